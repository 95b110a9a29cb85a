//! `holdfast member list|add|remove|place`: the servers of each Raft group, and changes to them through
//! openraft's joint consensus (see docs/operations.md, "Membership changes" and "More than five
//! servers").

use super::Conn;
use clap::{Args, Subcommand};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct MemberArgs {
    #[command(subcommand)]
    action: MemberAction,
}

#[derive(Subcommand, Debug)]
enum MemberAction {
    /// The members as a server sees them: voters (of some group, and which), learners, and configured
    /// servers that are in no group.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conn: Conn,
    },
    /// Add a running server (started with --join and --cluster-id) to every group: as a learner, then
    /// as a voter once it has caught up.
    Add {
        node_id: u64,
        /// Where clients reach it (host:port).
        #[arg(long)]
        client: String,
        /// Where peers reach it (host:port).
        #[arg(long)]
        peer: String,
        /// Only this group.
        #[arg(long)]
        group: Option<u32>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Remove a server from every group. Refused when fewer than 3 voters would remain, unless --force.
    /// Stop the removed server afterwards.
    Remove {
        node_id: u64,
        /// Allow leaving fewer than 3 voters.
        #[arg(long)]
        force: bool,
        /// Only this group.
        #[arg(long)]
        group: Option<u32>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Place each group on `--replicas` of the servers, evenly: as few voters move as possible, each
    /// added before one is removed. For clusters of more than five servers (docs/operations.md,
    /// "More than five servers").
    Place {
        /// Voters per group: 3 survives one failure, 5 two.
        #[arg(long)]
        replicas: usize,
        /// A server to place groups on that is not yet a voter of any (started with --join), as
        /// ID=CLIENT_HOST:PORT/PEER_HOST:PORT. Repeatable.
        #[arg(long = "with", value_name = "ID=CLIENT/PEER")]
        with: Vec<String>,
        /// A server to take out of every group (before removing it from the cluster). Repeatable.
        #[arg(long = "without", value_name = "ID")]
        without: Vec<u64>,
        /// Print the plan only.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        conn: Conn,
    },
}

fn groups(client: &holdfast_client::Client, group: Option<u32>) -> anyhow::Result<Vec<u32>> {
    match group {
        Some(g) if g < client.groups() => Ok(vec![g]),
        Some(g) => anyhow::bail!(
            "group {g} does not exist (the cluster has {} groups)",
            client.groups()
        ),
        None => Ok((0..client.groups()).collect()),
    }
}

fn print(g: u32, m: &holdfast_proto::v1::MembershipResponse) {
    println!(
        "group {g}: voters {:?}, learners {:?}",
        m.voters, m.learners
    );
}

pub async fn run(args: MemberArgs) -> anyhow::Result<ExitCode> {
    match args.action {
        MemberAction::List { json, conn } => {
            let client = conn.connect().await?;
            let s = super::any_status(&client).await?;
            if json {
                let members: Vec<_> = s
                    .members
                    .iter()
                    .map(|m| json!({"node_id": m.node_id, "role": m.role, "client": m.client_endpoint, "peer": m.peer_endpoint, "voter_of": m.voter_of}))
                    .collect();
                println!("{}", serde_json::to_string_pretty(&members)?);
            } else {
                println!(
                    "{:<5} {:<10} {:<21} {:<21} VOTER OF GROUPS",
                    "NODE", "ROLE", "CLIENT", "PEER"
                );
                for m in &s.members {
                    let groups: Vec<String> = m.voter_of.iter().map(u32::to_string).collect();
                    println!(
                        "{:<5} {:<10} {:<21} {:<21} {}",
                        m.node_id,
                        m.role,
                        m.client_endpoint,
                        m.peer_endpoint,
                        groups.join(",")
                    );
                }
            }
        }
        MemberAction::Add {
            node_id,
            client: client_ep,
            peer,
            group,
            conn,
        } => {
            holdfast_client::client::check_endpoint(&client_ep)?;
            holdfast_client::client::check_endpoint(&peer)?;
            let client = conn.connect().await?;
            for g in groups(&client, group)? {
                print(g, &client.add_member(g, node_id, &client_ep, &peer).await?);
            }
        }
        MemberAction::Remove {
            node_id,
            force,
            group,
            conn,
        } => {
            let client = conn.connect().await?;
            for g in groups(&client, group)? {
                print(g, &client.remove_member(g, node_id, force).await?);
            }
        }
        MemberAction::Place {
            replicas,
            with,
            without,
            dry_run,
            conn,
        } => {
            let client = conn.connect().await?;
            place(&client, replicas, &with, &without, dry_run).await?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `member place`: reads each group's voters from its leader, plans with
/// `holdfast_client::placement::plan`, and carries the plan out one group at a time.
async fn place(
    client: &holdfast_client::Client,
    replicas: usize,
    with: &[String],
    without: &[u64],
    dry_run: bool,
) -> anyhow::Result<()> {
    // Every server's view: a group's voters come from the server that leads it (in the highest term).
    let mut addresses: BTreeMap<u64, (String, String)> = BTreeMap::new();
    let mut views: BTreeMap<u32, (u64, Vec<u64>)> = BTreeMap::new();
    let mut unreachable = Vec::new();
    for i in 0..client.endpoints().len() {
        let s = match client.status_of(i).await {
            Ok(s) => s,
            Err(e) => {
                unreachable.push(e.to_string());
                continue;
            }
        };
        for m in &s.members {
            if m.role == "voter" {
                addresses
                    .entry(m.node_id)
                    .or_insert((m.client_endpoint.clone(), m.peer_endpoint.clone()));
            }
        }
        for g in &s.groups {
            if g.role == "leader" && views.get(&g.group).is_none_or(|(term, _)| *term < g.term) {
                views.insert(g.group, (g.term, g.voters.clone()));
            }
        }
    }
    for w in with {
        let (id, rest) = w.split_once('=').ok_or_else(|| {
            anyhow::anyhow!("--with {w}: give ID=CLIENT_HOST:PORT/PEER_HOST:PORT")
        })?;
        let id: u64 = id
            .parse()
            .map_err(|_| anyhow::anyhow!("--with {w}: {id:?} is not a node id"))?;
        let (client_ep, peer) = rest.split_once('/').ok_or_else(|| {
            anyhow::anyhow!("--with {w}: give ID=CLIENT_HOST:PORT/PEER_HOST:PORT")
        })?;
        holdfast_client::client::check_endpoint(client_ep)?;
        holdfast_client::client::check_endpoint(peer)?;
        addresses.insert(id, (client_ep.to_string(), peer.to_string()));
    }
    let mut current = Vec::new();
    for g in 0..client.groups() {
        match views.remove(&g) {
            Some((_, voters)) => current.push(voters.into_iter().collect::<BTreeSet<u64>>()),
            None => anyhow::bail!(
                "no server says it leads group {g}, so its voters are not known; retry when `holdfast status` shows a leader for every group{}",
                if unreachable.is_empty() {
                    String::new()
                } else {
                    format!(" (unreachable: {})", unreachable.join("; "))
                }
            ),
        }
    }
    for id in without {
        if addresses.remove(id).is_none() {
            anyhow::bail!("--without {id}: node {id} is not a voter of any group");
        }
    }
    let servers: BTreeSet<u64> = addresses.keys().copied().collect();
    let target = holdfast_client::placement::plan(&current, &servers, replicas)
        .map_err(|e| anyhow::anyhow!(e))?;
    let mut changes = 0;
    for (g, (now, then)) in current.iter().zip(&target).enumerate() {
        if now == then {
            println!("group {g}: voters {now:?}, unchanged");
            continue;
        }
        changes += 1;
        println!("group {g}: voters {now:?} -> {then:?}");
        if dry_run {
            continue;
        }
        let g = g as u32;
        // Adds before removals, so the group never has fewer voters than before.
        for id in then.difference(now) {
            let (client_ep, peer) = &addresses[id];
            print(g, &client.add_member(g, *id, client_ep, peer).await?);
        }
        for id in now.difference(then) {
            print(g, &client.remove_member(g, *id, false).await?);
        }
    }
    let mut load: BTreeMap<u64, usize> = servers.iter().map(|&s| (s, 0)).collect();
    for v in target.iter().flatten() {
        *load.entry(*v).or_default() += 1;
    }
    let per_server: Vec<String> = load.iter().map(|(s, n)| format!("{s}:{n}")).collect();
    println!(
        "{} {changes} of {} groups; voter of how many groups, per node: {}",
        if dry_run { "would change" } else { "changed" },
        target.len(),
        per_server.join(" ")
    );
    Ok(())
}
