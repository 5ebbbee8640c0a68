//! `check`: proves a handler's effect under idem's faults, before
//! production does. idem's guarantee (an event's effect once, however
//! often it arrives) holds only if the handler's [`apply`] does what idem
//! expects of it: its effect on a batch is its events' effects one at a
//! time, it writes only in idem's transaction, and what it writes follows
//! from the events and the tables alone.
//!
//! A check applies the events one at a time, in the file's order, each in
//! a transaction of its own (the reference); twice, to see that the effect
//! is the same each time; and in the reverse order, to see whether it
//! depends on the order. Then it runs the real worker on them, in batch
//! and per-message mode, under faults chosen rather than left to chance
//! (the `runs` module), and compares what each run left (the handler's
//! tables, row by row, and its outgoing messages) with the reference: when
//! the order does not matter, every run must end where the reference did.
//! Always, idem's own accounts must hold: every event applied once or
//! dead-lettered, one consume record each, the invariants given, and the
//! witness query counting each applied event's effect once.
//!
//! Every run has a schema and queues of its own (`idem_check_<id>_…`,
//! `idem-check-<id>.…`, on the URL's vhost), removed at the end.
//!
//! # Layout
//!
//! - `events` — the events file: JSON lines, or a `dlq discard` file.
//! - `state` — the handler's tables and outbox, and their differences.
//! - `reference` — one event at a time, and batch equivalence.
//! - `runs` — the runs on the real worker, its probe and its proxies.
//! - `scratch` — a run's schema.
//! - `report` — what a check says, as text or JSON.
//!
//! [`apply`]: crate::handler::Handler::apply

mod events;
mod reference;
mod report;
mod runs;
mod scratch;
mod state;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use deadpool_postgres::GenericClient;
use futures::{StreamExt, TryStreamExt};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use events::read as read_events;
pub use report::{CheckReport, RunReport};
pub use state::{Difference, LeftOut, Why};

use crate::broker::{AmqpConfig, ConnectError, close, connect_with_retry};
use crate::handler::{BoxError, Handler, message_id};
use crate::store::{DatabaseConfig, ReadyError, StoreError};
use crate::worker::WorkerConfig;
use reference::{Equivalence, Fates};
use runs::{Plan, Rig, Upstream};
use scratch::Scratch;
use state::{Lookup, State, Tables};

/// What a check runs, on what, and how it judges.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CheckConfig {
    /// The broker: the runs make queues of their own on the URL's vhost.
    pub amqp: AmqpConfig,
    /// The database: the runs make schemas of their own in it (its schema
    /// setting is not used).
    pub database: DatabaseConfig,
    /// The consumer group the events are recorded under.
    pub consumer_group: String,
    /// Message bodies, in order ([`read_events`] reads a file of them).
    pub events: Vec<Vec<u8>>,
    /// SQL run after the migrations in every schema the check makes (seed
    /// rows, say).
    pub setup: Option<String>,
    /// Queries that must return no row, after every run.
    pub invariants: Vec<String>,
    /// A query taking an event id (`$1`) and returning how many times its
    /// effect is present: once for an event idem applied, never for one it
    /// did not.
    pub witness: Option<String>,
    /// `table.column`s left out of the comparisons (a timestamp the team
    /// knows to differ).
    pub ignore_columns: Vec<String>,
    /// Copies of every message in the copies runs, at least 2.
    pub copies: usize,
    /// Deliveries per batch in batch mode, and per cut of batch
    /// equivalence.
    pub batch_size: usize,
    /// Genuine failures after which a message is dead-lettered.
    pub max_attempts: u32,
    /// Seed of the orders drawn.
    pub seed: u64,
    /// How long one run may take.
    pub patience: Duration,
    /// How long to wait for PostgreSQL and RabbitMQ to answer at the start.
    pub startup_timeout: Duration,
}

impl CheckConfig {
    /// Copies of every message in the copies runs, unless said otherwise.
    pub const DEFAULT_COPIES: usize = 3;
    /// Deliveries per batch, unless said otherwise: small enough that a
    /// few hundred events make several batches.
    pub const DEFAULT_BATCH_SIZE: usize = 100;
    /// How long one run may take, unless said otherwise.
    pub const DEFAULT_PATIENCE: Duration = Duration::from_secs(300);
    /// Genuine failures after which a message is dead-lettered, unless said
    /// otherwise: the check retries at once, where the worker's retries
    /// wait, so more attempts would find what the first two found, and a
    /// failing message makes each batch it lands in go one by one.
    pub const DEFAULT_MAX_ATTEMPTS: u32 = 2;

