//! Everything PostgreSQL: the pool, the migrations, and the transaction
//! that claims events and applies a handler's effect.
//!
//! The consume loop calls [`Applier::apply`] and never sees SQL.

mod apply;
mod claim;
#[doc(hidden)]
pub mod dead_letters;
mod failure;
#[doc(hidden)]
pub mod filter;
mod flush;
mod ledger;
pub mod migrate;
#[doc(hidden)]
pub mod outbox;
pub mod retention;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use backon::Retryable;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime, Timeouts};
use tokio_postgres::NoTls;
use tokio_postgres::config::SslMode;
use tokio_postgres::error::SqlState;
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_util::sync::CancellationToken;
use tracing::warn;

pub(crate) use apply::RERUN_PAUSE;
#[doc(hidden)]
pub use apply::{Applier, Claimed, Failure};
#[doc(hidden)]
pub use claim::{
    claim_and_tally_statement, digest, general_path_statements, recorded,
    straight_claim_and_tally_statement,
};
pub(crate) use dead_letters::GivenUpMessages;
pub use dead_letters::{DeadLetter, IndexFilter, IndexSummary, IndexTotals};
pub use failure::StoreError;
#[doc(hidden)]
pub use failure::describe;
#[doc(hidden)]
pub use filter::Filters;
#[doc(hidden)]
pub use flush::Lanes;
pub use ledger::LedgerEntry;

use crate::handler::Handler;
use crate::secret::SecretUrl;

/// Where the database is and how to use it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DatabaseConfig {
    /// Connection string (URL or key/value); may carry a password.
    pub url: SecretUrl,
    /// Schema the tables live in; `None` keeps the server's `search_path`.
    pub schema: Option<String>,
    /// Most connections held at once.
    pub pool_size: usize,
    /// How long to wait for a new connection, or for a free one in the pool.
    pub connect_timeout: Duration,
    /// With `sslmode=require`: the CA certificates (PEM) the server's
    /// certificate must chain to, instead of the system's.
    pub ca_file: Option<PathBuf>,
    /// How long a statement of idem's sessions waits for a lock before it
    /// fails (SQLSTATE 55P03, an infrastructure failure: the delivery is
    /// held and retried, and the wait is logged), instead of hanging.
    pub lock_timeout: Duration,
    /// How long a statement of idem's sessions may run before PostgreSQL
    /// cancels it (57014, infrastructure too). Migrations have none.
    pub statement_timeout: Duration,
    /// Where to connect instead of the connection string's host and port
    /// (a check's proxy), keeping its host name for TLS.
    pub(crate) through: Option<std::net::SocketAddr>,
}

/// The configuration is unusable: it will not get better by retrying.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The connection string does not parse.
    #[error("{url} is not a valid PostgreSQL connection string: {0}", url = ConfigError::URL)]
    Url(String),
    /// The CA file cannot be read, or holds no certificate.
    #[error(transparent)]
    CaFile(#[from] crate::tls::CaFileError),
    /// A CA file was given for a connection that will not use TLS.
    #[error(
        "a database CA file is set, but {} does not say sslmode=require: \
         idem would connect without TLS",
        ConfigError::URL
    )]
    CaFileWithoutTls,
    /// No CA file, and the system has no CA certificates to verify with.
    #[error(
        "sslmode=require: the system has no CA certificates to verify the server with; \
         set the database CA file"
    )]
    NoRoots,
    /// TLS could not be set up.
    #[error("cannot set up TLS: {0}")]
    Tls(String),
    /// The schema name is not a plain identifier.
    #[error(
        "schema `{0}` is not a plain identifier (letters, digits, _; not starting with a digit)"
    )]
    Schema(String),
    /// A handler's tally names something that is not a plain identifier.
    #[error("handler {handler}: tally name `{name}` is not a plain identifier")]
    Tally {
        /// The handler.
        handler: &'static str,
        /// The name.
        name: String,
    },
}

impl ConfigError {
    /// How these errors name the connection string; the command line says
    /// instead where it came from (`--database-url`, `DATABASE_URL`).
    pub const URL: &'static str = "the database URL";
}

