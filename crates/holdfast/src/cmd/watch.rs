//! `holdfast watch [PREFIX]`: print every change of the locks whose names start with PREFIX (all locks
//! without one) as it happens: granted, released, expired, queued, cancelled, each with its group and
//! log index. Follows leader changes without missing or repeating an event (see docs/api.md, "Watches").

use super::{show_bytes, Conn};
use clap::Args;
use holdfast_client::EventKind;
use serde_json::json;
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct WatchArgs {
    /// Name prefix (every lock if omitted).
    #[arg(default_value = "")]
    prefix: String,
    /// Stop after this many events (0: until Ctrl-C).
    #[arg(long, default_value_t = 0)]
    count: u64,
    #[command(flatten)]
    conn: Conn,
    /// Print one JSON object per event instead of a line of text.
    #[arg(long)]
    json: bool,
}

/// The event kind's name, as `--json` prints it (and the fault workload records it).
pub fn kind(k: EventKind) -> String {
    match k {
        EventKind::Granted => "granted".into(),
        EventKind::Released => "released".into(),
        EventKind::Expired => "expired".into(),
        EventKind::Queued => "queued".into(),
        EventKind::Cancelled => "cancelled".into(),
        EventKind::Delayed => "delayed".into(),
        EventKind::DelayEnded => "delay-ended".into(),
        EventKind::Unknown(n) => format!("unknown({n})"),
    }
}

pub async fn run(args: WatchArgs) -> anyhow::Result<ExitCode> {
    let client = args.conn.connect().await?;
    let mut watch = client.watch(&args.prefix).await?;
    // Said on stderr so that stdout is only events: a script knows from here that it misses nothing.
    eprintln!("watching {:?} (Ctrl-C stops)", args.prefix);
    let mut seen = 0u64;
    while args.count == 0 || seen < args.count {
        let event = tokio::select! {
            e = watch.next() => e?,
            _ = tokio::signal::ctrl_c() => break,
        };
        seen += 1;
        if args.json {
            let mut v = json!({
                "group": event.group,
                "index": event.index,
                "kind": kind(event.kind),
                "name": event.name,
                "session": event.session,
            });
            if event.token != 0 {
                v["token"] = json!(event.token);
            }
            if !event.value.is_empty() {
                v["value"] = json!(show_bytes(&event.value));
            }
            println!("{v}");
        } else {
            let mut line = format!(
                "{}/{} {} {:?} session {}",
                event.group,
                event.index,
                kind(event.kind),
                event.name,
                event.session
            );
            if event.token != 0 {
                line += &format!(" token {}", event.token);
            }
            if !event.value.is_empty() {
                line += &format!(" value {}", show_bytes(&event.value));
            }
            println!("{line}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
