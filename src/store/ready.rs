//! Whether the database can be used: it answers, it holds idem's tables
//! and the handler's at the versions this build needs, and its functions'
//! texts.

use std::time::Duration;

use backon::Retryable;
use tokio_postgres::error::SqlState;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::migrate;
use super::{Store, StoreError};
use crate::handler::Handler;

/// Why the database cannot be used. Each names the database, as
/// [`DatabaseConfig::describe`](super::DatabaseConfig::describe) does.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadyError {
    /// PostgreSQL answered and said no.
    #[error("PostgreSQL at {server} refused the connection: {}", .error.cause())]
    Refused {
        /// The database.
        server: String,
        /// What it said.
        error: StoreError,
    },
    /// PostgreSQL did not answer within the start-up timeout.
    #[error(
        "PostgreSQL at {server} did not answer within {}: {}",
        crate::duration::format(*.patience),
        .error.cause()
    )]
    Unavailable {
        /// The database.
        server: String,
        /// How long it was waited for: the start-up timeout.
        patience: Duration,
        /// The last attempt's error.
        error: StoreError,
    },
    /// The tables are missing or older than this idem or its handler.
    #[error(
        "in {server}, {search_path} is at migration {found} of {history}, this idem needs {needed}: run `{} migrate` first",
        crate::program::name()
    )]
    NotMigrated {
        /// The database.
        server: String,
        /// Where the tables were looked for: the schema, and the search path when
        /// it names more than that one.
        search_path: String,
        /// Whose migrations: `idem`, or `handler <name>`.
        history: String,
        /// The highest migration applied.
        found: i32,
        /// The highest migration this idem has.
        needed: i32,
    },
    /// The schema's definition of idem's functions is older than this
    /// idem's: a build whose migrations are those of the schema, but whose
    /// functions changed.
    #[error(
        "in {server}, {search_path} holds an older definition of {functions} than this idem: \
         run `{} migrate` first",
        crate::program::name()
    )]
    FunctionsBehind {
        /// The database.
        server: String,
        /// Where the tables were looked for.
        search_path: String,
        /// The functions, by name.
        functions: String,
    },
    /// Acks wait for standbys, but the role may not read where they are.
    #[error(
        "PostgreSQL at {server}: --ack-after-standbys reads the standbys' positions \
         (pg_stat_replication), which role {role} may not: GRANT pg_read_all_stats TO {role}"
    )]
    StandbysHidden {
        /// The database.
        server: String,
        /// The session's role.
        role: String,
    },
    /// Shutdown was asked for while waiting.
    #[error("interrupted while waiting for PostgreSQL")]
    Interrupted,
}

/// What a commit that returned promises, as the server is configured for
/// idem's sessions.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Replication {
    /// A commit returns once a synchronous standby has it
    /// (`synchronous_standby_names`, `synchronous_commit` at least
    /// `remote_write`): an acked effect survives a failover to it.
    Synchronous {
        /// `synchronous_standby_names`.
        standbys: String,
    },
    /// Standbys stream from the server, but a commit returns before any
    /// has it: a failover to one that is behind loses effects whose
    /// messages were acked.
    Asynchronous {
        /// Standbys streaming now.
        streaming: i64,
    },
    /// No standby streams from the server (a managed service may still
    /// replicate its storage, out of PostgreSQL's sight).
    NoStandby,
}

impl std::fmt::Display for Replication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Replication::Synchronous { standbys } => write!(
                f,
                "commits wait for a synchronous standby ({standbys}): an acked effect survives \
                 a failover to it"
            ),
            Replication::Asynchronous { streaming } => write!(
                f,
                "{streaming} standby(s) replicate asynchronously: a failover to one that is \
                 behind loses effects whose messages were acked; make replication synchronous \
                 for idem (see the guide, *A PostgreSQL primary and its standbys*)"
            ),
            Replication::NoStandby => write!(f, "no standby streams from the server"),
        }
    }
}

/// Runs `operation` until PostgreSQL answers it, retrying with backoff for
/// at most `patience`, one log line per attempt; a refusal (credentials, an
/// unknown database, a certificate) ends it at once, as does `shutdown`.
#[doc(hidden)]
pub async fn until_answered<T, F, Fut>(
    server: &str,
    patience: Duration,
    shutdown: &CancellationToken,
    operation: F,
) -> Result<T, ReadyError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let deadline = tokio::time::Instant::now() + patience;
    let attempts = operation
        .retry(crate::backoff::until(patience))
        .sleep(tokio::time::sleep)
        .when(|error| !is_refusal(error))
        .notify(|error, wait| {
            warn!(
                "PostgreSQL at {server} is unavailable: {}; {}",
                error.cause(),
                crate::backoff::retrying(wait, deadline)
            );
        });
    tokio::select! {
        result = attempts => result.map_err(|error| if is_refusal(&error) {
            ReadyError::Refused { server: server.to_owned(), error }
        } else {
            ReadyError::Unavailable { server: server.to_owned(), patience, error }
        }),
        () = shutdown.cancelled() => Err(ReadyError::Interrupted),
    }
}

