//! The exchanges, queues and bindings idem works with, declared the same way
//! by the worker and described by `rabbit-definitions.json`.
//!
//! Over 700 lines: one topology's names, its declaration and its checks
//! against what the broker holds (the refusal of a queue declared otherwise)
//! belong together, and its tests are a hundred of them.

use std::time::Duration;

use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ExchangeKind as AmqpKind};
use serde_json::{Value, json};
use tracing::{info, warn};

use super::publisher::Outgoing;
use crate::retry::RetryPolicy;

/// Names and limits of the objects one consumer group needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Topic exchange producers publish to.
    pub exchange: String,
    /// Routing key the work queue is bound with.
    pub routing_key: String,
    /// Quorum work queue of this consumer group.
    pub queue: String,
    /// Exchange the work queue dead-letters to.
    pub dead_letter_exchange: String,
    /// Quorum queue holding dead-lettered messages until they are replayed
    /// or discarded.
    pub dead_letter_queue: String,
    /// The work queue's `x-delivery-limit`: the broker dead-letters a message
    /// returned more often than this. A backstop above the failure ledger's
    /// budget, for a message that crashes the worker itself (every crash
    /// counts as a delivery on RabbitMQ 3.x).
    pub delivery_limit: u32,
    /// How a message whose transaction failed is tried again: each
    /// distinct delay of the policy above zero has a wait queue.
    pub retry: RetryPolicy,
    /// Replicas of each quorum queue when it is created
    /// (`x-quorum-initial-group-size`; a cluster of fewer nodes gives each
    /// node one). A queue that exists keeps the replicas it has.
    pub quorum_size: u32,
    /// The slot queues of an ordered queue ([`Topology::ordered`]); 0 for
    /// an unordered one, whose work queue is bound to the exchange.
    pub slots: u16,
}

/// An exchange a service publishes to (its outbox's messages): declared by
/// the worker and the relay before they publish, as the work queue is, so
/// that a relay's messages are not refused for want of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exchange {
    /// Its name.
    pub name: String,
    /// How it routes.
    pub kind: ExchangeKind,
    /// Whether it survives a broker restart.
    pub durable: bool,
}

/// How an [`Exchange`] routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExchangeKind {
    /// By routing-key pattern.
    Topic,
    /// By routing key.
    Direct,
    /// To every bound queue.
    Fanout,
    /// By headers.
    Headers,
}

impl Exchange {
    /// A durable topic exchange.
    pub fn topic(name: impl Into<String>) -> Self {
        Self::of(name, ExchangeKind::Topic)
    }

    /// A durable direct exchange.
    pub fn direct(name: impl Into<String>) -> Self {
        Self::of(name, ExchangeKind::Direct)
    }

    /// A durable fanout exchange.
    pub fn fanout(name: impl Into<String>) -> Self {
        Self::of(name, ExchangeKind::Fanout)
    }

    /// A durable exchange of `kind`.
    pub fn of(name: impl Into<String>, kind: ExchangeKind) -> Self {
        Self {
            name: name.into(),
            kind,
            durable: true,
        }
    }

    /// The same exchange, gone when the broker restarts.
    pub fn transient(self) -> Self {
        Self {
            durable: false,
            ..self
        }
    }

    /// Declares it on `channel`.
    async fn declare(&self, channel: &Channel) -> Result<(), TopologyError> {
        let options = ExchangeDeclareOptions {
            durable: self.durable,
            ..ExchangeDeclareOptions::default()
        };
        channel
            .exchange_declare(
                self.name.as_str().into(),
                self.lapin_kind(),
                options,
                FieldTable::default(),
            )
            .await
            .map_err(|source| {
                TopologyError::from_lapin(format!("exchange '{}'", self.name), source)
            })
    }

    fn lapin_kind(&self) -> AmqpKind {
        match self.kind {
            ExchangeKind::Topic => AmqpKind::Topic,
            ExchangeKind::Direct => AmqpKind::Direct,
            ExchangeKind::Fanout => AmqpKind::Fanout,
            ExchangeKind::Headers => AmqpKind::Headers,
        }
    }
}

