//! What reaches the service's outgoing exchanges while a check runs. A
//! check's workers relay nothing, and its references write the outbox
//! without sending it: whatever arrives there was sent by the handler
//! itself, outside idem's outbox, where a transaction that rolls back or
//! runs again sends again.

use std::collections::{BTreeMap, BTreeSet};

use lapin::options::{BasicGetOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};

use super::CheckError;
use crate::broker::{Exchange, ExchangeKind};

/// A queue of the check's own, bound to every outgoing exchange.
pub(super) struct Capture {
    channel: Channel,
    queue: String,
}

/// What a capture took since the last time: how many messages, and where
/// the first went (exchange, routing key).
#[derive(Debug, Default)]
pub(super) struct Captured {
    pub(super) messages: usize,
    pub(super) first: Option<(String, String)>,
}

impl Capture {
    /// Binds `queue` (the check's, removed with its other queues) to each of
    /// `outgoing`, declared as the worker declares them: every message of
    /// a topic, fanout or headers exchange; of a direct exchange, those of
    /// the routing keys in `direct_keys` (what the outbox's messages use:
    /// a direct exchange has no binding for every key). `None` without an
    /// outgoing exchange.
    pub(super) async fn start(
        connection: &Connection,
        queue: String,
        outgoing: &[Exchange],
        direct_keys: &BTreeMap<String, BTreeSet<String>>,
    ) -> Result<Option<Self>, CheckError> {
        if outgoing.is_empty() {
            return Ok(None);
        }
        let failed = |doing: &str, error: &dyn std::fmt::Display| {
            CheckError::Failed(format!("watching the outgoing exchanges: {doing}: {error}").into())
        };
        crate::broker::declare_exchanges(connection, outgoing)
            .await
            .map_err(|error| failed("declaring them", &error))?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|error| failed("opening a channel", &error))?;
        channel
            .queue_declare(
                queue.as_str().into(),
                // Gone with the check's connection, however the check ends.
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|error| failed("declaring its queue", &error))?;
        let no_keys = BTreeSet::new();
        for exchange in outgoing {
            let (keys, arguments) = match exchange.kind {
                ExchangeKind::Topic => (vec!["#".to_owned()], FieldTable::default()),
                ExchangeKind::Fanout => (vec![String::new()], FieldTable::default()),
                // `all` of no header: every message.
                ExchangeKind::Headers => {
                    let mut arguments = FieldTable::default();
                    arguments.insert("x-match".into(), AMQPValue::LongString("all".into()));
                    (vec![String::new()], arguments)
                }
                ExchangeKind::Direct => (
                    direct_keys
                        .get(&exchange.name)
                        .unwrap_or(&no_keys)
                        .iter()
                        .cloned()
                        .collect(),
                    FieldTable::default(),
                ),
            };
            for key in keys {
                channel
                    .queue_bind(
                        queue.as_str().into(),
                        exchange.name.as_str().into(),
                        key.as_str().into(),
                        QueueBindOptions::default(),
                        arguments.clone(),
                    )
                    .await
                    .map_err(|error| failed(&format!("binding to {}", exchange.name), &error))?;
            }
        }
        Ok(Some(Self { channel, queue }))
    }

    /// The messages captured since the last call, taken off the queue.
    pub(super) async fn taken(&self) -> Result<Captured, CheckError> {
        let mut captured = Captured::default();
        loop {
            let got = self
                .channel
                .basic_get(self.queue.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .map_err(|error| {
                    CheckError::Failed(
                        format!("reading what reached the outgoing exchanges: {error}").into(),
                    )
                })?;
            let Some(message) = got else {
                return Ok(captured);
            };
            captured.messages += 1;
            captured.first.get_or_insert_with(|| {
                (
                    message.delivery.exchange.to_string(),
                    message.delivery.routing_key.to_string(),
                )
            });
        }
    }
}
