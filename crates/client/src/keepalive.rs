//! Batched keepalives: one background task per [`Client`] renews every session it opened, sending one
//! message per group per round over a long-lived `KeepAliveStream` to that group's leader. This is what
//! keeps the load at the design's "one heartbeat per client connection" instead of one RPC per session.
//!
//! A session is due one third of its TTL after the last renewal was sent. A renewal counts from the moment
//! its message was **sent**; a failed round is retried on the next tick (every 100 ms) until the session's
//! client-side lease runs out, and then the session is marked lost.

use crate::client::{Client, Inner};
use crate::error::{classify, Disposition};
use crate::session::SessionInner;
use holdfast_proto::v1 as pb;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// How often the keepalive task looks for due sessions.
const TICK: Duration = Duration::from_millis(100);
/// Most session ids per keepalive message (the server's `max_keepalive_batch`).
const MAX_BATCH: usize = 10_000;

#[derive(Default)]
pub(crate) struct Registry {
    sessions: Mutex<Vec<Weak<SessionInner>>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Round-trip times of keepalive messages, in µs, until drained (at most `MAX_SAMPLES`).
    pub(crate) latencies_us: Mutex<Vec<u32>>,
}

/// Keepalive latency samples kept until [`Client::take_keepalive_latencies`] drains them.
const MAX_SAMPLES: usize = 1_000_000;

impl Registry {
    pub(crate) fn record(&self, rtt: Duration) {
        let mut l = self.latencies_us.lock().expect("latency lock");
        if l.len() < MAX_SAMPLES {
            l.push(rtt.as_micros().min(u128::from(u32::MAX)) as u32);
        }
    }
}

impl Client {
    /// Round-trip times (µs) of the keepalive messages sent since the last call, for benchmarks.
    pub fn take_keepalive_latencies(&self) -> Vec<u32> {
        std::mem::take(
            &mut *self
                .inner()
                .registry
                .latencies_us
                .lock()
                .expect("latency lock"),
        )
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        if let Some(t) = self.task.lock().ok().and_then(|mut t| t.take()) {
            t.abort();
        }
    }
}

impl Registry {
    pub(crate) fn add(&self, client: &Arc<Inner>, session: &Arc<SessionInner>) {
        self.sessions
            .lock()
            .expect("registry lock")
            .push(Arc::downgrade(session));
        let mut task = self.task.lock().expect("registry task lock");
        if task.is_none() {
            *task = Some(tokio::spawn(run(Arc::downgrade(client))));
        }
    }

    fn live(&self) -> Vec<Arc<SessionInner>> {
        let mut sessions = self.sessions.lock().expect("registry lock");
        sessions.retain(|w| w.upgrade().is_some_and(|s| !s.is_lost()));
        sessions.iter().filter_map(Weak::upgrade).collect()
    }
}

struct Stream {
    endpoint: usize,
    tx: mpsc::Sender<pb::KeepAliveRequest>,
    rx: tonic::Streaming<pb::KeepAliveResponse>,
}

async fn run(client: Weak<Inner>) {
    let mut streams: BTreeMap<u32, Stream> = BTreeMap::new();
    loop {
        tokio::time::sleep(TICK).await;
        let Some(inner) = client.upgrade() else {
            return;
        };
        let client = Client::from_inner(inner);
        let now = Instant::now();
        let sessions = client.inner().registry.live();
        for s in &sessions {
            s.check_expired(now);
        }
        let due: Vec<&Arc<SessionInner>> = sessions.iter().filter(|s| s.is_due(now)).collect();
        if due.is_empty() {
            continue;
        }
        let sent = Instant::now();
        let sent_wall_ms = crate::session::wall_ms();
        // A session is renewed when every group renewed it; the smallest TTL granted counts.
        let mut granted: Vec<Option<Duration>> = vec![Some(Duration::MAX); due.len()];
        for group in 0..client.groups() {
            for (chunk_no, chunk) in due.chunks(MAX_BATCH).enumerate() {
                let ids: Vec<u64> = chunk.iter().map(|s| s.id_in(group)).collect();
                let secrets: Vec<Vec<u8>> =
                    chunk.iter().map(|s| s.secret_in(group).to_vec()).collect();
                // A round may take no longer than the earliest lease in it has left.
                let limit = chunk
                    .iter()
                    .map(|s| s.valid_until())
                    .min()
                    .unwrap_or(now)
                    .saturating_duration_since(Instant::now());
                let outcome = match tokio::time::timeout(
                    limit,
                    round(&client, &mut streams, group, ids, secrets),
                )
                .await
                {
                    Ok(r) => r,
                    Err(_) => {
                        streams.remove(&group);
                        Err("the leases ran out during the round".to_string())
                    }
                };
                match outcome {
                    Ok(results) => {
                        for (i, r) in results.into_iter().enumerate() {
                            let slot = &mut granted[chunk_no * MAX_BATCH + i];
                            match r {
                                Some(ttl) => *slot = slot.map(|g| g.min(ttl)),
                                None => {
                                    chunk[i].mark_lost(
                                        "the server expired or closed the session".into(),
                                    );
                                    *slot = None;
                                }
                            }
                        }
                    }
                    Err(reason) => {
                        tracing::debug!(group, %reason, "keepalive round failed; retrying");
                        for i in 0..chunk.len() {
                            granted[chunk_no * MAX_BATCH + i] = None;
                        }
                    }
                }
            }
        }
        for (s, g) in due.iter().zip(granted) {
            match g {
                Some(ttl) if ttl != Duration::MAX => s.renewed(sent, sent_wall_ms, ttl),
                _ => s.retry_soon(Instant::now() + TICK),
            }
        }
    }
}

