//! Fenced transactions on PostgreSQL (feature `postgres`). See [`crate::sql`] for the pattern.

use crate::sql::{to_sql_token, Role, CHECK_AND_RAISE, RW_SCHEMA, SCHEMA, SEEN, SEEN_RW};
use crate::FenceError;
use postgres::{Client, Transaction};

fn db(e: postgres::Error) -> FenceError {
    FenceError::Database(e.to_string())
}

/// Creates the fencing table if it does not exist.
pub fn install(client: &mut Client) -> Result<(), FenceError> {
    client.batch_execute(SCHEMA).map_err(db)?;
    client.batch_execute(RW_SCHEMA).map_err(db)
}

/// [`fenced_transaction`] for a holder of a shared lock: a `Reader` is refused only if a newer writer
/// has been here, a `Writer` if any newer holder has (see [`crate::sql::RW_SCHEMA`]).
pub fn fenced_rw_transaction<T>(
    client: &mut Client,
    resource: &str,
    token: u64,
    role: Role,
    work: impl FnOnce(&mut Transaction<'_>) -> Result<T, postgres::Error>,
) -> Result<T, FenceError> {
    let sql_token = to_sql_token(token)?;
    let mut tx = client.transaction().map_err(db)?;
    let changed = tx
        .execute(role.check(), &[&resource, &sql_token])
        .map_err(db)?;
    if changed != 1 {
        let row = tx.query_one(SEEN_RW, &[&resource]).map_err(db)?;
        return Err(FenceError::Stale {
            resource: resource.into(),
            token,
            seen: role.seen(row.get(0), row.get(1)),
        });
    }
    let out = work(&mut tx).map_err(db)?;
    tx.commit().map_err(db)?;
    Ok(out)
}

/// Runs `work` in a transaction that first checks `token` against the highest token seen for `resource`
/// and raises it (holding the fence row's lock until the transaction ends). Refused with
/// [`FenceError::Stale`] (and nothing written) if a newer holder has been here; if `work` fails, the
/// transaction (including the fence) is rolled back.
pub fn fenced_transaction<T>(
    client: &mut Client,
    resource: &str,
    token: u64,
    work: impl FnOnce(&mut Transaction<'_>) -> Result<T, postgres::Error>,
) -> Result<T, FenceError> {
    let sql_token = to_sql_token(token)?;
    let mut tx = client.transaction().map_err(db)?;
    let changed = tx
        .execute(CHECK_AND_RAISE, &[&resource, &sql_token])
        .map_err(db)?;
    if changed != 1 {
        let seen: i64 = tx.query_one(SEEN, &[&resource]).map_err(db)?.get(0);
        return Err(FenceError::Stale {
            resource: resource.into(),
            token,
            seen: seen as u64,
        });
    }
    let out = work(&mut tx).map_err(db)?;
    tx.commit().map_err(db)?;
    Ok(out)
}
