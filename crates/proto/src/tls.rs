//! TLS on Holdfast's ports (rustls with ring; no OpenSSL): the configurations each side uses, the
//! accepting side that hands tonic connections already through their handshake, the connecting side
//! that tonic's channels call, and what a verified certificate says about its holder.
//!
//! Configurations live in cells ([`ServerConfigCell`], [`ClientConfigCell`]) that the server swaps when
//! its certificate files change (`holdfast_server::tls`): a new connection uses the newest, a
//! connection already open keeps the one it was made with.
//!
//! Who a peer is comes from its verified certificate ([`CertNames`]): the principal is the subject's
//! common name, or the first DNS name when there is none. A certificate that carries the `serverAuth`
//! key usage is a server certificate; the peer port admits only those (see `holdfast_server::tls`).

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

pub use rustls;

/// A server configuration that can be replaced while the server runs.
pub type ServerConfigCell = Arc<RwLock<Arc<rustls::ServerConfig>>>;
/// A client configuration that can be replaced while the process runs.
pub type ClientConfigCell = Arc<RwLock<Arc<rustls::ClientConfig>>>;

/// Longest a TLS handshake may take, on either side, before the connection is dropped: a client that
/// opens a connection and sends nothing holds a connection slot for no longer than this.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest certificate, key or CA file read (PEM); a bigger one is refused as not what it claims to be.
pub const MAX_PEM_BYTES: usize = 1 << 20;

/// A certificate, key or configuration that cannot be used, in words naming what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsError(pub String);

impl std::fmt::Display for TlsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TlsError {}

fn err(what: impl Into<String>) -> TlsError {
    TlsError(what.into())
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificates in a PEM file (a chain: the holder's first).
pub fn certs_from_pem(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    if pem.len() > MAX_PEM_BYTES {
        return Err(err(format!("larger than {MAX_PEM_BYTES} bytes")));
    }
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(err(
            "holds no certificate (want PEM `BEGIN CERTIFICATE` blocks)",
        ));
    }
    Ok(certs)
}

/// The private key in a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn key_from_pem(pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    if pem.len() > MAX_PEM_BYTES {
        return Err(err(format!("larger than {MAX_PEM_BYTES} bytes")));
    }
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| err(format!("holds no usable private key: {e}")))
}

fn roots(ca_pem: &[u8]) -> Result<Arc<rustls::RootCertStore>, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in certs_from_pem(ca_pem)? {
        roots
            .add(cert)
            .map_err(|e| err(format!("not a usable CA certificate: {e}")))?;
    }
    Ok(Arc::new(roots))
}

/// Checks that the first certificate of `cert_pem` chains to a CA of `ca_pem`, is valid now and may
/// authenticate a client (every Holdfast certificate may: servers present theirs to peer ports).
pub fn verify_chain(ca_pem: &[u8], cert_pem: &[u8]) -> Result<(), TlsError> {
    let certs = certs_from_pem(cert_pem)?;
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots(ca_pem)?, provider())
            .build()
            .map_err(|e| err(e.to_string()))?;
    verifier
        .verify_client_cert(&certs[0], &certs[1..], rustls::pki_types::UnixTime::now())
        .map(|_| ())
        .map_err(|e| err(format!("not signed by the CA, or not valid now: {e}")))
}

/// Whether a server port asks connecting clients for a certificate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientCerts {
    /// Not asked for (the HTTP port: scrapers and probes).
    None,
    /// Verified against the CA when presented; a client without one is let in, with no principal.
    Optional,
    /// A client without a certificate from the CA fails the handshake.
    Required,
}

/// Application protocols: gRPC runs over HTTP/2.
fn alpn_h2() -> Vec<Vec<u8>> {
    vec![b"h2".to_vec()]
}

