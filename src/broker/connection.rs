//! Connecting to RabbitMQ, and telling a broker that is not there yet from
//! one that refuses us.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use backon::{BackoffBuilder, Retryable};
use futures::StreamExt;
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::tcp::OwnedTLSConfig;
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::secret::SecretUrl;

/// Where the broker is: one node, or several nodes of a cluster.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AmqpConfig {
    /// `amqp://user:password@host:port/vhost`, or several such URLs
    /// separated by commas (the nodes of a cluster); may carry passwords.
    pub url: SecretUrl,
    /// With `amqps://`: CA certificates (PEM) the broker's certificate may
    /// chain to, besides the system's.
    pub ca_file: Option<PathBuf>,
    /// Which URL the next connection tries first, shared by the clones of
    /// this configuration: the one after the last that answered.
    next: Arc<AtomicUsize>,
    /// Where to connect instead of the URL's host and port (a check's proxy).
    through: Option<std::net::SocketAddr>,
}

/// How long one node may take to accept a connection before the next is
/// tried: a node cut off by the network never answers at all.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

impl AmqpConfig {
    /// The broker at `url` (or at each of the comma-separated URLs),
    /// verified against the system's CAs if `amqps://`.
    pub fn new(url: SecretUrl) -> Self {
        Self {
            url,
            ca_file: None,
            next: Arc::default(),
            through: None,
        }
    }

    /// The same broker, reached through `address` (a proxy) whatever the
    /// URL says: for `amqp://` URLs only, as TLS would check the proxy's
    /// address against the broker's certificate.
    pub(crate) fn through(&self, address: std::net::SocketAddr) -> Self {
        Self {
            through: Some(address),
            next: Arc::default(),
            ..self.clone()
        }
    }

    /// The address of the first node, for a proxy in front of it; an error
    /// says why there can be none.
    pub(crate) async fn address(&self) -> Result<std::net::SocketAddr, String> {
        let uri = self.parse_node(0)?;
        if uri.scheme == AMQPScheme::AMQPS {
            return Err(
                "amqps:// URLs cannot be reached through a proxy: give an amqp:// URL".into(),
            );
        }
        let host = uri.authority.host;
        let unresolved = || format!("its host {host} does not resolve");
        tokio::net::lookup_host((host.as_str(), uri.authority.port))
            .await
            .map_err(|_| unresolved())?
            .next()
            .ok_or_else(unresolved)
    }

    /// The same broker, its certificate also verified against the CA
    /// certificates (PEM) in `path`.
    pub fn with_ca_file(self, path: PathBuf) -> Self {
        Self {
            ca_file: Some(path),
            ..self
        }
    }

