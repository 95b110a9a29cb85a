//! Which cluster and node a data directory belongs to: `DATA_DIR/IDENTITY`, written when the directory is
//! created and checked on every start.
//!
//! Format 1 (text, one `key=value` per line):
//!
//! ```text
//! format=1
//! cluster_id=<16 hex digits>
//! node_id=<n>
//! groups=<g>
//! join=1            (only for a data directory created by a server started with `join`)
//! ```
//!
//! The cluster id is fixed at creation: the configuration's `cluster_id` if one is given, else a hash of
//! the member ids with their client addresses, the group count and `cluster_token` (so the servers of one
//! cluster, started with the same member list, agree on it without talking; a cluster re-created on the same
//! addresses should get a new `cluster_token`, as with etcd's `--initial-cluster-token`). Every peer message
//! carries it and a server refuses messages from another cluster ([`crate::peer`]).
//!
//! Format 0 (Holdfast 0.1) had no format line and pinned the whole member list (`node_id`, `groups`,
//! `members`); it is upgraded in place, its cluster id derived from the member list it recorded, or the
//! configured `cluster_id` if one is given (for servers whose configurations spelled a member's client
//! address differently, which would derive different ids).
//!
//! Invariant: a data directory is only ever served as the node id and group count it was created with,
//! and in the cluster it was created in.

use crate::config::ServerConfig;
use anyhow::{bail, Context};
use holdfast_wal::fs;
use std::path::Path;

pub const FILE: &str = "IDENTITY";
const FORMAT: u32 = 1;

/// What a data directory says about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    pub cluster_id: u64,
    pub node_id: u64,
    pub groups: u32,
    /// Created by a server started with `join`: it never initializes the groups itself, even when
    /// restarted without `join` before it was added.
    pub join: bool,
}

impl Identity {
    fn encode(&self) -> String {
        format!(
            "format={FORMAT}\ncluster_id={:016x}\nnode_id={}\ngroups={}\n{}",
            self.cluster_id,
            self.node_id,
            self.groups,
            if self.join { "join=1\n" } else { "" }
        )
    }
}

/// FNV-1a, 64 bit: stable across Rust versions and platforms (unlike `DefaultHasher`), which a value
/// written to disk and compared between servers needs.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The cluster id a new cluster with these members gets (see the module docs).
pub fn derive_cluster_id<'a>(
    members: impl IntoIterator<Item = (u64, &'a str)>,
    groups: u32,
    token: &str,
) -> u64 {
    let mut members: Vec<(u64, &str)> = members.into_iter().collect();
    members.sort();
    let mut text = format!("holdfast-cluster\ntoken={token}\ngroups={groups}\n");
    for (id, client) in members {
        text.push_str(&format!("{id}={client}\n"));
    }
    fnv1a(text.as_bytes())
}

/// Parses `--cluster-id` / `cluster_id`: 1 to 16 hex digits, not zero.
pub fn parse_cluster_id(text: &str) -> Result<u64, String> {
    let id = u64::from_str_radix(text.trim(), 16)
        .map_err(|_| format!("bad cluster id {text:?}: want up to 16 hex digits"))?;
    if id == 0 {
        return Err("cluster id 0 is reserved".into());
    }
    Ok(id)
}

fn configured(config: &ServerConfig) -> anyhow::Result<Identity> {
    let cluster_id = match &config.cluster_id {
        Some(text) => parse_cluster_id(text).map_err(anyhow::Error::msg)?,
        None => derive_cluster_id(
            config.members.iter().map(|m| (m.id, m.client.as_str())),
            config.groups,
            &config.cluster_token,
        ),
    };
    Ok(Identity {
        cluster_id,
        node_id: config.node_id,
        groups: config.groups,
        join: config.join,
    })
}

fn field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
}

/// Reads an IDENTITY file's text (either format).
pub fn parse(text: &str) -> Result<Identity, String> {
    let number = |key: &str| -> Result<u64, String> {
        field(text, key)
            .ok_or(format!("no {key} line"))?
            .parse()
            .map_err(|_| format!("bad {key} line"))
    };
    let node_id = number("node_id")?;
    let groups = u32::try_from(number("groups")?).map_err(|_| "bad groups line".to_string())?;
    let cluster_id = match field(text, "format") {
        Some("1") => parse_cluster_id(field(text, "cluster_id").ok_or("no cluster_id line")?)?,
        Some(other) => {
            return Err(format!(
                "IDENTITY format {other} is newer than this holdfast (format {FORMAT}); downgrades are not supported"
            ))
        }
        None => {
            // Format 0: the member list it was created with, `id=client/peer,...`.
            let members = field(text, "members").ok_or("no members line")?;
            let mut parsed = Vec::new();
            for item in members.split(',').filter(|s| !s.is_empty()) {
                let (id, addrs) = item.split_once('=').ok_or("bad members line")?;
                let id: u64 = id.parse().map_err(|_| "bad members line")?;
                let client = addrs.split_once('/').map_or(addrs, |(c, _)| c);
                parsed.push((id, client));
            }
            derive_cluster_id(parsed, groups, "")
        }
    };
    Ok(Identity {
        cluster_id,
        node_id,
        groups,
        join: field(text, "join") == Some("1"),
    })
}

