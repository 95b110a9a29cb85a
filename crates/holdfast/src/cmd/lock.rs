//! `holdfast lock NAME -- CMD ARGS...`: runs CMD while holding NAME (like `consul lock`, `etcdctl lock`).
//!
//! CMD gets `HOLDFAST_LOCK`, `HOLDFAST_TOKEN` (the fencing token: pass it to whatever CMD writes) and
//! `HOLDFAST_SESSION` in its environment. If the lease may be lost, CMD is stopped (SIGTERM, then SIGKILL
//! after `--kill-after`) and holdfast exits with 75; a grant that arrives when the lease may already have
//! lapsed is released without running CMD, also 75. If CMD cannot be started the lock is released at once
//! and holdfast exits with 127 (not found) or 126 (found but not executable), as shells do. Otherwise
//! holdfast exits with CMD's exit code (128 + signal if CMD was killed by a signal) after releasing the
//! lock. SIGINT and SIGTERM are passed on to CMD.

use super::duration::parse_duration;
use super::Conn;
use anyhow::{bail, Context};
use clap::Args;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitCode;
use std::time::Duration;
use tokio::process::Command;
use tokio::signal::unix::{signal, SignalKind};

/// Exit code when the lease was lost while CMD ran, or before it could start (EX_TEMPFAIL: try again).
pub const EXIT_LEASE_LOST: u8 = 75;
/// Exit code when CMD does not exist (what shells use).
pub const EXIT_NOT_FOUND: u8 = 127;
/// Exit code when CMD exists but cannot be run (what shells use).
pub const EXIT_CANNOT_RUN: u8 = 126;

#[derive(Args, Debug)]
pub struct LockArgs {
    /// The lock to hold.
    name: String,
    /// The command and its arguments (after `--`).
    #[arg(trailing_var_arg = true, required = true, num_args = 1..)]
    command: Vec<String>,
    /// Session TTL: how long after this process stops renewing the lock is released (2s to 5m; 250ms,
    /// 10s, 2m, a bare number is seconds).
    #[arg(long, default_value = "10s", value_parser = super::duration::parse_ttl)]
    ttl: Duration,
    /// How long to wait in line for the lock (0 = fail at once if it is held).
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    wait: Duration,
    /// After SIGTERM, how long CMD gets before SIGKILL.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    kill_after: Duration,
    /// Lock-delay (at most 60s): if this process's session expires (it was killed, hung or cut off),
    /// nobody gets the lock for this long afterwards. For resources that cannot check HOLDFAST_TOKEN.
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    lock_delay: Duration,
    /// Hold the lock shared with other `--shared` holders (readers); without it, exclusively.
    #[arg(long, conflicts_with = "permits")]
    shared: bool,
    /// Treat NAME as a semaphore of N permits (at most 1000) and hold one: at most N commands run at
    /// once. Every holder must give the same N while the semaphore is in use.
    #[arg(long, value_name = "N", default_value_t = 0)]
    permits: u32,
    #[command(flatten)]
    conn: Conn,
}

pub async fn run(args: LockArgs) -> anyhow::Result<ExitCode> {
    let client = args.conn.connect().await?;
    let session = client
        .open_session(args.ttl)
        .await
        .context("cannot open a session")?;
    let options = holdfast_client::AcquireOptions {
        wait: args.wait,
        lock_delay: args.lock_delay,
        shared: args.shared,
        permits: args.permits,
        ..Default::default()
    };
    let guard = match session.acquire_with(&args.name, options).await {
        Ok(g) => g,
        Err(e @ holdfast_client::Error::LeaseLost(_)) => {
            eprintln!("holdfast: cannot acquire {:?}: {e}", args.name);
            let _ = tokio::time::timeout(Duration::from_secs(1), session.close()).await;
            return Ok(ExitCode::from(EXIT_LEASE_LOST));
        }
        Err(e) => {
            let _ = session.close().await;
            bail!("cannot acquire {:?}: {e}", args.name);
        }
    };
    let spawned = Command::new(&args.command[0])
        .args(&args.command[1..])
        .env("HOLDFAST_LOCK", &args.name)
        .env("HOLDFAST_TOKEN", guard.token().to_string())
        .env("HOLDFAST_SESSION", session.id_for(&args.name).to_string())
        .spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            // Nothing runs under the lock, so nobody should wait for it: release it now.
            let code = match e.kind() {
                std::io::ErrorKind::NotFound => EXIT_NOT_FOUND,
                _ => EXIT_CANNOT_RUN,
            };
            eprintln!("holdfast: cannot run {:?}: {e}", args.command[0]);
            if let Err(e) = guard.release().await {
                eprintln!("holdfast: releasing {:?}: {e}", args.name);
            }
            let _ = session.close().await;
            return Ok(ExitCode::from(code));
        }
    };
    let pid = child.id().unwrap_or(0);
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let status = loop {
        tokio::select! {
            status = child.wait() => break status?,
            lost = guard.lost() => {
                eprintln!("holdfast: the lease on {:?} may be lost ({}); stopping the command", args.name, lost.0);
                super::signal(pid, libc::SIGTERM);
                if tokio::time::timeout(args.kill_after, child.wait()).await.is_err() {
                    let _ = child.kill().await;
                }
                // Best effort: the cluster may be unreachable, which is likely why the lease was lost.
                let _ = tokio::time::timeout(Duration::from_secs(1), session.close()).await;
                return Ok(ExitCode::from(EXIT_LEASE_LOST));
            }
            _ = term.recv() => super::signal(pid, libc::SIGTERM),
            _ = int.recv() => super::signal(pid, libc::SIGINT),
        }
    };
    let release = guard.release().await;
    let _ = session.close().await;
    if let Err(e) = release {
        eprintln!("holdfast: releasing {:?}: {e}", args.name);
    }
    let code = match (status.code(), status.signal()) {
        (Some(c), _) => c,
        (None, Some(sig)) => 128 + sig,
        (None, None) => 1,
    };
    Ok(ExitCode::from(code.clamp(0, 255) as u8))
}
