//! TLS for this server's three ports, from the `[tls]` section of the config: one certificate and key
//! (this server's, signed by the cluster CA) serve the client, peer and HTTP ports and are presented to
//! other servers when this one connects to their peer ports.
//!
//! - The **peer port** requires a certificate from the cluster CA that is a *server* certificate (its
//!   extended key usage lists `serverAuth`, which `holdfast certs client` never sets) naming a server
//!   (`holdfast-server-<id>`). Any other connection is closed after the handshake: a client, even one
//!   with a valid client certificate, cannot send Raft messages.
//! - The **client port** verifies a client certificate against the CA when one is presented
//!   (`client_certs = "optional"`, the default) or refuses clients without one (`"required"`).
//! - The **HTTP port** (metrics, health) asks for none.
//!
//! The files are read again every [`RELOAD_INTERVAL`] and on SIGHUP; when they changed and make a valid
//! configuration, new connections use it (connections already open keep theirs). A change that does
//! not load (a key that does not match its certificate, a file half written) keeps the old
//! configuration, is logged, and counts in `holdfast_tls_reloads_total{result="error"}`; the next
//! change is tried again.

use holdfast_proto::tls::{self, ClientCerts, ClientConfigCell, ServerConfigCell, TlsConnector};
use serde::Deserialize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// How often the certificate files are checked for a change.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// The prefix of a server certificate's common name; the peer port admits `holdfast-server-<id>`.
pub const SERVER_NAME_PREFIX: &str = "holdfast-server-";

/// The `[tls]` section of a server's config file.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// The cluster CA (PEM; several certificates while a CA is being replaced).
    pub ca: PathBuf,
    /// This server's certificate chain (PEM), issued by the CA (`holdfast certs server`).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// Whether the client port requires a client certificate.
    #[serde(default)]
    pub client_certs: ClientCertMode,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ClientCertMode {
    /// Verified when presented (a client without one has no principal).
    #[default]
    Optional,
    /// A client without a certificate from the CA is refused at the handshake.
    Required,
}

impl std::str::FromStr for ClientCertMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "optional" => Ok(ClientCertMode::Optional),
            "required" => Ok(ClientCertMode::Required),
            _ => Err(format!(
                "client certificates must be `optional` or `required`, got {s:?}"
            )),
        }
    }
}

/// The configurations built from the files, and the cells new connections take them from.
pub struct Tls {
    files: TlsConfig,
    /// This server's node id: its certificate must name it.
    node_id: u64,
    /// The three files' contents the cells were last built from.
    loaded: Mutex<Vec<u8>>,
    /// The contents that last failed to load, and why: tried again only once they change.
    failed: Mutex<Option<(Vec<u8>, String)>>,
    pub client_port: ServerConfigCell,
    pub peer_port: ServerConfigCell,
    pub http_port: ServerConfigCell,
    /// What this server presents when it connects to other servers' peer ports.
    pub peer_client: ClientConfigCell,
    pub reloads: AtomicU64,
    pub reload_failures: AtomicU64,
    /// Connections closed because their handshake failed or the peer port does not admit them.
    pub refused_client: Arc<AtomicU64>,
    pub refused_peer: Arc<AtomicU64>,
}

struct Built {
    client_port: rustls::ServerConfig,
    peer_port: rustls::ServerConfig,
    http_port: rustls::ServerConfig,
    peer_client: rustls::ClientConfig,
}

use holdfast_proto::tls::rustls;

fn read(path: &std::path::Path) -> Result<Vec<u8>, String> {
    read_capped(path, tls::MAX_PEM_BYTES)
}

/// A file watched by [`watch_files`], read whole if it is at most `max` bytes; an error names it.
pub(crate) fn read_capped(path: &std::path::Path, max: usize) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(max as u64 + 1).read_to_end(&mut bytes))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if bytes.len() > max {
        return Err(format!("{}: larger than {max} bytes", path.display()));
    }
    Ok(bytes)
}

