//! Integration tests against the RabbitMQ and PostgreSQL running on this
//! machine. Each test has its own schema and its own exchanges and queues.

#![allow(unreachable_pub, missing_docs)]

mod binary;
mod dead_letters;
mod definitions;
mod faults;
mod helpers;
mod idempotency;
mod proxy;
mod publishing;
