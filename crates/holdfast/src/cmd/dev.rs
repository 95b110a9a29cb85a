//! `holdfast dev`: a local cluster of real server processes on 127.0.0.1, data kept under one directory
//! between runs. Ctrl-C (or SIGTERM) stops every server with SIGTERM and waits for them.
//!
//! Before starting it checks what would make the servers fail (a data directory used by another `dev`,
//! or created for another cluster shape; ports in use) and says so on the terminal. While it runs it
//! supervises its servers and takes commands on `DATA_DIR/dev.sock`: `holdfast dev kill N` and
//! `holdfast dev restart N` (a failover experiment without rebuilding a server's command line), and a
//! restarted server is still stopped by Ctrl-C.

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use holdfast_proto::v1::holdfast_client::HoldfastClient;
use holdfast_proto::v1::StatusRequest;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::process::{Child, Command};

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct DevArgs {
    #[command(subcommand)]
    action: Option<DevAction>,
    /// Where each server keeps its data (node N in DIR/nodeN).
    #[arg(long, default_value = "holdfast-data", global = true)]
    data_dir: PathBuf,
    /// Number of servers (3 or 5 make sense).
    #[arg(long, default_value_t = 5)]
    nodes: u64,
    /// Client port of node 1; node N uses BASE+N-1, its peer port BASE+100+N-1 and HTTP BASE+200+N-1.
    #[arg(long, default_value_t = 7001)]
    base_port: u16,
    /// Raft groups (fixed when the data directory is first created).
    #[arg(long, default_value_t = 1)]
    groups: u32,
    /// Place each group on this many of the servers once the cluster is ready (`holdfast member place
    /// --replicas R`; e.g. `--nodes 7 --groups 4 --replicas 3`). Default: every server in every group.
    #[arg(long)]
    replicas: Option<usize>,
    /// TLS on every port, with a throwaway CA and certificates made under DATA_DIR/tls on first use
    /// (kept for the next run): the banner says which HOLDFAST_CA/CERT/KEY the client commands need.
    #[arg(long)]
    tls: bool,
    /// Worker threads of each server's runtime (`holdfast server --workers`; 0: the server's default,
    /// one per core unless HOLDFAST_WORKERS or TOKIO_WORKER_THREADS is set). The
    /// servers share this machine's cores, so each gets one for Raft and one for its client port
    /// (--client-workers): measured in docs/performance.md, "The client port on threads of its own"
    /// and "One client-port thread".
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(0..=256))]
    workers: u16,
    /// Worker threads of each server's client port, on a runtime of its own (`holdfast server
    /// --client-workers`; 0: on the server's runtime, with everything else). One: with two, the
    /// second is woken to look for work each time the first wakes with some; against two, one
    /// thread spent 11% less of the servers' CPU per entry at one client (median of thirteen
    /// alternated pairs), two did more on one connection shared by 64 clients, and 64 or 256
    /// clients on connections of their own came out either way.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(0..=256))]
    client_workers: u16,
}

/// Commands for a running `holdfast dev` (found through its `--data-dir`).
#[derive(Subcommand, Debug)]
enum DevAction {
    /// Kill server N at once (SIGKILL), as a crash would: for failover experiments.
    Kill { node: u64 },
    /// Start server N again (after `kill`, a crash, or to restart a running one).
    Restart { node: u64 },
}

/// The cluster shape and where things are.
struct Plan {
    exe: PathBuf,
    data_dir: PathBuf,
    nodes: u64,
    base_port: u16,
    groups: u32,
    members: String,
    /// DATA_DIR/tls when `--tls`.
    tls: Option<PathBuf>,
    workers: u16,
    client_workers: u16,
}

impl Plan {
    fn port(&self, n: u64, offset: u16) -> u16 {
        self.base_port + offset + (n - 1) as u16
    }

    fn log_path(&self, n: u64) -> PathBuf {
        self.data_dir.join(format!("node{n}.log"))
    }

