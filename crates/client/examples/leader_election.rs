//! Leader election: campaign for a role, lead with an epoch, resign; and observe who leads.
//!
//! `cargo run -p holdfast-client --example leader_election -- NAME` in two terminals (dev cluster running):
//! the second waits until the first resigns (Ctrl-C) or dies (its session expires).

use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), holdfast_client::Error> {
    let name = std::env::args()
        .nth(1)
        .unwrap_or_else(|| format!("pid-{}", std::process::id()));
    let endpoints = std::env::var("HOLDFAST_ENDPOINTS")
        .unwrap_or_else(|_| "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003".into());
    let client = holdfast_client::Client::connect(endpoints.split(',').map(str::to_string)).await?;
    if let Some(leader) = client.leader("examples/scheduler").await? {
        println!(
            "current leader: {} (epoch {})",
            String::from_utf8_lossy(&leader.value),
            leader.epoch
        );
    }
    let session = client.open_session(Duration::from_secs(10)).await?;
    let leadership = session
        .campaign("examples/scheduler", name.as_bytes())
        .await?;
    // Every message this leader sends carries its epoch; receivers drop messages with older epochs.
    println!(
        "{name} leads examples/scheduler with epoch {}",
        leadership.epoch()
    );
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {
            leadership.resign().await?;
            println!("resigned");
        }
        lost = leadership.lost() => println!("leadership may be lost: {}", lost.0),
    }
    session.close().await
}
