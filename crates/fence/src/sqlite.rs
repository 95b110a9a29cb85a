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

/// [`fenced_transaction`] for a holder of a shared lock: a `Reader` is refused only if a newer writer
/// has been here, a `Writer` if any newer holder has (see [`crate::sql::RW_SCHEMA`]).
pub fn fenced_rw_transaction<T>(
    conn: &mut Connection,
    resource: &str,
    token: u64,
    role: Role,
    work: impl FnOnce(&Transaction<'_>) -> rusqlite::Result<T>,
) -> Result<T, FenceError> {
    let sql_token = to_sql_token(token)?;
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(db)?;
    let changed = tx
        .execute(role.check(), rusqlite::params![resource, sql_token])
        .map_err(db)?;
    if changed != 1 {
        let (any, write): (i64, i64) = tx
            .query_row(SEEN_RW, [resource], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(db)?;
        return Err(FenceError::Stale {
            resource: resource.into(),
            token,
            seen: role.seen(any, write),
        });
    }
    let out = work(&tx).map_err(db)?;
    tx.commit().map_err(db)?;
    Ok(out)
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
    let sql_token = to_sql_token(token)?;
    // IMMEDIATE takes the write lock at BEGIN, so the check and the work are one serialized unit.
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(db)?;
    let changed = tx
        .execute(CHECK_AND_RAISE, rusqlite::params![resource, sql_token])
        .map_err(db)?;
    if changed != 1 {
        let seen: i64 = tx.query_row(SEEN, [resource], |r| r.get(0)).map_err(db)?;
        return Err(FenceError::Stale {
            resource: resource.into(),
            token,
            seen: seen as u64,
        });
    }
    let out = work(&tx).map_err(db)?;
    tx.commit().map_err(db)?;
    Ok(out)
}