    /// Starts server `n`; its output goes to `nodeN.log` (appended to on a restart).
    fn spawn(&self, n: u64, fresh_log: bool) -> anyhow::Result<Child> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(!fresh_log)
            .truncate(fresh_log)
            .open(self.log_path(n))?;
        Command::new(&self.exe)
            .arg("server")
            .args(["--node-id", &n.to_string(), "--members", &self.members])
            .arg("--data-dir")
            .arg(self.data_dir.join(format!("node{n}")))
            .args(["--http-listen", &format!("127.0.0.1:{}", self.port(n, 200))])
            .args(["--groups", &self.groups.to_string()])
            // Several groups: spread their leaders over the servers.
            .args((self.groups > 1).then_some("--balance-leaders"))
            .args(self.tls.iter().flat_map(|dir| {
                [
                    "--tls-ca".into(),
                    dir.join("ca.pem").into_os_string(),
                    "--tls-cert".into(),
                    dir.join(format!("server-{n}.pem")).into_os_string(),
                    "--tls-key".into(),
                    dir.join(format!("server-{n}.key")).into_os_string(),
                ]
            }))
            .args(
                (self.workers > 0)
                    .then(|| ["--workers".to_string(), self.workers.to_string()])
                    .into_iter()
                    .flatten(),
            )
            .args(["--client-workers", &self.client_workers.to_string()])
            .arg("--exit-on-stdin-close")
            .stdin(std::process::Stdio::piped())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot start server {n}"))
    }
}

/// Makes what is missing of a dev CA, server certificates for nodes 1..=nodes and a client certificate
/// `dev` under `dir`, and returns the client settings for them.
fn dev_certs(dir: &Path, nodes: u64) -> anyhow::Result<holdfast_client::ClientTls> {
    use super::certs;
    let ca_pem = dir.join("ca.pem");
    if !ca_pem.exists() {
        let (cert, key) = certs::new_ca(
            &format!("Holdfast dev CA (throwaway) {}", plan_stamp()),
            3650,
        )?;
        certs::write_pair(dir, "ca", &cert, &key)?;
    }
    let ca_cert = std::fs::read_to_string(&ca_pem)?;
    let ca_key = std::fs::read_to_string(dir.join("ca.key"))?;
    let mut leaves: Vec<(String, certs::Leaf)> = (1..=nodes)
        .map(|id| {
            let leaf = certs::Leaf::Server {
                id,
                hosts: Vec::new(),
            };
            (format!("server-{id}"), leaf)
        })
        .collect();
    leaves.push(("dev".into(), certs::Leaf::Client { name: "dev".into() }));
    for (stem, leaf) in leaves {
        if !dir.join(format!("{stem}.pem")).exists() {
            let (cert, key) = certs::issue(&ca_cert, &ca_key, &leaf, 365)?;
            certs::write_pair(dir, &stem, &cert, &key)?;
        }
    }
    Ok(holdfast_client::ClientTls::from_files(
        &ca_pem,
        Some((dir.join("dev.pem"), dir.join("dev.key"))),
    )?)
}

/// When this dev CA was made (seconds since the epoch), so that two dev CAs have different names.
fn plan_stamp() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Sends SIGTERM to a child we started (by its PID).
fn terminate(child: &Child) {
    if let Some(pid) = child.id() {
        super::signal(pid, libc::SIGTERM);
    }
}

