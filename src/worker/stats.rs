//! What the worker did and is doing, as Prometheus metrics: counters cheap
//! to bump from any task (each outcome's counter is made once, so counting
//! takes no lock), histograms of transactions and latencies, gauges of what
//! is in flight. The same numbers serve `/metrics`, the summary log lines
//! and [`Snapshot`].
//!
//! Names are in base units with `_total` on counters; labels are bounded:
//! the queue and consumer group on everything, an outcome or a retry delay
//! where it applies, never an event id.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

/// What became of a delivery.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    outcome: &'static str,
}

/// A retry delay, as the wait queue names it (`10s`): as many as the
/// schedule has.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Delay {
    delay: String,
}

/// A bound of an ordered queue's parked keys, reached.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub(crate) enum ParkedBound {
    /// `--max-parked-per-key`.
    EventsPerKey,
    /// `--max-parked-keys`.
    Keys,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BoundLabel {
    bound: &'static str,
}

/// A state of the pool's connections.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolState {
    state: &'static str,
}

/// Running totals and live gauges of one worker.
#[derive(Debug)]
pub struct Stats {
    registry: Registry,
    received: Counter,
    applied: Counter,
    duplicates: Counter,
    invalid: Counter,
    failed: Counter,
    retried: Counter,
    dead_lettered: Counter,
    parked: Counter,
    parked_bound_waits: Family<BoundLabel, Counter>,
    parked_keys: Gauge,
    parked_events: Gauge,
    retries: Family<Delay, Counter>,
    infrastructure_retries: Counter,
    sessions: Counter,
    reconnects: Counter,
    transaction_seconds: Histogram,
    batch_size: Histogram,
    latency_seconds: Histogram,
    in_flight: Gauge,
    unacked: Gauge,
    consuming: Gauge,
    slots: Gauge,
    database_up: Gauge,
    pool: Family<PoolState, Gauge>,
    pool_max: Gauge,
    relay: crate::relay::RelayCounters,
    epochs: crate::store::filter::EpochCounters,
    copies_nacked: Counter,
    unconfirmed: Counter,
}

/// A copy of the counters at one moment.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    /// Deliveries taken from the broker.
    pub received: u64,
    /// Events whose effect this worker applied.
    pub applied: u64,
    /// Deliveries of events applied before: acked without effect.
    pub duplicates: u64,
    /// Deliveries that broke the message contract: dead-lettered at once.
    pub invalid: u64,
    /// Failed deliveries sent for another attempt (at once or after a wait).
    pub retried: u64,
    /// Failed deliveries that used up their attempts: dead-lettered.
    pub dead_lettered: u64,
    /// Deliveries of an ordered queue kept behind their key's failed head,
    /// and acked: each applies later, once the head has (and counts then).
    pub parked: u64,
    /// Transactions retried because the database was unavailable.
    pub infrastructure_retries: u64,
    /// Consuming sessions started (one per broker connection).
    pub sessions: u64,
    /// Broker connections reopened after a loss.
    pub reconnects: u64,
    /// Outbox messages this worker's relay sent (confirmed).
    pub outbox_sent: u64,
    /// Outbox publishes the broker refused.
    pub outbox_refused: u64,
    /// Copies (to wait, to the dead-letter exchange, due back to work) the
    /// broker nacked, each sent again on a fresh channel.
    pub copies_nacked: u64,
    /// Transactions run again because a flush did not find what they put
    /// in (the server lost it, or the flush failed).
    pub unconfirmed: u64,
    /// Slots of an ordered queue this worker consumes now.
    pub slots: i64,
    /// Waits of events past a bound of the parked keys (a second each).
    pub parked_bound_waits: u64,
}

impl Snapshot {
    /// Deliveries settled for good: acked or dead-lettered.
    pub fn finished(&self) -> u64 {
        self.applied + self.duplicates + self.invalid + self.dead_lettered
    }
}

impl Default for Stats {
    fn default() -> Self {
        Self::new("", "")
    }
}

