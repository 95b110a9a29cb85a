//! Endpoints, leader following and retries.
//!
//! Each write goes to the server believed to lead the lock's group. A `NOT_LEADER` answer names the leader
//! and the request is sent there at once; an unreachable server, an election in progress or an unknown
//! outcome make the client try the next server after a backoff (20 ms doubling to 200 ms, each pause
//! jittered between half and all of that), until the request's deadline. Every attempt has its own
//! timeout, so a silent (partitioned or paused) server costs at most one attempt.

use crate::error::{classify, refused_for_now, Disposition, Error};
use holdfast_proto::v1 as pb;
use holdfast_proto::v1::holdfast_client::HoldfastClient;
use std::future::Future;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

#[derive(Clone)]
pub struct ClientOptions {
    /// Longest a call may take, all retries included (a waiting acquire adds its wait to this).
    pub request_timeout: Duration,
    /// Longest one attempt against one server may take.
    pub attempt_timeout: Duration,
    /// TCP connect timeout per server.
    pub connect_timeout: Duration,
    /// Renew all of this client's sessions together, one message per group per round over a keepalive
    /// stream (the default). `false` makes every session send its own unary keepalives, which is what a
    /// benchmark of one-heartbeat-per-session load wants.
    pub batched_keepalives: bool,
    /// Fixes the stream of session-open nonces (deterministic tests and the simulation). None, the
    /// default: random per process. Two clients with the same seed would collide, so never share one.
    /// Tests only: a retried open with a session's nonce returns its secret, so anyone who can compute
    /// the nonces can act on the sessions.
    pub nonce_seed: Option<u64>,
    /// Learn every member's advertised client endpoint from the first server that answers, and follow a
    /// `NOT_LEADER` redirect to a leader outside the endpoints given (the default): a partial endpoint
    /// list is enough. `false` uses only the endpoints given, for a client that reaches the servers
    /// through addresses other than the ones they advertise (a proxy, NAT, a port forward).
    pub discover: bool,
    /// This client cancels the acquires its callers give up (a dropped future, an unknown outcome) by
    /// itself, always. `true` (the default) also tells the server so (`AcquireRequest.client_cancels`),
    /// so that an attempt that timed out or lost its connection keeps its place in the queue when
    /// retried. `false` lets the server abandon every call of this client that goes away as well (a
    /// retry after a broken connection may then find its acquire abandoned and fail with
    /// `Error::Abandoned`); the simulation uses it on some hosts so both paths run under faults.
    pub client_cancels: bool,
    /// Send acquires and releases as messages on one `Calls` stream per server (the default), instead
    /// of a unary call each: less HTTP/2 work per call on both sides (docs/performance.md, "One stream
    /// for calls"). Both mean the same; a server without the stream gets unary calls anyway. `false`
    /// is for comparing the two.
    pub call_streams: bool,
    /// Carry the `Calls` stream on a connection of its own to each server (the default), instead of
    /// a gRPC stream on the client's channel: fewer task hand-offs per call on both sides
    /// (docs/performance.md, "Calls on connections of their own"). Both mean the same; a server
    /// that does not take such connections gets the gRPC stream anyway. `false` is for comparing the
    /// two. Only with [`ClientOptions::call_streams`].
    pub call_connections: bool,
    /// Connect over TLS (see [`crate::ClientTls`]). None, the default: plaintext.
    pub tls: Option<crate::ClientTls>,
    /// A bearer token sent with every request (`authorization: Bearer TOKEN`): the principal the
    /// server's access policy knows it by (docs/security.md). Send it over TLS only.
    pub token: Option<String>,
}

/// Every field but the token, which must not reach a log.
impl std::fmt::Debug for ClientOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientOptions")
            .field("request_timeout", &self.request_timeout)
            .field("attempt_timeout", &self.attempt_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("batched_keepalives", &self.batched_keepalives)
            .field("nonce_seed", &self.nonce_seed.map(|_| "<set>"))
            .field("discover", &self.discover)
            .field("client_cancels", &self.client_cancels)
            .field("call_streams", &self.call_streams)
            .field("call_connections", &self.call_connections)
            .field("tls", &self.tls)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            request_timeout: Duration::from_secs(15),
            attempt_timeout: Duration::from_secs(3),
            connect_timeout: Duration::from_millis(500),
            batched_keepalives: true,
            nonce_seed: None,
            discover: true,
            client_cancels: true,
            call_streams: true,
            call_connections: true,
            tls: None,
            token: None,
        }
    }
}

