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
    /// Every known server: voters (of which groups, as each group's leader says), learners, configured
    /// servers in no group, and "none" for a server no group's leader names.
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
            list(&client, json).await?;
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

/// Every group's members as its leader says (in the highest term, if two say so), and every server's
/// addresses, from the status of every server the client knows.
struct ClusterView {
    addresses: BTreeMap<u64, (String, String)>,
    /// Per group: its leader's view.
    groups: BTreeMap<u32, holdfast_proto::v1::GroupStatus>,
    /// What the servers that did not answer said.
    unreachable: Vec<String>,
    /// The roles the servers reported, for the nodes no leader names: "configured" if any server's
    /// configuration lists the node, else the first other role reported.
    reported: BTreeMap<u64, String>,
}

impl ClusterView {
    async fn gather(client: &holdfast_client::Client) -> ClusterView {
        let mut view = ClusterView {
            addresses: BTreeMap::new(),
            groups: BTreeMap::new(),
            unreachable: Vec::new(),
            reported: BTreeMap::new(),
        };
        for i in 0..client.endpoints().len() {
            let s = match client.status_of(i).await {
                Ok(s) => s,
                Err(e) => {
                    view.unreachable.push(e.to_string());
                    continue;
                }
            };
            for m in &s.members {
                view.addresses
                    .entry(m.node_id)
                    .or_insert((m.client_endpoint.clone(), m.peer_endpoint.clone()));
                // A server whose configuration lists the node says "configured"; that stands over
                // what another (lagging behind a removal, say) still calls it.
                if m.role == "configured" {
                    view.reported.insert(m.node_id, m.role.clone());
                } else {
                    view.reported.entry(m.node_id).or_insert(m.role.clone());
                }
            }
            for g in s.groups {
                if g.role == "leader"
                    && view
                        .groups
                        .get(&g.group)
                        .is_none_or(|known| known.term < g.term)
                {
                    view.groups.insert(g.group, g);
                }
            }
        }
        view
    }
}

/// `member list`: every known server, with its role and the groups it is a voter of as each group's
/// leader says.
async fn list(client: &holdfast_client::Client, json: bool) -> anyhow::Result<()> {
    let view = ClusterView::gather(client).await;
    if view.addresses.is_empty() {
        anyhow::bail!("no server answered: {}", view.unreachable.join("; "));
    }
    let mut rows: Vec<serde_json::Value> = view
        .addresses
        .iter()
        .map(|(id, (client_ep, peer))| {
            let voter_of: Vec<u32> = view
                .groups
                .values()
                .filter(|g| g.voters.contains(id))
                .map(|g| g.group)
                .collect();
            let role = if !voter_of.is_empty() {
                "voter"
            } else if view.groups.values().any(|g| g.learners.contains(id)) {
                "learner"
            } else if view.reported.get(id).map(String::as_str) == Some("configured") {
                "configured"
            } else {
                "none"
            };
            json!({"node_id": id, "role": role, "client": client_ep, "peer": peer, "voter_of": voter_of})
        })
        .collect();
    rows.sort_by_key(|m| (m["role"] != "voter", m["node_id"].as_u64()));
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!(
            "{:<5} {:<10} {:<21} {:<21} VOTER OF GROUPS",
            "NODE", "ROLE", "CLIENT", "PEER"
        );
        let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
        for m in &rows {
            let groups: Vec<String> = m["voter_of"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|g| g.to_string())
                .collect();
            println!(
                "{:<5} {:<10} {:<21} {:<21} {}",
                m["node_id"].as_u64().unwrap_or_default(),
                text(&m["role"]),
                text(&m["client"]),
                text(&m["peer"]),
                groups.join(",")
            );
        }
    }
    for g in 0..client.groups() {
        if !view.groups.contains_key(&g) {
            eprintln!("note: no server says it leads group {g}; its members are not shown");
        }
    }
    Ok(())
}

/// `member place`: reads each group's voters from its leader, plans with
/// `holdfast_client::placement::plan`, and carries the plan out one group at a time.
pub async fn place(
    client: &holdfast_client::Client,
    replicas: usize,
    with: &[String],
    without: &[u64],
    dry_run: bool,
) -> anyhow::Result<()> {
    let view = ClusterView::gather(client).await;
    let mut addresses = view.addresses.clone();
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
        match view.groups.get(&g) {
            Some(led) => current.push(led.voters.iter().copied().collect::<BTreeSet<u64>>()),
            None => anyhow::bail!(
                "no server says it leads group {g}, so its voters are not known; retry when `holdfast status` shows a leader for every group{}",
                if view.unreachable.is_empty() {
                    String::new()
                } else {
                    format!(" (unreachable: {})", view.unreachable.join("; "))
                }
            ),
        }
    }
    // The servers: every group's voters (as its leader says; a server's view of a group it is not in may
    // be stale), and the new ones.
    let mut servers: BTreeSet<u64> = current.iter().flatten().copied().collect();
    for w in with {
        servers.insert(
            w.split_once('=')
                .and_then(|(id, _)| id.parse().ok())
                .expect("checked above"),
        );
    }
    for id in without {
        if !servers.remove(id) {
            anyhow::bail!("--without {id}: node {id} is not a voter of any group");
        }
    }
    if let Some(id) = servers.iter().find(|id| !addresses.contains_key(id)) {
        anyhow::bail!("node {id} is a voter, but no server reported its addresses");
    }
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