impl Stats {
    /// Metrics of the worker of `consumer_group` on `queue`: the two labels
    /// every metric carries.
    pub fn new(queue: &str, consumer_group: &str) -> Self {
        let labels = [
            ("queue".into(), queue.to_owned().into()),
            ("consumer_group".into(), consumer_group.to_owned().into()),
        ];
        let mut registry = Registry::with_prefix_and_labels("idem", labels.into_iter());
        let deliveries = Family::<Outcome, Counter>::default();
        let outcome = |outcome| deliveries.get_or_create(&Outcome { outcome }).clone();
        let stats = Self {
            received: Counter::default(),
            applied: outcome("applied"),
            duplicates: outcome("duplicate"),
            invalid: outcome("invalid"),
            failed: outcome("failed"),
            retried: outcome("retried"),
            dead_lettered: outcome("dead_lettered"),
            parked: outcome("parked"),
            parked_bound_waits: Family::default(),
            parked_keys: Gauge::default(),
            parked_events: Gauge::default(),
            retries: Family::default(),
            infrastructure_retries: Counter::default(),
            sessions: Counter::default(),
            reconnects: Counter::default(),
            // 0.5 ms to about 16 s.
            transaction_seconds: Histogram::new(exponential_buckets(0.000_5, 2.0, 16)),
            batch_size: Histogram::new([
                1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0,
            ]),
            // 10 ms to about 3 hours: messages may wait in a wait queue.
            latency_seconds: Histogram::new(exponential_buckets(0.01, 2.0, 21)),
            in_flight: Gauge::default(),
            unacked: Gauge::default(),
            consuming: Gauge::default(),
            slots: Gauge::default(),
            database_up: Gauge::default(),
            pool: Family::default(),
            pool_max: Gauge::default(),
            relay: crate::relay::RelayCounters::default(),
            epochs: crate::store::filter::EpochCounters::default(),
            copies_nacked: Counter::default(),
            unconfirmed: Counter::default(),
            registry: Registry::default(),
        };
        stats.register_work(&mut registry, deliveries);
        stats.register_state(&mut registry);
        stats.register_outbox_and_epochs(&mut registry);
        Self { registry, ..stats }
    }

    /// What became of the deliveries, and the transactions that took them.
    fn register_work(&self, registry: &mut Registry, deliveries: Family<Outcome, Counter>) {
        registry.register(
            "deliveries",
            "Deliveries by what became of them: applied, duplicate, invalid (dead-lettered \
             at once), failed (a transaction of the message failed), retried (sent for \
             another attempt), dead_lettered (out of attempts)",
            deliveries,
        );
        registry.register(
            "received_deliveries",
            "Deliveries taken from the broker",
            self.received.clone(),
        );
        registry.register(
            "retries",
            "Failed deliveries sent for another attempt, by the delay they wait",
            self.retries.clone(),
        );
        registry.register(
            "database_retries",
            "Statements retried because the database was unavailable (no attempt spent)",
            self.infrastructure_retries.clone(),
        );
        registry.register(
            "sessions",
            "Consuming sessions started, one per broker connection",
            self.sessions.clone(),
        );
        registry.register(
            "reconnects",
            "Broker connections reopened after a loss",
            self.reconnects.clone(),
        );
        registry.register_with_unit(
            "transaction_duration",
            "Claim-and-apply transactions, from the first attempt to commit or failure",
            Unit::Seconds,
            self.transaction_seconds.clone(),
        );
        registry.register(
            "batch_size",
            "Deliveries per claim-and-apply transaction",
            self.batch_size.clone(),
        );
        registry.register_with_unit(
            "end_to_end_latency",
            "From a message's timestamp (set by its producer; idem publish does) to its ack",
            Unit::Seconds,
            self.latency_seconds.clone(),
        );
    }

    /// The worker's state now: what it holds, its connections.
    fn register_state(&self, registry: &mut Registry) {
        registry.register(
            "batches_in_flight",
            "Transactions being applied now",
            self.in_flight.clone(),
        );
        registry.register(
            "unacked_deliveries",
            "Deliveries taken and not yet settled with the broker",
            self.unacked.clone(),
        );
        registry.register(
            "consuming",
            "1 while a consumer is registered with the broker",
            self.consuming.clone(),
        );
        registry.register(
            "slots",
            "Slots of an ordered queue this worker consumes",
            self.slots.clone(),
        );
        registry.register(
            "parked_keys",
            "Keys of an ordered queue parked behind a failed head, as last counted",
            self.parked_keys.clone(),
        );
        registry.register(
            "parked_events",
            "Events the parked keys hold in PostgreSQL, as last counted",
            self.parked_events.clone(),
        );
        registry.register(
            "parked_bound_waits",
            "Seconds an event waited in the worker, unacked, because a bound of the parked \
             keys was reached (events_per_key: --max-parked-per-key; keys: --max-parked-keys)",
            self.parked_bound_waits.clone(),
        );
        registry.register(
            "database_up",
            "1 unless transactions are held because the database is unavailable",
            self.database_up.clone(),
        );
        registry.register(
            "pool_connections",
            "PostgreSQL connections of the pool, by state (idle, in_use)",
            self.pool.clone(),
        );
        registry.register(
            "pool_max_connections",
            "The most PostgreSQL connections the pool opens",
            self.pool_max.clone(),
        );
    }

