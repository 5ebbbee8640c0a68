//! Integration tests against the RabbitMQ and PostgreSQL running on this
//! machine. Each test has its own schema (or database) and its own exchanges
//! and queues (or vhost).

#![allow(unreachable_pub, missing_docs)]

/// Runs each scenario `async fn name(mode: Mode) -> anyhow::Result<()>` as
/// two tests, `name::batch` and `name::per_message`: every guarantee holds
/// in both modes.
macro_rules! in_both_modes {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn batch() -> anyhow::Result<()> {
                super::$scenario(idem::worker::Mode::Batch).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn per_message() -> anyhow::Result<()> {
                super::$scenario(idem::worker::Mode::PerMessage).await
            }
        }
    )*};
}

mod bench;
mod binary;
mod check;
mod cluster;
mod console;
mod dead_letters;
mod definitions;
mod docs;
mod failover;
mod faults;
mod handlers;
mod idempotency;
mod lab;
mod migrations;
mod observe;
mod orders;
mod outbox;
mod proxy;
mod publishing;
mod reconcile;
mod retention;
mod retries;
mod secrets;
mod stock;
mod support;
mod tls;
mod toolbox;
mod traces;
mod triage;
mod wallet;