/// Declares `exchanges` on a channel of their own; idempotent. One that
/// exists with another kind or durability is a [`TopologyError::Mismatch`].
pub async fn declare_exchanges(
    connection: &Connection,
    exchanges: &[Exchange],
) -> Result<(), TopologyError> {
    if exchanges.is_empty() {
        return Ok(());
    }
    let channel = open(connection, "the outgoing exchanges").await?;
    for exchange in exchanges {
        exchange.declare(&channel).await?;
    }
    super::close_channel(&channel).await;
    Ok(())
}

/// The broker refused a declaration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyError {
    /// An object exists with other properties or arguments than idem's.
    #[error(
        "{object} already exists with other settings than idem's ({broker}); \
         change idem's settings to match, or delete the {object} and let idem declare it"
    )]
    Mismatch {
        /// Which object, e.g. `queue 'points.payment-succeeded'`.
        object: String,
        /// What the broker said.
        broker: String,
    },
    /// The user has no permission to declare or bind it (403).
    #[error(
        "RabbitMQ refused to declare {object}: {broker}; grant the user configure, write and read permissions on it"
    )]
    Refused {
        /// Which object.
        object: String,
        /// What the broker said.
        broker: String,
    },
    /// The broker lacks the plugin an ordered queue's slots exchange needs.
    #[error(
        "RabbitMQ cannot declare {object} ({broker}): an ordered queue needs the consistent-hash exchange; \
         enable it on every node with `rabbitmq-plugins enable rabbitmq_consistent_hash_exchange`"
    )]
    PluginMissing {
        /// Which object.
        object: String,
        /// What the broker said.
        broker: String,
    },
    /// Any other failure (the connection dropped, say).
    #[error("declaring {object} failed: {source}")]
    Broker {
        /// Which object.
        object: String,
        /// The client's error.
        source: lapin::Error,
    },
}

impl TopologyError {
    /// Whether only an operator mends it (a mismatch, a permission, a
    /// plugin), so that trying again is no use; else the connection failed.
    pub fn needs_an_operator(&self) -> bool {
        !matches!(self, TopologyError::Broker { .. })
    }

    fn from_lapin(object: String, source: lapin::Error) -> Self {
        use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
        match source.kind() {
            lapin::ErrorKind::ProtocolError(amqp)
                if *amqp.kind() == AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) =>
            {
                TopologyError::Mismatch {
                    object,
                    broker: amqp.get_message().to_string(),
                }
            }
            _ => match super::connection::access_refused(&source) {
                Some(broker) => TopologyError::Refused { object, broker },
                None => TopologyError::Broker { object, source },
            },
        }
    }
}

impl Topology {
    /// The work queue's `x-delivery-limit` unless said otherwise.
    pub const DEFAULT_DELIVERY_LIMIT: u32 = 20;

    /// Replicas of a quorum queue unless said otherwise: a majority survives
    /// the loss of any one node.
    pub const DEFAULT_QUORUM_SIZE: u32 = 3;

    /// The dead-letter queue's `x-delivery-limit`: browsing it (a get, then
    /// a return) counts a delivery each time, and a quorum queue drops a
    /// message at its limit (RabbitMQ 4 sets 20 when none is given). At
    /// 2³¹ − 1 browses, a dead letter stays until it is replayed or
    /// discarded.
    pub const DEAD_LETTER_DELIVERY_LIMIT: i64 = i32::MAX as i64;

    /// How long a message stays in its wait queue past its delay before
    /// the broker sends it back to the work queue by itself. A worker takes
    /// it out when it is due; the TTL is for when none holds it (none runs,
    /// more wait than it takes). Without the grace, what a worker held when
    /// it lost its node would be given back already expired, and take the
    /// broker's hop, which a node's loss on RabbitMQ 3.10 can hold for
    /// 180 s, rather than be taken by another worker.
    pub const WAIT_GRACE: Duration = Duration::from_secs(60);

