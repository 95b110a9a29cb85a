//! A read-modify-write on the reference fenced store, fenced as a whole with the lock's token.
//!
//! Start the dev cluster and the store first:
//! `holdfast dev` and `holdfast fence-store`, then `cargo run -p holdfast-client --example fenced_write`.

use holdfast_fence::service::FenceClient;
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let endpoints = std::env::var("HOLDFAST_ENDPOINTS")
        .unwrap_or_else(|_| "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003".into());
    let store = std::env::var("HOLDFAST_FENCE_STORE").unwrap_or_else(|_| "127.0.0.1:7301".into());
    let client = holdfast_client::Client::connect(endpoints.split(',').map(str::to_string)).await?;
    let session = client.open_session(Duration::from_secs(10)).await?;
    let guard = session
        .acquire_timeout("accounts/alice", Duration::from_secs(30))
        .await?;
    let token = guard.token();

    let mut fence = FenceClient::connect(&store).await?;
    // The read carries the token too: it raises the store's mark, so a holder paused before us can no
    // longer write after we read (its late write would otherwise be silently overwritten by ours).
    let balance = match fence.read("accounts/alice", token).await? {
        Some((bytes, _)) => String::from_utf8(bytes)?.parse::<i64>()?,
        None => 0,
    };
    fence
        .write(
            "accounts/alice",
            token,
            (balance + 10).to_string().as_bytes(),
        )
        .await?;
    println!("balance {balance} -> {} with token {token}", balance + 10);

    guard.release().await?;
    session.close().await?;
    Ok(())
}
