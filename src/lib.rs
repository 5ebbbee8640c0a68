//! idem turns RabbitMQ's at-least-once delivery into an exactly-once effect
//! in PostgreSQL: however often an event arrives, its effect happens once;
//! what cannot be processed is dead-lettered and can be replayed.
//!
//! The effect is yours: implement [`Handler`](handler::Handler) and idem
//! runs it inside the transaction that records the event's consume record,
//! acks after commit, counts genuine failures, dead-letters what cannot be
//! applied, holds deliveries through an outage, batches, and replays. The
//! `idem` binary runs the reference handler, [`points`].
//!
//! # Your effect, idem's guarantees
//!
//! A handler that queues one welcome e-mail per sign-up, however often the
//! event arrives, and the few lines that run a worker with it:
//!
//! ```no_run
//! use idem::broker::{AmqpConfig, Topology};
//! use idem::handler::{Handler, HandlerError, Invalid, Migration, Transaction};
//! use idem::secret::SecretUrl;
//! use idem::store::{DatabaseConfig, migrate};
//! use idem::worker::{Worker, WorkerConfig};
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
//! # async fn run() -> anyhow::Result<()> {
//! let amqp = AmqpConfig::new(SecretUrl::new("amqp://guest:guest@127.0.0.1:5672/%2f"));
//! let database = DatabaseConfig::new(SecretUrl::new("postgres://postgres@127.0.0.1/postgres"));
//! // idem's tables and the handler's, each tracked apart; safe to run at every start.
//! migrate::run::<Welcome>(&database.pool()?, None).await?;
//! let topology = Topology::new(
//!     "accounts",                  // the exchange producers publish to
//!     "account.signed-up",         // the routing key the work queue is bound with
//!     "welcome.signed-up",         // this consumer group's work queue
//!     "welcome.dlx",
//!     "welcome.signed-up.dlq",
//! );
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
//! # Layout
//!
//! - [`handler`] — the extension point: the trait a team implements to put
//!   its own effect under idem's guarantees.
//! - [`points`] — the reference handler: a payment credits an order's points.
//! - [`store`] — PostgreSQL: pool, migrations, the claim-and-apply
//!   transaction, the failure ledger, the classification of failures.
//! - [`broker`] — RabbitMQ: connections, topology, confirmed publishing,
//!   dead-letter headers.
//! - [`worker`] — the consume loop: batches, processing, settling, shutdown.
//! - [`commands`] — `publish`, `dlq` (and `requeue`), `status`, `demo`, `bench` and `lab`.
//! - [`generate`] — reproducible loads of payment events with duplicates.
//! - [`vars`] — the environment variables the `idem` binary reads.
//! - [`duration`] — durations as flags and queue names write them.
//! - [`progress`] — how far long work got: a bar, or lines.
//! - [`backoff`] — the retry schedules.
//! - [`secret`] — connection strings that never print their password.
//! - [`tls`] — CA files and TLS handshake failures, for both connections.
//! - [`telemetry`] — logging.

pub mod backoff;
pub mod broker;
mod caught;
pub mod commands;
pub mod duration;
pub mod generate;
pub mod handler;
pub mod points;
pub mod progress;
pub mod relay;
pub mod secret;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod vars;
pub mod worker;
