//! Integration tests of the `holdfast` binary: real server processes, real disks, real gRPC.

// Real processes, never simulated: hash maps are fine here (see clippy.toml).
#![allow(clippy::disallowed_types)]

mod abandon;
mod access;
mod backup;
mod bad_input;
mod calls;
mod cli;
mod client;
mod cluster;
// Failpoints are compiled out of release builds.
#[cfg(debug_assertions)]
mod failpoints;
mod faults;
mod fencing;
mod harness;
mod limits;
mod lock_delay;
mod membership;
mod newcomer;
mod operations;
mod proxy;
mod secrets;
mod shared;
mod storage;
mod tls;
mod ui;
mod upgrade;
mod watch;
