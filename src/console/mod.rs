//! The console: the dead letters and the service's state in a browser,
//! served by the service's own binary from the PostgreSQL it already uses.
//!
//! Pages are rendered on the server (templates compiled in, every value
//! escaped) and need no script; the pages forbid scripts outright
//! (`Content-Security-Policy`), so a body or an error holding HTML is shown
//! as text and never runs. Every count comes from the dead-letter index and
//! its tallies, never from browsing the queue. Replays and discards run as
//! `dlq replay` and `dlq discard` run (a copy is acked only once its replay
//! is confirmed or its line synced to the discard file), in the console's
//! process, whatever becomes of the page that started them; each is
//! recorded in `idem_console_audit`. Where the service allows it, a letter
//! can be replayed with an edited body that the handler decodes.
//!
//! Reading needs no token where the console listens on a loopback address;
//! acting always does: the token of `IDEM_CONSOLE_TOKEN` (as `Authorization:
//! Bearer …`, or entered once in the page, which keeps a session cookie), or
//! the user a trusted reverse proxy names in a header. Forms carry a token
//! of the process's own, and a POST from another origin is refused.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::http::{HeaderValue, header};
use axum::routing::{get, post};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::handler::Handler;
use crate::progress::Progress;
use crate::store::{ReadyError, Store};
use crate::target::{OpenError, Target};

mod access;
mod actions;
mod edits;
mod pages;
mod parked;
mod tls;
mod view;

pub use access::Token;
pub use tls::{ConsoleTls, ConsoleTlsError};

/// The address the console listens on unless told otherwise.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9480";

/// What the console shows and may act on.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ConsoleConfig {
    /// The servers, the consumer group and its queues: the queues' depths,
    /// the replays, the index, the ledger, the records and the audit.
    pub target: Target,
    /// The token actions need; without one (and without a trusted proxy)
    /// nothing can be done, only seen.
    pub token: Option<Token>,
    /// A header in which a reverse proxy in front of the console names the
    /// user it authenticated: trusted as that user. Only for a console a
    /// stranger cannot reach but through the proxy.
    pub trusted_user_header: Option<String>,
    /// Shows of each letter's body only its size and SHA-256, and of its
    /// headers only their names (bodies and headers can hold personal
    /// data).
    pub hide_bodies: bool,
    /// Where discards write their letters before they are acked.
    pub discard_dir: PathBuf,
    /// Reading needs a token too: the console listens beyond loopback.
    pub reading_needs_token: bool,
    /// Whoever may act may replay a letter with a body they edited (once
    /// the handler decodes it; both bodies in the audit). Off unless the
    /// service turns it on; never with [`hide_bodies`](Self::hide_bodies).
    pub allow_edits: bool,
    /// Serves HTTPS with this certificate and key instead of plain HTTP
    /// (for a console with no TLS-terminating proxy in front).
    pub tls: Option<ConsoleTls>,
}

impl ConsoleConfig {
    /// The console of `target`: no token, bodies shown, discards into
    /// `./discarded`, reading open (as on a loopback address).
    pub fn new(target: Target) -> Self {
        Self {
            target,
            token: None,
            trusted_user_header: None,
            hide_bodies: false,
            discard_dir: PathBuf::from("discarded"),
            reading_needs_token: false,
            allow_edits: false,
            tls: None,
        }
    }
}

/// Why the console could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsoleError {
    /// The database's settings.
    #[error(transparent)]
    Config(#[from] crate::store::ConfigError),
    /// The database is not ready (or not migrated).
    #[error(transparent)]
    Ready(#[from] ReadyError),
    /// The address could not be listened on.
    #[error("cannot listen on {addr}: {error}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        error: std::io::Error,
    },
    /// No randomness for the form tokens.
    #[error("no randomness for the console's form tokens: {0}")]
    Random(String),
}

impl From<OpenError> for ConsoleError {
    fn from(error: OpenError) -> Self {
        match error {
            OpenError::Config(error) => Self::Config(error),
            OpenError::Ready(error) => Self::Ready(error),
        }
    }
}

/// The console's state, shared by its pages.
pub struct Console<H> {
    inner: Arc<Inner<H>>,
}

impl<H> Clone for Console<H> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<H> std::fmt::Debug for Console<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Console")
            .field("consumer_group", &self.inner.config.target.consumer_group)
            .finish_non_exhaustive()
    }
}