impl Tls {
    /// Loads the files; an error names the file and what is wrong with it (the server does not start).
    pub fn load(files: &TlsConfig, node_id: u64) -> Result<Tls, String> {
        let parts = Self::read_all(files)?;
        let built = Self::build(files, node_id, &parts)?;
        let bytes = parts.concat();
        let server = |c| Arc::new(RwLock::new(Arc::new(c)));
        Ok(Tls {
            files: files.clone(),
            node_id,
            loaded: Mutex::new(bytes),
            failed: Mutex::new(None),
            client_port: server(built.client_port),
            peer_port: server(built.peer_port),
            http_port: server(built.http_port),
            peer_client: Arc::new(RwLock::new(Arc::new(built.peer_client))),
            reloads: AtomicU64::new(0),
            reload_failures: AtomicU64::new(0),
            refused_client: Default::default(),
            refused_peer: Default::default(),
        })
    }

    /// The CA, certificate and key files' contents.
    fn read_all(files: &TlsConfig) -> Result<[Vec<u8>; 3], String> {
        Ok([read(&files.ca)?, read(&files.cert)?, read(&files.key)?])
    }

    fn build(
        files: &TlsConfig,
        node_id: u64,
        [ca, cert, key]: &[Vec<u8>; 3],
    ) -> Result<Built, String> {
        fn named(what: &std::path::Path) -> impl Fn(tls::TlsError) -> String + '_ {
            move |e| format!("{}: {e}", what.display())
        }
        let pair =
            |e: tls::TlsError| format!("{} and {}: {e}", files.cert.display(), files.key.display());
        // Checked one by one first, so the error names the file at fault.
        tls::certs_from_pem(ca).map_err(named(&files.ca))?;
        tls::certs_from_pem(cert).map_err(named(&files.cert))?;
        tls::key_from_pem(key).map_err(named(&files.key))?;
        tls::verify_chain(ca, cert).map_err(|e| {
            format!(
                "{} with the CA {}: {e}",
                files.cert.display(),
                files.ca.display()
            )
        })?;
        let client_certs = match files.client_certs {
            ClientCertMode::Optional => ClientCerts::Optional,
            ClientCertMode::Required => ClientCerts::Required,
        };
        let built = Built {
            client_port: tls::server_config(ca, cert, key, client_certs, true).map_err(pair)?,
            peer_port: tls::server_config(ca, cert, key, ClientCerts::Required, true)
                .map_err(pair)?,
            http_port: tls::server_config(ca, cert, key, ClientCerts::None, false).map_err(pair)?,
            peer_client: tls::client_config(ca, Some((cert, key))).map_err(pair)?,
        };
        // A server certificate must be usable as one: the peer port of every other server checks it.
        let names = tls::certs_from_pem(cert)
            .ok()
            .and_then(|c| c.first().and_then(|c| tls::cert_names(c)));
        match names.as_ref().and_then(server_id) {
            Some(id) if id == node_id => {}
            Some(id) => {
                return Err(format!(
                    "{}: the certificate of node {id}, but this is node {node_id} (every peer would refuse it)",
                    files.cert.display()
                ))
            }
            None => {
                return Err(format!(
                    "{}: not a Holdfast server certificate (want the serverAuth and clientAuth key usages and the common name {SERVER_NAME_PREFIX}{node_id}; `holdfast certs server --id {node_id}` makes one)",
                    files.cert.display()
                ))
            }
        }
        Ok(built)
    }

    /// Rebuilds the configurations if the files changed. Ok(true): the new ones are in use.
    ///
    /// Contents that failed are tried again on every call (a certificate may fail only because it is
    /// not valid yet), but counted and reported as a new failure only when they change.
    pub fn reload_if_changed(&self) -> Result<bool, String> {
        // Unreadable (being replaced, or removed): keep what is loaded until it reads again.
        let parts = Self::read_all(&self.files)?;
        let current = parts.concat();
        if current == *self.loaded.lock().expect("tls lock") {
            return Ok(false);
        }
        match Self::build(&self.files, self.node_id, &parts) {
            Ok(built) => {
                *self.client_port.write().expect("tls lock") = Arc::new(built.client_port);
                *self.peer_port.write().expect("tls lock") = Arc::new(built.peer_port);
                *self.http_port.write().expect("tls lock") = Arc::new(built.http_port);
                *self.peer_client.write().expect("tls lock") = Arc::new(built.peer_client);
                *self.loaded.lock().expect("tls lock") = current;
                *self.failed.lock().expect("tls lock") = None;
                self.reloads.fetch_add(1, Relaxed);
                Ok(true)
            }
            Err(e) => {
                let mut failed = self.failed.lock().expect("tls lock");
                if failed.as_ref().map(|(bytes, _)| bytes) != Some(&current) {
                    self.reload_failures.fetch_add(1, Relaxed);
                    *failed = Some((current, e.clone()));
                }
                Err(e)
            }
        }
    }

    /// The connector this server's peer channels use (see [`Tls::peer_connector_to`]).
    pub fn peer_connector(&self) -> TlsConnector {
        TlsConnector {
            config: self.peer_client.clone(),
            server_name: None,
            expect_common_name: None,
        }
    }

    /// Checks the files every [`RELOAD_INTERVAL`] and on SIGHUP until `shutdown`.
    pub async fn watch(self: Arc<Self>, shutdown: tokio::sync::watch::Receiver<bool>) {
        watch_files("TLS certificates", shutdown, move || {
            self.reload_if_changed()
        })
        .await
    }
}

