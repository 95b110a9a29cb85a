//! One module per subcommand, plus what the client commands share: how to reach the cluster, how to
//! print, and how to signal a child process.

pub mod bench;
pub mod certs;
pub mod describe;
pub mod dev;
pub mod duration;
pub mod elect;
pub mod fence;
pub mod fence_store;
pub mod leader;
pub mod lock;
pub mod locks;
pub mod member;
pub mod plot;
pub mod server;
pub mod sessions;
pub mod snapshot;
pub mod status;
pub mod watch;
pub mod workload;

use anyhow::Context;
use clap::Args;
use holdfast_client::{Client, ClientOptions};

/// The dev cluster's client endpoints (`holdfast dev`).
pub const DEV_ENDPOINTS: &str =
    "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003,127.0.0.1:7004,127.0.0.1:7005";

/// How client commands reach the cluster.
#[derive(Args, Debug, Clone)]
pub struct Conn {
    /// Client endpoints (host:port), comma-separated; one reachable server is enough, the others are
    /// learned from it (default: the dev cluster).
    #[arg(long, env = "HOLDFAST_ENDPOINTS", default_value = DEV_ENDPOINTS)]
    pub endpoints: String,
    /// Give up a request (including finding the cluster) after this long, retries included.
    #[arg(long, env = "HOLDFAST_TIMEOUT", default_value = "15s", value_parser = duration::parse_duration)]
    pub timeout: std::time::Duration,
    /// Use only the endpoints given: do not learn the members' advertised addresses or follow
    /// redirects to them (for a cluster reached through a proxy or NAT).
    #[arg(long, env = "HOLDFAST_ONLY_ENDPOINTS", value_parser = clap::builder::BoolishValueParser::new())]
    pub only_endpoints: bool,
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// How a client command connects over TLS (a cluster started with `[tls]` or `holdfast dev --tls`), and
/// who it says it is.
#[derive(Args, Clone, Default)]
pub struct TlsArgs {
    /// The cluster CA (PEM): connect over TLS and verify the servers' certificates against it.
    #[arg(long, env = "HOLDFAST_CA", global = true)]
    pub ca: Option<std::path::PathBuf>,
    /// This client's certificate (PEM), for a cluster that wants one; its common name is the principal.
    #[arg(long, env = "HOLDFAST_CERT", global = true, requires = "key")]
    pub cert: Option<std::path::PathBuf>,
    /// The key of --cert (PEM).
    #[arg(long, env = "HOLDFAST_KEY", global = true, requires = "cert")]
    pub key: Option<std::path::PathBuf>,
    /// Verify the servers' certificates for this name instead of the endpoint's host.
    #[arg(long, env = "HOLDFAST_TLS_SERVER_NAME", global = true)]
    pub tls_server_name: Option<String>,
    /// A bearer token the cluster's access policy lists (`holdfast certs token` makes one): act as its
    /// principal. Prefer the environment variable: a flag shows in `ps`.
    #[arg(
        long,
        env = "HOLDFAST_AUTH_TOKEN",
        global = true,
        hide_env_values = true
    )]
    pub auth_token: Option<String>,
}

