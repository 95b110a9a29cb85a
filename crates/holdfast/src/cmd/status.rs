//! `holdfast status`: every member's own view of every group it is in (role, leader, term, log indexes,
//! lag; with groups placed on some servers only, each group's voters), and what is wrong: members that
//! do not answer, and groups whose leader no quorum confirms.
//!
//! The members are learned from the first server that answers, so a partial `--endpoints` list shows
//! the whole cluster. Exit 0 when every member answered and every group has a leader confirmed by a
//! quorum (it can serve writes and linearizable reads now); 1 otherwise, each problem on its own line.

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
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also ask each server for each group's lock table digest (in `--json` as `digest`, in the table on
    /// a DIGEST line after each group's), to check that replicas at the same applied index agree. Costly on a large
    /// table: every server encodes its whole table under the group's state lock (~75 ms at 1M locks,
    /// during which it applies nothing). Needs the `admin` permission under an access policy.
    #[arg(long)]
    digest: bool,
}

/// One server's answer, or why there was none, in words.
async fn status_of(
    endpoint: &str,
    with_digest: bool,
    timeout: Duration,
    tls: Option<&holdfast_client::ClientTls>,
    token: Option<&str>,
) -> Result<StatusResponse, String> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{endpoint}"))
        .map_err(|e| e.to_string())?
        .connect_timeout(timeout.min(Duration::from_secs(1)))
        .timeout(timeout.min(Duration::from_secs(2)));
    let channel = holdfast_proto::transport::connect_lazy_tls(endpoint, tls.map(|t| t.connector()));
    let mut request = tonic::Request::new(StatusRequest { with_digest });
    if let Some(t) = token {
        let value = format!("Bearer {t}")
            .parse()
            .map_err(|_| "the token has characters a header cannot carry".to_string())?;
        request.metadata_mut().insert("authorization", value);
    }
    match HoldfastClient::new(channel).status(request).await {
        Ok(r) => Ok(r.into_inner()),
        Err(s) => Err(holdfast_client::client::describe_status(&s)),
    }
}

