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

    /// The same listener, registered with the I/O driver of the runtime this is called on, so that its
    /// accepts are woken by that runtime's threads and not handed over from the runtime that bound it:
    /// for a port served on a runtime of its own. (The connections it accepts are registered with the
    /// runtime that polls the accept, whichever registered the listener. In the simulation, the same
    /// listener.)
    pub fn on_this_runtime(self) -> io::Result<Listener> {
        #[cfg(not(holdfast_sim))]
        let inner = tokio::net::TcpListener::from_std(self.inner.into_std()?)?;
        #[cfg(holdfast_sim)]
        let inner = self.inner;
        Ok(Listener { inner })
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

/// A `preface` for [`divert`] that no connection begins with (and an HTTP/2 one differs from at its
/// first byte): every connection goes to tonic, as on a server that predates the protocol diverted.
pub const NO_PREFACE: &[u8] = b"\0\0no-protocol-of-our-own";

/// Connections that begin with `preface` go to `divert` (which gets them with the preface read); every
/// other connection is passed on, its first bytes given back, for tonic (`serve_with_incoming*`). The
/// bytes are told apart as they arrive: an HTTP/2 connection's preface (`PRI * HTTP/2.0...`) differs from
/// `preface` in its first byte, so gRPC connections wait for nothing. Each connection is read in a task
/// of its own (one slow connection holds up no other) for at most `timeout`; one that sends neither in
/// that time is closed.
pub fn divert<IO, S, D>(
    incoming: S,
    preface: &'static [u8],
    timeout: Duration,
    divert: D,
) -> impl tonic::codegen::tokio_stream::Stream<Item = io::Result<Rewind<IO>>> + Send + 'static
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: tonic::codegen::tokio_stream::Stream<Item = io::Result<IO>> + Send + 'static,
    D: Fn(IO) + Send + Sync + 'static,
{
    use tonic::codegen::tokio_stream::StreamExt;
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let divert = std::sync::Arc::new(divert);
    tokio::spawn(async move {
        let mut incoming = std::pin::pin!(incoming);
        loop {
            let next = tokio::select! {
                next = incoming.next() => next,
                _ = tx.closed() => return,
            };
            let Some(accepted) = next else { return };
            let mut io = match accepted {
                Ok(io) => io,
                Err(e) => {
                    if tx.send(Err(e)).await.is_err() {
                        return;
                    }
                    continue;
                }
            };
            let (tx, divert) = (tx.clone(), divert.clone());
            tokio::spawn(async move {
                let mut read = Vec::with_capacity(preface.len());
                let sniffed = tokio::time::timeout(timeout, async {
                    use tokio::io::AsyncReadExt;
                    let mut buf = vec![0u8; preface.len()];
                    while read.len() < preface.len() {
                        let want = preface.len() - read.len();
                        let n = io.read(&mut buf[..want]).await?;
                        if n == 0 {
                            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
                        }
                        read.extend_from_slice(&buf[..n]);
                        if !preface.starts_with(&read) {
                            return Ok(false);
                        }
                    }
                    Ok(true)
                })
                .await;
                match sniffed {
                    Ok(Ok(true)) => divert(io),
                    Ok(Ok(false)) => {
                        let rewound = Rewind {
                            prefix: read,
                            at: 0,
                            inner: io,
                        };
                        // Bounded like a TLS handshake's hand-over: tonic not taking connections
                        // closes this one.
                        let _ = tokio::time::timeout(timeout, tx.send(Ok(rewound))).await;
                    }
                    // Closed, failed or silent: dropped, which closes it.
                    _ => {}
                }
            });
        }
    });
    tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// A connection whose first bytes were read ([`divert`]) and are read again before the rest.
pub struct Rewind<IO> {
    prefix: Vec<u8>,
    at: usize,
    inner: IO,
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected for Rewind<IO> {
    type ConnectInfo = IO::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<IO: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Rewind<IO> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        if self.at < self.prefix.len() {
            let n = (self.prefix.len() - self.at).min(buf.remaining());
            let at = self.at;
            buf.put_slice(&self.prefix[at..at + n]);
            self.at += n;
            return std::task::Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<IO: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Rewind<IO> {
    delegate_async_write!(inner);
}

/// A byte stream to a server that is not used through tonic ([`connect_raw`]).
pub trait RawIo: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> RawIo for T {}

/// A plain byte stream to `addr` (`host:port`), over TLS with `tls` when it is given (the server's
/// certificate checked as for a channel), for a protocol of our own on a port that also serves gRPC.
pub async fn connect_raw(
    addr: &str,
    tls: Option<&crate::tls::TlsConnector>,
) -> io::Result<Box<dyn RawIo>> {
    connect_raw_within(addr, tls, CONNECT_TIMEOUT).await
}

/// [`connect_raw`], giving the TCP connection `timeout` to be set up (and a TLS handshake as long
/// again as [`TLS_CONNECT_TIMEOUT`] gives it beyond [`CONNECT_TIMEOUT`]).
pub async fn connect_raw_within(
    addr: &str,
    tls: Option<&crate::tls::TlsConnector>,
    timeout: Duration,
) -> io::Result<Box<dyn RawIo>> {
    if let Some(tls) = tls {
        let uri: tonic::codegen::http::Uri = format!("http://{addr}")
            .parse()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{e}")))?;
        let mut tls = tls.clone();
        let io = tokio::time::timeout(
            timeout + (TLS_CONNECT_TIMEOUT - CONNECT_TIMEOUT),
            tonic::codegen::Service::call(&mut tls, uri),
        )
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
        return Ok(Box::new(io.into_inner()));
    }
    #[cfg(not(holdfast_sim))]
    let stream = tokio::net::TcpStream::connect(addr);
    #[cfg(holdfast_sim)]
    let stream = turmoil::net::TcpStream::connect(addr.to_string());
    let stream = tokio::time::timeout(timeout, stream)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
    #[cfg(not(holdfast_sim))]
    stream.set_nodelay(true)?;
    Ok(Box::new(stream))
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
    delegate_async_write!(inner);
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