    /// The outbox's relay, the epochs of the consume records, and what the
    /// worker sent or ran again.
    fn register_outbox_and_epochs(&self, registry: &mut Registry) {
        registry.register(
            "outbox_sent_messages",
            "Outbox messages the relay published and the broker confirmed",
            self.relay.sent.clone(),
        );
        registry.register(
            "outbox_refused_publishes",
            "Outbox publishes the broker refused (nacked, returned, no exchange): \
             the message stays in the outbox and is tried again later",
            self.relay.refused.clone(),
        );
        registry.register(
            "outbox_unsent_messages",
            "Outbox messages not sent yet, as last counted",
            self.relay.unsent.clone(),
        );
        registry.register(
            "current_epoch_records",
            "Records the current epoch of the consume records has taken, as last seen \
             (the id sequence's progress since it opened)",
            self.epochs.current_records.clone(),
        );
        registry.register(
            "epoch_filters",
            "Closed epochs of the consume records whose filter this worker holds",
            self.epochs.filtered.clone(),
        );
        registry.register_with_unit(
            "epoch_filter_memory",
            "Memory the filters of the closed epochs take",
            Unit::Bytes,
            self.epochs.bytes.clone(),
        );
        registry.register(
            "unfiltered_epochs",
            "Closed epochs this worker holds no filter of: every event is looked up in each",
            self.epochs.unfiltered.clone(),
        );
        registry.register(
            "epoch_lookups",
            "Lookups of an event in a closed epoch whose filter may hold it (the event's \
             record, or a false positive, about one in 28,000 per epoch)",
            self.epochs.lookups.clone(),
        );
        registry.register(
            "copies_nacked",
            "Copies the worker publishes before it acks a delivery (to a wait queue, to the \
             dead-letter exchange, due back to the work queue) that the broker nacked: each \
             goes again on a fresh channel for up to 30 s",
            self.copies_nacked.clone(),
        );
        registry.register(
            "unconfirmed_transactions",
            "Transactions committed without waiting for their flush that a flush did not find \
             on disk (the server lost them, or the flush failed), each run again before its \
             deliveries are acked",
            self.unconfirmed.clone(),
        );
        registry.register(
            "straight_claims",
            "Events claimed straight into the current epoch, without the claim function \
             (per-message mode, first deliveries, every closed epoch filtered)",
            self.epochs.straight.clone(),
        );
    }

    /// The counters of the epochs' upkeep and of the closed epochs'
    /// filters, for the store.
    pub fn epochs(&self) -> &crate::store::filter::EpochCounters {
        &self.epochs
    }

    /// The metrics in the OpenMetrics text format, which Prometheus reads.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }

