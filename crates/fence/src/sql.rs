//! Fencing a SQL database: a fencing table, updated first, in the same transaction as the protected work.
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS holdfast_fence (resource TEXT PRIMARY KEY, token BIGINT NOT NULL);
//!
//! BEGIN;                                  -- SQLite: BEGIN IMMEDIATE
//! INSERT INTO holdfast_fence (resource, token) VALUES ($1, $2)
//!   ON CONFLICT (resource) DO UPDATE SET token = excluded.token
//!   WHERE holdfast_fence.token <= excluded.token;
//! -- 0 rows affected: a newer holder has been here. ROLLBACK and stop acting as the holder.
//! -- 1 row affected: this transaction now holds the fence row until it ends; do the reads and writes.
//! COMMIT;
//! ```
//!
//! Why this fences the whole read-modify-write: the upsert locks the fence row (PostgreSQL row lock;
//! SQLite's write lock for the whole database), so transactions of two holders of the same resource are
//! serialized, and each one checks its token against every token that committed before it. A stale
//! holder's transaction either runs entirely before the new holder's (then the new holder reads its
//! result) or fails its check and changes nothing. A token column checked only on `UPDATE` would fence
//! writes but not reads, and loses updates (see the crate docs).
//!
//! The token is a Holdfast token (a positive 63-bit integer in practice: a Raft log index), stored as a
//! signed `BIGINT`.

/// Creates the fencing table.
pub const SCHEMA: &str =
    "CREATE TABLE IF NOT EXISTS holdfast_fence (resource TEXT PRIMARY KEY, token BIGINT NOT NULL)";

/// Raises the fence of `resource` ($1) to `token` ($2) if no higher token was seen; 1 row affected
/// means the check passed. Portable between PostgreSQL (numbered parameters) and SQLite (which accepts
/// `$1`-style parameters too).
pub const CHECK_AND_RAISE: &str = "INSERT INTO holdfast_fence (resource, token) VALUES ($1, $2) \
     ON CONFLICT (resource) DO UPDATE SET token = excluded.token WHERE holdfast_fence.token <= excluded.token";

/// Reads the highest token seen for `resource` ($1), to name it in an error.
pub const SEEN: &str = "SELECT token FROM holdfast_fence WHERE resource = $1";

/// For a shared lock (docs/api.md, "Shared locks and semaphores"): per resource the highest token seen
/// from anyone (`any_token`) and from a writer (`write_token`).
///
/// ```sql
/// -- a writer (exclusive holder): no newer reader or writer was here
/// INSERT INTO holdfast_fence_rw VALUES ($1, $2, $2) ON CONFLICT (resource) DO UPDATE
///   SET any_token = excluded.any_token, write_token = excluded.write_token
///   WHERE holdfast_fence_rw.any_token <= excluded.any_token;
/// -- a reader (shared holder): no newer writer was here; raise any_token
/// INSERT INTO holdfast_fence_rw VALUES ($1, $2, 0) ON CONFLICT (resource) DO UPDATE
///   SET any_token = CASE WHEN holdfast_fence_rw.any_token > excluded.any_token
///                        THEN holdfast_fence_rw.any_token ELSE excluded.any_token END
///   WHERE holdfast_fence_rw.write_token < excluded.any_token;
/// ```
///
/// Like [`CHECK_AND_RAISE`], each statement locks the fence row for the rest of its transaction, so a
/// reader's transaction and a writer's are serialized (readers serialize among themselves too: the
/// price of checking both marks in one row).
pub const RW_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS holdfast_fence_rw (resource TEXT PRIMARY KEY, any_token BIGINT NOT NULL, write_token BIGINT NOT NULL)";

/// A writer's check on `resource` ($1) with `token` ($2); 1 row affected means it passed.
pub const CHECK_WRITER: &str = "INSERT INTO holdfast_fence_rw (resource, any_token, write_token) VALUES ($1, $2, $2) \
     ON CONFLICT (resource) DO UPDATE SET any_token = excluded.any_token, write_token = excluded.write_token \
     WHERE holdfast_fence_rw.any_token <= excluded.any_token";

/// A reader's check on `resource` ($1) with `token` ($2); 1 row affected means it passed.
pub const CHECK_READER: &str = "INSERT INTO holdfast_fence_rw (resource, any_token, write_token) VALUES ($1, $2, 0) \
     ON CONFLICT (resource) DO UPDATE SET any_token = CASE WHEN holdfast_fence_rw.any_token > excluded.any_token \
     THEN holdfast_fence_rw.any_token ELSE excluded.any_token END \
     WHERE holdfast_fence_rw.write_token < excluded.any_token";

/// The marks of `resource` ($1): (any_token, write_token), to name the one a refused check lost to.
pub const SEEN_RW: &str =
    "SELECT any_token, write_token FROM holdfast_fence_rw WHERE resource = $1";

/// Which holder of a shared lock a fenced transaction runs for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A shared holder: refused only after a newer writer.
    Reader,
    /// The exclusive holder: refused after any newer holder.
    Writer,
}

#[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
impl Role {
    pub(crate) fn check(self) -> &'static str {
        match self {
            Role::Reader => CHECK_READER,
            Role::Writer => CHECK_WRITER,
        }
    }

    /// The mark a refused check lost to.
    pub(crate) fn seen(self, any_token: i64, write_token: i64) -> u64 {
        match self {
            Role::Reader => write_token as u64,
            Role::Writer => any_token as u64,
        }
    }
}

#[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
/// The token as a BIGINT. 0 is refused: Holdfast's tokens start at 1, so a 0 is a caller that lost its
/// token, and it would pass on every resource not fenced yet.
pub(crate) fn to_sql_token(token: u64) -> Result<i64, crate::FenceError> {
    if token == 0 {
        return Err(crate::FenceError::Invalid(
            "token 0 is not a Holdfast token (they start at 1)".into(),
        ));
    }
    i64::try_from(token)
        .map_err(|_| crate::FenceError::Invalid(format!("token {token} does not fit a BIGINT")))
}
