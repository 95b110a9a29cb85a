//! The access policy: principals from client certificates and bearer tokens, permissions on name
//! prefixes, default deny, refusals that name who lacked what, and a policy replaced while it runs.

use crate::harness::{certs, Cluster, Options};
use holdfast_client::{Client, ClientOptions, ClientTls, Error};
use std::time::Duration;

/// sha256("ci-token") (the `ci` principal's bearer token).
const CI_TOKEN: &str = "ci-token";

fn policy(alice_locks: &str) -> String {
    let ci_hash: String = holdfast_server::access::token_hash(CI_TOKEN)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!(
        r#"
[roles.operator]
admin = true
lock = [""]
read = [""]
[roles.alice]
lock = [{alice_locks}]
[roles.a-reader]
read = ["a/"]

[principals.tester]
roles = ["operator"]
[principals.alice]
roles = ["alice"]
[principals.ci]
roles = ["a-reader"]
max_watches = 1
tokens_sha256 = ["{ci_hash}"]
"#
    )
}

async fn client_as(c: &Cluster, cert: Option<&str>, token: Option<&str>) -> Result<Client, Error> {
    let dir = c.tls_dir.as_ref().unwrap();
    let identity = cert.map(|n| (dir.join(format!("{n}.pem")), dir.join(format!("{n}.key"))));
    let options = ClientOptions {
        request_timeout: Duration::from_secs(5),
        tls: Some(ClientTls::from_files(dir.join("ca.pem"), identity).unwrap()),
        token: token.map(str::to_string),
        ..ClientOptions::default()
    };
    Client::connect_with(c.endpoints(), options).await
}

fn denied<T>(result: Result<T, Error>, words: &[&str]) {
    match result {
        Err(Error::PermissionDenied(m)) => {
            for w in words {
                assert!(m.contains(w), "{m:?} does not name {w:?}");
            }
        }
        Err(e) => panic!("expected PERMISSION_DENIED naming {words:?}, got {e:?}"),
        Ok(_) => panic!("expected PERMISSION_DENIED naming {words:?}, but it was allowed"),
    }
}

/// Every server's (applied index, table digest), once they agree.
async fn digest(c: &Cluster) -> (u64, u64) {
    let digest = c.wait_converged(0, Duration::from_secs(10)).await;
    (c.group_status(1, 0).await.unwrap().applied_index, digest)
}

