//! `holdfast workload` (hidden): the fault tests' clients, in the style of Jepsen's lock-set workload.
//!
//! Each client loops: acquire one of K locks (waiting up to 1 s); read the lock's counter from the
//! reference fenced store with its token; pause for a random time inside the critical section; write the
//! counter + 1 with its token; release. Every operation is appended to the history file as one JSON line
//! with its invoke and complete times (wall-clock ms) and its result: `ok`, `fail` (definitely did not
//! happen) or `unknown` (may have happened). The checker (`holdfast-checker`) reads these files.

use super::duration::parse_duration;
use super::Conn;
use anyhow::Context;
use clap::Args;
use holdfast_client::{ClientOptions, Error, Session};
use holdfast_fence::service::FenceClient;
use holdfast_fence::FenceError;
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

#[derive(Args, Debug)]
pub struct WorkloadArgs {
    #[arg(long, default_value_t = 3)]
    clients: usize,
    #[arg(long, default_value_t = 3)]
    locks: usize,
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    duration: Duration,
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    ttl: Duration,
    /// Longest pause inside a critical section, in ms.
    #[arg(long, default_value_t = 100)]
    pause_ms: u64,
    /// The reference fenced store.
    #[arg(long)]
    store: String,
    /// Where to append the history (JSON lines).
    #[arg(long)]
    history: PathBuf,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Keep going past `--duration` until this process recorded this many operations (at most 3 times the
    /// duration), so a run with long faults still checks enough operations.
    #[arg(long, default_value_t = 0)]
    min_ops: usize,
    /// Send acquires and releases as unary calls instead of on each server's `Calls` stream (the fault
    /// tests run one process each way).
    #[arg(long)]
    unary_calls: bool,
    /// Carry each server's `Calls` stream over gRPC instead of on a connection of its own.
    #[arg(long)]
    grpc_calls: bool,
    #[command(flatten)]
    conn: Conn,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

struct History {
    out: Mutex<std::fs::File>,
    process: u32,
    recorded: std::sync::atomic::AtomicUsize,
}

impl History {
    fn record(
        &self,
        client: usize,
        op: &str,
        lock: &str,
        invoke_ms: u64,
        result: &str,
        fields: serde_json::Value,
    ) {
        let mut line = json!({
            "process": self.process, "client": client, "op": op, "lock": lock,
            "invoke_ms": invoke_ms, "complete_ms": now_ms(), "result": result,
        });
        if let (Some(obj), serde_json::Value::Object(extra)) = (line.as_object_mut(), fields) {
            obj.extend(extra);
        }
        // `--min-ops` counts client operations, not what the watcher received.
        if !op.starts_with("watch") {
            self.recorded
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        // One write per line: formatting straight into the file made one write per piece, so a line
        // could be cut short when the process exited during one.
        let text = format!("{line}\n");
        let mut out = self.out.lock().expect("history lock");
        let _ = out.write_all(text.as_bytes());
    }
}

/// xorshift64*: a deterministic per-client random stream without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % below.max(1)
    }
}

/// `fail` (did not happen) or `unknown` (may have happened): see [`Error::not_applied`].
fn classify(e: &Error) -> &'static str {
    if e.not_applied() {
        "fail"
    } else {
        "unknown"
    }
}

