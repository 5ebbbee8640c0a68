//! Where the suite finds PostgreSQL and RabbitMQ, their URLs edited per
//! test, `rabbitmqctl`, and vhosts of a test's own.

use super::*;

/// Where the suite finds its services. The environment says, with defaults
/// for a PostgreSQL and a RabbitMQ on this host as installed:
/// `IDEM_TEST_DATABASE_URL` (a URL whose role may create schemas, databases
/// and roles) and `IDEM_TEST_AMQP_URL` (whose user the suite grants its
/// vhosts to, with `rabbitmqctl`).
pub(crate) struct Services {
    database: Url,
    amqp: Url,
}

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

pub(crate) fn services() -> &'static Services {
    static SERVICES: OnceLock<Services> = OnceLock::new();
    SERVICES.get_or_init(|| Services {
        database: setting("IDEM_TEST_DATABASE_URL", DEFAULT_DATABASE_URL, 5432),
        amqp: setting("IDEM_TEST_AMQP_URL", DEFAULT_AMQP_URL, 5672),
    })
}

/// The URL in `variable`, or `default`; a setting the suite cannot use
/// stops it at once, saying which.
pub(crate) fn setting(variable: &str, default: &str, default_port: u16) -> Url {
    let value = std::env::var(variable).unwrap_or_else(|_| default.to_owned());
    let url = Url::parse(&value)
        .ok()
        .filter(|url| url.host_str().is_some() && url.path().len() > 1);
    let Some(mut url) = url else {
        panic!("{variable} must be a URL with a host and a path (the default is {default})");
    };
    if url.port().is_none() {
        url.set_port(Some(default_port))
            .unwrap_or_else(|()| panic!("{variable}: a URL that cannot take a port"));
    }
    url
}

/// Adds `key=value` to `url`'s query, spaces as `%20` (PostgreSQL's
/// parser does not read `+` as a space).
pub fn append_query(url: &mut Url, key: &str, value: &str) {
    const UNRESERVED: &AsciiSet = &NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    let pair = format!("{key}={}", utf8_percent_encode(value, UNRESERVED));
    let query = match url.query() {
        Some(query) if !query.is_empty() => format!("{query}&{pair}"),
        _ => pair,
    };
    url.set_query(Some(&query));
}

/// `url` changed by `edit`.
pub(crate) fn edited(url: &Url, edit: impl FnOnce(&mut Url)) -> String {
    let mut url = url.clone();
    edit(&mut url);
    url.into()
}

/// `host:port` of `url` (set by [`setting`]).
pub(crate) fn host_port(url: &Url) -> String {
    format!(
        "{}:{}",
        url.host_str().unwrap_or_default(),
        url.port().unwrap_or_default()
    )
}

/// An address of `url`'s server, for a proxy in front of it.
pub(crate) fn address_of(url: &Url) -> SocketAddr {
    let host_port = host_port(url);
    host_port
        .to_socket_addrs()
        .ok()
        .and_then(|mut addresses| addresses.next())
        .unwrap_or_else(|| panic!("cannot resolve {host_port}"))
}

/// The database the tests' schemas live in.
pub fn database_url() -> String {
    services().database.to_string()
}

/// The test database's URL changed by `edit` (another user, say).
pub fn database_url_with(edit: impl FnOnce(&mut Url)) -> String {
    edited(&services().database, edit)
}

/// Another database on the same server.
pub fn database_url_in(database: &str) -> String {
    database_url_with(|url| url.set_path(database))
}

/// The test database through a proxy on this host's `port`.
pub fn database_url_at(port: u16) -> String {
    database_url_with(|url| {
        let _ = url.set_host(Some("127.0.0.1"));
        let _ = url.set_port(Some(port));
    })
}

/// The name of the database of [`database_url`].
pub fn database_name() -> String {
    services()
        .database
        .path()
        .trim_start_matches('/')
        .to_owned()
}

/// The database server's `host:port`, as the URL writes it.
pub fn postgres_host_port() -> String {
    host_port(&services().database)
}

/// The database server's address, for a proxy.
pub fn postgres_address() -> SocketAddr {
    address_of(&services().database)
}

/// The broker, on the vhost of [`DEFAULT_AMQP_URL`] unless told otherwise.
pub fn amqp_url() -> String {
    services().amqp.to_string()
}

/// The broker's URL changed by `edit` (a wrong password, say).
pub fn amqp_url_with(edit: impl FnOnce(&mut Url)) -> String {
    edited(&services().amqp, edit)
}

/// The broker's URL on `vhost`.
pub fn amqp_url_on(vhost: &str) -> String {
    amqp_url_with(|url| url.set_path(&utf8_percent_encode(vhost, NON_ALPHANUMERIC).to_string()))
}

/// The broker through a proxy on this host's `port`.
pub fn amqp_url_at(port: u16) -> String {
    amqp_url_with(|url| {
        let _ = url.set_host(Some("127.0.0.1"));
        let _ = url.set_port(Some(port));
    })
}

/// The vhost of [`amqp_url`].
pub fn amqp_vhost() -> String {
    let path = services().amqp.path().trim_start_matches('/');
    percent_decode_str(path).decode_utf8_lossy().into_owned()
}

/// The user the broker knows the suite as.
pub fn amqp_user() -> String {
    percent_decode_str(services().amqp.username())
        .decode_utf8_lossy()
        .into_owned()
}

/// `user:password` of the broker's URL, as it writes them: what no output
/// may show.
pub fn amqp_credentials() -> String {
    let url = &services().amqp;
    format!("{}:{}", url.username(), url.password().unwrap_or_default())
}

/// The broker's `host:port`, as the URL writes it.
pub fn amqp_host_port() -> String {
    host_port(&services().amqp)
}

/// The broker's address, for a proxy.
pub fn amqp_address() -> SocketAddr {
    address_of(&services().amqp)
}

/// `rabbitmqctl` for that broker: `IDEM_TEST_RABBITMQCTL` (split on white
/// space) or `rabbitmqctl`.
pub fn rabbitmqctl() -> std::process::Command {
    let line = std::env::var("IDEM_TEST_RABBITMQCTL").unwrap_or_else(|_| "rabbitmqctl".into());
    let mut words = line.split_whitespace();
    let mut command = std::process::Command::new(words.next().unwrap_or("rabbitmqctl"));
    command.args(words);
    command
}
/// Runs `rabbitmqctl` with `args`; its error output becomes the error.
pub fn rabbitmqctl_run(args: &[&str]) -> anyhow::Result<()> {
    let output = rabbitmqctl()
        .args(args)
        .output()
        .context("running rabbitmqctl")?;
    if !output.status.success() {
        bail!(
            "rabbitmqctl {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

/// A vhost of a test's own, deleted when the test ends, however it ends.
pub struct Vhost(pub String);

impl Vhost {
    /// A name, swept with the rest if this process dies; nothing created yet.
    pub fn named() -> Self {
        Self(unique_name())
    }

    /// A new vhost on which the suite's user has these configure, write and read
    /// permissions (regular expressions over object names).
    pub fn add(configure: &str, write: &str, read: &str) -> anyhow::Result<Self> {
        let vhost = Self::named();
        rabbitmqctl_run(&["add_vhost", &vhost.0])?;
        rabbitmqctl_run(&[
            "set_permissions",
            "-p",
            &vhost.0,
            &amqp_user(),
            configure,
            write,
            read,
        ])?;
        Ok(vhost)
    }

    /// The broker's URL on this vhost.
    pub fn amqp_url(&self) -> String {
        amqp_url_on(&self.0)
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        let _ = rabbitmqctl_run(&["delete_vhost", &self.0]);
    }
}
