//! The gRPC contract of Holdfast, generated from `proto/holdfast/v1/*.proto`.
//!
//! This crate is the boundary between clients and servers: the client library depends on it and never on
//! server internals, and protobuf types stop at the server's gRPC layer (the lock table never sees them).

#![allow(clippy::all, missing_docs, unreachable_pub)] // generated code

pub mod v1 {
    tonic::include_proto!("holdfast.v1");
}

/// The methods of `tokio::io::AsyncWrite` for a wrapper whose `$field` does the writing (the
/// connection wrappers of `tls` and `transport`: each adds something to reading or to its lifetime,
/// nothing to writing).
macro_rules! delegate_async_write {
    ($field:ident) => {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::pin::Pin::new(&mut self.$field).poll_write(cx, buf)
        }
        fn poll_flush(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.$field).poll_flush(cx)
        }
        fn poll_shutdown(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.$field).poll_shutdown(cx)
        }
        fn poll_write_vectored(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            bufs: &[std::io::IoSlice<'_>],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::pin::Pin::new(&mut self.$field).poll_write_vectored(cx, bufs)
        }
        fn is_write_vectored(&self) -> bool {
            self.$field.is_write_vectored()
        }
    };
}

pub mod frames;
pub mod tls;
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

/// A failed call's message with the causes behind it: tonic's own message for a transport failure is
/// often just "transport error", with what happened (connection refused, ...) in the error's sources.
pub fn status_with_causes(status: &tonic::Status) -> String {
    use std::error::Error as _;
    let mut parts = vec![status.message().to_string()];
    let mut source = status.source();
    while let Some(e) = source {
        let text = e.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = e.source();
    }
    parts.retain(|p| !p.is_empty());
    if parts.is_empty() {
        format!("{:?}", status.code())
    } else {
        parts.join(": ")
    }
}