    /// The `x-message-ttl` of the wait queue of `delay`, in milliseconds.
    fn wait_ttl(delay: Duration) -> u64 {
        let ttl = delay
            .saturating_add(Self::WAIT_GRACE)
            .min(RetryPolicy::MAX_DELAY);
        ttl.as_millis() as u64
    }

    /// The objects of the consumer group whose work queue is `queue`,
    /// named by idem's convention: for `stock.reservations`, the
    /// dead-letter exchange `stock.dlx` (the queue's first dotted part, or
    /// the whole name if it has none, then `.dlx`), the dead-letter queue
    /// `stock.reservations.dlq`, the wait queues
    /// `stock.reservations.retry.10s`. The work queue is bound to nothing
    /// yet: [`bound_to`](Topology::bound_to) says where its events come
    /// from. Every name is a public field, to override after.
    pub fn for_queue(queue: &str) -> Self {
        let service = queue.split('.').next().unwrap_or(queue);
        Self {
            exchange: String::new(),
            routing_key: String::new(),
            queue: queue.into(),
            dead_letter_exchange: format!("{service}.dlx"),
            dead_letter_queue: format!("{queue}.dlq"),
            delivery_limit: Self::DEFAULT_DELIVERY_LIMIT,
            retry: RetryPolicy::default(),
            quorum_size: Self::DEFAULT_QUORUM_SIZE,
            slots: 0,
        }
    }

    /// The same objects, ordered per key over `slots` slot queues
    /// (`<work queue>.slot.0` …): the exchange routes the events to the
    /// consistent-hash exchange `<work queue>.slots` (RabbitMQ's
    /// `rabbitmq_consistent_hash_exchange` plugin), which hashes each
    /// message's [`ORDERING_KEY_HEADER`](crate::handler::ORDERING_KEY_HEADER)
    /// to choose its slot; each slot is a quorum queue with a single active
    /// consumer, so that a key's events come out of it in the order they
    /// went in. The work queue is then bound to nothing. A key's failed
    /// head is retried from PostgreSQL, not through the wait queues.
    pub fn ordered(self, slots: u16) -> Self {
        Self { slots, ..self }
    }

    /// Whether events are applied in order per key.
    pub fn is_ordered(&self) -> bool {
        self.slots > 0
    }

    /// The consistent-hash exchange of an ordered queue: `<work queue>.slots`.
    pub fn slots_exchange(&self) -> String {
        format!("{}.slots", self.queue)
    }

    /// The slot queues of an ordered queue, in order; none for an
    /// unordered one.
    pub fn slot_queues(&self) -> Vec<String> {
        (0..self.slots)
            .map(|slot| format!("{}.slot.{slot}", self.queue))
            .collect()
    }

    /// The queues a worker consumes: the slot queues of an ordered queue,
    /// else the work queue.
    pub fn consumed_queues(&self) -> Vec<String> {
        if self.is_ordered() {
            self.slot_queues()
        } else {
            vec![self.queue.clone()]
        }
    }

    /// The same objects, the work queue bound to the topic `exchange` that
    /// producers publish to, with `routing_key`.
    pub fn bound_to(self, exchange: &str, routing_key: &str) -> Self {
        Self {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            ..self
        }
    }

    /// The wait queue of `delay`: `<work queue>.retry.<delay>`, e.g.
    /// `points.payment-succeeded.retry.10s`.
    pub fn wait_queue(&self, delay: Duration) -> String {
        format!("{}.retry.{}", self.queue, crate::duration::format(delay))
    }

    /// Every queue of this topology: the work queue, the dead-letter queue,
    /// the wait queues.
    pub fn queues(&self) -> Vec<String> {
        let mut queues = vec![self.queue.clone(), self.dead_letter_queue.clone()];
        queues.extend(self.slot_queues());
        queues.extend(
            self.retry
                .waits()
                .into_iter()
                .map(|delay| self.wait_queue(delay)),
        );
        queues
    }

