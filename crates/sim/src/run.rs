//! Runs one seed: builds the world, plays the plan's faults, heals everything, checks that the cluster
//! recovers (P7), then hands the history, the servers' audit logs and the store's records to the
//! invariants. Everything that happens is a function of the seed, so `--seed N` replays a run exactly;
//! [`Outcome::trace`] is what the determinism test compares.

use crate::cluster::{self, server_name, Shared};
use crate::plan::{Event, Fault, Plan, CLIENT_HOSTS, SERVERS};
use crate::workload::{self, History};
use holdfast_checker::{AuditLine, Op, StoreRecord};
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

/// After the faults heal: how long the cluster gets to serve a fresh client and converge (P7).
pub const HEAL_BUDGET_MS: u64 = 15_000;

#[derive(Clone, Debug)]
pub struct Options {
    /// How long the workload runs (simulated).
    pub work_ms: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options { work_ms: 12_000 }
    }
}

/// What a run produced, for the invariants.
#[derive(Debug, Default)]
pub struct Outcome {
    pub seed: u64,
    pub history: Vec<Op>,
    /// Raft groups (`Knobs::groups`).
    pub groups: u32,
    /// Per group, per server id, every audit line it wrote for that group.
    pub audits: Vec<Vec<(u64, Vec<AuditLine>)>>,
    pub store: Vec<StoreRecord>,
    /// P7: how long after the heal a fresh client completed open + acquire + release, if it did.
    pub recovered_after_ms: Option<u64>,
    /// P7: how long after the heal every server had applied the same index with the same digest.
    pub converged_after_ms: Option<u64>,
    /// The fault log and every observable result, in order; equal for equal seeds.
    pub trace: Vec<String>,
    /// The first lines of `trace` are the plan and the fault log.
    pub fault_log_len: usize,
    /// An error the simulation itself reported (a host failed or panicked).
    pub sim_error: Option<String>,
    /// Server replacements (`Fault::Replace`) the admin was asked for, and how many it completed (new
    /// member added and old one removed, configuration no longer joint).
    pub replacements_asked: u64,
    pub replacements_done: u64,
    /// Leader transfers the admin asked for and that returned a new leader.
    pub leader_transfers: u64,
    /// Damaged files a server refused to start on (`Fault::Corrupt`), and what went wrong with one
    /// (a server that started on one, or refused without naming it).
    pub corruptions_detected: u64,
    pub corruption_violations: Vec<String>,
    /// Entries refused for a full table (`Refusal::TableFull`), as the server that applied the most
    /// of them counts them.
    pub table_full_refusals: u64,
    /// Servers crashed at an armed failpoint (`Fault::Failpoint`), and servers stalled (`Fault::Stall`).
    pub failpoint_crashes: u64,
    pub stalls: u64,
    /// Unloaded tables loaded back (`Knobs::unload_after_ms`), over every server of the seed.
    pub table_reloads: u64,
}

/// The links a partition cuts: between the servers in `side` (with the client hosts `clients`) and the
/// other servers (with the other client hosts). Clients never talk to each other; the store is not cut.
fn partition(side: &[usize], clients: &[usize]) -> Vec<(String, String)> {
    let client = |c: usize| format!("c{}", c + 1);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for s in 0..SERVERS {
        let to = if side.contains(&s) { &mut a } else { &mut b };
        to.push((server_name(s), true));
    }
    for c in 0..CLIENT_HOSTS {
        let to = if clients.contains(&c) { &mut a } else { &mut b };
        to.push((client(c), false));
    }
    let mut cuts = Vec::new();
    for (x, x_server) in &a {
        for (y, y_server) in &b {
            if *x_server || *y_server {
                cuts.push((x.clone(), y.clone()));
            }
        }
    }
    cuts
}