    /// The broker as logs and errors name it: what was parsed out of each
    /// URL, without its password; never a URL itself.
    pub fn describe(&self) -> String {
        (0..self.urls().len())
            .map(|node| self.describe_node(node))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// How errors name a URL that does not parse; the command line says
    /// instead where it came from (`--amqp-url`, `AMQP_URL`).
    pub const URL: &'static str = "the AMQP URL";

    /// [`AmqpConfig::describe`] for the `node`-th URL.
    fn describe_node(&self, node: usize) -> String {
        match self.parse_node(node) {
            Ok(uri) => format!(
                "{}://{}@{}:{}/{}",
                uri.scheme,
                uri.authority.userinfo.username,
                uri.authority.host,
                uri.authority.port,
                percent_encoding::utf8_percent_encode(&uri.vhost, VHOST_ENCODED)
            ),
            Err(_) if self.urls().len() == 1 => Self::URL.to_owned(),
            Err(_) => format!("AMQP URL number {}", node + 1),
        }
    }

    /// The URLs as written: split at each comma that a scheme follows, so
    /// that a comma elsewhere (an unencoded one in a password, say) is not
    /// taken for a separator.
    fn urls(&self) -> Vec<&str> {
        let text = self.url.expose();
        let mut urls = Vec::new();
        let mut start = 0;
        for (comma, _) in text.match_indices(',') {
            let next = text[comma + 1..].trim_start();
            if next.starts_with("amqp://") || next.starts_with("amqps://") {
                urls.push(text[start..comma].trim());
                start = comma + 1;
            }
        }
        urls.push(text[start..].trim());
        urls
    }

    /// The `node`-th URL, parsed, unless it does not parse as written (see
    /// [`crate::secret::parsed_as_written`]): then why, without a character
    /// of it.
    fn parse_node(&self, node: usize) -> Result<AMQPUri, String> {
        let urls = self.urls();
        let url = urls.get(node).copied().unwrap_or_default();
        let uri: AMQPUri = url
            .parse()
            .map_err(|e: String| crate::secret::redact(&e.replace(url, "")))?;
        if !crate::secret::parsed_as_written(url, uri.authority.userinfo.password.as_bytes()) {
            return Err("its password is not where a URL's password stands".into());
        }
        Ok(uri)
    }
}

/// What a vhost's name encodes when a URL names it: all but a URL path's
/// unreserved characters, so that `/` reads `%2F` and `my_app` stays.
const VHOST_ENCODED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// Why a connection could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The broker answered and said no: wrong user or password, unknown
    /// vhost, no permission. Retrying will not help.
    #[error("RabbitMQ at {url} refused the connection: {reason}")]
    Refused {
        /// The broker, as [`AmqpConfig::describe`] names it.
        url: String,
        /// What the broker said.
        reason: String,
    },
    /// idem's own settings for the connection cannot work (a CA file with
    /// an `amqp://` URL, a CA file that is not PEM). Retrying will not help.
    #[error("cannot use {url} for RabbitMQ: {reason}")]
    Settings {
        /// The broker, as [`AmqpConfig::describe`] names it.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// The broker could not be reached or dropped us (no node of a
    /// cluster answered): worth retrying.
    #[error("RabbitMQ at {url} is unreachable: {reason}")]
    Unreachable {
        /// The broker, as [`AmqpConfig::describe`] names it.
        url: String,
        /// Why, from the client (the last node's, for a cluster).
        reason: String,
    },
    /// Shutdown was asked for while waiting for the broker.
    #[error("interrupted while waiting for RabbitMQ")]
    Interrupted,
}

impl ConnectError {
    /// True when retrying cannot help.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            ConnectError::Refused { .. }
                | ConnectError::Settings { .. }
                | ConnectError::Interrupted
        )
    }
}

