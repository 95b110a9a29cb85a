//! The client-facing gRPC service (`holdfast.v1.Holdfast`): validates requests, turns them into lock
//! table commands or linearizable reads, and maps outcomes to responses and statuses.
//!
//! Invariant: nothing reaches the log unless it passed validation here (name rules, group, TTL bounds,
//! request id, sizes), so the lock table only ever sees well-formed commands. Protobuf types stop here.

use crate::abandon::{self, Call, OnDrop};
use crate::access::Need;
use crate::errors::{self, invalid, limit, not_leader, refusal, session_unknown};
use crate::group::{Group, ProposeError, WaitEnd};
use crate::lease::{KeepAlive, KeepAliveRefused};
use crate::node::NodeShared;
use crate::now_ms;
use holdfast_lock_table::{
    group_for, AcquireMode, Command, FencingToken, LockName, LockView, Outcome, Refusal, RequestId,
    SessionId, Share,
};
use holdfast_proto::v1 as pb;
use holdfast_proto::v1::holdfast_server::Holdfast;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// Longest an acquire may wait in a queue; a client wanting longer re-issues the acquire.
pub const MAX_WAIT_MS: u64 = 300_000;
/// Most session ids in one keepalive message: 10,000 ids and secrets (at most ~275 KiB) stay under the
/// request size limit.
pub const MAX_KEEPALIVE_BATCH: usize = 10_000;
/// Largest page of a listing.
pub const MAX_PAGE: u32 = 1_000;
/// Page size when the client asks for 0.
pub const DEFAULT_PAGE: u32 = 100;
/// Largest client request message. A lock name is at most 256 bytes; a keepalive batch of 10,000 ids
/// with their 16-byte secrets is at most ~250 KiB.
pub const MAX_REQUEST_BYTES: usize = 512 << 10;
/// Longest a requested leader transfer may take before it is reported as failed (the old leader then
/// leads on).
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(3);
/// Keepalive messages queued per stream before the server stops reading more from it.
const KEEPALIVE_STREAM_BUFFER: usize = 64;

#[derive(Clone)]
pub struct ClientService {
    pub node: Arc<NodeShared>,
}

type KeepAliveStream = Pin<Box<dyn Stream<Item = Result<pb::KeepAliveResponse, Status>> + Send>>;
type SnapshotStream = Pin<Box<dyn Stream<Item = Result<pb::SnapshotGroupChunk, Status>> + Send>>;
type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::WatchResponse, Status>> + Send>>;

/// Messages queued per watch stream beyond what HTTP/2 flow control holds. The history is shared, so
/// a watcher that does not read costs this much and its cursor, until it falls off the history's end.
const WATCH_STREAM_BUFFER: usize = 4;
/// How often an idle watch stream sends progress (`through_index` with no events) and checks that
/// this server still leads the group.
const WATCH_TICK: Duration = Duration::from_secs(1);

/// Most `SnapshotGroup` streams in progress on one server (each holds a copy of its group's table).
pub const MAX_SNAPSHOT_STREAMS: usize = 2;

/// Table bytes per `SnapshotGroup` chunk.
const SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;

impl ClientService {
    /// What the access policy says about this request (everything is allowed without one).
    pub(crate) fn allow<T>(&self, r: &Request<T>, need: Need<'_>) -> Result<(), Status> {
        match &self.node.access {
            None => Ok(()),
            Some(access) => access.check(r, need),
        }
    }

    /// The principal and quota the policy holds this request to, if any.
    fn quota<T>(&self, r: &Request<T>) -> Option<(String, holdfast_lock_table::QuotaLimits)> {
        self.node.access.as_ref().and_then(|a| a.quota(r))
    }

    fn group(&self, g: u32) -> Result<&Arc<Group>, Status> {
        self.node.groups.get(g as usize).ok_or_else(|| {
            invalid(format!(
                "group {g} does not exist (the cluster has {} groups)",
                self.node.groups.len()
            ))
        })
    }

    fn lock_name(&self, name: String, group: u32) -> Result<LockName, Status> {
        let name = LockName::new(name).map_err(errors::name_error)?;
        let owner = group_for(name.as_str(), self.node.groups.len() as u32);
        if owner.0 != group {
            return Err(errors::status(
                tonic::Code::InvalidArgument,
                pb::Reason::WrongGroup,
                format!(
                    "lock {:?} belongs to group {}, not group {group}",
                    name.as_str(),
                    owner.0
                ),
                pb::ErrorDetail::default(),
            ));
        }
        Ok(name)
    }

    fn propose_error(&self, e: ProposeError) -> Status {
        match e {
            ProposeError::NotLeader(id) => self.not_leader(id),
            ProposeError::Unknown(msg) => errors::unavailable(format!(
                "outcome unknown, retry with the same request id: {msg}"
            )),
            ProposeError::Stopped(msg) => {
                errors::unavailable(format!("this server is stopping: {msg}"))
            }
            ProposeError::Refused(msg) => Status::failed_precondition(msg),
        }
    }

    /// A linearizable read of the group's lock table: confirm leadership with a quorum, then read.
    async fn read<T>(
        &self,
        group: &Group,
        f: impl FnOnce(&holdfast_lock_table::LockTable) -> T,
    ) -> Result<T, Status> {
        group
            .linearizable_read()
            .await
            .map_err(|e| self.propose_error(e))?;
        let state = group.state.read().expect("state lock");
        Ok(f(&state.table))
    }

    fn not_leader(&self, id: Option<u64>) -> Status {
        let endpoint = id.and_then(|id| self.node.client_endpoint(id));
        not_leader(id, endpoint.as_deref())
    }

