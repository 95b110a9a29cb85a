//! How every Holdfast gRPC connection is opened and accepted: real TCP sockets, or, in the deterministic
//! simulation (`--cfg holdfast_sim`, crates/sim), turmoil's simulated network. This is the one place that
//! knows which, so servers, clients and the fenced store run the same code in both.
//!
//! Simulated TCP never retransmits: a segment dropped by a partition stalls its connection for good. That
//! is also what a real half-open connection looks like, so callers set HTTP/2 keepalives (a dead
//! connection is closed and the next call reconnects) and a timeout on every call.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};

/// Longest wait for a TCP connection to be set up.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// Longest wait for a TCP connection and its TLS handshake (two more round trips, and signatures).
pub const TLS_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A channel that connects on first use and reconnects after the connection fails.
pub fn connect_lazy(endpoint: Endpoint) -> Channel {
    #[cfg(not(holdfast_sim))]
    return endpoint.connect_lazy();
    #[cfg(holdfast_sim)]
    return endpoint.connect_with_connector_lazy(sim::connector());
}

/// [`connect_lazy`] over TLS with `tls` when it is given.
pub fn connect_lazy_tls(endpoint: Endpoint, tls: Option<&crate::tls::TlsConnector>) -> Channel {
    match tls {
        Some(tls) => endpoint.connect_with_connector_lazy(tls.clone()),
        None => connect_lazy(endpoint),
    }
}

/// A channel connected now (fails if the server cannot be reached).
pub async fn connect(endpoint: Endpoint) -> Result<Channel, tonic::transport::Error> {
    #[cfg(not(holdfast_sim))]
    return endpoint.connect().await;
    #[cfg(holdfast_sim)]
    return endpoint.connect_with_connector(sim::connector()).await;
}

/// A listening socket for a gRPC server.
pub struct Listener {
    #[cfg(not(holdfast_sim))]
    inner: tokio::net::TcpListener,
    #[cfg(holdfast_sim)]
    inner: turmoil::net::TcpListener,
}

#[cfg(not(holdfast_sim))]
impl From<tokio::net::TcpListener> for Listener {
    fn from(inner: tokio::net::TcpListener) -> Self {
        Listener { inner }
    }
}

impl Listener {
    pub async fn bind(addr: SocketAddr) -> io::Result<Listener> {
        #[cfg(not(holdfast_sim))]
        let inner = tokio::net::TcpListener::bind(addr).await?;
        #[cfg(holdfast_sim)]
        let inner = turmoil::net::TcpListener::bind(addr).await?;
        Ok(Listener { inner })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// The accepted connections, for `tonic::transport::Server::serve_with_incoming*`.
    #[cfg(not(holdfast_sim))]
    pub fn incoming(self) -> tonic::transport::server::TcpIncoming {
        tonic::transport::server::TcpIncoming::from(self.inner).with_nodelay(Some(true))
    }

    /// [`Listener::incoming`], with at most `limit`'s permits' worth of connections open at once: a
    /// connection accepted while none is free is closed at once and counted in `refused`.
    #[cfg(not(holdfast_sim))]
    pub fn incoming_limited(
        self,
        limit: std::sync::Arc<tokio::sync::Semaphore>,
        refused: std::sync::Arc<std::sync::atomic::AtomicU64>,
    ) -> impl tonic::codegen::tokio_stream::Stream<Item = io::Result<Limited<tokio::net::TcpStream>>>
           + Send
           + 'static {
        use tonic::codegen::tokio_stream::StreamExt;
        self.incoming().filter_map(move |accepted| match accepted {
            Ok(stream) => match limit.clone().try_acquire_owned() {
                Ok(permit) => Some(Ok(Limited {
                    inner: stream,
                    _permit: Some(permit),
                })),
                // Dropping the stream closes the connection.
                Err(_) => {
                    refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    None
                }
            },
            Err(e) => Some(Err(e)),
        })
    }