/// Opens a connection named `name` (shown in the management UI). With
/// several URLs, tries each once, starting after the one that answered
/// last: the first connection goes to the first node that answers, and the
/// one after a loss to the next node that answers.
pub async fn connect(config: &AmqpConfig, name: &str) -> Result<Connection, ConnectError> {
    let nodes = config.urls().len();
    // Every URL is checked before any is tried: a mistake in the third is
    // not found only once the first two nodes are down.
    let uris = (0..nodes)
        .map(|node| {
            config.parse_node(node).map_err(|reason| {
                let hint = if config.urls()[node].contains('@') {
                    "; a / # @ , or % in the user or password must be percent-encoded"
                } else {
                    ""
                };
                ConnectError::Settings {
                    url: config.describe_node(node),
                    reason: format!("not a valid amqp:// or amqps:// URL ({reason}{hint})"),
                }
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let first = config.next.load(Ordering::Relaxed);
    let mut unreachable = None;
    for step in 0..nodes {
        let node = (first + step) % nodes;
        let url = config.describe_node(node);
        let attempt = connect_node(config, uris[node].clone(), &url, name);
        let error = match tokio::time::timeout(CONNECT_TIMEOUT, attempt).await {
            Ok(Ok(connection)) => {
                config.next.store((node + 1) % nodes, Ordering::Relaxed);
                if nodes > 1 {
                    info!(node = %url, "connected to RabbitMQ at {url}");
                }
                return Ok(connection);
            }
            Ok(Err(error)) if error.is_refusal() => return Err(error),
            Ok(Err(error)) => error,
            Err(_) => ConnectError::Unreachable {
                url,
                reason: format!("no answer within {}s", CONNECT_TIMEOUT.as_secs()),
            },
        };
        if nodes > 1 {
            warn!("{error}; trying the next node");
        }
        unreachable = Some(error);
    }
    Err(match unreachable {
        Some(ConnectError::Unreachable { reason, .. }) if nodes > 1 => ConnectError::Unreachable {
            url: format!("every node ({})", config.describe()),
            reason,
        },
        Some(error) => error,
        None => unreachable!("a configuration has at least one URL"),
    })
}

/// Opens a connection to one node, `url` as logs name it.
async fn connect_node(
    config: &AmqpConfig,
    mut uri: AMQPUri,
    url: &str,
    name: &str,
) -> Result<Connection, ConnectError> {
    if let Some(address) = config.through {
        uri.authority.host = address.ip().to_string();
        uri.authority.port = address.port();
    }
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    let unusable = |reason: String| ConnectError::Settings {
        url: url.to_owned(),
        reason,
    };
    let tls = match &config.ca_file {
        None => OwnedTLSConfig::default(),
        Some(_) if uri.scheme != AMQPScheme::AMQPS => {
            return Err(unusable(
                "a CA file is set, but the URL is not amqps://: idem would connect without TLS"
                    .into(),
            ));
        }
        Some(path) => {
            // Read at every connection: a renewed CA file is picked up.
            let (pem, _) =
                crate::tls::ca_file(path).map_err(|error| unusable(error.to_string()))?;
            OwnedTLSConfig {
                identity: None,
                cert_chain: Some(pem),
            }
        }
    };
    let runtime = lapin::runtime::default_runtime().map_err(|source| classify(url, source))?;
    Connection::connect_uri_with_config(uri, properties, tls, runtime)
        .await
        .map_err(|source| classify(url, source))
}

fn classify(url: &str, source: lapin::Error) -> ConnectError {
    let url = url.to_owned();
    if let Some(reason) = crate::tls::refusal(&source) {
        return ConnectError::Refused {
            url,
            reason: format!("TLS handshake failed: {reason}"),
        };
    }
    if let lapin::ErrorKind::ProtocolError(amqp) = source.kind() {
        let refused = matches!(
            amqp.kind(),
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
                | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)
        );
        if refused {
            return ConnectError::Refused {
                url,
                reason: amqp.get_message().to_string(),
            };
        }
    }
    ConnectError::Unreachable {
        url,
        reason: source.to_string(),
    }
}

/// Connects, retrying with exponential backoff and jitter while the broker
/// is unreachable, for at most `patience` of waiting in all. A refusal
/// (credentials, vhost) ends it at once, as does `shutdown`.
pub async fn connect_with_retry(
    config: &AmqpConfig,
    name: &str,
    patience: Duration,
    shutdown: &CancellationToken,
) -> Result<Connection, ConnectError> {
    let deadline = tokio::time::Instant::now() + patience;
    let attempts = (|| connect(config, name))
        .retry(crate::backoff::until(patience))
        .sleep(tokio::time::sleep)
        .when(|error| !error.is_refusal())
        .notify(|error, wait| warn!("{error}; {}", crate::backoff::retrying(wait, deadline)));
    tokio::select! {
        result = attempts => result,
        () = shutdown.cancelled() => Err(ConnectError::Interrupted),
    }
}

/// What the broker said when it closed a channel or the connection for a
/// reason that reconnecting cannot fix: a missing exchange or queue, no
/// permission, a message it will not take. `None` for anything else, a lost
/// connection above all.
pub fn refusal(error: &lapin::Error) -> Option<String> {
    let lapin::ErrorKind::ProtocolError(amqp) = error.kind() else {
        return None;
    };
    let refused = matches!(
        amqp.kind(),
        AMQPErrorKind::Soft(
            AMQPSoftError::NOTFOUND
                | AMQPSoftError::ACCESSREFUSED
                | AMQPSoftError::PRECONDITIONFAILED
        ) | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)
    );
    refused.then(|| amqp.get_message().to_string())
}

/// What the broker said when it refused an operation for lack of
/// permission (403 ACCESS_REFUSED).
pub fn access_refused(error: &lapin::Error) -> Option<String> {
    match error.kind() {
        lapin::ErrorKind::ProtocolError(amqp)
            if *amqp.kind() == AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED) =>
        {
            Some(amqp.get_message().to_string())
        }
        _ => None,
    }
}

/// Whether the broker said that what was named does not exist (404
/// NOT_FOUND): a queue nobody declared yet, say.
pub fn not_found(error: &lapin::Error) -> bool {
    matches!(
        error.kind(),
        lapin::ErrorKind::ProtocolError(amqp)
            if *amqp.kind() == AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)
    )
}