/// Writes (atomically, durably) the IDENTITY of a data directory; used at creation and by a restore.
pub fn create(dir: &Path, identity: &Identity) -> anyhow::Result<()> {
    let path = dir.join(FILE);
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, identity.encode())?;
    fs::File::open(&tmp)?.sync_all()?;
    fs::rename(&tmp, &path)?;
    fs::sync_dir(dir)?;
    Ok(())
}

/// What a data directory's identity is once the configuration is applied, and whether the file is
/// still to be written (a new directory) or rewritten (a format-0 file to upgrade).
struct Judged {
    identity: Identity,
    new: bool,
    upgrade_from_0: bool,
}

/// Reads the IDENTITY file (if any) and checks it against the configuration; writes nothing.
fn judge(config: &ServerConfig) -> anyhow::Result<Judged> {
    let dir = &config.data_dir;
    let path = dir.join(FILE);
    let wanted = configured(config)?;
    let text = match fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // A restore writes the snapshots first and IDENTITY last, and a server writes its log
            // before anything else: snapshots with neither are a restore that did not finish. Taken
            // for a new directory, its groups without a snapshot would start empty, issuing tokens
            // from 1 again.
            let snapshots = dir.join("snapshots");
            let has_snapshots = fs::read_dir(&snapshots).is_ok_and(|mut d| d.next().is_some());
            if has_snapshots && fs::metadata(dir.join("wal")).is_err() {
                bail!(
                    "data dir {} holds snapshots but no IDENTITY and no log: a restore that did not \
                     finish. Remove the directory and run `holdfast snapshot restore` again",
                    dir.display()
                );
            }
            return Ok(Judged {
                identity: wanted,
                new: true,
                upgrade_from_0: false,
            });
        }
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let mut stored = parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    if stored.node_id != wanted.node_id || stored.groups != wanted.groups {
        bail!(
            "data dir {} was created for node {} with {} groups; this configuration is node {} with {} groups (node id and groups are fixed at creation)",
            dir.display(),
            stored.node_id,
            stored.groups,
            wanted.node_id,
            wanted.groups
        );
    }
    let format_0 = field(&text, "format").is_none();
    if format_0 && config.cluster_id.is_some() {
        // Format 0 recorded no id; the one derived from its member list differs between servers whose
        // configurations spelled a member differently (a host name on one, an address on another). An
        // operator who gives the id explicitly settles it.
        stored.cluster_id = wanted.cluster_id;
    } else if config.cluster_id.is_some() && stored.cluster_id != wanted.cluster_id {
        // Once created, the stored id is the truth (members may move or change since); only an
        // explicitly configured id that differs is a contradiction.
        bail!(
            "data dir {} belongs to cluster {:016x}, but this configuration gives cluster_id {:016x}",
            dir.display(),
            stored.cluster_id,
            wanted.cluster_id
        );
    }
    Ok(Judged {
        identity: stored,
        new: false,
        upgrade_from_0: format_0,
    })
}

/// What `check` would decide, without writing anything: `Ok(None)` for a new data directory, the
/// identity an existing compatible one has (or gets by its upgrade), an error for one that would be
/// refused.
pub fn inspect(config: &ServerConfig) -> anyhow::Result<Option<Identity>> {
    let judged = judge(config)?;
    Ok((!judged.new).then_some(judged.identity))
}

