//! Connecting to RabbitMQ, and telling a broker that is not there yet from
//! one that refuses us.

use std::time::Duration;

use backon::Retryable;
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::uri::AMQPUri;
use lapin::{Connection, ConnectionProperties};

use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::secret::SecretUrl;

/// Where the broker is.
#[derive(Debug, Clone)]
pub struct AmqpConfig {
    /// `amqp://user:password@host:port/vhost`; may carry a password.
    pub url: SecretUrl,
}

/// Why a connection could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The broker answered and said no: wrong user or password, unknown
    /// vhost, no permission. Retrying will not help.
    #[error("RabbitMQ at {url} refused the connection: {reason}")]
    Refused {
        /// The URL, redacted.
        url: String,
        /// What the broker said.
        reason: String,
    },
    /// The broker could not be reached or dropped us: worth retrying.
    #[error("RabbitMQ at {url} is unreachable: {source}")]
    Unreachable {
        /// The URL, redacted.
        url: String,
        /// The client's error.
        source: lapin::Error,
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
            ConnectError::Refused { .. } | ConnectError::Interrupted
        )
    }
}

/// Opens a connection named `name` (shown in the management UI).
pub async fn connect(config: &AmqpConfig, name: &str) -> Result<Connection, ConnectError> {
    let uri: AMQPUri = config.url.expose().parse().map_err(|e: String| {
        // The parser may quote the URL, password and all.
        let reason = e.replace(config.url.expose(), &config.url.redacted());
        ConnectError::Refused {
            url: config.url.redacted(),
            reason: format!("not a valid amqp:// or amqps:// URL ({reason})"),
        }
    })?;
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    Connection::connect_uri(uri, properties)
        .await
        .map_err(|source| classify(&config.url, source))
}

fn classify(url: &SecretUrl, source: lapin::Error) -> ConnectError {
    let url = url.redacted();
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
    ConnectError::Unreachable { url, source }
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
    let attempts = (|| connect(config, name))
        .retry(crate::backoff::until(patience))
        .sleep(tokio::time::sleep)
        .when(|error| !error.is_refusal())
        .notify(|error, wait| warn!("{error}; retrying in {:.1}s", wait.as_secs_f64()));
    tokio::select! {
        result = attempts => result,
        () = shutdown.cancelled() => Err(ConnectError::Interrupted),
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