    /// A check of `events` (message bodies) on these servers, under the
    /// consumer group `consumer_group`, with idem's defaults for the rest.
    pub fn new(
        amqp: AmqpConfig,
        database: DatabaseConfig,
        consumer_group: impl Into<String>,
        events: Vec<Vec<u8>>,
    ) -> Self {
        Self {
            amqp,
            database,
            consumer_group: consumer_group.into(),
            events,
            setup: None,
            invariants: Vec::new(),
            witness: None,
            ignore_columns: Vec::new(),
            copies: Self::DEFAULT_COPIES,
            batch_size: Self::DEFAULT_BATCH_SIZE,
            max_attempts: Self::DEFAULT_MAX_ATTEMPTS,
            seed: 1,
            patience: Self::DEFAULT_PATIENCE,
            startup_timeout: WorkerConfig::DEFAULT_STARTUP_TIMEOUT,
        }
    }

    /// The same check, running `sql` after the migrations in every schema.
    pub fn setup(self, sql: impl Into<String>) -> Self {
        Self {
            setup: Some(sql.into()),
            ..self
        }
    }

    /// The same check, with one more query that must return no row.
    pub fn invariant(mut self, sql: impl Into<String>) -> Self {
        self.invariants.push(sql.into());
        self
    }

    /// The same check, counting each event's effect with `sql` (`$1`: the
    /// event id).
    pub fn witness(self, sql: impl Into<String>) -> Self {
        Self {
            witness: Some(sql.into()),
            ..self
        }
    }

    /// The same check, leaving `table.column` out of the comparisons.
    pub fn ignore_column(mut self, column: impl Into<String>) -> Self {
        self.ignore_columns.push(column.into());
        self
    }

    fn validate(&self) -> Result<(), CheckError> {
        crate::worker::check_consumer_group(&self.consumer_group)
            .map_err(|error| CheckError::Usage(error.to_string()))?;
        if self.events.is_empty() {
            return Err(CheckError::Usage("no event to check".into()));
        }
        if self.copies < 2 {
            return Err(CheckError::Usage(
                "copies must be at least 2: one copy is no duplicate".into(),
            ));
        }
        if self.batch_size < 2 || self.batch_size * 8 > usize::from(u16::MAX) {
            return Err(CheckError::Usage(
                "the batch size must be 2 to 8191: a batch of one is per-message mode".into(),
            ));
        }
        if self.max_attempts == 0 {
            return Err(CheckError::Usage("max attempts must be at least 1".into()));
        }
        for column in &self.ignore_columns {
            if column.split('.').count() != 2 || column.split('.').any(str::is_empty) {
                return Err(CheckError::Usage(format!(
                    "--ignore-column {column}: give it as TABLE.COLUMN"
                )));
            }
        }
        Ok(())
    }
}

/// Why a check could not be run to the end.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckError {
    /// What it was given cannot work: a file, a query, a column, a setting.
    #[error("{0}")]
    Usage(String),
    /// A server failed it.
    #[error("{0}")]
    Failed(#[source] BoxError),
    /// Shutdown was asked for.
    #[error("interrupted")]
    Interrupted,
}

impl CheckError {
    fn database(doing: &str, error: &tokio_postgres::Error) -> Self {
        Self::Failed(format!("{doing}: {}", crate::store::describe(error)).into())
    }
}

/// A valid event of the file: its id, what it decodes to, and its body.
#[derive(Debug)]
pub(crate) struct Event<E> {
    pub(crate) id: String,
    pub(crate) event: E,
    pub(crate) body: Vec<u8>,
}

/// Runs every check on the handlers `make` returns (one per worker and per
/// run, as a new process would have) and reports; the schemas and queues
/// it made are removed however it ends.
///
/// ```no_run
/// # use idem::handler::{Handler, HandlerError, Invalid, Outbox, Transaction};
/// # struct Inventory;
/// # impl Handler for Inventory {
/// #     type Event = String;
/// #     const NAME: &'static str = "inventory";
/// #     fn decode(&self, body: &[u8]) -> Result<String, Invalid> { Ok(String::from_utf8(body.to_vec())?) }
/// #     fn event_id<'e>(&self, event: &'e String) -> &'e str { event }
/// #     async fn apply(&self, _: &Transaction<'_>, _: &[&String], _: &mut Outbox<'_>) -> Result<(), HandlerError> { Ok(()) }
/// # }
/// use idem::broker::AmqpConfig;
/// use idem::check::CheckConfig;
/// use idem::secret::SecretUrl;
/// use idem::store::DatabaseConfig;
///
/// # async fn test() -> Result<(), idem::check::CheckError> {
/// let events = (0..200).map(|n| format!("reservation-{n}").into_bytes()).collect();
/// let config = CheckConfig::new(
///     AmqpConfig::new(SecretUrl::new("amqp://guest:guest@127.0.0.1:5672/%2f")),
///     DatabaseConfig::new(SecretUrl::new("postgres://postgres@127.0.0.1/postgres")),
///     "inventory",
///     events,
/// )
/// .witness("SELECT count(*) FROM reserved WHERE event_id = $1");
/// let report = idem::check::run(&config, || Inventory).await?;
/// assert!(report.passed(), "{report}");
/// # Ok(())
/// # }
/// ```
pub async fn run<G, F>(config: &CheckConfig, make: F) -> Result<CheckReport, CheckError>
where
    G: Handler,
    F: Fn() -> G + Send + Sync,
{
    run_until(config, make, &CancellationToken::new()).await
}

