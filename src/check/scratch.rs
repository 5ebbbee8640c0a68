//! The schemas a check makes for itself, one per run (idem's migrations,
//! the handler's, then the setup SQL), and their removal.

use deadpool_postgres::Pool;

use super::CheckError;
use crate::handler::Handler;
use crate::store::{DatabaseConfig, migrate};

/// A schema of one run's own, and a pool whose sessions work in it.
#[derive(Debug)]
pub(crate) struct Scratch {
    /// Its name.
    pub(crate) schema: String,
    /// The database with this schema as its search path.
    pub(crate) database: DatabaseConfig,
    /// Connections into it, straight to the server.
    pub(crate) pool: Pool,
}

impl Scratch {
    /// Makes `schema` in `base`'s database with `H`'s migrations, then runs
    /// `setup` in it; a pool of `pool_size` sessions works there.
    pub(crate) async fn create<H: Handler>(
        base: &DatabaseConfig,
        schema: String,
        setup: Option<&str>,
        pool_size: usize,
    ) -> Result<Self, CheckError> {
        let mut database = base.clone().with_schema(&schema);
        database.pool_size = pool_size;
        let pool = database
            .pool()
            .map_err(|error| CheckError::Usage(error.to_string()))?;
        migrate::run::<H>(&pool, Some(&schema))
            .await
            .map_err(|error| CheckError::Failed(format!("migrating {schema}: {error}").into()))?;
        if let Some(setup) = setup {
            let client = pool
                .get()
                .await
                .map_err(|error| CheckError::Failed(error.into()))?;
            client.batch_execute(setup).await.map_err(|error| {
                CheckError::Usage(format!("--setup fails: {}", crate::store::describe(&error)))
            })?;
        }
        Ok(Self {
            schema,
            database,
            pool,
        })
    }
}

/// Drops every schema whose name starts with `prefix` and `_`.
pub(crate) async fn remove(admin: &Pool, prefix: &str) -> Result<(), CheckError> {
    let client = admin
        .get()
        .await
        .map_err(|error| CheckError::Failed(error.into()))?;
    let failed =
        |error: tokio_postgres::Error| CheckError::database("removing the check's schemas", &error);
    let schemas = client
        .query(
            "SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, $1)",
            &[&format!("{prefix}_")],
        )
        .await
        .map_err(failed)?;
    for row in schemas {
        let schema: String = row.get(0);
        // The prefix is idem's, a plain identifier, and so is the rest.
        client
            .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .await
            .map_err(failed)?;
    }
    Ok(())
}
