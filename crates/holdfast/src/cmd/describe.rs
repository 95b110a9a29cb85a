//! `holdfast describe NAME`: one lock's holders, tokens and waiters (a linearizable read). A lock held
//! shared and a semaphore list every holder.

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
        "shared": l.holders.first().is_some_and(|h| h.shared), "permits": l.permits,
        "holders": l.holders.iter().map(|h| json!({
            "session_id": h.session_id, "token": h.token, "granted_at_ms": h.granted_at_ms,
            "ttl_remaining_ms": h.ttl_remaining_ms, "value": show_bytes(&h.value),
            "lock_delay_ms": h.lock_delay_ms, "delayed": h.delayed, "shared": h.shared,
        })).collect::<Vec<_>>(),
        "waiters": l.waiters.iter().map(|w| json!({"session_id": w.session_id, "enqueued_at_ms": w.enqueued_at_ms, "shared": w.shared})).collect::<Vec<_>>(),
    })
}

/// How a lock is held, for `describe` and `locks`: `exclusive`, `shared by N`, `K of N permits`.
pub fn mode(l: &LockInfo) -> String {
    if l.permits > 0 {
        format!("{} of {} permits", l.holders.len(), l.permits)
    } else if l.holders.first().is_some_and(|h| h.shared) {
        format!("shared by {}", l.holders.len())
    } else {
        "exclusive".into()
    }
}

fn print_holder(h: &holdfast_proto::v1::Holder) {
    if h.delayed {
        println!(
            "  token {}: none, in its lock-delay of {} since the holder's session expired {}",
            h.token,
            human_ms(u64::from(h.lock_delay_ms)),
            ago(h.granted_at_ms)
        );
    } else {
        println!(
            "  token {}: session {} (ttl left {}), granted {}{}",
            h.token,
            h.session_id,
            human_ms(h.ttl_remaining_ms),
            ago(h.granted_at_ms),
            if h.value.is_empty() {
                String::new()
            } else {
                format!(", value {}", show_bytes(&h.value))
            }
        );
    }
}

pub async fn run(args: DescribeArgs) -> anyhow::Result<ExitCode> {
    let client = args.conn.connect().await?;
    let lock = client.describe(&args.name).await?;
    match (lock, args.json) {
        (Some(l), true) => println!("{}", serde_json::to_string_pretty(&lock_json(&l))?),
        (None, true) => println!("{}", json!({"name": args.name, "free": true})),
        (None, false) => println!("{} is free", args.name),
        (Some(l), false)
            if l.permits > 0
                || l.holders.len() > 1
                || l.holders.first().is_some_and(|h| h.shared) =>
        {
            println!("name:      {}", l.name);
            println!("held:      {}", mode(&l));
            println!("holders:   {}", l.holders.len());
            for h in &l.holders {
                print_holder(h);
            }
            print_waiters(&l);
        }
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
            print_waiters(&l);
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn print_waiters(l: &LockInfo) {
    println!("waiters:   {}", l.waiters.len());
    for (i, w) in l.waiters.iter().enumerate() {
        println!(
            "  {:>3}. session {}{} (waiting since {})",
            i + 1,
            w.session_id,
            if w.shared { ", shared" } else { "" },
            ago(w.enqueued_at_ms)
        );
    }
}
