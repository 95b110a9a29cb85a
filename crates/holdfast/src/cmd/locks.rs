//! `holdfast locks [PREFIX]`: held locks, by name.

use super::{ago, human_ms, show_bytes, Conn};
use clap::Args;
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct LocksArgs {
    /// Only locks whose names start with this.
    #[arg(default_value = "")]
    prefix: String,
    #[command(flatten)]
    conn: Conn,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: LocksArgs) -> anyhow::Result<ExitCode> {
    let client = args.conn.connect().await?;
    let locks = client.list_locks(&args.prefix).await?;
    if args.json {
        let out: Vec<_> = locks.iter().map(super::describe::lock_json).collect();
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<40} {:>10} {:>10} {:>9} {:>7} {:<14} VALUE",
        "NAME", "TOKEN", "HOLDER", "TTL-LEFT", "WAITERS", "GRANTED"
    );
    for l in &locks {
        println!(
            "{:<40} {:>10} {:>10} {:>9} {:>7} {:<14} {}",
            l.name,
            l.token,
            if l.holders.len() > 1 || l.permits > 0 {
                super::describe::mode(l)
            } else if l.delayed {
                "delayed".to_string()
            } else {
                l.holder_session_id.to_string()
            },
            human_ms(l.holder_ttl_remaining_ms),
            l.waiters.len(),
            ago(l.granted_at_ms),
            show_bytes(&l.holder_value)
        );
    }
    eprintln!("{} lock(s)", locks.len());
    Ok(ExitCode::SUCCESS)
}