/// [`run`], until `shutdown` fires (an error then, once the check's schemas
/// and queues are removed).
pub async fn run_until<G, F>(
    config: &CheckConfig,
    make: F,
    shutdown: &CancellationToken,
) -> Result<CheckReport, CheckError>
where
    G: Handler,
    F: Fn() -> G + Send + Sync,
{
    config.validate()?;
    let started = Instant::now();
    // The process's id, for a test suite's sweep of what a check that died
    // left; then a random part, for two checks of one process.
    let prefix = format!(
        "idem_check_{}_{:04x}",
        std::process::id(),
        fastrand::u16(..)
    );
    let admin = {
        let mut admin = config.database.clone();
        admin.schema = None;
        admin.pool_size = 2;
        admin
            .pool()
            .map_err(|error| CheckError::Usage(error.to_string()))?
    };
    let server = config.database.describe();
    let answered = crate::store::until_answered(&server, config.startup_timeout, shutdown, || {
        let admin = admin.clone();
        async move { admin.get().await.map(drop).map_err(StoreError::from) }
    })
    .await;
    match answered {
        Ok(()) => {}
        Err(ReadyError::Interrupted) => return Err(CheckError::Interrupted),
        Err(error) => return Err(CheckError::Failed(Box::new(error))),
    }
    let upstream = Upstream {
        database: config
            .database
            .address()
            .await
            .map_err(|error| CheckError::Usage(error.to_string()))?,
        broker: config.amqp.address().await.map_err(CheckError::Usage)?,
    };
    let connection = match connect_with_retry(
        &config.amqp,
        "idem check",
        config.startup_timeout,
        shutdown,
    )
    .await
    {
        Ok(connection) => connection,
        Err(ConnectError::Interrupted) => return Err(CheckError::Interrupted),
        Err(error) => return Err(CheckError::Failed(Box::new(error))),
    };
    let handler = make();
    let decoded = decode(&handler, &config.events);
    let check = Check {
        config,
        make: &make,
        prefix: prefix.clone(),
        upstream,
        connection: &connection,
        ids: decoded
            .events
            .iter()
            .map(|event| event.id.as_str())
            .collect(),
    };
    let outcome = tokio::select! {
        outcome = check.everything(&decoded) => outcome,
        () = shutdown.cancelled() => Err(CheckError::Interrupted),
    };
    let removed = scratch::remove(&admin, &prefix).await;
    let deleted = runs::remove(&connection, &check.queue_prefix()).await;
    close(&connection).await;
    let mut report = outcome?;
    removed?;
    deleted?;
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// One check under way.
struct Check<'a, F> {
    config: &'a CheckConfig,
    make: &'a F,
    /// Start of every schema and queue name.
    prefix: String,
    upstream: Upstream,
    connection: &'a lapin::Connection,
    /// The distinct valid events' ids, in the file's order.
    ids: Vec<&'a str>,
}

/// The events of a check, decoded.
struct Decoded<E> {
    events: Vec<Event<E>>,
    invalid: usize,
}

/// What a run left, as judged.
struct Observed {
    state: State,
    fates: Fates,
    /// Events whose effect is there more than once, and how that shows.
    doubled: BTreeMap<String, String>,
    /// Events whose effect is not there though it should be, and how.
    lost: BTreeMap<String, String>,
    /// Rows the invariants returned: how many, and the first ones.
    violations: (usize, Vec<String>),
}

/// How many differences, events or rows of each kind a report shows.
const SHOWN: usize = 3;

/// Outgoing messages per event whose keys a doubled outbox row is traced
/// back to.
const OUTGOING_LOOKED_AT: usize = 8;

