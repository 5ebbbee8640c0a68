//! The migrations: idem's own (`sql/`, embedded) and each handler's, applied
//! in order under an advisory lock so that instances starting together do
//! not race, and tracked apart (`idem_schema_migrations`,
//! `idem_handler_migrations`) so that each can evolve; each with its
//! checksum, which refuses a schema whose applied migration was edited since.
//! Then idem's functions (`sql/functions`), each applied again when its text
//! is new to the schema (`sql/functions/README.md`).

use std::time::Duration;

use deadpool_postgres::{Pool, Transaction};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use tracing::info;

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
    migration!(14, "0014_migration_checksums.sql"),
    migration!(15, "0015_console.sql"),
    migration!(16, "0016_records_without_id_key.sql"),
    migration!(17, "0017_outbox_batches.sql"),
    migration!(18, "0018_points_table_leaves_the_baseline.sql"),
    migration!(19, "0019_parked_keys.sql"),
    migration!(20, "0020_outbox_order_per_key.sql"),
    migration!(21, "0021_console_edits.sql"),
];

/// One of idem's functions: its current definition, a file of
/// `sql/functions`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Function {
    /// The function's name, which is the file's.
    pub(crate) name: &'static str,
    /// `CREATE OR REPLACE FUNCTION …`, one or several.
    pub(crate) sql: &'static str,
}

macro_rules! function {
    ($name:literal) => {
        Function {
            name: $name,
            sql: include_str!(concat!("../../sql/functions/", $name, ".sql")),
        }
    };
}

/// idem's functions, in the order they are applied: a function whose body
/// is SQL (checked when it is created) after those it calls.
pub(crate) const FUNCTIONS: &[Function] = &[
    function!("mq_epoch_lock"),
    function!("mq_rotation_lock"),
    function!("mq_digest"),
    function!("mq_close_partition"),
    function!("mq_open_epoch"),
    function!("mq_rotate"),
    function!("mq_recorded"),
    function!("mq_claim"),
    function!("mq_dead_letter_error_tally_add"),
    function!("mq_dead_letter_tally"),
    function!("mq_dead_letter_groups"),
    function!("mq_standbys_have"),
];

/// The checksum a migration or a function is recorded with: the SHA-256 of
/// its text, in hex, with Windows line ends read as `\n` (a checkout that
/// converts them edits nothing).
pub(crate) fn checksum(sql: &str) -> String {
    let digest = Sha256::digest(sql.replace("\r\n", "\n").as_bytes());
    digest.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The newest version of `migrations`; 0 for none.
pub fn latest(migrations: &[Migration]) -> i32 {
    migrations.last().map_or(0, |m| m.version)
}

/// Why migrating failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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
    /// A migration the schema applied differs from the one of the same
    /// version this build would apply: it was edited after it landed.
    #[error(
        "migration {name} of {history} was applied to this schema with other text than this \
         build's: a migration must not be edited once applied; restore its text, and put the \
         change in a new migration"
    )]
    Edited {
        /// Whose migrations: `idem`, or `handler <name>`.
        history: String,
        /// The migration's file name.
        name: &'static str,
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
        applied_at TIMESTAMPTZ NOT NULL DEFAULT now(), \
        checksum   TEXT)";

/// Whether idem's history has its checksums: not when an idem from before
/// them made it.
const HISTORY_HAS_CHECKSUMS: &str = "\
    SELECT EXISTS (SELECT FROM pg_attribute \
                   WHERE attrelid = 'idem_schema_migrations'::regclass \
                     AND attname = 'checksum' AND NOT attisdropped)";

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
    if !tx.query_one(HISTORY_HAS_CHECKSUMS, &[]).await?.try_get(0)? {
        tx.batch_execute("ALTER TABLE idem_schema_migrations ADD COLUMN checksum TEXT")
            .await?;
    }
    let mut applied = Vec::new();
    History::Idem.migrate(&tx, MIGRATIONS, &mut applied).await?;
    History::Handler(H::NAME)
        .migrate(&tx, H::MIGRATIONS, &mut applied)
        .await?;
    apply_functions(&tx, &mut applied).await?;
    tx.commit().await?;
    Ok(applied)
}

/// A history of migrations: idem's, or one handler's.
#[derive(Debug, Clone, Copy)]
enum History {
    Idem,
    Handler(&'static str),
}

impl History {
    /// `idem`, or `handler <name>`.
    fn name(self) -> String {
        match self {
            Self::Idem => "idem".to_owned(),
            Self::Handler(handler) => format!("handler {handler}"),
        }
    }

    /// A migration's name as `migrate` reports it.
    fn named(self, migration: &Migration) -> String {
        match self {
            Self::Idem => migration.name.to_owned(),
            Self::Handler(handler) => format!("{handler}/{}", migration.name),
        }
    }

    /// The versions applied, with their checksums (none for those applied
    /// before checksums were kept).
    async fn recorded(
        self,
        tx: &Transaction<'_>,
    ) -> Result<Vec<(i32, Option<String>)>, tokio_postgres::Error> {
        let rows = match self {
            Self::Idem => {
                tx.query("SELECT version, checksum FROM idem_schema_migrations", &[])
                    .await?
            }
            Self::Handler(handler) => {
                tx.query(
                    "SELECT version, checksum FROM idem_handler_migrations WHERE handler = $1",
                    &[&handler],
                )
                .await?
            }
        };
        rows.iter()
            .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
            .collect()
    }

