//! idem turns RabbitMQ's at-least-once delivery into an exactly-once effect
//! in PostgreSQL: however often an event arrives, its effect happens once;
//! what cannot be processed is dead-lettered and can be replayed.
//!
//! The effect is yours: implement [`Handler`] and idem
//! runs it inside the transaction that records the event's consume record,
//! acks after commit, counts genuine failures, dead-letters what cannot be
//! applied, holds deliveries through an outage, batches, and replays. The
//! `idem` binary of idem's repository runs the reference handler, points
//! (the `idem-points` crate beside this one).
//!
//! # Your effect, idem's guarantees
//!
//! A handler that queues one welcome e-mail per sign-up, however often the
//! event arrives, and the few lines that run a worker with it:
//!
//! ```no_run
//! use idem::{
//!     AmqpConfig, DatabaseConfig, Handler, HandlerError, Invalid, Migration, Outbox, SecretUrl,
//!     Topology, Transaction, Worker, WorkerConfig, migrate,
//! };
//! use tokio_util::sync::CancellationToken;
//!
//! /// `{"eventId": "signup-42", "email": "ada@example.com"}`
//! #[derive(serde::Deserialize)]
//! #[serde(rename_all = "camelCase")]
//! struct SignedUp {
//!     event_id: String,
//!     email: String,
//! }
//!
//! struct Welcome;
//!
//! impl Handler for Welcome {
//!     type Event = SignedUp;
//!
//!     const NAME: &'static str = "welcome";
//!
//!     const MIGRATIONS: &'static [Migration] = &[Migration {
//!         version: 1,
//!         name: "0001_welcome_emails.sql",
//!         sql: "CREATE TABLE welcome_emails (email TEXT NOT NULL, \
//!               queued_at TIMESTAMPTZ NOT NULL DEFAULT now())",
//!     }];
//!
//!     /// An error makes the message invalid: dead-lettered at once.
//!     fn decode(&self, body: &[u8]) -> Result<SignedUp, Invalid> {
//!         Ok(serde_json::from_slice(body)?)
//!     }
//!
//!     /// The deduplication key.
//!     fn event_id<'e>(&self, event: &'e SignedUp) -> &'e str {
//!         &event.event_id
//!     }
//!
//!     /// Only events seen for the first time, in idem's transaction.
//!     async fn apply(
//!         &self,
//!         tx: &Transaction<'_>,
//!         events: &[&SignedUp],
//!         _: &mut Outbox<'_>,
//!     ) -> Result<(), HandlerError> {
//!         let emails: Vec<&str> = events.iter().map(|event| event.email.as_str()).collect();
//!         let queue = tx
//!             .prepare_cached("INSERT INTO welcome_emails (email) SELECT unnest($1::text[])")
//!             .await?;
//!         tx.execute(&queue, &[&emails]).await?;
//!         Ok(())
//!     }
//! }
//!
//! // Every idem command for this handler: migrate, worker, dlq, status, …
//! fn main() -> std::process::ExitCode {
//!     idem::cli::Service::new(Welcome)
//!         .topology(Topology::for_queue("welcome.signed-up").bound_to("accounts", "account.signed-up"))
//!         .consumer_group("welcome-emails")
//!         .run()
//! }
//!
//! // Or the worker alone, inside a service of your own.
//! # async fn run() -> anyhow::Result<()> {
//! let amqp = AmqpConfig::new(SecretUrl::new("amqp://guest:guest@127.0.0.1:5672/%2f"));
//! let database = DatabaseConfig::new(SecretUrl::new("postgres://postgres@127.0.0.1/postgres"));
//! // idem's tables and the handler's, each tracked apart; safe to run at every start.
//! migrate::run::<Welcome>(&database.pool()?, None).await?;
//! // The work queue names the rest: welcome.dlx, welcome.signed-up.dlq, …
//! let topology = Topology::for_queue("welcome.signed-up").bound_to("accounts", "account.signed-up");
//! let config = WorkerConfig::new(amqp, database, topology, "welcome-emails");
//! let shutdown = CancellationToken::new(); // cancel it on SIGTERM to drain and stop
//! Worker::new(config, Welcome).run(shutdown).await?;
//! # Ok(())
//! # }
//! ```
//!
//! `examples/stock` is a whole service built this way, with a constraint
//! that can fail.
//!
//! # Features
//!
//! - `cli` (default) — [`cli`], and with it clap, indicatif and csv.
//! - `otlp` (default) — idem's spans exported over OTLP (HTTP) when
//!   `OTEL_EXPORTER_OTLP_ENDPOINT` is set.
//!
//! A service that runs only [`Worker`] depends on idem with
//! `default-features = false` and gets neither.
//!
//! # What a service uses
//!
//! The crate root holds it: the [`Handler`] trait and its types
//! ([`Transaction`], [`Outbox`], [`OutboxMessage`], [`Tally`],
//! [`HandlerError`], [`Invalid`], [`Migration`], [`GivenUp`],
//! [`FailureKind`]); the [`Worker`] and its [`WorkerConfig`], [`Mode`],
//! [`Topology`], [`Exchange`], [`RetryPolicy`]; the connections ([`AmqpConfig`],
//! [`DatabaseConfig`], [`SecretUrl`]); [`migrate`]; the CLI [`Service`]; a
//! [`check`] of the handler ([`CheckConfig`]); the outbox [`relay`]
//! ([`RelayConfig`]). The modules below hold the rest: reports, errors, and
//! the operator commands as library calls.
//!
//! # Layout
//!
//! - [`handler`] — the extension point: the trait a team implements to put
//!   its own effect under idem's guarantees.
//! - [`store`] — PostgreSQL: pool, migrations, the claim-and-apply
//!   transaction, the failure ledger, the classification of failures.
//! - [`broker`] — RabbitMQ: connections, topology, confirmed publishing,
//!   dead-letter headers.
//! - [`worker`] — the consume loop: batches, processing, settling, shutdown.
//! - [`cli`] — every operator command for any handler's binary, in one call
//!   (feature `cli`).
//! - [`dlq`] — the dead letters: browse, summarize by reason and error,
//!   replay, discard (`dlq`, `requeue`, and what `status` and `prune` read).
//! - [`check`] — a handler proved under idem's faults against its events
//!   applied one at a time (`check`, and from a team's own tests).
//! - [`commands`] — what the other commands do: `status`, `prune`,
//!   `reconcile`; their error is an [`error::CommandError`].
//! - [`relay`] — the outbox relay, in the worker or on its own.
//! - [`companions`] — what runs beside a worker in its process: the
//!   console's pages and the pruner.
//! - [`retry`] — the retry policy: attempts, delays, and what each kind of
//!   failure does.
//! - [`secret`] — connection strings that never print their password.
//! - [`target`] — what an operator command works on: the servers, the
//!   consumer group and its queues.
//! - [`telemetry`] — logging, and the trace context across the broker.
//!
//! Hidden items of these modules, and the modules that the unstable
//! `internals` feature makes public (`vars`, `duration`, `progress`, `tls`,
//! `probe`, `trial`), serve idem's own binaries and tests: they are not part
//! of the API and change without notice.

