//! `holdfast describe NAME`: one lock's holder, token and waiters (a linearizable read).

use super::{ago, human_ms, show_bytes, Conn};
use clap::Args;
use holdfast_proto::v1::LockInfo;
use serde_json::{json, Value};
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct DescribeArgs {
    name: String,
    #[command(flatten)]
    conn: Conn,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn lock_json(l: &LockInfo) -> Value {
    json!({
        "name": l.name, "free": false, "token": l.token, "holder_session_id": l.holder_session_id,
        "granted_at_ms": l.granted_at_ms, "holder_ttl_remaining_ms": l.holder_ttl_remaining_ms,
        "holder_value": show_bytes(&l.holder_value),
        "lock_delay_ms": l.lock_delay_ms, "delayed": l.delayed,
        "waiters": l.waiters.iter().map(|w| json!({"session_id": w.session_id, "enqueued_at_ms": w.enqueued_at_ms})).collect::<Vec<_>>(),
    })
}

pub async fn run(args: DescribeArgs) -> anyhow::Result<ExitCode> {
    let client = args.conn.connect().await?;
    let lock = client.describe(&args.name).await?;
    match (lock, args.json) {
        (Some(l), true) => println!("{}", serde_json::to_string_pretty(&lock_json(&l))?),
        (None, true) => println!("{}", json!({"name": args.name, "free": true})),
        (None, false) => println!("{} is free", args.name),
        (Some(l), false) => {
            println!("name:      {}", l.name);
            println!("token:     {}", l.token);
            if l.delayed {
                println!(
                    "holder:    none: in its lock-delay of {} since the holder's session expired {}",
                    human_ms(u64::from(l.lock_delay_ms)),
                    ago(l.granted_at_ms)
                );
            } else {
                println!(
                    "holder:    session {} (ttl left {})",
                    l.holder_session_id,
                    human_ms(l.holder_ttl_remaining_ms)
                );
                println!("granted:   {}", ago(l.granted_at_ms));
                if l.lock_delay_ms > 0 {
                    println!(
                        "delay:     {} lock-delay if the session expires",
                        human_ms(u64::from(l.lock_delay_ms))
                    );
                }
            }
            if !l.holder_value.is_empty() {
                println!("value:     {}", show_bytes(&l.holder_value));
            }
            println!("waiters:   {}", l.waiters.len());
            for (i, w) in l.waiters.iter().enumerate() {
                println!(
                    "  {:>3}. session {} (waiting since {})",
                    i + 1,
                    w.session_id,
                    ago(w.enqueued_at_ms)
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