    /// Records `checksum` for `version`, applied now or before checksums
    /// were kept.
    async fn record(
        self,
        tx: &Transaction<'_>,
        migration: &Migration,
        checksum: &str,
    ) -> Result<(), tokio_postgres::Error> {
        match self {
            Self::Idem => {
                tx.execute(
                    "INSERT INTO idem_schema_migrations (version, name, checksum) \
                     VALUES ($1, $2, $3) \
                     ON CONFLICT (version) DO UPDATE SET checksum = EXCLUDED.checksum",
                    &[&migration.version, &migration.name, &checksum],
                )
                .await?
            }
            Self::Handler(handler) => {
                tx.execute(
                    "INSERT INTO idem_handler_migrations (handler, version, name, checksum) \
                     VALUES ($1, $2, $3, $4) \
                     ON CONFLICT (handler, version) DO UPDATE SET checksum = EXCLUDED.checksum",
                    &[&handler, &migration.version, &migration.name, &checksum],
                )
                .await?
            }
        };
        Ok(())
    }

    /// Checks the checksums of what the schema applied of `migrations`
    /// (giving those recorded without one theirs), then applies the rest,
    /// adding their names to `applied`.
    async fn migrate(
        self,
        tx: &Transaction<'_>,
        migrations: &[Migration],
        applied: &mut Vec<String>,
    ) -> Result<(), MigrateError> {
        let recorded = self.recorded(tx).await?;
        for (version, recorded) in &recorded {
            // A migration newer than this build's is a newer idem's.
            let Some(migration) = migrations.iter().find(|m| m.version == *version) else {
                continue;
            };
            let expected = checksum(migration.sql);
            match recorded {
                Some(recorded) if *recorded == expected => {}
                Some(_) => {
                    return Err(MigrateError::Edited {
                        history: self.name(),
                        name: migration.name,
                    });
                }
                // Applied before checksums were kept: given this text's.
                None => self.record(tx, migration, &expected).await?,
            }
        }
        for migration in migrations
            .iter()
            .filter(|m| !recorded.iter().any(|(version, _)| *version == m.version))
        {
            tx.batch_execute(migration.sql).await?;
            self.record(tx, migration, &checksum(migration.sql)).await?;
            applied.push(self.named(migration));
        }
        Ok(())
    }
}

/// Applies each of idem's functions whose text the schema never applied,
/// and records it; adds `functions/<name>.sql` to `applied` for each.
async fn apply_functions(
    tx: &Transaction<'_>,
    applied: &mut Vec<String>,
) -> Result<(), MigrateError> {
    let rows = tx
        .query(
            "SELECT name, checksum, ordinal = max(ordinal) OVER (PARTITION BY name) \
             FROM idem_schema_functions",
            &[],
        )
        .await?;
    for function in FUNCTIONS {
        let own = checksum(function.sql);
        let mut seen = None;
        for row in &rows {
            let name: &str = row.try_get(0)?;
            let recorded: &str = row.try_get(1)?;
            if name == function.name && recorded == own {
                seen = Some(row.try_get::<_, bool>(2)?);
            }
        }
        match seen {
            Some(true) => {}
            // An older idem's migrate, during an upgrade: the newer text stays.
            Some(false) => info!(
                function = function.name,
                "the schema holds a newer definition of this function than this idem's: kept"
            ),
            None => {
                tx.batch_execute(function.sql).await?;
                tx.execute(
                    "INSERT INTO idem_schema_functions (name, checksum) VALUES ($1, $2)",
                    &[&function.name, &own],
                )
                .await?;
                applied.push(format!("functions/{}.sql", function.name));
            }
        }
    }
    Ok(())
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
    fn every_file_of_sql_functions_is_applied_once() -> std::io::Result<()> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("sql/functions");
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if let Some(function) = name.strip_suffix(".sql") {
                files.push(function.to_owned());
            }
        }
        files.sort();
        let mut listed: Vec<String> = FUNCTIONS.iter().map(|f| f.name.to_owned()).collect();
        listed.sort();
        assert_eq!(files, listed);
        Ok(())
    }

    #[test]
    fn a_checksum_reads_windows_line_ends_as_unix_ones() {
        assert_eq!(
            checksum("SELECT 1;\r\nSELECT 2;\n"),
            checksum("SELECT 1;\nSELECT 2;\n")
        );
        assert_ne!(checksum("SELECT 1;"), checksum("SELECT 1; "));
        assert_eq!(checksum("").len(), 64);
    }

    #[test]
    fn migrations_out_of_order_are_refused() {
        let gap = [MIGRATIONS[0], MIGRATIONS[2]];
        assert!(numbered(&gap).is_err_and(|problem| problem.contains("expected 2")));
        assert_eq!(latest(&[]), 0);
        assert_eq!(latest(MIGRATIONS), 21);
    }
}