/// A connection to a Holdfast cluster. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) registry: crate::keepalive::Registry,
    /// The servers this client knows: the endpoints it was given, then every member a server reported
    /// and every leader a redirect named. Only grows (at most [`MAX_SERVERS`]), so indexes stay valid.
    servers: RwLock<Vec<Server>>,
    groups: u32,
    /// The server index believed to lead each group.
    leaders: Mutex<Vec<usize>>,
    options: ClientOptions,
    auth: Auth,
    /// Opens so far, for [`ClientOptions::nonce_seed`].
    pub(crate) opens: std::sync::atomic::AtomicU64,
    /// The state of the retry jitter's generator ([`jittered`]).
    jitter: std::sync::atomic::AtomicU64,
}

/// `backoff` with "equal jitter": between half of it and all of it, drawn from a splitmix64 stream
/// whose state is `state`. Clients that failed over together (a leader died under all of them) then
/// come back spread out instead of all at once.
fn jittered(state: &std::sync::atomic::AtomicU64, backoff: Duration) -> Duration {
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut z = state
        .fetch_add(GAMMA, std::sync::atomic::Ordering::Relaxed)
        .wrapping_add(GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let half = backoff / 2;
    let spread = (backoff - half).as_nanos() as u64;
    half + Duration::from_nanos(z % (spread + 1))
}

/// Where a client's retry jitter starts: from its nonce seed when it has one (so the simulation stays
/// reproducible), else from the OS random number generator.
fn jitter_seed(options: &ClientOptions) -> u64 {
    if let Some(seed) = options.nonce_seed {
        return seed ^ 0x6a69_7474_6572_2121;
    }
    let mut bytes = [0u8; 8];
    if getrandom::getrandom(&mut bytes).is_ok() {
        return u64::from_le_bytes(bytes);
    }
    // Should the OS generator fail: std's per-process random keys over the address of a local.
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_usize(&bytes as *const _ as usize);
    h.finish()
}

/// Adds the bearer token, if any, to every request.
#[derive(Clone)]
pub(crate) struct Auth(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl Auth {
    pub(crate) fn new(token: Option<&str>) -> Result<Auth, Error> {
        match token {
            None => Ok(Auth(None)),
            Some(t) => format!("Bearer {t}")
                .parse()
                .map(|v| Auth(Some(v)))
                .map_err(|_| {
                    Error::InvalidArgument("the token has characters a header cannot carry".into())
                }),
        }
    }
}

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut r: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            r.metadata_mut().insert("authorization", v.clone());
        }
        Ok(r)
    }
}

/// Where one attempt of an acquire or release goes: the server's `Calls` stream, or a unary call when
/// the client does not use the stream or the server does not serve it ([`crate::calls`]).
pub(crate) struct Via {
    pub(crate) rpc: Rpc,
    calls: Arc<crate::calls::Calls>,
}

impl Via {
    pub(crate) async fn acquire(
        self,
        req: pb::AcquireRequest,
    ) -> Result<tonic::Response<pb::AcquireResponse>, tonic::Status> {
        self.calls.acquire(self.rpc, req).await
    }

    pub(crate) async fn release(
        self,
        req: pb::ReleaseRequest,
    ) -> Result<tonic::Response<pb::ReleaseResponse>, tonic::Status> {
        self.calls.release(self.rpc, req).await
    }
}

/// A gRPC client on one server's channel, with this client's credentials.
pub(crate) type Rpc = HoldfastClient<tonic::codegen::InterceptedService<Channel, Auth>>;

struct Server {
    endpoint: String,
    channel: Channel,
    /// Acquires and releases to this server go on one stream ([`crate::calls`]).
    calls: Arc<crate::calls::Calls>,
    /// When a call to it last failed without an answer from it (unreachable, reset, timed out): a
    /// redirect to it soon after is not followed (see [`Client::redirect_target`]).
    failed: Mutex<Option<Instant>>,
    /// `failed` is set: every answered call checks this, and takes the lock only when it is.
    marked: std::sync::atomic::AtomicBool,
}

impl Server {
    fn new(endpoint: &str, channel: Channel, options: &ClientOptions) -> Server {
        Server {
            endpoint: endpoint.to_string(),
            channel,
            calls: Arc::new(crate::calls::Calls::new(
                options.call_streams,
                options.call_connections.then(|| {
                    crate::calls::RawTarget::new(
                        endpoint,
                        options.tls.as_ref().map(|t| t.connector.clone()),
                        options.token.as_ref().map(|t| format!("Bearer {t}")),
                        options.connect_timeout,
                    )
                }),
            )),
            failed: Mutex::new(None),
            marked: false.into(),
        }
    }
}

