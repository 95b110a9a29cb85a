//! `holdfast status`: asks every endpoint for its view of the cluster.

use clap::Args;
use holdfast_proto::v1::holdfast_client::HoldfastClient;
use holdfast_proto::v1::StatusRequest;
use std::process::ExitCode;
use std::time::Duration;

/// The dev cluster's client endpoints.
pub const DEV_ENDPOINTS: &str =
    "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003,127.0.0.1:7004,127.0.0.1:7005";

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Client endpoints, comma-separated.
    #[arg(long, env = "HOLDFAST_ENDPOINTS", default_value = DEV_ENDPOINTS)]
    endpoints: String,
}

pub async fn run(args: StatusArgs) -> anyhow::Result<ExitCode> {
    println!(
        "{:<6} {:<22} {:>5} {:<9} {:>6} {:>6} {:>9} {:>9} {:>9} {:>8} {:>6}",
        "node",
        "endpoint",
        "group",
        "role",
        "term",
        "leader",
        "last_log",
        "committed",
        "applied",
        "sessions",
        "locks"
    );
    let mut reachable = 0;
    for ep in args
        .endpoints
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let status = async {
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{ep}"))?
                .connect_timeout(Duration::from_secs(1))
                .timeout(Duration::from_secs(2))
                .connect()
                .await?;
            anyhow::Ok(
                HoldfastClient::new(channel)
                    .status(StatusRequest {})
                    .await?
                    .into_inner(),
            )
        };
        match status.await {
            Ok(s) => {
                reachable += 1;
                for g in s.groups {
                    println!(
                        "{:<6} {:<22} {:>5} {:<9} {:>6} {:>6} {:>9} {:>9} {:>9} {:>8} {:>6}",
                        s.node_id,
                        ep,
                        g.group,
                        g.role,
                        g.term,
                        g.leader_id,
                        g.last_log_index,
                        g.committed_index,
                        g.applied_index,
                        g.sessions,
                        g.locks
                    );
                }
            }
            Err(e) => println!("{:<6} {:<22} unreachable: {e}", "?", ep),
        }
    }
    Ok(if reachable > 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