pub async fn run(args: WorkloadArgs) -> anyhow::Result<ExitCode> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.history)
        .context("cannot open the history")?;
    let history = Arc::new(History {
        out: Mutex::new(file),
        process: std::process::id(),
        recorded: Default::default(),
    });
    let options = ClientOptions {
        request_timeout: Duration::from_secs(5),
        tls: args.conn.tls.client_tls()?,
        token: args.conn.tls.auth_token.clone(),
        call_streams: !args.unary_calls,
        call_connections: !args.grpc_calls,
        ..ClientOptions::default()
    };
    let client = holdfast_client::Client::connect_with(args.conn.endpoint_list()?, options).await?;
    let started = Instant::now();
    let deadline = started + args.duration;
    let cap = started + args.duration * 3;
    let args = Arc::new(args);
    let mut tasks = Vec::new();
    for c in 0..args.clients {
        let (client, history, args) = (client.clone(), history.clone(), args.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(args.seed.wrapping_mul(1_000_003).wrapping_add(c as u64 + 1) | 1);
            let mut fence = match FenceClient::connect(&args.store).await {
                Ok(f) => f,
                Err(e) => return Err(anyhow::anyhow!("cannot reach the fenced store: {e}")),
            };
            let mut session: Option<Session> = None;
            let more = || {
                let now = Instant::now();
                now < cap && (now < deadline || history.recorded.load(std::sync::atomic::Ordering::Relaxed) < args.min_ops)
            };
            while more() {
                let s = match &session {
                    Some(s) if s.is_valid() => s.clone(),
                    _ => {
                        if let Some(old) = session.take() {
                            // For the checker's "no early expiry": the server must keep this session
                            // until the last acknowledged renewal's send time plus the TTL.
                            let (sent_ms, ttl) = old.last_renewal();
                            let fields = json!({"session": old.ids()[0], "renewed_sent_ms": sent_ms, "ttl_ms": ttl.as_millis() as u64});
                            history.record(c, "lost", "", now_ms(), "ok", fields);
                        }
                        let invoke = now_ms();
                        match client.open_session(args.ttl).await {
                            Ok(s) => {
                                history.record(c, "open", "", invoke, "ok", json!({"session": s.ids()[0]}));
                                session = Some(s.clone());
                                s
                            }
                            Err(e) => {
                                history.record(c, "open", "", invoke, classify(&e), json!({"error": e.to_string()}));
                                tokio::time::sleep(Duration::from_millis(100)).await;
                                continue;
                            }
                        }
                    }
                };
                let lock = format!("wl/{}", rng.next(args.locks as u64));
                // The session's id in the lock's group (what describe reports as the holder); with
                // several groups its part there opens at the first use (the fault tests run one group,
                // where it opened with the session).
                let sid = match s.open_for(&lock).await {
                    Ok(sid) => sid,
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let invoke = now_ms();
                // One acquire in four asks for a lock-delay, so P10 checks delays through the faults.
                let options = holdfast_client::AcquireOptions {
                    wait: Duration::from_secs(1),
                    lock_delay: if rng.next(4) == 0 { Duration::from_millis(300) } else { Duration::ZERO },
                    ..Default::default()
                };
                let guard = match s.acquire_with(&lock, options).await {
                    Ok(g) => {
                        history.record(c, "acquire", &lock, invoke, "ok", json!({"session": sid, "token": g.token()}));
                        g
                    }
                    Err(e) => {
                        history.record(c, "acquire", &lock, invoke, classify(&e), json!({"session": sid, "error": e.to_string()}));
                        continue;
                    }
                };
                let token = guard.token();
                let invoke = now_ms();
                let value = match fence.read(&lock, token).await {
                    Ok(v) => {
                        let n: u64 = v.as_ref().and_then(|(b, _)| std::str::from_utf8(b).ok()?.parse().ok()).unwrap_or(0);
                        history.record(c, "read", &lock, invoke, "ok", json!({"session": sid, "token": token, "value": n}));
                        Some(n)
                    }
                    Err(FenceError::Stale { seen, .. }) => {
                        history.record(c, "read", &lock, invoke, "fail", json!({"session": sid, "token": token, "stale": true, "seen": seen}));
                        None
                    }
                    Err(e) => {
                        history.record(c, "read", &lock, invoke, "unknown", json!({"session": sid, "token": token, "error": e.to_string()}));
                        None
                    }
                };
                if let Some(n) = value {
                    tokio::time::sleep(Duration::from_millis(rng.next(args.pause_ms + 1))).await;
                    let invoke = now_ms();
                    let written = n + 1;
                    match fence.write(&lock, token, written.to_string().as_bytes()).await {
                        Ok(_) => history.record(c, "write", &lock, invoke, "ok", json!({"session": sid, "token": token, "value": written})),
                        Err(FenceError::Stale { seen, .. }) => history.record(c, "write", &lock, invoke, "fail", json!({"session": sid, "token": token, "value": written, "stale": true, "seen": seen})),
                        Err(e) => history.record(c, "write", &lock, invoke, "unknown", json!({"session": sid, "token": token, "value": written, "error": e.to_string()})),
                    }
                }
                let invoke = now_ms();
                let released = guard.release().await;
                let (result, fields) = match &released {
                    Ok(()) => ("ok", json!({"session": sid, "token": token})),
                    Err(e) => (classify(e), json!({"session": sid, "token": token, "error": e.to_string()})),
                };
                history.record(c, "release", &lock, invoke, result, fields);
                // Now and then a linearizable read of a lock, checked against the log by the checker.
                if rng.next(3) == 0 {
                    let read = format!("wl/{}", rng.next(args.locks as u64));
                    let invoke = now_ms();
                    match client.describe(&read).await {
                        Ok(l) => {
                            let (holder, token) = l.map_or((0, 0), |l| (l.holder_session_id, l.token));
                            history.record(c, "describe", &read, invoke, "ok", json!({"session": holder, "token": token}));
                        }
                        Err(e) => history.record(c, "describe", &read, invoke, classify(&e), json!({"error": e.to_string()})),
                    }
                }
            }
            if let Some(s) = session {
                let _ = tokio::time::timeout(Duration::from_secs(2), s.close()).await;
            }
            anyhow::Ok(())
        }));
    }
    // A watcher of every lock: the checker compares what it delivered with group 0's log (P9).
    let watcher = tokio::spawn(watch_all(client.clone(), history.clone(), args.clients));
    for t in tasks {
        t.await??;
    }
    // Wait for the watcher to stop: returning while it records a line let the process exit in the
    // middle of one (a fault test's checker then found a history line cut short).
    watcher.abort();
    let _ = watcher.await;
    Ok(ExitCode::SUCCESS)
}

/// Records a `watch-start` and then every event of group 0 (whose audit log the checker has); a watch
/// that ends for good (its position compacted away) is started again from now.
async fn watch_all(client: holdfast_client::Client, history: Arc<History>, c: usize) {
    loop {
        let invoke = now_ms();
        let mut watch = match client.watch("").await {
            Ok(w) => w,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let after = watch.position().groups[0].0 - 1;
        history.record(c, "watch-start", "", invoke, "ok", json!({"value": after}));
        while let Ok(e) = watch.next().await {
            if e.group != 0 {
                continue;
            }
            let kind = super::watch::kind(e.kind);
            history.record(
                c,
                "watch",
                &e.name,
                now_ms(),
                "ok",
                json!({"index": e.index, "kind": kind, "session": e.session, "token": e.token}),
            );
        }
    }
}