    /// Every exchange of this topology.
    pub fn exchanges(&self) -> [&str; 2] {
        [&self.exchange, &self.dead_letter_exchange]
    }

    /// A JSON event for this topology's exchange and routing key.
    pub fn event(&self, body: Vec<u8>) -> Outgoing {
        Outgoing::json(&self.exchange, &self.routing_key, body)
    }

    /// The same objects under names that start with `prefix` (tests, demo);
    /// the routing key stays.
    pub fn prefixed(&self, prefix: &str) -> Self {
        Self {
            exchange: format!("{prefix}{}", self.exchange),
            routing_key: self.routing_key.clone(),
            queue: format!("{prefix}{}", self.queue),
            dead_letter_exchange: format!("{prefix}{}", self.dead_letter_exchange),
            dead_letter_queue: format!("{prefix}{}", self.dead_letter_queue),
            ..self.clone()
        }
    }

    /// Arguments of the work queue.
    ///
    /// Dead-lettering is `at-least-once` (the quorum queue keeps a message
    /// until the dead-letter queue has it), which RabbitMQ allows only with
    /// `x-overflow: reject-publish`.
    fn work_queue_arguments(&self) -> Vec<(&'static str, Value)> {
        vec![
            ("x-queue-type", json!("quorum")),
            ("x-dead-letter-exchange", json!(self.dead_letter_exchange)),
            ("x-dead-letter-routing-key", json!(self.queue)),
            ("x-dead-letter-strategy", json!("at-least-once")),
            ("x-overflow", json!("reject-publish")),
            ("x-delivery-limit", json!(self.delivery_limit)),
            ("x-quorum-initial-group-size", json!(self.quorum_size)),
        ]
    }

    /// Arguments of the dead-letter queue: a quorum queue, so that dead
    /// letters survive the loss of a node, whose delivery limit browsing
    /// never reaches (see [`Topology::DEAD_LETTER_DELIVERY_LIMIT`]).
    fn dead_letter_queue_arguments(&self) -> Vec<(&'static str, Value)> {
        vec![
            ("x-queue-type", json!("quorum")),
            ("x-delivery-limit", json!(Self::DEAD_LETTER_DELIVERY_LIMIT)),
            ("x-quorum-initial-group-size", json!(self.quorum_size)),
        ]
    }

    /// Arguments of the wait queue of `delay`: the workers consume it and
    /// send each message back when it is due; what none holds expires
    /// [`Self::WAIT_GRACE`] after that (the same for all, so in the order
    /// they came) and is dead-lettered back to the work queue through the
    /// default exchange, at least once, as the work queue dead-letters.
    fn wait_queue_arguments(&self, delay: Duration) -> Vec<(&'static str, Value)> {
        vec![
            ("x-queue-type", json!("quorum")),
            ("x-message-ttl", json!(Self::wait_ttl(delay))),
            ("x-dead-letter-exchange", json!("")),
            ("x-dead-letter-routing-key", json!(self.queue)),
            ("x-dead-letter-strategy", json!("at-least-once")),
            ("x-overflow", json!("reject-publish")),
            ("x-quorum-initial-group-size", json!(self.quorum_size)),
        ]
    }