/// Of two errors that ended a session, the one that explains it: a refusal
/// over the errors it caused (operations on the channel it closed).
pub fn first_refusal(kept: Option<lapin::Error>, new: lapin::Error) -> Option<lapin::Error> {
    match kept {
        Some(kept) if refusal(&kept).is_some() || refusal(&new).is_none() => Some(kept),
        _ => Some(new),
    }
}

/// Why a loop that reconnects after every lost session stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SessionError {
    /// No connection could be opened.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The broker closed the channel for a reason reconnecting cannot fix.
    #[error("RabbitMQ refused: {0}")]
    Refused(String),
    /// Session after session ended before getting anything done.
    #[error("RabbitMQ keeps ending the session before anything is done ({0}); giving up")]
    NoProgress(String),
}

/// Paces a loop that opens a new session after each lost one: at once after
/// a session that got something done, with growing waits (and jitter) after
/// sessions that did not, so that a broker that keeps closing the channel is
/// not hammered; gives up once those waits add up to the patience.
#[derive(Debug)]
pub struct Reconnects {
    patience: Duration,
    waits: crate::backoff::Deadline,
    /// What the connection was lost during, for the log: "publishing".
    doing: &'static str,
}

impl Reconnects {
    /// Pacing that gives up after `patience` of waiting without progress;
    /// `doing` names the work in the one log line of each reconnect.
    pub fn new(patience: Duration, doing: &'static str) -> Self {
        Self {
            patience,
            waits: crate::backoff::until(patience).build(),
            doing,
        }
    }

    /// Decides what follows a session that ended with `error`: an error
    /// when reconnecting cannot help, otherwise a wait (none if the session
    /// `progressed`), cut short by `shutdown`.
    pub async fn after(
        &mut self,
        error: &lapin::Error,
        progressed: bool,
        shutdown: &CancellationToken,
    ) -> Result<(), SessionError> {
        if let Some(reason) = refusal(error) {
            return Err(SessionError::Refused(reason));
        }
        if progressed {
            self.waits = crate::backoff::until(self.patience).build();
            warn!(%error, "connection to RabbitMQ lost while {}; reconnecting", self.doing);
            return Ok(());
        }
        let Some(wait) = self.waits.next() else {
            return Err(SessionError::NoProgress(error.to_string()));
        };
        warn!(
            %error,
            "connection to RabbitMQ lost while {}, with nothing done since the last one; reconnecting in {:.1}s",
            self.doing,
            wait.as_secs_f64()
        );
        tokio::select! {
            () = tokio::time::sleep(wait) => Ok(()),
            () = shutdown.cancelled() => Ok(()),
        }
    }
}

/// Watches a connection's events for as long as it lives: logs each time
/// the broker blocks it (a memory or disk alarm stops publishers;
/// `connection.blocked`) with the broker's reason, and when it unblocks it;
/// and tells when the connection fails. One watch per connection: lapin
/// hands each event to one listener only, so two would steal each other's.
#[derive(Debug)]
pub struct ConnectionWatch {
    task: tokio::task::JoinHandle<()>,
    lost: tokio::sync::watch::Receiver<Option<String>>,
}

