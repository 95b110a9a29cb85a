//! Membership changes with real processes: add a server and remove one under load, replace a server whose
//! data directory was lost, and the guard against leaving too few voters. These are the runbooks of
//! docs/operations.md, "Membership changes", performed by `holdfast member` as an operator would.

use crate::harness::{Cluster, Options};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

async fn member(c: &Cluster, args: &[&str]) -> (bool, String, String) {
    let out = c
        .holdfast()
        .arg("member")
        .args(args)
        .args(["--timeout", "60s"])
        .output()
        .await
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn member_ok(c: &Cluster, args: &[&str]) -> String {
    let (ok, out, err) = member(c, args).await;
    assert!(ok, "holdfast member {args:?} failed: {err}{out}");
    out
}

/// A client looping acquire + release over `names` locks `{prefix}N` for as long as a test changes the
/// membership; any failure fails the test.
struct Looping {
    stop: Arc<AtomicBool>,
    grants: Arc<AtomicU32>,
    task: tokio::task::JoinHandle<()>,
}

impl Looping {
    fn start(session: &holdfast_client::Session, prefix: &str, names: u32) -> Looping {
        let stop = Arc::new(AtomicBool::new(false));
        let grants = Arc::new(AtomicU32::new(0));
        let task = tokio::spawn({
            let (session, stop, grants) = (session.clone(), stop.clone(), grants.clone());
            let prefix = prefix.to_string();
            async move {
                let mut i = 0u32;
                while !stop.load(Relaxed) {
                    i += 1;
                    let g = session
                        .acquire_timeout(&format!("{prefix}{}", i % names), Duration::from_secs(10))
                        .await
                        .expect("acquire during membership changes");
                    g.release()
                        .await
                        .expect("release during membership changes");
                    grants.fetch_add(1, Relaxed);
                }
            }
        });
        Looping { stop, grants, task }
    }

    /// Waits (up to 20 s) for 20 more grants, then stops the loop.
    async fn grants_more_then_stop(self, after: &str) {
        let before = self.grants.load(Relaxed);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while self.grants.load(Relaxed) < before + 20 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no grants after {after}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.stop.store(true, Relaxed);
        self.task.await.expect("the load loop failed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sixth_server_is_added_and_one_removed_under_load() {
    let mut c = Cluster::start(Options {
        groups: 2,
        ..Options::default()
    })
    .await;
    let client = c.client().await;
    let session = client.open_session(Duration::from_secs(10)).await.unwrap();
    let kept = session.acquire("member/kept").await.unwrap();

    // A client loops acquire + release on both groups the whole time; nothing may fail.
    let looping = Looping::start(&session, "member/loop-", 8);

    let six = c.add_server(&[]).await;
    c.start_server(six);
    let (client_ep, peer_ep) = (c.endpoint(six), c.peer_endpoint(six));
    let out = member_ok(
        &c,
        &["add", "6", "--client", &client_ep, "--peer", &peer_ep],
    )
    .await;
    assert_eq!(
        out.lines()
            .filter(|l| l.contains("voters [1, 2, 3, 4, 5, 6]"))
            .count(),
        2,
        "{out}"
    );
    for g in 0..2 {
        c.wait_converged(g, Duration::from_secs(30)).await;
    }
    // The new server serves reads of state written before it joined.
    let info = c
        .client()
        .await
        .describe("member/kept")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(info.token, kept.token());

    // Remove node 1 (whoever leads: a leader asked to remove itself hands over first), then stop it.
    let out = member_ok(&c, &["remove", "1"]).await;
    assert_eq!(
        out.lines()
            .filter(|l| l.contains("voters [2, 3, 4, 5, 6]"))
            .count(),
        2,
        "{out}"
    );
    c.kill(1).await;
    for g in 0..2 {
        c.wait_converged(g, Duration::from_secs(30)).await;
    }
    looping.grants_more_then_stop("the removal").await;

    // `member list` shows the voters, and node 1 only as configured somewhere.
    let list = member_ok(&c, &["list", "--json"]).await;
    let members: serde_json::Value = serde_json::from_str(&list).unwrap();
    let role = |id: u64| {
        members
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["node_id"] == id)
            .map(|m| m["role"].as_str().unwrap().to_string())
    };
    for id in 2..=6 {
        assert_eq!(role(id).as_deref(), Some("voter"), "{list}");
    }
    assert_eq!(role(1).as_deref(), Some("configured"), "{list}");
    assert_eq!(
        members
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["node_id"] == 6)
            .unwrap()["client"],
        client_ep.as_str(),
        "{list}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_whose_disk_was_lost_is_replaced() {
    let mut c = Cluster::start(Options {
        nodes: 3,
        snapshot_every_entries: 100,
        snapshot_keep_entries: 20,
        ..Options::default()
    })
    .await;
    // Never fewer than 3 voters by mistake.
    let (ok, _, err) = member(&c, &["remove", "3"]).await;
    assert!(!ok);
    assert!(
        err.contains("would leave group 0 with 2 voters") && err.contains("force"),
        "{err}"
    );

    let client = c.client().await;
    let session = client.open_session(Duration::from_secs(30)).await.unwrap();
    let kept = session.acquire("replace/kept").await.unwrap();
    // Enough entries that the log has been snapshotted and purged (the server purges in batches of 256
    // entries, 20 kept behind a snapshot): the replacement must catch up by snapshot.
    for i in 0..200 {
        let g = session
            .acquire(&format!("replace/{}", i % 5))
            .await
            .unwrap();
        g.release().await.unwrap();
    }
    c.wait_converged(0, Duration::from_secs(30)).await;

    // Node 3's disk is lost.
    c.kill(3).await;
    std::fs::remove_dir_all(&c.servers[2].data_dir).unwrap();

    // A new server with a new id and an empty data dir joins, then the dead one is removed. It never
    // snapshots by itself here, so a snapshot in its data dir is one it installed from the leader.
    let four = c.add_server(&["--snapshot-every-entries=100000"]).await;
    c.start_server(four);
    let (client_ep, peer_ep) = (c.endpoint(four), c.peer_endpoint(four));
    let out = member_ok(
        &c,
        &["add", "4", "--client", &client_ep, "--peer", &peer_ep],
    )
    .await;
    assert!(out.contains("voters [1, 2, 3, 4]"), "{out}");
    let out = member_ok(&c, &["remove", "3"]).await;
    assert!(out.contains("voters [1, 2, 4]"), "{out}");
    c.wait_converged(0, Duration::from_secs(30)).await;
    let snapshots = std::fs::read_dir(c.servers[3].data_dir.join("snapshots/g0"))
        .unwrap()
        .count();
    assert!(
        snapshots > 0,
        "the replacement did not catch up by snapshot"
    );

    // The cluster survives losing another original server: 1 and 4 are a majority of {1, 2, 4}.
    c.kill(2).await;
    let info = c
        .client()
        .await
        .describe("replace/kept")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(info.token, kept.token());
    let g = session.acquire("replace/after").await.unwrap();
    assert!(g.token() > kept.token());
}

/// The voters of `group` as the server that leads it says, once one does.
async fn voters_of(c: &Cluster, group: u32) -> Vec<u64> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        for s in c.servers.iter().filter(|s| s.child.is_some()) {
            if let Some(g) = c.group_status(s.id, group).await {
                if g.role == "leader" && g.leader_confirmed {
                    return g.voters;
                }
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "group {group} has no leader"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Seven servers, each group on three of them: two servers join a five-server cluster of four groups
/// and `holdfast member place --replicas 3` spreads the groups evenly while a client loops acquire +
/// release in every group (which never fails). A server taken out of a group stops standing for
/// election there; a client that knows only one server reaches every group; placing again changes
/// nothing; and the leader balancer ends with no server leading two groups. A joined server is not
/// ready (`/readyz`) until it is a voter of some group; then every server is. Last, a server is killed
/// and `--without` moves its groups to the six others, two each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_are_placed_on_three_of_seven_servers() {
    const GROUPS: u32 = 4;
    let mut c = Cluster::start(Options {
        groups: GROUPS,
        http: true,
        server_args: vec!["--balance-leaders".into()],
        ..Options::default()
    })
    .await;
    let client = c.client().await;
    let session = client.open_session(Duration::from_secs(10)).await.unwrap();
    // Guards, held to the end (dropping one releases its lock).
    let mut kept = Vec::new();
    for g in 0..GROUPS {
        let name = crate::harness::name_in_group(g, GROUPS, "place/kept-");
        kept.push((name.clone(), session.acquire(&name).await.unwrap()));
    }
    let looping = Looping::start(&session, "place/loop-", 16);

    let mut with = Vec::new();
    for _ in 0..2 {
        let id = c.add_server(&[]).await;
        c.start_server(id);
        with.push(format!("{id}={}/{}", c.endpoint(id), c.peer_endpoint(id)));
    }
    // A joined server that is a voter of no group yet is not ready, and says why.
    c.wait_for_log(7, "holdfast server started", 1).await;
    let (code, body) = c.http_get(7, "/readyz").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("a voter of none of the 4 groups"), "{body}");
    let place = |extra: Vec<String>| {
        let mut args = vec!["place".to_string(), "--replicas".into(), "3".into()];
        args.extend(extra);
        args
    };
    let args = place(
        with.iter()
            .flat_map(|w| ["--with".to_string(), w.clone()])
            .collect(),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = member_ok(&c, &args).await;
    assert!(
        out.contains(&format!("changed {GROUPS} of {GROUPS} groups")),
        "{out}"
    );

    // Twelve voters over seven servers: each a voter of one or two groups, the new ones included.
    let mut load = [0usize; 8];
    let mut voters = Vec::new();
    for g in 0..GROUPS {
        let v = voters_of(&c, g).await;
        assert_eq!(v.len(), 3, "group {g}: {v:?}\n{out}");
        for id in &v {
            load[*id as usize] += 1;
        }
        voters.push(v);
    }
    for (id, n) in load.iter().enumerate().skip(1) {
        assert!(
            (1..=2).contains(n),
            "node {id} is a voter of {n} groups: {voters:?}"
        );
    }

    // Every server is ready: each serves (or redirects to the leader of) the groups it is a voter of.
    for id in 1..=7 {
        let (code, body) = c.http_get(id, "/readyz").await;
        assert_eq!(code, 200, "node {id}: {body}");
    }

    // `holdfast status` shows each group's rows only for its members, and the voters per group.
    let status = c.holdfast_ok(&["status"]).await;
    let text = String::from_utf8_lossy(&status.stdout);
    let expected: Vec<String> = voters
        .iter()
        .enumerate()
        .map(|(g, v)| {
            let ids: Vec<String> = v.iter().map(u64::to_string).collect();
            format!("{g}: {}", ids.join(" "))
        })
        .collect();
    assert!(
        text.contains(&format!("voters per group: {}", expected.join(", "))),
        "{text}"
    );
    let rows = text
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .nth(2)
                .is_some_and(|g| g.parse::<u32>().is_ok())
        })
        .count();
    assert_eq!(rows, 3 * GROUPS as usize, "{text}");

    // `holdfast member list` says which groups each server is a voter of, as the leaders say.
    let list = member_ok(&c, &["list", "--json"]).await;
    let members: serde_json::Value = serde_json::from_str(&list).unwrap();
    for id in 1..=7u64 {
        let m = members
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["node_id"] == id)
            .unwrap_or_else(|| panic!("node {id} missing: {list}"));
        let expected: Vec<u32> = (0..GROUPS)
            .filter(|g| voters[*g as usize].contains(&id))
            .collect();
        assert_eq!(
            m["voter_of"],
            serde_json::json!(expected),
            "node {id}: {list}"
        );
        assert_eq!(m["role"], "voter", "{list}");
    }

    // A server that left a group is a learner there and stands for no election: its term stays put
    // over several election timeouts (before the change to demote first, it campaigned for good).
    let (g, gone) = (0..GROUPS)
        .find_map(|g| {
            (1..=5u64)
                .find(|id| !voters[g as usize].contains(id))
                .map(|id| (g, id))
        })
        .expect("some original server left some group");
    let before = c.group_status(gone, g).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = c.group_status(gone, g).await.unwrap();
    assert_eq!(after.role, "learner", "node {gone}, group {g}: {after:?}");
    assert_eq!(
        after.term, before.term,
        "node {gone} campaigns in group {g}"
    );

    // Every group still serves, and the locks taken before kept their tokens; a client that knows
    // only a new server (a voter of one or two groups) finds every group's leader.
    looping.grants_more_then_stop("the placement").await;
    let seven = holdfast_client::Client::connect([c.endpoint(7)])
        .await
        .unwrap();
    for (name, guard) in &kept {
        let info = seven.describe(name).await.unwrap().expect("still held");
        assert_eq!(info.token, guard.token(), "{name}");
    }
    let other = seven.open_session(Duration::from_secs(10)).await.unwrap();
    for g in 0..GROUPS {
        let name = crate::harness::name_in_group(g, GROUPS, "place/seven-");
        other.acquire(&name).await.unwrap().release().await.unwrap();
    }

    // Placed already: nothing moves.
    let args = place(Vec::new());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = member_ok(&c, &args).await;
    assert!(
        out.contains(&format!("changed 0 of {GROUPS} groups")),
        "{out}"
    );

    // The balancer, which sees only its own groups and asks the other members for the rest, spreads
    // the four leaderships over four servers: none leads two, also after two are moved to one server by
    // hand (it waits 10 s after a change it did not make).
    let busy = (1..=7u64)
        .find(|id| load[*id as usize] == 2)
        .expect("a voter of two groups");
    for g in (0..GROUPS).filter(|g| voters[*g as usize].contains(&busy)) {
        c.holdfast_ok(&[
            "leader",
            "transfer",
            "--group",
            &g.to_string(),
            "--to",
            &busy.to_string(),
        ])
        .await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let mut leaders = Vec::new();
        for g in 0..GROUPS {
            let mut leader = None;
            for id in voters_of(&c, g).await {
                if let Some(s) = c.group_status(id, g).await {
                    if s.role == "leader" && s.leader_confirmed {
                        leader = Some(id);
                    }
                }
            }
            leaders.push(leader);
        }
        let distinct: std::collections::BTreeSet<_> = leaders.iter().flatten().collect();
        if distinct.len() == GROUPS as usize {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "leaders not spread: {leaders:?} (voters {voters:?})"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A server lost for good: `--without` moves its groups to the others, which stay even (twelve
    // voters over six servers: two each), and every group serves again.
    c.kill(busy).await;
    for g in 0..GROUPS {
        voters_of(&c, g).await; // a leader again, if `busy` led the group
    }
    let args = place(vec!["--without".into(), busy.to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = member_ok(&c, &args).await;
    let mut load = [0usize; 8];
    for g in 0..GROUPS {
        let v = voters_of(&c, g).await;
        assert_eq!(v.len(), 3, "group {g}: {v:?}\n{out}");
        assert!(!v.contains(&busy), "group {g}: {v:?}\n{out}");
        for id in &v {
            load[*id as usize] += 1;
        }
    }
    for id in (1..=7).filter(|id| *id != busy) {
        assert_eq!(load[id as usize], 2, "node {id}: {load:?}\n{out}");
    }
    for (name, guard) in &kept {
        let info = seven.describe(name).await.unwrap().expect("still held");
        assert_eq!(info.token, guard.token(), "{name}");
    }
}

/// The value of a per-group metric of one server (`name{group="G"}`).
async fn group_metric(c: &Cluster, id: u64, name: &str, group: u32) -> u64 {
    let m = c.metrics(id).await;
    let key = m
        .keys()
        .find(|k| k.starts_with(&format!("{name}{{")) && k.contains(&format!("group=\"{group}\"")))
        .unwrap_or_else(|| panic!("node {id} has no {name} for group {group}"))
        .clone();
    m[&key]
}

/// A server removed from a group keeps running and hears nothing more of it: once the group has been
/// idle there for `unload_after_ms`, its table goes to disk (a snapshot at the applied state) and out of
/// memory, while status and metrics go on reporting what it held. Added back, the server loads the table
/// from that snapshot before it applies the entries it missed, and ends with the same table as the
/// others. The voters, idle at times too, never unload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_left_a_group_unloads_its_table_and_reloads_it_when_added_back() {
    let c = Cluster::start(Options {
        http: true,
        server_args: vec!["--unload-after-ms=300".into()],
        ..Options::default()
    })
    .await;
    let client = c.client().await;
    let session = client.open_session(Duration::from_secs(10)).await.unwrap();
    let mut held = Vec::new();
    for i in 0..30 {
        held.push(session.acquire(&format!("unload/{i}")).await.unwrap());
    }

    member_ok(&c, &["remove", "5"]).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let out = loop {
        let s = c.group_status(5, 0).await.expect("node 5 answers");
        if s.unloaded {
            break s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "node 5 never unloaded group 0: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    c.wait_for_log(5, "idle group unloaded", 1).await;
    // What it held is still reported: the same table as the group's (its last entries changed the
    // membership only, not the table).
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let at_leader = c.group_status(leader, 0).await.unwrap();
    assert_eq!(out.locks, 30, "{out:?}");
    assert_eq!(out.sessions, at_leader.sessions, "{out:?}");
    assert_eq!(
        out.digest, at_leader.digest,
        "{out:?} against {at_leader:?}"
    );
    assert_eq!(group_metric(&c, 5, "holdfast_table_unloaded", 0).await, 1);
    assert_eq!(group_metric(&c, 5, "holdfast_locks", 0).await, 30);

    // The table changes while node 5 is out.
    for guard in held.drain(..10) {
        guard.release().await.unwrap();
    }
    for i in 30..35 {
        held.push(session.acquire(&format!("unload/{i}")).await.unwrap());
    }

    member_ok(
        &c,
        &[
            "add",
            "5",
            "--client",
            &c.endpoint(5),
            "--peer",
            &c.peer_endpoint(5),
        ],
    )
    .await;
    // Back in: node 5 applies what it missed onto the reloaded table, and ends where the others are.
    c.wait_for_log(5, "reloaded the table from its snapshot", 1)
        .await;
    c.wait_converged(0, Duration::from_secs(30)).await;
    let back = c.group_status(5, 0).await.unwrap();
    assert!(!back.unloaded, "{back:?}");
    assert_eq!(back.locks, 25, "{back:?}");
    assert_eq!(group_metric(&c, 5, "holdfast_table_reloads", 0).await, 1);
    assert_eq!(group_metric(&c, 5, "holdfast_table_unloaded", 0).await, 0);
    for id in 1..=4 {
        assert_eq!(
            group_metric(&c, id, "holdfast_table_unloads", 0).await,
            0,
            "voter {id} unloaded"
        );
    }
    // And it serves the group again: its reads as leader see every lock.
    c.holdfast_ok(&["leader", "transfer", "--group", "0", "--to", "5"])
        .await;
    let five = holdfast_client::Client::connect([c.endpoint(5)])
        .await
        .unwrap();
    for guard in &held {
        let info = five.describe(guard.name()).await.unwrap().expect("held");
        assert_eq!(info.token, guard.token());
    }
}

/// A server removed from a group still names, in its redirects, the last leader it heard of, and that
/// server may be dead. A client whose endpoints are that dead server and the removed one used to go
/// dead, removed, dead, removed, ... until its request timed out, never trying the servers it learned
/// of (the placement test's clients lost their sessions that way, now and then). A server that failed
/// a moment ago is not followed now: the client moves on and finds the leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_redirect_to_a_dead_server_does_not_trap_a_client() {
    let mut c = Cluster::start(Options::default()).await;
    c.wait_for_leader(0, Duration::from_secs(30)).await;
    // Node 1 leads; node 5 leaves the group and keeps running, still naming node 1 as the leader.
    c.holdfast_ok(&["leader", "transfer", "--group", "0", "--to", "1"])
        .await;
    member_ok(&c, &["remove", "5"]).await;
    let stale = c.group_status(5, 0).await.unwrap();
    assert_eq!(stale.leader_id, 1, "{stale:?}");
    // Leadership moves on without node 5 hearing of it; then node 1 dies.
    c.holdfast_ok(&["leader", "transfer", "--group", "0", "--to", "2"])
        .await;
    c.kill(1).await;
    assert_eq!(c.group_status(5, 0).await.unwrap().leader_id, 1);

    let client = holdfast_client::Client::connect([c.endpoint(1), c.endpoint(5)])
        .await
        .unwrap();
    let session = client.open_session(Duration::from_secs(10)).await.unwrap();
    session
        .acquire("stale/lock")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// A group that moved twice, whose first voters are gone: the servers that left it before its present
/// voters joined (and are voters of nothing here, as servers of other groups would be) never heard of
/// those voters from the group itself. They learn them from the other members' status, and name them
/// to clients, so a client given only such a server still finds the group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_finds_a_group_whose_voters_joined_after_its_only_server_left() {
    let mut c = Cluster::start(Options::default()).await;
    c.wait_for_leader(0, Duration::from_secs(30)).await;
    // The group goes onto three of the five servers; two leave it.
    member_ok(&c, &["place", "--replicas", "3"]).await;
    let first = voters_of(&c, 0).await;
    let left: Vec<u64> = (1..=5).filter(|id| !first.contains(id)).collect();
    assert_eq!(left.len(), 2, "{first:?}");
    // Three servers join, and the group moves onto them, off its first voters.
    let mut args = vec!["place".to_string(), "--replicas".into(), "3".into()];
    let mut joined = Vec::new();
    for _ in 0..3 {
        let id = c.add_server(&[]).await;
        c.start_server(id);
        joined.push(id);
        args.extend([
            "--with".into(),
            format!("{id}={}/{}", c.endpoint(id), c.peer_endpoint(id)),
        ]);
    }
    for id in &first {
        args.extend(["--without".into(), id.to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    member_ok(&c, &args).await;
    assert_eq!(voters_of(&c, 0).await, joined);
    // What a server that left first knows of the group is from before the move: none of its voters.
    let lone = left[0];
    let stale = c.group_status(lone, 0).await.unwrap();
    assert!(
        stale.voters.iter().all(|v| !joined.contains(v)),
        "{stale:?}"
    );

    // It learns the new voters from the servers it knows (the first voters, who saw them join).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let s = c
            .raw(lone)
            .await
            .status(holdfast_proto::v1::StatusRequest::default())
            .await
            .unwrap()
            .into_inner();
        let named = |id: &u64| {
            s.members
                .iter()
                .any(|m| m.node_id == *id && m.client_endpoint == c.endpoint(*id))
        };
        if joined.iter().all(named) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "node {lone} never named the new voters: {:?}",
            s.members
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The first voters are decommissioned; only the servers that left first and the new voters run.
    for id in &first {
        c.kill(*id).await;
    }
    // Asked for the group, that server sends the client to its leader, not to the leader of when it
    // left (`stale.leader_id`, now dead): the one the others named.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let leader = loop {
        let mut leading = None;
        for id in &joined {
            if let Some(g) = c.group_status(*id, 0).await {
                if g.role == "leader" && g.leader_confirmed {
                    leading = Some(*id);
                }
            }
        }
        if let Some(id) = leading {
            break id;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "group 0 has no leader"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    loop {
        let err = c
            .raw(lone)
            .await
            .describe(holdfast_proto::v1::DescribeRequest {
                group: 0,
                name: "moved/twice".into(),
            })
            .await
            .unwrap_err();
        let detail =
            <holdfast_proto::v1::ErrorDetail as prost::Message>::decode(err.details()).unwrap();
        if detail.leader_id == leader {
            assert_eq!(detail.leader_endpoint, c.endpoint(leader), "{err:?}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "node {lone} redirects to node {} (stale: {})",
            detail.leader_id,
            stale.leader_id
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let client = holdfast_client::Client::connect([c.endpoint(lone)])
        .await
        .unwrap();
    let session = client.open_session(Duration::from_secs(10)).await.unwrap();
    let guard = session.acquire("moved/twice").await.unwrap();
    assert!(guard.token() > 0);
    guard.release().await.unwrap();
}
