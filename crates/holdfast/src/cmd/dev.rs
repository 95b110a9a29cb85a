//! `holdfast dev`: a local cluster of real server processes on 127.0.0.1, data kept under one directory
//! between runs. Ctrl-C (or SIGTERM) stops every server with SIGTERM and waits for them.

use anyhow::{bail, Context};
use clap::Args;
use holdfast_proto::v1::holdfast_client::HoldfastClient;
use holdfast_proto::v1::StatusRequest;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

#[derive(Args, Debug)]
pub struct DevArgs {
    /// Where each server keeps its data (node N in DIR/nodeN).
    #[arg(long, default_value = "holdfast-data")]
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
}

/// Sends SIGTERM to a child we started (by its PID).
fn terminate(child: &Child) {
    if let Some(pid) = child.id() {
        super::signal(pid, libc::SIGTERM);
    }
}

pub async fn run(args: DevArgs) -> anyhow::Result<ExitCode> {
    if !(1..=9).contains(&args.nodes) {
        bail!("--nodes must be 1..=9");
    }
    let exe = std::env::current_exe().context("cannot find the holdfast binary")?;
    let port = |n: u64, offset: u16| args.base_port + offset + (n - 1) as u16;
    let members: Vec<String> = (1..=args.nodes)
        .map(|n| format!("{n}=127.0.0.1:{}/127.0.0.1:{}", port(n, 0), port(n, 100)))
        .collect();
    let members = members.join(",");
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("cannot create {}", args.data_dir.display()))?;
    let mut children = Vec::new();
    for n in 1..=args.nodes {
        let dir = args.data_dir.join(format!("node{n}"));
        let log = std::fs::File::create(args.data_dir.join(format!("node{n}.log")))?;
        let child = Command::new(&exe)
            .arg("server")
            .args(["--node-id", &n.to_string(), "--members", &members])
            .arg("--data-dir")
            .arg(&dir)
            .args(["--http-listen", &format!("127.0.0.1:{}", port(n, 200))])
            .args(["--groups", &args.groups.to_string()])
            .arg("--exit-on-stdin-close")
            .stdin(std::process::Stdio::piped())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot start server {n}"))?;
        children.push(child);
    }
    let endpoints: Vec<String> = (1..=args.nodes)
        .map(|n| format!("127.0.0.1:{}", port(n, 0)))
        .collect();
    let started = Instant::now();
    match wait_ready(&endpoints, &mut children).await {
        Ok(leader) => {
            println!("holdfast dev cluster ready in {:.1}s ({} servers, leader of group 0: node {leader})", started.elapsed().as_secs_f64(), args.nodes);
            for n in 1..=args.nodes {
                println!("  node {n}: client 127.0.0.1:{}  peer 127.0.0.1:{}  http http://127.0.0.1:{}/metrics", port(n, 0), port(n, 100), port(n, 200));
            }
            println!(
                "  data: {}  logs: {}/nodeN.log",
                args.data_dir.display(),
                args.data_dir.display()
            );
            println!("  HOLDFAST_ENDPOINTS={}", endpoints.join(","));
            println!("Ctrl-C stops the cluster; the data is kept for the next run.");
        }
        Err(e) => {
            stop(&mut children).await;
            bail!(
                "cluster did not become ready: {e:#} (see {}/nodeN.log)",
                args.data_dir.display()
            );
        }
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut exited = vec![false; children.len()];
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {
                for (i, child) in children.iter_mut().enumerate() {
                    if !exited[i] {
                        if let Ok(Some(status)) = child.try_wait() {
                            exited[i] = true;
                            eprintln!("node {} exited ({status}); the others keep running", i + 1);
                        }
                    }
                }
            }
        }
    }
    println!("stopping...");
    stop(&mut children).await;
    println!("stopped");
    Ok(ExitCode::SUCCESS)
}

async fn stop(children: &mut [Child]) {
    for child in children.iter() {
        terminate(child);
    }
    for child in children.iter_mut() {
        if tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .is_err()
        {
            let _ = child.kill().await;
        }
    }
}

async fn wait_ready(endpoints: &[String], children: &mut [Child]) -> anyhow::Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for (i, child) in children.iter_mut().enumerate() {
            if let Some(status) = child.try_wait()? {
                bail!("node {} exited during start-up ({status})", i + 1);
            }
        }
        for ep in endpoints {
            let Ok(endpoint) = tonic::transport::Endpoint::from_shared(format!("http://{ep}"))
            else {
                continue;
            };
            let Ok(channel) = endpoint
                .connect_timeout(Duration::from_millis(200))
                .connect()
                .await
            else {
                continue;
            };
            if let Ok(s) = HoldfastClient::new(channel)
                .status(StatusRequest::default())
                .await
            {
                let s = s.into_inner();
                if s.groups.iter().all(|g| g.leader_id != 0) {
                    return Ok(s.groups.first().map_or(0, |g| g.leader_id));
                }
            }
        }
        if Instant::now() > deadline {
            bail!("no leader after 30 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
