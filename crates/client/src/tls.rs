//! TLS settings for a client: the CA that servers' certificates must chain to, and optionally this
//! client's certificate and key (its principal on the server; required when the server sets
//! `client_certs = "required"`).
//!
//! ```no_run
//! # fn demo() -> Result<(), holdfast_client::Error> {
//! let tls = holdfast_client::ClientTls::from_files("ca.pem", Some(("alice.pem", "alice.key")))?;
//! let options = holdfast_client::ClientOptions { tls: Some(tls), ..Default::default() };
//! # Ok(()) }
//! ```

use crate::Error;
use holdfast_proto::tls::{self, TlsConnector};
use std::path::Path;

/// How a client connects over TLS (see [`crate::ClientOptions::tls`]).
#[derive(Clone)]
pub struct ClientTls {
    pub(crate) connector: TlsConnector,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("server_name", &self.connector.server_name)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    /// From PEM contents: the CA, and this client's certificate chain and key.
    pub fn from_pem(ca: &[u8], identity: Option<(&[u8], &[u8])>) -> Result<ClientTls, Error> {
        let config = tls::client_config(ca, identity)
            .map_err(|e| Error::InvalidArgument(format!("TLS: {e}")))?;
        Ok(ClientTls {
            connector: TlsConnector::new(config, None),
        })
    }

    /// From PEM files; an error names the file.
    pub fn from_files(
        ca: impl AsRef<Path>,
        identity: Option<(impl AsRef<Path>, impl AsRef<Path>)>,
    ) -> Result<ClientTls, Error> {
        let read = |p: &Path| {
            std::fs::read(p)
                .map_err(|e| Error::InvalidArgument(format!("TLS: {}: {e}", p.display())))
        };
        let ca_pem = read(ca.as_ref())?;
        if let Err(e) = tls::certs_from_pem(&ca_pem) {
            return Err(Error::InvalidArgument(format!(
                "TLS: {}: {e}",
                ca.as_ref().display()
            )));
        }
        match identity {
            None => Self::from_pem(&ca_pem, None),
            Some((cert, key)) => {
                let (cert_pem, key_pem) = (read(cert.as_ref())?, read(key.as_ref())?);
                if let Err(e) = tls::certs_from_pem(&cert_pem) {
                    return Err(Error::InvalidArgument(format!(
                        "TLS: {}: {e}",
                        cert.as_ref().display()
                    )));
                }
                if let Err(e) = tls::key_from_pem(&key_pem) {
                    return Err(Error::InvalidArgument(format!(
                        "TLS: {}: {e}",
                        key.as_ref().display()
                    )));
                }
                Self::from_pem(&ca_pem, Some((&cert_pem, &key_pem)))
            }
        }
    }

    /// The connector tonic channels use (for code that opens its own channels, such as the CLI's
    /// per-server `status`).
    pub fn connector(&self) -> &TlsConnector {
        &self.connector
    }

    /// Verify every server's certificate for this name instead of the host of the endpoint dialled
    /// (for servers reached by an address their certificates do not list).
    pub fn with_server_name(mut self, name: impl Into<String>) -> ClientTls {
        self.connector.server_name = Some(name.into());
        self
    }
}