/// Sends one keepalive message for `group` and returns, per id, the TTL granted or `None` if not alive.
async fn round(
    client: &Client,
    streams: &mut BTreeMap<u32, Stream>,
    group: u32,
    ids: Vec<u64>,
    secrets: Vec<Vec<u8>>,
) -> Result<Vec<Option<Duration>>, String> {
    let n = ids.len();
    // Sessions opened by a server that gave no secrets send none.
    let secrets = if secrets.iter().all(|s| s.is_empty()) {
        Vec::new()
    } else {
        secrets
    };
    let request = pb::KeepAliveRequest {
        group,
        session_ids: ids,
        session_secrets: secrets,
    };
    let timeout = client.options().attempt_timeout;
    for _attempt in 0..client.server_count() + 1 {
        let stream = match streams.get_mut(&group) {
            Some(s) => s,
            None => {
                let endpoint = client.leader_of(group);
                let (tx, rx) = mpsc::channel(4);
                let mut c = client.rpc(endpoint);
                let opened =
                    tokio::time::timeout(timeout, c.keep_alive_stream(tokio_stream_from(rx))).await;
                match opened {
                    Ok(Ok(resp)) => streams.entry(group).or_insert(Stream {
                        endpoint,
                        tx,
                        rx: resp.into_inner(),
                    }),
                    Ok(Err(status)) => {
                        next_target(client, group, endpoint, &status);
                        continue;
                    }
                    Err(_) => {
                        client.set_leader(group, (endpoint + 1) % client.server_count());
                        continue;
                    }
                }
            }
        };
        let endpoint = stream.endpoint;
        let sent = Instant::now();
        if stream.tx.send(request.clone()).await.is_err() {
            streams.remove(&group);
            continue;
        }
        match tokio::time::timeout(timeout, stream.rx.message()).await {
            Ok(Ok(Some(reply))) if reply.results.len() == n => {
                client.inner().registry.record(sent.elapsed());
                return Ok(reply
                    .results
                    .iter()
                    .map(|r| r.alive.then(|| Duration::from_millis(r.ttl_ms)))
                    .collect());
            }
            Ok(Ok(_)) => {
                streams.remove(&group);
                return Err(
                    "keepalive stream ended or answered the wrong number of sessions".into(),
                );
            }
            Ok(Err(status)) => {
                streams.remove(&group);
                next_target(client, group, endpoint, &status);
            }
            Err(_) => {
                streams.remove(&group);
                client.set_leader(group, (endpoint + 1) % client.server_count());
                return Err(format!("no keepalive answer within {timeout:?}"));
            }
        }
    }
    Err("no server renewed the sessions".into())
}

fn next_target(client: &Client, group: u32, endpoint: usize, status: &tonic::Status) {
    let next = match classify(status) {
        Disposition::Redirect(ep) => client.server_index(&ep),
        _ => None,
    };
    client.set_leader(
        group,
        next.unwrap_or((endpoint + 1) % client.server_count()),
    );
}

fn tokio_stream_from(
    rx: mpsc::Receiver<pb::KeepAliveRequest>,
) -> impl tokio_stream::Stream<Item = pb::KeepAliveRequest> + Send + 'static {
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
