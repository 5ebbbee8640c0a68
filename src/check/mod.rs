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

mod capture;
mod collide;
mod config;
mod events;
mod judge;
mod reference;
mod report;
mod runs;
mod scratch;
mod state;

use std::collections::{BTreeMap, HashMap};

use deadpool_postgres::GenericClient;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use config::{CheckConfig, CheckError};
pub(crate) use events::discarded_body;
pub use events::read as read_events;
pub use report::{CheckReport, RunReport};
pub use state::{Difference, LeftOut, Why};

use crate::broker::{ConnectError, close, connect_with_retry};
use crate::handler::Handler;
use crate::store::{ReadyError, StoreError};
use crate::worker::WorkerConfig;
use reference::{Equivalence, Fates};
use runs::{Plan, Rig, Upstream};
use scratch::Scratch;
use state::{Lookup, State, Tables};

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
    /// The ordering key of each body whose event names one: what the runs
    /// on an ordered queue publish it with.
    keys: HashMap<Vec<u8>, String>,
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

/// The file's events, decoded as the worker decodes them; the valid ones
/// once each, in the order of their first copy.
fn decode<H: Handler>(handler: &H, bodies: &[Vec<u8>]) -> Decoded<H::Event> {
    let mut seen = HashMap::new();
    let mut decoded = Decoded {
        events: Vec::new(),
        invalid: 0,
        keys: HashMap::new(),
    };
    for body in bodies {
        match crate::worker::decode(handler, body, WorkerConfig::DEFAULT_MAX_BODY_BYTES) {
            Ok(event) => {
                if let Some(key) = handler.ordering_key(&event) {
                    decoded.keys.insert(body.clone(), key.to_owned());
                }
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