/// Calls `reload` every [`RELOAD_INTERVAL`] and on SIGHUP until `shutdown`, logging what `what` did:
/// each reload that took, and each distinct error once (not once a second).
pub async fn watch_files(
    what: &str,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
    reload: impl Fn() -> Result<bool, String>,
) {
    #[cfg(not(holdfast_sim))]
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    let mut tick = tokio::time::interval(RELOAD_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_error = None;
    loop {
        #[cfg(not(holdfast_sim))]
        let hup = async {
            match hangup.as_mut() {
                Some(h) => {
                    h.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        #[cfg(holdfast_sim)]
        let hup = std::future::pending::<()>();
        tokio::select! {
            _ = tick.tick() => {}
            _ = hup => {}
            _ = shutdown.changed() => return,
        }
        match reload() {
            Ok(true) => {
                last_error = None;
                tracing::info!("{what} reloaded");
            }
            Ok(false) => {}
            Err(e) => {
                if last_error.as_ref() != Some(&e) {
                    tracing::error!(%e, "{what}: changed, but the new version does not load; the previous one stays in use");
                    last_error = Some(e);
                }
            }
        }
    }
}

/// A channel from this server to another server's client port (abandons forwarded to the leader,
/// readiness probes): over TLS, presenting this server's certificate, when the cluster has TLS.
pub fn client_channel(
    endpoint: tonic::transport::Endpoint,
    target: u64,
    tls: Option<&Tls>,
) -> tonic::transport::Channel {
    // The request may carry a session's secret: it must reach `target` itself.
    let connector = tls.map(|t| TlsConnector {
        config: t.peer_client.clone(),
        server_name: None,
        expect_common_name: Some(format!("{SERVER_NAME_PREFIX}{target}")),
    });
    holdfast_proto::transport::connect_lazy_tls(endpoint, connector.as_ref())
}

/// The node id a server certificate names, if it is one.
pub fn server_id(names: &tls::CertNames) -> Option<u64> {
    if !names.server_auth {
        return None;
    }
    names
        .common_name
        .as_deref()
        .and_then(|cn| cn.strip_prefix(SERVER_NAME_PREFIX))
        .and_then(|id| id.parse::<u64>().ok())
        .filter(|&id| id != 0)
}

fn admit_peer_names(names: &tls::CertNames) -> bool {
    server_id(names).is_some()
}

/// The peer port's rule: a verified server certificate of the cluster CA naming a server.
pub fn admit_peer(info: &tls::TlsConnectInfo) -> bool {
    info.cert.as_deref().is_some_and(admit_peer_names)
}

/// The client port admits whoever got through the handshake (its rules are in the verifier).
pub fn admit_client(_: &tls::TlsConnectInfo) -> bool {
    true
}