impl DatabaseConfig {
    /// Connections of a pool unless said otherwise.
    pub const DEFAULT_POOL_SIZE: usize = 4;
    /// How long to wait for a connection unless said otherwise.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
    /// The lock timeout of idem's sessions unless said otherwise: far above
    /// what a batch waits for its rows, short enough that a stray lock shows.
    pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(10);
    /// The statement timeout of idem's sessions unless said otherwise.
    pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(60);

    /// The database at `url`, in the server's `search_path`, without a CA file.
    pub fn new(url: SecretUrl) -> Self {
        Self {
            url,
            schema: None,
            pool_size: Self::DEFAULT_POOL_SIZE,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            ca_file: None,
            lock_timeout: Self::DEFAULT_LOCK_TIMEOUT,
            statement_timeout: Self::DEFAULT_STATEMENT_TIMEOUT,
            through: None,
        }
    }

    /// The same database, reached through `address` (a proxy), the
    /// connection string's host name kept for TLS.
    pub(crate) fn through(self, address: std::net::SocketAddr) -> Self {
        Self {
            through: Some(address),
            ..self
        }
    }

    /// The address of the server, for a proxy in front of it: the first
    /// host of the connection string, which must be reached over TCP.
    pub(crate) async fn address(&self) -> Result<std::net::SocketAddr, ConfigError> {
        let config = self.parse()?;
        let Some(tokio_postgres::config::Host::Tcp(host)) = config.get_hosts().first() else {
            return Err(ConfigError::Url(
                "it names no host reached over TCP (a Unix socket cannot take a proxy)".into(),
            ));
        };
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let unresolved = || ConfigError::Url(format!("its host {host} does not resolve"));
        tokio::net::lookup_host((host.as_str(), port))
            .await
            .map_err(|_| unresolved())?
            .next()
            .ok_or_else(unresolved)
    }

    /// The same database, with idem's tables in `schema`.
    pub fn with_schema(self, schema: impl Into<String>) -> Self {
        Self {
            schema: Some(schema.into()),
            ..self
        }
    }

    /// The database as logs and errors name it: what was parsed out of the
    /// connection string, without its password; never the string itself.
    pub fn describe(&self) -> String {
        let Ok(config) = self.parse() else {
            return "the database URL".to_owned();
        };
        let hosts: Vec<String> = config
            .get_hosts()
            .iter()
            .map(|host| match host {
                tokio_postgres::config::Host::Tcp(name) => name.clone(),
                tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
            })
            .collect();
        let ports: Vec<String> = config.get_ports().iter().map(u16::to_string).collect();
        format!(
            "postgres://{}@{}{}/{}",
            config.get_user().unwrap_or_default(),
            hosts.join(","),
            if ports.is_empty() {
                String::new()
            } else {
                format!(":{}", ports.join(","))
            },
            config.get_dbname().unwrap_or_default()
        )
    }

    /// The connection string, parsed, unless it does not parse as written
    /// (see [`crate::secret::parsed_as_written`]).
    fn parse(&self) -> Result<tokio_postgres::Config, ConfigError> {
        let url = self.url.expose();
        let config: tokio_postgres::Config = verify_full_as_require(url)
            .parse()
            .map_err(|e: tokio_postgres::Error| ConfigError::Url(parse_error(&e, url)))?;
        if !crate::secret::parsed_as_written(url, config.get_password().unwrap_or_default()) {
            return Err(ConfigError::Url(
                "its password is not where a URL's password stands; a / # @ or % in the \
                 user or password must be percent-encoded"
                    .into(),
            ));
        }
        Ok(config)
    }

