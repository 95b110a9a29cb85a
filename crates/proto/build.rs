//! Compiles `proto/holdfast/v1/*.proto` with protox (pure Rust: no `protoc` on the build machine).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let files = [
        root.join("holdfast/v1/lock.proto"),
        root.join("holdfast/v1/raft.proto"),
        root.join("holdfast/v1/fence.proto"),
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let fds = protox::compile(&files, [&root])?;
    // Keepalive secrets as `Bytes`: slices of the received message instead of one allocation per
    // session (a batch carries up to 10,000). A log entry's command too: prost decodes a `bytes` field
    // typed `Vec<u8>` from a slice in two allocations (a `Bytes` copy, then the `Vec`), one as `Bytes`,
    // and every follower decodes every entry it is sent.
    tonic_prost_build::configure()
        .bytes(".holdfast.v1.Entry.command")
        .bytes(".holdfast.v1.KeepAliveRequest.session_secrets")
        .bytes(".holdfast.v1.GroupKeepAlive.session_secrets")
        .bytes(".holdfast.v1.GroupKeepAlive.packed_secrets")
        .compile_fds(fds)?;
    Ok(())
}
