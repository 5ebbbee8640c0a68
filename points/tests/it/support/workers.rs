//! Workers run in the test's process, their totals checked, and a handler
//! held to idem's general path.

use super::*;

/// A worker running in this process.
pub struct RunningWorker {
    pub stats: Arc<Stats>,
    shutdown: CancellationToken,
    handle: JoinHandle<Result<(), WorkerError>>,
}

impl RunningWorker {
    /// The points worker.
    pub fn start(config: WorkerConfig) -> Self {
        Self::start_with(config, idem_points::points::Points)
    }

    /// A worker of `handler`.
    pub fn start_with<H: idem::handler::Handler>(config: WorkerConfig, handler: H) -> Self {
        if let Ok(filter) = std::env::var("IDEM_TEST_LOG") {
            idem::telemetry::init(&filter, idem::telemetry::LogFormat::Text);
        }
        let worker = Worker::new(config, handler);
        let stats = worker.stats();
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(worker.run(shutdown.clone()));
        Self {
            stats,
            shutdown,
            handle,
        }
    }

    /// Asks it to stop, waits until it has, and gives its final counts:
    /// what it finished in flight is counted in them, unlike a snapshot
    /// taken while it runs (it counts a delivery after its commit).
    pub async fn stop(self) -> anyhow::Result<Snapshot> {
        self.shutdown.cancel();
        tokio::time::timeout(patient(Duration::from_secs(30)), self.handle).await???;
        Ok(self.stats.snapshot())
    }

    /// Waits until it has finished (acked or dead-lettered) `n` deliveries.
    pub async fn wait_finished(&self, n: u64, timeout: Duration) -> anyhow::Result<()> {
        wait_for(&format!("{n} finished deliveries"), timeout, || async {
            if self.handle.is_finished() {
                bail!("the worker stopped: {:?}", self.stats.snapshot());
            }
            Ok(self.stats.snapshot().finished() >= n)
        })
        .await
    }
}

/// The published load's distinct events each recorded once, every order at
/// its exact total, and the dead-letter queue holding exactly `dead` (bodies).
pub async fn assert_exact(
    env: &TestEnv,
    load: &[PaymentSucceeded],
    dead: &[Vec<u8>],
) -> anyhow::Result<()> {
    let expected = idem_points::generate::expected_points(load);
    let distinct = idem_points::generate::distinct_events(load) as i64;
    assert_eq!(
        env.doubly_recorded(GROUP).await?,
        0,
        "an event was recorded twice"
    );
    assert_eq!(
        env.records(GROUP).await?,
        distinct,
        "one record per distinct event"
    );
    let points = env.all_points().await?;
    let wrong: Vec<_> = expected
        .iter()
        .filter(|(order, total)| points.get(*order) != Some(total))
        .map(|(order, total)| (order, total, points.get(order)))
        .collect();
    assert!(
        wrong.is_empty(),
        "orders off their totals (order, expected, found): {wrong:?}"
    );
    let mut letters: Vec<Vec<u8>> = env
        .dead_letters()
        .await?
        .into_iter()
        .map(|l| l.body)
        .collect();
    letters.sort();
    let mut dead = dead.to_vec();
    dead.sort();
    assert_eq!(letters, dead, "the dead-letter queue's content");
    Ok(())
}

/// A generated load for `env`: its ids start with the test's name.
pub fn load(
    env: &TestEnv,
    count: usize,
    duplicate_ratio: f64,
    orders: usize,
) -> Vec<PaymentSucceeded> {
    idem_points::generate::events(&idem_points::generate::LoadSpec {
        count,
        duplicate_ratio,
        orders,
        seed: fastrand::u64(..),
        prefix: env.name.clone(),
    })
}

/// A handler through idem's general path: `H` in every way but its tally,
/// so that idem claims, calls `apply`, writes the outbox rows, and commits,
/// each a statement of its own.
pub struct Untallied<H>(pub H);

impl<H: idem::handler::Handler> idem::handler::Handler for Untallied<H> {
    type Event = H::Event;
    const NAME: &'static str = H::NAME;
    const MIGRATIONS: &'static [idem::handler::Migration] = H::MIGRATIONS;
    const SENDS_MESSAGES: bool = H::SENDS_MESSAGES;

    fn decode(&self, body: &[u8]) -> Result<H::Event, idem::handler::Invalid> {
        self.0.decode(body)
    }

    fn event_id<'e>(&self, event: &'e H::Event) -> &'e str {
        self.0.event_id(event)
    }

    async fn apply(
        &self,
        tx: &idem::handler::Transaction<'_>,
        events: &[&H::Event],
        outbox: &mut idem::handler::Outbox<'_>,
    ) -> Result<(), idem::handler::HandlerError> {
        self.0.apply(tx, events, outbox).await
    }

    fn classify(&self, error: &tokio_postgres::Error) -> idem::handler::FailureKind {
        self.0.classify(error)
    }

    fn outgoing(&self, event: &H::Event) -> Vec<idem::handler::OutboxMessage> {
        self.0.outgoing(event)
    }

    fn tally(&self) -> Option<idem::handler::Tally<H::Event>> {
        None
    }
}

/// `applier.apply(events)`, its failure as an error.
pub async fn apply<'e, H: idem::handler::Handler>(
    applier: &idem::store::Applier<H>,
    events: &[&'e H::Event],
) -> anyhow::Result<idem::store::Claimed<'e>> {
    applier
        .apply(events)
        .await
        .map_err(|failure| anyhow::anyhow!("{}", failure.reason))
}
