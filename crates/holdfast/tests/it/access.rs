//! The access policy: principals from client certificates and bearer tokens, permissions on name
//! prefixes, default deny, refusals that name who lacked what, and a policy replaced while it runs.

use crate::harness::{certs, Cluster, Options};
use holdfast_client::{Client, ClientOptions, ClientTls, Error};
use std::time::Duration;
use tokio::time::Instant;

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

async fn wait_log(c: &Cluster, id: u64, text: &str, count: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while c.log_text(id).matches(text).count() < count {
        assert!(
            Instant::now() < deadline,
            "server {id} never logged {text:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
        wait_log(&c, i, "policy: changed", 1).await;
    }
    denied(session.try_acquire("b/x").await, &["\"alice\"", "\"b/x\""]);
    assert!(session.try_acquire("a/y").await.is_ok());
    // A valid one: alice may lock b/ too, at once, on the sessions she has.
    std::fs::write(&policy_path, policy(r#""a/", "b/""#)).unwrap();
    for i in 1..=3 {
        wait_log(&c, i, "policy reloaded", 1).await;
    }
    let b = session.try_acquire("b/x").await.unwrap();
    b.release().await.unwrap();
    assert!(session.is_valid());
}