/// Every field but the token, which must not reach a log.
impl std::fmt::Debug for TlsArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsArgs")
            .field("ca", &self.ca)
            .field("cert", &self.cert)
            .field("key", &self.key)
            .field("tls_server_name", &self.tls_server_name)
            .field(
                "auth_token",
                &self.auth_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

impl TlsArgs {
    /// None: plaintext.
    pub fn client_tls(&self) -> anyhow::Result<Option<holdfast_client::ClientTls>> {
        let Some(ca) = &self.ca else {
            if self.cert.is_some() {
                anyhow::bail!(
                    "--cert needs --ca (HOLDFAST_CA): the CA the servers' certificates chain to"
                );
            }
            return Ok(None);
        };
        let identity = self.cert.as_ref().zip(self.key.as_ref());
        let tls = holdfast_client::ClientTls::from_files(ca, identity)?;
        Ok(Some(match &self.tls_server_name {
            Some(name) => tls.with_server_name(name),
            None => tls,
        }))
    }
}

impl Conn {
    /// The endpoints given, each checked to be `host:port`.
    pub fn endpoint_list(&self) -> anyhow::Result<Vec<String>> {
        let list: Vec<String> = self
            .endpoints
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        if list.is_empty() {
            anyhow::bail!("no endpoints given (--endpoints or HOLDFAST_ENDPOINTS)");
        }
        for ep in &list {
            holdfast_client::client::check_endpoint(ep)?;
        }
        Ok(list)
    }

    pub fn options(&self) -> anyhow::Result<ClientOptions> {
        Ok(ClientOptions {
            request_timeout: self.timeout,
            attempt_timeout: self.timeout.min(ClientOptions::default().attempt_timeout),
            discover: !self.only_endpoints,
            tls: self.tls.client_tls()?,
            token: self.tls.auth_token.clone(),
            ..ClientOptions::default()
        })
    }

    /// Connects, saying on a terminal what it is waiting for when the cluster does not answer at once.
    pub async fn connect(&self) -> anyhow::Result<Client> {
        use std::io::IsTerminal;
        let endpoints = self.endpoint_list()?;
        let connecting = Client::connect_with(endpoints, self.options()?);
        tokio::pin!(connecting);
        let waited = tokio::select! {
            r = &mut connecting => Some(r),
            _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => None,
        };
        let result = match waited {
            Some(r) => r,
            None => {
                if std::io::stderr().is_terminal() {
                    eprintln!(
                        "holdfast: no answer yet from {}; trying for up to {} (--timeout)",
                        self.endpoints,
                        duration::show(self.timeout)
                    );
                }
                connecting.await
            }
        };
        result.with_context(|| format!("cannot reach the cluster at {}", self.endpoints))
    }
}

/// Milliseconds as a short human duration.
/// The view of the first server that answers `Status` (any server: the view is not linearizable).
pub async fn any_status(client: &Client) -> anyhow::Result<holdfast_proto::v1::StatusResponse> {
    let mut last = None;
    for i in 0..client.endpoints().len() {
        match client.status_of(i).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    anyhow::bail!(
        "no server answered: {}",
        last.map_or(String::new(), |e| e.to_string())
    )
}

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

/// Whether this process inherited `sig` as ignored (SIG_IGN: `nohup`, a script's background job).
#[allow(
    unsafe_code,
    reason = "sigaction(2) with no new action only reads the current one into a local struct"
)]
pub fn inherited_ignored(sig: libc::c_int) -> bool {
    // SAFETY: a zeroed sigaction is a valid out-parameter; a null new action changes nothing.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_IGN
    }
}

/// Whether any process of group `group` is left (zombies included).
#[allow(
    unsafe_code,
    reason = "kill(2) with signal 0 only checks that the group exists"
)]
pub fn group_alive(group: u32) -> bool {
    // SAFETY: kill(2) has no memory-safety preconditions; signal 0 sends nothing.
    group > 1 && unsafe { libc::kill(-(group as libc::pid_t), 0) } == 0
}

/// Sends `signal` to every process of process group `group` (a child started as its group's leader).
#[allow(
    unsafe_code,
    reason = "libc::kill on the process group of a child this process spawned and still owns"
)]
pub fn signal_group(group: u32, signal: libc::c_int) {
    // Never 0 or 1 (kill(0) and kill(-1) would reach this process's own group, or everything).
    if group <= 1 {
        return;
    }
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(-(group as libc::pid_t), signal);
    }
}

/// Lets a command whose output is read through a pipe end quietly when the reader goes away, as other
/// Unix tools do (`holdfast status | head`): Rust starts with SIGPIPE ignored, so a print to a closed
/// pipe panicked with a backtrace. Only for the commands that print what they read from the cluster;
/// servers keep ignoring it.
#[allow(
    unsafe_code,
    reason = "signal(2) restoring SIGPIPE's default action, before any thread is started"
)]
pub fn default_sigpipe() {
    // SAFETY: signal(2) with SIG_DFL has no memory-safety preconditions; called first thing in main.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
