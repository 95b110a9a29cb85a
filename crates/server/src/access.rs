//! Access control on the client port: who the caller is (its principal) and what the policy file lets
//! it do. Without a policy file every caller may do everything (the dev mode; its banner says so).
//!
//! - **Principal:** a bearer token (`authorization: Bearer TOKEN`) that the policy lists, else the common
//!   name of the client certificate the TLS handshake verified, else `anonymous`. A token the policy
//!   does not list is refused, not treated as anonymous: a typo must not silently drop privileges
//!   into someone else's.
//! - **Permissions** on name prefixes: `lock` (open, renew and close sessions; acquire names under the
//!   prefix; release and cancel with `lock` on any prefix, see [`Need::Cancel`]), `read` (describe and list names under it; `ListSessions` needs read
//!   on every name, `""`), `admin` (status with the digest, leader transfer, membership, snapshots).
//!   `Status` without the digest (how clients find the groups and members) needs any permission.
//! - **Default deny:** a principal the policy does not name, or a permission none of its roles grants,
//!   is refused with `PERMISSION_DENIED` naming the principal, the permission and the name or prefix.
//!
//! The file is read again every second and on SIGHUP; a version that does not parse keeps the previous
//! policy (logged, and counted in `holdfast_policy_reloads_total{result="error"}`). The policy is each
//! server's own file, not replicated: give every server the same one.
//!
//! The peer port is not governed by the policy: with TLS it admits only cluster members (`crate::tls`).

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use tonic::{Request, Status};

/// The principal of a caller with neither a listed token nor a client certificate.
pub const ANONYMOUS: &str = "anonymous";
/// Largest policy file read.
pub const MAX_POLICY_BYTES: usize = 1 << 20;
/// Most prefixes per permission per role, roles, and principals in a policy: a check walks them.
pub const MAX_PREFIXES: usize = 1_000;
pub const MAX_ROLES: usize = 1_000;
pub const MAX_PRINCIPALS: usize = 100_000;
/// Most roles one principal names, and prefixes per permission it ends up with once they are merged.
pub const MAX_ROLES_PER_PRINCIPAL: usize = 100;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Permission {
    Lock,
    Read,
    Admin,
}

impl std::fmt::Display for Permission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Permission::Lock => "lock",
            Permission::Read => "read",
            Permission::Admin => "admin",
        })
    }
}

