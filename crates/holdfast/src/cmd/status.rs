//! `holdfast status`: every server's own view of every group (role, leader, term, log indexes, lag).

use super::Conn;
use clap::Args;
use holdfast_proto::v1::holdfast_client::HoldfastClient;
use holdfast_proto::v1::{StatusRequest, StatusResponse};
use serde_json::json;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    conn: Conn,
}

async fn status_of(endpoint: &str, with_digest: bool) -> anyhow::Result<StatusResponse> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{endpoint}"))?
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(2))
        .connect()
        .await?;
    Ok(HoldfastClient::new(channel)
        .status(StatusRequest { with_digest })
        .await?
        .into_inner())
}

pub async fn run(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let endpoints = args.conn.endpoint_list();
    let mut answers = Vec::new();
    for ep in &endpoints {
        answers.push((ep.clone(), status_of(ep, args.conn.json).await));
    }
    // Lag: how far each server's applied index is behind the group leader's last log index.
    let leader_last = |group: u32| {
        answers
            .iter()
            .filter_map(|(_, a)| a.as_ref().ok())
            .flat_map(|s| s.groups.iter())
            .filter(|g| g.group == group && g.role == "leader")
            .map(|g| g.last_log_index)
            .max()
    };
    let reachable = answers.iter().filter(|(_, a)| a.is_ok()).count();
    if args.conn.json {
        let servers: Vec<_> = answers
            .iter()
            .map(|(ep, a)| match a {
                Ok(s) => json!({
                    "endpoint": ep, "node_id": s.node_id, "group_count": s.group_count,
                    "groups": s.groups.iter().map(|g| json!({
                        "group": g.group, "role": g.role, "term": g.term, "leader_id": g.leader_id,
                        "leader_endpoint": g.leader_endpoint, "last_log_index": g.last_log_index,
                        "committed_index": g.committed_index, "applied_index": g.applied_index,
                        "snapshot_index": g.snapshot_index, "lag": leader_last(g.group).map(|l| l.saturating_sub(g.applied_index)),
                        "sessions": g.sessions, "locks": g.locks, "waiters": g.waiters, "digest": format!("{:016x}", g.digest),
                    })).collect::<Vec<_>>(),
                    "members": s.members.iter().map(|m| json!({"node_id": m.node_id, "client": m.client_endpoint, "peer": m.peer_endpoint})).collect::<Vec<_>>(),
                }),
                Err(e) => json!({"endpoint": ep, "error": e.to_string()}),
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&servers)?);
    } else {
        println!(
            "{:<5} {:<21} {:>5} {:<9} {:>5} {:>6} {:>9} {:>9} {:>9} {:>6} {:>8} {:>7}",
            "NODE",
            "ENDPOINT",
            "GROUP",
            "ROLE",
            "TERM",
            "LEADER",
            "LAST-LOG",
            "COMMITTED",
            "APPLIED",
            "LAG",
            "SESSIONS",
            "LOCKS"
        );
        for (ep, a) in &answers {
            match a {
                Ok(s) => {
                    for g in &s.groups {
                        let lag = leader_last(g.group).map_or("?".to_string(), |l| {
                            l.saturating_sub(g.applied_index).to_string()
                        });
                        let leader = if g.leader_id == 0 {
                            "-".to_string()
                        } else {
                            g.leader_id.to_string()
                        };
                        println!(
                            "{:<5} {:<21} {:>5} {:<9} {:>5} {:>6} {:>9} {:>9} {:>9} {:>6} {:>8} {:>7}",
                            s.node_id, ep, g.group, g.role, g.term, leader, g.last_log_index, g.committed_index, g.applied_index, lag, g.sessions, g.locks
                        );
                    }
                }
                Err(e) => println!("{:<5} {:<21} unreachable: {e}", "?", ep),
            }
        }
    }
    if reachable == 0 {
        eprintln!("error: no server answered at {}", args.conn.endpoints);
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}