/// True if a Holdfast server sent this error: every error it sends carries an `ErrorDetail`. Anything
/// else is the transport's (refused, reset, unreachable) or a proxy's.
pub(crate) fn answered_by_a_server(status: &tonic::Status) -> bool {
    !status.details().is_empty()
}

/// How long after a server failed a call a redirect to it is not followed. A server that left a group
/// still names the last leader it heard of, which may be dead: a client that followed it would go
/// dead server, stale server, dead server, and never reach the others (found by the placement test,
/// whose clients lost their sessions that way). It only needs to outlast one pass over the servers.
const REDIRECT_DISTRUST: Duration = Duration::from_secs(2);

/// Most servers one client keeps channels to: members and redirect targets beyond this are not added
/// (a cluster has 3 or 5; a misconfigured one could name endless addresses).
const MAX_SERVERS: usize = 64;

/// Checks that `endpoint` is `host:port`, the form every Holdfast endpoint takes, so that a typo is an
/// error at once instead of 15 seconds of retries.
pub fn check_endpoint(endpoint: &str) -> Result<(), Error> {
    let bad = |why: &str| {
        Err(Error::InvalidArgument(format!(
            "endpoint {endpoint:?} {why}"
        )))
    };
    if endpoint.contains("://") {
        return bad("has a scheme: give host:port, such as 127.0.0.1:7001");
    }
    let Some((host, port)) = endpoint.rsplit_once(':') else {
        return bad("is not host:port (such as 127.0.0.1:7001)");
    };
    if host.is_empty() || host.contains(char::is_whitespace) || host.contains('/') {
        return bad("has no valid host: give host:port, such as 127.0.0.1:7001");
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => bad("has no valid port (1..=65535)"),
    }
}

fn channel_to(endpoint: &str, options: &ClientOptions) -> Result<Channel, Error> {
    check_endpoint(endpoint)?;
    let e = Endpoint::from_shared(format!("http://{endpoint}"))
        .map_err(|e| Error::InvalidArgument(format!("bad endpoint {endpoint:?}: {e}")))?;
    // Pings detect a dead connection (half-open after a network fault) in ~4 s; it is closed and the
    // next call reconnects.
    let e = e
        .connect_timeout(options.connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(2))
        .keep_alive_timeout(Duration::from_secs(2))
        .keep_alive_while_idle(true);
    Ok(holdfast_proto::transport::connect_lazy_tls(
        e,
        options.tls.as_ref().map(|t| &t.connector),
    ))
}

/// How much longer than a normal request a membership change may take (a learner catching up).
const MEMBER_CHANGE_EXTRA: Duration = Duration::from_secs(120);

/// A failed call in words an operator can act on: the causes behind tonic's message, and what a
/// wrong kind of port looks like.
pub fn describe_status(status: &tonic::Status) -> String {
    if status.code() == tonic::Code::Unimplemented {
        return "not a Holdfast client port (it does not serve holdfast.v1.Holdfast: a peer or HTTP port?)"
            .into();
    }
    let text = holdfast_proto::status_with_causes(status);
    if text.contains("frame with invalid size") {
        // A TLS server answers a plaintext HTTP/2 preface with a TLS alert, which h2 reads as a frame.
        return format!("not a plaintext gRPC server: a TLS port? (give the cluster CA: --ca or HOLDFAST_CA; the HTTP/2 handshake failed: {text})");
    }
    if text.contains("http2 error") {
        return format!("not a gRPC server (the HTTP/2 handshake failed: {text})");
    }
    if text.contains("InvalidContentType") || text.contains("corrupt message") {
        return format!("not a TLS server: a plaintext port? (drop --ca / HOLDFAST_CA; {text})");
    }
    text
}

/// The index of `endpoint` in `servers`, adding it if it is new; `None` if malformed or the list is full.
fn index_or_add(
    servers: &mut Vec<Server>,
    endpoint: &str,
    options: &ClientOptions,
) -> Option<usize> {
    if let Some(i) = servers.iter().position(|s| s.endpoint == endpoint) {
        return Some(i);
    }
    if servers.len() >= MAX_SERVERS {
        return None;
    }
    let channel = channel_to(endpoint, options).ok()?;
    servers.push(Server::new(endpoint, channel, options));
    Some(servers.len() - 1)
}