/// What one RPC needs.
#[derive(Clone, Copy, Debug)]
pub enum Need<'a> {
    /// `lock` on this name.
    Lock(&'a str),
    /// For `CancelAcquire`: `lock` on some prefix, not necessarily this name's (the session's secret,
    /// checked after, shows the session is the caller's). A principal whose `lock` on a name was
    /// revoked while one of its acquires waited there must be able to take that wait back: its
    /// session, renewed on the strength of its other prefixes, would otherwise be granted the lock
    /// without its owner knowing. (A principal with no `lock` left at all is refused its keepalives,
    /// so its sessions expire with their waits.) Other servers send it too (forwarding an acquire
    /// whose caller went away to the leader).
    Cancel(&'a str),
    /// For `Release`: as `Cancel` (letting go of a lock the session holds), but not for servers.
    Release(&'a str),
    /// `lock` on some prefix (sessions are not tied to names).
    LockAny,
    /// `read` on every name under this prefix (a name is its own prefix).
    Read(&'a str),
    Admin,
    /// Any permission at all.
    Any,
}

/// The policy file, as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(default)]
    roles: BTreeMap<String, RoleFile>,
    #[serde(default)]
    principals: BTreeMap<String, PrincipalFile>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RoleFile {
    #[serde(default)]
    lock: Vec<String>,
    #[serde(default)]
    read: Vec<String>,
    #[serde(default)]
    admin: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PrincipalFile {
    #[serde(default)]
    roles: Vec<String>,
    /// SHA-256 (hex) of bearer tokens that act as this principal.
    #[serde(default)]
    tokens_sha256: Vec<String>,
    /// Quotas (unlimited when absent): sessions open at once, locks held or waited for, waits.
    max_sessions: Option<u64>,
    max_locks: Option<u64>,
    max_waiting: Option<u64>,
    /// Watch streams open at once on each server (a server's own count, not replicated).
    max_watches: Option<u64>,
}

/// What one principal may do: its roles merged.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Grants {
    pub lock: Vec<String>,
    pub read: Vec<String>,
    pub admin: bool,
    /// None: no quota at all.
    pub quota: Option<holdfast_lock_table::QuotaLimits>,
    /// Watch streams open at once per server; None: unlimited (the server-wide bound still holds).
    pub max_watches: Option<u64>,
}

impl Grants {
    fn allows(&self, need: Need<'_>) -> bool {
        let under =
            |prefixes: &[String], name: &str| prefixes.iter().any(|p| name.starts_with(p.as_str()));
        match need {
            Need::Lock(name) => under(&self.lock, name),
            Need::LockAny | Need::Cancel(_) | Need::Release(_) => !self.lock.is_empty(),
            Need::Read(prefix) => under(&self.read, prefix),
            Need::Admin => self.admin,
            Need::Any => self.admin || !self.lock.is_empty() || !self.read.is_empty(),
        }
    }
}

/// A parsed, checked policy.
#[derive(Debug, Default)]
pub struct Policy {
    principals: BTreeMap<String, Grants>,
    /// SHA-256 of a token → its principal.
    tokens: BTreeMap<[u8; 32], String>,
}

fn hex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// SHA-256 of a bearer token, as the policy lists it.
pub fn token_hash(token: &str) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    d.as_ref().try_into().expect("sha256 is 32 bytes")
}

impl Policy {
    /// Parses a policy file; an error names what is wrong (an unknown role, a malformed token hash, a
    /// limit exceeded, a TOML error with its line).
    pub fn parse(text: &str) -> Result<Policy, String> {
        let file: PolicyFile = toml::from_str(text).map_err(|e| e.to_string())?;
        if file.roles.len() > MAX_ROLES || file.principals.len() > MAX_PRINCIPALS {
            return Err(format!(
                "at most {MAX_ROLES} roles and {MAX_PRINCIPALS} principals"
            ));
        }
        for (name, role) in &file.roles {
            if role.lock.len() > MAX_PREFIXES || role.read.len() > MAX_PREFIXES {
                return Err(format!(
                    "role {name:?}: at most {MAX_PREFIXES} prefixes per permission"
                ));
            }
        }
        let mut policy = Policy::default();
        for (name, p) in &file.principals {
            let mut grants = Grants::default();
            let roles: std::collections::BTreeSet<&String> = p.roles.iter().collect();
            if roles.len() > MAX_ROLES_PER_PRINCIPAL {
                return Err(format!(
                    "principal {name:?}: at most {MAX_ROLES_PER_PRINCIPAL} roles"
                ));
            }
            let (mut lock, mut read) = (
                std::collections::BTreeSet::new(),
                std::collections::BTreeSet::new(),
            );
            for role in roles {
                let r = file.roles.get(role).ok_or_else(|| {
                    format!("principal {name:?}: role {role:?} is not defined under [roles]")
                })?;
                lock.extend(r.lock.iter().cloned());
                read.extend(r.read.iter().cloned());
                grants.admin |= r.admin;
            }
            if lock.len() > MAX_PREFIXES || read.len() > MAX_PREFIXES {
                return Err(format!(
                    "principal {name:?}: its roles grant more than {MAX_PREFIXES} prefixes for one permission"
                ));
            }
            if p.max_sessions.is_some() || p.max_locks.is_some() || p.max_waiting.is_some() {
                grants.quota = Some(holdfast_lock_table::QuotaLimits {
                    sessions: p.max_sessions.unwrap_or(u64::MAX),
                    locks: p.max_locks.unwrap_or(u64::MAX),
                    waiting: p.max_waiting.unwrap_or(u64::MAX),
                });
            }
            grants.max_watches = p.max_watches;
            grants.lock = lock.into_iter().collect();
            grants.read = read.into_iter().collect();
            let tokens: std::collections::BTreeSet<&String> = p.tokens_sha256.iter().collect();
            for t in tokens {
                let hash = hex32(t).ok_or_else(|| {
                    format!("principal {name:?}: token hash {t:?} is not 64 hex digits (sha256)")
                })?;
                if let Some(other) = policy.tokens.insert(hash, name.clone()) {
                    return Err(format!(
                        "the same token is listed for principals {other:?} and {name:?}"
                    ));
                }
            }
            policy.principals.insert(name.clone(), grants);
        }
        Ok(policy)
    }

    pub fn grants(&self, principal: &str) -> Option<&Grants> {
        self.principals.get(principal)
    }

    /// The caller's principal: a listed token, else the TLS client certificate, else anonymous.
    pub fn principal<T>(&self, r: &Request<T>) -> Result<String, Status> {
        self.principal_of(&Caller::of(r))
    }

    /// [`Policy::principal`] of a caller kept from its request ([`Caller`]).
    pub fn principal_of(&self, caller: &Caller) -> Result<String, Status> {
        match &caller.token {
            Some(Err(())) => Err(denied(
                "the authorization header is not `Bearer TOKEN`".to_string(),
            )),
            Some(Ok(hash)) => self
                .tokens
                .get(hash)
                .cloned()
                .ok_or_else(|| denied("the bearer token is not in the policy".to_string())),
            None => Ok(caller
                .cert
                .as_deref()
                .and_then(holdfast_proto::tls::CertNames::principal)
                .unwrap_or(ANONYMOUS)
                .to_string()),
        }
    }

    /// Whether `principal` may do what `need` says; the refusal names the principal, the permission and
    /// the name or prefix.
    pub fn check(&self, principal: &str, need: Need<'_>) -> Result<(), Status> {
        let grants = self.principals.get(principal);
        if grants.is_some_and(|g| g.allows(need)) {
            return Ok(());
        }
        // Names reach here before they are validated: show at most a lock name's worth.
        let short = |n: &str| -> String {
            let mut end = n.len().min(holdfast_lock_table::limits::MAX_NAME_BYTES);
            while !n.is_char_boundary(end) {
                end -= 1;
            }
            n[..end].to_string()
        };
        let (perm, on) = match need {
            Need::Lock(name) => (
                Permission::Lock.to_string(),
                format!(" on {:?}", short(name)),
            ),
            Need::LockAny | Need::Cancel(_) | Need::Release(_) => {
                (Permission::Lock.to_string(), " on any prefix".to_string())
            }
            Need::Read(prefix) => (
                Permission::Read.to_string(),
                format!(" on {:?}", short(prefix)),
            ),
            Need::Admin => (Permission::Admin.to_string(), String::new()),
            Need::Any => ("any permission".to_string(), String::new()),
        };
        let why = if grants.is_none() {
            "it is not in the policy".to_string()
        } else {
            "no role of it grants that".to_string()
        };
        Err(denied(format!(
            "principal {principal:?} lacks {perm}{on}: {why}"
        )))
    }
}

fn denied(message: String) -> Status {
    crate::errors::status(
        tonic::Code::PermissionDenied,
        holdfast_proto::v1::Reason::AccessDenied,
        message,
        holdfast_proto::v1::ErrorDetail::default(),
    )
}

/// Who made a request, kept apart from it (a keepalive stream checks every message against the policy
/// of the moment, long after the request that opened it).
#[derive(Clone, Debug)]
pub struct Caller {
    /// The bearer token's SHA-256, or Err if the authorization header was malformed.
    token: Option<Result<[u8; 32], ()>>,
    cert: Option<Arc<holdfast_proto::tls::CertNames>>,
}

impl Caller {
    pub fn of<T>(r: &Request<T>) -> Caller {
        let token = r.metadata().get("authorization").map(|v| {
            let v = v.to_str().map_err(|_| ())?;
            // The scheme is case-insensitive (RFC 7235).
            match v.split_once(' ') {
                Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => {
                    Ok(token_hash(token.trim()))
                }
                _ => Err(()),
            }
        });
        let cert = r
            .extensions()
            .get::<holdfast_proto::tls::TlsConnectInfo>()
            .and_then(|i| i.cert.clone());
        Caller { token, cert }
    }

    /// A caller presenting a server certificate of the cluster (and no token).
    fn server(&self) -> bool {
        self.token.is_none()
            && self
                .cert
                .as_deref()
                .and_then(crate::tls::server_id)
                .is_some()
    }
}

/// The policy file and the policy loaded from it, swapped when the file changes.
pub struct Access {
    path: PathBuf,
    current: RwLock<Arc<Policy>>,
    loaded: Mutex<Vec<u8>>,
    failed: Mutex<Option<(Vec<u8>, String)>>,
    pub reloads: AtomicU64,
    pub reload_failures: AtomicU64,
    pub denied: AtomicU64,
}

fn read(path: &std::path::Path) -> Result<Vec<u8>, String> {
    crate::tls::read_capped(path, MAX_POLICY_BYTES)
}

fn parse(path: &std::path::Path, bytes: &[u8]) -> Result<Policy, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| format!("{}: not UTF-8", path.display()))?;
    Policy::parse(text).map_err(|e| format!("{}: {e}", path.display()))
}