/// A server configuration: this server's chain and key, and (unless [`ClientCerts::None`]) the CA that
/// client certificates must chain to. `h2` sets ALPN for a gRPC port.
pub fn server_config(
    ca_pem: &[u8],
    cert_pem: &[u8],
    key_pem: &[u8],
    client_certs: ClientCerts,
    h2: bool,
) -> Result<rustls::ServerConfig, TlsError> {
    let certs = certs_from_pem(cert_pem).map_err(|e| err(format!("certificate: {e}")))?;
    let key = key_from_pem(key_pem).map_err(|e| err(format!("key: {e}")))?;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| err(e.to_string()))?;
    let builder = match client_certs {
        ClientCerts::None => builder.with_no_client_auth(),
        mode => {
            let roots = roots(ca_pem).map_err(|e| err(format!("CA: {e}")))?;
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider());
            let verifier = if mode == ClientCerts::Optional {
                verifier.allow_unauthenticated()
            } else {
                verifier
            };
            builder
                .with_client_cert_verifier(verifier.build().map_err(|e| err(format!("CA: {e}")))?)
        }
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| err(format!("certificate and key do not make a pair: {e}")))?;
    config.alpn_protocols = if h2 {
        alpn_h2()
    } else {
        vec![b"http/1.1".to_vec()]
    };
    Ok(config)
}

/// A client configuration: the CA that servers' certificates must chain to, and optionally this
/// client's own chain and key (required by the peer port; the principal on a client port).
pub fn client_config(
    ca_pem: &[u8],
    identity: Option<(&[u8], &[u8])>,
) -> Result<rustls::ClientConfig, TlsError> {
    let roots = roots(ca_pem).map_err(|e| err(format!("CA: {e}")))?;
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| err(e.to_string()))?
        .with_root_certificates(roots);
    let mut config = match identity {
        None => builder.with_no_client_auth(),
        Some((cert_pem, key_pem)) => {
            let certs = certs_from_pem(cert_pem).map_err(|e| err(format!("certificate: {e}")))?;
            let key = key_from_pem(key_pem).map_err(|e| err(format!("key: {e}")))?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| err(format!("certificate and key do not make a pair: {e}")))?
        }
    };
    config.alpn_protocols = alpn_h2();
    Ok(config)
}

/// What a connection's verified certificate says about the other side.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CertNames {
    /// The subject's common name (CN), if it has one.
    pub common_name: Option<String>,
    /// The DNS names of the subject alternative name extension.
    pub dns_names: Vec<String>,
    /// The extended key usage lists `serverAuth`: a server certificate.
    pub server_auth: bool,
}

impl CertNames {
    /// Who holds the certificate: the common name, else the first DNS name.
    pub fn principal(&self) -> Option<&str> {
        self.common_name
            .as_deref()
            .or(self.dns_names.first().map(String::as_str))
    }
}

/// Reads the names out of a DER certificate. Only certificates the handshake has already verified
/// reach this, but it checks every length anyway: None when the encoding is not what X.509 says.
pub fn cert_names(der: &[u8]) -> Option<CertNames> {
    const CN: &[u8] = &[0x55, 0x04, 0x03];
    const SAN: &[u8] = &[0x55, 0x1d, 0x11];
    const EKU: &[u8] = &[0x55, 0x1d, 0x25];
    const SERVER_AUTH: &[u8] = &[0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x01];
    let (cert, _) = der::expect(der, der::SEQUENCE)?;
    let (mut tbs, _) = der::expect(cert, der::SEQUENCE)?;
    let mut names = CertNames::default();
    // version [0] (optional), serial, signature algorithm, issuer, validity, subject, key, then the
    // optional unique ids [1] [2] and extensions [3].
    if tbs.first() == Some(&0xa0) {
        tbs = der::next(tbs)?.2;
    }
    for _ in 0..4 {
        tbs = der::next(tbs)?.2;
    }
    let (subject, rest) = der::expect(tbs, der::SEQUENCE)?;
    let mut rdns = subject;
    while !rdns.is_empty() {
        let (set, rest) = der::expect(rdns, der::SET)?;
        rdns = rest;
        let mut attrs = set;
        while !attrs.is_empty() {
            let (attr, rest) = der::expect(attrs, der::SEQUENCE)?;
            attrs = rest;
            let (oid, value) = der::expect(attr, der::OID)?;
            if oid == CN && names.common_name.is_none() {
                let (_, text, _) = der::next(value)?;
                names.common_name = Some(String::from_utf8(text.to_vec()).ok()?);
            }
        }
    }
    let mut tbs = der::next(rest)?.2; // the subject's public key
    while !tbs.is_empty() {
        let (tag, content, rest) = der::next(tbs)?;
        tbs = rest;
        if tag != 0xa3 {
            continue;
        }
        let (mut exts, _) = der::expect(content, der::SEQUENCE)?;
        while !exts.is_empty() {
            let (ext, rest) = der::expect(exts, der::SEQUENCE)?;
            exts = rest;
            let (oid, mut ext) = der::expect(ext, der::OID)?;
            if ext.first() == Some(&der::BOOLEAN) {
                ext = der::next(ext)?.2;
            }
            let (value, _) = der::expect(ext, der::OCTET_STRING)?;
            if oid == SAN {
                let (mut general, _) = der::expect(value, der::SEQUENCE)?;
                while !general.is_empty() {
                    let (tag, name, rest) = der::next(general)?;
                    general = rest;
                    if tag == 0x82 {
                        names.dns_names.push(String::from_utf8(name.to_vec()).ok()?);
                    }
                }
            } else if oid == EKU {
                let (mut usages, _) = der::expect(value, der::SEQUENCE)?;
                while !usages.is_empty() {
                    let (usage, rest) = der::expect(usages, der::OID)?;
                    usages = rest;
                    names.server_auth |= usage == SERVER_AUTH;
                }
            }
        }
    }
    Some(names)
}

