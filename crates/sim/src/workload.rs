//! The simulated clients: the same lock-set workload as the real-process fault tests (`holdfast
//! workload`), on turmoil hosts. Each worker loops: acquire one of [`LOCKS`] locks, read the lock's counter
//! from the fenced store with its token, pause inside the critical section, write counter + 1 with its
//! token, release, and now and then describe a lock. One acquire in [`ABANDON_ONE_IN`] is dropped by its
//! caller after a short patience, as a `select!` or a timeout would (recorded `unknown`). Every
//! operation is recorded with its invoke and complete time (simulated wall clock) and `ok`, `fail` (did
//! not happen) or `unknown` (may have). Each host also runs a watcher whose events P9 checks against the
//! log. One round in [`SHARED_ONE_IN`] takes a shared lock instead ([`SHARED_LOCK`], as a reader or a
//! writer) or a permit of the semaphore [`SEMAPHORE`], holds it a while and releases it (P11).

use crate::cluster::{client_endpoints, STORE_PORT};
use crate::plan::{Knobs, LOCKS};
use crate::rng::Rng;
use holdfast_checker::Op;
use holdfast_client::{Client, ClientOptions, Error, Session};
use holdfast_fence::service::FenceClient;
use holdfast_fence::FenceError;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub type History = Arc<Mutex<Vec<Op>>>;

/// One acquire in this many is dropped by its caller after a random patience of 10..600 ms.
const ABANDON_ONE_IN: u64 = 5;

/// One round in this many uses the shared lock or the semaphore instead of a `wl/N` lock.
const SHARED_ONE_IN: u64 = 3;

/// Taken shared (two times in three) or exclusively.
pub const SHARED_LOCK: &str = "wl/rw";

/// A semaphore of [`PERMITS`] permits.
pub const SEMAPHORE: &str = "wl/sem";
pub const PERMITS: u32 = 2;

/// Simulated wall-clock milliseconds (the same clock on every host).
pub fn now_ms() -> u64 {
    turmoil::since_epoch().map_or(0, |d| d.as_millis() as u64)
}

/// `fail` (did not happen) or `unknown` (may have happened): see [`Error::not_applied`].
fn classify(e: &Error) -> &'static str {
    if e.not_applied() {
        "fail"
    } else {
        "unknown"
    }
}

/// The session's id in the group of `lock`, opening its part there first if this is its first use there
/// (recorded as that group's `open`, as the checker expects one per group). None if that open failed.
async fn open_part(s: &Session, lock: &str, rec: &Recorder) -> Option<u64> {
    let sid = s.id_for(lock);
    if sid != 0 {
        return Some(sid);
    }
    let group = holdfast_client::group_for(lock, s.client().groups());
    let invoke = now_ms();
    match s.open_for(lock).await {
        Ok(sid) => {
            rec.record("open", "", invoke, "ok", |o| {
                o.session = Some(sid);
                o.group = Some(group);
            });
            Some(sid)
        }
        Err(e) => {
            rec.record("open", "", invoke, classify(&e), |o| o.group = Some(group));
            tokio::time::sleep(Duration::from_millis(100)).await;
            None
        }
    }
}

struct Recorder {
    history: History,
    process: u32,
    client: usize,
}

impl Recorder {
    fn record(&self, op: &str, lock: &str, invoke_ms: u64, result: &str, f: impl FnOnce(&mut Op)) {
        let mut o = Op {
            process: self.process,
            client: self.client,
            op: op.into(),
            lock: lock.into(),
            invoke_ms,
            complete_ms: now_ms(),
            result: result.into(),
            ..Op::default()
        };
        f(&mut o);
        self.history.lock().unwrap().push(o);
    }
}