/// `alice` (a client certificate) may lock `a/` only and read nothing; `ci` (a bearer token) may read
/// `a/` only; `tester` administers. Everything else is refused with the principal, the permission and
/// the name in the message, and the refused requests change nothing (the table digest is unchanged).
/// Then the policy file is replaced: a broken version is refused and the old one stays; a valid one
/// giving alice `b/` takes effect without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn principals_get_what_their_roles_grant_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let policy_path = dir.path().join("policy.toml");
    std::fs::write(&policy_path, policy(r#""a/""#)).unwrap();
    let c = Cluster::start(Options {
        nodes: 3,
        tls: true,
        http: true,
        server_args: vec![format!("--policy={}", policy_path.display())],
        ..Options::default()
    })
    .await;
    let tls_dir = c.tls_dir.clone().unwrap();
    for name in ["alice", "bob"] {
        certs(&["client", "--dir", tls_dir.to_str().unwrap(), "--name", name]);
    }

    let alice = client_as(&c, Some("alice"), None).await.unwrap();
    let session = alice.open_session(Duration::from_secs(10)).await.unwrap();
    let guard = session.try_acquire("a/x").await.unwrap();
    // The dashboard's HTTP port authenticates nobody: with a policy it shows counts, never names.
    for path in [
        "/ui/api/locks",
        "/ui/api/locks?prefix=a%2F",
        "/ui/api/sessions",
    ] {
        let (code, body) = c.http_get(1, path).await;
        assert_eq!(code, 403, "{path}: {body}");
        assert!(!body.contains("a/x"), "{body}");
    }
    // The overview keeps roles and counts, and leaves out what names the cluster or says where its
    // servers are.
    let (code, body) = c.http_get(1, "/ui/api/overview").await;
    assert!(
        code == 200 && body.contains("\"lists_allowed\":false") && !body.contains("a/x"),
        "{body}"
    );
    let (_, status) = c.http_get(1, "/metrics").await;
    assert!(status.contains("holdfast_is_leader"), "{status}");
    for hidden in ["127.0.0.1", "\"cluster_id\":\""] {
        assert!(!body.contains(hidden), "{hidden} in {body}");
    }
    let before = digest(&c).await;
    denied(
        session.try_acquire("b/x").await,
        &["\"alice\"", "lock", "\"b/x\""],
    );
    denied(
        alice.describe("a/x").await,
        &["\"alice\"", "read", "\"a/x\""],
    );
    denied(alice.list_locks("").await, &["\"alice\"", "read"]);
    denied(
        alice.transfer_leader(0, None).await,
        &["\"alice\"", "admin"],
    );

    // A token: ci reads a/ but cannot open a session, nor read b/.
    let ci = client_as(&c, None, Some(CI_TOKEN)).await.unwrap();
    let seen = ci.describe("a/x").await.unwrap().unwrap();
    assert_eq!(seen.token, guard.token());
    denied(ci.describe("b/x").await, &["\"ci\"", "read", "\"b/x\""]);
    denied(
        ci.open_session(Duration::from_secs(10)).await,
        &["\"ci\"", "lock"],
    );

    // Nobody the policy knows: a certificate it does not list, no credentials, an unknown token.
    denied(
        client_as(&c, Some("bob"), None).await,
        &["\"bob\"", "not in the policy"],
    );
    denied(client_as(&c, None, None).await, &["\"anonymous\""]);
    denied(client_as(&c, None, Some("guess")).await, &["token"]);
    // A `Calls` connection is taken only from a caller who may lock something (the others' calls go
    // over gRPC, where they are refused with reasons): alice's certificate, not ci's token, an unknown
    // token or nothing.
    let ca = std::fs::read(tls_dir.join("ca.pem")).unwrap();
    let (cert, key) = (
        std::fs::read(tls_dir.join("alice.pem")).unwrap(),
        std::fs::read(tls_dir.join("alice.key")).unwrap(),
    );
    for (identity, authorization, taken) in [
        (Some((&cert[..], &key[..])), "", true),
        (None, "Bearer ci-token", false),
        (None, "Bearer guess", false),
        (None, "", false),
    ] {
        let tls = holdfast_proto::tls::TlsConnector::new(
            holdfast_proto::tls::client_config(&ca, identity).unwrap(),
            None,
        );
        let mut io = holdfast_proto::transport::connect_raw(&c.endpoint(1), Some(&tls))
            .await
            .unwrap();
        let status =
            crate::calls::calls_hello(&mut io, holdfast_server::raw_calls::VERSION, authorization)
                .await;
        assert_eq!(status == 0, taken, "{authorization:?}");
    }
    // The CLI says the same.
    let out = c
        .holdfast()
        .env("HOLDFAST_CERT", tls_dir.join("alice.pem"))
        .env("HOLDFAST_KEY", tls_dir.join("alice.key"))
        .args(["describe", "a/x"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("permission denied") && stderr.contains("alice"),
        "{stderr}"
    );

    assert_eq!(
        digest(&c).await,
        before,
        "a refused request changed the table"
    );
    assert!(guard.is_valid());

    // A broken policy: refused, the old one stays.
    std::fs::write(&policy_path, "[roles.x]\nlocks = []\n").unwrap();
    for i in 1..=3 {
        c.wait_for_log(i, "policy: changed", 1).await;
    }
    denied(session.try_acquire("b/x").await, &["\"alice\"", "\"b/x\""]);
    assert!(session.try_acquire("a/y").await.is_ok());
    // A valid one: alice may lock b/ too, at once, on the sessions she has.
    std::fs::write(&policy_path, policy(r#""a/", "b/""#)).unwrap();
    for i in 1..=3 {
        c.wait_for_log(i, "policy reloaded", 1).await;
    }
    let b = session.try_acquire("b/x").await.unwrap();
    // Revoked on b/ while she holds b/x: she may take no more there, but may still let go of it
    // (giving up needs only to be in the policy, and the session's secret).
    std::fs::write(&policy_path, policy(r#""a/""#)).unwrap();
    for i in 1..=3 {
        c.wait_for_log(i, "policy reloaded", 2).await;
    }
    denied(session.try_acquire("b/y").await, &["\"alice\"", "\"b/y\""]);
    b.release().await.unwrap();
    assert!(session.is_valid());

    // Revoked: alice loses lock altogether. Her keepalives (calls on her Calls stream) are checked on
    // every message, so her session stops being renewed and is lost within its TTL, though its stream
    // stays open.
    std::fs::write(&policy_path, policy("")).unwrap();
    for i in 1..=3 {
        c.wait_for_log(i, "policy reloaded", 3).await;
    }
    let lost = tokio::time::timeout(Duration::from_secs(15), session.lost()).await;
    assert!(
        lost.is_ok(),
        "a revoked principal's session was still renewed"
    );
}

/// Per-principal quotas: alice may have 2 sessions and 3 locks (held or waited for) across them; past
/// them she gets a clear LIMIT_EXCEEDED naming the quota, and another principal is unaffected. Closing
/// a session gives its share back. The counts are replicated: a new leader enforces the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_principal_is_held_to_its_quotas_and_others_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let policy_path = dir.path().join("policy.toml");
    let text = policy(r#""""#).replace(
        "[principals.alice]\nroles = [\"alice\"]\n",
        "[principals.alice]\nroles = [\"alice\"]\nmax_sessions = 2\nmax_locks = 3\n",
    );
    assert!(text.contains("max_locks"), "{text}");
    std::fs::write(&policy_path, text).unwrap();
    let mut c = Cluster::start(Options {
        nodes: 3,
        tls: true,
        server_args: vec![format!("--policy={}", policy_path.display())],
        ..Options::default()
    })
    .await;
    let tls_dir = c.tls_dir.clone().unwrap();
    certs(&[
        "client",
        "--dir",
        tls_dir.to_str().unwrap(),
        "--name",
        "alice",
    ]);
    let alice = client_as(&c, Some("alice"), None).await.unwrap();
    let one = alice.open_session(Duration::from_secs(10)).await.unwrap();
    let two = alice.open_session(Duration::from_secs(10)).await.unwrap();
    let over = |r: Result<_, Error>, quota: &str| match r {
        Err(Error::LimitExceeded { limit, message, .. }) => {
            assert_eq!(limit, quota, "{message}");
            assert!(message.contains(quota), "{message}");
        }
        Err(e) => panic!("expected {quota}, got {e:?}"),
        Ok(_) => panic!("expected {quota}, but it was allowed"),
    };
    over(
        alice
            .open_session(Duration::from_secs(10))
            .await
            .map(|_| ()),
        "principal_max_sessions",
    );
    // Another principal is not held to alice's quota.
    let tester = c.client().await;
    let theirs = tester.open_session(Duration::from_secs(10)).await.unwrap();
    let _t = theirs.try_acquire("q/t").await.unwrap();

    let _a = one.try_acquire("q/a").await.unwrap();
    let _b = two.try_acquire("q/b").await.unwrap();
    let _c = one.try_acquire("q/c").await.unwrap();
    over(
        two.try_acquire("q/d").await.map(|_| ()),
        "principal_max_locks",
    );

    // The counts live in the replicated table: after a failover the new leader refuses the same.
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    c.kill(leader).await;
    c.wait_for_leader_except(0, leader, Duration::from_secs(20))
        .await;
    over(
        two.try_acquire("q/e").await.map(|_| ()),
        "principal_max_locks",
    );
    // Closing a session gives back its session and its two locks.
    one.close().await.unwrap();
    let _d = two.try_acquire("q/d").await.unwrap();
    let three = alice.open_session(Duration::from_secs(10)).await.unwrap();
    assert!(three.is_valid() && two.is_valid());

    // Watch streams: `read` on the prefix, and ci's max_watches = 1 on each server.
    let ci = client_as(&c, None, Some(CI_TOKEN)).await.unwrap();
    denied(ci.watch("b/").await.map(|_| ()), &["ci", "read", "b/"]);
    let first = ci.watch("a/").await.unwrap();
    over(ci.watch("a/").await.map(|_| ()), "principal_max_watches");
    // Another principal is not counted against ci.
    let _theirs = tester.watch("a/").await.unwrap();
    // A closed watch gives its slot back (once the server sees the stream end).
    drop(first);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match ci.watch("a/").await {
            Ok(_) => break,
            Err(Error::LimitExceeded { .. }) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("the slot of a dropped watch was not given back: {e}"),
        }
    }
}