/// Just enough DER to walk a certificate: tag, length, contents.
mod der {
    pub const BOOLEAN: u8 = 0x01;
    pub const OCTET_STRING: u8 = 0x04;
    pub const OID: u8 = 0x06;
    pub const SEQUENCE: u8 = 0x30;
    pub const SET: u8 = 0x31;

    /// The first element: (tag, contents, what follows). Single-byte tags only, as X.509 uses.
    pub fn next(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
        let (&tag, rest) = input.split_first()?;
        let (&first, mut rest) = rest.split_first()?;
        let len = if first < 0x80 {
            usize::from(first)
        } else {
            let n = usize::from(first & 0x7f);
            if n == 0 || n > 4 || rest.len() < n {
                return None;
            }
            let len = rest[..n]
                .iter()
                .fold(0usize, |len, b| (len << 8) | usize::from(*b));
            rest = &rest[n..];
            len
        };
        if rest.len() < len {
            return None;
        }
        Some((tag, &rest[..len], &rest[len..]))
    }

    /// The first element if it has `tag`: (contents, what follows).
    pub fn expect(input: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
        match next(input)? {
            (t, content, rest) if t == tag => Some((content, rest)),
            _ => None,
        }
    }
}

/// What tonic's handlers see of a TLS connection (`request.extensions().get::<TlsConnectInfo>()`).
#[derive(Clone, Debug)]
pub struct TlsConnectInfo {
    pub remote_addr: Option<SocketAddr>,
    /// The other side's verified certificate, if it presented one.
    pub cert: Option<Arc<CertNames>>,
}

impl TlsConnectInfo {
    pub fn principal(&self) -> Option<&str> {
        self.cert.as_deref().and_then(CertNames::principal)
    }
}

/// An accepted connection past its TLS handshake.
pub struct TlsConn<S> {
    inner: tokio_rustls::server::TlsStream<S>,
    info: TlsConnectInfo,
}

impl<S> TlsConn<S> {
    pub fn info(&self) -> &TlsConnectInfo {
        &self.info
    }
}

impl<S: Send + Sync + 'static> tonic::transport::server::Connected for TlsConn<S> {
    type ConnectInfo = TlsConnectInfo;
    fn connect_info(&self) -> TlsConnectInfo {
        self.info.clone()
    }
}

/// Runs the server side of a handshake on `stream` with the cell's current configuration.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    config: &ServerConfigCell,
    stream: S,
    remote_addr: Option<SocketAddr>,
) -> io::Result<TlsConn<S>> {
    let current = config.read().expect("tls config lock").clone();
    let tls = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        tokio_rustls::TlsAcceptor::from(current).accept(stream),
    )
    .await
    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out"))??;
    let cert = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.first())
        .and_then(|c| cert_names(c))
        .map(Arc::new);
    Ok(TlsConn {
        inner: tls,
        info: TlsConnectInfo { remote_addr, cert },
    })
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for TlsConn<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for TlsConn<S> {
    delegate_async_write!(inner);
}

