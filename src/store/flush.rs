//! Group commit for a worker's claims. A claim of a handler with a tally is
//! one statement; it commits without waiting for its WAL to reach disk
//! (`synchronous_commit = off`, for that transaction alone), on a
//! connection it shares with other claims, and its deliveries are acked
//! only once a flush has found its consume records. One flush stands for
//! every claim that returned before it, and claims sent on one connection
//! without waiting for each other's answers (tokio-postgres pipelines
//! them) cost the server and the worker a good deal less than each on a
//! connection of its own, waiting for its own flush.
//!
//! A flush is one statement on a connection of its own: it reads the
//! consume records of the claims waiting, by digest, and writes a WAL
//! record (a transactional `pg_logical_emit_message`), so that its commit,
//! with the session's `synchronous_commit`, returns only once the WAL up
//! to its own commit record is flushed (and replicated, under synchronous
//! replication). A record it saw committed before it began, so lies before
//! that commit record: on disk once the flush returns. A record it does not
//! see was lost (the server crashed before it reached disk, say), and its
//! claim runs again; so does every claim of a flush that fails. This holds
//! whatever lies between the worker and the server (a proxy that keeps the
//! sessions across a restart, several hosts): the flush looks for the
//! records themselves.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use deadpool_postgres::{Object, Pool};
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio_postgres::error::SqlState;
use tracing::warn;
use uuid::Uuid;

use super::{Standbys, StoreError, describe};

/// The flush: the records of `$1` (digests) in the epochs from `$2` on, and
/// a WAL record in the same transaction. A transaction that wrote no WAL
/// would commit without a flush.
const FLUSH: &str = "\
    WITH flushed AS MATERIALIZED (SELECT pg_logical_emit_message(true, 'idem', '') AS lsn) \
    SELECT record.digest FROM flushed, mq_consume_record AS record \
    WHERE record.epoch >= $2::int AND record.digest = ANY($1::uuid[])";

/// Connections the claims of a handler with a tally share, committing
/// unflushed, and the flushes that find their records. Shared by a
/// worker's claims; the flushes stop once the last clone is dropped.
#[derive(Debug, Clone)]
pub struct Lanes {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    pool: Pool,
    lanes: Vec<Mutex<Option<Arc<Object>>>>,
    next: AtomicUsize,
    flush_pool: Pool,
    requests: mpsc::UnboundedSender<Request>,
    /// The server refused a flush (the function not granted, say): claims
    /// wait for their own flush from then on.
    refused: Arc<AtomicBool>,
}

/// Records a claim put in, waiting to be found by a flush.
struct Request {
    digests: Vec<Uuid>,
    from_epoch: i32,
    found: oneshot::Sender<bool>,
}

impl Lanes {
    /// `lanes` connections of `pool` (a pool of their own, as large) for
    /// the claims, and flushes on a connection of `flush_pool` (of its
    /// own too).
    /// With `standbys`, a flush returns once they have it too.
    pub fn new(
        pool: Pool,
        lanes: usize,
        flush_pool: Pool,
        standbys: Option<Arc<Standbys>>,
    ) -> Self {
        let (requests, received) = mpsc::unbounded_channel();
        let refused = Arc::new(AtomicBool::new(false));
        tokio::spawn(flush_rounds(
            flush_pool.clone(),
            received,
            Arc::clone(&refused),
            standbys,
        ));
        Self {
            inner: Arc::new(Inner {
                pool,
                lanes: (0..lanes.max(1)).map(|_| Mutex::new(None)).collect(),
                next: AtomicUsize::new(0),
                flush_pool,
                requests,
                refused,
            }),
        }
    }

    /// Whether claims may commit unflushed: not once the server refused a
    /// flush.
    pub fn usable(&self) -> bool {
        !self.inner.refused.load(Ordering::Relaxed)
    }

    /// Flushes once, for no claim, before any claim commits unflushed: a
    /// server that refuses the flush is found out before a claim would
    /// need it. (One that refuses it later, its grant revoked meanwhile,
    /// holds the deliveries of the claims waiting for a flush, retried,
    /// until it is granted again.) A flush that fails otherwise is left
    /// to the claims to meet.
    pub async fn check(&self) {
        if let Err(error) = flush(&self.inner.flush_pool, &mut None, &[], 0, None).await {
            refusal(&error, &self.inner.refused);
        }
    }

