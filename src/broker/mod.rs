//! Everything RabbitMQ: connecting, the topology, and publishing with
//! confirms. The consume loop itself is [`crate::worker`].

mod connection;
pub mod death;
mod publisher;
mod topology;

pub use connection::{
    AmqpConfig, ConnectError, ConnectionWatch, Reconnects, SessionError, access_refused, close,
    close_channel, connect, connect_with_retry, first_refusal, refusal,
};
pub use publisher::{
    ConfirmChannel, Nacks, Outgoing, PublishOptions, PublishReport, Refusal, publish_all,
    publish_showing, settle,
};
pub use topology::{
    Exchange, ExchangeKind, Topology, TopologyError, declare_bound_queue, declare_exchanges,
    queue_counts, ready_messages,
};
