//! A team's handler whose effect depends on order: an order's status moves
//! forward one step at a time (created, paid, shipped, …), and every step
//! applied is recorded in the order it applied. Its ordering key is the
//! order. An order listed in `blocked` fails (for good, or until the
//! handler's `heal` count of attempts has failed).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use idem::{
    GivenUp, Handler, HandlerError, Invalid, Migration, Outbox, OutboxMessage, RetryPolicy, Tally,
    Topology, Transaction,
};

/// `{"eventId": "o7-step-2", "order": "o7", "step": 2}`
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    pub event_id: String,
    pub order: String,
    pub step: i32,
}

/// The event id of an order's step: ids that sort against the steps'
/// order, so that a batch applied in id order would apply them backwards.
pub fn step_id(order: &str, step: i32) -> String {
    format!("{order}-{:03}", 999 - step)
}

/// The body of a step, and the ordering key its producer sets.
pub fn step(order: &str, step: i32) -> (Vec<u8>, Option<String>) {
    let event_id = step_id(order, step);
    let body = serde_json::json!({"eventId": event_id, "order": order, "step": step})
        .to_string()
        .into_bytes();
    (body, Some(order.to_owned()))
}

/// The steps 1 to `steps` of each of `orders` orders, published step by
/// step: every order's first step, then every order's second, …
pub fn interleaved(orders: usize, steps: i32) -> Vec<(Vec<u8>, Option<String>)> {
    (1..=steps)
        .flat_map(|n| (0..orders).map(move |order| step(&format!("o{order}"), n)))
        .collect()
}

/// An ordered queue of `slots` slots, retrying after `delays`.
pub fn topology(slots: u16, delays: &[std::time::Duration]) -> Topology {
    let mut topology = Topology::for_queue("steps.applied")
        .bound_to("orders", "order.step")
        .ordered(slots);
    topology.retry = RetryPolicy::default().with_delays(delays.to_vec());
    topology
}

/// The order's status only moves forward: a step applied out of order is
/// a permanent failure, which a test sees as a dead letter.
#[derive(Debug, Clone, Default)]
pub struct Steps {
    /// Orders that fail for good.
    pub blocked: Arc<Mutex<Vec<String>>>,
    /// Orders that fail this many more attempts, then apply.
    pub heal: Arc<Mutex<HashMap<String, u32>>>,
    /// Orders that fail every attempt, as a message failure (retried),
    /// until they are fixed.
    pub stalled: Arc<Mutex<Vec<String>>>,
}

impl Steps {
    /// `orders` fail for good from now on.
    pub fn block(&self, orders: &[&str]) {
        let mut blocked = self.blocked.lock().unwrap_or_else(PoisonError::into_inner);
        blocked.extend(orders.iter().map(|order| (*order).to_owned()));
    }

    /// `order` applies again.
    pub fn unblock(&self, order: &str) {
        let mut blocked = self.blocked.lock().unwrap_or_else(PoisonError::into_inner);
        blocked.retain(|blocked| blocked != order);
    }

    /// `order` fails every attempt from now on, as a message failure that
    /// is retried, until [`Steps::fix`].
    pub fn stall(&self, order: &str) {
        let mut stalled = self.stalled.lock().unwrap_or_else(PoisonError::into_inner);
        stalled.push(order.to_owned());
    }

    /// `order` applies again after [`Steps::stall`].
    pub fn fix(&self, order: &str) {
        let mut stalled = self.stalled.lock().unwrap_or_else(PoisonError::into_inner);
        stalled.retain(|stalled| stalled != order);
    }

    /// `order` fails its next `attempts` attempts, then applies.
    pub fn heal_after(&self, order: &str, attempts: u32) {
        let mut heal = self.heal.lock().unwrap_or_else(PoisonError::into_inner);
        heal.insert(order.to_owned(), attempts);
    }

    fn blocked(&self, order: &str) -> bool {
        let blocked = self.blocked.lock().unwrap_or_else(PoisonError::into_inner);
        blocked.iter().any(|blocked| blocked == order)
    }

    /// Whether `order` fails this attempt, counting it.
    fn not_ready(&self, order: &str) -> bool {
        let stalled = self.stalled.lock().unwrap_or_else(PoisonError::into_inner);
        if stalled.iter().any(|stalled| stalled == order) {
            return true;
        }
        drop(stalled);
        let mut heal = self.heal.lock().unwrap_or_else(PoisonError::into_inner);
        match heal.get_mut(order) {
            Some(left) if *left > 0 => {
                *left -= 1;
                true
            }
            _ => false,
        }
    }
}

impl Handler for Steps {
    type Event = Step;

    const NAME: &'static str = "steps";

