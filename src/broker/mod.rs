//! Everything RabbitMQ: connecting, the topology, and publishing with
//! confirms. The consume loop itself is [`crate::worker`].

mod connection;
#[doc(hidden)]
pub mod death;
pub(crate) mod json;
mod publisher;
mod topology;

pub use connection::{AmqpConfig, ConnectError, SessionError};
#[doc(hidden)]
pub use connection::{
    ConnectionWatch, Reconnects, access_refused, close, close_channel, connect, connect_with_retry,
    first_refusal, not_found, refusal,
};
#[doc(hidden)]
pub use publisher::{ConfirmChannel, Nacks, Outgoing, publish_all, publish_showing, settle};
pub use publisher::{PublishOptions, PublishReport, Refusal};
pub use topology::{Exchange, ExchangeKind, Topology, TopologyError};
#[doc(hidden)]
pub use topology::{declare_bound_queue, declare_exchanges, queue_counts, ready_messages};