pub async fn run(args: DevArgs) -> anyhow::Result<ExitCode> {
    if let Some(action) = args.action {
        return control(&args.data_dir, action).await;
    }
    if !(1..=9).contains(&args.nodes) {
        bail!("--nodes must be 1..=9");
    }
    let plan = Plan {
        exe: std::env::current_exe().context("cannot find the holdfast binary")?,
        members: (1..=args.nodes)
            .map(|n| {
                let port = |offset: u16| args.base_port + offset + (n - 1) as u16;
                format!("{n}=127.0.0.1:{}/127.0.0.1:{}", port(0), port(100))
            })
            .collect::<Vec<_>>()
            .join(","),
        tls: args.tls.then(|| args.data_dir.join("tls")),
        data_dir: args.data_dir,
        nodes: args.nodes,
        base_port: args.base_port,
        groups: args.groups,
        workers: args.workers,
        client_workers: args.client_workers,
    };
    std::fs::create_dir_all(&plan.data_dir)
        .with_context(|| format!("cannot create {}", plan.data_dir.display()))?;
    let _dev_lock = lock_dev(&plan.data_dir)?;
    check_shape(&plan)?;
    check_ports(&plan)?;
    let client_tls = match &plan.tls {
        Some(dir) => Some(dev_certs(dir, plan.nodes)?),
        None => None,
    };
    let socket_path = plan.data_dir.join("dev.sock");
    let _ = std::fs::remove_file(&socket_path);
    let control = UnixListener::bind(&socket_path)
        .with_context(|| format!("cannot listen on {}", socket_path.display()))?;

    let mut children: Vec<Option<Child>> = Vec::new();
    for n in 1..=plan.nodes {
        children.push(Some(plan.spawn(n, true)?));
    }
    let endpoints: Vec<String> = (1..=plan.nodes)
        .map(|n| format!("127.0.0.1:{}", plan.port(n, 0)))
        .collect();
    let started = Instant::now();
    match wait_ready(&plan, &endpoints, &mut children, client_tls.as_ref()).await {
        Ok(leader) => {
            println!("holdfast dev cluster ready in {:.1}s ({} servers, leader of group 0: node {leader})", started.elapsed().as_secs_f64(), plan.nodes);
            if let Some(replicas) = args.replicas {
                let options = holdfast_client::ClientOptions {
                    tls: client_tls.clone(),
                    ..Default::default()
                };
                let placed = match holdfast_client::Client::connect_with(endpoints.clone(), options)
                    .await
                {
                    Ok(client) => super::member::place(&client, replicas, &[], &[], false).await,
                    Err(e) => Err(e.into()),
                };
                if let Err(e) = placed {
                    stop(&mut children).await;
                    let _ = std::fs::remove_file(&socket_path);
                    bail!("cannot place the groups on {replicas} servers each: {e:#}");
                }
            }
            let http = if plan.tls.is_some() { "https" } else { "http" };
            println!(
                "  dashboard: {http}://127.0.0.1:{}/ui (any server's http port serves one)",
                plan.port(1, 200)
            );
            for n in 1..=plan.nodes {
                println!("  node {n}: client 127.0.0.1:{}  peer 127.0.0.1:{}  http {http}://127.0.0.1:{}/metrics", plan.port(n, 0), plan.port(n, 100), plan.port(n, 200));
            }
            println!(
                "  data: {}  logs: {}/nodeN.log",
                plan.data_dir.display(),
                plan.data_dir.display()
            );
            println!("  HOLDFAST_ENDPOINTS={}", endpoints.join(","));
            match &plan.tls {
                Some(dir) => {
                    let dir = std::path::absolute(dir).unwrap_or(dir.clone());
                    println!("  TLS on every port (mutual between servers). For the client commands:");
                    println!(
                        "    export HOLDFAST_CA={0}/ca.pem HOLDFAST_CERT={0}/dev.pem HOLDFAST_KEY={0}/dev.key",
                        dir.display()
                    );
                }
                None => println!("  plaintext: anyone who reaches these ports can use them (`--tls` for TLS; see docs/security.md)"),
            }
            println!("  no access policy: every client that connects may do everything (`holdfast server --policy`, docs/security.md)");
            println!("Failover: `holdfast dev kill N`, then `holdfast dev restart N`. Ctrl-C stops the cluster; the data is kept for the next run.");
        }
        Err(e) => {
            stop(&mut children).await;
            let _ = std::fs::remove_file(&socket_path);
            bail!("cluster did not become ready: {e:#}");
        }
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            accepted = control.accept() => {
                if let Ok((stream, _)) = accepted {
                    serve_control(stream, &plan, &mut children).await;
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(500)) => {
                for (i, slot) in children.iter_mut().enumerate() {
                    let Some(child) = slot else { continue };
                    if let Ok(Some(status)) = child.try_wait() {
                        *slot = None;
                        eprintln!("node {} exited ({status}); the others keep running; `holdfast dev restart {}` starts it again{}",
                            i + 1, i + 1, last_error(&plan.log_path(i as u64 + 1)).map(|e| format!("\n  its log says: {e}")).unwrap_or_default());
                    }
                }
            }
        }
    }
    println!("stopping...");
    stop(&mut children).await;
    let _ = std::fs::remove_file(&socket_path);
    println!("stopped");
    Ok(ExitCode::SUCCESS)
}

