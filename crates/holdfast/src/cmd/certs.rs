//! `holdfast certs`: a cluster CA and the certificates a deployment needs (rcgen, ECDSA P-256).
//!
//! - `holdfast certs ca --dir D` makes `D/ca.pem` and `D/ca.key`.
//! - `holdfast certs server --dir D --id N [--host H]...` makes `D/server-N.pem|.key`: common name
//!   `holdfast-server-N` (what the peer port admits), the `serverAuth` and `clientAuth` usages (a server
//!   presents it on its ports and to other servers' peer ports), and the hosts clients and peers dial
//!   as subject alternative names (default `localhost` and `127.0.0.1`).
//! - `holdfast certs client --dir D --name P` makes `D/P.pem|.key`: common name `P` (the principal), the
//!   `clientAuth` usage only, so it cannot pass as a server on a peer port.
//!
//! Only a CA made by `holdfast certs ca` can sign here (its name is read back from `ca.pem`); an
//! organisation's own CA issues with its own tools, following the same rules. Keys are written
//! owner-only (0600) and existing files are never overwritten.

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct CertsArgs {
    #[command(subcommand)]
    what: CertsAction,
}

#[derive(Subcommand, Debug)]
enum CertsAction {
    /// Make a cluster CA: DIR/ca.pem (give it to servers and clients) and DIR/ca.key (keep it safe).
    Ca {
        /// Where the files go (and where `server` and `client` find the CA).
        #[arg(long, default_value = "holdfast-certs")]
        dir: PathBuf,
        /// The CA's common name (default `Holdfast cluster CA` and 8 random hex digits, so that two
        /// clusters' CAs never share a name).
        #[arg(long)]
        name: Option<String>,
        /// Validity in days.
        #[arg(long, default_value_t = 3650)]
        days: u32,
    },
    /// Make server N's certificate and key, signed by DIR/ca.pem: DIR/server-N.pem, DIR/server-N.key.
    Server {
        #[arg(long, default_value = "holdfast-certs")]
        dir: PathBuf,
        /// The server's node id.
        #[arg(long)]
        id: u64,
        /// A host name or IP address clients and peers reach this server by (repeatable; default
        /// localhost and 127.0.0.1).
        #[arg(long = "host")]
        hosts: Vec<String>,
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
    /// Make a random bearer token: prints it (for the client, HOLDFAST_AUTH_TOKEN) and the line that
    /// lists it under a principal in the policy file (only its SHA-256 is kept there).
    Token {
        /// The principal the token acts as (printed in the policy line).
        #[arg(long)]
        name: String,
    },
    /// Make a client certificate for principal NAME, signed by DIR/ca.pem: DIR/NAME.pem, DIR/NAME.key.
    Client {
        #[arg(long, default_value = "holdfast-certs")]
        dir: PathBuf,
        /// The principal (the certificate's common name).
        #[arg(long)]
        name: String,
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
}

pub async fn run(args: CertsArgs) -> anyhow::Result<ExitCode> {
    match args.what {
        CertsAction::Ca { dir, name, days } => {
            let name = match name {
                Some(n) => n,
                None => format!("Holdfast cluster CA {:08x}", random_u32()?),
            };
            let (cert, key) = new_ca(&name, days)?;
            write_pair(&dir, "ca", &cert, &key)?;
        }
        CertsAction::Server {
            dir,
            id,
            hosts,
            days,
        } => {
            if id == 0 {
                bail!("--id must be a server's node id (1 or more)");
            }
            let (ca_cert, ca_key) = read_ca(&dir)?;
            let (cert, key) = issue(&ca_cert, &ca_key, &Leaf::Server { id, hosts }, days)?;
            write_pair(&dir, &format!("server-{id}"), &cert, &key)?;
        }
        CertsAction::Token { name } => {
            let mut bytes = [0u8; 32];
            for chunk in bytes.chunks_mut(4) {
                chunk.copy_from_slice(&random_u32()?.to_le_bytes());
            }
            let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            let hash: String = holdfast_server::access::token_hash(&token)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            println!("token: {token}");
            println!("policy:\n[principals.{name:?}]\ntokens_sha256 = [\"{hash}\"]");
        }
        CertsAction::Client { dir, name, days } => {
            check_principal(&name)?;
            let (ca_cert, ca_key) = read_ca(&dir)?;
            let (cert, key) = issue(
                &ca_cert,
                &ca_key,
                &Leaf::Client { name: name.clone() },
                days,
            )?;
            write_pair(&dir, &name, &cert, &key)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn random_u32() -> anyhow::Result<u32> {
    use std::io::Read;
    let mut b = [0u8; 4];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// A principal names a file here, so it must be a plain name.
fn check_principal(name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.@".contains(c))
        && !name.starts_with('.')
        && !name.starts_with(holdfast_server::tls::SERVER_NAME_PREFIX);
    if !ok {
        bail!(
            "--name {name:?}: want 1..=64 of A-Z a-z 0-9 - _ . @, not starting with '.' or {:?}",
            holdfast_server::tls::SERVER_NAME_PREFIX
        );
    }
    Ok(())
}

/// What a certificate is for.
pub enum Leaf {
    Server { id: u64, hosts: Vec<String> },
    Client { name: String },
}

fn validity(params: &mut CertificateParams, days: u32) {
    let now = rcgen::date_time_ymd(1970, 1, 1)
        + std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
    // An hour of slack for clocks a little behind this one.
    params.not_before = now - std::time::Duration::from_secs(3600);
    params.not_after = now + std::time::Duration::from_secs(u64::from(days) * 86_400);
}

/// A new self-signed CA: (certificate PEM, key PEM).
pub fn new_ca(name: &str, days: u32) -> anyhow::Result<(String, String)> {
    let key = KeyPair::generate()?;
    let params = ca_params(name, days);
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn ca_params(name: &str, days: u32) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity(&mut params, days);
    params
}

/// A certificate signed by the CA: (certificate PEM, key PEM).
pub fn issue(
    ca_cert: &str,
    ca_key: &str,
    leaf: &Leaf,
    days: u32,
) -> anyhow::Result<(String, String)> {
    let ca_der = holdfast_proto::tls::certs_from_pem(ca_cert.as_bytes())
        .map_err(|e| anyhow::anyhow!("CA certificate: {e}"))?;
    let ca_name = ca_der
        .first()
        .and_then(|c| holdfast_proto::tls::cert_names(c))
        .and_then(|n| n.common_name)
        .context("the CA certificate has no common name (was it made by `holdfast certs ca`?)")?;
    let ca_key = KeyPair::from_pem(ca_key).context("CA key")?;
    let issuer = Issuer::new(ca_params(&ca_name, 1), ca_key);
    let (cn, sans, usages) = match leaf {
        Leaf::Server { id, hosts } => {
            let hosts = if hosts.is_empty() {
                vec!["localhost".to_string(), "127.0.0.1".to_string()]
            } else {
                hosts.clone()
            };
            (
                format!("{}{id}", holdfast_server::tls::SERVER_NAME_PREFIX),
                hosts,
                vec![
                    ExtendedKeyUsagePurpose::ServerAuth,
                    ExtendedKeyUsagePurpose::ClientAuth,
                ],
            )
        }
        Leaf::Client { name } => (
            name.clone(),
            Vec::new(),
            vec![ExtendedKeyUsagePurpose::ClientAuth],
        ),
    };
    let mut params = CertificateParams::new(sans).context("a --host is not a valid name")?;
    params.distinguished_name.push(DnType::CommonName, cn);
    params.extended_key_usages = usages;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    validity(&mut params, days);
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn read_ca(dir: &Path) -> anyhow::Result<(String, String)> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path).with_context(|| {
            format!(
                "cannot read {} (make a CA first: `holdfast certs ca --dir {}`)",
                path.display(),
                dir.display()
            )
        })
    };
    Ok((read("ca.pem")?, read("ca.key")?))
}

/// Writes STEM.pem and STEM.key (owner-only) in `dir`, refusing to replace either.
pub fn write_pair(dir: &Path, stem: &str, cert: &str, key: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let (cert_path, key_path) = (
        dir.join(format!("{stem}.pem")),
        dir.join(format!("{stem}.key")),
    );
    for p in [&cert_path, &key_path] {
        if p.exists() {
            bail!("{} exists; remove it first to make a new one", p.display());
        }
    }
    for (path, text, mode) in [(&key_path, key, 0o600), (&cert_path, cert, 0o644)] {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
