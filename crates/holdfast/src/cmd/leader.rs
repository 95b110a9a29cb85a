//! `holdfast leader transfer [--group G] [--to N]`: hands a group's leadership to another server, e.g.
//! before restarting its leader by hand (a stopping server does this by itself).

use super::Conn;
use clap::{Args, Subcommand};
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct LeaderArgs {
    #[command(subcommand)]
    action: LeaderAction,
}

#[derive(Subcommand, Debug)]
enum LeaderAction {
    /// Hand leadership of a group (every group unless --group) to another server.
    Transfer {
        /// Only this group.
        #[arg(long)]
        group: Option<u32>,
        /// The server to hand over to (default: the one whose log is the most up to date).
        #[arg(long)]
        to: Option<u64>,
        #[command(flatten)]
        conn: Conn,
    },
}

pub async fn run(args: LeaderArgs) -> anyhow::Result<ExitCode> {
    let LeaderAction::Transfer { group, to, conn } = args.action;
    let client = conn.connect().await?;
    let groups: Vec<u32> = match group {
        Some(g) if g < client.groups() => vec![g],
        Some(g) => anyhow::bail!(
            "group {g} does not exist (the cluster has {} groups)",
            client.groups()
        ),
        None => (0..client.groups()).collect(),
    };
    for g in groups {
        let leader = client.transfer_leader(g, to).await?;
        println!("group {g}: led by node {leader}");
    }
    Ok(ExitCode::SUCCESS)
}