/// One `holdfast dev kill|restart N` request on the control socket.
async fn serve_control(stream: UnixStream, plan: &Plan, children: &mut [Option<Child>]) {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let read = tokio::time::timeout(
        Duration::from_secs(2),
        BufReader::new(read).read_line(&mut line),
    )
    .await;
    if !matches!(read, Ok(Ok(_))) {
        return;
    }
    let reply = match line.split_whitespace().collect::<Vec<_>>()[..] {
        [verb @ ("kill" | "restart"), n] => match n.parse::<u64>() {
            Ok(n) if (1..=plan.nodes).contains(&n) => {
                let slot = &mut children[(n - 1) as usize];
                if let Some(mut child) = slot.take() {
                    let _ = child.kill().await;
                }
                if verb == "kill" {
                    eprintln!("node {n} killed (SIGKILL) on request");
                    format!("ok: node {n} killed")
                } else {
                    match plan.spawn(n, false) {
                        Ok(child) => {
                            let pid = child.id().unwrap_or(0);
                            *slot = Some(child);
                            eprintln!("node {n} restarted on request (pid {pid})");
                            format!("ok: node {n} restarted (pid {pid})")
                        }
                        Err(e) => format!("error: cannot restart node {n}: {e:#}"),
                    }
                }
            }
            _ => format!(
                "error: no node {n} (this cluster has nodes 1..={})",
                plan.nodes
            ),
        },
        _ => format!("error: unknown request {:?}", line.trim()),
    };
    let _ = write.write_all(format!("{reply}\n").as_bytes()).await;
}

/// `holdfast dev kill|restart N`: asks the `holdfast dev` running on `data_dir`.
async fn control(data_dir: &Path, action: DevAction) -> anyhow::Result<ExitCode> {
    let path = data_dir.join("dev.sock");
    let request = match action {
        DevAction::Kill { node } => format!("kill {node}\n"),
        DevAction::Restart { node } => format!("restart {node}\n"),
    };
    let stream = UnixStream::connect(&path).await.with_context(|| {
        format!(
            "no `holdfast dev` is running with data dir {} (nothing listens on {})",
            data_dir.display(),
            path.display()
        )
    })?;
    let (read, mut write) = stream.into_split();
    write.write_all(request.as_bytes()).await?;
    let mut reply = String::new();
    tokio::time::timeout(
        Duration::from_secs(15),
        BufReader::new(read).read_line(&mut reply),
    )
    .await
    .context("the running `holdfast dev` did not answer")??;
    match reply.trim().strip_prefix("ok: ") {
        Some(done) => {
            println!("{done}");
            Ok(ExitCode::SUCCESS)
        }
        None => bail!("{}", reply.trim().trim_start_matches("error: ")),
    }
}

/// Holds `DATA_DIR/dev.lock` while this `dev` runs, so a second one on the same data is refused with the
/// reason (the servers' own data-dir locks would only say it in their logs).
fn lock_dev(data_dir: &Path) -> anyhow::Result<std::fs::File> {
    use std::io::{Read, Seek, Write};
    let path = data_dir.join("dev.lock");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    if file.try_lock().is_err() {
        let mut pid = String::new();
        let _ = file.read_to_string(&mut pid);
        bail!(
            "data dir {} is in use by another `holdfast dev` (pid {}); stop it (Ctrl-C), or use another --data-dir",
            data_dir.display(),
            pid.trim()
        );
    }
    file.set_len(0)?;
    file.rewind()?;
    write!(file, "{}", std::process::id())?;
    Ok(file)
}

