//! Client errors, decoded from the server's status and its machine-readable `ErrorDetail`.

use holdfast_proto::v1::{ErrorDetail, Reason};
use prost::Message;

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A try-acquire found the lock held, or a wait ran out.
    #[error("{message}")]
    LockHeld {
        holder_session: u64,
        token: u64,
        message: String,
    },
    /// The session is gone (closed or expired): its locks are released.
    #[error("{0}")]
    SessionUnknown(String),
    /// A release with a token that is not the current grant's.
    #[error("{message}")]
    StaleToken { current: u64, message: String },
    #[error("{0}")]
    NotHolder(String),
    #[error("{0}")]
    AlreadyHeld(String),
    #[error("{message}")]
    LimitExceeded {
        limit: String,
        value: u64,
        message: String,
    },
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    RequestIdTooOld(String),
    /// The request did not carry the session's secret. Nothing changed.
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// The acquire was cancelled ([`crate::Session::cancel_acquire`]) before this retry of it: nothing is
    /// held or queued for it any more (a grant it had may have been visible until then).
    #[error("{0}")]
    Abandoned(String),
    /// The acquire asked for a semaphore of another size, or a lock while the name is a semaphore, or
    /// the other way round: `permits` is what the name is now (0: a lock). Nothing changed.
    #[error("{message}")]
    PermitsMismatch { permits: u32, message: String },
    /// A watch's position is older than the events the servers keep (or its stream fell so far behind
    /// that they were dropped): read the current state and watch from now.
    #[error("{0}")]
    Compacted(String),
    /// No server could complete the request in time; the outcome may be unknown.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The session's lease may have expired on the server (the client could not renew it in time). From
    /// an acquire, the grant (if one arrived) was not returned and is released; the outcome counts as
    /// unknown, since another client may have seen the grant meanwhile.
    #[error("session lease lost: {0}")]
    LeaseLost(String),
    #[error("{0}")]
    Other(String),
}

impl Error {
    /// True if the request certainly was not applied. False if it may have been: the client retries
    /// with the same request id, so an earlier attempt can have been applied before a later one failed
    /// (a retried acquire can be granted, then meet SESSION_UNKNOWN because the session expired since).
    /// For that reason a refusal that can change between attempts (the access policy, the calls in
    /// flight) that meets a retry after an attempt with an unknown outcome comes back as
    /// [`Error::Unavailable`], not as itself.
    pub fn not_applied(&self) -> bool {
        matches!(
            self,
            Error::LockHeld { .. }
                | Error::AlreadyHeld(_)
                | Error::LimitExceeded { .. }
                | Error::InvalidArgument(_)
                | Error::StaleToken { .. }
                | Error::NotHolder(_)
                | Error::PermissionDenied(_)
                | Error::PermitsMismatch { .. }
        )
    }
}

/// Limits a server checks before the lock table that depend on more than the request: the calls its
/// connection has in flight at the moment.
const LIMITS_OF_THE_MOMENT: [&str; 2] = ["max_calls_per_connection", "max_calls_per_stream"];

/// True for a refusal a server makes before the request reaches the lock table, on grounds that can
/// change between two attempts of one request: the access policy (`ACCESS_DENIED`; a reload changes
/// it) and the limits on calls in flight. A retry can meet one while an earlier attempt, whose answer
/// never arrived, was applied (queued or granted): such a refusal speaks for the retry only. Every
/// other refusal either refuses every attempt alike (checks of the request's own fields, its session's
/// secret) or is the lock table's answer, which the table gives a request id it has seen from its
/// deduplication window: either way the request's own outcome.
pub(crate) fn refused_for_now(status: &tonic::Status) -> bool {
    let Some(d) = ErrorDetail::decode(status.details()).ok() else {
        return false;
    };
    match Reason::try_from(d.reason) {
        Ok(Reason::AccessDenied) => true,
        Ok(Reason::LimitExceeded) => LIMITS_OF_THE_MOMENT.contains(&d.limit.as_str()),
        _ => false,
    }
}

/// What the retry loop should do with a failed attempt.
pub(crate) enum Disposition {
    /// Try the leader at this endpoint.
    Redirect(String),
    /// Try another server after a backoff.
    Retry(String),
    Fail(Error),
}

pub(crate) fn classify(status: &tonic::Status) -> Disposition {
    let detail = ErrorDetail::decode(status.details())
        .ok()
        .filter(|d| d.reason != 0);
    let msg = status.message().to_string();
    let Some(d) = detail else {
        return match status.code() {
            tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Cancelled
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Internal => Disposition::Retry(format!("{}: {msg}", status.code())),
            tonic::Code::InvalidArgument => Disposition::Fail(Error::InvalidArgument(msg)),
            _ => Disposition::Fail(Error::Other(format!("{}: {msg}", status.code()))),
        };
    };
    match Reason::try_from(d.reason).unwrap_or(Reason::Unspecified) {
        Reason::NotLeader if !d.leader_endpoint.is_empty() => {
            Disposition::Redirect(d.leader_endpoint)
        }
        Reason::NotLeader | Reason::Unavailable | Reason::Unspecified => Disposition::Retry(msg),
        Reason::SessionUnknown => Disposition::Fail(Error::SessionUnknown(msg)),
        Reason::LockHeld => Disposition::Fail(Error::LockHeld {
            holder_session: d.holder_session_id,
            token: d.current_token,
            message: msg,
        }),
        Reason::StaleToken => Disposition::Fail(Error::StaleToken {
            current: d.current_token,
            message: msg,
        }),
        Reason::NotHolder => Disposition::Fail(Error::NotHolder(msg)),
        Reason::LimitExceeded => Disposition::Fail(Error::LimitExceeded {
            limit: d.limit,
            value: d.limit_value,
            message: msg,
        }),
        Reason::InvalidArgument | Reason::WrongGroup => {
            Disposition::Fail(Error::InvalidArgument(msg))
        }
        Reason::AlreadyHeld => Disposition::Fail(Error::AlreadyHeld(msg)),
        Reason::RequestIdTooOld => Disposition::Fail(Error::RequestIdTooOld(msg)),
        Reason::RequestIdTooNew => Disposition::Fail(Error::InvalidArgument(msg)),
        Reason::PermissionDenied | Reason::AccessDenied => {
            Disposition::Fail(Error::PermissionDenied(msg))
        }
        Reason::AcquireAbandoned => Disposition::Fail(Error::Abandoned(msg)),
        Reason::Compacted | Reason::WatchTooSlow => Disposition::Fail(Error::Compacted(msg)),
        Reason::PermitsMismatch => Disposition::Fail(Error::PermitsMismatch {
            permits: u32::try_from(d.limit_value).unwrap_or(u32::MAX),
            message: msg,
        }),
    }
}
