//! idem turns RabbitMQ's at-least-once delivery into an exactly-once effect
//! in PostgreSQL: however often an event arrives, its effect happens once;
//! what cannot be processed is dead-lettered and can be replayed.
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
//! - [`commands`] — `publish`, `requeue`, `demo` and `bench`.
//! - [`generate`] — reproducible loads of payment events with duplicates.
//! - [`vars`] — the environment variables the `idem` binary reads.
//! - [`backoff`] — the retry schedules.
//! - [`secret`] — connection strings that never print their password.
//! - [`tls`] — CA files and TLS handshake failures, for both connections.
//! - [`telemetry`] — logging.

pub mod backoff;
pub mod broker;
mod caught;
pub mod commands;
pub mod generate;
pub mod handler;
pub mod points;
pub mod secret;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod vars;
pub mod worker;
