//! Real `holdfast server` processes on 127.0.0.1 with real data directories, for cluster tests.
//!
//! Every peer link goes through a [`Proxies`] link so a test can partition servers. Servers are started
//! with `--exit-on-stdin-close`, so they exit with the test process even if it is killed, and are killed
//! (SIGKILL, by the PID we started) when the harness is dropped.

use crate::proxy::Proxies;
use holdfast_client::{Client, ClientOptions};
use holdfast_proto::v1::holdfast_client::HoldfastClient;
use holdfast_proto::v1::{GroupStatus, StatusRequest};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;
use tokio::process::{Child, Command};
use tokio::time::Instant;

pub struct Options {
    /// Servers write the audit log the fault checker reads (`DATA_DIR/audit-g0.jsonl`).
    pub audit: bool,
    /// Serve /metrics on a port of each server (see [`Cluster::metrics`]).
    pub http: bool,
    pub nodes: u64,
    pub groups: u32,
    pub snapshot_every_entries: u64,
    pub snapshot_keep_entries: u64,
    /// Start each server N on a copy of `DIR/nodeN` (a committed fixture) instead of an empty data dir.
    pub seed_data: Option<PathBuf>,
    /// Seed each server's data dir from this backup file with `holdfast snapshot restore` (its own
    /// member list), as the "all servers lost" runbook does.
    pub restore: Option<PathBuf>,
    /// Added to every server's command line (hidden test flags such as `--wal-segment-bytes`).
    pub server_args: Vec<String>,
    /// TLS on every port: a CA, server certificates and a client certificate `tester` are made with
    /// `holdfast certs` under `DIR/tls`, and the harness's own clients use them.
    pub tls: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            audit: false,
            http: false,
            nodes: 5,
            groups: 1,
            snapshot_every_entries: 20_000,
            snapshot_keep_entries: 1_000,
            seed_data: None,
            restore: None,
            server_args: Vec::new(),
            tls: false,
        }
    }
}

pub struct Server {
    pub id: u64,
    pub client_port: u16,
    /// Where the server listens for peers (members reach it through a proxy in front of it).
    pub peer_port: u16,
    pub http_port: Option<u16>,
    pub log: PathBuf,
    pub data_dir: PathBuf,
    /// Flags added to the next start only (fault injection), cleared by it.
    pub extra_args: Vec<String>,
    args: Vec<String>,
    pub child: Option<Child>,
}

pub struct Cluster {
    /// `None` only while dropping.
    dir: Option<tempfile::TempDir>,
    pub servers: Vec<Server>,
    pub proxies: Proxies,
    /// With `Options::tls`: where the certificates are, and the harness clients' settings.
    pub tls_dir: Option<PathBuf>,
    pub tls: Option<holdfast_client::ClientTls>,
}

/// Runs `holdfast certs ARGS` and panics with its output if it fails.
pub fn certs(args: &[&str]) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_holdfast"))
        .arg("certs")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "holdfast certs {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The first name `{prefix}{i}` that hashes to `group` of `groups`.
pub fn name_in_group(group: u32, groups: u32, prefix: &str) -> String {
    names_in_group(group, groups, prefix, 1).remove(0)
}

/// The first `n` names `{prefix}{i}` that hash to `group` of `groups`.
pub fn names_in_group(group: u32, groups: u32, prefix: &str, n: usize) -> Vec<String> {
    (0..)
        .map(|i| format!("{prefix}{i}"))
        .filter(|name| holdfast_lock_table::group_for(name, groups).0 == group)
        .take(n)
        .collect()
}

/// Opens `session` in each of `groups` (a session opens in a group at its first use there).
pub async fn open_in_groups(session: &holdfast_client::Session, groups: &[u32]) {
    let all = session.client().groups();
    for &g in groups {
        session
            .open_for(&name_in_group(g, all, "open/"))
            .await
            .unwrap();
    }
}

