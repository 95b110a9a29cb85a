//! `holdfast sessions`: live sessions of every group.

use super::{ago, human_ms, Conn};
use clap::Args;
use serde_json::json;
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct SessionsArgs {
    #[command(flatten)]
    conn: Conn,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: SessionsArgs) -> anyhow::Result<ExitCode> {
    let client = args.conn.connect().await?;
    let sessions = client.list_sessions().await?;
    if args.json {
        let out: Vec<_> = sessions
            .iter()
            .map(|(g, s)| {
                json!({"group": g, "session_id": s.session_id, "ttl_ms": s.ttl_ms, "ttl_remaining_ms": s.ttl_remaining_ms,
                       "opened_at_ms": s.opened_at_ms, "locks_held": s.locks_held, "locks_waiting": s.locks_waiting})
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:>5} {:>12} {:>8} {:>9} {:>6} {:>7} OPENED",
        "GROUP", "SESSION", "TTL", "TTL-LEFT", "HELD", "WAITING"
    );
    for (g, s) in &sessions {
        println!(
            "{:>5} {:>12} {:>8} {:>9} {:>6} {:>7} {}",
            g,
            s.session_id,
            human_ms(s.ttl_ms),
            human_ms(s.ttl_remaining_ms),
            s.locks_held,
            s.locks_waiting,
            ago(s.opened_at_ms)
        );
    }
    eprintln!("{} session(s)", sessions.len());
    Ok(ExitCode::SUCCESS)
}