    /// Every queue with its arguments.
    fn queue_arguments(&self) -> Vec<(String, Vec<(&'static str, Value)>)> {
        let mut queues = vec![
            (self.queue.clone(), self.work_queue_arguments()),
            (
                self.dead_letter_queue.clone(),
                self.dead_letter_queue_arguments(),
            ),
        ];
        for delay in self.retry.waits() {
            queues.push((self.wait_queue(delay), self.wait_queue_arguments(delay)));
        }
        for slot in self.slot_queues() {
            let mut arguments = self.work_queue_arguments();
            arguments.push(("x-single-active-consumer", json!(true)));
            queues.push((slot, arguments));
        }
        queues
    }

    /// Declares everything, on channels of its own; idempotent. A queue
    /// that exists with other arguments is reported as
    /// [`TopologyError::Mismatch`], except for two differences that idem
    /// accepts, saying so: the replicas a quorum queue was created with
    /// (they only matter at creation), and a classic dead-letter queue, as
    /// idem declared it before (it keeps working, but does not survive the
    /// loss of its node).
    pub async fn declare(&self, connection: &Connection) -> Result<(), TopologyError> {
        let mut channel = open(connection, "the topology").await?;
        for exchange in [
            Exchange::topic(&self.exchange),
            Exchange::direct(&self.dead_letter_exchange),
        ] {
            exchange.declare(&channel).await?;
        }
        if self.is_ordered() {
            self.declare_slots_exchange(&channel).await?;
        }
        for (name, arguments) in self.queue_arguments() {
            channel = self
                .declare_queue(connection, channel, &name, arguments)
                .await?;
        }
        for binding in self.bindings() {
            let bound = if binding.to_exchange {
                channel
                    .exchange_bind(
                        binding.destination.as_str().into(),
                        binding.source.as_str().into(),
                        binding.key.as_str().into(),
                        ExchangeBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
            } else {
                channel
                    .queue_bind(
                        binding.destination.as_str().into(),
                        binding.source.as_str().into(),
                        binding.key.as_str().into(),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
            };
            bound.map_err(|e| {
                TopologyError::from_lapin(format!("binding of '{}'", binding.destination), e)
            })?;
        }
        super::connection::close_channel(&channel).await;
        Ok(())
    }

    /// Declares queue `name` with `arguments`; after a difference idem
    /// accepts (which closes the channel), declares it again as it is, on a
    /// new channel, so that every other argument is still compared.
    /// Returns the channel to go on with.
    async fn declare_queue(
        &self,
        connection: &Connection,
        mut channel: Channel,
        name: &str,
        mut arguments: Vec<(&'static str, Value)>,
    ) -> Result<Channel, TopologyError> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let object = format!("queue '{name}'");
        // Each accepted difference is taken once: at most one per argument.
        for _ in 0..=arguments.len() {
            let error = match channel
                .queue_declare(name.into(), durable, field_table(&arguments))
                .await
            {
                Ok(_) => return Ok(channel),
                Err(error) => TopologyError::from_lapin(object.clone(), error),
            };
            let TopologyError::Mismatch { broker, .. } = &error else {
                return Err(error);
            };
            let Some(difference) = Difference::parse(broker) else {
                return Err(error);
            };
            match difference.argument.as_str() {
                "x-quorum-initial-group-size" => {
                    info!(
                        queue = name,
                        "queue '{name}' was created with another number of replicas \
                         ({}); it keeps them (x-quorum-initial-group-size only applies \
                         to a new queue)",
                        difference
                            .current
                            .as_deref()
                            .unwrap_or("the broker's default")
                    );
                    arguments.retain(|(key, _)| *key != difference.argument);
                    if let Some(current) = &difference.current {
                        let Ok(size) = current.parse::<u32>() else {
                            return Err(error);
                        };
                        arguments.push(("x-quorum-initial-group-size", json!(size)));
                    }
                }
                "x-queue-type"
                    if name == self.dead_letter_queue
                        && difference.current.as_deref().is_none_or(|t| t == "classic") =>
                {
                    warn!(
                        queue = name,
                        "the dead-letter queue '{name}' is a classic queue, as idem declared \
                         it before: it works, but its messages are unreachable while its node \
                         is down, and lost with it; to make it a quorum queue, empty it (idem \
                         dlq replay, or dlq discard --to FILE), delete it, and start the worker \
                         again"
                    );
                    arguments = vec![("x-queue-type", json!("classic"))];
                }
                "x-message-ttl"
                    if self.retry.waits().iter().any(|delay| {
                        self.wait_queue(*delay) == name
                            && difference.current.as_deref()
                                == Some(delay.as_millis().to_string().as_str())
                    }) =>
                {
                    warn!(
                        queue = name,
                        "the wait queue '{name}' expires its messages after their delay, as \
                         idem declared it before: it works, but a message a worker held when \
                         it lost its node may take the broker's own hop back, which a node's \
                         loss can hold for minutes; to give it a grace of {}s, delete it when \
                         it is empty and start the worker again",
                        Self::WAIT_GRACE.as_secs()
                    );
                    arguments.retain(|(key, _)| *key != difference.argument);
                    if let Some(current) = &difference.current {
                        let Ok(ttl) = current.parse::<u64>() else {
                            return Err(error);
                        };
                        arguments.push(("x-message-ttl", json!(ttl)));
                    }
                }
                _ => return Err(error),
            }
            channel = open(connection, &object).await?;
        }
        Err(TopologyError::Mismatch {
            object,
            broker: "the broker kept finding other differences".into(),
        })
    }

    /// Deletes every queue of this topology, whatever it holds, then its
    /// exchanges: for the objects a demo, a benchmark or a check made for
    /// itself. What does not exist is no error.
    pub async fn delete(&self, channel: &Channel) -> lapin::Result<()> {
        for queue in self.queues() {
            channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await?;
        }
        let slots = self.is_ordered().then(|| self.slots_exchange());
        for exchange in self.exchanges().into_iter().chain(slots.as_deref()) {
            channel
                .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
                .await?;
        }
        Ok(())
    }

    /// Each binding: the work queue's (or the slots'), the dead letters'.
    fn bindings(&self) -> Vec<Binding> {
        let binding = |destination: &str, source: &str, key: &str, to_exchange| Binding {
            destination: destination.to_owned(),
            source: source.to_owned(),
            key: key.to_owned(),
            to_exchange,
        };
        let mut bindings = vec![binding(
            &self.dead_letter_queue,
            &self.dead_letter_exchange,
            &self.queue,
            false,
        )];
        if self.is_ordered() {
            let slots = self.slots_exchange();
            bindings.push(binding(&slots, &self.exchange, &self.routing_key, true));
            // Each slot takes an equal share of the hash space.
            for slot in self.slot_queues() {
                bindings.push(binding(&slot, &slots, "1", false));
            }
        } else {
            bindings.push(binding(
                &self.queue,
                &self.exchange,
                &self.routing_key,
                false,
            ));
        }
        bindings
    }

    /// The consistent-hash exchange of an ordered queue, hashing the
    /// ordering key's header.
    async fn declare_slots_exchange(&self, channel: &Channel) -> Result<(), TopologyError> {
        let name = self.slots_exchange();
        channel
            .exchange_declare(
                name.as_str().into(),
                AmqpKind::Custom(CONSISTENT_HASH.into()),
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                field_table(&self.slots_exchange_arguments()),
            )
            .await
            .map_err(|source| match source.kind() {
                lapin::ErrorKind::ProtocolError(amqp)
                    if is_unknown_exchange_type(amqp.get_message().as_str()) =>
                {
                    TopologyError::PluginMissing {
                        object: format!("exchange '{name}'"),
                        broker: amqp.get_message().to_string(),
                    }
                }
                _ => TopologyError::from_lapin(format!("exchange '{name}'"), source),
            })
    }

    fn slots_exchange_arguments(&self) -> Vec<(&'static str, Value)> {
        vec![("hash-header", json!(crate::handler::ORDERING_KEY_HEADER))]
    }

    /// The exchanges, queues and bindings of this topology in RabbitMQ's
    /// definitions format, in `vhost`: what `rabbit-definitions.json` holds.
    pub fn definitions(&self, vhost: &str) -> Value {
        let exchange = |name: &str, kind: &str| {
            json!({"name": name, "vhost": vhost, "type": kind, "durable": true,
                   "auto_delete": false, "internal": false, "arguments": {}})
        };
        let queue = |name: &str, arguments: Vec<(&str, Value)>| {
            json!({"name": name, "vhost": vhost, "durable": true, "auto_delete": false,
                   "arguments": arguments.into_iter().map(|(k, v)| (k.to_owned(), v))
                        .collect::<serde_json::Map<_, _>>()})
        };
        let bindings: Vec<Value> = self
            .bindings()
            .iter()
            .map(|binding| {
                let kind = if binding.to_exchange {
                    "exchange"
                } else {
                    "queue"
                };
                json!({"source": binding.source, "vhost": vhost,
                       "destination": binding.destination, "destination_type": kind,
                       "routing_key": binding.key, "arguments": {}})
            })
            .collect();
        let mut exchanges = vec![
            exchange(&self.exchange, "topic"),
            exchange(&self.dead_letter_exchange, "direct"),
        ];
        if self.is_ordered() {
            let mut slots = exchange(&self.slots_exchange(), CONSISTENT_HASH);
            slots["arguments"] = Value::Object(
                self.slots_exchange_arguments()
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), v))
                    .collect(),
            );
            exchanges.push(slots);
        }
        json!({
            "exchanges": exchanges,
            "queues": self
                .queue_arguments()
                .into_iter()
                .map(|(name, arguments)| queue(&name, arguments))
                .collect::<Vec<_>>(),
            "bindings": bindings,
        })
    }
}