/// A fault in force: when it ends, the server it crashed and the links it cut (resolved when it started).
struct Active {
    end_ms: u64,
    fault: Fault,
    crashed: Option<usize>,
    cuts: Vec<(String, String)>,
    /// The server a `Fault::Stall` stalled.
    stalled: Option<usize>,
    /// The runtime a `Fault::Failpoint` armed.
    armed: Option<tokio::runtime::Id>,
}

struct Driver<'a> {
    sim: turmoil::Sim<'a>,
    shared: Arc<Shared>,
    /// Servers crashed and not yet restarted.
    down: BTreeSet<usize>,
    trace: Vec<String>,
    /// Active faults: when each ends, and which crash it was (for restarts).
    ending: Vec<Active>,
    max_latency_ms: u64,
}

/// The links a stall of server `s` holds: to the other servers, the client hosts, the admin and the probe.
fn stall_links(s: usize) -> Vec<(String, String)> {
    (0..SERVERS)
        .filter(|&o| o != s)
        .map(server_name)
        .chain((0..CLIENT_HOSTS).map(|c| format!("c{}", c + 1)))
        .chain(["admin".to_string(), "probe".to_string()])
        .map(|other| (server_name(s), other))
        .collect()
}

/// The links a pause of client host `host` holds: to every server and the store.
fn pause_links(host: usize) -> Vec<(String, String)> {
    let c = format!("c{}", host + 1);
    (0..SERVERS)
        .map(server_name)
        .chain(["store".to_string()])
        .map(|s| (c.clone(), s))
        .collect()
}

