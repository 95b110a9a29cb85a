//! The simulated world's hosts: five real `holdfast_server::Node`s (`n1`..`n5`) and the reference fenced
//! store (`store`), each a turmoil host with its own disk. A crashed host loses what it had not synced and
//! is restarted by running its closure again, exactly like a process restart on a real machine.

use crate::plan::Plan;
use holdfast_server::config::AuditSink;
use holdfast_server::node::NodeShared;
use holdfast_server::{Member, Node, ServerConfig};
use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

pub const CLIENT_PORT: u16 = 7001;
pub const PEER_PORT: u16 = 7101;
pub const STORE_PORT: u16 = 7300;
pub const STORE_FILE: &str = "/store/fenced.log";

pub fn server_name(i: usize) -> String {
    format!("n{}", i + 1)
}

pub fn client_endpoints() -> Vec<String> {
    (0..crate::plan::SERVERS)
        .map(|i| format!("{}:{CLIENT_PORT}", server_name(i)))
        .collect()
}

/// What the driver can see of the world without going through the network.
#[derive(Default)]
pub struct Shared {
    /// The running server per index; a weak reference, so a crashed server's state is not kept alive.
    pub nodes: Mutex<BTreeMap<usize, Weak<NodeShared>>>,
    /// Every audit line each server wrote, per server and group (`audits[server][group]`), across
    /// restarts (re-applied entries appear again).
    pub audits: Vec<Vec<Arc<Mutex<Vec<u8>>>>>,
    /// How many times each server has started; part of its Raft seed.
    pub boots: Mutex<Vec<u64>>,
    /// Set by the driver at the end; the store host then copies its file's records into `store_records`.
    pub dump_store: Mutex<bool>,
    pub store_records: Mutex<Option<Vec<holdfast_fence::store::Record>>>,
    /// The node id each server index runs as now (index + 1 until a `Replace` gives it a new one).
    pub ids: Mutex<Vec<u64>>,
    /// Servers whose next start begins with an empty data dir and joins (`Replace`).
    pub wipe: Mutex<Vec<bool>>,
    /// The cluster id, recorded by the first server that starts (a joining server needs it).
    pub cluster_id: Mutex<Option<u64>>,
    /// Membership operations for the admin host, in order.
    pub admin: Mutex<std::collections::VecDeque<AdminOp>>,
    /// Damage to do to each server's data dir before its next start (`Fault::Corrupt`).
    pub corrupt: Mutex<Vec<Option<crate::corrupt::Corruption>>>,
    /// Servers that refused to start on a damaged file, with the error, for the driver to replace.
    pub refused: Mutex<Vec<Option<String>>>,
    /// What each corruption did and how the server took it, for the fault log; and the violations
    /// (a server that started on a damaged file, or refused without naming it).
    pub corruption_log: Mutex<Vec<String>>,
    pub corruption_violations: Mutex<Vec<String>>,
}

/// What the admin host does (see `run::admin_host`).
#[derive(Clone, Debug)]
pub enum AdminOp {
    /// Add `new` (running on server index `server`), then remove `old`.
    Replace {
        server: usize,
        old: u64,
        new: u64,
    },
    TransferLeader,
}

impl Shared {
    pub fn new(groups: u32) -> Arc<Shared> {
        Arc::new(Shared {
            audits: (0..crate::plan::SERVERS)
                .map(|_| {
                    (0..groups)
                        .map(|_| Arc::new(Mutex::new(Vec::new())))
                        .collect()
                })
                .collect(),
            boots: Mutex::new(vec![0; crate::plan::SERVERS]),
            ids: Mutex::new((1..=crate::plan::SERVERS as u64).collect()),
            wipe: Mutex::new(vec![false; crate::plan::SERVERS]),
            corrupt: Mutex::new(vec![None; crate::plan::SERVERS]),
            refused: Mutex::new(vec![None; crate::plan::SERVERS]),
            ..Shared::default()
        })
    }

    pub fn node(&self, i: usize) -> Option<Arc<NodeShared>> {
        self.nodes.lock().unwrap().get(&i).and_then(Weak::upgrade)
    }
}

struct SinkWriter(Arc<Mutex<Vec<u8>>>);