    /// Accepted connections past their TLS handshake with `config`'s current configuration, for
    /// `tonic::transport::Server::serve_with_incoming*`. Handshakes run concurrently (one slow client
    /// does not hold up the others), each for at most [`crate::tls::HANDSHAKE_TIMEOUT`]. With `limit`,
    /// as [`Listener::incoming_limited`]: a connection holds a permit from accept to close. A
    /// connection whose handshake fails, or that `admit` turns away, is closed and counted in
    /// `refused_handshakes`.
    #[cfg(not(holdfast_sim))]
    pub fn incoming_tls(
        self,
        config: crate::tls::ServerConfigCell,
        limit: Option<(
            std::sync::Arc<tokio::sync::Semaphore>,
            std::sync::Arc<std::sync::atomic::AtomicU64>,
        )>,
        admit: fn(&crate::tls::TlsConnectInfo) -> bool,
        refused_handshakes: std::sync::Arc<std::sync::atomic::AtomicU64>,
    ) -> impl tonic::codegen::tokio_stream::Stream<
        Item = io::Result<crate::tls::TlsConn<Limited<tokio::net::TcpStream>>>,
    > + Send
           + 'static {
        use std::sync::atomic::Ordering::Relaxed;
        // Connections through their handshake wait here for tonic. A connection that cannot be queued
        // within a handshake timeout (tonic not taking connections) is closed, giving its slot back.
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let listener = self.inner;
        tokio::spawn(async move {
            loop {
                let (stream, remote) = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            // Out of file descriptors or similar: let connections close, then go on.
                            tracing::warn!(%e, "accepting a connection failed");
                            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                            continue;
                        }
                    },
                    _ = tx.closed() => return,
                };
                let _ = stream.set_nodelay(true);
                let permit = match &limit {
                    None => None,
                    Some((slots, refused)) => match slots.clone().try_acquire_owned() {
                        Ok(p) => Some(p),
                        Err(_) => {
                            refused.fetch_add(1, Relaxed);
                            continue;
                        }
                    },
                };
                let (tx, config, refused) =
                    (tx.clone(), config.clone(), refused_handshakes.clone());
                tokio::spawn(async move {
                    let stream = Limited {
                        inner: stream,
                        _permit: permit,
                    };
                    match crate::tls::accept(&config, stream, Some(remote)).await {
                        Ok(conn) if admit(conn.info()) => {
                            let _ = tokio::time::timeout(
                                crate::tls::HANDSHAKE_TIMEOUT,
                                tx.send(Ok(conn)),
                            )
                            .await;
                        }
                        _ => {
                            refused.fetch_add(1, Relaxed);
                        }
                    }
                });
            }
        });
        tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(rx)
    }

    /// The accepted connections, for `tonic::transport::Server::serve_with_incoming*`.
    #[cfg(holdfast_sim)]
    pub fn incoming(self) -> impl futures::Stream<Item = io::Result<sim::Stream>> + Send + 'static {
        futures::stream::unfold(self.inner, |listener| async move {
            let accepted = listener.accept().await.map(|(s, _)| sim::Stream(s));
            Some((accepted, listener))
        })
    }
}

/// An accepted connection that holds one of the listener's connection permits (if it has a limit)
/// until it closes.
pub struct Limited<S> {
    inner: S,
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for Limited<S> {
    type ConnectInfo = S::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Limited<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Limited<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(holdfast_sim)]
pub mod sim {
    //! turmoil's TCP behind tonic's connector and incoming-stream traits.

    use super::CONNECT_TIMEOUT;
    use std::io;
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

    /// A tower service that opens a simulated TCP connection to the URI's host and port.
    pub fn connector() -> impl tower::Service<
        tonic::codegen::http::Uri,
        Response = hyper_util::rt::TokioIo<turmoil::net::TcpStream>,
        Error = io::Error,
        Future = impl Send,
    > + Clone
           + Send
           + 'static {
        tower::service_fn(|uri: tonic::codegen::http::Uri| async move {
            let host = uri.host().unwrap_or_default().to_string();
            let port = uri.port_u16().unwrap_or(80);
            let stream = tokio::time::timeout(
                CONNECT_TIMEOUT,
                turmoil::net::TcpStream::connect((host, port)),
            )
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
            Ok(hyper_util::rt::TokioIo::new(stream))
        })
    }

    /// An accepted simulated connection.
    pub struct Stream(pub turmoil::net::TcpStream);

    impl tonic::transport::server::Connected for Stream {
        type ConnectInfo = ();
        fn connect_info(&self) -> Self::ConnectInfo {}
    }

    impl AsyncRead for Stream {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut self.0).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for Stream {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Pin::new(&mut self.0).poll_write(cx, buf)
        }
        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.0).poll_flush(cx)
        }
        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.0).poll_shutdown(cx)
        }
    }
}
