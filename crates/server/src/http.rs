//! A minimal HTTP/1.1 endpoint for operators: `GET /metrics` (Prometheus text), `/healthz` (the process
//! serves), `/readyz` (a write or linearizable read of every group can be served now, see
//! [`NodeShared::readiness`]), and the dashboard at `/ui` (see [`crate::ui`]). One request per connection; requests over 8 KiB or
//! slower than 5 s are dropped. Over TLS when the server has it (no client certificate asked for).

use crate::node::NodeShared;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;

const MAX_REQUEST_BYTES: usize = 8 << 10;
/// Most connections served at once; one accepted beyond them is closed at once (counted in
/// `holdfast_connections_refused_total{port="http"}`). Each lasts at most 5 s.
pub const MAX_CONNECTIONS: usize = 64;

pub async fn serve(
    listener: TcpListener,
    node: Arc<NodeShared>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, remote) = tokio::select! {
            accepted = listener.accept() => match accepted { Ok(a) => a, Err(_) => continue },
            _ = shutdown.changed() => return,
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            node.metrics
                .http_connections_refused
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            continue;
        };
        let node = node.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let _ = tokio::time::timeout(Duration::from_secs(5), async {
                match node.tls.clone() {
                    #[cfg(not(holdfast_sim))]
                    Some(tls) => {
                        let conn =
                            holdfast_proto::tls::accept(&tls.http_port, stream, Some(remote))
                                .await?;
                        handle(conn, node).await
                    }
                    _ => {
                        let _ = remote;
                        handle(stream, node).await
                    }
                }
            })
            .await;
        });
    }
}

async fn handle<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    node: Arc<NodeShared>,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut chunk).await?;
        if n == 0 || buf.len() + n > MAX_REQUEST_BYTES {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let line = String::from_utf8_lossy(&buf);
    let path = line.split_whitespace().nth(1).unwrap_or("/");
    let (status, content_type, body) = if let Some(reply) = crate::ui::handle(&node, path) {
        reply
    } else {
        match path {
            "/metrics" => ("200 OK", "text/plain; version=0.0.4", node.render_metrics()),
            "/healthz" => ("200 OK", "text/plain", "ok\n".to_string()),
            "/readyz" => match node.readiness().await {
                Ok(()) => ("200 OK", "text/plain", "ready\n".to_string()),
                Err(why) => ("503 Service Unavailable", "text/plain", format!("{why}\n")),
            },
            _ => ("404 Not Found", "text/plain", "not found\n".to_string()),
        }
    };
    let head = format!("HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}