impl Client {
    /// Connects to a cluster given some of its servers' client endpoints (`host:port`). One reachable
    /// server is enough: the client learns the others from it.
    pub async fn connect<I, S>(endpoints: I) -> Result<Client, Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Client::connect_with(endpoints, ClientOptions::default()).await
    }

    pub async fn connect_with<I, S>(endpoints: I, options: ClientOptions) -> Result<Client, Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let endpoints: Vec<String> = endpoints.into_iter().map(Into::into).collect();
        if endpoints.is_empty() {
            return Err(Error::InvalidArgument("no endpoints given".into()));
        }
        let servers = endpoints
            .iter()
            .map(|ep| Ok(Server::new(ep, channel_to(ep, &options)?, &options)))
            .collect::<Result<Vec<_>, Error>>()?;
        let auth = Auth::new(options.token.as_deref())?;
        let mut inner = Inner {
            auth: auth.clone(),
            registry: Default::default(),
            servers: RwLock::new(servers),
            groups: 1,
            leaders: Mutex::new(vec![0]),
            options: options.clone(),
            opens: Default::default(),
            jitter: jitter_seed(&options).into(),
        };
        // Learn the group count, the members and a first leader hint from any server that answers.
        let deadline = Instant::now() + options.request_timeout;
        let mut errors: Vec<String> = vec![String::new(); endpoints.len()];
        'outer: loop {
            let mut not_holdfast = 0;
            let mut denied = 0;
            for (i, ep) in endpoints.iter().enumerate() {
                let channel = inner.servers.read().expect("servers lock")[i]
                    .channel
                    .clone();
                let mut c = HoldfastClient::with_interceptor(channel, auth.clone());
                match tokio::time::timeout(
                    options.attempt_timeout,
                    c.status(pb::StatusRequest::default()),
                )
                .await
                {
                    Ok(Ok(s)) => {
                        let s = s.into_inner();
                        inner.groups = s.group_count.max(1);
                        let servers = inner.servers.get_mut().expect("servers lock");
                        if options.discover {
                            for m in &s.members {
                                index_or_add(servers, &m.client_endpoint, &options);
                            }
                        }
                        let leaders = (0..inner.groups)
                            .map(|g| {
                                s.groups
                                    .iter()
                                    .find(|gs| gs.group == g)
                                    .and_then(|gs| {
                                        servers
                                            .iter()
                                            .position(|s| s.endpoint == gs.leader_endpoint)
                                    })
                                    .unwrap_or(i)
                            })
                            .collect();
                        inner.leaders = Mutex::new(leaders);
                        break 'outer;
                    }
                    // The access policy refuses this client. Policies are per server (one may be
                    // stale during a change), so only every server refusing ends the wait.
                    Ok(Err(status)) if status.code() == tonic::Code::PermissionDenied => {
                        denied += 1;
                        errors[i] = format!("{ep}: {}", status.message());
                    }
                    Ok(Err(status)) => {
                        not_holdfast += usize::from(status.code() == tonic::Code::Unimplemented);
                        errors[i] = format!("{ep}: {}", describe_status(&status));
                    }
                    Err(_) => {
                        errors[i] = format!(
                            "{ep}: no answer within {:?} (paused, or not a gRPC server?)",
                            options.attempt_timeout
                        )
                    }
                }
            }
            if denied == endpoints.len() {
                return Err(Error::PermissionDenied(errors.join("; ")));
            }
            // Every endpoint answered that it is not a Holdfast client port: waiting will not help.
            if not_holdfast == endpoints.len() || Instant::now() > deadline {
                return Err(Error::Unavailable(format!(
                    "no server answered: {}",
                    errors.join("; ")
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(Client {
            inner: Arc::new(inner),
        })
    }

    /// The index of `endpoint`, adding it if it is new (a member or leader a server told us about).
    /// `None` if it is malformed or the list is full.
    pub(crate) fn server_index(&self, endpoint: &str) -> Option<usize> {
        let known = self
            .inner
            .servers
            .read()
            .expect("servers lock")
            .iter()
            .position(|s| s.endpoint == endpoint);
        known.or_else(|| {
            if !self.inner.options.discover {
                return None;
            }
            let mut servers = self.inner.servers.write().expect("servers lock");
            index_or_add(&mut servers, endpoint, &self.inner.options)
        })
    }

    /// The server a redirect to `endpoint` should go to: its index, unless a call to it failed within
    /// [`REDIRECT_DISTRUST`] (then the caller moves on to the next server instead).
    pub(crate) fn redirect_target(&self, endpoint: &str) -> Option<usize> {
        let i = self.server_index(endpoint)?;
        let servers = self.inner.servers.read().expect("servers lock");
        let failed = *servers[i].failed.lock().expect("server failure lock");
        match failed {
            Some(t) if t.elapsed() < REDIRECT_DISTRUST => None,
            _ => Some(i),
        }
    }

    /// Notes that server `index` could not be reached or did not answer (see
    /// [`Client::redirect_target`]). Not for an answer such as `NOT_LEADER` without a leader: that
    /// server is up, and may be the next leader a moment later.
    pub(crate) fn mark_failed(&self, index: usize) {
        if let Some(s) = self.inner.servers.read().expect("servers lock").get(index) {
            tracing::debug!(endpoint = %s.endpoint, "no answer: redirects to it not followed for 2 s");
            *s.failed.lock().expect("server failure lock") = Some(Instant::now());
            s.marked.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Notes that server `index` answered (anything a server sends, an error included): a failure
    /// marked before no longer holds. A restarted server (killed earlier, so marked) may be the leader
    /// its peers redirect to a moment later.
    pub(crate) fn mark_answered(&self, index: usize) {
        if let Some(s) = self.inner.servers.read().expect("servers lock").get(index) {
            if s.marked.swap(false, std::sync::atomic::Ordering::Relaxed) {
                *s.failed.lock().expect("server failure lock") = None;
            }
        }
    }

    pub(crate) fn server_count(&self) -> usize {
        self.inner.servers.read().expect("servers lock").len()
    }

    fn endpoint(&self, index: usize) -> String {
        self.inner.servers.read().expect("servers lock")[index]
            .endpoint
            .clone()
    }

    /// Number of Raft groups lock names are spread over.
    pub fn groups(&self) -> u32 {
        self.inner.groups
    }

    /// Every server this client knows: the endpoints it was given, then the members and leaders the
    /// cluster told it about.
    pub fn endpoints(&self) -> Vec<String> {
        self.inner
            .servers
            .read()
            .expect("servers lock")
            .iter()
            .map(|s| s.endpoint.clone())
            .collect()
    }

    pub fn options(&self) -> &ClientOptions {
        &self.inner.options
    }

    /// Runs `f` against the group's leader, following redirects and retrying until the deadline.
    /// `extra` extends both the per-attempt and the overall timeout (for waiting acquires).
    pub(crate) async fn call<T, F, Fut>(
        &self,
        group: u32,
        extra: Duration,
        f: F,
    ) -> Result<T, Error>
    where
        F: Fn(Rpc) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        self.call_via(group, extra, |via| f(via.rpc)).await
    }

    /// [`Client::call`] with an explicit overall deadline.
    pub(crate) async fn call_until<T, F, Fut>(
        &self,
        group: u32,
        deadline: Instant,
        extra: Duration,
        f: F,
    ) -> Result<T, Error>
    where
        F: Fn(Rpc) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        self.call_via_until(group, deadline, extra, |via| f(via.rpc))
            .await
    }

    /// [`Client::call`] for acquires and releases, which may go on the server's `Calls` stream
    /// ([`Via`]).
    pub(crate) async fn call_via<T, F, Fut>(
        &self,
        group: u32,
        extra: Duration,
        f: F,
    ) -> Result<T, Error>
    where
        F: Fn(Via) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let deadline = Instant::now() + self.inner.options.request_timeout + extra;
        self.call_via_until(group, deadline, extra, f).await
    }

    async fn call_via_until<T, F, Fut>(
        &self,
        group: u32,
        deadline: Instant,
        extra: Duration,
        f: F,
    ) -> Result<T, Error>
    where
        F: Fn(Via) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let inner = &self.inner;
        let mut target = self.leader_of(group);
        let mut backoff = Duration::from_millis(20);
        let mut redirects = 0;
        // Why an earlier attempt's outcome is unknown (it timed out, or failed in a way that may have
        // come after the server took it): a later refusal that can change between attempts is then no
        // proof that nothing was applied (`refused_for_now`).
        let mut unknown: Option<String> = None;
        loop {
            let via = Via {
                rpc: self.rpc(target),
                calls: self.calls(target),
            };
            let limit = (inner.options.attempt_timeout + extra)
                .min(deadline.saturating_duration_since(Instant::now()));
            let attempt = tokio::time::timeout(limit, f(via)).await;
            if let Ok(Err(status)) = &attempt {
                if answered_by_a_server(status) {
                    self.mark_answered(target);
                }
            }
            let reason = match attempt {
                Ok(Ok(resp)) => {
                    self.mark_answered(target);
                    self.set_leader(group, target);
                    return Ok(resp.into_inner());
                }
                Ok(Err(status)) => match classify(&status) {
                    Disposition::Fail(e) => {
                        return Err(match unknown {
                            Some(earlier) if refused_for_now(&status) => Error::Unavailable(
                                format!(
                                    "a retry was refused ({e}), but an earlier attempt may have \
                                     been applied ({earlier})"
                                ),
                            ),
                            _ => e,
                        })
                    }
                    // The leader's advertised endpoint, followed even if it was not among the ones this
                    // client was given.
                    Disposition::Redirect(ep) => match self.redirect_target(&ep) {
                        Some(i) if redirects < 2 * self.server_count() => {
                            redirects += 1;
                            target = i;
                            self.set_leader(group, i);
                            continue;
                        }
                        Some(_) => format!("redirected too often (last to {ep})"),
                        None if self.server_index(&ep).is_some() => {
                            format!("redirected to {ep}, which failed a moment ago")
                        }
                        None if !inner.options.discover => format!(
                            "redirected to {ep}, which is not among the endpoints (discovery is off)"
                        ),
                        None => format!("redirected to {ep:?}, which is not a usable endpoint"),
                    },
                    Disposition::Retry(msg) => {
                        if !answered_by_a_server(&status) {
                            self.mark_failed(target);
                        }
                        let reason = format!("{}: {msg}", self.endpoint(target));
                        unknown = Some(reason.clone());
                        reason
                    }
                },
                Err(_) => {
                    self.mark_failed(target);
                    let reason = format!("{} did not answer within {limit:?}", self.endpoint(target));
                    unknown = Some(reason.clone());
                    reason
                }
            };
            let pause = jittered(&inner.jitter, backoff);
            if Instant::now() + pause > deadline {
                return Err(Error::Unavailable(reason));
            }
            tracing::debug!(%reason, "retrying on another server");
            tokio::time::sleep(pause).await;
            backoff = (backoff * 2).min(Duration::from_millis(200));
            target = (target + 1) % self.server_count();
            redirects = 0;
        }
    }

    pub(crate) fn from_inner(inner: Arc<Inner>) -> Client {
        Client { inner }
    }

    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }

    /// A gRPC client to server `index` that sends this client's credentials.
    pub(crate) fn rpc(&self, index: usize) -> Rpc {
        HoldfastClient::with_interceptor(self.channel(index), self.inner.auth.clone())
    }

    pub(crate) fn calls(&self, index: usize) -> Arc<crate::calls::Calls> {
        self.inner.servers.read().expect("servers lock")[index]
            .calls
            .clone()
    }

    pub(crate) fn channel(&self, index: usize) -> Channel {
        self.inner.servers.read().expect("servers lock")[index]
            .channel
            .clone()
    }

    /// The endpoint index believed to lead `group`.
    pub(crate) fn leader_of(&self, group: u32) -> usize {
        self.inner
            .leaders
            .lock()
            .expect("leader lock")
            .get(group as usize)
            .copied()
            .unwrap_or(0)
    }

    pub(crate) fn set_leader(&self, group: u32, index: usize) {
        if let Some(slot) = self
            .inner
            .leaders
            .lock()
            .expect("leader lock")
            .get_mut(group as usize)
        {
            *slot = index;
        }
    }

    /// Describes a lock (linearizable). `None` if it is free.
    pub async fn describe(&self, name: &str) -> Result<Option<pb::LockInfo>, Error> {
        let group = crate::group_for(name, self.groups());
        let name = name.to_string();
        let r = self
            .call(group, Duration::ZERO, |mut c| {
                let req = pb::DescribeRequest {
                    group,
                    name: name.clone(),
                };
                async move { c.describe(req).await }
            })
            .await?;
        Ok(r.lock)
    }

    /// Lists locks whose names start with `prefix` in every group (linearizable per group), in name order.
    pub async fn list_locks(&self, prefix: &str) -> Result<Vec<pb::LockInfo>, Error> {
        let mut all = Vec::new();
        for group in 0..self.groups() {
            let mut after = String::new();
            loop {
                let (prefix, a) = (prefix.to_string(), after.clone());
                let page = self
                    .call(group, Duration::ZERO, |mut c| {
                        let req = pb::ListLocksRequest {
                            group,
                            prefix: prefix.clone(),
                            after: a.clone(),
                            limit: 1000,
                        };
                        async move { c.list_locks(req).await }
                    })
                    .await?;
                after = page
                    .locks
                    .last()
                    .map(|l| l.name.clone())
                    .unwrap_or_default();
                all.extend(page.locks);
                if !page.more {
                    break;
                }
            }
        }
        all.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(all)
    }

    /// Lists every session of every group (linearizable per group).
    pub async fn list_sessions(&self) -> Result<Vec<(u32, pb::SessionInfo)>, Error> {
        let mut all = Vec::new();
        for group in 0..self.groups() {
            let mut after = 0;
            loop {
                let page = self
                    .call(group, Duration::ZERO, |mut c| async move {
                        c.list_sessions(pb::ListSessionsRequest {
                            group,
                            after,
                            limit: 1000,
                        })
                        .await
                    })
                    .await?;
                after = page.sessions.last().map_or(0, |s| s.session_id);
                all.extend(page.sessions.into_iter().map(|s| (group, s)));
                if !page.more {
                    break;
                }
            }
        }
        Ok(all)
    }

    /// Hands leadership of `group` to node `to` (or the most up-to-date voter) and returns the new leader.
    pub async fn transfer_leader(&self, group: u32, to: Option<u64>) -> Result<u64, Error> {
        let r = self
            .call(group, Duration::ZERO, |mut c| async move {
                c.transfer_leader(pb::TransferLeaderRequest {
                    group,
                    to: to.unwrap_or(0),
                })
                .await
            })
            .await?;
        Ok(r.leader_id)
    }

    /// Adds server `node_id` to `group`: as a learner, then, once it has caught up, as a voter. The server
    /// must be running (with `--join` if its data directory is new). Returns the group's voters and
    /// learners after the change. Idempotent, so it is retried like any request.
    pub async fn add_member(
        &self,
        group: u32,
        node_id: u64,
        client_endpoint: &str,
        peer_endpoint: &str,
    ) -> Result<pb::MembershipResponse, Error> {
        let (client_endpoint, peer_endpoint) =
            (client_endpoint.to_string(), peer_endpoint.to_string());
        self.call(group, MEMBER_CHANGE_EXTRA, |mut c| {
            let req = pb::AddMemberRequest {
                group,
                node_id,
                client_endpoint: client_endpoint.clone(),
                peer_endpoint: peer_endpoint.clone(),
            };
            async move { c.add_member(req).await }
        })
        .await
    }

    /// Removes server `node_id` from `group`. Refused when fewer than 3 voters would remain, unless
    /// `force`. Idempotent.
    pub async fn remove_member(
        &self,
        group: u32,
        node_id: u64,
        force: bool,
    ) -> Result<pb::MembershipResponse, Error> {
        self.call(group, MEMBER_CHANGE_EXTRA, |mut c| async move {
            c.remove_member(pb::RemoveMemberRequest {
                group,
                node_id,
                force,
            })
            .await
        })
        .await
    }

    /// A consistent copy of `group`'s lock table from its leader, at a committed index (for backups):
    /// the first chunk's index, term, leader and digest, with `data` holding the whole table.
    pub async fn snapshot_group(&self, group: u32) -> Result<pb::SnapshotGroupChunk, Error> {
        let mut stream = self
            .call(group, MEMBER_CHANGE_EXTRA, |mut c| async move {
                c.snapshot_group(pb::SnapshotGroupRequest { group }).await
            })
            .await?;
        let mut all: Option<pb::SnapshotGroupChunk> = None;
        loop {
            match stream.message().await {
                Ok(Some(chunk)) => match &mut all {
                    None => all = Some(chunk),
                    Some(a) => a.data.extend_from_slice(&chunk.data),
                },
                Ok(None) => break,
                Err(s) => {
                    return Err(Error::Unavailable(format!(
                        "snapshot stream of group {group} broke: {}",
                        describe_status(&s)
                    )))
                }
            }
        }
        let all =
            all.ok_or_else(|| Error::Unavailable(format!("empty snapshot of group {group}")))?;
        if all.data.len() as u64 != all.total_bytes {
            return Err(Error::Unavailable(format!(
                "snapshot of group {group} ended after {} of {} bytes",
                all.data.len(),
                all.total_bytes
            )));
        }
        Ok(all)
    }

    /// Asks one server (by its index in [`Client::endpoints`]) for its own view of the cluster. Not
    /// linearizable.
    pub async fn status_of(&self, index: usize) -> Result<pb::StatusResponse, Error> {
        let endpoint = self.endpoint(index);
        let mut c = self.rpc(index);
        match tokio::time::timeout(
            self.inner.options.attempt_timeout,
            c.status(pb::StatusRequest::default()),
        )
        .await
        {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(Error::Unavailable(format!(
                "{endpoint}: {}",
                describe_status(&s)
            ))),
            Err(_) => Err(Error::Unavailable(format!("{endpoint}: no answer"))),
        }
    }
}

