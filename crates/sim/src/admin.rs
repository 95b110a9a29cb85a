//! The admin host: an operator running `holdfast member` and `holdfast leader transfer` during the run,
//! through the real client library and RPCs. It takes the operations the driver queues
//! (`Shared::admin`) in order and retries each until it succeeds or the run ends, logging every attempt's
//! outcome into the run's trace.

use crate::cluster::{client_endpoints, server_name, AdminOp, Shared, CLIENT_PORT, PEER_PORT};
use holdfast_client::{Client, ClientOptions};
use holdfast_proto::v1::MembershipResponse;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub type AdminLog = Arc<Mutex<Vec<String>>>;

/// Repeats a membership call until it answers with a settled (not joint) configuration; false if the
/// run ends first. Each attempt is bounded by the time left.
async fn settle<F, Fut>(what: &str, until_ms: u64, say: &impl Fn(String), call: F) -> bool
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<MembershipResponse, holdfast_client::Error>>,
{
    loop {
        let left = Duration::from_millis(until_ms.saturating_sub(crate::workload::now_ms()));
        match tokio::time::timeout(left, call()).await {
            Err(_) => return false,
            Ok(Ok(m)) => {
                say(format!("{what}: voters {:?} joint {}", m.voters, m.joint));
                if !m.joint {
                    return true;
                }
            }
            Ok(Err(e)) => say(format!("{what} failed, retrying: {e}")),
        }
        if crate::workload::now_ms() >= until_ms {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Takes operations until `idle_until_ms` (the end of the workload) and then ends once the queue is
/// empty; an operation under way is retried until `until_ms` (simulated wall clock).
pub async fn admin_host(
    shared: Arc<Shared>,
    seed: u64,
    idle_until_ms: u64,
    until_ms: u64,
    log: AdminLog,
) -> Result<(), Box<dyn std::error::Error>> {
    let options = ClientOptions {
        request_timeout: Duration::from_secs(5),
        nonce_seed: Some(seed ^ 0xad31_0000),
        ..ClientOptions::default()
    };
    let client = Client::connect_with(client_endpoints(), options).await?;
    let say = |text: String| {
        log.lock()
            .unwrap()
            .push(format!("{} admin {text}", crate::workload::now_ms()));
    };
    while crate::workload::now_ms() < until_ms {
        let op = shared.admin.lock().unwrap().pop_front();
        let Some(op) = op else {
            if crate::workload::now_ms() >= idle_until_ms {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        match op {
            AdminOp::TransferLeader => match client.transfer_leader(0, None).await {
                Ok(leader) => say(format!("transfer leader: now {leader}")),
                Err(e) => say(format!("transfer leader failed: {e}")),
            },
            AdminOp::Replace { server, old, new } => {
                let client_ep = format!("{}:{CLIENT_PORT}", server_name(server));
                let peer_ep = format!("{}:{PEER_PORT}", server_name(server));
                for g in 0..client.groups() {
                    let add = || client.add_member(g, new, &client_ep, &peer_ep);
                    if !settle(&format!("add {new}"), until_ms, &say, add).await {
                        return Ok(());
                    }
                    let remove = || client.remove_member(g, old, false);
                    if !settle(&format!("remove {old}"), until_ms, &say, remove).await {
                        return Ok(());
                    }
                }
                say(format!("replaced {old} by {new} in every group"));
            }
        }
    }
    Ok(())
}
