//! idem turns RabbitMQ's at-least-once delivery into an exactly-once effect
//! in PostgreSQL: however often a "payment succeeded" event arrives, the
//! order's points go up once; what cannot be processed is dead-lettered and
//! can be replayed.
//!
//! # Layout
//!
//! - [`event`] — the message contract and its validation.
//! - [`store`] — PostgreSQL: pool, migrations, the claim-and-apply transaction,
//!   the classification of failures.
//! - [`broker`] — RabbitMQ: connections, topology, confirmed publishing,
//!   dead-letter headers.
//! - [`worker`] — the consume loop: batches, processing, settling, shutdown.
//! - [`commands`] — `publish`, `requeue`, `demo` and `bench`.
//! - [`generate`] — reproducible loads with duplicates.
//! - [`backoff`] — the retry schedules.
//! - [`cli`] — flags and environment variables, turned into typed settings.
//! - [`secret`] — connection strings that never print their password.
//! - [`tls`] — CA files and TLS handshake failures, for both connections.
//! - [`telemetry`] — logging.

pub mod backoff;
pub mod broker;
pub mod cli;
pub mod commands;
pub mod event;
pub mod generate;
pub mod secret;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod worker;