/// Checks (or, for a new data directory, writes) the identity and returns it. Refuses a data directory
/// created for another node id, group count or cluster: serving it would move locks between groups or
/// merge clusters.
pub fn check(config: &ServerConfig) -> anyhow::Result<Identity> {
    let judged = judge(config)?;
    if judged.upgrade_from_0 {
        tracing::info!(cluster_id = %format!("{:016x}", judged.identity.cluster_id), "upgrading {} from format 0 to format {FORMAT}", config.data_dir.join(FILE).display());
    }
    if judged.new || judged.upgrade_from_0 {
        create(&config.data_dir, &judged.identity)?;
    }
    Ok(judged.identity)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_1_round_trips_and_is_pinned() {
        let id = Identity {
            cluster_id: 0x0123_4567_89ab_cdef,
            node_id: 3,
            groups: 4,
            join: false,
        };
        assert_eq!(
            id.encode(),
            "format=1\ncluster_id=0123456789abcdef\nnode_id=3\ngroups=4\n"
        );
        assert_eq!(parse(&id.encode()).unwrap(), id);
        let joined = Identity { join: true, ..id };
        assert_eq!(
            joined.encode(),
            "format=1\ncluster_id=0123456789abcdef\nnode_id=3\ngroups=4\njoin=1\n"
        );
        assert_eq!(parse(&joined.encode()).unwrap(), joined);
    }

    #[test]
    fn format_0_derives_the_same_id_on_every_node_of_a_cluster() {
        // Two nodes of one cluster recorded different peer addresses (a proxy each) but the same clients.
        let n1 = "node_id=1\ngroups=2\nmembers=1=h:1/p:9,2=h:2/p:8\n";
        let n2 = "node_id=2\ngroups=2\nmembers=1=h:1/q:7,2=h:2/q:6\n";
        let (a, b) = (parse(n1).unwrap(), parse(n2).unwrap());
        assert_eq!(a.cluster_id, b.cluster_id);
        assert_eq!((a.node_id, a.groups), (1, 2));
        assert_eq!(
            a.cluster_id,
            derive_cluster_id([(2, "h:2"), (1, "h:1")], 2, "")
        );
        // The value itself is pinned: it is on disk in every upgraded data directory.
        assert_eq!(a.cluster_id, 0x38457bf461dac524);
        let other = "node_id=1\ngroups=2\nmembers=1=h:1/p:9,2=h:3/p:8\n";
        assert_ne!(parse(other).unwrap().cluster_id, a.cluster_id);
    }

    fn config(dir: &Path, cluster_id: Option<&str>) -> ServerConfig {
        ServerConfig {
            node_id: 1,
            groups: 2,
            data_dir: dir.to_path_buf(),
            cluster_id: cluster_id.map(str::to_string),
            members: ServerConfig::parse_members("1=h:1/p:1,2=h:2/p:2").unwrap(),
            ..ServerConfig::default()
        }
    }

    /// A restore writes the snapshots first and IDENTITY last: a directory with snapshots and neither
    /// IDENTITY nor a log is one that did not finish, refused rather than started as a new cluster whose
    /// unrestored groups would issue tokens from 1 again. With a log it is an older server's directory.
    #[test]
    fn an_unfinished_restore_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("snapshots/g0")).unwrap();
        let err = check(&config(dir.path(), None)).unwrap_err().to_string();
        assert!(err.contains("a restore that did not finish"), "{err}");
        assert!(!dir.path().join(FILE).exists());
        std::fs::create_dir(dir.path().join("wal")).unwrap();
        check(&config(dir.path(), None)).unwrap();
        assert!(dir.path().join(FILE).exists());
    }

    #[test]
    fn check_creates_upgrades_and_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE);
        // Format 0 with an explicit id: the id is adopted and the file rewritten as format 1.
        std::fs::write(&path, "node_id=1\ngroups=2\nmembers=1=x:1/p:1,2=h:2/p:2\n").unwrap();
        let id = check(&config(dir.path(), Some("abc"))).unwrap();
        assert_eq!(id.cluster_id, 0xabc);
        assert!(std::fs::read_to_string(&path)
            .unwrap()
            .starts_with("format=1\ncluster_id=0000000000000abc\n"));
        // From now on the recorded id counts: none configured is fine, another one is refused.
        assert_eq!(check(&config(dir.path(), None)).unwrap().cluster_id, 0xabc);
        let err = check(&config(dir.path(), Some("abd")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("belongs to cluster 0000000000000abc"), "{err}");
        // Another node id is refused, naming both.
        let mut other = config(dir.path(), None);
        other.node_id = 2;
        let err = check(&other).unwrap_err().to_string();
        assert!(err.contains("created for node 1 with 2 groups"), "{err}");
        // A new directory records the derived id.
        let fresh = tempfile::tempdir().unwrap();
        let id = check(&config(fresh.path(), None)).unwrap();
        assert_eq!(
            id.cluster_id,
            derive_cluster_id([(1, "h:1"), (2, "h:2")], 2, "")
        );
    }

    #[test]
    fn tokens_groups_and_bad_text() {
        let m = [(1, "a"), (2, "b")];
        assert_ne!(derive_cluster_id(m, 1, ""), derive_cluster_id(m, 1, "x"));
        assert_ne!(derive_cluster_id(m, 1, ""), derive_cluster_id(m, 2, ""));
        assert!(parse("format=2\ncluster_id=1\nnode_id=1\ngroups=1\n")
            .unwrap_err()
            .contains("newer"));
        assert!(parse("format=1\nnode_id=1\ngroups=1\n").is_err());
        assert!(parse("node_id=x\ngroups=1\nmembers=\n").is_err());
        assert_eq!(parse_cluster_id("00ff").unwrap(), 255);
        assert!(parse_cluster_id("0").is_err());
        assert!(parse_cluster_id("xyz").is_err());
    }
}