/// Whether the broker refused an exchange for its type, which a plugin
/// not enabled brings: RabbitMQ 3.x says "unknown exchange type", some
/// versions "invalid exchange type".
fn is_unknown_exchange_type(message: &str) -> bool {
    ["unknown exchange type", "invalid exchange type"]
        .iter()
        .any(|refusal| message.contains(refusal))
}

/// The type of RabbitMQ's consistent-hash exchange (a plugin).
const CONSISTENT_HASH: &str = "x-consistent-hash";

/// A binding of a queue, or of an exchange, to an exchange.
struct Binding {
    destination: String,
    source: String,
    key: String,
    /// Whether the destination is an exchange.
    to_exchange: bool,
}

/// A new channel on `connection`, for declaring `object`.
async fn open(connection: &Connection, object: &str) -> Result<Channel, TopologyError> {
    connection
        .create_channel()
        .await
        .map_err(|source| TopologyError::Broker {
            object: object.to_owned(),
            source,
        })
}

/// What a broker's `PRECONDITION_FAILED - inequivalent arg 'x-…' for queue
/// '…' in vhost '…': received … but current is …` says: which argument,
/// and the value the queue has (`None`: it has none).
#[derive(Debug, PartialEq, Eq)]
struct Difference {
    argument: String,
    current: Option<String>,
}

