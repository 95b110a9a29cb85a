//! `holdfast snapshot save FILE` (a consistent backup of every group, from the running cluster) and
//! `holdfast snapshot restore FILE --data-dir D --node-id N --members ...` (seed one server of a new
//! cluster from it, offline). The file format and what a restore writes: `holdfast_server::backup`.

use super::Conn;
use anyhow::Context;
use clap::{Args, Subcommand};
use holdfast_server::backup::{self, Backup, GroupBackup};
use holdfast_server::config::ServerConfig;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct SnapshotArgs {
    #[command(subcommand)]
    action: SnapshotAction,
}

#[derive(Subcommand, Debug)]
enum SnapshotAction {
    /// Write a backup of every group (each taken by its leader at a committed index) to FILE.
    Save {
        file: PathBuf,
        #[command(flatten)]
        conn: Conn,
    },
    /// Seed the data dir of one server of a NEW cluster from a backup (run once per server, with the same
    /// --members; then start the servers). The new cluster gets a new cluster id.
    Restore {
        file: PathBuf,
        /// The new server's data directory (must not exist or be empty).
        #[arg(long)]
        data_dir: PathBuf,
        /// The new server's id (one of --members).
        #[arg(long)]
        node_id: u64,
        /// Every server of the new cluster: `id=client_host:port/peer_host:port,...`.
        #[arg(long)]
        members: String,
        /// Mixed into the new cluster id (restore twice from one backup on the same addresses: give each
        /// a different token).
        #[arg(long, default_value = "")]
        cluster_token: String,
        /// Start every group's log at this index instead of the backup's plus 2^40 (must be at least the
        /// backup's; above the old cluster's last index, or fencing tokens repeat). Same on every server.
        /// Restoring one backup a second time (the first restored cluster lost too, with no backup of
        /// its own): pass one above everything the first could have issued, e.g. its start + 2^40.
        #[arg(long)]
        index_floor: Option<u64>,
    },
}

pub async fn run(args: SnapshotArgs) -> anyhow::Result<ExitCode> {
    match args.action {
        SnapshotAction::Save { file, conn } => save(file, conn).await,
        SnapshotAction::Restore {
            file,
            data_dir,
            node_id,
            members,
            cluster_token,
            index_floor,
        } => {
            let bytes =
                std::fs::read(&file).with_context(|| format!("cannot read {}", file.display()))?;
            let backup =
                Backup::decode(&bytes).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
            let members = ServerConfig::parse_members(&members).map_err(anyhow::Error::msg)?;
            let cluster_id = backup::restore(
                &backup,
                &data_dir,
                node_id,
                &members,
                index_floor,
                &cluster_token,
            )
            .map_err(anyhow::Error::msg)?;
            for g in &backup.groups {
                // What the restored cluster will report (`holdfast status --digest`): the backup's
                // table with its sessions re-keyed.
                let restored =
                    backup::restored_digest(g, cluster_id).map_err(anyhow::Error::msg)?;
                println!(
                    "group {}: backed up at index {} (digest {:016x}), restored to start at index {} (digest {:016x})",
                    g.group,
                    g.last_log_id.index,
                    g.digest,
                    backup::restored_index(g, index_floor).map_err(anyhow::Error::msg)?,
                    restored,
                );
            }
            println!(
                "data dir {} is node {node_id} of new cluster {cluster_id:016x} (from cluster {:016x}); start it with --node-id {node_id} --groups {} --data-dir {} and the same --members",
                data_dir.display(),
                backup.cluster_id,
                backup.groups.len(),
                data_dir.display()
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn save(file: PathBuf, conn: Conn) -> anyhow::Result<ExitCode> {
    let client = conn.connect().await?;
    let status = super::any_status(&client).await?;
    let cluster_id = u64::from_str_radix(&status.cluster_id, 16)
        .ok()
        .context("the server reported no cluster id")?;
    let mut groups = Vec::new();
    for g in 0..client.groups() {
        let chunk = client.snapshot_group(g).await?;
        let last_log_id = holdfast_server::formats::log_id_from_pb(&holdfast_proto::v1::LogId {
            term: chunk.term,
            leader: chunk.leader,
            index: chunk.index,
        });
        groups.push(GroupBackup {
            group: g,
            last_log_id,
            digest: chunk.digest,
            table: chunk.data,
        });
    }
    let backup = Backup {
        cluster_id,
        created_at_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        written_by: format!("holdfast {}", env!("CARGO_PKG_VERSION")),
        groups,
    };
    let bytes = backup.encode();
    // Check what is about to be written exactly as a restore will read it.
    Backup::decode(&bytes).map_err(|e| anyhow::anyhow!("the backup does not check out: {e}"))?;
    // FILE.tmp (not FILE with its extension replaced: a.backup and a.old would share a.tmp).
    let mut tmp = file.clone().into_os_string();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    {
        let mut f = std::fs::File::create(&tmp)
            .with_context(|| format!("cannot create {}", tmp.display()))?;
        f.write_all(&bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, &file).with_context(|| format!("cannot rename to {}", file.display()))?;
    // The rename is durable only once the directory is.
    let dir = file
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("cannot sync {}", dir.display()))?;
    for g in &backup.groups {
        println!(
            "group {}: index {}, digest {:016x}, {} bytes",
            g.group,
            g.last_log_id.index,
            g.digest,
            g.table.len()
        );
    }
    println!(
        "wrote {} ({} bytes) from cluster {cluster_id:016x}",
        file.display(),
        bytes.len()
    );
    Ok(ExitCode::SUCCESS)
}
