//! `holdfast lock NAME -- CMD ARGS...`: runs CMD while holding NAME (like `consul lock`, `etcdctl lock`).
//!
//! CMD gets `HOLDFAST_LOCK`, `HOLDFAST_TOKEN` (the fencing token: pass it to whatever CMD writes) and
//! `HOLDFAST_SESSION` in its environment, in a process group of its own: the signals below go to the
//! whole group, so what CMD started (a shell's pipeline, a backgrounded helper) stops with it. If the
//! lease may be lost, CMD is stopped (SIGTERM, then SIGKILL after `--kill-after`, by default a tenth of
//! the TTL: the lease's own margin) and holdfast exits with 75; so it does if CMD ends after the lease
//! may have lapsed, or its release finds the lock no longer its own (CMD's work may have overlapped
//! another holder's), and when a grant arrives after the lease may already have lapsed (CMD does not
//! run). If CMD cannot be started the lock is released at once and holdfast exits with 127 (not found)
//! or 126 (found but not executable), as shells do. Otherwise holdfast exits with CMD's exit code (128 +
//! signal if CMD was killed by a signal) after releasing the lock. SIGINT and SIGTERM are passed on to
//! CMD's group; received while waiting for the lock, they give the wait up (the session is closed) and
//! holdfast exits with 128 + the signal.

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
    /// After SIGTERM, how long CMD gets before SIGKILL (default: a tenth of the TTL, the lease's margin
    /// before the servers may expire the session; longer lets CMD run on after another holder got the
    /// lock, unless `--lock-delay` covers it).
    #[arg(long, value_parser = parse_duration)]
    kill_after: Option<Duration>,
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
    // The lease ends a tenth of the TTL before the servers may expire the session (docs/client.md).
    let margin = args.ttl / 10;
    let kill_after = args.kill_after.unwrap_or(margin);
    if kill_after > margin && kill_after > args.lock_delay {
        eprintln!(
            "holdfast: warning: --kill-after {kill_after:?} is longer than the lease's margin ({margin:?}, a tenth of the TTL): after a lost lease CMD may run on for up to {:?} while another holder has {:?}; give --lock-delay {kill_after:?} or make CMD check HOLDFAST_TOKEN",
            kill_after - margin,
            args.name
        );
    }
    // From the start: a signal while waiting for the lock gives the wait up instead of killing this
    // process and leaving the session (and a grant to it) behind for a TTL.
    // A signal this process inherited as ignored (`nohup`, a background job of a script) stays ignored,
    // for CMD too: catching it would end CMD where the caller asked it to be left alone.
    let mut term = caught(libc::SIGTERM)?;
    let mut int = caught(libc::SIGINT)?;
    let mut hup = caught(libc::SIGHUP)?;
    let mut quit = caught(libc::SIGQUIT)?;
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
    let acquired = tokio::select! {
        acquired = session.acquire_with(&args.name, options) => acquired,
        _ = recv(&mut term) => return Ok(give_up(session.clone(), libc::SIGTERM).await),
        _ = recv(&mut int) => return Ok(give_up(session.clone(), libc::SIGINT).await),
        _ = recv(&mut hup) => return Ok(give_up(session.clone(), libc::SIGHUP).await),
        _ = recv(&mut quit) => return Ok(give_up(session.clone(), libc::SIGQUIT).await),
    };
    let guard = match acquired {
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
        .process_group(0)
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
    // The child leads its own process group (`process_group(0)`), whose id is its pid.
    let Some(group) = child.id() else {
        bail!("the command exited before its process id could be read");
    };
    // CMD is not in the terminal's foreground group, so job control reaches it through holdfast:
    // Ctrl-Z stops its group (SIGTSTP, then SIGSTOP, which it cannot ignore), then holdfast (whose
    // keepalives stop too), and `fg` continues holdfast, which continues CMD only if the lease still
    // holds (otherwise the lost lease stops the group).
    let mut tstp = caught(libc::SIGTSTP)?;
    let mut cont = signal(SignalKind::from_raw(libc::SIGCONT))?;
    let status = loop {
        tokio::select! {
            // Lost first: a lease lost as CMD ends must not pass for a clean run.
            biased;
            lost = guard.lost() => {
                eprintln!("holdfast: the lease on {:?} may be lost ({}); stopping the command", args.name, lost.0);
                if !stop_group(&mut child, group, kill_after).await {
                    eprintln!("holdfast: processes of the command's group are still there after SIGKILL (stuck in the kernel?)");
                }
                // Best effort: the cluster may be unreachable, which is likely why the lease was lost.
                let _ = tokio::time::timeout(Duration::from_secs(1), session.close()).await;
                return Ok(ExitCode::from(EXIT_LEASE_LOST));
            }
            status = child.wait() => match status {
                Ok(status) => break status,
                Err(e) => {
                    // Whatever it runs must not outlive the lock: stopped before the session closes.
                    stop_group(&mut child, group, Duration::ZERO).await;
                    let _ = tokio::time::timeout(Duration::from_secs(1), session.close()).await;
                    return Err(e).context("cannot wait for the command");
                }
            },
            _ = recv(&mut term) => super::signal_group(group, libc::SIGTERM),
            _ = recv(&mut int) => super::signal_group(group, libc::SIGINT),
            _ = recv(&mut hup) => super::signal_group(group, libc::SIGHUP),
            _ = recv(&mut quit) => super::signal_group(group, libc::SIGQUIT),
            _ = recv(&mut tstp) => {
                super::signal_group(group, libc::SIGTSTP);
                super::signal_group(group, libc::SIGSTOP);
                super::signal(std::process::id(), libc::SIGSTOP);
            }
            _ = cont.recv() => {
                if guard.is_valid() {
                    super::signal_group(group, libc::SIGCONT);
                }
            }
        }
    };
    // What CMD left running in its group (a backgrounded helper) must not run on once the lock is
    // released; if something is still there after SIGKILL, it may: say so (exit 75 below).
    let emptied = stop_group(&mut child, group, kill_after).await;
    if !emptied {
        eprintln!("holdfast: processes of the command's group are still there after SIGKILL (stuck in the kernel?)");
    }
    // CMD ended; was it still the holder all along? Not if the lease lapsed meanwhile (this process was
    // paused, say), or if the release finds the grant gone.
    let valid = guard.is_valid();
    let release = guard.release().await;
    let _ = tokio::time::timeout(Duration::from_secs(2), session.close()).await;
    let released = match release {
        Ok(()) => true,
        Err(e) => {
            eprintln!("holdfast: releasing {:?}: {e}", args.name);
            !matches!(
                e,
                holdfast_client::Error::NotHolder(_)
                    | holdfast_client::Error::StaleToken { .. }
                    | holdfast_client::Error::SessionUnknown(_)
                    | holdfast_client::Error::LeaseLost(_)
            )
        }
    };
    if !valid || !released || !emptied {
        if !valid || !released {
            eprintln!(
                "holdfast: the command ended, but the lease on {:?} may have lapsed before it did: its work may have overlapped another holder's",
                args.name
            );
        }
        return Ok(ExitCode::from(EXIT_LEASE_LOST));
    }
    let code = match (status.code(), status.signal()) {
        (Some(c), _) => c,
        (None, Some(sig)) => 128 + sig,
        (None, None) => 1,
    };
    Ok(ExitCode::from(code.clamp(0, 255) as u8))
}