    /// A pool for this database; connects lazily.
    pub fn pool(&self) -> Result<Pool, ConfigError> {
        let mut pg = self.parse()?;
        if let Some(address) = self.through {
            pg = redirected(&pg, address);
        }
        // `require` verifies the certificate and the host name, as libpq's
        // `verify-full` does; `prefer` (the default) and `disable` do not try TLS.
        let tls = match (pg.get_ssl_mode(), &self.ca_file) {
            (SslMode::Require, ca_file) => Some(tls_connector(ca_file.as_deref())?),
            (_, Some(_)) => return Err(ConfigError::CaFileWithoutTls),
            (_, None) => None,
        };
        // idem's statements take arrays whose sizes do not change the best
        // plan: plan them once per connection instead of at every execution.
        let mut options = pg
            .get_options()
            .map(|o| format!("{o} "))
            .unwrap_or_default();
        options.push_str("-c plan_cache_mode=force_generic_plan");
        options.push_str(&format!(
            " -c lock_timeout={} -c statement_timeout={}",
            self.lock_timeout.as_millis(),
            self.statement_timeout.as_millis()
        ));
        if let Some(schema) = &self.schema {
            if !is_identifier(schema) {
                return Err(ConfigError::Schema(schema.clone()));
            }
            options.push_str(&format!(" -c search_path={schema}"));
        }
        pg.options(options);
        if pg.get_application_name().is_none() {
            pg.application_name("idem");
        }
        pg.connect_timeout(self.connect_timeout);
        let manager_config = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let manager = match tls {
            Some(tls) => Manager::from_config(pg, tls, manager_config),
            None => Manager::from_config(pg, NoTls, manager_config),
        };
        let timeouts = Timeouts {
            wait: Some(self.connect_timeout),
            create: Some(self.connect_timeout),
            recycle: Some(self.connect_timeout),
        };
        Pool::builder(manager)
            .max_size(self.pool_size)
            .timeouts(timeouts)
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| ConfigError::Url(e.to_string()))
    }
}

/// `config` with its first host reached at `address` instead (its name
/// kept for TLS), and every other setting idem's sessions use.
fn redirected(
    config: &tokio_postgres::Config,
    address: std::net::SocketAddr,
) -> tokio_postgres::Config {
    let mut to = tokio_postgres::Config::new();
    if let Some(tokio_postgres::config::Host::Tcp(host)) = config.get_hosts().first() {
        to.host(host);
    }
    to.hostaddr(address.ip()).port(address.port());
    if let Some(user) = config.get_user() {
        to.user(user);
    }
    if let Some(password) = config.get_password() {
        to.password(password);
    }
    if let Some(dbname) = config.get_dbname() {
        to.dbname(dbname);
    }
    if let Some(options) = config.get_options() {
        to.options(options);
    }
    if let Some(name) = config.get_application_name() {
        to.application_name(name);
    }
    to.ssl_mode(config.get_ssl_mode());
    to
}

/// Why the database cannot be used. Each names the database, as
/// [`DatabaseConfig::describe`] does.
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
    /// Shutdown was asked for while waiting.
    #[error("interrupted while waiting for PostgreSQL")]
    Interrupted,
}

/// libpq's `sslmode=verify-full` is what `require` does here (tokio-postgres
/// knows only `disable`, `prefer` and `require`): connection strings copied
/// from a provider's console often say it.
fn verify_full_as_require(url: &str) -> std::borrow::Cow<'_, str> {
    const FULL: &str = "sslmode=verify-full";
    let mut out = String::new();
    let mut rest = url;
    while let Some(at) = rest.find(FULL) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + FULL.len()..].chars().next();
        let starts = before.is_none_or(|c| c == '?' || c == '&' || c.is_whitespace());
        let ends = after.is_none_or(|c| c == '&' || c.is_whitespace());
        out.push_str(&rest[..at]);
        out.push_str(if starts && ends {
            "sslmode=require"
        } else {
            FULL
        });
        rest = &rest[at + FULL.len()..];
    }
    if out.is_empty() {
        return std::borrow::Cow::Borrowed(url);
    }
    out.push_str(rest);
    std::borrow::Cow::Owned(out)
}

/// Why a connection string does not parse, with tokio-postgres's cause
/// ("invalid value for option `sslmode`") but never a character of the
/// string itself, which may be part of a password.
fn parse_error(error: &tokio_postgres::Error, url: &str) -> String {
    use std::error::Error as _;
    // Read as key=value pairs, another scheme fails on its end.
    if let Some((scheme, _)) = url.split_once("://")
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
        && !matches!(scheme, "postgres" | "postgresql")
    {
        return format!("it must start with postgres:// or postgresql://, not {scheme}://");
    }
    match error.source() {
        Some(cause) => {
            let cause = cause.to_string();
            let cause = cause.split(" but got ").next().unwrap_or_default();
            format!("{error}: {cause}")
        }
        None => error.to_string(),
    }
}

