//! Deterministic simulation of Holdfast (issue 4, in the style of TigerBeetle's VOPR and openraft's
//! turmoil tests): five real servers (`holdfast_server::Node`), client hosts running the lock-set
//! workload through the real client library, and the reference fenced store, all in one process on
//! turmoil's simulated network, clock and disks.
//!
//! Nothing is mocked above the operating system: the servers run their real WAL, snapshots, Raft, leases
//! and gRPC; only sockets, files and time are turmoil's (`holdfast_proto::transport`,
//! `holdfast_wal::fs`, compiled in with `--cfg holdfast_sim`). Every source of randomness is the seed:
//! turmoil's network and disk, tokio's scheduler (`--cfg tokio_unstable`), openraft's timeouts
//! (`ServerConfig::rng_seed`), client nonces (`ClientOptions::nonce_seed`) and the fault plan.
//!
//! - [`plan`]: the seed's fault rates and schedule (partitions, one-way links, held messages, crashes,
//!   leader crashes, client pauses longer than the TTL, lost disks replaced by a new member, corrupted
//!   files, leader transfers).
//! - [`corrupt`]: the damage a `Corrupt` fault does to a stopped server's WAL or snapshot.
//! - [`cluster`]: the server and store hosts.
//! - [`admin`]: the operator host: membership changes (replacing a server whose disk was lost) and
//!   leader transfers, through the real RPCs.
//! - [`workload`]: the client hosts.
//! - [`run`]: plays one seed and collects what the invariants need.
//! - [`invariants`]: one file per property, P1–P7 and linearizable reads.
//!
//! Run it with `scripts/sim` (see docs/testing.md).

#![cfg(holdfast_sim)]

pub mod admin;
pub mod cluster;
pub mod corrupt;
pub mod invariants;
pub mod plan;
pub mod rng;
pub mod run;
pub mod workload;
