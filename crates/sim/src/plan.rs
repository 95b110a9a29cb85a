//! What one seed does: the fault rates and the fault schedule, drawn from the seed alone (TigerBeetle's
//! VOPR style: each seed also draws how hostile its world is, so some seeds are quiet and some are storms).

use crate::rng::Rng;

/// Servers in the simulated cluster.
pub const SERVERS: usize = 5;
/// Client hosts; each runs `Knobs::workers_per_host` workload loops over one `holdfast_client::Client`.
pub const CLIENT_HOSTS: usize = 3;
/// Lock names the workload contends on.
pub const LOCKS: u64 = 3;
/// Largest clock-rate error drawn for a server (2%, forty times what an undisciplined quartz clock drifts).
pub const MAX_CLOCK_PPM: i64 = 20_000;
/// The shortest session TTL a seed's workload uses (the smallest the server accepts); client pauses are
/// drawn longer than the seed's TTL.
pub const TTL_MS: u64 = 2_000;

/// Settings drawn per seed (FoundationDB's BUGGIFY), each within its valid range, from a random stream
/// of their own so that a seed's fault schedule does not depend on them. Printed with the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Knobs {
    /// Snapshot (and purge the log) after this many entries; 100 is the least a server accepts.
    pub snapshot_every_entries: u64,
    pub snapshot_keep_entries: u64,
    /// WAL segment size: small ones rotate, and are purged, within a 12 s run.
    pub wal_segment_bytes: Option<u64>,
    pub heartbeat_interval_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// The workload's session TTL.
    pub ttl_ms: u64,
    /// One acquire in `lock_delay_one_in` asks for a lock-delay of `lock_delay_ms` (0: none does).
    pub lock_delay_one_in: u64,
    pub lock_delay_ms: u64,
    pub snapshot_every_bytes: u64,
    /// `snapshot_log_percent`: 0 (snapshots never wait), the default 25, or 1,000 (a log ten times
    /// the snapshot's size: the workload's small tables then defer most due snapshots).
    pub snapshot_log_percent: u64,
    /// Each group's table budget in bytes (None: the default 1 GiB). The small ones hold the
    /// workload's sessions three times over (1 KiB each) and 4 or 16 KiB more, so opens and acquires
    /// are refused for a full table now and then.
    pub table_budget_bytes: Option<u64>,
    /// Lock-set workers per client host (each with its own session), 1 to 3.
    pub workers_per_host: usize,
    /// The most bytes of appends one WAL group commit takes (None: the server's 4 MiB); small ones
    /// split what queued up into several commits.
    pub wal_batch_bytes: Option<usize>,
    /// Raft groups the lock names are split across (half the seeds 1, else 2 or 3): every session is
    /// opened in each group, every server hosts every group in one WAL, and each group's log is
    /// checked on its own (`holdfast_checker::check_groups`).
    pub groups: u32,
    /// Unload a group's table once it was idle this long on a server that does not lead it, voters
    /// included (`sim_unload_voters`): a partitioned or lagging server's groups go to disk, and its next
    /// apply loads them back, under every fault. 30 s (the default, for non-voters only) in half the seeds.
    pub unload_after_ms: u64,
    pub unload_voters: bool,
}

