//! `holdfast fence-store`: runs the reference fenced store (`holdfast.v1.FencedStore`), a durable
//! key-value service that refuses writes and reads with a token lower than the highest it has seen.

use anyhow::Context;
use clap::Args;
use holdfast_fence::store::FencedStore;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Args, Debug)]
pub struct FenceStoreArgs {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:7301")]
    listen: SocketAddr,
    /// The store's file (created if missing).
    #[arg(long, default_value = "holdfast-data/fence.log")]
    data: PathBuf,
}

pub async fn run(args: FenceStoreArgs) -> anyhow::Result<ExitCode> {
    if let Some(dir) = args.data.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let store = Arc::new(FencedStore::open(&args.data)?);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    eprintln!(
        "fenced store on {} (data {})",
        listener.local_addr()?,
        args.data.display()
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let stop = async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    holdfast_fence::service::serve(listener, store, stop).await?;
    Ok(ExitCode::SUCCESS)
}
