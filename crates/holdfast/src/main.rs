//! The `holdfast` binary: `holdfast server` runs one server, `holdfast dev` a local cluster, and the
//! other subcommands are clients in the style of `etcdctl` (see `docs/cli.md`). One command per file in
//! `cmd/`.

mod cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "holdfast",
    version,
    about = "A distributed lock service on Raft, with fencing tokens"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
#[allow(
    clippy::large_enum_variant,
    reason = "parsed once per process; boxing buys nothing"
)]
enum Cmd {
    /// Run one server of a cluster.
    Server(cmd::server::ServerArgs),
    /// Run a local 5-server cluster on 127.0.0.1 with data under ./holdfast-data (Ctrl-C stops it).
    Dev(cmd::dev::DevArgs),
    /// Show every server's view: role, leader, term, log indexes and lag per group.
    Status(cmd::status::StatusArgs),
    /// List held locks (optionally by name prefix).
    Locks(cmd::locks::LocksArgs),
    /// List sessions.
    Sessions(cmd::sessions::SessionsArgs),
    /// Describe one lock: holder, token, waiters.
    Describe(cmd::describe::DescribeArgs),
    /// Print every change of the locks under a prefix as it happens (granted, released, expired, ...).
    Watch(cmd::watch::WatchArgs),
    /// Run a command while holding a lock (the token is in HOLDFAST_TOKEN).
    Lock(cmd::lock::LockArgs),
    /// Hand a group's Raft leadership to another server (`holdfast leader transfer`).
    Leader(cmd::leader::LeaderArgs),
    /// List, add and remove the servers of each group (membership changes).
    Member(cmd::member::MemberArgs),
    /// Back up every group to a file, or seed a new cluster's data dirs from one.
    Snapshot(cmd::snapshot::SnapshotArgs),
    /// Campaign for a role (leader election), or observe who leads it.
    Elect(cmd::elect::ElectArgs),
    /// Load a running cluster and report throughput and latency percentiles.
    Bench(cmd::bench::BenchArgs),
    /// Run the reference fenced store (a key-value service that refuses stale fencing tokens).
    FenceStore(cmd::fence_store::FenceStoreArgs),
    /// Write to the reference fenced store with a fencing token (default $HOLDFAST_TOKEN).
    FenceWrite(cmd::fence::FenceWriteArgs),
    /// Read from the reference fenced store with a fencing token (raising its mark).
    FenceRead(cmd::fence::FenceReadArgs),
    /// Make a cluster CA, server and client certificates for TLS.
    Certs(cmd::certs::CertsArgs),
    /// The fault tests' client workload (writes a history for the checker).
    #[command(hide = true)]
    Workload(cmd::workload::WorkloadArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Cmd::Status(_) | Cmd::Locks(_) | Cmd::Sessions(_) | Cmd::Describe(_) | Cmd::Watch(_)
    ) {
        cmd::default_sigpipe();
    }
    // The client commands log only when asked: `HOLDFAST_LOG=holdfast_client=debug` shows each retry on
    // another server and why. (`server` sets up its own logging; `dev` passes the variable on to its
    // servers.)
    if !matches!(cli.command, Cmd::Server(_) | Cmd::Dev(_)) {
        if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("HOLDFAST_LOG") {
            tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                // No colour codes in a log redirected to a file.
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .init();
        }
    }
    // Before any thread starts, so that every thread of the server inherits it.
    let scheduled = match &cli.command {
        Cmd::Server(args) => cmd::server::apply_scheduling(args.scheduling),
        _ => Ok(cmd::server::Scheduled::Untouched),
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Cmd::Server(cmd::server::ServerArgs {
        workers: Some(n), ..
    }) = &cli.command
    {
        runtime.worker_threads(usize::from(*n));
    }
    let runtime = match runtime.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Cmd::Server(args) => cmd::server::run(args, scheduled).await,
            Cmd::Dev(args) => cmd::dev::run(args).await,
            Cmd::Status(args) => cmd::status::run(args).await,
            Cmd::Locks(args) => cmd::locks::run(args).await,
            Cmd::Sessions(args) => cmd::sessions::run(args).await,
            Cmd::Describe(args) => cmd::describe::run(args).await,
            Cmd::Watch(args) => cmd::watch::run(args).await,
            Cmd::Lock(args) => cmd::lock::run(args).await,
            Cmd::Elect(args) => cmd::elect::run(args).await,
            Cmd::Leader(args) => cmd::leader::run(args).await,
            Cmd::Member(args) => cmd::member::run(args).await,
            Cmd::Snapshot(args) => cmd::snapshot::run(args).await,
            Cmd::Bench(args) => cmd::bench::run(args).await,
            Cmd::FenceStore(args) => cmd::fence_store::run(args).await,
            Cmd::FenceWrite(args) => cmd::fence::write(args).await,
            Cmd::FenceRead(args) => cmd::fence::read(args).await,
            Cmd::Certs(args) => cmd::certs::run(args).await,
            Cmd::Workload(args) => cmd::workload::run(args).await,
        }
    });
    // The runtime may hold background keepalive tasks; do not wait for them.
    runtime.shutdown_background();
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