/// Invalid credentials, no such database or role, a certificate that does
/// not verify: retrying cannot help.
fn is_refusal(error: &StoreError) -> bool {
    error.code().is_some_and(|code| {
        code.code().starts_with("28") || *code == SqlState::INVALID_CATALOG_NAME
    }) || error.tls_refused().is_some()
}

impl Store {
    /// Waits until PostgreSQL answers and holds idem's tables and those of
    /// handler `H`, retrying with backoff for at most `patience` of waiting,
    /// one log line per attempt. A refusal (credentials, unknown database)
    /// or a schema that is not migrated ends it at once: retrying cannot fix
    /// those.
    pub async fn wait_until_ready<H: Handler>(
        &self,
        server: &str,
        patience: Duration,
        shutdown: &CancellationToken,
    ) -> Result<(), ReadyError> {
        let (idem, handler, search_path, behind) =
            until_answered(server, patience, shutdown, || self.schema_versions(H::NAME)).await?;
        for (history, found, needed) in [
            (
                "idem".to_owned(),
                idem,
                migrate::latest(migrate::MIGRATIONS),
            ),
            (
                format!("handler {}", H::NAME),
                handler,
                migrate::latest(H::MIGRATIONS),
            ),
        ] {
            if found < needed {
                return Err(ReadyError::NotMigrated {
                    server: server.to_owned(),
                    search_path,
                    history,
                    found,
                    needed,
                });
            }
        }
        if !behind.is_empty() {
            return Err(ReadyError::FunctionsBehind {
                server: server.to_owned(),
                search_path,
                functions: behind.join(", "),
            });
        }
        Ok(())
    }

