//! Every bound the lock table enforces. Exceeding one gives a [`crate::Refusal::LimitExceeded`] naming it
//! and changes nothing. The server enforces the request-level limits (request size, batch size) before a
//! command reaches the log.

/// Longest lock name in bytes. Lock names are identifiers, not payloads; 256 bytes fits any path-like name
/// and keeps a lock entry near the design's ~100 bytes for typical names.
pub const MAX_NAME_BYTES: usize = 256;

/// Shortest session TTL. Below 2 s a keepalive every TTL/3 is under 700 ms and a single GC pause or a
/// leader election (about 1 s here) would expire healthy sessions.
pub const MIN_TTL_MS: u64 = 2_000;

/// Longest session TTL. A crashed holder's locks stay taken for up to TTL (plus one more TTL after a
/// failover); five minutes is the most an operator should ever wait for that.
pub const MAX_TTL_MS: u64 = 300_000;

/// TTL used when a client asks for none (the design's 10 s: two heartbeats at 3 s may be lost).
pub const DEFAULT_TTL_MS: u64 = 10_000;

/// Locks a session may hold plus wait for at once. Bounds the work of expiring one session (one log
/// entry releases them all) and stops one client from filling the table.
pub const MAX_LOCKS_PER_SESSION: usize = 10_000;

/// Sessions one [`crate::Command::ExpireSessions`] entry may expire. Together with its bound on work (at
/// most [`MAX_LOCKS_PER_SESSION`] locks and waits in all, what one session's expiry may release) it keeps
/// one entry's apply as short as one session's expiry; a mass expiry (a client fleet gone at once) then
/// takes one entry per thousand sessions instead of one per session.
pub const MAX_EXPIRY_BATCH: usize = 1_000;

/// Waiters in one lock's FIFO queue. Beyond this a lock is badly contended and queuing longer only
/// grows latency; the client gets a clear error and can back off.
pub const MAX_WAITERS_PER_LOCK: usize = 1_000;

/// Live sessions per group. The design holds 100,000 sessions; twice that leaves headroom.
pub const MAX_SESSIONS: usize = 200_000;

/// Locks (held or with waiters) per group. The design holds 1,000,000 at ~100 B each; four times that is
/// still under 1 GiB of memory per server.
pub const MAX_LOCKS: usize = 4_000_000;

/// Outcomes remembered per session for request-id deduplication. A client with at most this many
/// requests in flight per session always gets its first outcome back on retry. 16 keeps the memory of
/// 100,000 sessions' windows under 40 MB.
pub const DEDUP_WINDOW: usize = 16;

/// How far above the highest request id a session has used a new one may be. A request further ahead is
/// refused (`RequestIdTooNew`) and remembered nowhere, so that no request (not even the owner's, with an
/// id near `u64::MAX`) can push the window up so far that the ids a client uses next are "too old". A
/// client numbers its requests 1, 2, 3, ...: it would need this many requests in flight at once to hit it.
pub const MAX_REQUEST_ID_AHEAD: u64 = 1 << 20;

/// Open-session nonces are remembered for this many sessions, so a retried `OpenSession` returns the
/// same session instead of opening a second one.
pub const OPEN_NONCE_WINDOW: usize = 4_096;

/// Largest value stored with a grant (leader election's leader value). Small, because it lives in every
/// replica's memory for as long as the lock is held.
pub const MAX_VALUE_BYTES: usize = 1024;

/// Longest lock-delay ([`crate::Command::WithLockDelay`]). Chubby's default is one minute: enough for a
/// resource that cannot check tokens to see an expired holder's last request drain, and the longest a
/// dead holder's lock should stay unusable after its TTL already ran out.
pub const MAX_LOCK_DELAY_MS: u32 = 60_000;

/// Holders of one lock at once: shared holders of a lock, or permits of a semaphore. A reader beyond it
/// waits (a try is refused); a semaphore of more permits is refused. Each holder is a grant the lock
/// keeps (about 64 bytes) and releasing one searches them, so the bound keeps both small; a thousand
/// concurrent readers of one name is already more than any lock use we know.
pub const MAX_HOLDERS_PER_LOCK: usize = 1_000;

/// What the table charges against its memory budget ([`crate::Command::SetTableBudget`]) for one
/// session: the session record, its deduplication window when full ([`DEDUP_WINDOW`] outcomes) and its
/// map entries. An estimate of the allocator's real use when it was set, fixed so that every replica
/// computes the same total; the table has shrunk since, and the budget as a whole (this and the
/// per-lock charges below) now charges more than twice what a server holding the design's load uses
/// (`docs/operations.md`, "Sizing").
pub const SESSION_BYTES: u64 = 1_024;

/// Charged for one lock besides its grants and waits: the map entry, the shared name's allocation and
/// the lock record. The name's bytes are charged on top.
pub const LOCK_BYTES: u64 = 192;

/// Charged for one grant or one wait (they cost the same, so granting a waiter changes nothing): the
/// record and its entry in the session's sets. The grant's value bytes are charged on top.
pub const GRANT_BYTES: u64 = 96;