/// A port for a server to listen on, this test process's alone until it exits. Taken below the kernel's
/// ephemeral range (32768 and up here), so no `bind(0)` or outgoing connection can take it between
/// this check and the server's bind; and claimed by a lock on a file named for it
/// (`$TMPDIR/holdfast-it-ports/PORT`), which this process holds until it exits (the kernel lets go
/// of it however the process ends), so that a test in another process cannot take it in that window
/// either, nor while a killed server of this test is down. Processes exclude each other only with
/// the same `TMPDIR`. Each claim keeps a file open: a few per test under nextest, which runs each
/// test in a process of its own. Each process starts its search at a place its id gives, so that
/// processes seldom try the same files.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Mutex;
    const LOW: u32 = 10_000;
    const SPAN: u32 = 22_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    static CLAIMED: Mutex<Vec<std::fs::File>> = Mutex::new(Vec::new());
    let dir = std::env::temp_dir().join("holdfast-it-ports");
    std::fs::create_dir_all(&dir).unwrap();
    let start = (std::process::id() % 220) * 100;
    for _ in 0..SPAN {
        let port = (LOW + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % SPAN) as u16;
        let claim = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(port.to_string()))
            .unwrap();
        match claim.try_lock() {
            Ok(()) => {}
            // Held by another test process.
            Err(std::fs::TryLockError::WouldBlock) => continue,
            Err(std::fs::TryLockError::Error(e)) => panic!("cannot lock {}: {e}", dir.display()),
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            CLAIMED.lock().unwrap().push(claim);
            return port;
        }
    }
    panic!("no free port in {LOW}..{}", LOW + SPAN);
}

/// The command line every test server starts with: who it is, where it listens, where its data is.
fn server_args(
    id: u64,
    members: &[String],
    data_dir: &std::path::Path,
    client_port: u16,
    peer_port: u16,
) -> Vec<String> {
    vec![
        "server".into(),
        "--exit-on-stdin-close".into(),
        format!("--node-id={id}"),
        format!("--members={}", members.join(",")),
        format!("--data-dir={}", data_dir.display()),
        format!("--client-listen=127.0.0.1:{client_port}"),
        format!("--peer-listen=127.0.0.1:{peer_port}"),
    ]
}