    /// idem's functions whose text this idem has the schema never applied
    /// (one a newer idem replaced was applied, then replaced: it is not
    /// behind).
    async fn functions_behind(
        client: &deadpool_postgres::Client,
    ) -> Result<Vec<String>, StoreError> {
        let (names, checksums): (Vec<&str>, Vec<String>) = migrate::FUNCTIONS
            .iter()
            .map(|function| (function.name, migrate::checksum(function.sql)))
            .unzip();
        let rows = client
            .query(
                "SELECT own.name FROM unnest($1::text[], $2::text[]) AS own (name, checksum) \
                 WHERE NOT EXISTS (SELECT FROM idem_schema_functions AS applied \
                                   WHERE applied.name = own.name \
                                     AND applied.checksum = own.checksum) \
                 ORDER BY 1",
                &[
                    &names as &(dyn tokio_postgres::types::ToSql + Sync),
                    &checksums,
                ],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|row| row.try_get(0))
            .collect::<Result<_, _>>()?)
    }

    /// The highest migration applied of idem's and of handler `handler`'s
    /// (0 where none was), the search path they were looked for in, and
    /// idem's functions whose text the schema lacks (none looked for in a
    /// schema before this idem's migrations).
    /// Waits until the server takes writes, as [`Self::wait_until_ready`]
    /// waits for it to answer: a standby (which a failover may promote) or
    /// a read-only server holds the worker, one line per attempt saying
    /// so and what to give idem instead.
    pub async fn wait_until_writable(
        &self,
        server: &str,
        patience: Duration,
        shutdown: &CancellationToken,
    ) -> Result<(), ReadyError> {
        until_answered(server, patience, shutdown, || self.writable()).await
    }

    /// What the server promises about a commit once it returns: whether a
    /// standby has it, and how many standbys stream from it. A server that
    /// will not say (its settings or `pg_stat_replication` not readable)
    /// answers `None`.
    pub async fn replication(&self) -> Option<Replication> {
        let client = self.pool.get().await.ok()?;
        let row = client
            .query_one(
                "SELECT current_setting('synchronous_standby_names'), \
                        current_setting('synchronous_commit'), \
                        (SELECT count(*) FROM pg_stat_replication)",
                &[],
            )
            .await
            .ok()?;
        let (names, commit, streaming): (String, String, i64) =
            (row.get(0), row.get(1), row.get(2));
        let waits = !names.trim().is_empty()
            && matches!(commit.as_str(), "on" | "remote_write" | "remote_apply");
        Some(if waits {
            Replication::Synchronous { standbys: names }
        } else if streaming > 0 {
            Replication::Asynchronous { streaming }
        } else {
            Replication::NoStandby
        })
    }

    /// With acks after standbys ([`Store::with_standbys`]): refuses a role
    /// that cannot read the standbys' positions, which would never count,
    /// and says how many standbys stream now and how many a commit waits
    /// for. A server that does not answer is waited for, up to `patience`,
    /// as [`wait_until_ready`](Store::wait_until_ready) waits.
    pub async fn check_standbys(
        &self,
        server: &str,
        patience: Duration,
        shutdown: &CancellationToken,
    ) -> Result<(), ReadyError> {
        let Some(standbys) = &self.standbys else {
            return Ok(());
        };
        let (role, reads, streaming) = until_answered(server, patience, shutdown, || async {
            let client = self.pool.get().await?;
            let row = client
                .query_one(
                    "SELECT current_user::text, pg_has_role('pg_read_all_stats', 'MEMBER'), \
                            (SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming')",
                    &[],
                )
                .await?;
            Ok::<(String, bool, i64), StoreError>((row.get(0), row.get(1), row.get(2)))
        })
        .await?;
        if !reads {
            return Err(ReadyError::StandbysHidden {
                server: server.to_owned(),
                role,
            });
        }
        let wanted = standbys.wanted();
        if streaming < i64::from(wanted) {
            tracing::warn!(
                "PostgreSQL at {server}: acks wait for {wanted} standby(s), {streaming} stream now: \
                 deliveries wait, unacked, until enough catch up"
            );
        } else {
            tracing::info!(
                "PostgreSQL at {server}: a delivery is acked once {wanted} of the {streaming} \
                 standby(s) streaming have flushed its commit"
            );
        }
        Ok(())
    }

    async fn writable(&self) -> Result<(), StoreError> {
        let client = self.pool.get().await?;
        let row = client
            .query_one(
                "SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'",
                &[],
            )
            .await?;
        let (standby, read_only): (bool, bool) = (row.try_get(0)?, row.try_get(1)?);
        if standby || read_only {
            return Err(StoreError::ReadOnly { standby });
        }
        Ok(())
    }

    async fn schema_versions(
        &self,
        handler: &str,
    ) -> Result<(i32, i32, String, Vec<String>), StoreError> {
        let client = self.pool.get().await?;
        let row = client
            .query_one(
                "SELECT current_schema(), current_setting('search_path')",
                &[],
            )
            .await?;
        let search_path = where_tables_are(row.try_get(0)?, row.try_get(1)?);
        let idem = client
            .query_one("SELECT max(version) FROM idem_schema_migrations", &[])
            .await;
        let idem: Option<i32> = match idem {
            Ok(row) => row.try_get(0)?,
            Err(error) if error.code() == Some(&SqlState::UNDEFINED_TABLE) => {
                return Ok((0, 0, search_path, Vec::new()));
            }
            Err(error) => return Err(error.into()),
        };
        let handler = client
            .query_one(
                "SELECT max(version) FROM idem_handler_migrations WHERE handler = $1",
                &[&handler],
            )
            .await;
        let handler: Option<i32> = match handler {
            Ok(row) => row.try_get(0)?,
            // A database from before handlers had migrations of their own.
            Err(error) if error.code() == Some(&SqlState::UNDEFINED_TABLE) => None,
            Err(error) => return Err(error.into()),
        };
        let idem = idem.unwrap_or(0);
        let behind = if idem >= migrate::latest(migrate::MIGRATIONS) {
            Self::functions_behind(&client).await?
        } else {
            Vec::new()
        };
        Ok((idem, handler.unwrap_or(0), search_path, behind))
    }
}

/// Where unqualified tables are found, for an error: the schema
/// (`current_schema()`, the first of the search path that exists), and the
/// search path when it names more than that one.
fn where_tables_are(schema: Option<String>, search_path: String) -> String {
    let single = !search_path.contains(',');
    let named = search_path.trim().trim_matches('"');
    match schema {
        Some(schema) if single && named == schema => format!("schema {schema}"),
        Some(schema) => {
            format!("schema {schema} (the first of search_path {search_path} that exists)")
        }
        None if single => format!("schema {named} (which does not exist)"),
        None => format!("search_path {search_path} (none of whose schemas exists)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schema_of_the_tables_is_named_not_only_the_search_path() {
        let named = |schema: Option<&str>, path: &str| {
            where_tables_are(schema.map(str::to_owned), path.to_owned())
        };
        assert_eq!(named(Some("billing"), "billing"), "schema billing");
        assert_eq!(
            named(Some("public"), "\"$user\", public"),
            "schema public (the first of search_path \"$user\", public that exists)"
        );
        assert_eq!(
            named(None, "billing"),
            "schema billing (which does not exist)"
        );
        assert_eq!(
            named(None, "\"$user\", nowhere"),
            "search_path \"$user\", nowhere (none of whose schemas exists)"
        );
    }
}
