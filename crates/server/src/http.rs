//! The HTTP port for operators, on axum routes served by hyper's HTTP/1.1: `GET /metrics` (Prometheus
//! text, see [`crate::metrics`]), `/healthz` (the process serves), `/readyz` (a write or linearizable
//! read of every group can be served now, see [`NodeShared::readiness`]), and the dashboard at `/ui`
//! (see [`crate::ui`]). One request per connection (no keep-alive); request heads over 8 KiB are refused
//! and a connection is closed after 5 s whatever it is doing. At most [`MAX_CONNECTIONS`] are served at
//! once. Over TLS when the server has it (no client certificate asked for).

use crate::node::NodeShared;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;

/// The largest request head hyper buffers (its minimum); a larger one is answered 431 and closed.
const MAX_REQUEST_BYTES: usize = 8 << 10;
/// Most connections served at once; one accepted beyond them is closed at once (counted in
/// `holdfast_connections_refused_total{port="http"}`).
pub const MAX_CONNECTIONS: usize = 64;
/// How long one connection may take, from accept (and TLS handshake) to the last byte of the answer.
const CONNECTION_TIME: Duration = Duration::from_secs(5);

pub async fn serve(
    listener: TcpListener,
    node: Arc<NodeShared>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let app = router(node.clone());
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, remote) = tokio::select! {
            accepted = listener.accept() => match accepted { Ok(a) => a, Err(_) => continue },
            _ = shutdown.changed() => return,
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            node.metrics.http_connections_refused.inc();
            continue;
        };
        let (node, app) = (node.clone(), app.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let _ = tokio::time::timeout(CONNECTION_TIME, async {
                match node.tls.clone() {
                    #[cfg(not(holdfast_sim))]
                    Some(tls) => {
                        let conn =
                            holdfast_proto::tls::accept(&tls.http_port, stream, Some(remote))
                                .await?;
                        serve_connection(conn, app).await
                    }
                    _ => {
                        let _ = (remote, &node);
                        serve_connection(stream, app).await
                    }
                }
            })
            .await;
        });
    }
}

/// Serves one request on `stream`, then closes it.
async fn serve_connection<S>(stream: S, app: Router) -> std::io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        .max_buf_size(MAX_REQUEST_BYTES)
        .serve_connection(
            hyper_util::rt::TokioIo::new(stream),
            hyper_util::service::TowerToHyperService::new(app),
        )
        .await
        .map_err(std::io::Error::other)
}

/// Every path of the HTTP port.
pub fn router(node: Arc<NodeShared>) -> Router {
    let registry = Arc::new(crate::metrics::registry(node.clone()));
    Router::new()
        .route(
            "/metrics",
            get(move || async move {
                (
                    [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
                    crate::metrics::render(&registry),
                )
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .merge(crate::ui::routes())
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found\n") })
        .with_state(node)
}

async fn readyz(State(node): State<Arc<NodeShared>>) -> Response {
    match node.readiness().await {
        Ok(()) => "ready\n".into_response(),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response(),
    }
}