impl Write for SinkWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The configuration of server `i` on its `boot`-th start.
pub fn server_config(i: usize, plan: &Plan, boot: u64, shared: &Arc<Shared>) -> ServerConfig {
    let seed = plan.seed;
    let ids = shared.ids.lock().unwrap().clone();
    let members = (0..crate::plan::SERVERS)
        .map(|m| Member {
            id: ids[m],
            client: format!("{}:{CLIENT_PORT}", server_name(m)),
            peer: format!("{}:{PEER_PORT}", server_name(m)),
        })
        .collect();
    let audit = shared.audits[i].clone();
    ServerConfig {
        node_id: ids[i],
        client_listen: Some(SocketAddr::from(([0, 0, 0, 0], CLIENT_PORT))),
        peer_listen: Some(SocketAddr::from(([0, 0, 0, 0], PEER_PORT))),
        http_listen: None,
        // A server that lost its disk (`Replace`) starts on a new, empty directory under its new id.
        data_dir: if ids[i] == i as u64 + 1 {
            "/data".into()
        } else {
            format!("/data-node{}", ids[i]).into()
        },
        members,
        // Drawn per seed (`Knobs`): small ones make runs take and install snapshots, purge the log and
        // rotate WAL segments.
        snapshot_every_entries: plan.knobs.snapshot_every_entries,
        snapshot_keep_entries: plan.knobs.snapshot_keep_entries,
        snapshot_every_bytes: plan.knobs.snapshot_every_bytes,
        snapshot_log_percent: plan.knobs.snapshot_log_percent,
        wal_segment_bytes: plan.knobs.wal_segment_bytes,
        heartbeat_interval_ms: plan.knobs.heartbeat_interval_ms,
        election_timeout_min_ms: plan.knobs.election_timeout_min_ms,
        election_timeout_max_ms: plan.knobs.election_timeout_max_ms,
        rng_seed: Some(
            seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9) ^ boot.wrapping_mul(0x85eb_ca6b),
        ),
        audit_sink: Some(AuditSink(Arc::new(move |group| {
            Box::new(SinkWriter(audit[group as usize].clone()))
        }))),
        groups: plan.knobs.groups,
        clock_rate_ppm: plan.clock_ppm[i],
        sim_fsync: Duration::from_micros(plan.fsync_us),
        sim_table_budget_bytes: plan.knobs.table_budget_bytes,
        sim_wal_batch_bytes: plan.knobs.wal_batch_bytes,
        unload_after_ms: plan.knobs.unload_after_ms,
        sim_unload_voters: plan.knobs.unload_voters,
        ..ServerConfig::default()
    }
}

/// Registers the five servers and the store as turmoil hosts.
pub fn add_hosts(sim: &mut turmoil::Sim<'_>, plan: &Plan, shared: &Arc<Shared>) {
    for i in 0..crate::plan::SERVERS {
        let shared = shared.clone();
        let plan = plan.clone();
        sim.host(server_name(i), move || {
            let shared = shared.clone();
            let plan = plan.clone();
            async move {
                let boot = {
                    let mut boots = shared.boots.lock().unwrap();
                    boots[i] += 1;
                    boots[i]
                };
                let mut config = server_config(i, &plan, boot, &shared);
                let wipe = std::mem::take(&mut shared.wipe.lock().unwrap()[i]);
                if wipe {
                    // The lost disk: a new, empty data dir (see `server_config`), joining under its new id.
                    config.join = true;
                    config.cluster_id = shared
                        .cluster_id
                        .lock()
                        .unwrap()
                        .map(|c| format!("{c:016x}"));
                }
                // A `Corrupt` fault: damage a file first; the server must then refuse to start.
                let corruption = shared.corrupt.lock().unwrap()[i].take();
                let damaged = match corruption {
                    Some(c) => crate::corrupt::apply(&config.data_dir, c)?,
                    None => None,
                };
                if corruption.is_some() {
                    shared.corruption_log.lock().unwrap().push(format!(
                        "server {} boot {boot}: {}",
                        i + 1,
                        damaged
                            .as_ref()
                            .map_or("nothing to damage".into(), |d| d.1.clone())
                    ));
                }
                let node = match (Node::start(config).await, damaged) {
                    (Ok(node), None) => node,
                    (Ok(node), Some((_, what))) => {
                        shared.corruption_violations.lock().unwrap().push(format!(
                            "server {} started on a damaged file ({what})",
                            i + 1
                        ));
                        node
                    }
                    (Err(e), Some((path, _))) => {
                        let msg = e.to_string();
                        let file = path.file_name().map(|f| f.to_string_lossy().into_owned());
                        if !file.is_some_and(|f| msg.contains(&f)) {
                            shared.corruption_violations.lock().unwrap().push(format!(
                                "server {} refused to start on damaged {} without naming it: {msg}",
                                i + 1,
                                path.display()
                            ));
                        }
                        shared
                            .corruption_log
                            .lock()
                            .unwrap()
                            .push(format!("server {} refused to start: {msg}", i + 1));
                        shared.refused.lock().unwrap()[i] = Some(msg);
                        // Down until the driver replaces it (which restarts this host).
                        std::future::pending::<()>().await;
                        unreachable!("a pending future never completes")
                    }
                    (Err(e), None) => return Err(e.into()),
                };
                shared
                    .cluster_id
                    .lock()
                    .unwrap()
                    .get_or_insert(node.shared.cluster_id);
                shared
                    .nodes
                    .lock()
                    .unwrap()
                    .insert(i, Arc::downgrade(&node.shared));
                let reason = node.fatal().await;
                if holdfast_wal::failpoint::sim_reached_here() {
                    // It stopped on the I/O error of its failpoint; the driver crashes it next.
                    std::future::pending::<()>().await;
                }
                Err(format!("server {} stopped: {reason}", i + 1).into())
            }
        });
    }
    let shared = shared.clone();
    sim.host("store", move || {
        let shared = shared.clone();
        async move {
            holdfast_wal::fs::create_dir_all(Path::new(STORE_FILE).parent().unwrap())?;
            let store = Arc::new(holdfast_fence::store::FencedStore::open(Path::new(
                STORE_FILE,
            ))?);
            let listener = holdfast_proto::transport::Listener::bind(SocketAddr::from((
                [0, 0, 0, 0],
                STORE_PORT,
            )))
            .await?;
            tokio::spawn(holdfast_fence::service::serve_listener(
                listener,
                store,
                std::future::pending(),
            ));
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let dump = std::mem::take(&mut *shared.dump_store.lock().unwrap());
                if dump {
                    let records = holdfast_fence::store::read_records(Path::new(STORE_FILE))?;
                    *shared.store_records.lock().unwrap() = Some(records);
                }
            }
        }
    });
}