/// A data directory is created for one cluster shape (servers, ports, groups), recorded in
/// `DATA_DIR/dev.shape`; starting it with another would fail or confuse, so say so here, with what to run
/// instead. A directory made by an older `holdfast dev` has no shape file: its shape is read from node 1's
/// format-0 IDENTITY, which recorded the member list.
fn check_shape(plan: &Plan) -> anyhow::Result<()> {
    let shape_path = plan.data_dir.join("dev.shape");
    let wanted = format!(
        "nodes={}\nbase_port={}\ngroups={}\n",
        plan.nodes, plan.base_port, plan.groups
    );
    let field = |text: &str, key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
            .unwrap_or("?")
            .to_string()
    };
    let recorded = match std::fs::read_to_string(&shape_path) {
        Ok(text) => Some(text),
        Err(_) => std::fs::read_to_string(plan.data_dir.join("node1").join("IDENTITY"))
            .ok()
            .filter(|identity| identity.contains("\nmembers="))
            .map(|identity| {
                let members = field(&identity, "members");
                let nodes = members.split(',').filter(|m| !m.is_empty()).count();
                let base_port = members
                    .split(',')
                    .next()
                    .and_then(|m| m.split('/').next())
                    .and_then(|c| c.rsplit(':').next())
                    .unwrap_or("?")
                    .to_string();
                let groups = field(&identity, "groups");
                format!("nodes={nodes}\nbase_port={base_port}\ngroups={groups}\n")
            }),
    };
    match recorded {
        Some(text) if text == wanted => {}
        Some(text) => {
            let (nodes, base_port, groups) = (
                field(&text, "nodes"),
                field(&text, "base_port"),
                field(&text, "groups"),
            );
            bail!(
                "{dir} holds a cluster made with --nodes {nodes} --base-port {base_port} --groups {groups}; run `holdfast dev --nodes {nodes} --base-port {base_port} --groups {groups}` to use it, or use another --data-dir (or delete {dir} to start afresh)",
                dir = plan.data_dir.display()
            )
        }
        None => {}
    }
    std::fs::write(&shape_path, wanted)
        .with_context(|| format!("cannot write {}", shape_path.display()))?;
    Ok(())
}

/// Every port the servers will listen on must be free now, or a server would exit at start.
fn check_ports(plan: &Plan) -> anyhow::Result<()> {
    for n in 1..=plan.nodes {
        for (offset, what) in [(0, "client"), (100, "peer"), (200, "HTTP")] {
            let port = plan.port(n, offset);
            if let Err(e) = std::net::TcpListener::bind(("127.0.0.1", port)) {
                bail!("port {port} (node {n}'s {what} port) is not free ({e}): is another holdfast dev or server running? stop it, or choose another --base-port");
            }
        }
    }
    Ok(())
}

/// The last error line a server wrote to its log, to show on the terminal.
fn last_error(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .rev()
        .find(|l| l.contains("ERROR") || l.starts_with("error"))
        .map(|l| l.trim().to_string())
}

async fn stop(children: &mut [Option<Child>]) {
    for child in children.iter().flatten() {
        terminate(child);
    }
    for child in children.iter_mut().flatten() {
        if tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .is_err()
        {
            let _ = child.kill().await;
        }
    }
}

/// Waits until every group has a leader that a quorum confirms (so the banner names this start's
/// leader, not one remembered from the last run), and returns group 0's.
async fn wait_ready(
    plan: &Plan,
    endpoints: &[String],
    children: &mut [Option<Child>],
    tls: Option<&holdfast_client::ClientTls>,
) -> anyhow::Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for (i, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            if let Some(status) = child.try_wait()? {
                let n = i as u64 + 1;
                let why = last_error(&plan.log_path(n))
                    .unwrap_or_else(|| format!("see {}", plan.log_path(n).display()));
                bail!("node {n} exited during start-up ({status}): {why}");
            }
        }
        let mut confirmed = vec![None; plan.groups as usize];
        for ep in endpoints {
            let Ok(endpoint) = tonic::transport::Endpoint::from_shared(format!("http://{ep}"))
            else {
                continue;
            };
            let endpoint = endpoint.connect_timeout(Duration::from_millis(200));
            let connected = match tls {
                Some(tls) => {
                    endpoint
                        .connect_with_connector(tls.connector().clone())
                        .await
                }
                None => endpoint.connect().await,
            };
            let Ok(channel) = connected else {
                continue;
            };
            if let Ok(s) = HoldfastClient::new(channel)
                .status(StatusRequest::default())
                .await
            {
                for g in s.into_inner().groups {
                    if g.role == "leader" && g.leader_confirmed {
                        if let Some(slot) = confirmed.get_mut(g.group as usize) {
                            *slot = Some(g.leader_id);
                        }
                    }
                }
            }
        }
        if confirmed.iter().all(Option::is_some) {
            return Ok(confirmed.first().copied().flatten().unwrap_or(0));
        }
        if Instant::now() > deadline {
            bail!(
                "no leader confirmed by a quorum after 30 s (see {}/nodeN.log)",
                plan.data_dir.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