impl Access {
    /// Loads the policy file; an error names the file and the problem (the server does not start).
    pub fn load(path: &std::path::Path) -> Result<Access, String> {
        let bytes = read(path)?;
        let policy = parse(path, &bytes)?;
        Ok(Access {
            path: path.to_path_buf(),
            current: RwLock::new(Arc::new(policy)),
            loaded: Mutex::new(bytes),
            failed: Mutex::new(None),
            reloads: AtomicU64::new(0),
            reload_failures: AtomicU64::new(0),
            denied: AtomicU64::new(0),
        })
    }

    pub fn policy(&self) -> Arc<Policy> {
        self.current.read().expect("policy lock").clone()
    }

    /// Checks `r` against the current policy, counting refusals.
    pub fn check<T>(&self, r: &Request<T>, need: Need<'_>) -> Result<(), Status> {
        self.check_caller(&Caller::of(r), need)
    }

    /// [`Access::check`] for a caller kept from its request. A caller with a server certificate of the
    /// cluster passes the two calls servers make to each other's client ports: `CancelAcquire`
    /// (forwarding an abandoned acquire) and `Status` without the digest (readiness); nothing else.
    pub fn check_caller(&self, caller: &Caller, need: Need<'_>) -> Result<(), Status> {
        if caller.server() && matches!(need, Need::Cancel(_) | Need::Any) {
            return Ok(());
        }
        let policy = self.policy();
        let result = policy
            .principal_of(caller)
            .and_then(|principal| policy.check(&principal, need));
        if result.is_err() {
            self.denied.fetch_add(1, Relaxed);
        }
        result
    }