impl Knobs {
    pub fn new(seed: u64) -> Knobs {
        let mut rng = Rng::new(seed ^ 0x6b6e_6f62_7321_0001);
        let (heartbeat_interval_ms, election_timeout_min_ms, election_timeout_max_ms) =
            rng.pick(&[
                // The defaults, then the defaults before 2026-12 (slower failover, more margin), then
                // two more.
                (50, 200, 350),
                (100, 500, 1_000),
                (50, 300, 600),
                (150, 700, 1_000),
            ]);
        let mut knobs = Knobs {
            snapshot_every_entries: rng.pick(&[100, 300, 300, 1_000, 20_000]),
            snapshot_keep_entries: rng.pick(&[10, 50, 500]),
            wal_segment_bytes: rng.pick(&[None, Some(64 << 10), Some(256 << 10), Some(1 << 20)]),
            heartbeat_interval_ms,
            election_timeout_min_ms,
            election_timeout_max_ms,
            // At least twice the longest election timeout, as the server requires; at most 3 s, so that a
            // 2% fast lease clock (`MAX_CLOCK_PPM`) ends a TTL at most 60 ms early, inside P6's 100 ms
            // margin, and P8's 15 s bound still exceeds two TTLs, an election and a request timeout.
            ttl_ms: rng.pick(&[TTL_MS, TTL_MS, 3_000]),
            lock_delay_one_in: rng.pick(&[0, 4, 4, 2]),
            lock_delay_ms: rng.pick(&[100, 300, 1_000]),
            // Also snapshot once the log grew by this many bytes (65,536 is the least accepted).
            snapshot_every_bytes: rng.pick(&[64 << 20, 64 << 20, 65_536]),
            table_budget_bytes: None,
            workers_per_host: 2,
            wal_batch_bytes: None,
            groups: 1,
            unload_after_ms: 30_000,
            unload_voters: false,
            snapshot_log_percent: 25,
        };
        // Drawn after the knobs above, so that adding these changed none of theirs.
        let budget_room_kib: Option<u64> = rng.pick(&[None, None, None, Some(4), Some(16)]);
        knobs.workers_per_host = rng.pick(&[2, 2, 1, 3]);
        knobs.wal_batch_bytes = rng.pick(&[None, None, Some(512), Some(4_096)]);
        // Room for every worker's session, a lost one per worker and the reader's (1 KiB each), and
        // 4 or 16 KiB more: opens and acquires are refused for a full table now and then.
        knobs.table_budget_bytes =
            budget_room_kib.map(|room| (3 * knobs.workers_per_host as u64 + room) << 10);
        // Last, so that adding it changed none of the draws above.
        knobs.groups = rng.pick(&[1, 1, 2, 3]);
        // Last again, for the same reason.
        knobs.unload_after_ms = rng.pick(&[30_000, 30_000, 300, 1_000]);
        knobs.unload_voters = knobs.unload_after_ms < 30_000;
        // Last again.
        knobs.snapshot_log_percent = rng.pick(&[25, 25, 0, 1_000]);
        knobs
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Cuts every link between `side` and the other servers, both ways (a single node, a minority or a
    /// majority, depending on the side's size).
    /// `clients` (client host indexes) are on `side`'s side; the other client hosts reach only the other
    /// servers. The fenced store stays reachable from everywhere.
    Partition {
        side: Vec<usize>,
        clients: Vec<usize>,
    },
    /// Cuts whichever server leads when the fault starts from the other servers, with `clients` on its
    /// side: they keep talking to a deposed leader while the others move on.
    IsolateLeader { clients: Vec<usize> },
    /// Drops everything `from` sends to `to`; the other direction works.
    OneWay { from: usize, to: usize },
    /// Holds every message between two servers, then delivers them all late.
    Hold { a: usize, b: usize },
    /// Makes the link between two servers slow: each message takes up to `max_ms`.
    Slow { a: usize, b: usize, max_ms: u64 },
    /// Crashes a server (unsynced writes are lost), restarts it when the fault ends.
    Crash { server: usize },
    /// Crashes whichever server leads when the fault starts.
    CrashLeader,
    /// Holds every message of a client host (to servers and the store) for longer than the TTL: to the
    /// cluster the client is paused; its in-flight writes arrive late, with old tokens.
    PauseClient { host: usize },
    /// The disk of a server is lost: it crashes, and when the fault ends it starts with an empty data
    /// dir under a new node id (`--join`); the admin host adds the new id and then removes the old one
    /// (`AddMember`, `RemoveMember`), retrying through whatever other faults are going on.
    Replace { server: usize },
    /// The admin host asks for a leader transfer of group 0 (`TransferLeader`), as before a planned
    /// restart.
    TransferLeader,
    /// A server crashes, and while it is down one of its files is damaged (`crate::corrupt`); when the
    /// fault ends it starts again and must refuse to, naming the file. The driver then replaces it as
    /// for `Replace` (empty disk, new id, add and remove through the admin host).
    Corrupt {
        server: usize,
        corruption: crate::corrupt::Corruption,
    },
    /// A VM stall of a server (`server`, or whichever leads when the fault starts if None): every
    /// message to and from it is held, and its clock stops (`holdfast_server::skew::stall`); when the
    /// fault ends the clock jumps to where it would have been and the held messages arrive at once.
    Stall { server: Option<usize> },
    /// Arms failpoint `point` (`holdfast_wal::failpoint::NAMES`) to fire on its `at`th hit in `server`
    /// while the fault lasts; a server that reaches it fails that I/O, is crashed by the driver before
    /// the next step (unsynced writes lost) and restarts, unarmed, `restart_ms` later.
    Failpoint {
        server: usize,
        point: &'static str,
        at: u64,
        restart_ms: u64,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub at_ms: u64,
    pub duration_ms: u64,
    pub fault: Fault,
}

#[derive(Clone, Debug)]
pub struct Plan {
    pub seed: u64,
    /// Upper bound of the one-way network latency (turmoil draws each message's latency up to it).
    pub max_latency_ms: u64,
    /// Simulated time of one WAL group commit (write + fdatasync).
    pub fsync_us: u64,
    /// Probability that turmoil's disk makes an unsynced write durable on its own (as a real page cache
    /// may), so crashes see many different disk states.
    pub background_sync: f64,
    /// Disk block size for torn writes: on a crash a pending (unsynced) write may survive in part,
    /// block by block. None: pending writes are lost or kept whole.
    pub torn_block: Option<u64>,
    /// How long the workload runs; faults happen inside it.
    pub work_ms: u64,
    /// Each server's lease clock error in parts per million (positive: fast). Bounded by
    /// [`MAX_CLOCK_PPM`]: the design assumes clocks whose rates differ by far less than the client's
    /// TTL/10 safety margin.
    pub clock_ppm: Vec<i64>,
    pub events: Vec<Event>,
    pub knobs: Knobs,
}

/// A random subset of the client hosts (often empty).
fn some_clients(rng: &mut Rng) -> Vec<usize> {
    (0..CLIENT_HOSTS).filter(|_| rng.chance(0.3)).collect()
}

impl Plan {
    pub fn new(seed: u64, work_ms: u64) -> Plan {
        let knobs = Knobs::new(seed);
        let mut rng = Rng::new(seed);
        let max_latency_ms = rng.pick(&[1, 2, 5, 10, 25]);
        let fsync_us = rng.pick(&[100, 500, 2_000, 8_000]);
        let background_sync = rng.pick(&[0.0, 0.01, 0.2]);
        // Small blocks tear even the small frames of this workload (real disks tear at 512 bytes or
        // more, but the log must survive a tear at any byte).
        let torn_block = rng.pick(&[None, Some(16), Some(64), Some(512)]);
        let clock_ppm = (0..SERVERS)
            .map(|_| {
                rng.pick(&[
                    0,
                    0,
                    100,
                    -100,
                    5_000,
                    -5_000,
                    MAX_CLOCK_PPM,
                    -MAX_CLOCK_PPM,
                ])
            })
            .collect();
        // How hostile this seed is: the number of faults and which kinds it favours.
        let count = rng.between(1, 3 + work_ms / 2_000);
        let weights: Vec<u64> = (0..8).map(|_| rng.between(0, 4)).collect();
        let total: u64 = weights.iter().sum::<u64>().max(1);
        let mut events = Vec::new();
        for _ in 0..count {
            let at_ms = rng.between(500, work_ms.saturating_sub(1_500).max(600));
            let mut pick = rng.between(0, total - 1);
            let mut kind = 0;
            for (i, w) in weights.iter().enumerate() {
                if pick < *w {
                    kind = i;
                    break;
                }
                pick -= w;
            }
            let server = |rng: &mut Rng| rng.between(0, SERVERS as u64 - 1) as usize;
            let (fault, duration_ms) = match kind {
                0 => {
                    let size = rng.pick(&[1, 1, 2, 3]);
                    let mut side = Vec::new();
                    while side.len() < size {
                        let s = server(&mut rng);
                        if !side.contains(&s) {
                            side.push(s);
                        }
                    }
                    side.sort_unstable();
                    let clients = some_clients(&mut rng);
                    (Fault::Partition { side, clients }, rng.between(300, 5_000))
                }
                1 => {
                    let from = server(&mut rng);
                    let to = (from + rng.between(1, SERVERS as u64 - 1) as usize) % SERVERS;
                    (Fault::OneWay { from, to }, rng.between(300, 4_000))
                }
                2 => {
                    let a = server(&mut rng);
                    let b = (a + rng.between(1, SERVERS as u64 - 1) as usize) % SERVERS;
                    (Fault::Hold { a, b }, rng.between(100, 2_500))
                }
                3 => (
                    Fault::Crash {
                        server: server(&mut rng),
                    },
                    rng.between(200, 4_000),
                ),
                4 => (Fault::CrashLeader, rng.between(200, 4_000)),
                6 => (
                    Fault::IsolateLeader {
                        clients: some_clients(&mut rng),
                    },
                    rng.between(1_000, 6_000),
                ),
                5 => {
                    let a = server(&mut rng);
                    let b = (a + rng.between(1, SERVERS as u64 - 1) as usize) % SERVERS;
                    let max_ms = rng.pick(&[50, 200, 800]);
                    (Fault::Slow { a, b, max_ms }, rng.between(500, 5_000))
                }
                _ => (
                    Fault::PauseClient {
                        host: rng.between(0, CLIENT_HOSTS as u64 - 1) as usize,
                    },
                    rng.between(knobs.ttl_ms + 300, knobs.ttl_ms * 2 + 500),
                ),
            };
            events.push(Event {
                at_ms,
                duration_ms,
                fault,
            });
        }
        // Membership changes and leader transfers come from their own stream, so every fault drawn above
        // is the same as before they existed (seeds named in docs/testing.md keep their plans).
        let mut ops = Rng::new(seed ^ 0x6d65_6d62_6572_7321);
        if ops.chance(0.3) {
            events.push(Event {
                at_ms: ops.between(500, work_ms.saturating_sub(4_000).max(600)),
                duration_ms: ops.between(200, 2_000),
                fault: Fault::Replace {
                    server: ops.between(0, SERVERS as u64 - 1) as usize,
                },
            });
        }
        for _ in 0..ops.pick(&[0, 0, 1, 2]) {
            events.push(Event {
                at_ms: ops.between(500, work_ms.saturating_sub(1_500).max(600)),
                duration_ms: 0,
                fault: Fault::TransferLeader,
            });
        }
        // Corruption faults: their own stream too, drawn after the others.
        let mut bad = Rng::new(seed ^ 0x636f_7272_7570_7421);
        if bad.chance(0.3) {
            use crate::corrupt::{Corruption, Damage, Target};
            events.push(Event {
                at_ms: bad.between(500, work_ms.saturating_sub(4_000).max(600)),
                duration_ms: bad.between(200, 1_500),
                fault: Fault::Corrupt {
                    server: bad.between(0, SERVERS as u64 - 1) as usize,
                    corruption: Corruption {
                        target: bad.pick(&[Target::WalFrame, Target::WalFrame, Target::Snapshot]),
                        damage: bad.pick(&[
                            Damage::BitFlip,
                            Damage::ZeroedSector,
                            Damage::Misdirected,
                        ]),
                        pick: bad.next_u64(),
                    },
                },
            });
        }
        // Stalls: a stream of their own as well.
        let mut stalls = Rng::new(seed ^ 0x7374_616c_6c73_2121);
        if stalls.chance(0.3) {
            let server = stalls
                .chance(1.0 / 3.0)
                .then(|| stalls.between(0, SERVERS as u64 - 1) as usize);
            events.push(Event {
                at_ms: stalls.between(500, work_ms.saturating_sub(3_500).max(600)),
                // Shorter and longer than the election timeout and the TTL.
                duration_ms: stalls.between(200, 3_000),
                fault: Fault::Stall { server },
            });
        }
        // Failpoints: their own stream.
        let mut points = Rng::new(seed ^ 0x6661_696c_7074_2121);
        if points.chance(0.4) {
            // Every group commit writes and syncs and every entry is applied; the other points are
            // reached far less often in a 12 s run (rotations and purges only with small segments,
            // snapshots with low thresholds, votes in elections), so they fire on their first hit.
            let point = points.pick(&[
                "wal.write",
                "wal.write",
                "wal.sync",
                "wal.sync",
                "apply",
                "apply",
                "wal.rotate",
                "wal.purge",
                "snapshot.write",
                "snapshot.rename",
                "vote.save",
            ]);
            let frequent = matches!(point, "wal.write" | "wal.sync" | "apply");
            let at_ms = points.between(500, work_ms.saturating_sub(4_000).max(600));
            events.push(Event {
                at_ms,
                duration_ms: points.between(2_000, work_ms.saturating_sub(at_ms + 500).max(2_001)),
                fault: Fault::Failpoint {
                    server: points.between(0, SERVERS as u64 - 1) as usize,
                    point,
                    at: if frequent {
                        points.pick(&[1, 2, 5, 20])
                    } else {
                        1
                    },
                    restart_ms: points.between(200, 2_000),
                },
            });
        }
        events.sort_by_key(|e| e.at_ms);
        Plan {
            seed,
            max_latency_ms,
            fsync_us,
            background_sync,
            torn_block,
            work_ms,
            clock_ppm,
            events,
            knobs,
        }
    }
}