/// One client host: a `Client` shared by `knobs.workers_per_host` workers, a reader and a watcher,
/// running until `until_ms`.
pub async fn client_host(
    host: usize,
    seed: u64,
    until_ms: u64,
    history: History,
    knobs: Knobs,
) -> Result<(), Box<dyn std::error::Error>> {
    let options = ClientOptions {
        request_timeout: Duration::from_secs(5),
        nonce_seed: Some(seed ^ 0xc11e_0000 ^ host as u64),
        // The first host lets the servers abandon its calls that go away too, as they do for every
        // client that does not say it cancels by itself.
        client_cancels: host != 0,
        // The last host sends unary acquires and releases; the others use the Calls stream (the first
        // with the servers in charge of abandoning what goes away on it).
        call_streams: host != 2,
        // The second host carries its Calls streams over gRPC, the first on connections of their own.
        call_connections: host != 1,
        ..ClientOptions::default()
    };
    let client = Client::connect_with(client_endpoints(), options).await?;
    let mut tasks = Vec::new();
    let workers = knobs.workers_per_host;
    for w in 0..workers {
        let recorder = Recorder {
            history: history.clone(),
            process: host as u32 + 1,
            client: w,
        };
        let rng = Rng::new(seed ^ ((host * workers + w) as u64 + 1).wrapping_mul(0x2545_f491));
        tasks.push(tokio::spawn(worker(
            client.clone(),
            recorder,
            rng,
            until_ms,
            knobs.clone(),
        )));
    }
    let reader = Recorder {
        history: history.clone(),
        process: host as u32 + 1,
        client: workers,
    };
    let rng = Rng::new(seed ^ (host as u64 + 1).wrapping_mul(0x5851_f42d));
    tasks.push(tokio::spawn(reader_loop(
        client.clone(),
        reader,
        rng,
        until_ms,
    )));
    // One watcher per host: every lock on the first, a few locks' prefix on the others (P9).
    let watcher = Recorder {
        history: history.clone(),
        process: host as u32 + 1,
        client: workers + 1,
    };
    let prefix = if host == 0 {
        String::new()
    } else {
        format!("wl/{host}")
    };
    tasks.push(tokio::spawn(watch_loop(
        client.clone(),
        watcher,
        prefix,
        until_ms,
    )));
    for t in tasks {
        t.await?;
    }
    Ok(())
}

/// Describes random locks in a loop. Reads that go to a deposed leader still believing it leads are
/// what a stale-read bug would return; the workers' own describes come too rarely to catch one.
async fn reader_loop(client: Client, rec: Recorder, mut rng: Rng, until_ms: u64) {
    while now_ms() < until_ms {
        let lock = format!("wl/{}", rng.between(0, LOCKS - 1));
        let invoke = now_ms();
        match client.describe(&lock).await {
            Ok(l) => {
                let (holder, token) = l.map_or((0, 0), |l| (l.holder_session_id, l.token));
                rec.record("describe", &lock, invoke, "ok", |o| {
                    o.session = Some(holder);
                    o.token = Some(token);
                });
            }
            Err(e) => rec.record("describe", &lock, invoke, classify(&e), |_| {}),
        }
        tokio::time::sleep(Duration::from_millis(rng.between(10, 60))).await;
    }
}

/// Watches `prefix` until the end, recording where each watch started and every event it delivered (P9
/// compares them with the log). A watch ends only on an error retrying cannot fix (its position was
/// compacted away); then a new one starts from now.
async fn watch_loop(client: Client, rec: Recorder, prefix: String, until_ms: u64) {
    let end = tokio::time::sleep(Duration::from_millis(until_ms.saturating_sub(now_ms())));
    tokio::pin!(end);
    while now_ms() < until_ms {
        let invoke = now_ms();
        let mut watch = tokio::select! {
            w = client.watch(&prefix) => match w {
                Ok(w) => w,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            },
            () = &mut end => return,
        };
        // One start per group: each group's events follow its own log from its own position.
        for (g, &(next, _)) in watch.position().groups.iter().enumerate() {
            rec.record("watch-start", &prefix, invoke, "ok", |o| {
                o.value = Some(next - 1);
                o.group = Some(g as u32);
            });
        }
        loop {
            let event = tokio::select! {
                e = watch.next() => e,
                () = &mut end => return,
            };
            let Ok(e) = event else { break };
            let kind = match e.kind {
                holdfast_client::EventKind::Granted => "granted",
                holdfast_client::EventKind::Released => "released",
                holdfast_client::EventKind::Expired => "expired",
                holdfast_client::EventKind::Queued => "queued",
                holdfast_client::EventKind::Cancelled => "cancelled",
                holdfast_client::EventKind::Delayed => "delayed",
                holdfast_client::EventKind::DelayEnded => "delay-ended",
                holdfast_client::EventKind::Unknown(_) => "unknown",
            };
            rec.record("watch", &e.name, now_ms(), "ok", |o| {
                o.index = Some(e.index);
                o.kind = Some(kind.into());
                o.session = Some(e.session);
                o.token = Some(e.token);
            });
        }
    }
}

