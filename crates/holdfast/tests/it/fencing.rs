//! The design's own scenario (seed, "The danger is a gap between checking and acting"): a holder paused
//! past its lease is fenced off by the resource, and a client that cannot renew learns it has lost the
//! lease before the server can expire it.

use crate::harness::{Cluster, Options, CLIENTS};
use holdfast_fence::service::{serve, FenceClient};
use holdfast_fence::store::FencedStore;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

async fn fence_store(dir: &std::path::Path) -> (String, Arc<FencedStore>) {
    let store = Arc::new(FencedStore::open(&dir.join("fence.log")).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(serve(listener, store.clone(), std::future::pending()));
    (addr, store)
}

async fn wait_for_file(path: &std::path::Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if s.ends_with('\n') {
                return s.trim().to_string();
            }
        }
        assert!(
            Instant::now() < deadline,
            "{} never written",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A acquires (token t) and is paused with SIGSTOP for longer than its TTL; its session expires; B
/// acquires (token > t) and writes; A resumes and writes with t; the store refuses A's write and B's
/// write is intact. A is real processes: `holdfast lock` (the session) and the writer it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holder_is_fenced_off_after_its_session_expires() {
    let c = Cluster::start(Options {
        nodes: 3,
        ..Options::default()
    })
    .await;
    let work = tempfile::tempdir().unwrap();
    let (store_addr, store) = fence_store(work.path()).await;
    let token_file = work.path().join("a.token");
    let exit_file = work.path().join("a.exit");
    // The writer stops itself right after it learned its token, as if paused between check and act.
    let script = format!(
        "echo $HOLDFAST_TOKEN > {t}; kill -STOP $$; {bin} fence-write acct from-A --store {s} 2> {e}.err; echo $? > {e}",
        t = token_file.display(),
        bin = env!("CARGO_BIN_EXE_holdfast"),
        s = store_addr,
        e = exit_file.display(),
    );
    let mut a = c
        .holdfast()
        .args(["lock", "acct", "--ttl", "2s", "--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let token_a: u64 = wait_for_file(&token_file).await.parse().unwrap();
    // Pause A's session holder too: no more keepalives.
    let holder_pid = a.id().unwrap();
    assert!(std::process::Command::new("kill")
        .args(["-STOP", &holder_pid.to_string()])
        .status()
        .unwrap()
        .success());

    let client = c.client().await;
    let b = client.open_session(Duration::from_secs(10)).await.unwrap();
    let guard_b = b
        .acquire_timeout("acct", Duration::from_secs(30))
        .await
        .expect("B gets the lock once A's session expires");
    assert!(guard_b.token() > token_a);
    let mut fence = FenceClient::connect(&store_addr).await.unwrap();
    fence
        .write("acct", guard_b.token(), b"from-B")
        .await
        .unwrap();

    // A wakes up and writes with its old token.
    let writer = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.split_whitespace().nth(3) == Some(&holder_pid.to_string()))
        })
        .expect("A's writer is a child of its holdfast lock process");
    assert!(std::process::Command::new("kill")
        .args(["-CONT", &writer.to_string()])
        .status()
        .unwrap()
        .success());
    let a_exit = wait_for_file(&exit_file).await;
    let a_err = std::fs::read_to_string(format!("{}.err", exit_file.display())).unwrap();
    assert_ne!(a_exit, "0", "A's stale write was accepted");
    assert!(
        a_err.contains("stale token"),
        "A's write failed for another reason: {a_err}"
    );
    let e = store.peek("acct").unwrap();
    assert_eq!(
        (e.value.as_deref(), e.value_token),
        (Some(&b"from-B"[..]), guard_b.token()),
        "B's write is intact"
    );

    // A's holder resumes, finds its lease lost, and exits with the lease-lost code.
    assert!(std::process::Command::new("kill")
        .args(["-CONT", &holder_pid.to_string()])
        .status()
        .unwrap()
        .success());
    let status = tokio::time::timeout(Duration::from_secs(30), a.wait())
        .await
        .unwrap()
        .unwrap();
    // 75 whichever it sees first on resuming, the lost lease or its writer's end: a command that
    // ended after the lease lapsed does not pass for a clean run.
    assert_eq!(status.code(), Some(75), "{status:?}");
}

/// Without a pause: a client cut off from the cluster learns that its lease may be lost before the
/// server expires its session and frees its lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_client_knows_before_the_server_expires_it() {
    let c = Cluster::start(Options {
        nodes: 3,
        ..Options::default()
    })
    .await;
    // Only through the proxies: the servers' advertised (direct) endpoints would bypass the cut.
    let options = holdfast_client::ClientOptions {
        discover: false,
        ..Default::default()
    };
    let cut_off = holdfast_client::Client::connect_with(c.proxied_endpoints().await, options)
        .await
        .unwrap();
    let session = cut_off.open_session(Duration::from_secs(2)).await.unwrap();
    let guard = session.try_acquire("x").await.unwrap();
    let observer = c.client().await;

    c.proxies.isolate(CLIENTS);
    let cut_at = Instant::now();
    let freed = tokio::spawn(async move {
        loop {
            match observer.describe("x").await.unwrap() {
                Some(l) if l.token == guard.token() => {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                _ => return Instant::now(),
            }
        }
    });
    let lost = session.lost().await;
    let lost_at = Instant::now();
    let freed_at = freed.await.unwrap();
    assert!(
        lost_at < freed_at,
        "the client learned of the loss {:?} after the server freed the lock ({lost:?})",
        lost_at - freed_at
    );
    eprintln!(
        "cut off at 0; client lease lost at {:?}; server freed the lock at {:?}",
        lost_at - cut_at,
        freed_at - cut_at
    );
    assert!(!session.is_valid());
    let err = session.try_acquire("y").await.err().unwrap();
    assert!(matches!(err, holdfast_client::Error::LeaseLost(_)), "{err}");
}