    /// The principal and quota a session-opening or acquiring request is held to (the request passed
    /// [`Access::check`] already). Every such request is wrapped while a policy is loaded, unlimited
    /// for a principal without quotas, so that every session opened under a policy has an owner and
    /// counts, whatever quotas are added later.
    pub fn quota<T>(&self, r: &Request<T>) -> Option<(String, holdfast_lock_table::QuotaLimits)> {
        let policy = self.policy();
        let principal = policy.principal(r).ok()?;
        let quota = policy.grants(&principal).and_then(|g| g.quota).unwrap_or(
            holdfast_lock_table::QuotaLimits {
                sessions: u64::MAX,
                locks: u64::MAX,
                waiting: u64::MAX,
            },
        );
        Some((principal, quota))
    }

    /// The principal a watch counts against, and its `max_watches` (None: unlimited).
    pub fn watch_quota<T>(&self, r: &Request<T>) -> Option<(String, Option<u64>)> {
        let policy = self.policy();
        let principal = policy.principal(r).ok()?;
        let max = policy.grants(&principal).and_then(|g| g.max_watches);
        Some((principal, max))
    }

    /// Reloads the file if it changed. Ok(true): the new policy is in use.
    pub fn reload_if_changed(&self) -> Result<bool, String> {
        let bytes = read(&self.path)?;
        if bytes == *self.loaded.lock().expect("policy lock") {
            return Ok(false);
        }
        if let Some((failed, why)) = &*self.failed.lock().expect("policy lock") {
            // Parsing depends on nothing but the bytes: the same ones fail the same way.
            if *failed == bytes {
                return Err(why.clone());
            }
        }
        match parse(&self.path, &bytes) {
            Ok(policy) => {
                *self.current.write().expect("policy lock") = Arc::new(policy);
                *self.loaded.lock().expect("policy lock") = bytes;
                self.reloads.fetch_add(1, Relaxed);
                Ok(true)
            }
            Err(e) => {
                self.reload_failures.fetch_add(1, Relaxed);
                *self.failed.lock().expect("policy lock") = Some((bytes, e.clone()));
                Err(e)
            }
        }
    }