impl<F> Check<'_, F> {
    /// Start of every queue and exchange name: the schemas' with dashes.
    fn queue_prefix(&self) -> String {
        self.prefix.replace('_', "-")
    }
}

impl<G: Handler, F: Fn() -> G + Send + Sync> Check<'_, F> {
    async fn everything(&self, decoded: &Decoded<G::Event>) -> Result<CheckReport, CheckError> {
        let config = self.config;
        let events: Vec<&Event<G::Event>> = decoded.events.iter().collect();
        let mut report = CheckReport {
            messages: config.events.len(),
            events: events.len(),
            invalid: decoded.invalid,
            ..CheckReport::default()
        };
        let lookup_events: Vec<(String, &[u8])> = events
            .iter()
            .map(|event| (event.id.clone(), event.body.as_slice()))
            .collect();
        let lookup = Lookup {
            events: &lookup_events,
        };

        let (tables, expected) = self.references(&events, &lookup, &mut report).await?;
        let reference = (!report.order_matters).then_some(&expected);

        // Batch equivalence, on two cuts of the events.
        report.runs.push(
            self.equivalence(&events, &tables, reference, &lookup)
                .await?,
        );

        // The real worker, under every fault.
        let bodies: Vec<(String, Vec<u8>)> = events
            .iter()
            .map(|event| (event.id.clone(), event.body.clone()))
            .collect();
        let rig = Rig {
            amqp: &config.amqp,
            upstream: self.upstream,
            connection: self.connection,
            make: self.make,
            consumer_group: &config.consumer_group,
            prefix: &self.queue_prefix(),
            bodies: &config.events,
            events: &bodies,
            max_attempts: config.max_attempts,
            seed: config.seed,
            patience: config.patience,
        };
        for plan in runs::plans(config.copies, config.batch_size, config.seed) {
            let row = self
                .worker_run(&rig, &plan, &events, &tables, reference, &lookup)
                .await;
            report.runs.push(row?);
        }
        Ok(report)
    }

    /// The references: the events one at a time in the file's order, which
    /// also finds the tables to compare; again, which tells the columns
    /// the events do not decide (left out from then on, and a failure);
    /// and reversed, which tells whether the order matters. Their rows go
    /// into `report`; the shape of the comparisons and the reference come
    /// back.
    async fn references(
        &self,
        events: &[&Event<G::Event>],
        lookup: &Lookup<'_>,
        report: &mut CheckReport,
    ) -> Result<(Tables, Observed), CheckError> {
        let config = self.config;
        let started = Instant::now();
        let first = self.scratch("reference", 2).await?;
        let client = first
            .pool
            .get()
            .await
            .map_err(|error| CheckError::Failed(error.into()))?;
        let mut tables = state::tables(&client, &first.schema, &config.ignore_columns).await?;
        self.validate_queries(&client).await?;
        drop(client);
        let fates = self.one_at_a_time(&first, events).await?;
        let mut expected = self.observe(&first, &tables, Some(fates.clone())).await?;
        let mut first_row = self.row(
            "reference · the file's order",
            events,
            &expected,
            None,
            lookup,
        );
        first_row.seconds = started.elapsed().as_secs_f64();

        // The same order again: what differs is not the events' doing.
        let started = Instant::now();
        let again = self.scratch("again", 2).await?;
        let again_fates = self.one_at_a_time(&again, events).await?;
        let repeated = self.observe(&again, &tables, Some(again_fates)).await?;
        let mut unstable = state::differences(&expected.state, &repeated.state);
        report.unstable = state::unstable(&expected.state, &repeated.state);
        let mut again_row = self.row(
            "reference · the file's order, again",
            events,
            &repeated,
            None,
            lookup,
        );
        again_row.diverged = Some(unstable.len());
        lookup.name(&mut unstable, SHOWN);
        let rows = unstable.iter().map(ToString::to_string).collect();
        again_row.findings.extend(first_few(rows, "rows", ""));
        again_row.seconds = started.elapsed().as_secs_f64();
        if !unstable.is_empty() {
            // Compared from here on without them, so that what else differs shows.
            let mut ignore = config.ignore_columns.clone();
            ignore.extend(
                report
                    .unstable
                    .iter()
                    .filter(|column| !column.ends_with(')'))
                    .cloned(),
            );
            let client = first
                .pool
                .get()
                .await
                .map_err(|error| CheckError::Failed(error.into()))?;
            tables = state::tables(&client, &first.schema, &ignore).await?;
            drop(client);
            expected = self.observe(&first, &tables, Some(fates)).await?;
            first_row = RunReport {
                seconds: first_row.seconds,
                ..self.row(
                    "reference · the file's order",
                    events,
                    &expected,
                    None,
                    lookup,
                )
            };
        }
        report.left_out = tables.left_out.clone();
        report.tables = tables.names();
        report.runs.push(first_row);
        report.runs.push(again_row);

        // The reverse order: does the effect depend on it?
        let started = Instant::now();
        let reversed_events: Vec<&Event<G::Event>> = events.iter().rev().copied().collect();
        let reversed = self.scratch("reversed", 2).await?;
        let reversed_fates = self.one_at_a_time(&reversed, &reversed_events).await?;
        let reversed = self
            .observe(&reversed, &tables, Some(reversed_fates))
            .await?;
        let mut order = state::differences(&expected.state, &reversed.state);
        let fate_changes = fate_differences(&expected.fates, &reversed.fates);
        report.order_matters = !order.is_empty() || !fate_changes.is_empty();
        let mut reversed_row = self.row("reference · reversed", events, &reversed, None, lookup);
        if report.order_matters {
            reversed_row.findings.push(format!(
                "the effect depends on the order of the events ({} rows and {} events' fates differ \
                 from the file's order): the runs are judged by the invariants, the witness and \
                 idem's accounts, not by the reference's rows",
                order.len(),
                fate_changes.len()
            ));
            reversed_row
                .findings
                .extend(first_few(fate_changes, "events", ""));
            lookup.name(&mut order, SHOWN);
            let rows = order.iter().map(ToString::to_string).collect();
            reversed_row.findings.extend(first_few(rows, "rows", ""));
        }
        reversed_row.seconds = started.elapsed().as_secs_f64();
        report.runs.push(reversed_row);
        Ok((tables, expected))
    }

    /// `events` applied one at a time on `scratch`, in their order.
    async fn one_at_a_time(
        &self,
        scratch: &Scratch,
        events: &[&Event<G::Event>],
    ) -> Result<Fates, CheckError> {
        reference::one_at_a_time(scratch, (self.make)(), &self.config.consumer_group, events).await
    }

    /// A schema of the check's own for `run`, migrated and set up.
    async fn scratch(&self, run: &str, pool_size: usize) -> Result<Scratch, CheckError> {
        Scratch::create::<G>(
            &self.config.database,
            format!("{}_{run}", self.prefix),
            self.config.setup.as_deref(),
            pool_size,
        )
        .await
    }

    /// Runs every invariant and the witness once on a fresh schema: a query
    /// that cannot run is a usage error, said before any run.
    async fn validate_queries(&self, client: &impl GenericClient) -> Result<(), CheckError> {
        for (place, invariant) in self.config.invariants.iter().enumerate() {
            client
                .query(&invariant_query(invariant), &[])
                .await
                .map_err(|error| {
                    CheckError::Usage(format!(
                        "--invariant {} cannot run: {}",
                        place + 1,
                        crate::store::describe(&error)
                    ))
                })?;
        }
        if let Some(witness) = &self.config.witness {
            let cannot = |why: String| CheckError::Usage(format!("--witness cannot run: {why}"));
            let statement = client
                .prepare(witness)
                .await
                .map_err(|error| cannot(crate::store::describe(&error)))?;
            if statement.params().len() != 1 {
                return Err(cannot(format!(
                    "it must take the event id as $1, its one parameter (it takes {})",
                    statement.params().len()
                )));
            }
            witness_count(client, witness, "").await.map_err(cannot)?;
        }
        Ok(())
    }

    /// What `scratch` holds after a run: its tables, the events' fates
    /// (those given, or idem's records and dead letters), and what is
    /// doubled, lost or breaks an invariant.
    async fn observe(
        &self,
        scratch: &Scratch,
        tables: &Tables,
        fates: Option<Fates>,
    ) -> Result<Observed, CheckError> {
        let config = self.config;
        let client = scratch
            .pool
            .get()
            .await
            .map_err(|error| CheckError::Failed(error.into()))?;
        let client = &client;
        let ids = &self.ids;
        let fates = match fates {
            Some(fates) => fates,
            None => fates_of(client, &config.consumer_group, ids).await?,
        };
        let state = tables.state(client).await?;
        let read =
            |error: tokio_postgres::Error| CheckError::database("reading a run's accounts", &error);
        let mut doubled = BTreeMap::new();
        let records = client
            .query(
                "SELECT event_id::text, count(*) FROM mq_consume_record \
                 WHERE consumer_group = $1 GROUP BY event_id HAVING count(*) > 1",
                &[&config.consumer_group],
            )
            .await
            .map_err(read)?;
        for row in records {
            let count: i64 = row.get(1);
            doubled.insert(row.get(0), format!("{count} consume records"));
        }
        let mut lost = BTreeMap::new();
        for id in ids {
            if !fates.applied.contains(*id) && !fates.dead.contains_key(*id) {
                lost.insert(
                    (*id).to_owned(),
                    "neither applied nor dead-lettered".to_owned(),
                );
            }
        }
        if let Some(witness) = &config.witness {
            let counts = witness_counts(client, witness, ids)
                .await
                .map_err(|error| CheckError::Failed(format!("--witness: {error}").into()))?;
            for (id, count) in ids.iter().zip(counts) {
                let expected = i64::from(fates.applied.contains(*id));
                if count > expected {
                    let what = if expected == 0 {
                        format!("the witness counts {count} though idem did not apply it")
                    } else {
                        format!("the witness counts {count}")
                    };
                    doubled.entry((*id).to_owned()).or_insert(what);
                } else if count < expected {
                    lost.entry((*id).to_owned())
                        .or_insert_with(|| "applied, but the witness counts 0".to_owned());
                }
            }
        }
        for (id, what) in self.outbox_doubled(client).await? {
            doubled.entry(id).or_insert(what);
        }
        let mut violations = (0, Vec::new());
        for (place, invariant) in config.invariants.iter().enumerate() {
            let rows = client
                .query(&invariant_query(invariant), &[])
                .await
                .map_err(read)?;
            violations.0 += rows.len();
            for row in rows.iter().take(SHOWN) {
                let text: Option<String> = row.get(0);
                violations.1.push(format!(
                    "invariant {} returned {}",
                    place + 1,
                    text.unwrap_or_default()
                ));
            }
        }
        Ok(Observed {
            state,
            fates,
            doubled,
            lost,
            violations,
        })
    }

    /// The events whose messages are in the outbox more than once (the
    /// check's workers relay nothing): their idempotency keys are derived
    /// from the event, so a key twice is an effect twice.
    async fn outbox_doubled(
        &self,
        client: &impl GenericClient,
    ) -> Result<Vec<(String, String)>, CheckError> {
        let twice = client
            .query(
                "SELECT message_id, count(*) FROM mq_outbox GROUP BY 1 HAVING count(*) > 1",
                &[],
            )
            .await
            .map_err(|error| CheckError::database("reading the outbox", &error))?;
        if twice.is_empty() {
            return Ok(Vec::new());
        }
        let group = &self.config.consumer_group;
        let keys: HashMap<uuid::Uuid, &str> = self
            .ids
            .iter()
            .flat_map(|id| {
                (0..OUTGOING_LOOKED_AT).map(move |index| (message_id(group, id, index), *id))
            })
            .collect();
        Ok(twice
            .iter()
            .map(|row| {
                let (key, count): (uuid::Uuid, i64) = (row.get(0), row.get(1));
                let what = format!("its message {key} is in the outbox {count} times");
                let event = keys
                    .get(&key)
                    .map_or_else(|| format!("message {key}"), |id| (*id).to_owned());
                (event, what)
            })
            .collect())
    }

    /// A run's row of the report: its counts, and what it found wrong,
    /// compared with `reference` when there is one to compare with.
    fn row(
        &self,
        name: &str,
        events: &[&Event<G::Event>],
        observed: &Observed,
        reference: Option<&Observed>,
        lookup: &Lookup<'_>,
    ) -> RunReport {
        let mut row = RunReport {
            name: name.to_owned(),
            events: events.len(),
            applied: observed.fates.applied.len(),
            dead_lettered: observed.fates.dead.len(),
            doubled: observed.doubled.len(),
            lost: observed.lost.len(),
            violations: observed.violations.0,
            ..RunReport::default()
        };
        let listed = |events: &BTreeMap<String, String>| {
            events
                .iter()
                .take(SHOWN)
                .map(|(id, how)| format!("{id} ({how})"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if !observed.doubled.is_empty() {
            row.findings
                .push(format!("doubled: {}", listed(&observed.doubled)));
        }
        if !observed.lost.is_empty() {
            row.findings
                .push(format!("lost: {}", listed(&observed.lost)));
        }
        row.findings.extend(observed.violations.1.iter().cloned());
        if let Some(reference) = reference {
            let mut rows = state::differences(&reference.state, &observed.state);
            let fates = fate_differences(&reference.fates, &observed.fates);
            row.diverged = Some(rows.len() + fates.len());
            lookup.name(&mut rows, SHOWN);
            row.findings.extend(first_few(fates, "events", ""));
            let rows = rows.iter().map(ToString::to_string).collect();
            row.findings.extend(first_few(rows, "rows", ""));
        }
        row
    }

    /// Batch equivalence on two cuts of the events: from the first one, and
    /// from half a batch in, so that two neighbours of the file share a
    /// batch in one of them.
    async fn equivalence(
        &self,
        events: &[&Event<G::Event>],
        tables: &Tables,
        reference: Option<&Observed>,
        lookup: &Lookup<'_>,
    ) -> Result<RunReport, CheckError> {
        let started = Instant::now();
        let size = self.config.batch_size;
        let handler = (self.make)();
        let mut row = RunReport::default();
        let (mut batches, mut unequal, mut shown) = (0, 0, 0);
        for (cut, offset) in [("batches", 0), ("batches_half", size / 2)] {
            let scratch = self.scratch(cut, 1).await?;
            let found: Equivalence = reference::batch_equivalence(
                &scratch,
                &handler,
                &self.config.consumer_group,
                tables,
                events,
                (size, offset),
            )
            .await?;
            batches += found.batches;
            unequal += found.unequal.len();
            let observed = self.observe(&scratch, tables, Some(found.fates)).await?;
            let judged = self.row("", events, &observed, reference, lookup);
            if offset == 0 {
                row = judged;
            } else {
                row.doubled = row.doubled.max(judged.doubled);
                row.lost = row.lost.max(judged.lost);
                row.violations = row.violations.max(judged.violations);
                row.diverged = row.diverged.zip(judged.diverged).map(|(a, b)| a.max(b));
                row.findings.extend(judged.findings);
            }
            for batch in found.unequal.iter().take(SHOWN.saturating_sub(shown)) {
                let named: Vec<&str> = batch.batch.iter().take(8).map(String::as_str).collect();
                let more = if batch.batch.len() > named.len() {
                    ", …"
                } else {
                    ""
                };
                row.findings.push(format!(
                    "{} (a batch of {}: {}{more})",
                    batch.how,
                    batch.batch.len(),
                    named.join(", ")
                ));
                if let Some((alone, whole)) = &batch.rows {
                    let mut differences = state::differences(alone, whole);
                    lookup.name(&mut differences, SHOWN);
                    let rows = differences
                        .iter()
                        .map(|difference| format!("one at a time vs whole: {difference}"))
                        .collect();
                    row.findings.extend(first_few(rows, "rows", "  "));
                }
            }
            shown += found.unequal.len().min(SHOWN.saturating_sub(shown));
        }
        if unequal > shown {
            row.findings
                .push(format!("… and {} more batches", unequal - shown));
        }
        row.name = format!("batch equivalence ({batches} batches of {size}, two cuts)");
        row.diverged = Some(row.diverged.unwrap_or(0) + unequal);
        row.seconds = started.elapsed().as_secs_f64();
        Ok(row)
    }

    /// One run on the real worker, judged.
    async fn worker_run(
        &self,
        rig: &Rig<'_, F>,
        plan: &Plan,
        events: &[&Event<G::Event>],
        tables: &Tables,
        reference: Option<&Observed>,
        lookup: &Lookup<'_>,
    ) -> Result<RunReport, CheckError> {
        let started = Instant::now();
        let pool_size = 2;
        let scratch = self.scratch(&plan.slug, pool_size).await?;
        let ran = rig.run(plan, &scratch).await;
        let mut row = match ran {
            Ok(ran) => {
                let observed = self.observe(&scratch, tables, None).await?;
                let mut row = self.row(&plan.name, events, &observed, reference, lookup);
                row.duplicates = Some(ran.duplicates);
                row.strikes = Some(ran.strikes);
                if ran.retried > 0 && plan.fault != runs::Fault::CutDatabase {
                    let (count, verb) = match ran.retried {
                        1 => ("1 transaction".to_owned(), "was"),
                        n => (format!("{n} transactions"), "were"),
                    };
                    row.findings.push(format!(
                        "note: {count} {verb} refused by the database for a while and ran again \
                         (a deadlock or a lock timeout): right, but slow; lock the rows a batch \
                         touches in a stable order"
                    ));
                }
                row
            }
            // A run that did not settle is a finding, not the end of the check.
            Err(CheckError::Failed(error)) => RunReport {
                name: plan.name.clone(),
                events: events.len(),
                error: Some(error.to_string()),
                ..RunReport::default()
            },
            Err(error) => return Err(error),
        };
        row.seconds = started.elapsed().as_secs_f64();
        Ok(row)
    }
}

/// The file's events, decoded as the worker decodes them; the valid ones
/// once each, in the order of their first copy.
fn decode<H: Handler>(handler: &H, bodies: &[Vec<u8>]) -> Decoded<H::Event> {
    let mut seen = HashMap::new();
    let mut decoded = Decoded {
        events: Vec::new(),
        invalid: 0,
    };
    for body in bodies {
        match crate::worker::decode(handler, body, WorkerConfig::DEFAULT_MAX_BODY_BYTES) {
            Ok(event) => {
                let id = handler.event_id(&event).to_owned();
                if seen.insert(id.clone(), ()).is_none() {
                    decoded.events.push(Event {
                        id,
                        event,
                        body: body.clone(),
                    });
                }
            }
            Err(_) => decoded.invalid += 1,
        }
    }
    decoded
}

/// Which of `ids` idem applied (their consume records) and which it
/// dead-lettered (the dead-letter index), with the last error.
pub(crate) async fn fates_of(
    client: &impl GenericClient,
    consumer_group: &str,
    ids: &[&str],
) -> Result<Fates, CheckError> {
    let read =
        |error: tokio_postgres::Error| CheckError::database("reading a run's accounts", &error);
    let applied = crate::store::recorded(client, consumer_group, ids)
        .await
        .map_err(read)?;
    let dead = client
        .query(
            "SELECT event_id::text, coalesce(last_error, reason) FROM mq_dead_letter \
             WHERE consumer_group = $1 AND event_id = ANY($2::text[])",
            &[&consumer_group, &ids],
        )
        .await
        .map_err(read)?;
    let mut fates = Fates {
        applied: applied.into_iter().collect(),
        dead: BTreeMap::new(),
    };
    for row in dead {
        let id: String = row.get(0);
        if !fates.applied.contains(&id) {
            fates.dead.insert(id, row.get(1));
        }
    }
    Ok(fates)
}

/// The first [`SHOWN`] of `items` (each after `indent`), then how many
/// more `what` there are.
fn first_few(items: Vec<String>, what: &str, indent: &str) -> Vec<String> {
    let more = items.len().saturating_sub(SHOWN);
    let mut few: Vec<String> = items
        .into_iter()
        .take(SHOWN)
        .map(|item| format!("{indent}{item}"))
        .collect();
    if more > 0 {
        few.push(format!("{indent}… and {more} more {what}"));
    }
    few
}

/// The events applied in one and dead-lettered in the other.
fn fate_differences(expected: &Fates, found: &Fates) -> Vec<String> {
    let mut differences = Vec::new();
    for (id, error) in &found.dead {
        if expected.applied.contains(id) {
            differences.push(format!(
                "{id}: applied in the reference, dead-lettered here ({error})"
            ));
        }
    }
    for (id, error) in &expected.dead {
        if found.applied.contains(id) {
            differences.push(format!(
                "{id}: dead-lettered in the reference ({error}), applied here"
            ));
        }
    }
    differences
}

/// An invariant as a query of one JSON text column per row it returns.
fn invariant_query(sql: &str) -> String {
    let sql = sql.trim().trim_end_matches(';');
    format!("SELECT to_jsonb(violation)::text FROM ({sql}) violation")
}

/// What the witness counts for each of `ids`, in their order: one
/// statement, its executions sent without waiting for each answer.
async fn witness_counts(
    client: &impl GenericClient,
    witness: &str,
    ids: &[&str],
) -> Result<Vec<i64>, String> {
    let statement = client
        .prepare(witness)
        .await
        .map_err(|error| crate::store::describe(&error))?;
    futures::stream::iter(ids)
        .map(|id| {
            let statement = &statement;
            async move {
                let row = client
                    .query_one(statement, &[id])
                    .await
                    .map_err(|error| crate::store::describe(&error))?;
                count_of(&row)
            }
        })
        .buffered(64)
        .try_collect()
        .await
}

/// The count a witness returned.
fn count_of(row: &tokio_postgres::Row) -> Result<i64, String> {
    row.try_get::<_, i64>(0)
        .or_else(|_| row.try_get::<_, i32>(0).map(i64::from))
        .map_err(|_| "it must return one row of one integer (count(*), say)".to_owned())
}

/// What the witness counts for `event_id`.
async fn witness_count(
    client: &impl GenericClient,
    witness: &str,
    event_id: &str,
) -> Result<i64, String> {
    let row = client
        .query_one(witness, &[&event_id])
        .await
        .map_err(|error| crate::store::describe(&error))?;
    count_of(&row)
}