async fn worker(client: Client, rec: Recorder, mut rng: Rng, until_ms: u64, knobs: Knobs) {
    let store = format!("store:{STORE_PORT}");
    let mut fence: Option<FenceClient> = None;
    let mut session: Option<Session> = None;
    while now_ms() < until_ms {
        let mut f = match &fence {
            Some(f) => f.clone(),
            None => match FenceClient::connect(&store).await {
                Ok(f) => {
                    fence = Some(f.clone());
                    f
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let s = match &session {
            Some(s) if s.is_valid() => s.clone(),
            _ => {
                if let Some(old) = session.take() {
                    // The session's last renewal, acknowledged by every group, bounds each group's
                    // expiry of its part of it.
                    let (sent_ms, ttl) = old.last_renewal();
                    // Only the groups it was opened in (id 0: never opened there).
                    for (g, sid) in old.ids().into_iter().enumerate().filter(|(_, id)| *id != 0) {
                        rec.record("lost", "", now_ms(), "ok", |o| {
                            o.session = Some(sid);
                            o.renewed_sent_ms = Some(sent_ms);
                            o.ttl_ms = Some(ttl.as_millis() as u64);
                            o.group = Some(g as u32);
                        });
                    }
                }
                let invoke = now_ms();
                match client
                    .open_session(Duration::from_millis(knobs.ttl_ms))
                    .await
                {
                    Ok(s) => {
                        // With one group the session opened there now; with several, in none yet
                        // (each group's part opens at its first use: `open_part`).
                        for (g, sid) in s.ids().into_iter().enumerate().filter(|(_, id)| *id != 0) {
                            rec.record("open", "", invoke, "ok", |o| {
                                o.session = Some(sid);
                                o.group = Some(g as u32);
                            });
                        }
                        session = Some(s.clone());
                        s
                    }
                    Err(e) => {
                        // Only a one-group open talks to the cluster here.
                        rec.record("open", "", invoke, classify(&e), |o| o.group = Some(0));
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                }
            }
        };
        if rng.between(0, SHARED_ONE_IN - 1) == 0 {
            shared_round(&s, &rec, &mut rng, &knobs).await;
            continue;
        }
        let lock = format!("wl/{}", rng.between(0, LOCKS - 1));
        // The session's id in the lock's group (what describe reports as the holder).
        let Some(sid) = open_part(&s, &lock, &rec).await else {
            continue;
        };
        let invoke = now_ms();
        let lock_delay = draw_lock_delay(&knobs, &mut rng);
        let acquire = s.acquire_with(
            &lock,
            holdfast_client::AcquireOptions {
                wait: Duration::from_secs(1),
                lock_delay,
                ..Default::default()
            },
        );
        let Some(acquired) = maybe_abandoned(acquire, &mut rng).await else {
            rec.record("acquire", &lock, invoke, "unknown", |o| {
                o.session = Some(sid)
            });
            continue;
        };
        let guard = match acquired {
            Ok(g) => {
                let token = g.token();
                rec.record("acquire", &lock, invoke, "ok", |o| {
                    o.session = Some(sid);
                    o.token = Some(token);
                });
                g
            }
            Err(e) => {
                rec.record("acquire", &lock, invoke, classify(&e), |o| {
                    o.session = Some(sid)
                });
                continue;
            }
        };
        let token = guard.token();
        let invoke = now_ms();
        let value = match f.read(&lock, token).await {
            Ok(v) => {
                let n: u64 = v
                    .as_ref()
                    .and_then(|(b, _)| std::str::from_utf8(b).ok()?.parse().ok())
                    .unwrap_or(0);
                rec.record("read", &lock, invoke, "ok", |o| {
                    o.session = Some(sid);
                    o.token = Some(token);
                    o.value = Some(n);
                });
                Some(n)
            }
            Err(e) => {
                let result = if matches!(e, FenceError::Stale { .. }) {
                    "fail"
                } else {
                    "unknown"
                };
                rec.record("read", &lock, invoke, result, |o| {
                    o.session = Some(sid);
                    o.token = Some(token);
                });
                if result == "unknown" {
                    fence = None;
                }
                None
            }
        };
        if let Some(n) = value {
            tokio::time::sleep(Duration::from_millis(rng.between(0, 100))).await;
            let invoke = now_ms();
            let written = n + 1;
            let result = match f.write(&lock, token, written.to_string().as_bytes()).await {
                Ok(_) => "ok",
                Err(FenceError::Stale { .. }) => "fail",
                Err(_) => {
                    fence = None;
                    "unknown"
                }
            };
            rec.record("write", &lock, invoke, result, |o| {
                o.session = Some(sid);
                o.token = Some(token);
                o.value = Some(written);
            });
        }
        let invoke = now_ms();
        let result = match guard.release().await {
            Ok(()) => "ok",
            Err(e) => classify(&e),
        };
        rec.record("release", &lock, invoke, result, |o| {
            o.session = Some(sid);
            o.token = Some(token);
        });
        if rng.between(0, 2) == 0 {
            let read = format!("wl/{}", rng.between(0, LOCKS - 1));
            let invoke = now_ms();
            match client.describe(&read).await {
                Ok(l) => {
                    let (holder, token) = l.map_or((0, 0), |l| (l.holder_session_id, l.token));
                    rec.record("describe", &read, invoke, "ok", |o| {
                        o.session = Some(holder);
                        o.token = Some(token);
                    });
                }
                Err(e) => rec.record("describe", &read, invoke, classify(&e), |_| {}),
            }
        }
    }
    if let Some(s) = session {
        let _ = tokio::time::timeout(Duration::from_secs(2), s.close()).await;
    }
}

/// One round on the shared lock (a reader, or now and then a writer) or the semaphore: acquire (with
/// the knobs' lock-delays, and abandoned now and then like the other rounds), hold for 0..100 ms,
/// release. No fenced store: P11 checks these holders against each other in the log.
async fn shared_round(s: &Session, rec: &Recorder, rng: &mut Rng, knobs: &Knobs) {
    // Half the rounds on the semaphore, so its permits run out often; a writer in three of the rest.
    let (lock, share, shared, permits) = match rng.between(0, 5) {
        0..=2 => (SEMAPHORE, format!("permits:{PERMITS}"), false, PERMITS),
        3 => (SHARED_LOCK, "exclusive".to_string(), false, 0),
        _ => (SHARED_LOCK, "shared".to_string(), true, 0),
    };
    let Some(sid) = open_part(s, lock, rec).await else {
        return;
    };
    let lock_delay = draw_lock_delay(knobs, rng);
    let invoke = now_ms();
    let acquire = s.acquire_with(
        lock,
        holdfast_client::AcquireOptions {
            wait: Duration::from_secs(1),
            lock_delay,
            shared,
            permits,
            ..Default::default()
        },
    );
    let Some(acquired) = maybe_abandoned(acquire, rng).await else {
        rec.record("acquire", lock, invoke, "unknown", |o| {
            o.session = Some(sid);
            o.share = Some(share.clone());
        });
        return;
    };
    let guard = match acquired {
        Ok(g) => g,
        Err(e) => {
            rec.record("acquire", lock, invoke, classify(&e), |o| {
                o.session = Some(sid);
                o.share = Some(share.clone());
            });
            return;
        }
    };
    let token = guard.token();
    rec.record("acquire", lock, invoke, "ok", |o| {
        o.session = Some(sid);
        o.token = Some(token);
        o.share = Some(share.clone());
    });
    tokio::time::sleep(Duration::from_millis(rng.between(0, 100))).await;
    let invoke = now_ms();
    let result = match guard.release().await {
        Ok(()) => "ok",
        Err(e) => classify(&e),
    };
    rec.record("release", lock, invoke, result, |o| {
        o.session = Some(sid);
        o.token = Some(token);
        o.share = Some(share.clone());
    });
}

/// Some acquires ask for a lock-delay (`Knobs`): an expiry of its session (a paused client) then
/// leaves the lock to nobody for that long, timed by whichever server leads then.
fn draw_lock_delay(knobs: &Knobs, rng: &mut Rng) -> Duration {
    if knobs.lock_delay_one_in > 0 && rng.between(0, knobs.lock_delay_one_in - 1) == 0 {
        Duration::from_millis(knobs.lock_delay_ms)
    } else {
        Duration::ZERO
    }
}

/// Awaits `acquire`, except that one in [`ABANDON_ONE_IN`] callers give up early and drop it (a
/// select!, a timeout, a shutdown): None then. Its wait or grant must not outlive that (P8); it may
/// have been granted meanwhile.
async fn maybe_abandoned<T>(
    acquire: impl std::future::Future<Output = T>,
    rng: &mut Rng,
) -> Option<T> {
    if rng.between(0, ABANDON_ONE_IN - 1) == 0 {
        let patience = Duration::from_millis(rng.between(10, 600));
        tokio::time::timeout(patience, acquire).await.ok()
    } else {
        Some(acquire.await)
    }
}