/// A signal arrived while waiting for the lock: give the wait up (closing the session removes it, and
/// any grant that raced the signal) and exit as the signal would have.
async fn give_up(session: holdfast_client::Session, sig: libc::c_int) -> ExitCode {
    eprintln!("holdfast: interrupted while waiting for the lock; giving the wait up");
    let _ = tokio::time::timeout(Duration::from_secs(2), session.close()).await;
    ExitCode::from((128 + sig) as u8)
}

/// Stops CMD's process group: SIGTERM to every process left in it, and SIGKILL to whatever is still
/// there after `grace`. Returns at once (true) if nothing is left (CMD ended with no helpers); false if
/// something is still there `grace` + 5 s on (a process stuck in the kernel does not die at once, and
/// zombies count until they are reaped).
///
/// CMD's leader is reaped already, so the group's id is a free pid once the group is empty, and could
/// in principle name another group by the next look (every 20 ms): Linux hands out pids in sequence,
/// so that needs the whole pid space (`/proc/sys/kernel/pid_max`, 4,194,304 by default) to wrap within
/// 20 ms.
async fn stop_group(child: &mut tokio::process::Child, group: u32, grace: Duration) -> bool {
    let gone = |child: &mut tokio::process::Child| {
        child.try_wait().is_ok_and(|s| s.is_some()) && !super::group_alive(group)
    };
    if gone(child) {
        return true;
    }
    super::signal_group(group, libc::SIGTERM);
    // Also lets a stopped group (Ctrl-Z) see the SIGTERM.
    super::signal_group(group, libc::SIGCONT);
    for (wait, signal) in [(grace, Some(libc::SIGKILL)), (Duration::from_secs(5), None)] {
        let deadline = tokio::time::Instant::now() + wait;
        while !gone(child) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        match signal {
            Some(signal) if !gone(child) => super::signal_group(group, signal),
            _ => break,
        }
    }
    gone(child)
}

/// A stream of `sig`, or `None` if this process inherited it as ignored (it then stays ignored).
fn caught(sig: libc::c_int) -> std::io::Result<Option<tokio::signal::unix::Signal>> {
    if super::inherited_ignored(sig) {
        return Ok(None);
    }
    signal(SignalKind::from_raw(sig)).map(Some)
}

/// The next delivery of a signal caught with [`caught`]; never, for one left ignored.
async fn recv(sig: &mut Option<tokio::signal::unix::Signal>) {
    match sig {
        Some(sig) => {
            sig.recv().await;
        }
        None => std::future::pending().await,
    }
}