impl Driver<'_> {
    fn now_ms(&self) -> u64 {
        self.sim.elapsed().as_millis() as u64
    }

    fn log(&mut self, what: String) {
        let line = format!("{:>6} {what}", self.now_ms());
        self.trace.push(line);
    }

    fn leader(&mut self) -> Option<usize> {
        let mut best: Option<(u64, usize)> = None;
        for i in 0..SERVERS {
            if self.down.contains(&i) || !self.sim.is_host_running(server_name(i)) {
                continue;
            }
            if let Some(node) = self.shared.node(i) {
                let m = node.groups[0].raft_metrics();
                if m.current_leader == Some(self.shared.ids.lock().unwrap()[i])
                    && best.is_none_or(|(t, _)| m.current_term > t)
                {
                    best = Some((m.current_term, i));
                }
            }
        }
        best.map(|(_, i)| i)
    }

    fn start(&mut self, e: &Event) {
        let end = self.now_ms() + e.duration_ms;
        let mut crashed = None;
        let mut stalled = None;
        let mut armed = None;
        let mut cuts = Vec::new();
        match &e.fault {
            Fault::Partition { side, clients } => cuts = partition(side, clients),
            Fault::IsolateLeader { clients } => {
                if let Some(leader) = self.leader() {
                    cuts = partition(&[leader], clients);
                }
            }
            Fault::OneWay { from, to } => {
                let (a, b) = (server_name(*from), server_name(*to));
                self.sim.partition_oneway(a.as_str(), b.as_str());
            }
            Fault::Hold { a, b } => {
                let (a, b) = (server_name(*a), server_name(*b));
                self.sim.hold(a.as_str(), b.as_str());
            }
            Fault::Slow { a, b, max_ms } => {
                let (a, b) = (server_name(*a), server_name(*b));
                self.sim.set_link_max_message_latency(
                    a.as_str(),
                    b.as_str(),
                    Duration::from_millis(*max_ms),
                );
            }
            Fault::Crash { server } => crashed = Some(*server),
            Fault::CrashLeader => crashed = self.leader(),
            Fault::PauseClient { host } => {
                for (a, b) in pause_links(*host) {
                    self.sim.hold(a.as_str(), b.as_str());
                }
            }
            Fault::Replace { server } | Fault::Corrupt { server, .. } => {
                // One replacement at a time per server, and not of a server already down.
                let replacing = self.ending.iter().any(|a| {
                    matches!(a.fault, Fault::Replace { server: s } | Fault::Corrupt { server: s, .. } if s == *server)
                });
                let refused = self.shared.refused.lock().unwrap()[*server].is_some();
                if !replacing && !refused && !self.down.contains(server) {
                    crashed = Some(*server);
                }
            }
            Fault::TransferLeader => self
                .shared
                .admin
                .lock()
                .unwrap()
                .push_back(crate::cluster::AdminOp::TransferLeader),
            Fault::Failpoint {
                server, point, at, ..
            } => {
                let node = self.shared.ids.lock().unwrap()[*server];
                if let Some(rt) =
                    holdfast_server::skew::runtime_of(node).filter(|_| !self.down.contains(server))
                {
                    holdfast_wal::failpoint::sim_arm(rt, &format!("{point}={at}"))
                        .expect("a failpoint of the list");
                    armed = Some(rt);
                }
            }
            Fault::Stall { server } => {
                let s = server.or_else(|| self.leader());
                if let Some(s) = s.filter(|s| !self.down.contains(s)) {
                    let node = self.shared.ids.lock().unwrap()[s];
                    if holdfast_server::skew::stall(node, Duration::from_millis(e.duration_ms)) {
                        for (a, b) in stall_links(s) {
                            self.sim.hold(a.as_str(), b.as_str());
                        }
                        stalled = Some(s);
                    }
                }
            }
        }
        if let Some(s) = crashed {
            if self.down.insert(s) {
                self.sim.crash(server_name(s));
                // Its state is gone with its runtime; the restarted server registers anew.
                self.shared.nodes.lock().unwrap().remove(&s);
            } else {
                crashed = None;
            }
        }
        for (a, b) in &cuts {
            self.sim.partition(a.as_str(), b.as_str());
        }
        self.log(format!(
            "start {:?} for {} ms (crashed: {crashed:?}, stalled: {stalled:?}, armed: {}, cut: {cuts:?})",
            e.fault,
            e.duration_ms,
            armed.is_some()
        ));
        self.ending.push(Active {
            end_ms: end,
            fault: e.fault.clone(),
            crashed,
            cuts,
            stalled,
            armed,
        });
        self.reassert_links();
    }

    /// Puts back what every fault still in force does to its links. A turmoil link has one state per
    /// direction, which `hold`, `release`, `partition` and `repair` overwrite, so a fault ending (or
    /// starting) on a link that another fault also uses would otherwise undo that one: a client pause
    /// ending during a stall would let the stalled server answer, a stall ending would end a partition.
    /// Holds first, then cuts, so a cut link stays cut while it is also held.
    fn reassert_links(&mut self) {
        let holds = self.held_links();
        for (a, b) in &holds {
            self.sim.hold(a.as_str(), b.as_str());
        }
        for a in &self.ending {
            for (x, y) in &a.cuts {
                self.sim.partition(x.as_str(), y.as_str());
            }
            if let Fault::OneWay { from, to } = a.fault {
                let (x, y) = (server_name(from), server_name(to));
                self.sim.partition_oneway(x.as_str(), y.as_str());
            }
        }
    }

    /// Releases the link between `a` and `b` (delivering what it held) unless a fault still in force
    /// holds it too.
    fn release(&mut self, a: &str, b: &str) {
        let pair = |x: &str, y: &str| {
            if x < y {
                (x.to_string(), y.to_string())
            } else {
                (y.to_string(), x.to_string())
            }
        };
        let wanted = pair(a, b);
        if !self.held_links().iter().any(|(x, y)| pair(x, y) == wanted) {
            self.sim.release(a, b);
        }
    }

    /// Every link a fault in force holds.
    fn held_links(&self) -> Vec<(String, String)> {
        let mut holds = Vec::new();
        for a in &self.ending {
            match &a.fault {
                Fault::Hold { a, b } => holds.push((server_name(*a), server_name(*b))),
                Fault::PauseClient { host } => {
                    holds.extend(pause_links(*host));
                }
                Fault::Stall { .. } => {
                    if let Some(s) = a.stalled {
                        holds.extend(stall_links(s));
                    }
                }
                _ => {}
            }
        }
        holds
    }

    /// Crashes every server that reached its armed failpoint in the last step (`Fault::Failpoint`),
    /// and restarts it when its fault says.
    fn crash_at_failpoints(&mut self) {
        for rt in holdfast_wal::failpoint::sim_take_crashed() {
            let ids = self.shared.ids.lock().unwrap().clone();
            let Some(s) =
                (0..SERVERS).find(|&s| holdfast_server::skew::runtime_of(ids[s]) == Some(rt))
            else {
                continue;
            };
            let restart_ms = self.ending.iter().find_map(|a| match a.fault {
                Fault::Failpoint {
                    server, restart_ms, ..
                } if server == s && a.armed == Some(rt) => Some(restart_ms),
                _ => None,
            });
            let Some(restart_ms) = restart_ms else {
                continue;
            };
            if !self.down.insert(s) {
                continue;
            }
            self.sim.crash(server_name(s));
            self.shared.nodes.lock().unwrap().remove(&s);
            self.log(format!(
                "server {} reached its failpoint: crashed, restarts in {restart_ms} ms",
                s + 1
            ));
            self.ending.push(Active {
                end_ms: self.now_ms() + restart_ms,
                fault: Fault::Crash { server: s },
                crashed: Some(s),
                cuts: Vec::new(),
                stalled: None,
                armed: None,
            });
        }
    }

    /// The disk of server `s` is gone: it starts empty under the next unused id, and the admin adds
    /// that id and removes the old one.
    fn replace_disk(&mut self, s: usize) {
        let (old, new) = {
            let mut ids = self.shared.ids.lock().unwrap();
            let new = ids.iter().max().unwrap() + 1;
            let old = std::mem::replace(&mut ids[s], new);
            (old, new)
        };
        self.shared.wipe.lock().unwrap()[s] = true;
        self.sim.bounce(server_name(s));
        self.shared
            .admin
            .lock()
            .unwrap()
            .push_back(crate::cluster::AdminOp::Replace {
                server: s,
                old,
                new,
            });
        self.log(format!("server {} now runs node {new} (was {old})", s + 1));
    }

    /// A server that refused to start on a damaged file is replaced, as an operator would.
    fn replace_refused(&mut self) {
        let refused: Vec<usize> = {
            let mut r = self.shared.refused.lock().unwrap();
            (0..r.len()).filter(|&s| r[s].take().is_some()).collect()
        };
        let lines = std::mem::take(&mut *self.shared.corruption_log.lock().unwrap());
        for line in lines {
            self.log(line);
        }
        for s in refused {
            self.replace_disk(s);
        }
    }

    fn stop(
        &mut self,
        fault: &Fault,
        crashed: Option<usize>,
        stalled: Option<usize>,
        cuts: Vec<(String, String)>,
    ) {
        for (a, b) in cuts {
            self.sim.repair(a.as_str(), b.as_str());
        }
        match fault {
            Fault::Partition { .. } | Fault::IsolateLeader { .. } => {}
            Fault::OneWay { from, to } => {
                let (a, b) = (server_name(*from), server_name(*to));
                self.sim.repair_oneway(a.as_str(), b.as_str());
            }
            Fault::Hold { a, b } => {
                let (a, b) = (server_name(*a), server_name(*b));
                self.release(a.as_str(), b.as_str());
            }
            Fault::Slow { a, b, .. } => {
                let (a, b) = (server_name(*a), server_name(*b));
                self.sim.set_link_max_message_latency(
                    a.as_str(),
                    b.as_str(),
                    Duration::from_millis(self.max_latency_ms),
                );
            }
            Fault::Crash { .. } | Fault::CrashLeader => {
                if let Some(s) = crashed {
                    self.down.remove(&s);
                    self.sim.bounce(server_name(s));
                }
            }
            Fault::PauseClient { host } => {
                for (a, b) in pause_links(*host) {
                    self.release(a.as_str(), b.as_str());
                }
            }
            Fault::Replace { .. } => {
                if let Some(s) = crashed {
                    self.down.remove(&s);
                    self.replace_disk(s);
                }
            }
            Fault::Corrupt { corruption, .. } => {
                if let Some(s) = crashed {
                    // It starts on its damaged disk; once it refuses, `replace_refused` replaces it.
                    self.shared.corrupt.lock().unwrap()[s] = Some(*corruption);
                    self.down.remove(&s);
                    self.sim.bounce(server_name(s));
                }
            }
            Fault::TransferLeader => {}
            Fault::Failpoint { .. } => {}
            Fault::Stall { .. } => {
                // Its clock resumed by itself at the same moment (`skew::stall` was given the fault's
                // length); now what it sent and what was sent to it meanwhile arrives at once.
                if let Some(s) = stalled {
                    for (a, b) in stall_links(s) {
                        self.release(a.as_str(), b.as_str());
                    }
                }
            }
        }
        self.log(format!("stop {fault:?}"));
    }

    fn heal(&mut self) {
        // Every link, not just the ones the faults in force name: overlapping faults on one link can
        // leave a direction cut that no fault would undo (an isolation's cut, partly repaired by a
        // one-way fault ending on the same pair, stayed cut after the heal in seed 2648: a false P7
        // failure).
        let mut hosts: Vec<String> = (0..SERVERS).map(server_name).collect();
        hosts.push("store".into());
        hosts.extend((0..CLIENT_HOSTS).map(|c| format!("c{}", c + 1)));
        hosts.extend(["admin".to_string(), "probe".to_string()]);
        for (i, a) in hosts.iter().enumerate() {
            for b in &hosts[i + 1..] {
                self.sim.repair(a.as_str(), b.as_str());
                self.sim.release(a.as_str(), b.as_str());
            }
        }
        for (a, b) in self.ending.iter().filter_map(|f| match f.fault {
            Fault::Slow { a, b, .. } => Some((server_name(a), server_name(b))),
            _ => None,
        }) {
            self.sim.set_link_max_message_latency(
                a.as_str(),
                b.as_str(),
                Duration::from_millis(self.max_latency_ms),
            );
        }
        for s in std::mem::take(&mut self.down) {
            self.sim.bounce(server_name(s));
        }
        for rt in self.ending.iter().filter_map(|a| a.armed) {
            holdfast_wal::failpoint::sim_disarm(rt);
        }
        self.ending.clear();
        self.log("heal: every link repaired, every server running".into());
    }

    /// P7 part 2: in every group, every server applied the same index and has the same digest.
    fn converged(&self) -> bool {
        let mut seen: Option<Vec<(u64, u64)>> = None;
        for i in 0..SERVERS {
            let Some(node) = self.shared.node(i) else {
                return false;
            };
            let here: Vec<(u64, u64)> = node
                .status(true)
                .groups
                .iter()
                .map(|g| (g.applied_index, g.digest))
                .collect();
            if here.iter().any(|&(applied, _)| applied == 0)
                || seen.as_ref().is_some_and(|s| *s != here)
            {
                return false;
            }
            seen = Some(here);
        }
        true
    }
}

