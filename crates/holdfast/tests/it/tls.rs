//! TLS on every port: who gets in (a client of the cluster CA), who does not (plaintext, a foreign CA,
//! a client certificate on the peer port), and certificates replaced while clients run.

use crate::harness::{certs, Cluster, Options};
use holdfast_client::{Client, ClientOptions, ClientTls, Error};
use holdfast_proto::v1::peer_client::PeerClient;
use std::path::Path;
use std::time::Duration;
use tokio::time::Instant;

fn options(endpoints: Vec<String>, tls: Option<ClientTls>) -> (Vec<String>, ClientOptions) {
    let options = ClientOptions {
        request_timeout: Duration::from_secs(3),
        tls,
        ..ClientOptions::default()
    };
    (endpoints, options)
}

async fn try_connect(c: &Cluster, tls: Option<ClientTls>) -> Result<Client, Error> {
    let (endpoints, options) = options(c.endpoints(), tls);
    let client = Client::connect_with(endpoints, options).await?;
    client.open_session(Duration::from_secs(10)).await?;
    Ok(client)
}

fn pair(dir: &Path, stem: &str) -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    Some((
        dir.join(format!("{stem}.pem")),
        dir.join(format!("{stem}.key")),
    ))
}

/// A peer RPC to server 1's peer port, presenting `identity`.
async fn vote_as(
    c: &Cluster,
    identity: Option<(std::path::PathBuf, std::path::PathBuf)>,
) -> tonic::Status {
    vote_claiming(c, identity, None).await
}

/// A vote request to server 1's peer port presenting `identity`, with a header claiming `from_node`.
async fn vote_claiming(
    c: &Cluster,
    identity: Option<(std::path::PathBuf, std::path::PathBuf)>,
    from_node: Option<u64>,
) -> tonic::Status {
    let request = holdfast_proto::v1::VoteRequest {
        header: from_node.map(|from_node| holdfast_proto::v1::PeerHeader {
            from_node,
            ..Default::default()
        }),
        ..Default::default()
    };
    let dir = c.tls_dir.as_ref().unwrap();
    let tls = ClientTls::from_files(dir.join("ca.pem"), identity).unwrap();
    let endpoint =
        tonic::transport::Endpoint::from_shared(format!("http://{}", c.peer_endpoint(1)))
            .unwrap()
            .timeout(Duration::from_secs(3));
    match endpoint
        .connect_with_connector(tls.connector().clone())
        .await
    {
        Err(e) => tonic::Status::unavailable(format!("connect: {e}")),
        Ok(channel) => PeerClient::new(channel)
            .vote(request)
            .await
            .expect_err("an empty vote request is not a valid one"),
    }
}

