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

#[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
pub(crate) fn to_sql_token(token: u64) -> Result<i64, crate::FenceError> {
    i64::try_from(token)
        .map_err(|_| crate::FenceError::Invalid(format!("token {token} does not fit a BIGINT")))
}