/// A TLS connector that verifies the server against `ca_file`'s
/// certificates, or the system's.
fn tls_connector(ca_file: Option<&Path>) -> Result<MakeRustlsConnect, ConfigError> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let (_, certificates) = crate::tls::ca_file(path)?;
            let (added, _) = roots.add_parsable_certificates(certificates);
            if added == 0 {
                return Err(crate::tls::CaFileError {
                    path: path.display().to_string(),
                    reason: "no usable certificate in it".into(),
                }
                .into());
            }
        }
        None => {
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            if roots.is_empty() {
                return Err(ConfigError::NoRoots);
            }
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(crate::tls::provider()))
        .with_safe_default_protocol_versions()
        .map_err(|error| ConfigError::Tls(error.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
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

/// A plain SQL identifier that needs no quoting.
#[doc(hidden)]
pub fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name.len() <= 63
}

/// The consume records and the failure ledger of one consumer group.
#[derive(Clone)]
pub struct Store {
    /// Shared by every in-flight transaction of the worker.
    pool: Pool,
    /// Part of the consume record's key: each group applies an event once.
    consumer_group: String,
    /// The closed epochs' filters its claims consult: none until someone
    /// syncs them (a worker does), and then a claim looks into a closed
    /// epoch only for the events its filter may hold.
    filters: Arc<Filters>,
    /// Connections its claims share, committing without waiting for their
    /// own flush (a worker's store has them).
    lanes: Option<Lanes>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("consumer_group", &self.consumer_group)
            .field("pool", &self.pool.status())
            .field("filters", &self.filters)
            .field("lanes", &self.lanes.is_some())
            .finish()
    }
}

impl Store {
    /// A store for `consumer_group` over `pool`, with no filter yet.
    pub fn new(pool: Pool, consumer_group: impl Into<String>) -> Self {
        Self {
            pool,
            consumer_group: consumer_group.into(),
            filters: Arc::default(),
            lanes: None,
        }
    }

    /// The same store, its claims consulting `filters`.
    pub fn with_filters(self, filters: Arc<Filters>) -> Self {
        Self { filters, ..self }
    }

    /// The same store, the claims of a handler with a tally sent on
    /// `lanes`, committing without waiting for their own flush;
    /// [`Applier::apply`] returns once a flush on their lane is done.
    pub fn with_lanes(self, lanes: Lanes) -> Self {
        Self {
            lanes: Some(lanes),
            ..self
        }
    }

    /// The lanes of its claims, if it has them.
    pub fn lanes(&self) -> Option<&Lanes> {
        self.lanes.as_ref()
    }

    /// The closed epochs' filters its claims consult.
    pub fn filters(&self) -> &Arc<Filters> {
        &self.filters
    }

    /// The pool the store's statements run on.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The consumer group whose records this store keeps.
    pub fn consumer_group(&self) -> &str {
        &self.consumer_group
    }

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

    /// Counts a genuine failure of `event_id`, in a transaction of its own
    /// (the failed one rolled back); returns how many there were.
    pub async fn record_failure(&self, event_id: &str, error: &str) -> Result<u32, StoreError> {
        let client = self.pool.get().await?;
        let failures = ledger::record(&client, event_id, &self.consumer_group, error).await?;
        Ok(u32::try_from(failures).unwrap_or(0))
    }

    /// The events among `event_ids` that already failed `max_failures` times.
    pub async fn exhausted(
        &self,
        event_ids: &[&str],
        max_failures: u32,
    ) -> Result<Vec<String>, StoreError> {
        let client = self.pool.get().await?;
        let max = i32::try_from(max_failures).unwrap_or(i32::MAX);
        Ok(ledger::exhausted(&client, event_ids, &self.consumer_group, max).await?)
    }

    /// The recorded failures of each of `event_ids` that has some.
    pub async fn ledger_entries(
        &self,
        event_ids: &[&str],
    ) -> Result<HashMap<String, LedgerEntry>, StoreError> {
        if event_ids.is_empty() {
            return Ok(HashMap::new());
        }
        let client = self.pool.get().await?;
        Ok(ledger::entries(&client, event_ids, &self.consumer_group).await?)
    }

    /// How many consume records this consumer group has, and when the
    /// oldest was written.
    pub async fn records(&self) -> Result<(i64, Option<SystemTime>), StoreError> {
        let client = self.pool.get().await?;
        let row = client
            .query_one(
                "SELECT count(*), min(consumed_at) FROM mq_consume_record WHERE consumer_group = $1",
                &[&self.consumer_group],
            )
            .await?;
        Ok((row.try_get(0)?, row.try_get(1)?))
    }

