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
    let seen = |tx: &mut Transaction<'_>| {
        tx.query_one(SEEN, &[&resource])
            .map(|r| r.get::<_, i64>(0) as u64)
    };
    checked(client, resource, token, CHECK_AND_RAISE, seen, work)
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
    let seen = |tx: &mut Transaction<'_>| {
        tx.query_one(SEEN_RW, &[&resource])
            .map(|r| role.seen(r.get(0), r.get(1)))
    };
    checked(client, resource, token, role.check(), seen, work)
}

/// Runs `check` (1 row affected: passed), then `work`, in one transaction; `seen` names the mark a
/// refused check lost to.
fn checked<T>(
    client: &mut Client,
    resource: &str,
    token: u64,
    check: &str,
    seen: impl FnOnce(&mut Transaction<'_>) -> Result<u64, postgres::Error>,
    work: impl FnOnce(&mut Transaction<'_>) -> Result<T, postgres::Error>,
) -> Result<T, FenceError> {
    let sql_token = to_sql_token(token)?;
    let mut tx = client.transaction().map_err(db)?;
    let changed = tx.execute(check, &[&resource, &sql_token]).map_err(db)?;
    if changed != 1 {
        return Err(FenceError::Stale {
            resource: resource.into(),
            token,
            seen: seen(&mut tx).map_err(db)?,
        });
    }
    let out = work(&mut tx).map_err(db)?;
    tx.commit().map_err(db)?;
    Ok(out)
}