pub async fn run(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let timeout = args.conn.timeout;
    let mut answers: Vec<(String, Result<StatusResponse, String>)> = Vec::new();
    let tls = args.conn.tls.client_tls()?;
    for ep in args.conn.endpoint_list()? {
        let answer = status_of(
            &ep,
            args.digest,
            timeout,
            tls.as_ref(),
            args.conn.tls.auth_token.as_deref(),
        )
        .await;
        answers.push((ep, answer));
    }
    // Every member the cluster reports, so a partial endpoint list shows them all.
    if !args.conn.only_endpoints {
        let members: Vec<String> = answers
            .iter()
            .filter_map(|(_, a)| a.as_ref().ok())
            .flat_map(|s| s.members.iter().map(|m| m.client_endpoint.clone()))
            .collect();
        for ep in members {
            if !answers.iter().any(|(e, _)| *e == ep) {
                let answer = status_of(
                    &ep,
                    args.digest,
                    timeout,
                    tls.as_ref(),
                    args.conn.tls.auth_token.as_deref(),
                )
                .await;
                answers.push((ep, answer));
            }
        }
    }
    let node_of = |ep: &str| {
        answers
            .iter()
            .filter_map(|(_, a)| a.as_ref().ok())
            .flat_map(|s| s.members.iter())
            .find(|m| m.client_endpoint == ep)
            .map(|m| m.node_id)
    };
    let group_count = answers
        .iter()
        .filter_map(|(_, a)| a.as_ref().ok())
        .map(|s| s.group_count)
        .max()
        .unwrap_or(0);
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

    // Each group's members as its leader says (the highest term's), if one answered. With more than five
    // servers a group is on some of them only (`holdfast member place`).
    let mut members_of: std::collections::BTreeMap<u32, (u64, Vec<u64>, Vec<u64>)> =
        std::collections::BTreeMap::new();
    for g in answers
        .iter()
        .filter_map(|(_, a)| a.as_ref().ok())
        .flat_map(|s| s.groups.iter())
        .filter(|g| g.role == "leader")
    {
        if members_of
            .get(&g.group)
            .is_none_or(|(term, _, _)| *term < g.term)
        {
            members_of.insert(g.group, (g.term, g.voters.clone(), g.learners.clone()));
        }
    }
    // A server that is not in a group (as its leader says) has no row for it in the table.
    let in_group = |node: u64, group: u32| {
        members_of
            .get(&group)
            .is_none_or(|(_, v, l)| v.contains(&node) || l.contains(&node))
    };
    let placed = {
        let mut sets = members_of.values().map(|(_, v, _)| v);
        sets.next()
            .is_some_and(|first| sets.any(|other| other != first))
    };

    let mut problems = Vec::new();
    for (ep, a) in &answers {
        if let Err(e) = a {
            let node = node_of(ep).map_or("a server".to_string(), |n| format!("node {n}"));
            problems.push(format!("{node} at {ep} is unreachable: {e}"));
        }
    }
    let clusters: std::collections::BTreeSet<&str> = answers
        .iter()
        .filter_map(|(_, a)| a.as_ref().ok())
        .map(|s| s.cluster_id.as_str())
        .collect();
    if clusters.len() > 1 {
        problems.push(format!(
            "servers belong to different clusters ({}): they refuse each other's messages",
            clusters.iter().copied().collect::<Vec<_>>().join(", ")
        ));
    }
    // A table near its budget refuses opens and acquires soon: say so before it does.
    let mut near_full = std::collections::BTreeSet::new();
    for g in answers
        .iter()
        .filter_map(|(_, a)| a.as_ref().ok())
        .flat_map(|s| s.groups.iter())
    {
        if g.table_budget > 0
            && g.table_bytes >= g.table_budget / 10 * 9
            && near_full.insert(g.group)
        {
            problems.push(format!(
                "group {}'s lock table is at {}% of its memory budget ({} of {} bytes): past it opens and acquires are refused (max_table_bytes); raise --table-budget-mib or free locks",
                g.group,
                g.table_bytes * 100 / g.table_budget,
                g.table_bytes,
                g.table_budget
            ));
        }
    }
    for group in 0..group_count {
        let views: Vec<_> = answers
            .iter()
            .filter_map(|(_, a)| a.as_ref().ok())
            .flat_map(|s| {
                s.groups
                    .iter()
                    .filter(|g| g.group == group)
                    .map(move |g| (s.node_id, g))
            })
            .collect();
        if views
            .iter()
            .any(|(_, g)| g.role == "leader" && g.leader_confirmed)
        {
            continue;
        }
        let named: std::collections::BTreeSet<u64> = views
            .iter()
            .map(|(_, g)| g.leader_id)
            .filter(|&l| l != 0)
            .collect();
        let why = match named.iter().next() {
            None => "no server knows a leader (an election is under way, or no quorum is up)"
                .to_string(),
            Some(l) => match views.iter().find(|(n, _)| n == l) {
                Some(_) => format!("node {l} says it leads but no quorum acknowledged it recently"),
                None => format!("servers name node {l}, which does not answer"),
            },
        };
        problems.push(format!(
            "group {group} has no leader confirmed by a quorum: {why}"
        ));
    }

    if args.json {
        let servers: Vec<_> = answers
            .iter()
            .map(|(ep, a)| match a {
                Ok(s) => json!({
                    "endpoint": ep, "node_id": s.node_id, "cluster_id": s.cluster_id, "group_count": s.group_count,
                    "groups": s.groups.iter().map(|g| { let mut v = json!({
                        "group": g.group, "role": g.role, "term": g.term, "leader_id": g.leader_id,
                        "leader_endpoint": g.leader_endpoint, "leader_confirmed": g.leader_confirmed,
                        "last_log_index": g.last_log_index,
                        "committed_index": g.committed_index, "applied_index": g.applied_index,
                        "snapshot_index": g.snapshot_index, "purged_index": g.purged_index, "lag": leader_last(g.group).map(|l| l.saturating_sub(g.applied_index)),
                        "sessions": g.sessions, "locks": g.locks, "waiters": g.waiters,
                        "table_bytes": g.table_bytes, "table_budget": g.table_budget,
                        "voters": g.voters, "learners": g.learners, "unloaded": g.unloaded,
                    });
                    if args.digest {
                        v["digest"] = json!(format!("{:016x}", g.digest));
                    }
                    v }).collect::<Vec<_>>(),
                    "members": s.members.iter().map(|m| json!({"node_id": m.node_id, "client": m.client_endpoint, "peer": m.peer_endpoint})).collect::<Vec<_>>(),
                }),
                Err(e) => json!({"endpoint": ep, "node_id": node_of(ep), "error": e}),
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&servers)?);
    } else {
        if let [only] = clusters.iter().collect::<Vec<_>>()[..] {
            println!("cluster {only}");
        }
        println!(
            "{:<5} {:<21} {:>5} {:<9} {:>5} {:>6} {:>9} {:>9} {:>9} {:>6} {:>8} {:>7} {:>13}",
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
            "LOCKS",
            "TABLE-MIB"
        );
        for (ep, a) in &answers {
            match a {
                Ok(s) => {
                    for g in s.groups.iter().filter(|g| in_group(s.node_id, g.group)) {
                        let lag = leader_last(g.group).map_or("?".to_string(), |l| {
                            l.saturating_sub(g.applied_index).to_string()
                        });
                        let leader = if g.leader_id == 0 {
                            "-".to_string()
                        } else {
                            g.leader_id.to_string()
                        };
                        // A leader without a recent quorum is marked: it cannot serve anything.
                        let role = if g.role == "leader" && !g.leader_confirmed {
                            "leader?"
                        } else {
                            g.role.as_str()
                        };
                        println!(
                            "{:<5} {:<21} {:>5} {:<9} {:>5} {:>6} {:>9} {:>9} {:>9} {:>6} {:>8} {:>7} {:>13}",
                            s.node_id, ep, g.group, role, g.term, leader, g.last_log_index, g.committed_index, g.applied_index, lag, g.sessions, g.locks,
                            table_mib(g.table_bytes, g.table_budget)
                        );
                        if args.digest {
                            println!(
                                "{:<5} {:<21} {:>5} DIGEST {:016x}",
                                s.node_id, ep, g.group, g.digest
                            );
                        }
                    }
                }
                Err(_) => {
                    let node = node_of(ep).map_or("?".to_string(), |n| n.to_string());
                    println!("{node:<5} {ep:<21} unreachable");
                }
            }
        }
        if placed {
            let list: Vec<String> = members_of
                .iter()
                .map(|(g, (_, v, _))| {
                    let ids: Vec<String> = v.iter().map(u64::to_string).collect();
                    format!("{g}: {}", ids.join(" "))
                })
                .collect();
            println!("voters per group: {}", list.join(", "));
        }
        // With several groups, how the leaderships are spread (as the leaders themselves say).
        let mut leads: std::collections::BTreeMap<u64, Vec<u32>> =
            std::collections::BTreeMap::new();
        let mut groups = 0;
        for (_, a) in &answers {
            if let Ok(s) = a {
                leads.entry(s.node_id).or_default();
                groups = groups.max(s.groups.len());
                for g in s.groups.iter().filter(|g| g.role == "leader") {
                    leads.entry(s.node_id).or_default().push(g.group);
                }
            }
        }
        if groups > 1 {
            let spread: Vec<String> = leads
                .iter()
                .map(|(node, gs)| {
                    let list: Vec<String> = gs.iter().map(u32::to_string).collect();
                    format!(
                        "node {node}: {} ({})",
                        gs.len(),
                        if list.is_empty() {
                            "-".into()
                        } else {
                            list.join(" ")
                        }
                    )
                })
                .collect();
            println!("leaders per node: {}", spread.join(", "));
        }
    }
    if answers.iter().all(|(_, a)| a.is_err()) {
        for p in &problems {
            eprintln!("error: {p}");
        }
        eprintln!("error: no server answered at {}", args.conn.endpoints);
        return Ok(ExitCode::FAILURE);
    }
    for p in &problems {
        eprintln!("problem: {p}");
    }
    Ok(if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// A table's charge and budget in MiB ("0.3/1024"; "0.3/-" without a budget).
fn table_mib(bytes: u64, budget: u64) -> String {
    let used = bytes as f64 / f64::from(1 << 20);
    if budget == 0 {
        format!("{used:.1}/-")
    } else {
        format!("{used:.1}/{}", budget >> 20)
    }
}
