//! `holdfast fence-write KEY VALUE` and `holdfast fence-read KEY`: talk to the reference fenced store
//! with a fencing token (by default `$HOLDFAST_TOKEN`, which `holdfast lock` sets), e.g.
//! `holdfast lock acct -- holdfast fence-write acct 42`. A stale token exits with 1 and says so.

use anyhow::{bail, Context};
use clap::Args;
use holdfast_fence::service::FenceClient;
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct FenceWriteArgs {
    key: String,
    value: String,
    #[command(flatten)]
    target: Target,
}

#[derive(Args, Debug)]
pub struct FenceReadArgs {
    key: String,
    #[command(flatten)]
    target: Target,
}

#[derive(Args, Debug)]
struct Target {
    /// The fencing token (default: $HOLDFAST_TOKEN, set by `holdfast lock`).
    #[arg(long, env = "HOLDFAST_TOKEN")]
    token: u64,
    /// The fenced store's address.
    #[arg(long, env = "HOLDFAST_FENCE_STORE", default_value = "127.0.0.1:7301")]
    store: String,
}

pub async fn write(args: FenceWriteArgs) -> anyhow::Result<ExitCode> {
    let mut client = FenceClient::connect(&args.target.store)
        .await
        .context("cannot reach the fenced store")?;
    match client
        .write(&args.key, args.target.token, args.value.as_bytes())
        .await
    {
        Ok(_) => {
            eprintln!("wrote {:?} with token {}", args.key, args.target.token);
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => bail!("{e}"),
    }
}

pub async fn read(args: FenceReadArgs) -> anyhow::Result<ExitCode> {
    let mut client = FenceClient::connect(&args.target.store)
        .await
        .context("cannot reach the fenced store")?;
    match client.read(&args.key, args.target.token).await? {
        Some((value, token)) => println!(
            "{} (written with token {token})",
            String::from_utf8_lossy(&value)
        ),
        None => println!("{} is not set", args.key),
    }
    Ok(ExitCode::SUCCESS)
}
