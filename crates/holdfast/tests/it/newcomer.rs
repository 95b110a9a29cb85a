//! What a newcomer and an operator hit first (issue 14): a partial endpoint list, readiness and status
//! without a quorum, malformed endpoints.

use crate::harness::{Cluster, Options};
use std::time::Duration;
use tokio::time::Instant;

/// A client given only followers' endpoints still reaches the leader: it learns the members from the
/// first server that answers and follows redirects to the leader's advertised endpoint, also after the
/// leader changes to a server it was never told about.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_with_a_partial_endpoint_list_follows_the_leader_anywhere() {
    let mut c = Cluster::start(Options::default()).await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let followers: Vec<String> = (1..=5)
        .filter(|&n| n != leader)
        .take(2)
        .map(|n| c.endpoint(n))
        .collect();
    let client = holdfast_client::Client::connect(followers.clone())
        .await
        .unwrap();
    assert!(
        client.endpoints().contains(&c.endpoint(leader)),
        "the members were learned: {:?}",
        client.endpoints()
    );
    let s = client.open_session(Duration::from_secs(10)).await.unwrap();
    let g = s.try_acquire("partial").await.unwrap();
    g.release().await.unwrap();

    // The same through the CLI, with one follower's endpoint only.
    let out = c
        .holdfast()
        .env("HOLDFAST_ENDPOINTS", &followers[0])
        .args(["lock", "partial", "--", "true"])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The leader dies; the next one may be any server, also one this client was never given.
    c.kill(leader).await;
    let next = c
        .wait_for_leader_except(0, leader, Duration::from_secs(20))
        .await;
    let g = s
        .acquire_timeout("partial", Duration::from_secs(10))
        .await
        .unwrap_or_else(|e| panic!("acquire after the leader moved to node {next}: {e}"));
    assert!(g.token() > 0);
}

/// With two of three servers down, the survivor is not ready and `holdfast status` says why and exits
/// non-zero; with all up, both say healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_and_status_need_a_leader_a_quorum_confirms() {
    let mut c = Cluster::start(Options {
        nodes: 3,
        http: true,
        ..Options::default()
    })
    .await;
    c.wait_converged(0, Duration::from_secs(20)).await;
    for id in 1..=3 {
        let (code, body) = c.http_get(id, "/readyz").await;
        assert_eq!(code, 200, "node {id}: {body}");
    }
    let out = c.holdfast().arg("status").output().await.unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let survivor = (1..=3).find(|&n| n != leader).unwrap();
    for id in (1..=3).filter(|&n| n != survivor) {
        c.kill(id).await;
    }
    // The survivor may take a moment to notice: wait for /readyz to turn (bounded).
    let deadline = Instant::now() + Duration::from_secs(20);
    let body = loop {
        let (code, body) = c.http_get(survivor, "/readyz").await;
        if code == 503 {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "still ready without a quorum: {code} {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(body.contains("group 0"), "{body}");

    // Status from the survivor alone still shows every member, and flags the dead ones and the group.
    let out = c
        .holdfast()
        .env("HOLDFAST_ENDPOINTS", c.endpoint(survivor))
        .arg("status")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    for id in (1..=3).filter(|&n| n != survivor) {
        assert!(
            stderr.contains(&format!("node {id} at {} is unreachable", c.endpoint(id))),
            "{stderr}"
        );
    }
    assert!(
        stderr.contains("group 0 has no leader confirmed by a quorum"),
        "{stderr}"
    );
}

/// Malformed endpoints are refused at once with a message that says what is wrong; a port that is not
/// a Holdfast client port is named as such instead of a silent 15 s wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_endpoints_fail_fast_and_say_why() {
    let c = Cluster::start(Options {
        nodes: 1,
        ..Options::default()
    })
    .await;
    for (endpoint, expected) in [
        ("garbage", "is not host:port"),
        ("http://127.0.0.1:7001", "has a scheme"),
        ("127.0.0.1:99999", "no valid port"),
    ] {
        let started = Instant::now();
        let out = c
            .holdfast()
            .env("HOLDFAST_ENDPOINTS", endpoint)
            .arg("locks")
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{endpoint}: {stderr}");
        assert!(stderr.contains(expected), "{endpoint}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{endpoint} took {:?}",
            started.elapsed()
        );
    }
    // A peer port speaks gRPC, but not the client API.
    let peer = c.peer_endpoint(1);
    let out = c
        .holdfast()
        .env("HOLDFAST_ENDPOINTS", &peer)
        .args(["locks", "--timeout", "3s"])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("not a Holdfast client port"), "{stderr}");
    // Nothing listens: the cause is named, within the --timeout given.
    let started = Instant::now();
    let out = c
        .holdfast()
        .env("HOLDFAST_ENDPOINTS", "127.0.0.1:1")
        .args(["locks", "--timeout", "2s"])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.to_lowercase().contains("connection refused"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "took {:?}",
        started.elapsed()
    );
}

