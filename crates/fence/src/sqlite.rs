//! Fenced transactions on SQLite (feature `sqlite`). See [`crate::sql`] for the pattern.

use crate::sql::{to_sql_token, Role, CHECK_AND_RAISE, RW_SCHEMA, SCHEMA, SEEN, SEEN_RW};
use crate::FenceError;
use rusqlite::{Connection, Transaction, TransactionBehavior};

fn db(e: rusqlite::Error) -> FenceError {
    FenceError::Database(e.to_string())
}

/// Creates the fencing table if it does not exist.
pub fn install(conn: &Connection) -> Result<(), FenceError> {
    conn.execute(SCHEMA, []).map_err(db)?;
    conn.execute(RW_SCHEMA, []).map_err(db)?;
    Ok(())
}

/// Runs `work` in a transaction that first checks `token` against the highest token seen for `resource`
/// and raises it. Refused with [`FenceError::Stale`] (and nothing written) if a newer holder has been here;
/// if `work` fails, the transaction (including the fence) is rolled back.
pub fn fenced_transaction<T>(
    conn: &mut Connection,
    resource: &str,
    token: u64,
    work: impl FnOnce(&Transaction<'_>) -> rusqlite::Result<T>,
) -> Result<T, FenceError> {
    let seen = |tx: &Transaction<'_>| {
        tx.query_row(SEEN, [resource], |r| r.get::<_, i64>(0))
            .map(|s| s as u64)
    };
    checked(conn, resource, token, CHECK_AND_RAISE, seen, work)
}

/// [`fenced_transaction`] for a holder of a shared lock: a `Reader` is refused only if a newer writer
/// has been here, a `Writer` if any newer holder has (see [`crate::sql::RW_SCHEMA`]).
pub fn fenced_rw_transaction<T>(
    conn: &mut Connection,
    resource: &str,
    token: u64,
    role: Role,
    work: impl FnOnce(&Transaction<'_>) -> rusqlite::Result<T>,
) -> Result<T, FenceError> {
    let seen = |tx: &Transaction<'_>| {
        tx.query_row(SEEN_RW, [resource], |r| Ok(role.seen(r.get(0)?, r.get(1)?)))
    };
    checked(conn, resource, token, role.check(), seen, work)
}

/// Runs `check` (1 row affected: passed), then `work`, in one transaction; `seen` names the mark a
/// refused check lost to.
fn checked<T>(
    conn: &mut Connection,
    resource: &str,
    token: u64,
    check: &str,
    seen: impl FnOnce(&Transaction<'_>) -> rusqlite::Result<u64>,
    work: impl FnOnce(&Transaction<'_>) -> rusqlite::Result<T>,
) -> Result<T, FenceError> {
    let sql_token = to_sql_token(token)?;
    // IMMEDIATE takes the write lock at BEGIN, so the check and the work are one serialized unit.
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(db)?;
    let changed = tx
        .execute(check, rusqlite::params![resource, sql_token])
        .map_err(db)?;
    if changed != 1 {
        return Err(FenceError::Stale {
            resource: resource.into(),
            token,
            seen: seen(&tx).map_err(db)?,
        });
    }
    let out = work(&tx).map_err(db)?;
    tx.commit().map_err(db)?;
    Ok(out)
}