/// Copies a directory tree (fixtures are small).
pub fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap_or_else(|e| panic!("{}: {e}", from.display())) {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

impl Cluster {
    pub async fn start(options: Options) -> Cluster {
        let dir = tempfile::Builder::new()
            .prefix("holdfast-it-")
            .tempdir()
            .unwrap();
        let n = options.nodes;
        let tls_dir = options.tls.then(|| dir.path().join("tls"));
        let tls = tls_dir.as_ref().map(|d| {
            let d = d.to_str().unwrap();
            certs(&["ca", "--dir", d]);
            for i in 1..=n {
                certs(&["server", "--dir", d, "--id", &i.to_string()]);
            }
            certs(&["client", "--dir", d, "--name", "tester"]);
            let d = std::path::Path::new(d);
            holdfast_client::ClientTls::from_files(
                d.join("ca.pem"),
                Some((d.join("tester.pem"), d.join("tester.key"))),
            )
            .unwrap()
        });
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let proxies = Proxies::default();
        let mut servers = Vec::new();
        for i in 1..=n {
            let mut members = Vec::new();
            for j in 1..=n {
                let (client, peer) = ports[(j - 1) as usize];
                let peer = if i == j {
                    peer
                } else {
                    proxies.add(i, j, peer).await
                };
                members.push(format!("{j}=127.0.0.1:{client}/127.0.0.1:{peer}"));
            }
            let (client_port, peer_port) = ports[(i - 1) as usize];
            let data_dir = dir.path().join(format!("node{i}"));
            if let Some(seed) = &options.seed_data {
                copy_dir(&seed.join(format!("node{i}")), &data_dir);
            }
            if let Some(backup) = &options.restore {
                let out = std::process::Command::new(env!("CARGO_BIN_EXE_holdfast"))
                    .args(["snapshot", "restore"])
                    .arg(backup)
                    .arg("--data-dir")
                    .arg(&data_dir)
                    .args(["--node-id", &i.to_string(), "--members", &members.join(",")])
                    .output()
                    .unwrap();
                assert!(
                    out.status.success(),
                    "restore of node {i}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let mut args = server_args(i, &members, &data_dir, client_port, peer_port);
            args.extend([
                format!("--groups={}", options.groups),
                format!(
                    "--snapshot-every-entries={}",
                    options.snapshot_every_entries
                ),
                format!("--snapshot-keep-entries={}", options.snapshot_keep_entries),
            ]);
            if options.audit {
                args.push("--audit-log".into());
            }
            if let Some(d) = &tls_dir {
                args.extend([
                    format!("--tls-ca={}", d.join("ca.pem").display()),
                    format!("--tls-cert={}", d.join(format!("server-{i}.pem")).display()),
                    format!("--tls-key={}", d.join(format!("server-{i}.key")).display()),
                ]);
            }
            args.extend(options.server_args.iter().cloned());
            let http_port = options.http.then(free_port);
            if let Some(port) = http_port {
                args.push(format!("--http-listen=127.0.0.1:{port}"));
            }
            let log = dir.path().join(format!("node{i}.log"));
            servers.push(Server {
                id: i,
                client_port,
                peer_port,
                http_port,
                log,
                data_dir,
                extra_args: Vec::new(),
                args,
                child: None,
            });
        }
        let mut cluster = Cluster {
            dir: Some(dir),
            servers,
            proxies,
            tls_dir,
            tls,
        };
        for i in 1..=n {
            cluster.start_server(i);
        }
        cluster.wait_for_leader(0, Duration::from_secs(30)).await;
        cluster
    }

    /// Prepares one more server (id = current count + 1) that joins this cluster (`--join` with the
    /// cluster id of node 1's data dir) instead of forming one: its configuration lists every server with
    /// its direct peer port and itself, `extra` is added to its command line. Not started.
    pub async fn add_server(&mut self, extra: &[&str]) -> u64 {
        let id = self.servers.len() as u64 + 1;
        let (client_port, peer_port) = (free_port(), free_port());
        let mut members: Vec<String> = self
            .servers
            .iter()
            .map(|s| {
                format!(
                    "{}=127.0.0.1:{}/127.0.0.1:{}",
                    s.id, s.client_port, s.peer_port
                )
            })
            .collect();
        members.push(format!(
            "{id}=127.0.0.1:{client_port}/127.0.0.1:{peer_port}"
        ));
        let data_dir = self.dir().join(format!("node{id}"));
        let groups = self.servers[0]
            .args
            .iter()
            .find(|a| a.starts_with("--groups="))
            .cloned()
            .expect("groups flag");
        let mut args = server_args(id, &members, &data_dir, client_port, peer_port);
        args.extend([
            groups,
            "--join".into(),
            format!("--cluster-id={}", self.cluster_id().await),
        ]);
        // The cluster's snapshot policy, unless `extra` sets its own.
        let overridden = |a: &str| {
            let name = a.split('=').next().unwrap_or(a);
            extra.iter().any(|e| e.split('=').next() == Some(name))
        };
        args.extend(
            self.servers[0]
                .args
                .iter()
                .filter(|a| a.starts_with("--snapshot-") && !overridden(a))
                .cloned(),
        );
        args.extend(extra.iter().map(|a| a.to_string()));
        // HTTP as the others have it.
        let http_port = self.servers[0].http_port.map(|_| free_port());
        if let Some(port) = http_port {
            args.push(format!("--http-listen=127.0.0.1:{port}"));
        }
        self.servers.push(Server {
            id,
            client_port,
            peer_port,
            http_port,
            log: self.dir().join(format!("node{id}.log")),
            data_dir,
            extra_args: Vec::new(),
            args,
            child: None,
        });
        id
    }

    /// The cluster id, from the first running server's status.
    pub async fn cluster_id(&self) -> String {
        let id = self
            .servers
            .iter()
            .find(|s| s.child.is_some())
            .expect("a running server")
            .id;
        let mut raw = self.raw(id).await;
        raw.status(StatusRequest::default())
            .await
            .unwrap()
            .into_inner()
            .cluster_id
    }

    pub fn dir(&self) -> &std::path::Path {
        self.dir.as_ref().expect("not dropped").path()
    }

    pub fn start_server(&mut self, id: u64) {
        let s = &mut self.servers[(id - 1) as usize];
        assert!(s.child.is_none(), "server {id} is running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&s.log)
            .unwrap();
        let extra = std::mem::take(&mut s.extra_args);
        let child = Command::new(env!("CARGO_BIN_EXE_holdfast"))
            .args(&s.args)
            .args(&extra)
            .stdin(Stdio::piped())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        s.child = Some(child);
    }

    /// kill -9.
    pub async fn kill(&mut self, id: u64) {
        let s = &mut self.servers[(id - 1) as usize];
        let mut child = s.child.take().expect("server is running");
        child.kill().await.unwrap();
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.servers
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.client_port))
            .collect()
    }

    pub fn endpoint(&self, id: u64) -> String {
        format!("127.0.0.1:{}", self.servers[(id - 1) as usize].client_port)
    }

    /// The address a server listens on for peers.
    pub fn peer_endpoint(&self, id: u64) -> String {
        format!("127.0.0.1:{}", self.servers[(id - 1) as usize].peer_port)
    }

    pub async fn client(&self) -> Client {
        let options = ClientOptions {
            request_timeout: Duration::from_secs(20),
            tls: self.tls.clone(),
            ..ClientOptions::default()
        };
        Client::connect_with(self.endpoints(), options)
            .await
            .unwrap()
    }

    /// A raw gRPC client to one server (no redirects, no retries).
    pub async fn raw(&self, id: u64) -> HoldfastClient<tonic::transport::Channel> {
        let endpoint =
            tonic::transport::Endpoint::from_shared(format!("http://{}", self.endpoint(id)))
                .unwrap()
                .connect_timeout(Duration::from_secs(1))
                .timeout(Duration::from_secs(5));
        HoldfastClient::new(self.connect(endpoint).await.unwrap())
    }

    /// A session opened with raw gRPC on group 0's leader and never renewed (it expires after `ttl_ms`),
    /// with the raw client to act on it.
    pub async fn silent_session(
        &self,
        ttl_ms: u64,
        nonce: u64,
    ) -> (
        HoldfastClient<tonic::transport::Channel>,
        holdfast_proto::v1::OpenSessionResponse,
    ) {
        let leader = self.wait_for_leader(0, Duration::from_secs(30)).await;
        let mut raw = self.raw(leader).await;
        let opened = raw
            .open_session(holdfast_proto::v1::OpenSessionRequest {
                group: 0,
                ttl_ms,
                nonce_hi: nonce,
                nonce_lo: nonce,
            })
            .await
            .unwrap()
            .into_inner();
        (raw, opened)
    }

    /// Connects to `endpoint` the way the harness's clients do (over TLS if the cluster has it).
    pub async fn connect(
        &self,
        endpoint: tonic::transport::Endpoint,
    ) -> Result<tonic::transport::Channel, tonic::transport::Error> {
        match &self.tls {
            Some(tls) => {
                endpoint
                    .connect_with_connector(tls.connector().clone())
                    .await
            }
            None => endpoint.connect().await,
        }
    }

    /// One server's view of a group, if it answers.
    pub async fn group_status(&self, id: u64, group: u32) -> Option<GroupStatus> {
        // A stopped server cannot answer.
        self.servers[(id - 1) as usize].child.as_ref()?;
        let endpoint =
            tonic::transport::Endpoint::from_shared(format!("http://{}", self.endpoint(id)))
                .ok()?
                .connect_timeout(Duration::from_millis(300))
                .timeout(Duration::from_secs(1));
        let channel = self.connect(endpoint).await.ok()?;
        let s = HoldfastClient::new(channel)
            .status(StatusRequest { with_digest: true })
            .await
            .ok()?
            .into_inner();
        s.groups.into_iter().find(|g| g.group == group)
    }

    /// Waits until a running server says it leads `group` and a majority of running servers agree.
    /// Waits until server `id` names `leader` as the group's leader.
    pub async fn wait_for_known_leader(&self, id: u64, group: u32, leader: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let known = self.group_status(id, group).await.map(|g| g.leader_id);
            if known == Some(leader) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "server {id} does not name node {leader} as leader of group {group} (it names {known:?})"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn wait_for_leader(&self, group: u32, timeout: Duration) -> u64 {
        self.wait_for_leader_except(group, 0, timeout).await
    }

    pub async fn wait_for_leader_except(&self, group: u32, not: u64, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        loop {
            let mut votes = std::collections::HashMap::new();
            let mut leaders = Vec::new();
            for s in &self.servers {
                if let Some(g) = self.group_status(s.id, group).await {
                    if g.leader_id != 0 {
                        *votes.entry(g.leader_id).or_insert(0) += 1;
                    }
                    if g.role == "leader" {
                        leaders.push(s.id);
                    }
                }
            }
            let majority = self.servers.len() / 2 + 1;
            for l in leaders {
                if l != not && votes.get(&l).copied().unwrap_or(0) >= majority {
                    return l;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no leader for group {group} within {timeout:?}; logs in {}",
                self.dir().display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until all running servers report the same applied index and digest, and returns the digest.
    pub async fn wait_converged(&self, group: u32, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        loop {
            let mut seen = Vec::new();
            for s in self.servers.iter().filter(|s| s.child.is_some()) {
                seen.push(
                    self.group_status(s.id, group)
                        .await
                        .map(|g| (g.applied_index, g.digest)),
                );
            }
            if let Some(Some(first)) = seen.first() {
                if seen.iter().all(|x| x.as_ref() == Some(first)) {
                    return first.1;
                }
            }
            assert!(
                Instant::now() < deadline,
                "servers did not converge: {seen:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Keep the servers' logs and data of a failed test for the post-mortem.
        if std::thread::panicking() {
            if let Some(dir) = self.dir.take() {
                eprintln!("cluster logs and data kept in {}", dir.keep().display());
            }
        }
    }
}

/// The link id of the test's own clients in [`Proxies`]: cutting it partitions those clients only.
pub const CLIENTS: u64 = 1000;

impl Cluster {
    /// Client endpoints behind proxies the test can cut with `proxies.isolate(CLIENTS)`.
    pub async fn proxied_endpoints(&self) -> Vec<String> {
        let mut endpoints = Vec::new();
        for s in &self.servers {
            let port = self.proxies.add(CLIENTS, s.id, s.client_port).await;
            endpoints.push(format!("127.0.0.1:{port}"));
        }
        endpoints
    }

    /// Runs `holdfast ARGS` as a client of this cluster and panics with its stderr if it fails.
    pub async fn holdfast_ok(&self, args: &[&str]) -> std::process::Output {
        let out = self.holdfast().args(args).output().await.unwrap();
        assert!(
            out.status.success(),
            "holdfast {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// The `holdfast` binary as a client of this cluster.
    pub fn holdfast(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_holdfast"));
        c.env("HOLDFAST_ENDPOINTS", self.endpoints().join(","))
            .kill_on_drop(true);
        if let Some(d) = &self.tls_dir {
            c.env("HOLDFAST_CA", d.join("ca.pem"))
                .env("HOLDFAST_CERT", d.join("tester.pem"))
                .env("HOLDFAST_KEY", d.join("tester.key"));
        }
        c
    }
}

/// A plaintext or TLS stream.
pub trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

impl Cluster {
    /// `GET path` on one server's HTTP port (needs `Options::http`): the status code and the body.
    pub async fn http_get(&self, id: u64, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let port = self.servers[(id - 1) as usize]
            .http_port
            .expect("cluster started with http");
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let mut stream: Box<dyn Io> = match &self.tls_dir {
            None => Box::new(stream),
            Some(d) => {
                let ca = std::fs::read(d.join("ca.pem")).unwrap();
                let mut config = holdfast_proto::tls::client_config(&ca, None).unwrap();
                config.alpn_protocols = vec![b"http/1.1".to_vec()];
                let name =
                    holdfast_proto::tls::rustls::pki_types::ServerName::try_from("127.0.0.1")
                        .unwrap();
                let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
                    .connect(name, stream)
                    .await
                    .unwrap();
                Box::new(tls)
            }
        };
        stream
            .write_all(format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
        let code = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        (code, body.to_string())
    }

    /// One server's Prometheus metrics: `name` or `name{labels}` to value (needs `Options::http`).
    pub async fn metrics(&self, id: u64) -> std::collections::HashMap<String, u64> {
        let (_, body) = self.http_get(id, "/metrics").await;
        body.lines()
            .filter(|l| !l.starts_with('#') && l.contains(' '))
            .filter_map(|l| {
                let (name, value) = l.rsplit_once(' ')?;
                Some((name.to_string(), value.parse::<f64>().ok()? as u64))
            })
            .collect()
    }
}

impl Cluster {
    /// Waits for a server to exit on its own and returns its status.
    pub async fn wait_exit(&mut self, id: u64, timeout: Duration) -> std::process::ExitStatus {
        let s = &mut self.servers[(id - 1) as usize];
        let child = s.child.as_mut().expect("server is running");
        // tokio closes a child's stdin before waiting, which would tell the server to exit: keep it open.
        let stdin = child.stdin.take();
        let status = tokio::time::timeout(timeout, child.wait())
            .await
            .unwrap_or_else(|_| panic!("server {id} did not exit within {timeout:?}"))
            .unwrap();
        s.child = None;
        drop(stdin);
        status
    }

    pub fn log_text(&self, id: u64) -> String {
        std::fs::read_to_string(&self.servers[(id - 1) as usize].log).unwrap_or_default()
    }

    /// Waits (up to 30 s) until server `id`'s log has `count` lines containing `text`.
    pub async fn wait_for_log(&self, id: u64, text: &str, count: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.log_text(id).matches(text).count() < count {
            assert!(
                Instant::now() < deadline,
                "server {id} never logged {text:?} {count}×:\n{}",
                self.log_text(id)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Cluster {
    /// The PID of a running server.
    pub fn pid(&self, id: u64) -> u32 {
        self.servers[(id - 1) as usize]
            .child
            .as_ref()
            .and_then(|c| c.id())
            .expect("server is running")
    }
}

/// Sends SIGINT (what Ctrl-C sends) to a process this test started, by PID.
pub fn interrupt(pid: u32) {
    assert!(std::process::Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .unwrap()
        .success());
}

/// Sends SIGTERM (what an operator or systemd sends to stop a server) to a process this test started.
pub fn terminate(pid: u32) {
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap()
        .success());
}
