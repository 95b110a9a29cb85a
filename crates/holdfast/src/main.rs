//! The `holdfast` binary: `holdfast server` runs one server, `holdfast dev` runs a local 5-server cluster,
//! and the other subcommands are clients (see `docs/cli.md`).

mod bench;
mod dev;
mod duration;
mod server;
mod status;

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
    Server(server::ServerArgs),
    /// Run a local 5-server cluster on 127.0.0.1 with data under ./holdfast-data (Ctrl-C stops it).
    Dev(dev::DevArgs),
    /// Show each server's view: role, leader, term and log indexes per group.
    Status(status::StatusArgs),
    /// Load a running cluster and report throughput and latency percentiles.
    Bench(bench::BenchArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Cmd::Server(args) => server::run(args).await,
            Cmd::Dev(args) => dev::run(args).await,
            Cmd::Status(args) => status::run(args).await,
            Cmd::Bench(args) => bench::run(args).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
