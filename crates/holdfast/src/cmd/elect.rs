//! `holdfast elect ROLE [VALUE]`: campaign for ROLE and hold leadership until Ctrl-C (then resign);
//! `holdfast elect --observe ROLE`: print each change of ROLE's leader. The leader's epoch is its fencing
//! token: strictly increasing across leaders.

use super::{show_bytes, Conn};
use anyhow::bail;
use clap::Args;
use serde_json::json;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ElectArgs {
    /// The role (a lock name).
    role: String,
    /// What observers see as the leader (e.g. this process's address).
    value: Option<String>,
    /// Follow the role's leader instead of campaigning.
    #[arg(long)]
    observe: bool,
    /// Session TTL while campaigning and leading (2s to 5m; 250ms, 10s, 2m, a bare number is seconds).
    #[arg(long, default_value = "10s", value_parser = super::duration::parse_ttl)]
    ttl: Duration,
    #[command(flatten)]
    conn: Conn,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: ElectArgs) -> anyhow::Result<ExitCode> {
    let client = args.conn.connect().await?;
    if args.observe {
        let mut observer = client.observe(&args.role);
        loop {
            tokio::select! {
                leader = observer.next() => {
                    let leader = leader?;
                    if args.json {
                        let v = leader.as_ref().map(|l| json!({"value": show_bytes(&l.value), "epoch": l.epoch, "session": l.session}));
                        println!("{}", json!({"role": args.role, "leader": v}));
                    } else {
                        match leader {
                            Some(l) => println!("{}: {} (epoch {}, session {})", args.role, show_bytes(&l.value), l.epoch, l.session),
                            None => println!("{}: no leader", args.role),
                        }
                    }
                }
                _ = tokio::signal::ctrl_c() => return Ok(ExitCode::SUCCESS),
            }
        }
    }
    let value = args
        .value
        .clone()
        .unwrap_or_else(|| format!("pid {}", std::process::id()));
    let session = client.open_session(args.ttl).await?;
    eprintln!("campaigning for {:?} as {value:?}", args.role);
    let leadership = tokio::select! {
        l = session.campaign(&args.role, value.as_bytes()) => l?,
        _ = tokio::signal::ctrl_c() => {
            let _ = session.close().await;
            return Ok(ExitCode::SUCCESS);
        }
    };
    if args.json {
        println!(
            "{}",
            json!({"role": args.role, "elected": true, "epoch": leadership.epoch(), "value": value})
        );
    } else {
        println!(
            "elected {:?}: epoch {} (Ctrl-C resigns)",
            args.role,
            leadership.epoch()
        );
    }
    tokio::select! {
        lost = leadership.lost() => {
            bail!("leadership of {:?} may be lost: {}", args.role, lost.0);
        }
        _ = tokio::signal::ctrl_c() => {
            leadership.resign().await?;
            session.close().await?;
            eprintln!("resigned {:?}", args.role);
        }
    }
    Ok(ExitCode::SUCCESS)
}