    /// How many events of this consumer group are failing: a failure
    /// counted in the ledger, neither applied since nor dead-lettered (the
    /// dead-letter index holds none of their letters); looking at no more
    /// than `at_most` of them (a status costs the same whatever the ledger
    /// holds); `true` with the count when there were more to look at.
    pub async fn failing(&self, at_most: i64) -> Result<(i64, bool), StoreError> {
        let client = self.pool.get().await?;
        let row = client
            .query_one(
                // Not the rows of events recorded since (see `ledger::EXHAUSTED`).
                "WITH looked AS MATERIALIZED (\
                     SELECT event_id FROM mq_failure_ledger AS ledger WHERE consumer_group = $1 \
                     AND NOT EXISTS (SELECT FROM mq_dead_letter AS letter \
                         WHERE letter.consumer_group = $1 \
                           AND letter.letter_key = 'event ' || ledger.event_id) \
                     LIMIT $2::bigint + 1) \
                 SELECT count(*) FILTER (WHERE event_id NOT IN (\
                            SELECT recorded.event_id FROM mq_recorded(\
                                ARRAY(SELECT event_id FROM looked), $1) AS recorded)), \
                        count(*) > $2::bigint \
                 FROM looked",
                &[&self.consumer_group, &at_most],
            )
            .await?;
        let (count, more): (i64, bool) = (row.try_get(0)?, row.try_get(1)?);
        Ok((count.min(at_most), more))
    }

    /// Which of `event_ids` this consumer group applied already.
    pub async fn recorded(&self, event_ids: &[&str]) -> Result<HashSet<String>, StoreError> {
        if event_ids.is_empty() {
            return Ok(HashSet::new());
        }
        let client = self.pool.get().await?;
        Ok(claim::recorded(&client, &self.consumer_group, event_ids).await?)
    }

    /// Counts one more copy of each of `letters` in the dead-letter index:
    /// they are about to be dead-lettered.
    pub async fn index_dead_letters(&self, letters: &[DeadLetter]) -> Result<(), StoreError> {
        self.dead_lettered(letters, &[]).await
    }

