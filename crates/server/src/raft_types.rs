//! The openraft type configuration: what a Holdfast log entry and its response are.

use holdfast_lock_table::{Command, Outcome};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;

/// The payload of a normal log entry: one lock table command. Shared, not copied: openraft clones each
/// entry it reads from the log (a leader once for each follower it sends it to, every server once to
/// apply it), and a command that carries a session secret boxes the command it authorizes, so a deep
/// copy was an allocation and a free each time. Compared, printed and serialized as the command.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request(pub Arc<Command>);

impl Request {
    pub fn new(command: Command) -> Request {
        Request(Arc::new(command))
    }
}

/// openraft prints entries (at debug level) through these: never with a session secret in them.
impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0.without_secrets())
    }
}

impl fmt::Debug for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Request({:?})", self.0.without_secrets())
    }
}

/// What applying an entry returned. Blank and membership entries have no outcome.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    #[default]
    None,
    Outcome(Outcome),
    /// The outcome of opening a session with a secret, and that session's secret (a retried open gets
    /// the secret of the first), read from the table in the same apply.
    Opened {
        outcome: Outcome,
        secret: u128,
    },
}

/// A member as the Raft membership records it: where peers and clients reach it. Replicated, so every
/// server (and, through `Status`, every client) knows a member added after it was configured.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberNode {
    /// `host:port` of its peer listener.
    pub peer: String,
    /// `host:port` of its client listener; empty in memberships written before it was recorded.
    pub client: String,
}

impl fmt::Display for MemberNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.client, self.peer)
    }
}

openraft::declare_raft_types!(
    pub TypeConfig:
        D = Request,
        R = Response,
        NodeId = u64,
        Node = MemberNode,
        AsyncRuntime = Runtime,
);

/// Tokio, with openraft's randomness (election timeouts, tick jitter) drawn from a seed given at start
/// (`ServerConfig::rng_seed`): random per process in a real server, fixed by the simulation so that one
/// seed replays one run exactly.
#[cfg(not(holdfast_sim))]
pub type Runtime = openraft::rt::deterministic_rng::DeterministicRng<openraft::impls::TokioRuntime>;
/// In the simulation, on each server's own clock rate (`crate::skew`).
#[cfg(holdfast_sim)]
pub type Runtime = openraft::rt::deterministic_rng::DeterministicRng<crate::skew::SkewedRuntime>;

pub type NodeId = u64;
pub type Membership = openraft::Membership<NodeId, MemberNode>;
pub type Raft = openraft::Raft<TypeConfig, crate::state_machine::StateMachine>;
pub type LogId = openraft::alias::LogIdOf<TypeConfig>;
pub type Vote = openraft::alias::VoteOf<TypeConfig>;
pub type Entry = openraft::alias::EntryOf<TypeConfig>;
pub type StoredMembership = openraft::alias::StoredMembershipOf<TypeConfig>;
pub type SnapshotMeta = openraft::alias::SnapshotMetaOf<TypeConfig>;
/// A snapshot's body as openraft passes it around.
pub enum SnapshotData {
    /// A snapshot file of this server: what a build returns and what is sent to a follower, read (a
    /// piece at a time) only when sent. A newer snapshot may have replaced it by then; sending then fails
    /// and openraft asks for the current one again.
    File(std::path::PathBuf),
    /// A snapshot received from the leader and checked: the file's bytes, and the table they decode to
    /// (decoded once, on receipt).
    Received {
        bytes: Vec<u8>,
        table: Box<holdfast_lock_table::LockTable>,
    },
}

impl std::fmt::Debug for SnapshotData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SnapshotData::File(path) => write!(f, "File({})", path.display()),
            SnapshotData::Received { bytes, .. } => write!(f, "Received({} bytes)", bytes.len()),
        }
    }
}
pub type Snapshot = openraft::alias::SnapshotOf<TypeConfig, SnapshotData>;

#[cfg(test)]
mod tests {
    use super::*;
    use holdfast_lock_table::{Command, SessionId};

    /// openraft prints entries at debug level; a session secret must not be in what it prints.
    #[test]
    fn entries_print_without_secrets() {
        let secret = 0x1234_5678_9abc_def0_0fed_cba9_8765_4321u128;
        let close = Command::CloseSession {
            session: SessionId(4),
            now_ms: 1,
        };
        for command in [
            Command::Authorized {
                secret,
                command: Box::new(close),
            },
            Command::OpenSessionWithSecret {
                nonce: 9,
                ttl_ms: 10_000,
                secret,
                now_ms: 1,
            },
        ] {
            let request = Request::new(command);
            for printed in [format!("{request}"), format!("{request:?}")] {
                assert!(!printed.contains(&secret.to_string()), "{printed}");
                assert!(!printed.contains(&format!("{secret:x}")), "{printed}");
                assert!(!printed.contains("secret"), "{printed}");
            }
        }
    }
}