// The crate docs link to the modules of the default features.
#![cfg_attr(not(feature = "cli"), allow(rustdoc::broken_intra_doc_links))]

mod backoff;
pub mod broker;
mod caught;
pub mod check;
#[cfg(feature = "cli")]
pub mod cli;
pub mod commands;
pub mod companions;
#[cfg(feature = "console")]
pub mod console;
pub mod dlq;
pub mod error;
mod files;
pub mod handler;
mod program;
pub mod relay;
pub mod retry;
pub mod secret;
pub mod store;
pub mod target;
pub mod telemetry;
pub mod worker;

/// Declares modules that idem's own tools (the points service's binary,
/// bench, lab and suite) reach into: public with the `internals` feature,
/// which is unstable and hidden from these pages, and the crate's own
/// otherwise.
macro_rules! internal_modules {
    ($($name:ident,)*) => {$(
        #[cfg(feature = "internals")]
        #[doc(hidden)]
        pub mod $name;
        #[cfg(not(feature = "internals"))]
        #[allow(dead_code, unreachable_pub, unused_imports)]
        pub(crate) mod $name;
    )*};
}

internal_modules! {
    duration,
    probe,
    progress,
    tls,
    trial,
    vars,
}

pub use broker::{AmqpConfig, Exchange, ExchangeKind, Topology};
pub use check::{CheckConfig, CheckReport};
#[cfg(feature = "cli")]
pub use cli::Service;
pub use companions::Companions;
pub use error::CommandError;
pub use handler::{
    FailureKind, GivenUp, Handler, HandlerError, Invalid, Migration, Outbox, OutboxMessage, Tally,
    Transaction,
};
pub use relay::RelayConfig;
pub use retry::RetryPolicy;
pub use secret::SecretUrl;
pub use store::{DatabaseConfig, migrate};
pub use target::Target;
pub use worker::{Mode, Worker, WorkerConfig};

/// The README's and the guide's Rust blocks, compiled by `cargo test` as
/// doctests (what the pages hide with `# ` is the context each needs).
#[cfg(doctest)]
mod pages {
    #[doc = include_str!("../README.md")]
    struct Readme;
    #[doc = include_str!("../docs/guide/handler.md")]
    struct Handler;
    #[doc = include_str!("../docs/guide/outbox.md")]
    struct Outbox;
    #[doc = include_str!("../docs/guide/prove.md")]
    struct Prove;
    #[doc = include_str!("../docs/guide/ordering.md")]
    struct Ordering;
}

/// The connection pool behind [`handler::Transaction`].
pub use deadpool_postgres;
/// The PostgreSQL client whose types idem's signatures name (a handler's
/// [`Transaction`], its errors): depend on this one
/// rather than pinning a second copy.
pub use tokio_postgres;
