//! Where the database is and how to reach it: the connection string, TLS,
//! the pool.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime, Timeouts};
use tokio_postgres::NoTls;
use tokio_postgres::config::SslMode;
use tokio_postgres_rustls::MakeRustlsConnect;

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
        // One port for every host, or one each (libpq's two forms).
        let ports = config.get_ports();
        let port_of = |i: usize| match ports {
            [] => None,
            [port] => Some(*port),
            ports => ports.get(i).copied(),
        };
        let hosts: Vec<String> = hosts
            .iter()
            .enumerate()
            .map(|(i, host)| match port_of(i) {
                Some(port) => format!("{host}:{port}"),
                None => host.clone(),
            })
            .collect();
        format!(
            "postgres://{}@{}/{}",
            config.get_user().unwrap_or_default(),
            hosts.join(","),
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

/// A plain SQL identifier that needs no quoting.
#[doc(hidden)]
pub fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name.len() <= 63
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_is_described_by_each_host_with_its_port_and_no_password() {
        for (url, described) in [
            ("postgres://u:secret@db:5433/x", "postgres://u@db:5433/x"),
            (
                "postgres://u:secret@db-1:5441,db-2:5442/x?target_session_attrs=read-write",
                "postgres://u@db-1:5441,db-2:5442/x",
            ),
            (
                "host=db-1,db-2 port=5432 user=u password=secret dbname=x",
                "postgres://u@db-1:5432,db-2:5432/x",
            ),
        ] {
            let config = DatabaseConfig::new(crate::secret::SecretUrl::new(url.to_owned()));
            assert_eq!(config.describe(), described, "{url}");
        }
    }

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
}
