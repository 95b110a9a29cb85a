//! The `holdfast` command line against a real cluster.

use crate::harness::{Cluster, Options, CLIENTS};
use std::process::Stdio;
use std::time::Duration;

fn three() -> Options {
    Options {
        nodes: 3,
        ..Options::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_runs_the_command_with_its_token_and_exits_with_its_code() {
    let c = Cluster::start(three()).await;
    let out = c
        .holdfast()
        .args([
            "lock",
            "jobs/nightly",
            "--",
            "sh",
            "-c",
            "echo $HOLDFAST_LOCK $HOLDFAST_TOKEN; exit 3",
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let (lock, token) = stdout.trim().split_once(' ').unwrap();
    assert_eq!(lock, "jobs/nightly");
    assert!(token.parse::<u64>().unwrap() > 0);
    // Released after the command ended.
    let client = c.client().await;
    assert!(client.describe("jobs/nightly").await.unwrap().is_none());

    // A held lock with --wait 0 fails at once with one clear line and a non-zero code.
    let s = client.open_session(Duration::from_secs(10)).await.unwrap();
    let _g = s.try_acquire("jobs/nightly").await.unwrap();
    let out = c
        .holdfast()
        .args(["lock", "jobs/nightly", "--wait", "0", "--", "true"])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("error: ") && stderr.contains("is held by session"),
        "{stderr}"
    );
}

/// A command that cannot start does not keep the lock: it is released before `holdfast lock` exits, which
/// exits 127 (not found) or 126 (not executable) as a shell would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_releases_at_once_when_the_command_cannot_start() {
    let c = Cluster::start(three()).await;
    let client = c.client().await;
    let work = tempfile::tempdir().unwrap();
    let not_executable = work.path().join("script.sh");
    std::fs::write(&not_executable, "#!/bin/sh\necho hi\n").unwrap();
    for (command, code) in [
        (work.path().join("missing").display().to_string(), 127),
        (not_executable.display().to_string(), 126),
    ] {
        let out = c
            .holdfast()
            .args(["lock", "jobs/broken", "--", &command])
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{command}: {stderr}");
        assert!(stderr.contains("cannot run"), "{stderr}");
        assert!(
            client.describe("jobs/broken").await.unwrap().is_none(),
            "{command}: the lock is still held after holdfast lock exited"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_stops_the_command_when_the_lease_is_lost() {
    let c = Cluster::start(three()).await;
    let endpoints = c.proxied_endpoints().await.join(",");
    let mut child = c
        .holdfast()
        .env("HOLDFAST_ENDPOINTS", endpoints)
        // Only through the proxies: the servers' advertised (direct) endpoints would bypass the cut.
        .env("HOLDFAST_ONLY_ENDPOINTS", "1")
        .args([
            "lock",
            "cut",
            "--ttl",
            "2s",
            "--kill-after",
            "1s",
            "--",
            "sh",
            "-c",
            // A shell with a child of its own, and one that ignores SIGTERM: all must stop (the
            // signals go to CMD's group, SIGKILL after --kill-after).
            "sleep 600 & a=$!; (trap '' TERM; exec sleep 600) & echo $$ $a $!; wait",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let stdout = child.stdout.take().unwrap();
    tokio::io::AsyncBufReadExt::read_line(&mut tokio::io::BufReader::new(stdout), &mut line)
        .await
        .unwrap();
    // Each process with its start time (field 22 of /proc/PID/stat), so a reused pid is not taken for it.
    let started = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.to_string()))
            .and_then(|rest| rest.split_whitespace().nth(19).map(str::to_string))
    };
    let pids: Vec<(u32, Option<String>)> = line
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .map(|pid| (pid, started(pid)))
        .collect();
    c.proxies.isolate(CLIENTS);
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(75), "exit code for a lost lease");
    assert_eq!(pids.len(), 3, "{line}");
    for (pid, start) in pids {
        assert!(
            start.is_some(),
            "process {pid} was not running when its pid was printed"
        );
        // Gone (or another process under a reused pid), or a zombie nobody has reaped yet: stopped
        // either way. Holdfast waits for its group before it exits, but a reparented process's
        // zombie is reaped by init in its own time.
        let stopped = || {
            started(pid) != start
                || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|s| s.contains(") Z "))
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !stopped() {
            assert!(
                std::time::Instant::now() < deadline,
                "process {pid} of the command was not stopped"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspection_commands_print_tables_and_json() {
    let c = Cluster::start(three()).await;
    let client = c.client().await;
    let s = client.open_session(Duration::from_secs(10)).await.unwrap();
    let g = s.try_acquire("inspect/a").await.unwrap();

    let out = c
        .holdfast()
        .args(["status", "--json"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let servers = v.as_array().unwrap();
    assert_eq!(servers.len(), 3);
    let leaders = servers
        .iter()
        .filter(|s| s["groups"][0]["role"] == "leader")
        .count();
    assert_eq!(leaders, 1);

    let out = c
        .holdfast()
        .args(["locks", "inspect/", "--json"])
        .output()
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v[0]["name"], "inspect/a");
    assert_eq!(v[0]["token"], g.token());
    assert_eq!(v[0]["holder_session_id"], s.ids()[0]);

    let out = c
        .holdfast()
        .args(["describe", "inspect/a"])
        .output()
        .await
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains(&format!("token:     {}", g.token())),
        "{text}"
    );
    let out = c
        .holdfast()
        .args(["describe", "inspect/free"])
        .output()
        .await
        .unwrap();
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        "inspect/free is free"
    );

    let out = c
        .holdfast()
        .args(["sessions", "--json"])
        .output()
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["session_id"] == s.ids()[0] && x["locks_held"] == 1));

    let out = c
        .holdfast()
        .args(["describe", "bad\nname"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("control character"), "{stderr}");

    let out = c
        .holdfast()
        .env("HOLDFAST_ENDPOINTS", "127.0.0.1:1")
        .args(["status"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));

    // `holdfast status | head`: a reader that goes away ends the command quietly (SIGPIPE), as with
    // other Unix tools, not with a panic and a backtrace. Here the pipe is closed before it prints.
    let mut child = c
        .holdfast()
        .arg("status")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{stderr}");
}

/// Every way of sending acquires and releases: on the `Calls` streams on connections of their own
/// (the default), on the streams over gRPC, and unary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_reports_json() {
    let c = Cluster::start(three()).await;
    for (flag, calls) in [
        (None, "connection"),
        (Some("--grpc-calls"), "stream"),
        (Some("--unary-calls"), "unary"),
    ] {
        let out = c
            .holdfast()
            .args([
                "bench",
                "acquire-release",
                "--clients",
                "4",
                "--connections",
                "2",
                "--duration",
                "1s",
                "--json",
            ])
            .args(flag)
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(v["ops"].as_u64().unwrap() > 0);
        assert_eq!(v["errors"], 0);
        assert_eq!(
            (v["clients"].as_u64(), v["connections"].as_u64()),
            (Some(4), Some(2))
        );
        assert_eq!(v["calls"], calls);
        assert!(v["p99_ms"].as_f64().unwrap() >= v["p50_ms"].as_f64().unwrap());
    }
}

/// `--clients 1,3` measures each count in turn (one JSON line each) and `--plot` draws them; a hold's
/// plot shows its keepalive latency per second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_sweeps_client_counts_and_plots_them() {
    let c = Cluster::start(three()).await;
    let dir = tempfile::tempdir().unwrap();
    let sweep = dir.path().join("sweep.svg");
    let out = c
        .holdfast_ok(&[
            "bench",
            "acquire-release",
            "--clients",
            "1,3",
            "--duration",
            "1s",
            "--json",
            "--plot",
            sweep.to_str().unwrap(),
        ])
        .await;
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let clients: Vec<u64> = lines
        .iter()
        .map(|v| v["clients"].as_u64().unwrap())
        .collect();
    assert_eq!(clients, [1, 3]);
    assert!(lines.iter().all(|v| v["ops"].as_u64().unwrap() > 0));
    let svg = std::fs::read_to_string(&sweep).unwrap();
    assert!(svg.starts_with("<svg"), "{svg:.200}");
    // Three percentile lines, through two points each.
    assert_three_lines_with(
        &svg,
        &[
            "throughput (acquire+release pairs/s)",
            "1 clients",
            "3 clients",
            "p50",
            "p99.9",
        ],
    );
    assert_eq!(svg.matches("<circle").count(), 6, "{svg}");

    let kept = dir.path().join("hold.svg");
    c.holdfast_ok(&[
        "bench",
        "hold",
        "--sessions",
        "20",
        "--locks-per-session",
        "2",
        "--ttl",
        "3s",
        "--duration",
        "4s",
        "--plot",
        kept.to_str().unwrap(),
    ])
    .await;
    let svg = std::fs::read_to_string(&kept).unwrap();
    assert_three_lines_with(
        &svg,
        &[
            "keepalive latency (ms, log scale)",
            "time into the hold (s)",
            "max",
        ],
    );
}

/// A bench plot has every text in `texts` and three lines (blue, red, green), each drawn once in the
/// chart and once in the legend.
fn assert_three_lines_with(svg: &str, texts: &[&str]) {
    for text in texts {
        assert!(svg.contains(text), "the plot has no {text:?}");
    }
    for color in ["#1F77B4", "#D62728", "#2CA02C"] {
        let line = format!("stroke=\"{color}\" stroke-width=\"2\"");
        assert_eq!(svg.matches(&line).count(), 2, "{color} in {svg}");
    }
}

/// A client command's log (`HOLDFAST_LOG`) written to a file or pipe has no terminal colour codes in it.
#[test]
fn a_client_commands_log_into_a_pipe_has_no_colour_codes() {
    // Port 1 on loopback: nothing listens, so the status call fails at once, after logging its attempt.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_holdfast"))
        .args(["status", "--endpoints", "127.0.0.1:1"])
        .env("HOLDFAST_LOG", "trace")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("TRACE"), "no log lines: {log}");
    assert!(!log.contains('\x1b'), "colour codes in the log: {log}");
}

/// Under `nohup` (SIGHUP inherited as ignored), a hangup leaves `holdfast lock` and CMD running, as it
/// would CMD alone (catching it to pass it on would end CMD); SIGTERM still stops CMD's group, and the
/// lock is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_under_nohup_leaves_the_hangup_ignored() {
    let c = Cluster::start(three()).await;
    let client = c.client().await;
    // `trap '' HUP` is what nohup does: the ignored disposition is inherited through exec.
    let mut holder = tokio::process::Command::new("sh")
        .arg("-c")
        .arg("trap '' HUP; exec \"$0\" lock nohup/job -- sh -c 'echo $$; exec sleep 600'")
        .arg(env!("CARGO_BIN_EXE_holdfast"))
        .env("HOLDFAST_ENDPOINTS", c.endpoints().join(","))
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut line = String::new();
    let stdout = holder.stdout.take().unwrap();
    tokio::io::AsyncBufReadExt::read_line(&mut tokio::io::BufReader::new(stdout), &mut line)
        .await
        .unwrap();
    let command_pid: u32 = line.trim().parse().unwrap();
    let holder_pid = holder.id().unwrap();
    let kill = |sig: &str, pid: u32| {
        assert!(std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap()
            .success());
    };
    kill("-HUP", holder_pid);
    // Both still there, the lock still held, a while later (what the hangup would have ended).
    let held = || async { client.describe("nohup/job").await.unwrap().is_some() };
    for _ in 0..10 {
        assert!(held().await, "the lock was released after the hangup");
        assert!(
            holder.try_wait().unwrap().is_none(),
            "holdfast lock ended on the hangup"
        );
        assert!(
            std::path::Path::new(&format!("/proc/{command_pid}")).exists(),
            "CMD ended on the hangup"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    kill("-TERM", holder_pid);
    let status = tokio::time::timeout(Duration::from_secs(30), holder.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(143), "CMD's exit on SIGTERM, passed on");
    assert!(
        !held().await,
        "the lock is still held after holdfast lock exited"
    );
}