/// The connecting side for tonic's channels: TCP, then a handshake with the cell's current
/// configuration, verifying the server's certificate for `server_name` (default: the URI's host).
#[derive(Clone)]
pub struct TlsConnector {
    pub config: ClientConfigCell,
    pub server_name: Option<String>,
    /// Also require the server's certificate to have this common name and the `serverAuth` usage
    /// (a server dialling a peer checks it reached that peer, not any holder of a certificate for the
    /// same host name).
    pub expect_common_name: Option<String>,
}

impl TlsConnector {
    pub fn new(config: rustls::ClientConfig, server_name: Option<String>) -> TlsConnector {
        TlsConnector {
            config: Arc::new(RwLock::new(Arc::new(config))),
            server_name,
            expect_common_name: None,
        }
    }
}

type Connecting = Pin<
    Box<
        dyn std::future::Future<
                Output = io::Result<
                    hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>,
                >,
            > + Send,
    >,
>;

#[cfg(not(holdfast_sim))]
type TcpStream = tokio::net::TcpStream;
#[cfg(holdfast_sim)]
type TcpStream = turmoil::net::TcpStream;

impl tonic::codegen::Service<tonic::codegen::http::Uri> for TlsConnector {
    type Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = Connecting;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), io::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: tonic::codegen::http::Uri) -> Connecting {
        let config = self.config.read().expect("tls config lock").clone();
        let name = self.server_name.clone();
        let expect = self.expect_common_name.clone();
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no host"))?;
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let port = uri.port_u16().unwrap_or(443);
            let server_name = ServerName::try_from(name.unwrap_or_else(|| host.clone()))
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            #[cfg(not(holdfast_sim))]
            tcp.set_nodelay(true)?;
            let tls = tokio::time::timeout(
                HANDSHAKE_TIMEOUT,
                tokio_rustls::TlsConnector::from(config).connect(server_name, tcp),
            )
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out"))??;
            if let Some(expect) = expect {
                let names = tls
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|chain| chain.first())
                    .and_then(|c| cert_names(c));
                let ok = names.as_ref().is_some_and(|n| {
                    n.server_auth && n.common_name.as_deref() == Some(expect.as_str())
                });
                if !ok {
                    return Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        format!(
                            "the server's certificate is not {expect}'s (common name {:?})",
                            names.and_then(|n| n.common_name)
                        ),
                    ));
                }
            }
            Ok(hyper_util::rt::TokioIo::new(tls))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn der_lengths_are_checked() {
        assert_eq!(der::next(&[0x30, 0x03, 1, 2]), None);
        assert_eq!(der::next(&[0x30, 0x85, 0, 0, 0, 0, 1]), None);
        assert_eq!(
            der::next(&[0x30, 0x81, 0x01, 7]),
            Some((0x30, &[7u8][..], &[][..]))
        );
        assert_eq!(cert_names(&[]), None);
        assert_eq!(cert_names(&[0x30, 0x00]), None);
    }

    /// Certificates made by `holdfast certs` (the fuzz corpus): a server's, a client's, the CA.
    #[test]
    fn names_are_read_from_real_certificates() {
        let corpus = |f: &str| {
            std::fs::read(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../fuzz/corpus/certificate")
                    .join(f),
            )
            .unwrap()
        };
        let server = cert_names(&corpus("server-1.der")).unwrap();
        assert_eq!(server.principal(), Some("holdfast-server-1"));
        assert_eq!(server.dns_names, ["example.internal"]);
        assert!(server.server_auth);
        let client = cert_names(&corpus("alice.der")).unwrap();
        assert_eq!(client.principal(), Some("alice"));
        assert!(client.dns_names.is_empty());
        assert!(!client.server_auth);
        let ca = cert_names(&corpus("ca.der")).unwrap();
        assert!(
            ca.principal().unwrap().starts_with("Holdfast cluster CA "),
            "{ca:?}"
        );
        // The PEM file of the same server certificate holds the same DER.
        let pem = certs_from_pem(&corpus("server-1.pem")).unwrap();
        assert_eq!(pem[0].as_ref(), &corpus("server-1.der")[..]);
        assert!(key_from_pem(&corpus("alice.key.pem")).is_ok());
        assert!(certs_from_pem(&corpus("alice.key.pem")).is_err());
    }
}