impl ConnectionWatch {
    /// Starts watching `connection`, before the work it watches. `doing`
    /// names the work in the lines: consuming, publishing, replaying.
    pub fn start(connection: &Connection, doing: &'static str) -> Self {
        let mut events = connection.events_listener();
        let (tell, lost) = tokio::sync::watch::channel(None);
        let task = tokio::spawn(async move {
            while let Some(event) = events.next().await {
                match event {
                    lapin::Event::Error(error) => {
                        tell.send_replace(Some(error.to_string()));
                    }
                    lapin::Event::ConnectionBlocked(reason) => warn!(
                        %reason,
                        "RabbitMQ blocked the connection (an alarm stops publishers): {doing} waits until it unblocks"
                    ),
                    lapin::Event::ConnectionUnblocked => {
                        tracing::info!("RabbitMQ unblocked the connection: {doing} goes on")
                    }
                    _ => {}
                }
            }
        });
        Self { task, lost }
    }

    /// Resolves, with what went wrong, at the first error of the connection
    /// or of one of its channels (a lost socket, a channel the broker
    /// closed) since the watch started.
    pub fn lost(&self) -> impl Future<Output = String> + Send + 'static {
        let mut lost = self.lost.clone();
        async move {
            match lost.wait_for(Option::is_some).await {
                Ok(reason) => reason.clone().unwrap_or_default(),
                Err(_) => "the connection closed".to_owned(),
            }
        }
    }
}

impl Drop for ConnectionWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Closes `connection` cleanly if it is still open; gives up after a few
/// seconds (a connection that just broke may never answer the close).
pub async fn close(connection: &Connection) {
    let closing = connection.close(200, "OK".into());
    let _ = tokio::time::timeout(Duration::from_secs(5), closing).await;
}

/// Closes `channel` cleanly if it is still open; gives up after a few seconds.
pub async fn close_channel(channel: &lapin::Channel) {
    let closing = channel.close(200, "OK".into());
    let _ = tokio::time::timeout(Duration::from_secs(5), closing).await;
}

#[cfg(test)]
mod tests {
    use lapin::protocol::AMQPError;

    use super::*;

    fn closed_with(kind: AMQPErrorKind, text: &str) -> lapin::Error {
        lapin::ErrorKind::ProtocolError(AMQPError::new(kind, text.into())).into()
    }

    fn lost() -> lapin::Error {
        lapin::ErrorKind::IOError(std::sync::Arc::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        )))
        .into()
    }

    #[test]
    fn a_missing_object_or_permission_is_a_refusal_and_a_lost_connection_is_not() {
        let missing = closed_with(
            AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND),
            "NOT_FOUND - no exchange 'x' in vhost '/'",
        );
        assert_eq!(
            refusal(&missing).as_deref(),
            Some("NOT_FOUND - no exchange 'x' in vhost '/'")
        );
        let forbidden = closed_with(AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED), "403");
        assert!(refusal(&forbidden).is_some());
        let forced = closed_with(AMQPErrorKind::Hard(AMQPHardError::CONNECTIONFORCED), "320");
        assert_eq!(
            refusal(&forced),
            None,
            "an operator closing us is worth a reconnect"
        );
        assert_eq!(refusal(&lost()), None);
    }

    #[test]
    fn the_refusal_explains_a_session_over_the_errors_it_caused() {
        let missing = || closed_with(AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND), "404");
        let kept = first_refusal(first_refusal(None, lost()), missing());
        assert!(kept.as_ref().and_then(refusal).is_some());
        let kept = first_refusal(first_refusal(None, missing()), lost());
        assert!(kept.as_ref().and_then(refusal).is_some());
        let kept = first_refusal(None, lost());
        assert!(kept.as_ref().and_then(refusal).is_none());
    }

    #[test]
    fn a_vhost_is_named_as_a_url_writes_it_without_its_password() {
        let named = |url: &str| AmqpConfig::new(SecretUrl::new(url.to_owned())).describe();
        assert_eq!(
            named("amqp://app:s3cret@broker:5672/newcomer_idem"),
            "amqp://app@broker:5672/newcomer_idem"
        );
        assert_eq!(
            named("amqp://app:s3cret@broker:5672/%2f"),
            "amqp://app@broker:5672/%2F"
        );
        assert_eq!(
            named("amqp://app:s3cret@broker:5672/a%20b"),
            "amqp://app@broker:5672/a%20b"
        );
    }
}