impl Difference {
    fn parse(broker: &str) -> Option<Self> {
        let after = broker.split_once("inequivalent arg '")?.1;
        let argument = after.split_once('\'')?.0.to_owned();
        let current = after.rsplit_once("but current is ")?.1;
        let current = match current.strip_prefix("the value ") {
            Some(typed) => Some(typed),
            None if current.starts_with("none") => None,
            None => Some(current),
        };
        let current = match current {
            Some(quoted) => Some(quoted.strip_prefix('\'')?.split_once('\'')?.0.to_owned()),
            None => None,
        };
        Some(Self { argument, current })
    }
}

/// Declares `queue`, durable and classic, bound to `exchange` with
/// `routing_key`: a queue that takes what a topology's messages go on to,
/// as a downstream consumer's would.
pub async fn declare_bound_queue(
    channel: &Channel,
    queue: &str,
    exchange: &str,
    routing_key: &str,
) -> lapin::Result<()> {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), durable, FieldTable::default())
        .await?;
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            routing_key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok(())
}

/// Messages ready in `queue` (delivered but unacked ones not counted),
/// without changing it: a passive declare.
pub async fn ready_messages(channel: &Channel, queue: &str) -> lapin::Result<u32> {
    Ok(queue_counts(channel, queue).await?.0)
}

/// Messages ready in `queue` and its consumers, by a passive declare,
/// which closes `channel` when the queue does not exist.
pub async fn queue_counts(channel: &Channel, queue: &str) -> lapin::Result<(u32, u32)> {
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok((declared.message_count(), declared.consumer_count()))
}