/// A base port for `holdfast dev` whose client, peer and HTTP ports (BASE.., BASE+100.., BASE+200..)
/// are free now: below the harness's range, spread by process id.
fn dev_base_port(nodes: u16) -> u16 {
    let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
    let start = 3000 + (std::process::id() % 50) as u16 * 12;
    (0..50)
        .map(|i| start + i * 12)
        .find(|&b| (0..nodes).all(|n| free(b + n) && free(b + 100 + n) && free(b + 200 + n)))
        .expect("a free block of ports for holdfast dev")
}

/// `holdfast dev` says at once why it cannot start (its data dir is in use, its ports are taken, the
/// data dir holds another cluster shape), names the leader of this start, and restarts a killed server
/// that Ctrl-C then stops with the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_refuses_what_would_fail_and_restarts_a_killed_server() {
    use tokio::io::AsyncBufReadExt;
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("data");
    let base = dev_base_port(3);
    let holdfast = || {
        let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_holdfast"));
        c.env("HOLDFAST_ENDPOINTS", format!("127.0.0.1:{}", base + 1))
            .kill_on_drop(true);
        c
    };
    let dev_args = |dir: &std::path::Path, nodes: &str| {
        vec![
            "dev".to_string(),
            "--nodes".into(),
            nodes.into(),
            "--base-port".into(),
            base.to_string(),
            "--data-dir".into(),
            dir.display().to_string(),
        ]
    };
    let mut dev = holdfast()
        .args(dev_args(&data, "3"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(dev.stdout.take().unwrap()).lines();
    let banner = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("holdfast dev became ready")
        .unwrap()
        .unwrap();
    assert!(
        banner.contains("ready") && banner.contains("leader of group 0: node"),
        "{banner}"
    );

    let refused = |out: std::process::Output, expected: &str| {
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(expected), "{stderr}");
    };
    refused(
        holdfast()
            .args(dev_args(&data, "3"))
            .output()
            .await
            .unwrap(),
        "is in use by another `holdfast dev`",
    );
    refused(
        holdfast()
            .args(dev_args(&work.path().join("other"), "3"))
            .output()
            .await
            .unwrap(),
        "is not free",
    );

    let control = |verb: &str| {
        let mut c = holdfast();
        c.args(["dev", verb, "1", "--data-dir"]).arg(&data);
        c
    };
    let out = control("kill").output().await.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status = holdfast().arg("status").output().await.unwrap();
    assert_eq!(status.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&status.stderr).contains("node 1 at"));
    let out = control("restart").output().await.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = holdfast().arg("status").output().await.unwrap();
        if status.status.success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the restarted server did not come back: {}",
            String::from_utf8_lossy(&status.stderr)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Ctrl-C stops every server, the restarted one included: their ports are free again.
    crate::harness::interrupt(dev.id().unwrap());
    let exited = tokio::time::timeout(Duration::from_secs(30), dev.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exited.success());
    for n in 0..3 {
        assert!(
            std::net::TcpListener::bind(("127.0.0.1", base + n)).is_ok(),
            "server {} still runs after Ctrl-C",
            n + 1
        );
    }
    refused(
        holdfast()
            .args(dev_args(&data, "5"))
            .output()
            .await
            .unwrap(),
        "holds a cluster made with --nodes 3",
    );
}

/// A follower that is down is one warning in the leader's log, a summary every 10 s, and one line when
/// it is back: not one warning per failed heartbeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_down_follower_is_summarised_in_the_log_not_repeated() {
    let mut c = Cluster::start(Options {
        nodes: 3,
        ..Options::default()
    })
    .await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let down = (1..=3).find(|&n| n != leader).unwrap();
    // Only what the leader logs from here on counts (start-up elections warn about peers not yet up).
    let before = c.log_text(leader).len();
    c.kill(down).await;
    c.wait_for_log(leader, &format!("node {down} unreachable for"), 1)
        .await;
    let log = c.log_text(leader)[before..].to_string();
    let warnings = log.lines().filter(|l| l.contains("WARN")).count();
    let failed: u64 = log
        .lines()
        .find_map(|l| {
            let rest = l.split(&format!("node {down} unreachable for ")).nth(1)?;
            rest.split(", ").nth(1)?.split(' ').next()?.parse().ok()
        })
        .unwrap();
    assert!(
        failed >= 10 && warnings <= 4,
        "{failed} failed messages took {warnings} warnings:\n{log}"
    );
    c.start_server(down);
    c.wait_for_log(leader, &format!("node {down} reachable again after"), 1)
        .await;
}

