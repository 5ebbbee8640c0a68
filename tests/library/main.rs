//! The library's promises to a team, driven through its public API with a
//! handler defined here (`deposits`), against the real RabbitMQ and
//! PostgreSQL: each event's effect once in batch and per-message modes,
//! retries as the policy says and dead letters, the outbox, `check`, the
//! console and the pruner beside a worker (`Companions`). What
//! tests the points service and its binary is in `points/tests`.

// Test helpers are `pub` for the modules beside them, not for a user.
#![allow(unreachable_pub, missing_docs)]

mod companions;
mod contract;
mod deposits;
mod layout;
mod order;
mod steps;
mod support;