    /// [`Store::index_dead_letters`], and in the same transaction the
    /// messages the handler sends when it is given up on, for each death
    /// no copy sent them for before.
    pub(crate) async fn dead_lettered(
        &self,
        letters: &[DeadLetter],
        given_up: &[GivenUpMessages],
    ) -> Result<(), StoreError> {
        if letters.is_empty() {
            return Ok(());
        }
        let mut client = self.pool.get().await?;
        if given_up.iter().all(|death| death.messages.is_empty()) {
            return Ok(dead_letters::write(&client, &self.consumer_group, letters, None).await?);
        }
        let tx = client.transaction().await?;
        dead_letters::write(&tx, &self.consumer_group, letters, None).await?;
        dead_letters::write_given_up(&tx, &self.consumer_group, given_up).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Takes one copy of each of `keys` off the dead-letter index: their
    /// letters were replayed or discarded.
    pub async fn dead_letters_taken(&self, keys: &[&str]) -> Result<(), StoreError> {
        if keys.is_empty() {
            return Ok(());
        }
        let client = self.pool.get().await?;
        Ok(dead_letters::take(&client, &self.consumer_group, keys).await?)
    }

    /// The last error the dead-letter index keeps for each of `keys` that
    /// has one: the ledger's when the letter died, kept after a replay
    /// resets the ledger.
    pub async fn dead_letter_errors(
        &self,
        keys: &[&str],
    ) -> Result<HashMap<String, String>, StoreError> {
        if keys.is_empty() {
            return Ok(HashMap::new());
        }
        let client = self.pool.get().await?;
        Ok(dead_letters::errors(&client, &self.consumer_group, keys).await?)
    }

    /// Indexes letters a sync found, each one copy; a row last touched
    /// before `started` (the sync's start) is set, not added to.
    pub async fn sync_dead_letters(
        &self,
        letters: &[DeadLetter],
        started: SystemTime,
    ) -> Result<(), StoreError> {
        let client = self.pool.get().await?;
        Ok(dead_letters::write(&client, &self.consumer_group, letters, Some(started)).await?)
    }

    /// Ends a sync that started at `started` and found `letters` letters:
    /// the rows of letters it did not find go. Returns how many went.
    pub async fn dead_letters_synced(
        &self,
        started: SystemTime,
        letters: i64,
    ) -> Result<u64, StoreError> {
        let client = self.pool.get().await?;
        Ok(dead_letters::synced(&client, &self.consumer_group, started, letters).await?)
    }

    /// The database's clock, now.
    pub async fn clock(&self) -> Result<SystemTime, StoreError> {
        let client = self.pool.get().await?;
        Ok(dead_letters::now(&client).await?)
    }

    /// The oldest epoch holding a record of an event of this group that has
    /// a dead letter in the index, and how many such events there are.
    pub async fn held_by_dead_letters(&self) -> Result<(Option<i32>, i64), StoreError> {
        let client = self.pool.get().await?;
        Ok(dead_letters::held_epoch(&client, &self.consumer_group).await?)
    }

    /// The dead-letter index's count of letters, and when it was last
    /// synced with the queue.
    pub async fn dead_letter_totals(&self) -> Result<IndexTotals, StoreError> {
        let client = self.pool.get().await?;
        Ok(dead_letters::totals(&client, &self.consumer_group).await?)
    }

    /// The dead letters of the index that match `filter`, counted.
    pub async fn dead_letter_summary(
        &self,
        filter: &IndexFilter,
    ) -> Result<IndexSummary, StoreError> {
        let mut client = self.pool.get().await?;
        // Planned for the filter given: idem's connections plan generically
        // (for the worker's statements), which would read every row here
        // for the filters that are not there.
        let transaction = client.transaction().await?;
        transaction
            .batch_execute("SET LOCAL plan_cache_mode = force_custom_plan")
            .await?;
        let summary = dead_letters::summary(&transaction, &self.consumer_group, filter).await?;
        transaction.commit().await?;
        Ok(summary)
    }

    /// Forgets the failures of `event_ids`: a replay starts a fresh budget.
    pub async fn reset_ledger(&self, event_ids: &[&str]) -> Result<(), StoreError> {
        if event_ids.is_empty() {
            return Ok(());
        }
        let client = self.pool.get().await?;
        Ok(ledger::reset(&client, event_ids, &self.consumer_group).await?)
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
    fn verify_full_is_read_as_require_and_nothing_else_changes() {
        for (given, read) in [
            (
                "postgres://u:p@db/x?sslmode=verify-full",
                "postgres://u:p@db/x?sslmode=require",
            ),
            (
                "postgres://db/x?sslmode=verify-full&application_name=a",
                "postgres://db/x?sslmode=require&application_name=a",
            ),
            (
                "host=db sslmode=verify-full user=u",
                "host=db sslmode=require user=u",
            ),
            (
                "postgres://db/x?sslmode=prefer",
                "postgres://db/x?sslmode=prefer",
            ),
            // Part of another value (a password, say): left alone.
            (
                "postgres://db/x?password=xsslmode=verify-full",
                "postgres://db/x?password=xsslmode=verify-full",
            ),
        ] {
            assert_eq!(verify_full_as_require(given), read);
        }
    }

    #[test]
    fn a_connection_string_that_does_not_parse_says_why_without_echoing_it() {
        let said = |url: &str| {
            url.parse::<tokio_postgres::Config>()
                .err()
                .map(|e| parse_error(&e, url))
        };
        let error = said("postgres://db/x?sslmode=verify-ca");
        assert_eq!(
            error.as_deref(),
            Some("invalid connection string: invalid value for option `sslmode`")
        );
        // tokio-postgres's own text would end "but got `h`": a character of
        // the password.
        let error = said("host=db password hunter2");
        assert_eq!(
            error.as_deref(),
            Some("invalid connection string: unexpected character at byte 17: expected `=`")
        );
        // Another database's URL reads as key=value pairs and fails at its
        // end: the scheme is what is wrong.
        assert_eq!(
            said("mysql://x").as_deref(),
            Some("it must start with postgres:// or postgresql://, not mysql://")
        );
        // What precedes a :// that is no scheme is never echoed.
        let error = said("password=se://cret host").unwrap_or_default();
        assert!(!error.contains("se:") && !error.contains("cret"), "{error}");
    }

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
