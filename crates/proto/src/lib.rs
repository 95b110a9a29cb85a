//! The gRPC contract of Holdfast, generated from `proto/holdfast/v1/*.proto`.
//!
//! This crate is the boundary between clients and servers: the client library depends on it and never on
//! server internals, and protobuf types stop at the server's gRPC layer (the lock table never sees them).

#![allow(clippy::all, missing_docs, unreachable_pub)] // generated code

pub mod v1 {
    tonic::include_proto!("holdfast.v1");
}

pub mod transport;

/// Metadata key that repeats the [`v1::Reason`] of an error status, for tools that cannot decode details.
pub const REASON_METADATA_KEY: &str = "holdfast-reason";

/// The [`v1::Reason`] of an error status, from its `ErrorDetail` (`None` if it has none).
pub fn reason(status: &tonic::Status) -> Option<v1::Reason> {
    use prost::Message;
    let detail = v1::ErrorDetail::decode(status.details()).ok()?;
    v1::Reason::try_from(detail.reason)
        .ok()
        .filter(|r| *r != v1::Reason::Unspecified)
}
