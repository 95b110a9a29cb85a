//! The admin host: an operator running `holdfast member` and `holdfast leader transfer` during the run,
//! through the real client library and RPCs. It takes the operations the driver queues
//! (`Shared::admin`) in order and retries each until it succeeds or the run ends, logging every attempt's
//! outcome into the run's trace.

use crate::cluster::{client_endpoints, server_name, AdminOp, Shared, CLIENT_PORT, PEER_PORT};
use holdfast_client::{Client, ClientOptions};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub type AdminLog = Arc<Mutex<Vec<String>>>;

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
                let left =
                    || Duration::from_millis(until_ms.saturating_sub(crate::workload::now_ms()));
                for g in 0..client.groups() {
                    loop {
                        let call = client.add_member(g, new, &client_ep, &peer_ep);
                        match tokio::time::timeout(left(), call).await {
                            Err(_) => return Ok(()),
                            Ok(Ok(m)) => {
                                say(format!(
                                    "add {new}: voters {:?} joint {}",
                                    m.voters, m.joint
                                ));
                                if !m.joint {
                                    break;
                                }
                            }
                            Ok(Err(e)) => say(format!("add {new} failed, retrying: {e}")),
                        }
                        if crate::workload::now_ms() >= until_ms {
                            return Ok(());
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    loop {
                        let call = client.remove_member(g, old, false);
                        match tokio::time::timeout(left(), call).await {
                            Err(_) => return Ok(()),
                            Ok(Ok(m)) => {
                                say(format!(
                                    "remove {old}: voters {:?} joint {}",
                                    m.voters, m.joint
                                ));
                                if !m.joint {
                                    break;
                                }
                            }
                            Ok(Err(e)) => say(format!("remove {old} failed, retrying: {e}")),
                        }
                        if crate::workload::now_ms() >= until_ms {
                            return Ok(());
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
                say(format!("replaced {old} by {new} in every group"));
            }
        }
    }
    Ok(())
}