    /// A connection to send an unflushed claim on, in turn.
    pub(crate) async fn lane(&self) -> Result<Arc<Object>, StoreError> {
        let inner = &self.inner;
        let at = inner.next.fetch_add(1, Ordering::Relaxed) % inner.lanes.len();
        let mut lane = inner.lanes[at].lock().await;
        match &*lane {
            Some(client) if !client.is_closed() => Ok(Arc::clone(client)),
            _ => {
                // Back to the pool first (which lets a closed one go): the
                // pool holds as many connections as there are lanes.
                *lane = None;
                let client = Arc::new(inner.pool.get().await?);
                *lane = Some(Arc::clone(&client));
                Ok(client)
            }
        }
    }

    /// Waits for a flush that begins after this call to look for the
    /// records of `digests`, in epoch `from_epoch` or later. True when it
    /// found them all: they are on disk. False otherwise (one was lost, or
    /// the flush failed): their claims must run again.
    pub(crate) async fn flushed(&self, digests: Vec<Uuid>, from_epoch: i32) -> bool {
        if digests.is_empty() {
            return true;
        }
        let (found, answer) = oneshot::channel();
        let request = Request {
            digests,
            from_epoch,
            found,
        };
        if self.inner.requests.send(request).is_err() {
            return false;
        }
        answer.await.unwrap_or(false)
    }
}

/// Flushes for the claims waiting, a round at a time, each for every
/// claim that asked before it began, on a connection of `pool`.
async fn flush_rounds(
    pool: Pool,
    mut requests: mpsc::UnboundedReceiver<Request>,
    refused: Arc<AtomicBool>,
    standbys: Option<Arc<Standbys>>,
) {
    let mut client = None;
    while let Some(first) = requests.recv().await {
        let mut round = vec![first];
        while let Ok(request) = requests.try_recv() {
            round.push(request);
        }
        let digests: Vec<Uuid> = round
            .iter()
            .flat_map(|request| request.digests.iter().copied())
            .collect();
        let from_epoch = round
            .iter()
            .map(|request| request.from_epoch)
            .min()
            .unwrap_or(0);
        let flushed = flush(
            &pool,
            &mut client,
            &digests,
            from_epoch,
            standbys.as_deref(),
        )
        .await;
        let found = match flushed {
            Ok(found) => found,
            Err(error) => {
                client = None;
                refusal(&error, &refused);
                Vec::new()
            }
        };
        for request in round {
            let all = request
                .digests
                .iter()
                .all(|digest| found.binary_search(digest).is_ok());
            let _ = request.found.send(all);
        }
    }
}

/// Says once that the server refused the flush, when `error` is that.
fn refusal(error: &StoreError, refused: &AtomicBool) {
    if let StoreError::Postgres(error) = error
        && matches!(
            error.code(),
            Some(&SqlState::INSUFFICIENT_PRIVILEGE | &SqlState::UNDEFINED_FUNCTION)
        )
        && !refused.swap(true, Ordering::Relaxed)
    {
        warn!(error = %describe(error), "the server refused idem's flush: claims wait for their own flush from now on");
    }
}

/// One flush on `client` (a connection of `pool` when there is none): the
/// digests of `digests` it found, sorted, once `standbys` (if any) have
/// the flush too.
async fn flush(
    pool: &Pool,
    client: &mut Option<Object>,
    digests: &[Uuid],
    from_epoch: i32,
    standbys: Option<&Standbys>,
) -> Result<Vec<Uuid>, StoreError> {
    let client = match client {
        Some(client) => client,
        None => {
            let connected = pool.get().await?;
            // The flush looks records up by digest, whatever the table's
            // statistics said when its plan was made (the table empty, say,
            // where a scan of it would be the cheaper plan, and then grows).
            connected.batch_execute("SET enable_seqscan = off").await?;
            client.insert(connected)
        }
    };
    let statement = client.prepare_cached(FLUSH).await?;
    let rows = client.query(&statement, &[&digests, &from_epoch]).await?;
    if let Some(standbys) = standbys {
        standbys.have_commits_of(client).await?;
    }
    let mut found = rows
        .iter()
        .map(|row| row.try_get(0))
        .collect::<Result<Vec<Uuid>, _>>()?;
    found.sort_unstable();
    Ok(found)
}