/// Runs `seed` and returns everything the invariants need. Panics inside hosts are reported as
/// `sim_error`, not propagated.
pub fn run(seed: u64, options: &Options) -> Outcome {
    // Clocks and failpoints of an earlier seed run in this process are gone with its hosts.
    holdfast_server::skew::reset();
    holdfast_server::state_machine::SIM_RELOADS.store(0, std::sync::atomic::Ordering::Relaxed);
    holdfast_wal::failpoint::sim_reset();
    let plan = Plan::new(seed, options.work_ms);
    let heal_ms = options.work_ms + 500;
    let mut builder = turmoil::Builder::new();
    builder
        .rng_seed(seed)
        .epoch(UNIX_EPOCH + Duration::from_secs(1_790_000_000))
        .simulation_duration(Duration::from_millis(heal_ms + HEAL_BUDGET_MS + 5_000))
        .min_message_latency(Duration::from_micros(100))
        .max_message_latency(Duration::from_millis(plan.max_latency_ms))
        .tcp_capacity(4096);
    builder.fs().sync_probability(plan.background_sync);
    if let Some(block) = plan.torn_block {
        builder.fs().block_size(block);
    }
    let mut sim = builder.build();
    let shared = Shared::new(plan.knobs.groups);
    cluster::add_hosts(&mut sim, &plan, &shared);
    let history: History = Arc::new(Mutex::new(Vec::new()));
    let epoch_ms = 1_790_000_000_000u64;
    for h in 0..CLIENT_HOSTS {
        let history = history.clone();
        let knobs = plan.knobs.clone();
        let until = epoch_ms + options.work_ms;
        sim.client(format!("c{}", h + 1), async move {
            workload::client_host(h, seed, until, history, knobs).await
        });
    }
    let admin_log: crate::admin::AdminLog = Arc::default();
    {
        let (shared, log) = (shared.clone(), admin_log.clone());
        sim.client("admin", async move {
            crate::admin::admin_host(
                shared,
                seed,
                epoch_ms + heal_ms,
                epoch_ms + heal_ms + HEAL_BUDGET_MS,
                log,
            )
            .await
        });
    }
    let probe: Arc<Mutex<Option<u64>>> = Arc::default();
    {
        let probe = probe.clone();
        sim.client("probe", async move {
            crate::invariants::p7_liveness::probe(seed, epoch_ms + heal_ms, probe).await
        });
    }

    let mut d = Driver {
        sim,
        shared: shared.clone(),
        down: BTreeSet::new(),
        trace: vec![format!("seed {seed} plan {plan:?}")],
        ending: Vec::new(),
        max_latency_ms: plan.max_latency_ms,
    };
    let mut pending: std::collections::VecDeque<Event> = plan.events.iter().cloned().collect();
    let mut healed = false;
    let mut converged_after_ms = None;
    let mut sim_error = None;
    loop {
        let now = d.now_ms();
        while pending.front().is_some_and(|e| e.at_ms <= now) {
            let e = pending.pop_front().unwrap();
            d.start(&e);
        }
        // Before any fault ends: a failpoint's own end disarms it, and its crash needs its restart time.
        d.crash_at_failpoints();
        let mut i = 0;
        while i < d.ending.len() {
            if d.ending[i].end_ms <= now {
                let Active {
                    fault,
                    crashed,
                    stalled,
                    armed,
                    cuts,
                    ..
                } = d.ending.remove(i);
                if let Some(rt) = armed {
                    holdfast_wal::failpoint::sim_disarm(rt);
                }
                d.stop(&fault, crashed, stalled, cuts);
                d.reassert_links();
            } else {
                i += 1;
            }
        }
        d.replace_refused();
        if !healed && now >= heal_ms {
            d.heal();
            healed = true;
        }
        if healed && converged_after_ms.is_none() && now.is_multiple_of(50) && d.converged() {
            converged_after_ms = Some(now - heal_ms);
            d.log(format!("converged {} ms after the heal", now - heal_ms));
        }
        match d.sim.step() {
            // Done when every client finished (the probe ends once it got through, or gave up) and the
            // servers converged, or when the heal budget is spent.
            Ok(clients_done)
                if (clients_done && converged_after_ms.is_some())
                    || now >= heal_ms + HEAL_BUDGET_MS =>
            {
                break
            }
            Ok(_) => {}
            Err(e) => {
                sim_error = Some(e.to_string());
                break;
            }
        }
    }

    // The store's records, read on the store host from its own disk.
    *shared.dump_store.lock().unwrap() = true;
    let mut store = Vec::new();
    for _ in 0..1_000 {
        if let Some(records) = shared.store_records.lock().unwrap().take() {
            store = records
                .into_iter()
                .map(|r| StoreRecord::new(r.write, r.key, r.token, &r.value))
                .collect();
            break;
        }
        if let Err(e) = d.sim.step() {
            sim_error.get_or_insert(e.to_string());
            break;
        }
    }

    let mut history = std::mem::take(&mut *history.lock().unwrap());
    history.sort_by_key(|o| (o.complete_ms, o.process, o.client));
    let mut audits: Vec<Vec<(u64, Vec<AuditLine>)>> =
        (0..plan.knobs.groups).map(|_| Vec::new()).collect();
    for (i, groups) in shared.audits.iter().enumerate() {
        for (g, text) in groups.iter().enumerate() {
            let text = String::from_utf8_lossy(&text.lock().unwrap()).into_owned();
            match holdfast_checker::parse_lines::<AuditLine>(&text) {
                Ok(lines) => audits[g].push((i as u64 + 1, lines)),
                Err(e) => {
                    sim_error = Some(format!("server {} group {g}: bad audit line: {e}", i + 1))
                }
            }
        }
    }
    let mut trace = std::mem::take(&mut d.trace);
    let admin_lines = std::mem::take(&mut *admin_log.lock().unwrap());
    let count =
        |lines: &[String], what: &str| lines.iter().filter(|l| l.contains(what)).count() as u64;
    let replacements_asked = count(&trace, " now runs node ");
    let replacements_done = count(&admin_lines, " admin replaced ");
    let corruptions_detected = count(&trace, " refused to start: ");
    let corruption_violations = std::mem::take(&mut *shared.corruption_violations.lock().unwrap());
    let leader_transfers = count(&admin_lines, " admin transfer leader: now ");
    trace.extend(admin_lines);
    // Per group, as the server that applied the most of them counts them.
    let table_full_refusals = audits
        .iter()
        .map(|group| {
            group
                .iter()
                .map(|(_, lines)| {
                    lines
                        .iter()
                        .filter(|l| {
                            matches!(
                                l.outcome,
                                holdfast_lock_table::Outcome::Refused(
                                    holdfast_lock_table::Refusal::TableFull { .. }
                                )
                            )
                        })
                        .count() as u64
                })
                .max()
                .unwrap_or(0)
        })
        .sum();
    let failpoint_crashes = count(&trace, " reached its failpoint: crashed");
    let stalls = trace
        .iter()
        .filter(|l| l.contains(" start Stall ") && !l.contains("stalled: None"))
        .count() as u64;
    let table_reloads =
        holdfast_server::state_machine::SIM_RELOADS.load(std::sync::atomic::Ordering::Relaxed);
    let fault_log_len = trace.len();
    trace.extend(history.iter().map(|o| format!("{o:?}")));
    for (g, group) in audits.iter().enumerate() {
        for (id, lines) in group {
            trace.push(format!(
                "server {id} group {g}: {} audit lines",
                lines.len()
            ));
            trace.extend(lines.iter().map(|l| format!("{id} {g} {l:?}")));
        }
    }
    trace.push(format!("store: {} records", store.len()));
    let recovered_after_ms = *probe.lock().unwrap();
    Outcome {
        seed,
        history,
        groups: plan.knobs.groups,
        audits,
        store,
        recovered_after_ms,
        converged_after_ms,
        replacements_asked,
        replacements_done,
        leader_transfers,
        corruptions_detected,
        corruption_violations,
        table_full_refusals,
        failpoint_crashes,
        stalls,
        table_reloads,
        trace,
        fault_log_len,
        sim_error,
    }
}
