//! The embedded `sql/` migrations, applied in order under an advisory lock
//! so that instances starting together do not race.

use deadpool_postgres::Pool;

use super::StoreError;

/// One file of `sql/`.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Order of application; the number the file name starts with.
    pub version: i32,
    /// The file name, for the record.
    pub name: &'static str,
    /// The statements.
    pub sql: &'static str,
}

macro_rules! migration {
    ($version:literal, $name:literal) => {
        Migration {
            version: $version,
            name: $name,
            sql: include_str!(concat!("../../sql/", $name)),
        }
    };
}

/// Every migration, oldest first.
pub const MIGRATIONS: &[Migration] = &[
    migration!(1, "0001_consume_record_and_points.sql"),
    migration!(2, "0002_failure_ledger.sql"),
];

/// Key of the advisory lock that serializes migrations ("idem" in ASCII).
const LOCK_KEY: i64 = 0x6964_656d;

const CREATE_HISTORY: &str = "\
    CREATE TABLE IF NOT EXISTS idem_schema_migrations (\
        version    INTEGER PRIMARY KEY, \
        name       TEXT NOT NULL, \
        applied_at TIMESTAMPTZ NOT NULL DEFAULT now())";

/// Applies the migrations not yet applied, in one transaction, and returns
/// their names. Creates `schema` first when one is given.
///
/// Safe to run again (it applies nothing) and from several processes at once
/// (the second waits for the first, then applies nothing).
pub async fn run(pool: &Pool, schema: Option<&str>) -> Result<Vec<&'static str>, StoreError> {
    let mut client = pool.get().await?;
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK_KEY])
        .await?;
    if let Some(schema) = schema {
        // The name was checked to be a plain identifier when the pool was made.
        tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
            .await?;
    }
    tx.batch_execute(CREATE_HISTORY).await?;
    let done: Vec<i32> = tx
        .query("SELECT version FROM idem_schema_migrations", &[])
        .await?
        .iter()
        .map(|row| row.try_get(0))
        .collect::<Result<_, _>>()?;
    let mut applied = Vec::new();
    for migration in MIGRATIONS.iter().filter(|m| !done.contains(&m.version)) {
        tx.batch_execute(migration.sql).await?;
        tx.execute(
            "INSERT INTO idem_schema_migrations (version, name) VALUES ($1, $2)",
            &[&migration.version, &migration.name],
        )
        .await?;
        applied.push(migration.name);
    }
    tx.commit().await?;
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_are_numbered_in_order_and_named_after_their_version() {
        for (index, migration) in MIGRATIONS.iter().enumerate() {
            let expected = i32::try_from(index + 1).unwrap_or(i32::MAX);
            assert_eq!(migration.version, expected);
            assert!(migration.name.starts_with(&format!("{expected:04}_")));
        }
    }
}
