//! How refusals become gRPC statuses: a code, a lowercase message naming the thing and the limit, and an
//! [`ErrorDetail`] with a machine-readable [`Reason`] in the status details (and `holdfast-reason` metadata).

use holdfast_lock_table::{command::Limit, NameError, Refusal};
use holdfast_proto::v1::{ErrorDetail, Reason};
use prost::Message;
use tonic::{Code, Status};

pub fn status(
    code: Code,
    reason: Reason,
    message: impl Into<String>,
    detail: ErrorDetail,
) -> Status {
    let detail = ErrorDetail {
        reason: reason as i32,
        ..detail
    };
    let mut status = Status::with_details(code, message.into(), detail.encode_to_vec().into());
    if let Ok(v) = reason.as_str_name().parse() {
        status
            .metadata_mut()
            .insert(holdfast_proto::REASON_METADATA_KEY, v);
    }
    status
}

pub fn invalid(message: impl Into<String>) -> Status {
    status(
        Code::InvalidArgument,
        Reason::InvalidArgument,
        message,
        ErrorDetail::default(),
    )
}

pub fn limit(name: &str, value: u64, message: impl Into<String>) -> Status {
    status(
        Code::ResourceExhausted,
        Reason::LimitExceeded,
        message,
        ErrorDetail {
            limit: name.into(),
            limit_value: value,
            ..Default::default()
        },
    )
}

pub fn not_leader(leader_id: Option<u64>, leader_endpoint: Option<&str>) -> Status {
    let msg = match leader_endpoint {
        Some(ep) => format!(
            "not the leader; the leader is node {} at {ep}",
            leader_id.unwrap_or(0)
        ),
        None => {
            "not the leader, and no leader is known yet (an election is under way); retry shortly"
                .into()
        }
    };
    status(
        Code::Unavailable,
        Reason::NotLeader,
        msg,
        ErrorDetail {
            leader_id: leader_id.unwrap_or(0),
            leader_endpoint: leader_endpoint.unwrap_or_default().into(),
            ..Default::default()
        },
    )
}

pub fn unavailable(message: impl Into<String>) -> Status {
    status(
        Code::Unavailable,
        Reason::Unavailable,
        message,
        ErrorDetail::default(),
    )
}

pub fn session_unknown(session: u64) -> Status {
    status(
        Code::NotFound,
        Reason::SessionUnknown,
        format!("session {session} does not exist (never opened, closed, or expired)"),
        ErrorDetail::default(),
    )
}

pub fn name_error(e: NameError) -> Status {
    match e {
        NameError::TooLong { len } => limit(
            "max_name_bytes",
            holdfast_lock_table::limits::MAX_NAME_BYTES as u64,
            format!(
                "lock name is {len} bytes, over the limit of {} bytes (max_name_bytes)",
                holdfast_lock_table::limits::MAX_NAME_BYTES
            ),
        ),
        other => invalid(other.to_string()),
    }
}

