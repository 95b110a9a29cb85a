//! Integration tests of the `holdfast` binary: real server processes, real disks, real gRPC.

mod bad_input;
mod cluster;
mod harness;
mod proxy;