/// Every metric a server exports is documented in docs/operations.md, and the exposition has no float
/// noise in bucket bounds and no empty label sets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_is_documented_and_well_formed() {
    let c = Cluster::start(Options {
        nodes: 3,
        http: true,
        ..Options::default()
    })
    .await;
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let (code, body) = c.http_get(leader, "/metrics").await;
    assert_eq!(code, 200);
    let docs = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/operations.md"
    ))
    .unwrap();
    let families: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(families.len() >= 15, "{body}");
    for name in &families {
        assert!(
            docs.contains(&format!("`{name}")),
            "{name} is not in docs/operations.md"
        );
        assert_eq!(
            body.matches(&format!("# TYPE {name} ")).count(),
            1,
            "{name} is declared more than once"
        );
    }
    // The shipped alert rules and Grafana dashboard use only metrics that exist.
    let deploy = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy");
    let alerts =
        std::fs::read_to_string(format!("{deploy}/prometheus/holdfast-alerts.yml")).unwrap();
    let dashboard =
        std::fs::read_to_string(format!("{deploy}/grafana/holdfast-dashboard.json")).unwrap();
    let parsed: serde_json::Value =
        serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    let exprs: Vec<&str> = parsed["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().expect("targets").iter())
        .map(|t| t["expr"].as_str().expect("expr"))
        .collect();
    assert!(
        exprs.len() >= 14,
        "{} queries in the dashboard",
        exprs.len()
    );
    let rules = alerts.matches("- alert: ").count();
    assert!(
        rules >= 8 && alerts.matches("expr: ").count() == rules,
        "{alerts}"
    );
    for (file, text) in [
        ("alerts", alerts.as_str()),
        ("dashboard", dashboard.as_str()),
    ] {
        let mut used = 0;
        let uses = text
            .match_indices("holdfast_")
            .chain(text.match_indices("process_"))
            // Not the tail of a longer word.
            .filter(|(at, _)| {
                !text[..*at]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
            });
        for (at, prefix) in uses {
            let name: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            if name == prefix {
                continue; // prose ("holdfast_* metrics")
            }
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| families.contains(f)))
                .unwrap_or(&name);
            // A plaintext server without a policy leaves out the TLS and policy metrics; the docs say
            // when those exist.
            let conditional = docs.lines().any(|l| {
                l.contains(&format!("`{family}"))
                    && (l.contains("with TLS") || l.contains("with a policy"))
            });
            assert!(
                families.contains(&family) || conditional,
                "the {file} uses {name}, which no server exports"
            );
            used += 1;
        }
        assert!(used >= 8, "the {file} uses {used} metrics");
    }
    assert!(!body.contains("{}"), "{body}");
    // Float noise in bucket bounds (values such as byte counts may hold any digits).
    assert!(
        !body
            .lines()
            .any(|l| l.contains("le=\"") && l.contains("99999")),
        "float noise in {body}"
    );
    assert!(body.contains("holdfast_build_info{version=\""), "{body}");
    assert!(
        body.contains("holdfast_replication_lag_entries{group=\"0\",follower=\""),
        "{body}"
    );
}

/// The small things a newcomer trips over: a TTL of 0, a JSON schema with a key missing, a server
/// without a data dir, config errors that list test-only keys, `--json` where nothing prints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_things_say_what_they_mean() {
    let c = Cluster::start(Options {
        nodes: 1,
        ..Options::default()
    })
    .await;
    let run = |args: &[&str]| {
        let mut cmd = c.holdfast();
        cmd.args(args);
        async move {
            let out = cmd.output().await.unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).to_string(),
                String::from_utf8_lossy(&out.stderr).to_string(),
            )
        }
    };
    let (code, _, err) = run(&["lock", "x", "--ttl", "0", "--", "true"]).await;
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("0 is not a TTL"), "{err}");
    let (code, _, err) = run(&["lock", "x", "--json", "--", "true"]).await;
    assert_eq!(code, Some(2), "lock has no JSON output to give: {err}");
    let (code, _, err) = run(&["lock", "x", "--ttl", "1s", "--", "true"]).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("allowed range, 2000 ms to 300000 ms"), "{err}");

    let (_, free, _) = run(&["describe", "x", "--json"]).await;
    let free: serde_json::Value = serde_json::from_str(&free).unwrap();
    assert_eq!(free["free"], true);
    let client = c.client().await;
    let s = client.open_session(Duration::from_secs(10)).await.unwrap();
    let _g = s.try_acquire("x").await.unwrap();
    let (_, held, _) = run(&["describe", "x", "--json"]).await;
    let held: serde_json::Value = serde_json::from_str(&held).unwrap();
    assert_eq!(held["free"], false, "{held}");

    let (code, _, err) = run(&[
        "server",
        "--node-id",
        "1",
        "--members",
        "1=127.0.0.1:1/127.0.0.1:2",
    ])
    .await;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("no data directory configured"), "{err}");
    let work = tempfile::tempdir().unwrap();
    let config = work.path().join("bad.toml");
    std::fs::write(&config, "node_id = 1\nnode = 2\n").unwrap();
    let (code, _, err) = run(&["server", "--config", config.to_str().unwrap()]).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("unknown field `node`"), "{err}");
    assert!(
        !err.contains("audit_log") && !err.contains("fault_fsync"),
        "test-only keys listed: {err}"
    );
}
