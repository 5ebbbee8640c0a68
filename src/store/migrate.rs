//! The migrations: idem's own (`sql/`, embedded) and each handler's, applied
//! in order under an advisory lock so that instances starting together do
//! not race, and tracked apart (`idem_schema_migrations`,
//! `idem_handler_migrations`) so that each can evolve.

use std::time::Duration;

use deadpool_postgres::{Pool, Transaction};
use tokio_util::sync::CancellationToken;

use super::StoreError;
use crate::handler::{Handler, Migration};

macro_rules! migration {
    ($version:literal, $name:literal) => {
        Migration {
            version: $version,
            name: $name,
            sql: include_str!(concat!("../../sql/", $name)),
        }
    };
}

/// idem's own migrations, oldest first.
pub const MIGRATIONS: &[Migration] = &[
    migration!(1, "0001_consume_record_and_points.sql"),
    migration!(2, "0002_failure_ledger.sql"),
    migration!(3, "0003_handler_migrations.sql"),
    migration!(4, "0004_outbox.sql"),
    migration!(5, "0005_consume_record_epochs.sql"),
    migration!(6, "0006_consume_record_digest_key.sql"),
    migration!(7, "0007_epoch_filters.sql"),
    migration!(8, "0008_claim_fast_paths.sql"),
    migration!(9, "0009_claim_one_event.sql"),
    migration!(10, "0010_dead_letter_index.sql"),
    migration!(11, "0011_dead_letter_summary_tally.sql"),
    migration!(12, "0012_closed_epochs_refuse_records.sql"),
    migration!(13, "0013_given_up_messages.sql"),
];

/// The newest version of `migrations`; 0 for none.
pub fn latest(migrations: &[Migration]) -> i32 {
    migrations.last().map_or(0, |m| m.version)
}

/// Why migrating failed.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// The database failed or refused a statement.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The database did not answer, or refused us.
    #[error(transparent)]
    Ready(#[from] super::ReadyError),
    /// A handler's migrations are not numbered 1, 2, 3 … or its name is
    /// unusable: a mistake in its code.
    #[error("handler {handler}: {problem}")]
    Handler {
        /// The handler.
        handler: &'static str,
        /// What is wrong.
        problem: String,
    },
}

impl From<tokio_postgres::Error> for MigrateError {
    fn from(error: tokio_postgres::Error) -> Self {
        Self::Store(error.into())
    }
}

/// [`run`], once PostgreSQL answers: waits for it as the worker does, for
/// at most `patience`.
pub async fn run_when_ready<H: Handler>(
    server: &str,
    pool: &Pool,
    schema: Option<&str>,
    patience: Duration,
    shutdown: &CancellationToken,
) -> Result<Vec<String>, MigrateError> {
    // The first connection tells whether the database answers; the
    // migrations then run on it at once.
    let answered = super::until_answered(server, patience, shutdown, || async {
        Ok(pool.get().await?)
    })
    .await?;
    drop(answered);
    run::<H>(pool, schema).await
}

/// Key of the advisory lock that serializes migrations ("idem" in ASCII).
const LOCK_KEY: i64 = 0x6964_656d;

const CREATE_HISTORY: &str = "\
    CREATE TABLE IF NOT EXISTS idem_schema_migrations (\
        version    INTEGER PRIMARY KEY, \
        name       TEXT NOT NULL, \
        applied_at TIMESTAMPTZ NOT NULL DEFAULT now())";

/// Applies, in one transaction, idem's migrations not yet applied and then
/// handler `H`'s, and returns their names (a handler's prefixed with its
/// name). Creates `schema` first when one is given.
///
/// Safe to run again (it applies nothing) and from several processes at once
/// (the second waits for the first, then applies nothing). A database that
/// runs several handlers is migrated once per handler.
pub async fn run<H: Handler>(
    pool: &Pool,
    schema: Option<&str>,
) -> Result<Vec<String>, MigrateError> {
    check_handler::<H>()?;
    let mut client = pool.get().await.map_err(StoreError::from)?;
    let tx = client.transaction().await?;
    // A migration may rebuild a large table, and waits its turn behind
    // another instance's: no timeout of the worker's sessions applies.
    tx.batch_execute("SET LOCAL lock_timeout = 0; SET LOCAL statement_timeout = 0")
        .await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK_KEY])
        .await?;
    if let Some(schema) = schema {
        // The name was checked to be a plain identifier when the pool was made.
        tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
            .await?;
    }
    tx.batch_execute(CREATE_HISTORY).await?;
    let mut applied = Vec::new();
    let done = versions(&tx, "SELECT version FROM idem_schema_migrations", &[]).await?;
    for migration in MIGRATIONS.iter().filter(|m| !done.contains(&m.version)) {
        tx.batch_execute(migration.sql).await?;
        tx.execute(
            "INSERT INTO idem_schema_migrations (version, name) VALUES ($1, $2)",
            &[&migration.version, &migration.name],
        )
        .await?;
        applied.push(migration.name.to_owned());
    }
    let done = versions(
        &tx,
        "SELECT version FROM idem_handler_migrations WHERE handler = $1",
        &[&H::NAME],
    )
    .await?;
    for migration in H::MIGRATIONS.iter().filter(|m| !done.contains(&m.version)) {
        tx.batch_execute(migration.sql).await?;
        tx.execute(
            "INSERT INTO idem_handler_migrations (handler, version, name) VALUES ($1, $2, $3)",
            &[&H::NAME, &migration.version, &migration.name],
        )
        .await?;
        applied.push(format!("{}/{}", H::NAME, migration.name));
    }
    tx.commit().await?;
    Ok(applied)
}

async fn versions(
    tx: &Transaction<'_>,
    query: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<i32>, tokio_postgres::Error> {
    tx.query(query, params)
        .await?
        .iter()
        .map(|row| row.try_get(0))
        .collect()
}

/// A handler's name fits its column, and its migrations are numbered 1, 2, 3 …
fn check_handler<H: Handler>() -> Result<(), MigrateError> {
    let problem = |problem: String| MigrateError::Handler {
        handler: H::NAME,
        problem,
    };
    if H::NAME.is_empty() || H::NAME.chars().count() > 64 {
        return Err(problem("its name must be 1 to 64 characters".into()));
    }
    numbered(H::MIGRATIONS).map_err(problem)
}

/// `migrations` are numbered 1, 2, 3 … in order.
fn numbered(migrations: &[Migration]) -> Result<(), String> {
    for (index, migration) in migrations.iter().enumerate() {
        let expected = i32::try_from(index + 1).unwrap_or(i32::MAX);
        if migration.version != expected {
            return Err(format!(
                "migration {} has version {}, expected {expected}: number migrations 1, 2, 3 … oldest first",
                migration.name, migration.version
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idems_migrations_are_numbered_in_order_and_named_after_their_version() {
        assert_eq!(numbered(MIGRATIONS), Ok(()));
        for migration in MIGRATIONS {
            assert!(
                migration
                    .name
                    .starts_with(&format!("{:04}_", migration.version))
            );
        }
    }

    #[test]
    fn migrations_out_of_order_are_refused() {
        let gap = [MIGRATIONS[0], MIGRATIONS[2]];
        assert!(numbered(&gap).is_err_and(|problem| problem.contains("expected 2")));
        assert_eq!(latest(&[]), 0);
        assert_eq!(latest(MIGRATIONS), 13);
    }
}