    fn lock_info(&self, group: &Group, view: LockView) -> pb::LockInfo {
        let now = Instant::now();
        let remaining = |session| {
            group
                .leases
                .remaining(session, now)
                .map_or(0, |d| d.as_millis() as u64)
        };
        let holders = view
            .holders()
            .map(|h| pb::Holder {
                session_id: h.session.0,
                token: h.token.0,
                granted_at_ms: h.granted_at_ms,
                ttl_remaining_ms: remaining(h.session),
                value: h.value.to_vec(),
                lock_delay_ms: h.lock_delay_ms,
                delayed: h.session.0 == 0,
                shared: h.shared,
            })
            .collect();
        pb::LockInfo {
            name: view.name.as_str().to_string(),
            holder_session_id: view.holder.session.0,
            token: view.holder.token.0,
            granted_at_ms: view.holder.granted_at_ms,
            holder_ttl_remaining_ms: group
                .leases
                .remaining(view.holder.session, now)
                .map_or(0, |d| d.as_millis() as u64),
            waiters: view
                .waiters
                .iter()
                .map(|w| pb::Waiter {
                    session_id: w.session.0,
                    enqueued_at_ms: w.enqueued_at_ms,
                    shared: w.shared,
                })
                .collect(),
            holder_value: view.holder.value.to_vec(),
            lock_delay_ms: view.holder.lock_delay_ms,
            delayed: view.holder.session.0 == 0,
            holders,
            permits: view.permits,
        }
    }