    const MIGRATIONS: &'static [Migration] = &[Migration {
        version: 1,
        name: "0001_steps.sql",
        sql: "CREATE TABLE order_status (order_id TEXT PRIMARY KEY, step INT NOT NULL);
              CREATE TABLE order_steps (
                  applied BIGSERIAL PRIMARY KEY,
                  order_id TEXT NOT NULL,
                  step INT NOT NULL
              );",
    }];

    fn decode(&self, body: &[u8]) -> Result<Step, Invalid> {
        Ok(serde_json::from_slice(body)?)
    }

    fn event_id<'e>(&self, event: &'e Step) -> &'e str {
        &event.event_id
    }

    fn ordering_key<'e>(&self, event: &'e Step) -> Option<&'e str> {
        Some(&event.order)
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        events: &[&Step],
        _: &mut Outbox<'_>,
    ) -> Result<(), HandlerError> {
        for event in events {
            if self.blocked(&event.order) {
                return Err(HandlerError::permanent(format!(
                    "order {} is blocked",
                    event.order
                )));
            }
            if self.not_ready(&event.order) {
                return Err(HandlerError::message(format!(
                    "order {} is not ready yet",
                    event.order
                )));
            }
            let moved = tx
                .execute(
                    "INSERT INTO order_status VALUES ($1, $2) ON CONFLICT (order_id) DO UPDATE \
                     SET step = EXCLUDED.step WHERE order_status.step < EXCLUDED.step",
                    &[&event.order, &event.step],
                )
                .await?;
            if moved == 0 {
                return Err(HandlerError::permanent(format!(
                    "order {} cannot go back to step {}",
                    event.order, event.step
                )));
            }
            tx.execute(
                "INSERT INTO order_steps (order_id, step) VALUES ($1, $2)",
                &[&event.order, &event.step],
            )
            .await?;
        }
        Ok(())
    }
}

/// [`Steps`], announcing each step it applies to an exchange: a message
/// per step, `{"order": "o7", "step": 2}`, through the outbox.
#[derive(Debug, Clone)]
pub struct Announcing {
    pub steps: Steps,
    pub exchange: String,
}

impl Handler for Announcing {
    type Event = Step;

    const NAME: &'static str = Steps::NAME;

    const MIGRATIONS: &'static [Migration] = Steps::MIGRATIONS;

    const SENDS_MESSAGES: bool = true;

    fn decode(&self, body: &[u8]) -> Result<Step, Invalid> {
        self.steps.decode(body)
    }

    fn event_id<'e>(&self, event: &'e Step) -> &'e str {
        self.steps.event_id(event)
    }

    fn ordering_key<'e>(&self, event: &'e Step) -> Option<&'e str> {
        self.steps.ordering_key(event)
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        events: &[&Step],
        outbox: &mut Outbox<'_>,
    ) -> Result<(), HandlerError> {
        self.steps.apply(tx, events, outbox).await
    }

    fn outgoing(&self, event: &Step) -> Vec<OutboxMessage> {
        let body = serde_json::json!({"order": event.order, "step": event.step});
        vec![OutboxMessage::json(
            &self.exchange,
            "order.stepped",
            body.to_string().into_bytes(),
        )]
    }

    /// `{"order": "o7", "givenUp": 2}` for a step dead-lettered.
    fn given_up(&self, given_up: &GivenUp<'_, Step>) -> Vec<OutboxMessage> {
        let GivenUp::Event { event, .. } = given_up else {
            return Vec::new();
        };
        let body = serde_json::json!({"order": event.order, "givenUp": event.step});
        vec![OutboxMessage::json(
            &self.exchange,
            "order.given-up",
            body.to_string().into_bytes(),
        )]
    }
}

/// A tally of each order's steps (`order_total`: the sum of its steps),
/// a trigger failing every step of an order named `poisoned`: an effect
/// that is the same in any order, on an ordered queue all the same.
#[derive(Debug, Clone, Default)]
pub struct Totals;

fn total_entry(event: &Step) -> (&str, i64) {
    (&event.order, i64::from(event.step))
}

impl Handler for Totals {
    type Event = Step;

    const NAME: &'static str = "totals";

    const MIGRATIONS: &'static [Migration] = &[Migration {
        version: 1,
        name: "0001_totals.sql",
        sql: "CREATE TABLE order_total (order_id TEXT PRIMARY KEY, steps BIGINT NOT NULL);
              CREATE FUNCTION order_total_poisoned() RETURNS trigger LANGUAGE plpgsql AS $$
              BEGIN
                  IF NEW.order_id = 'poisoned' THEN
                      RAISE EXCEPTION 'order poisoned is poisoned';
                  END IF;
                  RETURN NEW;
              END $$;
              CREATE TRIGGER order_total_poisoned BEFORE INSERT OR UPDATE ON order_total
                  FOR EACH ROW EXECUTE FUNCTION order_total_poisoned();",
    }];

    fn decode(&self, body: &[u8]) -> Result<Step, Invalid> {
        Ok(serde_json::from_slice(body)?)
    }

    fn event_id<'e>(&self, event: &'e Step) -> &'e str {
        &event.event_id
    }

    fn ordering_key<'e>(&self, event: &'e Step) -> Option<&'e str> {
        Some(&event.order)
    }

    fn tally(&self) -> Option<Tally<Step>> {
        Some(Tally {
            table: "order_total",
            key: "order_id",
            amount: "steps",
            entry: total_entry,
        })
    }
}