#[cfg(test)]
impl Client {
    /// Whether a call to server `index` has failed without an answer yet.
    pub(crate) fn has_failed(&self, index: usize) -> bool {
        self.inner.servers.read().expect("servers lock")[index]
            .marked
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A client of `groups` groups that has talked to no server (its one endpoint is never dialled
    /// unless a call is made): for unit tests of client-side state.
    pub(crate) fn unconnected(groups: u32) -> Client {
        Client::unconnected_to(&["127.0.0.1:9"], groups)
    }

    /// [`Client::unconnected`] with these endpoints.
    pub(crate) fn unconnected_to(endpoints: &[&str], groups: u32) -> Client {
        let options = ClientOptions {
            batched_keepalives: false,
            ..ClientOptions::default()
        };
        Client {
            inner: Arc::new(Inner {
                registry: Default::default(),
                servers: RwLock::new(
                    endpoints
                        .iter()
                        .map(|e| {
                            Server::new(
                                e,
                                channel_to(e, &options).expect("a lazy channel"),
                                &options,
                            )
                        })
                        .collect(),
                ),
                groups,
                leaders: Mutex::new(vec![0; groups as usize]),
                auth: Auth::new(None).expect("no token"),
                opens: Default::default(),
                jitter: jitter_seed(&options).into(),
                options,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{jittered, Client};
    use crate::Error;
    use holdfast_proto::v1::{self as pb, ErrorDetail, Reason};
    use prost::Message;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    fn refusal(code: tonic::Code, reason: Reason, limit: &str) -> tonic::Status {
        let detail = ErrorDetail {
            reason: reason as i32,
            limit: limit.into(),
            ..Default::default()
        };
        tonic::Status::with_details(code, "refused", detail.encode_to_vec().into())
    }

    /// The errors a call returns when its attempts fail with `answers` in turn (two servers, so a retry
    /// goes to the other one).
    async fn outcome(answers: Vec<tonic::Status>) -> Error {
        let client = Client::unconnected_to(&["127.0.0.1:9", "127.0.0.1:10"], 1);
        let tries = AtomicUsize::new(0);
        let got = client
            .call_via(0, Duration::ZERO, |_| {
                let answer = answers[tries.fetch_add(1, Ordering::SeqCst)].clone();
                async move { Err::<tonic::Response<pb::AcquireResponse>, _>(answer) }
            })
            .await
            .expect_err("every attempt fails");
        assert_eq!(tries.load(Ordering::SeqCst), answers.len(), "{got}");
        got
    }

    /// A refusal that can change between attempts (the calls in flight, a policy reload) that meets a
    /// retry does not prove the request changed nothing: an earlier attempt whose answer was lost may
    /// have been queued. Such an error must not be "not applied", or the session would not cancel a
    /// wait that may be granted to it later. Refusals that every attempt would meet alike, and the lock
    /// table's answers, stay what they are; so does any refusal of a first attempt.
    #[tokio::test]
    async fn a_refusal_after_an_attempt_with_an_unknown_outcome_may_have_been_applied() {
        use tonic::Code;
        let lost = tonic::Status::unavailable("connection reset");
        let busy = refusal(
            Code::ResourceExhausted,
            Reason::LimitExceeded,
            "max_calls_per_connection",
        );
        let policy = refusal(Code::PermissionDenied, Reason::AccessDenied, "");
        let long = refusal(
            Code::InvalidArgument,
            Reason::LimitExceeded,
            "max_name_bytes",
        );
        let secret = refusal(Code::PermissionDenied, Reason::PermissionDenied, "");
        let held = refusal(Code::FailedPrecondition, Reason::LockHeld, "");

        let first = outcome(vec![busy.clone()]).await;
        assert!(matches!(first, Error::LimitExceeded { .. }) && first.not_applied());
        for late in [busy, policy] {
            let retried = outcome(vec![lost.clone(), late]).await;
            assert!(
                matches!(&retried, Error::Unavailable(m) if m.contains("may have been applied")),
                "{retried:?}"
            );
            assert!(!retried.not_applied());
        }
        for late in [long, secret, held] {
            let retried = outcome(vec![lost.clone(), late]).await;
            assert!(retried.not_applied(), "{retried:?}");
        }
    }

    /// Every pause lies between half the backoff and all of it, the pauses spread over that range, and
    /// one seed gives one sequence.
    #[test]
    fn retry_pauses_are_jittered_within_the_backoff() {
        let backoff = Duration::from_millis(400);
        let draw = |seed: u64| {
            let state = std::sync::atomic::AtomicU64::new(seed);
            (0..1_000)
                .map(|_| jittered(&state, backoff))
                .collect::<Vec<_>>()
        };
        let pauses = draw(7);
        assert!(pauses.iter().all(|p| *p >= backoff / 2 && *p <= backoff));
        let low = pauses.iter().filter(|p| **p < backoff * 3 / 4).count();
        assert!((350..650).contains(&low), "{low} of 1000 in the lower half");
        assert_eq!(pauses, draw(7));
        assert_ne!(pauses, draw(8));
        assert_eq!(jittered(&0.into(), Duration::ZERO), Duration::ZERO);
    }
}