    /// One keepalive message: its own group (unless it carries only `groups`), then each of `groups`
    /// answered on its own. Counted as one message however many groups it renews. Asked for
    /// `compact`, the groups are answered with one TTL per session (`ttl_ms`) instead of a result
    /// message each, and the response says so: at 10,000 sessions a message, the results were most of
    /// encoding the answer here and decoding it at the client (docs/performance.md, "Compact keepalives").
    pub(crate) fn keepalive(
        &self,
        mut req: pb::KeepAliveRequest,
    ) -> Result<pb::KeepAliveResponse, Status> {
        if self.node.config.compat_ignore_keepalive_groups {
            req.groups.clear();
        }
        // A server older than `groups` predates `compact` too.
        let compat = self.node.config.compat_no_compact_keepalives
            || self.node.config.compat_ignore_keepalive_groups;
        let compact = req.compact && !compat;
        let ids = req.session_ids.len()
            + req
                .groups
                .iter()
                .map(|g| g.session_ids.len())
                .sum::<usize>();
        if ids > MAX_KEEPALIVE_BATCH {
            return Err(limit(
                "max_keepalive_batch",
                MAX_KEEPALIVE_BATCH as u64,
                format!("{ids} session ids in one keepalive, over the limit of {MAX_KEEPALIVE_BATCH} (max_keepalive_batch)"),
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        if let Some(g) = req.groups.iter().find(|g| !seen.insert(g.group)) {
            return Err(invalid(format!(
                "group {} appears twice in one keepalive",
                g.group
            )));
        }
        let own = req.groups.is_empty() || !req.session_ids.is_empty();
        let results = if own {
            let renewed = self.renew(
                req.group,
                &req.session_ids,
                Secrets::Each(&req.session_secrets),
            )?;
            result_messages(&req.session_ids, renewed)
        } else {
            Vec::new()
        };
        let groups = req
            .groups
            .iter()
            .map(|g| {
                let secrets = if compat || g.packed_secrets.is_empty() {
                    Secrets::Each(&g.session_secrets)
                } else if g.session_secrets.is_empty() {
                    Secrets::Packed(&g.packed_secrets)
                } else {
                    Secrets::Both
                };
                let packed = matches!(secrets, Secrets::Packed(_));
                let renewed = self.renew(g.group, &g.session_ids, secrets);
                if packed && renewed.is_ok() {
                    self.node.metrics.keepalive_packed_groups.inc();
                }
                match renewed {
                    Ok(renewed) if compact => pb::GroupKeepAliveResult {
                        group: g.group,
                        ttl_ms: renewed
                            .into_iter()
                            .map(|k| match k {
                                KeepAlive::Alive { ttl_ms } => ttl_ms,
                                KeepAlive::Gone => 0,
                            })
                            .collect(),
                        ..Default::default()
                    },
                    Ok(renewed) => pb::GroupKeepAliveResult {
                        group: g.group,
                        results: result_messages(&g.session_ids, renewed),
                        ..Default::default()
                    },
                    Err(status) => pb::GroupKeepAliveResult {
                        group: g.group,
                        code: status.code() as i32,
                        message: status.message().to_string(),
                        error: errors::detail(&status),
                        ..Default::default()
                    },
                }
            })
            .collect::<Vec<_>>();
        // Counted when it renewed something here: a message whose every group was refused was not
        // answered as leader.
        if own || groups.iter().any(|g| g.code == 0) {
            self.node.metrics.keepalive_messages.inc();
        }
        Ok(pb::KeepAliveResponse {
            results,
            groups,
            compact,
        })
    }

    /// Renews `session_ids` of `group` (this server must lead it and may renew now): what each is now.
    fn renew(
        &self,
        group: u32,
        session_ids: &[u64],
        secrets: Secrets<'_>,
    ) -> Result<Vec<KeepAlive>, Status> {
        let group = self.group(group)?;
        if !group.can_renew() {
            return Err(self.not_leader(
                group.leader_hint(
                    group
                        .current_leader()
                        .filter(|&l| l != self.node.config.node_id),
                ),
            ));
        }
        let secrets = secrets.read(session_ids.len())?;
        let mut out = Vec::with_capacity(session_ids.len());
        match group
            .leases
            .keepalive(session_ids, &secrets, Instant::now(), &mut out)
        {
            Ok(()) => {}
            Err(KeepAliveRefused::NotLeading) => {
                return Err(self.not_leader(group.leader_hint(group.current_leader())))
            }
            Err(KeepAliveRefused::WrongSecret(session)) => {
                return Err(errors::permission_denied(session.0))
            }
        }
        self.node
            .metrics
            .keepalives
            .inc_by(session_ids.len() as u64);
        Ok(out)
    }

    /// Waits for a queued acquire to be granted (`wait`: none for a try, which ends the wait at once),
    /// cancelling the wait through the log when the deadline passes. The log decides a race between a
    /// grant and the cancel.
    async fn wait_for_grant(
        &self,
        group: &Group,
        (session, request): (SessionId, RequestId),
        name: &LockName,
        secret: u128,
        wait: Option<tokio::sync::oneshot::Receiver<WaitEnd>>,
        deadline: Instant,
    ) -> Result<FencingToken, Status> {
        if let Some(wait) = wait {
            if let Ok(Ok(WaitEnd::Granted(token))) = tokio::time::timeout_at(deadline, wait).await {
                return Ok(token);
            }
        }
        let cancel = authorized(
            secret,
            Command::CancelWait {
                session,
                request,
                name: name.clone(),
                now_ms: now_ms(),
            },
        );
        // The wait is in the table: whatever stops its cancel from committing here (this server no
        // longer leads, say), the wait goes on elsewhere, so the answer is "outcome unknown"
        // (UNAVAILABLE), never a refusal, which would tell the client nothing was done and leave the
        // wait to be granted to a client that stopped waiting. An unknown outcome also has this call
        // abandoned (see `acquire`), through the leader.
        let cancelled = group.propose(cancel).await.map_err(|e| {
            errors::unavailable(format!(
                "the wait for lock {:?} ran out, but its cancel could not be settled here; outcome unknown, retry with the same request id: {}",
                name.as_str(),
                self.propose_error(e).message()
            ))
        })?;
        match cancelled {
            Outcome::Granted { token } => Ok(token),
            Outcome::Cancelled | Outcome::Refused(Refusal::NotWaiting) => {
                let state = group.state.read().expect("state lock");
                // The wait was abandoned meanwhile (the client cancelled the request): say so.
                if state.table.remembered(session, request) == Some(Outcome::Abandoned) {
                    return Err(abandoned(request, name.as_str()));
                }
                let holder = state.table.describe(name);
                let (holder_session, token) =
                    holder.map_or((0, 0), |v| (v.holder.session.0, v.holder.token.0));
                let why = if holder_session == 0 && token != 0 {
                    format!(
                        "in its lock-delay after the session holding it with token {token} expired"
                    )
                } else {
                    format!("held by session {holder_session} with token {token}")
                };
                Err(errors::status(
                    tonic::Code::Aborted,
                    pb::Reason::LockHeld,
                    format!("gave up waiting for lock {:?}: {why}", name.as_str()),
                    pb::ErrorDetail {
                        holder_session_id: holder_session,
                        current_token: token,
                        ..Default::default()
                    },
                ))
            }
            Outcome::Refused(r) => Err(refusal(r, session.0, name.as_str())),
            other => Err(errors::unavailable(format!(
                "unexpected outcome of a cancel: {other:?}"
            ))),
        }
    }
}

/// Refuses a request whose secret is not its session's, as far as this server's applied table knows,
/// before it costs a log entry. The table checks again when the entry applies (this read may be behind),
/// so this is only a shortcut: a session this server does not know yet goes on to the log.
fn check_secret(group: &Group, session: SessionId, secret: u128) -> Result<(), Status> {
    let state = group.state.read().expect("state lock");
    match state.table.session_secret(session) {
        Some(known) if known != secret => Err(errors::permission_denied(session.0)),
        _ => Ok(()),
    }
}

/// `command` held to a principal's quota, if the policy gives it one (see `Command::Quota`).
fn within(quota: Option<(String, holdfast_lock_table::QuotaLimits)>, command: Command) -> Command {
    match quota {
        None => command,
        Some((principal, quota)) => Command::Quota {
            principal: principal.into(),
            quota,
            command: Box::new(command),
        },
    }
}

/// `command` on behalf of a caller that showed `secret`.
fn authorized(secret: u128, command: Command) -> Command {
    Command::Authorized {
        secret,
        command: Box::new(command),
    }
}

fn nonzero(v: u64, what: &str) -> Result<u64, Status> {
    if v == 0 {
        Err(invalid(format!("{what} must be non-zero")))
    } else {
        Ok(v)
    }
}

fn abandoned(request: RequestId, name: &str) -> Status {
    errors::status(
        tonic::Code::Aborted,
        pb::Reason::AcquireAbandoned,
        format!("the acquire of lock {name:?} with request id {} was abandoned (cancelled, or its first call went away before it was answered); nothing is held or queued for it: acquire again with a new request id", request.0),
        pb::ErrorDetail::default(),
    )
}

fn unexpected(o: Outcome) -> Status {
    errors::unavailable(format!("unexpected outcome {o:?}"))
}

#[tonic::async_trait]
impl Holdfast for ClientService {
    async fn open_session(
        &self,
        r: Request<pb::OpenSessionRequest>,
    ) -> Result<Response<pb::OpenSessionResponse>, Status> {
        self.allow(&r, Need::LockAny)?;
        let quota = self.quota(&r);
        let r = r.into_inner();
        let group = self.group(r.group)?;
        let c = &self.node.config;
        let ttl_ms = if r.ttl_ms == 0 {
            c.default_ttl_ms
        } else {
            r.ttl_ms
        };
        if !(c.min_ttl_ms..=c.max_ttl_ms).contains(&ttl_ms) {
            return Err(invalid(format!(
                "ttl {ttl_ms} ms is outside the allowed range, {} ms to {} ms (0 asks for the default, {} ms)",
                c.min_ttl_ms, c.max_ttl_ms, c.default_ttl_ms
            )));
        }
        let nonce = (u128::from(r.nonce_hi) << 64) | u128::from(r.nonce_lo);
        if nonce == 0 {
            return Err(invalid("nonce must be random and non-zero"));
        }
        let command = within(
            quota,
            Command::OpenSessionWithSecret {
                nonce,
                ttl_ms,
                secret: self.node.secrets.next(),
                now_ms: now_ms(),
            },
        );
        match group
            .propose_open(command)
            .await
            .map_err(|e| self.propose_error(e))?
        {
            (Outcome::SessionOpened { session, ttl_ms }, secret) => {
                Ok(Response::new(pb::OpenSessionResponse {
                    session_id: session.0,
                    ttl_ms,
                    session_secret: errors::secret_bytes(secret),
                }))
            }
            (outcome, _) => match outcome {
                Outcome::Refused(r) => Err(refusal(r, 0, "")),
                other => Err(unexpected(other)),
            },
        }
    }

    async fn close_session(
        &self,
        r: Request<pb::CloseSessionRequest>,
    ) -> Result<Response<pb::CloseSessionResponse>, Status> {
        self.allow(&r, Need::LockAny)?;
        let r = r.into_inner();
        let group = self.group(r.group)?;
        let session = SessionId(nonzero(r.session_id, "session_id")?);
        let secret = errors::session_secret(&r.session_secret)?;
        check_secret(group, session, secret)?;
        match group
            .propose(authorized(
                secret,
                Command::CloseSession {
                    session,
                    now_ms: now_ms(),
                },
            ))
            .await
            .map_err(|e| self.propose_error(e))?
        {
            Outcome::SessionClosed { released } => {
                Ok(Response::new(pb::CloseSessionResponse { released }))
            }
            Outcome::Refused(r) => Err(refusal(r, session.0, "")),
            other => Err(unexpected(other)),
        }
    }

    async fn keep_alive(
        &self,
        r: Request<pb::KeepAliveRequest>,
    ) -> Result<Response<pb::KeepAliveResponse>, Status> {
        self.allow(&r, Need::LockAny)?;
        self.keepalive(r.into_inner()).map(Response::new)
    }

    type KeepAliveStreamStream = KeepAliveStream;

    async fn keep_alive_stream(
        &self,
        r: Request<tonic::Streaming<pb::KeepAliveRequest>>,
    ) -> Result<Response<Self::KeepAliveStreamStream>, Status> {
        self.allow(&r, Need::LockAny)?;
        // Checked again on every message, against the policy of the moment: a principal whose `lock`
        // was revoked stops renewing at once, not when its stream happens to break.
        let caller = crate::access::Caller::of(&r);
        let mut inbound = r.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(KEEPALIVE_STREAM_BUFFER);
        let service = self.clone();
        let streams = self.node.metrics.keepalive_streams.clone();
        streams.fetch_add(1, Relaxed);
        tokio::spawn(async move {
            struct Open(std::sync::Arc<std::sync::atomic::AtomicU64>);
            impl Drop for Open {
                fn drop(&mut self) {
                    self.0.fetch_sub(1, Relaxed);
                }
            }
            let _open = Open(streams);
            while let Ok(Some(req)) = inbound.message().await {
                let reply = match &service.node.access {
                    Some(access) => access
                        .check_caller(&caller, Need::LockAny)
                        .and_then(|()| service.keepalive(req)),
                    None => service.keepalive(req),
                };
                let stop = reply.is_err();
                if tx.send(reply).await.is_err() || stop {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn acquire(
        &self,
        r: Request<pb::AcquireRequest>,
    ) -> Result<Response<pb::AcquireResponse>, Status> {
        self.allow(&r, Need::Lock(&r.get_ref().name))?;
        let quota = self.quota(&r);
        let r = r.into_inner();
        let group = self.group(r.group)?;
        let session = SessionId(nonzero(r.session_id, "session_id")?);
        let request = RequestId(nonzero(r.request_id, "request_id")?);
        let secret = errors::session_secret(&r.session_secret)?;
        check_secret(group, session, secret)?;
        let name = self.lock_name(r.name, r.group)?;
        if r.wait_timeout_ms > MAX_WAIT_MS {
            return Err(limit(
                "max_wait_ms",
                MAX_WAIT_MS,
                format!(
                    "wait of {} ms is over the limit of {MAX_WAIT_MS} ms (max_wait_ms)",
                    r.wait_timeout_ms
                ),
            ));
        }
        if r.value.len() > holdfast_lock_table::limits::MAX_VALUE_BYTES {
            let max = holdfast_lock_table::limits::MAX_VALUE_BYTES;
            return Err(limit(
                "max_value_bytes",
                max as u64,
                format!(
                    "value of {} bytes is over the limit of {max} bytes (max_value_bytes)",
                    r.value.len()
                ),
            ));
        }
        let max_delay = holdfast_lock_table::limits::MAX_LOCK_DELAY_MS;
        if r.lock_delay_ms > max_delay {
            return Err(limit(
                "max_lock_delay_ms",
                u64::from(max_delay),
                format!(
                    "lock-delay of {} ms is over the limit of {max_delay} ms (max_lock_delay_ms)",
                    r.lock_delay_ms
                ),
            ));
        }
        let max_permits = holdfast_lock_table::limits::MAX_HOLDERS_PER_LOCK;
        if r.permits as usize > max_permits {
            return Err(limit(
                "max_holders_per_lock",
                max_permits as u64,
                format!(
                    "a semaphore of {} permits is over the limit of {max_permits} (max_holders_per_lock)",
                    r.permits
                ),
            ));
        }
        let share =
            match (r.shared, r.permits) {
                (false, 0) => Share::Exclusive,
                (true, 0) => Share::Shared,
                (false, n) => Share::Permits(n),
                (true, _) => return Err(invalid(
                    "shared and permits exclude each other: a semaphore's permits are not shared",
                )),
            };
        // From here on, a handler dropped before it answers abandons the acquire through the log, unless
        // the client said it cancels by itself.
        let on_drop = if r.client_cancels {
            OnDrop::Detach
        } else {
            OnDrop::Abandon
        };
        let attempt = self.node.attempt_ids.next();
        let call = Call::new(
            &self.node,
            group,
            (session, request),
            &name,
            attempt,
            secret,
            on_drop,
        );
        let started = Instant::now();
        let deadline = started + Duration::from_millis(r.wait_timeout_ms);
        let mode = if r.wait_timeout_ms > 0 {
            AcquireMode::Wait
        } else {
            AcquireMode::Try
        };
        // Register before proposing, so a grant applied right after the Queued outcome is not missed.
        let mut registration =
            (mode == AcquireMode::Wait).then(|| group.waiters.register_call(session, request));
        let mut command = within(
            quota,
            authorized(
                secret,
                Command::Acquire {
                    session,
                    request,
                    name: name.clone(),
                    mode,
                    value: r.value.into(),
                    attempt,
                    now_ms: now_ms(),
                },
            ),
        );
        if r.lock_delay_ms > 0 {
            command = Command::WithLockDelay {
                lock_delay_ms: r.lock_delay_ms,
                command: Box::new(command),
            };
        }
        if share != Share::Exclusive {
            command = Command::WithShare {
                share,
                command: Box::new(command),
            };
        }
        let outcome = group
            .propose(command)
            .await
            .map_err(|e| self.propose_error(e));
        let result = match outcome {
            Err(e) => Err(e),
            Ok(Outcome::Granted { token }) => Ok(token),
            // A try that finds its request queued is a retry of a wait whose time ran out: it ends the
            // wait now (through the log, which also tells whether the grant won the race).
            Ok(Outcome::Queued { .. }) => {
                let wait = registration.as_mut().and_then(|r| r.take());
                self.wait_for_grant(group, (session, request), &name, secret, wait, deadline)
                    .await
            }
            Ok(Outcome::Cancelled) => Err(errors::status(
                tonic::Code::Aborted,
                pb::Reason::LockHeld,
                format!(
                    "the wait of this request for lock {:?} was cancelled earlier",
                    name.as_str()
                ),
                pb::ErrorDetail::default(),
            )),
            Ok(Outcome::Abandoned) => Err(abandoned(request, name.as_str())),
            Ok(Outcome::Refused(r)) => Err(refusal(r, session.0, name.as_str())),
            Ok(other) => Err(unexpected(other)),
        };
        drop(registration);
        // An unknown outcome is no answer: the entry may still commit, or the wait be granted, and a
        // client that gives up now would leave it behind. The call's attempt is abandoned (when the
        // server is in charge of that); a retry either takes the wait over first or learns it was
        // abandoned, and both are safe.
        let unknown =
            matches!(&result, Err(s) if holdfast_proto::reason(s) == Some(pb::Reason::Unavailable));
        if !unknown {
            call.answered();
        }
        result.map(|token| Response::new(pb::AcquireResponse { token: token.0 }))
    }

    async fn cancel_acquire(
        &self,
        r: Request<pb::CancelAcquireRequest>,
    ) -> Result<Response<pb::CancelAcquireResponse>, Status> {
        self.allow(&r, Need::Cancel(&r.get_ref().name))?;
        let r = r.into_inner();
        let group = self.group(r.group)?;
        let session = SessionId(nonzero(r.session_id, "session_id")?);
        let request = RequestId(nonzero(r.request_id, "request_id")?);
        let name = self.lock_name(r.name, r.group)?;
        let attempt = (r.attempt != 0).then_some(r.attempt);
        let secret = errors::session_secret(&r.session_secret)?;
        check_secret(group, session, secret)?;
        let outcome = abandon::propose(group, session, request, &name, attempt, secret)
            .await
            .map_err(|e| self.propose_error(e))?;
        match outcome {
            Outcome::Abandoned => Ok(Response::new(pb::CancelAcquireResponse {})),
            Outcome::Refused(Refusal::NotWaiting) => Err(errors::status(
                tonic::Code::FailedPrecondition,
                pb::Reason::NotHolder,
                format!(
                    "request {} of session {} neither waits for nor holds lock {:?}{}",
                    request.0,
                    session.0,
                    name.as_str(),
                    if attempt.is_some() {
                        " under that attempt (a newer call took it over)"
                    } else {
                        " (it waits for another lock)"
                    }
                ),
                pb::ErrorDetail::default(),
            )),
            Outcome::Refused(r) => Err(refusal(r, session.0, name.as_str())),
            other => Err(unexpected(other)),
        }
    }

    async fn release(
        &self,
        r: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        self.allow(&r, Need::Release(&r.get_ref().name))?;
        let r = r.into_inner();
        let group = self.group(r.group)?;
        let session = SessionId(nonzero(r.session_id, "session_id")?);
        let request = RequestId(nonzero(r.request_id, "request_id")?);
        let token = FencingToken(nonzero(r.token, "token")?);
        let secret = errors::session_secret(&r.session_secret)?;
        check_secret(group, session, secret)?;
        let name = self.lock_name(r.name, r.group)?;
        let command = authorized(
            secret,
            Command::Release {
                session,
                request,
                name: name.clone(),
                token,
                now_ms: now_ms(),
            },
        );
        match group
            .propose(command)
            .await
            .map_err(|e| self.propose_error(e))?
        {
            Outcome::Released => Ok(Response::new(pb::ReleaseResponse {})),
            Outcome::Refused(r) => Err(refusal(r, session.0, name.as_str())),
            other => Err(unexpected(other)),
        }
    }

    type CallsStream = crate::calls::CallReplies;

    async fn calls(
        &self,
        r: Request<tonic::Streaming<pb::CallRequest>>,
    ) -> Result<Response<Self::CallsStream>, Status> {
        self.open_calls(r).map(Response::new)
    }

    async fn describe(
        &self,
        r: Request<pb::DescribeRequest>,
    ) -> Result<Response<pb::DescribeResponse>, Status> {
        self.allow(&r, Need::Read(&r.get_ref().name))?;
        let r = r.into_inner();
        let group = self.group(r.group)?;
        let name = self.lock_name(r.name, r.group)?;
        let view = self.read(group, |t| t.describe(&name)).await?;
        Ok(Response::new(pb::DescribeResponse {
            lock: view.map(|v| self.lock_info(group, v)),
        }))
    }

    async fn list_locks(
        &self,
        r: Request<pb::ListLocksRequest>,
    ) -> Result<Response<pb::ListLocksResponse>, Status> {
        self.allow(&r, Need::Read(&r.get_ref().prefix))?;
        let r = r.into_inner();
        let group = self.group(r.group)?;
        let page = page_size(r.limit)?;
        let after = (!r.after.is_empty()).then_some(r.after.as_str());
        let mut views = self
            .read(group, |t| t.list_locks(&r.prefix, after, page + 1))
            .await?;
        let more = views.len() > page;
        views.truncate(page);
        let locks = views
            .into_iter()
            .map(|v| self.lock_info(group, v))
            .collect();
        Ok(Response::new(pb::ListLocksResponse { locks, more }))
    }

    async fn list_sessions(
        &self,
        r: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        self.allow(&r, Need::Read(""))?;
        let r = r.into_inner();
        let group = self.group(r.group)?;
        let page = page_size(r.limit)?;
        let after = (r.after != 0).then_some(SessionId(r.after));
        let mut views = self
            .read(group, |t| t.list_sessions(after, page + 1))
            .await?;
        let more = views.len() > page;
        views.truncate(page);
        let now = Instant::now();
        let sessions = views
            .into_iter()
            .map(|v| pb::SessionInfo {
                session_id: v.session.0,
                ttl_ms: v.ttl_ms,
                opened_at_ms: v.opened_at_ms,
                locks_held: v.held,
                locks_waiting: v.waiting,
                ttl_remaining_ms: group
                    .leases
                    .remaining(v.session, now)
                    .map_or(0, |d| d.as_millis() as u64),
            })
            .collect();
        Ok(Response::new(pb::ListSessionsResponse { sessions, more }))
    }

    async fn transfer_leader(
        &self,
        r: Request<pb::TransferLeaderRequest>,
    ) -> Result<Response<pb::TransferLeaderResponse>, Status> {
        self.allow(&r, Need::Admin)?;
        let r = r.into_inner();
        let group = self.group(r.group)?;
        if group.raft_metrics().state != openraft::ServerState::Leader {
            return Err(self.not_leader(
                group.leader_hint(
                    group
                        .current_leader()
                        .filter(|&l| l != self.node.config.node_id),
                ),
            ));
        }
        let to = (r.to != 0).then_some(r.to);
        // Asked to move leadership where it already is: nothing to do.
        if to == Some(self.node.config.node_id) {
            return Ok(Response::new(pb::TransferLeaderResponse {
                leader_id: self.node.config.node_id,
            }));
        }
        match group.hand_over(to, TRANSFER_TIMEOUT).await {
            Ok(leader_id) => Ok(Response::new(pb::TransferLeaderResponse { leader_id })),
            Err(e) if e.contains("not a voter") || e.contains("no other voter") => Err(invalid(e)),
            Err(e) => Err(errors::unavailable(format!(
                "leader transfer did not complete: {e}"
            ))),
        }
    }

    async fn add_member(
        &self,
        r: Request<pb::AddMemberRequest>,
    ) -> Result<Response<pb::MembershipResponse>, Status> {
        self.allow(&r, Need::Admin)?;
        let r = r.into_inner();
        let group = self.group(r.group)?;
        if r.node_id == 0 {
            return Err(invalid("node id 0 is reserved"));
        }
        for (what, endpoint) in [("client", &r.client_endpoint), ("peer", &r.peer_endpoint)] {
            if endpoint.parse::<std::net::SocketAddr>().is_err()
                && !endpoint
                    .rsplit_once(':')
                    .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
            {
                return Err(invalid(format!(
                    "bad {what} endpoint {endpoint:?}: want host:port"
                )));
            }
        }
        let node = crate::raft_types::MemberNode {
            peer: r.peer_endpoint,
            client: r.client_endpoint,
        };
        group
            .add_member(r.node_id, node)
            .await
            .map_err(|e| self.propose_error(e))?;
        Ok(Response::new(membership_response(group)))
    }

    async fn remove_member(
        &self,
        r: Request<pb::RemoveMemberRequest>,
    ) -> Result<Response<pb::MembershipResponse>, Status> {
        self.allow(&r, Need::Admin)?;
        let r = r.into_inner();
        let group = self.group(r.group)?;
        let me = self.node.config.node_id;
        if r.node_id == me && group.raft_metrics().state == openraft::ServerState::Leader {
            group
                .check_removal(&group.membership_view(), me, r.force)
                .map_err(|e| self.propose_error(e))?;
            // A leader does not remove itself: it hands over, and the retry reaches the new leader.
            let leader = group.hand_over(None, TRANSFER_TIMEOUT).await.map_err(|e| {
                errors::unavailable(format!("handing over before removing this server: {e}"))
            })?;
            return Err(self.not_leader(Some(leader)));
        }
        group
            .remove_member(r.node_id, r.force)
            .await
            .map_err(|e| self.propose_error(e))?;
        Ok(Response::new(membership_response(group)))
    }

    type SnapshotGroupStream = SnapshotStream;

    async fn snapshot_group(
        &self,
        r: Request<pb::SnapshotGroupRequest>,
    ) -> Result<Response<Self::SnapshotGroupStream>, Status> {
        self.allow(&r, Need::Admin)?;
        let group = self.group(r.into_inner().group)?;
        // Each stream holds a whole copy of the table until it is read or dropped: bound how many.
        let permit = self
            .node
            .snapshot_streams
            .clone()
            .try_acquire_owned()
            .map_err(|_| {
                limit(
                    "max_snapshot_streams",
                    MAX_SNAPSHOT_STREAMS as u64,
                    format!("{MAX_SNAPSHOT_STREAMS} SnapshotGroup streams are in progress on this server (max_snapshot_streams); try again when one ends"),
                )
            })?;
        group
            .linearizable_read()
            .await
            .map_err(|e| self.propose_error(e))?;
        // The table and its log position under one read lock: a consistent copy at a committed index.
        let (bytes, last, digest) = {
            let state = group.state.read().expect("state lock");
            (
                state.table.encode_snapshot(),
                state.last_applied,
                state.table.digest(),
            )
        };
        let last = last.ok_or_else(|| errors::unavailable("group has applied nothing yet"))?;
        let total = bytes.len() as u64;
        // Chunks are copied out one at a time as the client reads them, so a stream holds one copy.
        let count = bytes.len().div_ceil(SNAPSHOT_CHUNK_BYTES).max(1);
        let chunks = futures::StreamExt::map(futures::stream::iter(0..count), move |i| {
            let _held = &permit;
            let start = i * SNAPSHOT_CHUNK_BYTES;
            let end = (start + SNAPSHOT_CHUNK_BYTES).min(bytes.len());
            let mut chunk = pb::SnapshotGroupChunk {
                data: bytes[start.min(end)..end].to_vec(),
                ..Default::default()
            };
            if i == 0 {
                chunk.index = last.index;
                chunk.term = last.leader_id.term;
                chunk.leader = last.leader_id.node_id;
                chunk.digest = digest;
                chunk.total_bytes = total;
            }
            Ok(chunk)
        });
        Ok(Response::new(Box::pin(chunks)))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        r: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        self.allow(&r, Need::Read(&r.get_ref().prefix))?;
        let principal = self.node.access.as_ref().and_then(|a| a.watch_quota(&r));
        let r = r.into_inner();
        let group = self.group(r.group)?.clone();
        let max = holdfast_lock_table::limits::MAX_NAME_BYTES;
        if r.prefix.len() > max {
            return Err(limit(
                "max_name_bytes",
                max as u64,
                format!("a watch prefix is at most {max} bytes (max_name_bytes)"),
            ));
        }
        let exact = if r.exact {
            Some(self.lock_name(r.prefix.clone(), r.group)?)
        } else {
            None
        };
        if r.include_current && r.start_index != 0 {
            return Err(invalid(
                "include_current needs start_index 0: a resumed watch continues from its events",
            ));
        }
        if r.skip_events != 0 && r.start_index == 0 {
            return Err(invalid("skip_events needs a start_index"));
        }
        let slot = self.node.watches.take(principal).map_err(|f| {
            limit(
                f.limit,
                f.value,
                format!(
                    "{} watch streams are open ({}); close one first",
                    f.value, f.limit
                ),
            )
        })?;
        // The position, the current locks and everything after come from this group's leader after a
        // linearizable check, so "now" is at least as new as every change already acknowledged.
        group
            .linearizable_read()
            .await
            .map_err(|e| self.propose_error(e))?;
        let filter = crate::watch::Filter {
            prefix: r.prefix,
            exact: r.exact,
        };
        let (cursor, views, mut applied) = {
            let state = group.state.read().expect("state lock");
            let applied = state.history.applied();
            let cursor = match r.start_index {
                0 => crate::watch::Cursor {
                    index: applied + 1,
                    skip: 0,
                },
                start if start > applied + 1 => {
                    return Err(invalid(format!(
                        "start_index {start} is beyond group {}'s log (applied through {applied})",
                        r.group
                    )))
                }
                start if start <= state.history.floor() => {
                    return Err(errors::compacted(start, state.history.floor()))
                }
                start if start > applied && r.skip_events > 0 => {
                    return Err(invalid(format!(
                        "skip_events {} at start_index {start}: group {} has no events there yet",
                        r.skip_events, r.group
                    )))
                }
                start => crate::watch::Cursor {
                    index: start,
                    skip: r.skip_events as usize,
                },
            };
            let views = match (&exact, r.include_current) {
                (_, false) => Vec::new(),
                (Some(name), true) => state.table.describe(name).into_iter().collect(),
                (None, true) => {
                    let views =
                        state
                            .table
                            .list_locks(&filter.prefix, None, crate::watch::MAX_CURRENT + 1);
                    if views.len() > crate::watch::MAX_CURRENT {
                        return Err(limit(
                            "max_watch_current",
                            crate::watch::MAX_CURRENT as u64,
                            format!("more than {} locks match {:?}: watch without include_current (and list them with ListLocks)", crate::watch::MAX_CURRENT, filter.prefix),
                        ));
                    }
                    views
                }
            };
            (cursor, views, state.applied_tx.subscribe())
        };
        let first = pb::WatchResponse {
            events: Vec::new(),
            through_index: cursor.index - 1,
            current: views
                .into_iter()
                .map(|v| self.lock_info(&group, v))
                .collect(),
        };
        let (tx, rx) = tokio::sync::mpsc::channel(WATCH_STREAM_BUFFER);
        let node = self.node.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let mut cursor = cursor;
            let mut last_sent = Instant::now();
            let mut tick = tokio::time::interval(WATCH_TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // Ticks in a row on which this server could not show that it leads with a quorum.
            let mut unconfirmed = 0;
            if tx.send(Ok(first)).await.is_err() {
                return;
            }
            // Sends this server's leader hint: the client resumes on the leader from its position.
            let not_leading = |group: &Group| {
                let leader = group.leader_hint(
                    group
                        .current_leader()
                        .filter(|id| *id != node.config.node_id),
                );
                let endpoint = leader.and_then(|id| node.client_endpoint(id));
                Err(not_leader(leader, endpoint.as_deref()))
            };
            loop {
                let read = {
                    let state = group.state.read().expect("state lock");
                    state
                        .history
                        .read(cursor, &filter, crate::watch::MAX_BATCH_EVENTS)
                };
                let batch = match read {
                    Ok(batch) => batch,
                    // A snapshot from the leader replaced this server's state: it is a follower
                    // that was behind, and the leader still has the events.
                    Err(gone) if !gone.evicted => {
                        let _ = tx.send(not_leading(&group)).await;
                        return;
                    }
                    Err(gone) => {
                        node.metrics.watches_cut_off.inc();
                        let _ = tx
                            .send(Err(errors::watch_too_slow(cursor.index, gone.floor)))
                            .await;
                        return;
                    }
                };
                cursor = batch.next;
                // At least one message a tick, so the client can tell a live stream from a silent one.
                let beat = last_sent.elapsed() >= WATCH_TICK;
                if !batch.events.is_empty() || beat {
                    node.metrics.watch_events.inc_by(batch.events.len() as u64);
                    let message = pb::WatchResponse {
                        events: batch.events.into_iter().map(watch_event).collect(),
                        through_index: batch.through,
                        current: Vec::new(),
                    };
                    if tx.send(Ok(message)).await.is_err() {
                        return;
                    }
                    last_sent = Instant::now();
                }
                if batch.more {
                    continue;
                }
                tokio::select! {
                    changed = applied.changed() => {
                        if changed.is_err() {
                            return;
                        }
                    }
                    _ = tick.tick() => {
                        // A server that cannot show it leads with a quorum (deposed, cut off from
                        // the others, or stopped) ends the stream within two ticks, so no watcher
                        // follows a server that no longer hears the cluster's changes.
                        unconfirmed = if group.quorum_confirmed() { 0 } else { unconfirmed + 1 };
                        if unconfirmed >= 2 {
                            let _ = tx.send(not_leading(&group)).await;
                            return;
                        }
                    }
                    () = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn status(
        &self,
        r: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        self.allow(
            &r,
            if r.get_ref().with_digest {
                Need::Admin
            } else {
                Need::Any
            },
        )?;
        Ok(Response::new(self.node.status(r.into_inner().with_digest)))
    }
}

fn watch_event((index, change): (u64, holdfast_lock_table::Change)) -> pb::WatchEvent {
    pb::WatchEvent {
        index,
        kind: crate::watch::kind(change.kind) as i32,
        name: change.name.as_str().to_string(),
        session_id: change.session.0,
        token: change.token.map_or(0, |t| t.0),
        value: change.value.into_vec(),
    }
}

fn membership_response(group: &Group) -> pb::MembershipResponse {
    let view = group.membership_view();
    pb::MembershipResponse {
        voters: view.voters,
        learners: view.learners,
        joint: view.joint,
    }
}

fn page_size(limit: u32) -> Result<usize, Status> {
    match limit {
        0 => Ok(DEFAULT_PAGE as usize),
        l if l > MAX_PAGE => Err(errors::limit(
            "max_page",
            MAX_PAGE as u64,
            format!("page of {l} is over the limit of {MAX_PAGE} (max_page)"),
        )),
        l => Ok(l as usize),
    }
}

#[allow(dead_code)]
fn assert_session_unknown_is_used(s: u64) -> Status {
    session_unknown(s)
}

/// A group's session secrets as a keepalive carries them.
enum Secrets<'a> {
    /// `session_secrets`: one field per session, or none at all.
    Each(&'a [prost::bytes::Bytes]),
    /// `packed_secrets`: 16 bytes per session.
    Packed(&'a [u8]),
    /// Both fields at once: refused.
    Both,
}

impl Secrets<'_> {
    /// One secret per id (none: every session without one), or INVALID_ARGUMENT.
    fn read(self, ids: usize) -> Result<Vec<u128>, Status> {
        match self {
            Secrets::Each(each) => {
                if !each.is_empty() && each.len() != ids {
                    return Err(invalid(format!(
                        "{} session secrets for {ids} session ids: send one per id, or none",
                        each.len()
                    )));
                }
                each.iter().map(|s| errors::session_secret(s)).collect()
            }
            Secrets::Packed(packed) => {
                if packed.len() != ids * 16 {
                    return Err(invalid(format!(
                        "packed_secrets is {} bytes for {ids} session ids: it must be 16 bytes per id",
                        packed.len()
                    )));
                }
                Ok(packed
                    .chunks_exact(16)
                    .map(|s| u128::from_be_bytes(s.try_into().expect("16 bytes")))
                    .collect())
            }
            Secrets::Both => Err(invalid(
                "a group's keepalive carries session_secrets and packed_secrets: send one or the other",
            )),
        }
    }
}

/// The result messages of a keepalive answered in full.
fn result_messages(session_ids: &[u64], renewed: Vec<KeepAlive>) -> Vec<pb::KeepAliveResult> {
    session_ids
        .iter()
        .zip(renewed)
        .map(|(&session_id, k)| match k {
            KeepAlive::Alive { ttl_ms } => pb::KeepAliveResult {
                session_id,
                alive: true,
                ttl_ms,
            },
            KeepAlive::Gone => pb::KeepAliveResult {
                session_id,
                alive: false,
                ttl_ms: 0,
            },
        })
        .collect()
}
