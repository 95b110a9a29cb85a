//! `holdfast member list|add|remove`: the servers of each Raft group, and changes to them through
//! openraft's joint consensus (see docs/operations.md, "Membership changes").

use super::Conn;
use clap::{Args, Subcommand};
use serde_json::json;
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct MemberArgs {
    #[command(subcommand)]
    action: MemberAction,
}

#[derive(Subcommand, Debug)]
enum MemberAction {
    /// The members as a server sees them (group 0): voters, learners, and configured servers that are
    /// not members.
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
                    .map(|m| json!({"node_id": m.node_id, "role": m.role, "client": m.client_endpoint, "peer": m.peer_endpoint}))
                    .collect();
                println!("{}", serde_json::to_string_pretty(&members)?);
            } else {
                println!("{:<5} {:<10} {:<21} PEER", "NODE", "ROLE", "CLIENT");
                for m in &s.members {
                    println!(
                        "{:<5} {:<10} {:<21} {}",
                        m.node_id, m.role, m.client_endpoint, m.peer_endpoint
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
    }
    Ok(ExitCode::SUCCESS)
}