fn field_table(arguments: &[(&str, Value)]) -> FieldTable {
    let mut table = FieldTable::default();
    for (key, value) in arguments {
        let value = match value {
            Value::String(text) => AMQPValue::LongString(text.as_str().into()),
            Value::Number(n) => AMQPValue::LongLongInt(n.as_i64().unwrap_or_default()),
            Value::Bool(b) => AMQPValue::Boolean(*b),
            other => AMQPValue::LongString(other.to_string().into()),
        };
        table.insert((*key).into(), value);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topology(delays: &[u64]) -> Topology {
        let delays: Vec<Duration> = delays.iter().map(|ms| Duration::from_millis(*ms)).collect();
        Topology {
            retry: RetryPolicy::default().with_delays(delays),
            ..Topology {
                dead_letter_exchange: "dlx".into(),
                dead_letter_queue: "dlq".into(),
                ..Topology::for_queue("work").bound_to("x", "k")
            }
        }
    }

    #[test]
    fn a_broker_without_the_hash_exchange_plugin_is_recognised() {
        // As RabbitMQ 3.10 refuses the slots exchange without the plugin.
        assert!(is_unknown_exchange_type(
            "COMMAND_INVALID - unknown exchange type 'x-consistent-hash'"
        ));
        assert!(!is_unknown_exchange_type(
            "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'x'"
        ));
    }

    #[test]
    fn every_name_follows_from_the_work_queue() {
        let topology =
            Topology::for_queue("stock.reservations").bound_to("inventory", "stock.reserve");
        assert_eq!(
            (
                topology.exchange.as_str(),
                topology.routing_key.as_str(),
                topology.dead_letter_exchange.as_str(),
                topology.dead_letter_queue.as_str(),
                topology.wait_queue(Duration::from_secs(10)).as_str()
            ),
            (
                "inventory",
                "stock.reserve",
                "stock.dlx",
                "stock.reservations.dlq",
                "stock.reservations.retry.10s"
            )
        );
        assert_eq!(
            Topology::for_queue("welcome").dead_letter_exchange,
            "welcome.dlx"
        );
    }

    #[test]
    fn the_brokers_differences_are_read_in_the_forms_of_3_10_and_4_0() {
        let parsed = |text: &str| Difference::parse(text).map(|d| (d.argument, d.current));
        let arg = |a: &str, c: Option<&str>| Some((a.to_owned(), c.map(str::to_owned)));
        let prefix = "PRECONDITION_FAILED - inequivalent arg";
        assert_eq!(
            parsed(&format!(
                "{prefix} 'x-quorum-initial-group-size' for queue 'q' in vhost '/': \
                 received none but current is the value '3' of type 'signedint'"
            )),
            arg("x-quorum-initial-group-size", Some("3"))
        );
        assert_eq!(
            parsed(&format!(
                "{prefix} 'x-quorum-initial-group-size' for queue 'q' in vhost '/': \
                 received '1' but current is '3'"
            )),
            arg("x-quorum-initial-group-size", Some("3"))
        );
        assert_eq!(
            parsed(&format!(
                "{prefix} 'x-queue-type' for queue 'q' in vhost '/': received the value \
                 'quorum' of type 'longstr' but current is none"
            )),
            arg("x-queue-type", None)
        );
        assert_eq!(
            parsed(&format!(
                "{prefix} 'x-queue-type' for queue 'q' in vhost '/': received 'quorum' \
                 but current is 'classic'"
            )),
            arg("x-queue-type", Some("classic"))
        );
        assert_eq!(parsed("NOT_FOUND - no queue 'q'"), None);
    }

    #[test]
    fn each_distinct_delay_above_zero_has_one_wait_queue_named_after_it() {
        let schedule = topology(&[0, 1000, 60_000, 1000, 250]);
        assert_eq!(
            schedule.queues(),
            vec![
                "work",
                "dlq",
                "work.retry.250ms",
                "work.retry.1s",
                "work.retry.1m"
            ]
        );
    }
}
