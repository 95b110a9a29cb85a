//! P7 liveness: once every fault has healed (links repaired, crashed servers restarted), the cluster
//! serves again and converges. Checked two ways, within [`crate::run::HEAL_BUDGET_MS`] of the heal:
//! - a fresh client (the `probe` host, never faulted) opens a session, acquires a lock and releases it;
//! - every server reaches the same applied index with the same lock table digest (no replica is left
//!   behind or different).
//!
//! Safety (P1–P6) may never depend on timing; liveness does, which is why it is only asked after the heal
//! and with a generous budget (several election timeouts and session TTLs).

use crate::cluster::client_endpoints;
use crate::run::{Outcome, HEAL_BUDGET_MS};
use crate::workload::now_ms;
use holdfast_client::{Client, ClientOptions};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The probe client: waits for the heal, then tries open + acquire + release until it succeeds or the
/// budget runs out; records how long after the heal it succeeded.
pub async fn probe(
    seed: u64,
    heal_at_ms: u64,
    done: Arc<Mutex<Option<u64>>>,
) -> Result<(), Box<dyn std::error::Error>> {
    let now = now_ms();
    tokio::time::sleep(Duration::from_millis(heal_at_ms.saturating_sub(now))).await;
    let give_up = heal_at_ms + HEAL_BUDGET_MS;
    let mut attempts = 0u64;
    while now_ms() < give_up {
        attempts += 1;
        // A fresh client per attempt, with its own nonces: a repeated nonce would get back the session
        // an earlier attempt opened, which may have expired since.
        let options = ClientOptions {
            request_timeout: Duration::from_secs(3),
            nonce_seed: Some(seed ^ 0x9b0b_e000 ^ (attempts << 40)),
            ..ClientOptions::default()
        };
        let attempt = async {
            let client = Client::connect_with(client_endpoints(), options).await?;
            let session = client.open_session(Duration::from_secs(2)).await?;
            let guard = session
                .acquire_timeout("probe/p7", Duration::from_secs(2))
                .await?;
            guard.release().await?;
            session.close().await?;
            Ok::<_, holdfast_client::Error>(())
        };
        if tokio::time::timeout(Duration::from_secs(6), attempt)
            .await
            .is_ok_and(|r| r.is_ok())
        {
            *done.lock().unwrap() = Some(now_ms() - heal_at_ms);
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

pub fn check(run: &Outcome) -> Vec<String> {
    let mut v = Vec::new();
    if run.recovered_after_ms.is_none() {
        v.push(format!(
            "P7: no fresh client got open + acquire + release through within {HEAL_BUDGET_MS} ms of the heal"
        ));
    }
    if run.converged_after_ms.is_none() {
        v.push(format!(
            "P7: the servers did not reach the same applied index and digest within {HEAL_BUDGET_MS} ms of the heal"
        ));
    }
    v
}