    /// The counters now.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            received: self.received.get(),
            applied: self.applied.get(),
            duplicates: self.duplicates.get(),
            invalid: self.invalid.get(),
            retried: self.retried.get(),
            dead_lettered: self.dead_lettered.get(),
            parked: self.parked.get(),
            infrastructure_retries: self.infrastructure_retries.get(),
            sessions: self.sessions.get(),
            reconnects: self.reconnects.get(),
            outbox_sent: self.relay.sent.get(),
            outbox_refused: self.relay.refused.get(),
            copies_nacked: self.copies_nacked.get(),
            unconfirmed: self.unconfirmed.get(),
            slots: self.slots.get(),
            parked_bound_waits: [ParkedBound::EventsPerKey, ParkedBound::Keys]
                .into_iter()
                .map(|bound| self.bound_waits(bound).get())
                .sum(),
        }
    }

    fn bound_waits(&self, bound: ParkedBound) -> Counter {
        let bound = match bound {
            ParkedBound::EventsPerKey => "events_per_key",
            ParkedBound::Keys => "keys",
        };
        self.parked_bound_waits
            .get_or_create(&BoundLabel { bound })
            .clone()
    }

    /// An event waited a second past `bound`.
    pub(crate) fn parked_bound_wait(&self, bound: ParkedBound) {
        self.bound_waits(bound).inc();
    }

    /// The parked keys and the events they hold, as counted now.
    pub(crate) fn parked_now(&self, keys: i64, events: i64) {
        self.parked_keys.set(keys);
        self.parked_events.set(events);
    }

    /// What the worker's copies count their nacks into.
    pub(crate) fn copies_nacked(&self) -> &Counter {
        &self.copies_nacked
    }

    /// The counters a relay beside the consumer bumps.
    pub(crate) fn relay(&self) -> &crate::relay::RelayCounters {
        &self.relay
    }

    pub(crate) fn received(&self, n: u64) {
        self.received.inc_by(n);
    }

    pub(crate) fn applied(&self, n: u64) {
        self.applied.inc_by(n);
    }

    pub(crate) fn duplicates(&self, n: u64) {
        self.duplicates.inc_by(n);
    }

    pub(crate) fn parked(&self, n: u64) {
        self.parked.inc_by(n);
    }

    pub(crate) fn invalid(&self, n: u64) {
        self.invalid.inc_by(n);
    }

    pub(crate) fn failed(&self, n: u64) {
        self.failed.inc_by(n);
    }

    /// `n` deliveries sent for another attempt after waiting `delay`.
    pub(crate) fn retried(&self, n: u64, delay: Duration) {
        self.retried.inc_by(n);
        self.retries
            .get_or_create(&Delay {
                delay: crate::duration::format(delay),
            })
            .inc_by(n);
    }

    /// A transaction a flush did not confirm, run again.
    pub(crate) fn unconfirmed(&self) {
        self.unconfirmed.inc();
    }

    pub(crate) fn dead_lettered(&self, n: u64) {
        self.dead_lettered.inc_by(n);
    }

    pub(crate) fn infrastructure_retries(&self, n: u64) {
        self.infrastructure_retries.inc_by(n);
    }

    pub(crate) fn sessions(&self, n: u64) {
        self.sessions.inc_by(n);
    }

    pub(crate) fn reconnects(&self, n: u64) {
        self.reconnects.inc_by(n);
    }

    /// A transaction of `size` deliveries took `took`.
    pub(crate) fn transaction(&self, size: usize, took: Duration) {
        self.batch_size.observe(size as f64);
        self.transaction_seconds.observe(took.as_secs_f64());
    }

    /// A message was acked `latency` after its producer's timestamp.
    pub(crate) fn latency(&self, latency: Duration) {
        self.latency_seconds.observe(latency.as_secs_f64());
    }

    /// One more (or one fewer) transaction in flight.
    pub(crate) fn in_flight(&self, change: i64) {
        self.in_flight.inc_by(change);
    }

    pub(crate) fn unacked(&self, n: usize) {
        self.unacked.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub(crate) fn slots(&self, held: usize) {
        self.slots.set(i64::try_from(held).unwrap_or(i64::MAX));
    }

    pub(crate) fn consuming(&self, consuming: bool) {
        self.consuming.set(i64::from(consuming));
    }

    /// True while a consumer is registered.
    pub(crate) fn is_consuming(&self) -> bool {
        self.consuming.get() == 1
    }

    /// True while the worker consumes with no transaction in flight and
    /// no delivery it took left to settle: what a check waits for before it
    /// stops a worker whose work looks done.
    #[doc(hidden)]
    pub fn is_idle(&self) -> bool {
        self.is_consuming() && self.in_flight.get() == 0 && self.unacked.get() == 0
    }

    pub(crate) fn database_up(&self, up: bool) {
        self.database_up.set(i64::from(up));
    }

    /// The pool's connections now: in use, idle, and its limit.
    pub(crate) fn pool(&self, status: deadpool_postgres::Status) {
        let in_use = status.size.saturating_sub(status.available);
        let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        for (state, n) in [("in_use", in_use), ("idle", status.available)] {
            self.pool.get_or_create(&PoolState { state }).set(gauge(n));
        }
        self.pool_max.set(gauge(status.max_size));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metrics_carry_their_base_units_totals_and_bounded_labels() {
        let stats = Stats::new("work", "group");
        stats.applied(3);
        stats.retried(1, Duration::from_secs(10));
        stats.transaction(200, Duration::from_millis(4));
        let text = stats.encode();
        for line in [
            r#"idem_deliveries_total{queue="work",consumer_group="group",outcome="applied"} 3"#,
            r#"idem_retries_total{queue="work",consumer_group="group",delay="10s"} 1"#,
            "# TYPE idem_transaction_duration_seconds histogram",
            r#"idem_batch_size_count{queue="work",consumer_group="group"} 1"#,
        ] {
            assert!(text.contains(line), "{line} is missing from\n{text}");
        }
        assert_eq!(stats.snapshot().applied, 3);
        assert_eq!(stats.snapshot().retried, 1);
    }
}
