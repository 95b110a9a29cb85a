//! One module per subcommand, plus what the client commands share: how to reach the cluster, how to
//! print, and how to signal a child process.

pub mod bench;
pub mod describe;
pub mod dev;
pub mod duration;
pub mod elect;
pub mod fence;
pub mod fence_store;
pub mod lock;
pub mod locks;
pub mod server;
pub mod sessions;
pub mod status;
pub mod workload;

use anyhow::Context;
use clap::Args;
use holdfast_client::{Client, ClientOptions};

/// The dev cluster's client endpoints (`holdfast dev`).
pub const DEV_ENDPOINTS: &str =
    "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003,127.0.0.1:7004,127.0.0.1:7005";

/// How client commands reach the cluster and print.
#[derive(Args, Debug, Clone)]
pub struct Conn {
    /// Client endpoints, comma-separated (default: the dev cluster).
    #[arg(long, env = "HOLDFAST_ENDPOINTS", default_value = DEV_ENDPOINTS)]
    pub endpoints: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

impl Conn {
    pub fn endpoint_list(&self) -> Vec<String> {
        self.endpoints
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect()
    }

    pub async fn connect(&self) -> anyhow::Result<Client> {
        Client::connect_with(self.endpoint_list(), ClientOptions::default())
            .await
            .with_context(|| format!("cannot reach the cluster at {}", self.endpoints))
    }
}

/// Milliseconds as a short human duration.
pub fn human_ms(ms: u64) -> String {
    match ms {
        0..=999 => format!("{ms}ms"),
        1_000..=59_999 => format!("{:.1}s", ms as f64 / 1000.0),
        _ => format!("{}m{}s", ms / 60_000, (ms % 60_000) / 1000),
    }
}

/// How long ago a wall-clock time (ms since the epoch) was.
pub fn ago(at_ms: u64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    format!("{} ago", human_ms(now.saturating_sub(at_ms)))
}

/// Bytes as text if they are printable UTF-8, else hex.
pub fn show_bytes(b: &[u8]) -> String {
    match std::str::from_utf8(b) {
        Ok(s) if !s.chars().any(char::is_control) => s.to_string(),
        _ => b.iter().map(|x| format!("{x:02x}")).collect(),
    }
}

/// Sends `signal` to a child process this process started, by PID.
#[allow(
    unsafe_code,
    reason = "libc::kill on the PID of a child this process spawned and still owns"
)]
pub fn signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}