    /// Checks the file every second and on SIGHUP until `shutdown`.
    pub async fn watch(self: Arc<Self>, shutdown: tokio::sync::watch::Receiver<bool>) {
        crate::tls::watch_files("policy", shutdown, move || self.reload_if_changed()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: &str = r#"
[roles.locker]
lock = ["a/"]
read = ["a/"]
[roles.reader]
read = [""]
[roles.operator]
admin = true

[principals.alice]
roles = ["locker"]
[principals.ops]
roles = ["reader", "operator"]
tokens_sha256 = ["9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]
"#;

    #[test]
    fn grants_follow_roles_and_prefixes() {
        let p = Policy::parse(POLICY).unwrap();
        assert!(p.check("alice", Need::Lock("a/x")).is_ok());
        assert!(p.check("alice", Need::LockAny).is_ok());
        let e = p.check("alice", Need::Lock("b/x")).unwrap_err();
        assert!(
            e.message().contains("\"alice\" lacks lock on \"b/x\""),
            "{}",
            e.message()
        );
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(p.check("alice", Need::Read("a/")).is_ok());
        assert!(
            p.check("alice", Need::Read("")).is_err(),
            "read on a/ is not read on everything"
        );
        assert!(p.check("alice", Need::Admin).is_err());
        assert!(p.check("ops", Need::Read("b/x")).is_ok());
        assert!(p.check("ops", Need::Admin).is_ok());
        assert!(p.check("ops", Need::LockAny).is_err());
        // Giving up needs lock on some prefix: alice may take back a wait or release a lock on b/x
        // (where her lock was revoked, say); the session's secret is checked after. A reader may not.
        assert!(p.check("alice", Need::Cancel("b/x")).is_ok());
        assert!(p.check("alice", Need::Release("b/x")).is_ok());
        let e = p.check("ops", Need::Release("a/x")).unwrap_err();
        assert!(
            e.message().contains("lacks lock on any prefix"),
            "{}",
            e.message()
        );
        assert!(p.check("ops", Need::Cancel("a/x")).is_err());
        assert!(p.check("mallory", Need::Cancel("a/x")).is_err());
        let e = p.check("mallory", Need::Any).unwrap_err();
        assert!(e.message().contains("not in the policy"), "{}", e.message());
        assert!(p.check(ANONYMOUS, Need::Any).is_err());
        // sha256("test")
        assert_eq!(
            p.tokens.get(&token_hash("test")).map(String::as_str),
            Some("ops")
        );
    }

    /// Another server (a server certificate, no token) passes only what servers send each other.
    #[test]
    fn servers_pass_only_cancel_and_status() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.toml");
        std::fs::write(&path, POLICY).unwrap();
        let access = Access::load(&path).unwrap();
        let server = |cn: &str, server_auth: bool| {
            let mut r = Request::new(());
            r.extensions_mut()
                .insert(holdfast_proto::tls::TlsConnectInfo {
                    remote_addr: None,
                    cert: Some(Arc::new(holdfast_proto::tls::CertNames {
                        common_name: Some(cn.into()),
                        server_auth,
                        ..Default::default()
                    })),
                });
            Caller::of(&r)
        };
        let s2 = server("holdfast-server-2", true);
        assert!(access.check_caller(&s2, Need::Cancel("b/x")).is_ok());
        assert!(access.check_caller(&s2, Need::Any).is_ok());
        for need in [
            Need::Admin,
            Need::Lock("b/x"),
            Need::Release("b/x"),
            Need::Read(""),
            Need::LockAny,
        ] {
            assert!(access.check_caller(&s2, need).is_err(), "{need:?}");
        }
        // A client certificate with a server's name but without serverAuth is just a principal.
        let fake = server("holdfast-server-2", false);
        assert!(access.check_caller(&fake, Need::Cancel("b/x")).is_err());
        assert_eq!(access.denied.load(Relaxed), 6);
    }

    #[test]
    fn bad_policies_are_refused_with_the_reason() {
        let unknown_role = "[principals.a]\nroles = [\"nope\"]\n";
        assert!(Policy::parse(unknown_role)
            .unwrap_err()
            .contains("\"nope\" is not defined"));
        let bad_hash = "[principals.a]\ntokens_sha256 = [\"xyz\"]\n";
        assert!(Policy::parse(bad_hash)
            .unwrap_err()
            .contains("64 hex digits"));
        let typo = "[roles.r]\nlocks = [\"a/\"]\n";
        assert!(Policy::parse(typo).unwrap_err().contains("unknown field"));
        let h = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
        let shared = format!(
            "[principals.a]\ntokens_sha256 = [\"{h}\"]\n[principals.b]\ntokens_sha256 = [\"{h}\"]\n"
        );
        assert!(Policy::parse(&shared).unwrap_err().contains("same token"));
        let plus = "+f".repeat(32);
        let signed = format!("[principals.a]\ntokens_sha256 = [\"{plus}\"]\n");
        assert!(Policy::parse(&signed)
            .unwrap_err()
            .contains("64 hex digits"));
        let twice = format!("[principals.a]\ntokens_sha256 = [\"{h}\", \"{h}\"]\n");
        assert!(
            Policy::parse(&twice).is_ok(),
            "the same token twice for one principal is one token"
        );
    }

    #[test]
    fn the_principal_is_the_token_else_the_certificate_else_anonymous() {
        let p = Policy::parse(POLICY).unwrap();
        let mut r = Request::new(());
        assert_eq!(p.principal(&r).unwrap(), ANONYMOUS);
        r.extensions_mut()
            .insert(holdfast_proto::tls::TlsConnectInfo {
                remote_addr: None,
                cert: Some(Arc::new(holdfast_proto::tls::CertNames {
                    common_name: Some("alice".into()),
                    ..Default::default()
                })),
            });
        assert_eq!(p.principal(&r).unwrap(), "alice");
        r.metadata_mut()
            .insert("authorization", "Bearer test".parse().unwrap());
        assert_eq!(p.principal(&r).unwrap(), "ops");
        r.metadata_mut()
            .insert("authorization", "Bearer wrong".parse().unwrap());
        assert!(
            p.principal(&r).is_err(),
            "an unknown token is refused, not anonymous"
        );
    }
}
