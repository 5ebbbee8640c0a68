//! What every test needs: its own schema and its own exchanges and queues
//! (named after the test process, so a crashed run's leftovers can be swept),
//! a worker to run, and waiting on conditions instead of sleeping.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Once, OnceLock};
use std::time::Duration;

use anyhow::{Context, bail};
use deadpool_postgres::Pool;
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicQosOptions,
    ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str, utf8_percent_encode};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use url::Url;

use idem::broker::{
    AmqpConfig, Outgoing, PublishOptions, PublishReport, Topology, connect, publish_all,
};
use idem::secret::SecretUrl;
use idem::store::{DatabaseConfig, migrate};
use idem::vars;
use idem::worker::{Mode, Snapshot, Stats, Worker, WorkerConfig, WorkerError};
use idem_points::points::PaymentSucceeded;

mod broker;
mod cleanup;
mod env;
mod processes;
mod servers;
mod waiting;
mod workers;

pub use broker::*;
pub use cleanup::*;
pub use env::*;
pub use processes::*;
pub use servers::*;
pub use waiting::*;
pub use workers::*;