/// An AppendEntries on a connection of its own (`raw_append`) to server 1's peer port presenting
/// `identity`, with a header claiming `from_node`: the reply's status code and message.
async fn raw_append_claiming(
    c: &Cluster,
    identity: Option<(std::path::PathBuf, std::path::PathBuf)>,
    from_node: u64,
) -> (u8, String) {
    use prost::Message;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = c.tls_dir.as_ref().unwrap();
    let tls = ClientTls::from_files(dir.join("ca.pem"), identity).unwrap();
    let mut io = holdfast_proto::transport::connect_raw(&c.peer_endpoint(1), Some(tls.connector()))
        .await
        .unwrap();
    let request = holdfast_proto::v1::AppendEntriesRequest {
        header: Some(holdfast_proto::v1::PeerHeader {
            from_node,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut frame = b"HFAPPEND".to_vec();
    frame.extend_from_slice(&1u32.to_le_bytes());
    frame.extend_from_slice(&(request.encoded_len() as u32).to_le_bytes());
    request.encode(&mut frame).unwrap();
    io.write_all(&frame).await.unwrap();
    let mut len = [0u8; 4];
    io.read_exact(&mut len).await.unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    io.read_exact(&mut body).await.unwrap();
    let code = body.remove(0);
    (code, String::from_utf8_lossy(&body).into_owned())
}

/// An answer from the Raft service itself, not a connection that failed or was closed under the call
/// (TLS 1.3 finishes the client's side of the handshake before the server has checked its certificate,
/// so a refused client sees its first call fail, not its connect).
fn reached_service(status: &tonic::Status) -> bool {
    let transport = std::error::Error::source(status)
        .is_some_and(|e| e.downcast_ref::<tonic::transport::Error>().is_some());
    !transport && status.code() != tonic::Code::Unavailable
}

/// With `--client-certs=required`: the harness's client (certificate `tester` of the cluster CA) works;
/// plaintext, no certificate, a certificate of another CA, and trusting another CA all fail to connect.
/// On the peer port a server certificate reaches the Raft service, a client certificate of the same
/// CA does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_holders_of_cluster_certificates_get_in_and_only_servers_reach_the_peer_port() {
    let c = Cluster::start(Options {
        nodes: 3,
        tls: true,
        http: true,
        server_args: vec!["--client-certs=required".into()],
        ..Options::default()
    })
    .await;
    let dir = c.tls_dir.clone().unwrap();
    let client = c.client().await;
    let session = client.open_session(Duration::from_secs(10)).await.unwrap();
    let guard = session.try_acquire("tls/x").await.unwrap();

    let plaintext = try_connect(&c, None).await.err().expect("plaintext got in");
    assert!(plaintext.to_string().contains("TLS port?"), "{plaintext}");

    let no_cert = ClientTls::from_files(dir.join("ca.pem"), None::<(&str, &str)>).unwrap();
    try_connect(&c, Some(no_cert))
        .await
        .err()
        .expect("a client without a certificate got in");

    let other = dir.join("other");
    let o = other.to_str().unwrap();
    certs(&["ca", "--dir", o]);
    certs(&["client", "--dir", o, "--name", "mallory"]);
    let foreign = ClientTls::from_files(dir.join("ca.pem"), pair(&other, "mallory")).unwrap();
    try_connect(&c, Some(foreign))
        .await
        .err()
        .expect("a foreign client certificate got in");
    let wrong_ca = ClientTls::from_files(other.join("ca.pem"), pair(&dir, "tester")).unwrap();
    let e = try_connect(&c, Some(wrong_ca))
        .await
        .err()
        .expect("a server of another CA was trusted");
    assert!(e.to_string().contains("UnknownIssuer"), "{e}");

    // The CLI reads the same settings from HOLDFAST_CA/CERT/KEY.
    let out = c.holdfast_ok(&["describe", "tls/x"]).await;
    assert!(String::from_utf8_lossy(&out.stdout).contains(&guard.token().to_string()));

    // The peer port: a client certificate of the cluster CA is turned away at the handshake; a server
    // certificate gets as far as the Raft service, which refuses an empty vote for what it is.
    let as_client = vote_as(&c, pair(&dir, "tester")).await;
    assert!(!reached_service(&as_client), "{as_client:?}");
    let as_nobody = vote_as(&c, None).await;
    assert!(!reached_service(&as_nobody), "{as_nobody:?}");
    let as_server = vote_as(&c, pair(&dir, "server-2")).await;
    assert!(reached_service(&as_server), "{as_server:?}");
    // A server's key speaks only for that server: server 2's certificate claiming node 3 is refused
    // for that; claiming node 2 it gets past the check (and is refused later, for its empty header).
    let impostor = vote_claiming(&c, pair(&dir, "server-2"), Some(3)).await;
    assert_eq!(
        impostor.code(),
        tonic::Code::PermissionDenied,
        "{impostor:?}"
    );
    assert!(impostor.message().contains("node 2's"), "{impostor:?}");
    let itself = vote_claiming(&c, pair(&dir, "server-2"), Some(2)).await;
    assert!(
        reached_service(&itself) && itself.code() != tonic::Code::PermissionDenied,
        "{itself:?}"
    );
    // The same on a connection of appends outside gRPC: the certificate's node, not the header's.
    let (code, why) = raw_append_claiming(&c, pair(&dir, "server-2"), 3).await;
    assert_eq!(code, tonic::Code::PermissionDenied as u8, "{why}");
    assert!(why.contains("node 2's"), "{why}");
    // A leader's append connection checks it reached the node it dialled, as its gRPC channel does:
    // server 1 answering for node 2 is refused (the connector leaders use: `peer::Peers::connector`).
    let expecting = |id: u64| {
        let mut connector = ClientTls::from_files(dir.join("ca.pem"), pair(&dir, "server-2"))
            .unwrap()
            .connector()
            .clone();
        connector.expect_common_name = Some(format!("holdfast-server-{id}"));
        connector
    };
    let impersonated =
        holdfast_proto::transport::connect_raw(&c.peer_endpoint(1), Some(&expecting(2))).await;
    let e = impersonated.err().expect("server 1 passed for node 2");
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    holdfast_proto::transport::connect_raw(&c.peer_endpoint(1), Some(&expecting(1)))
        .await
        .expect("server 1 is node 1");
    let refused = c.metrics(1).await;
    assert!(
        refused["holdfast_tls_handshakes_refused_total{port=\"peer\"}"] >= 2,
        "{refused:?}"
    );
    assert!(refused["holdfast_tls_handshakes_refused_total{port=\"client\"}"] >= 3);

    // Leadership moves over the peer port (the transfer message carries the leader's vote, which must
    // be its sender's), and a follower's readiness asks the leader over TLS too.
    let old = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let new = client.transfer_leader(0, None).await.unwrap();
    assert_ne!(new, old);
    let leader = c
        .wait_for_leader_except(0, old, Duration::from_secs(10))
        .await;
    let follower = (1..=3).find(|&i| i != leader).unwrap();
    let (code, body) = c.http_get(follower, "/readyz").await;
    assert_eq!(code, 200, "{body}");
    // The leaders appended over TLS on connections of their own.
    let appends = c.metrics(follower).await["holdfast_peer_append_connections_total"];
    assert!(appends >= 1, "{appends}");

    // Nothing the refused clients did touched the lock.
    assert!(guard.is_valid());
    let held = c.client().await.describe("tls/x").await.unwrap().unwrap();
    assert_eq!(held.token, guard.token());
}

/// The certificate (DER) a server presents on `port`.
async fn presented(ca: &Path, port: u16) -> Vec<u8> {
    let ca = std::fs::read(ca).unwrap();
    let config = holdfast_proto::tls::client_config(&ca, None).unwrap();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let name = holdfast_proto::tls::rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, tcp)
        .await
        .unwrap();
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

fn der_of(pem: &Path) -> Vec<u8> {
    holdfast_proto::tls::certs_from_pem(&std::fs::read(pem).unwrap()).unwrap()[0].to_vec()
}

/// Every server's certificate and key are replaced while a client holds a lock and another cycles
/// acquire+release. A half-done replacement (a key that does not match) is refused and the old pair
/// stays in use; the full one is picked up without a restart; new connections, client and peer, use
/// it (every server presents its new certificate; a restarted follower catches up and, after the
/// leader is killed, the others elect one). No session is lost and no cycle fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_are_rotated_without_a_restart_and_no_session_is_lost() {
    let mut c = Cluster::start(Options {
        nodes: 3,
        tls: true,
        ..Options::default()
    })
    .await;
    let dir = c.tls_dir.clone().unwrap();
    let client = c.client().await;
    let holder = client.open_session(Duration::from_secs(10)).await.unwrap();
    let guard = holder.try_acquire("rotate/held").await.unwrap();
    let cycler = client.open_session(Duration::from_secs(10)).await.unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cycles = {
        let (cycler, stop) = (cycler.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let g = cycler
                    .acquire_timeout("rotate/cycle", Duration::from_secs(10))
                    .await
                    .unwrap_or_else(|e| panic!("cycle {n}: {e}"));
                g.release()
                    .await
                    .unwrap_or_else(|e| panic!("release {n}: {e}"));
                n += 1;
            }
            n
        })
    };

    // New pairs, made aside and moved in by rename.
    let new = dir.join("new");
    let n = new.to_str().unwrap();
    std::fs::create_dir_all(&new).unwrap();
    std::fs::copy(dir.join("ca.pem"), new.join("ca.pem")).unwrap();
    std::fs::copy(dir.join("ca.key"), new.join("ca.key")).unwrap();
    for i in 1..=3u64 {
        certs(&["server", "--dir", n, "--id", &i.to_string()]);
    }
    let ca = dir.join("ca.pem");
    let old_1 = der_of(&dir.join("server-1.pem"));
    assert_eq!(presented(&ca, c.servers[0].client_port).await, old_1);
    // Half done on server 1: its new certificate with its old key. Refused; the old pair serves on.
    std::fs::rename(new.join("server-1.pem"), dir.join("server-1.pem")).unwrap();
    c.wait_for_log(1, "does not load", 1).await;
    assert_eq!(presented(&ca, c.servers[0].client_port).await, old_1);
    let still = c.client().await;
    still.open_session(Duration::from_secs(10)).await.unwrap();
    // Finished everywhere.
    std::fs::rename(new.join("server-1.key"), dir.join("server-1.key")).unwrap();
    for i in 2..=3u64 {
        std::fs::rename(
            new.join(format!("server-{i}.key")),
            dir.join(format!("server-{i}.key")),
        )
        .unwrap();
        std::fs::rename(
            new.join(format!("server-{i}.pem")),
            dir.join(format!("server-{i}.pem")),
        )
        .unwrap();
    }
    for i in 1..=3u64 {
        c.wait_for_log(i, "TLS certificates reloaded", 1).await;
        let new = der_of(&dir.join(format!("server-{i}.pem")));
        let s = &c.servers[(i - 1) as usize];
        assert_eq!(
            presented(&ca, s.client_port).await,
            new,
            "server {i}, client port"
        );
        assert_eq!(
            presented(&ca, s.peer_port).await,
            new,
            "server {i}, peer port"
        );
    }
    // New client connections get the new certificates (and still verify against the CA).
    let fresh = c.client().await;
    let s = fresh.open_session(Duration::from_secs(10)).await.unwrap();
    s.close().await.unwrap();

    // New peer connections too: a restarted follower connects to the others and they to it, all with
    // new certificates, and it catches up; then the leader goes and the others elect one.
    let leader = c.wait_for_leader(0, Duration::from_secs(10)).await;
    let follower = (1..=3).find(|&i| i != leader).unwrap();
    c.kill(follower).await;
    let g = cycler
        .acquire_timeout("rotate/while-down", Duration::from_secs(15))
        .await
        .unwrap();
    g.release().await.unwrap();
    c.start_server(follower);
    let target = c.group_status(leader, 0).await.unwrap().applied_index;
    let deadline = Instant::now() + Duration::from_secs(20);
    while c
        .group_status(follower, 0)
        .await
        .map_or(0, |s| s.applied_index)
        < target
    {
        assert!(
            Instant::now() < deadline,
            "the restarted follower did not catch up to {target}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    c.kill(leader).await;
    c.wait_for_leader_except(0, leader, Duration::from_secs(20))
        .await;
    let after = c.client().await;
    let described = after.describe("rotate/held").await.unwrap().unwrap();
    assert_eq!(
        described.token,
        guard.token(),
        "the held lock changed hands"
    );
    let g = cycler
        .acquire_timeout("rotate/after", Duration::from_secs(15))
        .await
        .unwrap();
    g.release().await.unwrap();

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let done = cycles.await.unwrap();
    assert!(done > 0, "no cycle ran");
    assert!(holder.is_valid(), "the holder's session was lost");
    assert!(cycler.is_valid(), "the cycling session was lost");
    assert!(guard.is_valid());
}