/// Maps a replicated refusal to a status. `session` and `name` are for the message.
pub fn refusal(r: Refusal, session: u64, name: &str) -> Status {
    match r {
        Refusal::UnknownSession => session_unknown(session),
        Refusal::Held { holder, token } => status(
            Code::Aborted,
            Reason::LockHeld,
            if holder.0 == 0 {
                format!("lock {name:?} is in its lock-delay: the session holding it with token {token} expired, and nobody gets it until the delay ends")
            } else {
                format!("lock {name:?} is held by session {holder} with token {token}")
            },
            ErrorDetail { holder_session_id: holder.0, current_token: token.0, ..Default::default() },
        ),
        Refusal::AlreadyHolder { token } => status(
            Code::AlreadyExists,
            Reason::AlreadyHeld,
            format!("session {session} already holds lock {name:?} with token {token}"),
            ErrorDetail { holder_session_id: session, current_token: token.0, ..Default::default() },
        ),
        Refusal::AlreadyWaiting => status(
            Code::AlreadyExists,
            Reason::AlreadyHeld,
            format!("session {session} already waits for lock {name:?} under another request id"),
            ErrorDetail::default(),
        ),
        Refusal::NotHolder => status(
            Code::FailedPrecondition,
            Reason::NotHolder,
            format!("session {session} does not hold lock {name:?}"),
            ErrorDetail::default(),
        ),
        Refusal::StaleToken { current } => status(
            Code::FailedPrecondition,
            Reason::StaleToken,
            format!("stale token for lock {name:?}: the current grant's token is {current}"),
            ErrorDetail { current_token: current.0, ..Default::default() },
        ),
        Refusal::NotWaiting => status(
            Code::FailedPrecondition,
            Reason::NotHolder,
            format!("session {session} is not waiting for lock {name:?}"),
            ErrorDetail::default(),
        ),
        Refusal::InvalidTtl { ttl_ms } => invalid(format!("ttl {ttl_ms} ms is outside the allowed range")),
        Refusal::LimitExceeded(l) => limit_exceeded(l),
        Refusal::QuotaExceeded { quota, value } => limit(
            quota.name(),
            value,
            match quota {
                holdfast_lock_table::QuotaKind::Sessions => format!(
                    "the principal's quota of {value} sessions is used up ({}, in the access policy)",
                    quota.name()
                ),
                holdfast_lock_table::QuotaKind::Locks => format!(
                    "the principal's sessions already hold or wait for {value} locks, its quota ({}, in the access policy)",
                    quota.name()
                ),
                holdfast_lock_table::QuotaKind::Waiting => format!(
                    "the principal's sessions already wait for {value} locks, its quota ({}, in the access policy)",
                    quota.name()
                ),
            },
        ),
        Refusal::RequestIdTooOld => status(
            Code::FailedPrecondition,
            Reason::RequestIdTooOld,
            format!(
                "request id is older than the last {} requests of session {session} (dedup_window); use a new request id",
                holdfast_lock_table::limits::DEDUP_WINDOW
            ),
            ErrorDetail::default(),
        ),
        Refusal::PermissionDenied => permission_denied(session),
        Refusal::PermitsMismatch { permits } => status(
            Code::FailedPrecondition,
            Reason::PermitsMismatch,
            if permits == 0 {
                format!("{name:?} is a lock, not a semaphore: acquire it without permits")
            } else {
                format!("{name:?} is a semaphore of {permits} permits: acquire it with permits {permits} (the number is fixed while it is held or waited for)")
            },
            ErrorDetail { limit_value: u64::from(permits), ..Default::default() },
        ),
        Refusal::InvalidPermits { permits } => invalid(format!(
            "permits {permits} is outside 1 to {} (max_holders_per_lock)",
            holdfast_lock_table::limits::MAX_HOLDERS_PER_LOCK
        )),
        Refusal::TableFull { budget, used } => limit(
            "max_table_bytes",
            budget,
            format!("the group's lock table is full: it is charged {used} of its {budget} bytes (max_table_bytes; the servers' --table-budget-mib); release locks or close sessions, or raise the budget"),
        ),
        Refusal::RequestIdTooNew { highest } => status(
            Code::InvalidArgument,
            Reason::RequestIdTooNew,
            format!(
                "request id is more than {} above session {session}'s highest ({highest}) (max_request_id_ahead); number requests 1, 2, 3, ...",
                holdfast_lock_table::limits::MAX_REQUEST_ID_AHEAD
            ),
            ErrorDetail::default(),
        ),
    }
}

/// A request without the session's secret. The message names the session, never a secret.
pub fn permission_denied(session: u64) -> Status {
    status(
        Code::PermissionDenied,
        Reason::PermissionDenied,
        format!("session {session}: the request does not carry the session's secret (session_secret), so it may not act on it"),
        ErrorDetail::default(),
    )
}

/// The secret a request shows: empty is none (0), otherwise exactly 16 bytes, big-endian.
pub fn session_secret(bytes: &[u8]) -> Result<u128, Status> {
    match bytes.len() {
        0 => Ok(0),
        16 => Ok(u128::from_be_bytes(bytes.try_into().expect("16 bytes"))),
        n => Err(invalid(format!(
            "session_secret is {n} bytes; it must be the 16 bytes OpenSession returned"
        ))),
    }
}

/// A secret as requests carry it: none (0) is empty.
pub fn secret_bytes(secret: u128) -> Vec<u8> {
    if secret == 0 {
        Vec::new()
    } else {
        secret.to_be_bytes().to_vec()
    }
}

pub fn limit_exceeded(l: Limit) -> Status {
    limit(
        l.name(),
        l.value() as u64,
        format!("limit exceeded: {} is {}", l.name(), l.value()),
    )
}

/// Decodes the [`ErrorDetail`] of a status (for clients and tests).
pub fn detail(status: &Status) -> Option<ErrorDetail> {
    ErrorDetail::decode(status.details()).ok()
}

/// A watch asked for events this server no longer keeps.
pub fn compacted(start: u64, floor: u64) -> Status {
    status(
        Code::OutOfRange,
        Reason::Compacted,
        format!("the events from index {start} are no longer kept on this server (it keeps those after index {floor}): read the current state and watch from now"),
        ErrorDetail::default(),
    )
}

/// A watch stream fell behind the kept history.
pub fn watch_too_slow(next: u64, floor: u64) -> Status {
    status(
        Code::ResourceExhausted,
        Reason::WatchTooSlow,
        format!("this watch stream fell too far behind: the events from index {next} it had not read yet were dropped (the server keeps those after index {floor}); read the current state and watch from now"),
        ErrorDetail::default(),
    )
}