struct Inner<H> {
    config: ConsoleConfig,
    handler: Arc<H>,
    store: Store,
    forms: access::FormKey,
    broker: tokio::sync::Mutex<Option<lapin::Connection>>,
    /// Actions this process runs, by audit number.
    running: Mutex<HashMap<i64, Progress>>,
    /// Their tasks, awaited before the console stops.
    tasks: TaskTracker,
    shutdown: CancellationToken,
    /// Wrong tokens at the login, per client address.
    tries: access::LoginTries,
}

impl<H: Handler> Console<H> {
    /// The console over `config`'s database (waiting for it, and for its
    /// migrations, at most the patience); actions stop at `shutdown`.
    pub async fn new(
        config: ConsoleConfig,
        handler: Arc<H>,
        shutdown: CancellationToken,
    ) -> Result<Self, ConsoleError> {
        let store = config.target.ready_store::<H>(&shutdown).await?;
        let forms = access::FormKey::random().map_err(ConsoleError::Random)?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                handler,
                store,
                forms,
                broker: tokio::sync::Mutex::new(None),
                running: Mutex::new(HashMap::new()),
                tasks: TaskTracker::new(),
                shutdown,
                tries: access::LoginTries::default(),
            }),
        })
    }

    /// The console's pages, to serve on their own or beside other routes.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/", get(pages::overview::<H>))
            .route("/groups", get(pages::groups::<H>))
            .route("/groups/{id}", get(pages::group::<H>))
            .route("/letter", get(pages::letter::<H>))
            .route("/audit", get(pages::audit::<H>))
            .route("/parked", get(parked::list::<H>).post(parked::act::<H>))
            .route("/parked/preview", post(parked::preview::<H>))
            .route("/actions/{id}", get(actions::progress::<H>))
            .route("/actions/{id}/file", get(actions::file::<H>))
            .route("/actions/preview", post(actions::preview::<H>))
            .route("/actions", post(actions::start::<H>))
            .route("/edits/preview", post(edits::preview::<H>))
            .route("/edits", post(edits::start::<H>))
            .route(
                "/login",
                get(access::login_page::<H>).post(access::login::<H>),
            )
            .route("/logout", post(access::logout))
            .route("/console.css", get(view::stylesheet))
            .fallback(view::not_found)
            .layer(axum::middleware::map_response(secure_headers))
            .with_state(self.clone())
    }

    /// Serves the console on `addr` until `shutdown`.
    pub async fn serve(self, addr: SocketAddr) -> Result<(), ConsoleError> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|error| ConsoleError::Listen { addr, error })?;
        self.serve_on(listener).await;
        Ok(())
    }

    /// Serves the console on `listener` (over TLS when the config has a
    /// certificate) until `shutdown`; then waits for the actions under way
    /// to end.
    pub async fn serve_on(self, listener: tokio::net::TcpListener) {
        let Ok(bound) = listener.local_addr() else {
            warn!("the console's listener has no address: it serves nothing");
            return;
        };
        let stopping = self.inner.shutdown.clone().cancelled_owned();
        let served = match self.inner.config.tls.clone() {
            Some(tls) => {
                let listener = tls::TlsListener::new(listener, bound, &tls);
                info!(addr = %bound, "the console is at https://{bound}/");
                let routes = self
                    .router()
                    .into_make_service_with_connect_info::<tls::TlsPeer>();
                axum::serve(listener, routes)
                    .with_graceful_shutdown(stopping)
                    .await
            }
            None => {
                info!(addr = %bound, "the console is at http://{bound}/");
                let routes = self
                    .router()
                    .into_make_service_with_connect_info::<SocketAddr>();
                axum::serve(listener, routes)
                    .with_graceful_shutdown(stopping)
                    .await
            }
        };
        if let Err(error) = served {
            warn!(%error, "the console stopped");
        }
        // Actions under way end as they would if the process stopped: what
        // was confirmed is acked, the rest stays dead-lettered.
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
    }
}

/// Headers of every answer: no script, no frame, no sniffing, no caching,
/// no referrer to another site.
async fn secure_headers(mut response: axum::response::Response) -> axum::response::Response {
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'self'; img-src 'self' data:; \
             form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}
