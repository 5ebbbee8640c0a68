//! Filters of the closed epochs: a claim looks into a closed epoch only for
//! the events whose digest its filter may hold. A closed epoch no longer
//! changes, so its filter, built once, stays true; the first worker to need
//! it builds it and stores it beside the epoch (`mq_consume_filter`), the
//! others load it.

use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Instant, SystemTime};

use futures::TryStreamExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use sbbf_rs_safe::Filter;
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;
use uuid::Uuid;

use super::StoreError;

/// Bits of filter a record: Parquet's split-block filter then holds about
/// one event in 28,000 it was not built with (measured: 0.0036 %; 0.017 %
/// with 24 bits, 0.13 % with 16), and a claim looks that one up for
/// nothing: a random read of an index and of a heap that are seldom in
/// memory, which is what sets this (docs/guide/performance.md).
pub const BITS_PER_RECORD: usize = 32;

/// Key of the advisory lock that lets one worker at a time build an
/// epoch's filter: "idmf" in ASCII, and the epoch.
const BUILDER_LOCK: &str = "SELECT pg_try_advisory_xact_lock(x'69646d66'::integer, $1)";

/// One closed epoch's filter.
struct EpochFilter {
    epoch: i32,
    /// When the epoch was closed (the next one opened): a database
    /// restored from before then has another epoch of that number, closed
    /// at another moment, which this filter does not cover.
    closed_at: SystemTime,
    bits: Filter,
}

impl EpochFilter {
    fn bytes(&self) -> usize {
        self.bits.as_bytes().len()
    }
}

/// What a sync found, replaced whole: a claim reads the filters and the
/// current epoch of one sync.
#[derive(Default)]
struct Held {
    /// The filters held, oldest epoch first.
    filters: Vec<Arc<EpochFilter>>,
    /// The current epoch, when these filters cover every closed epoch
    /// keyed by digest and no epoch is keyed by text: a claim of an event
    /// none of them may hold can insert straight into it.
    straight: Option<i32>,
    /// The current epoch when every epoch is keyed by digest: what a claim
    /// puts in goes there or into a later one, where it can be found by
    /// its digest.
    by_digest_from: Option<i32>,
}

/// The filters a store's claims consult, shared by the transactions in
/// flight and replaced whole by [`Filters::sync`].
#[derive(Default)]
pub struct Filters {
    held: RwLock<Arc<Held>>,
    counters: EpochCounters,
}

impl std::fmt::Debug for Filters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Filters")
            .field("epochs", &self.epochs())
            .finish()
    }
}

/// What the epochs' upkeep saw and the filters did, for the worker's
/// metrics.
#[derive(Debug, Clone, Default)]
pub struct EpochCounters {
    /// Records the current epoch has taken, as last seen.
    pub current_records: Gauge,
    /// Closed epochs whose filter is held.
    pub filtered: Gauge,
    /// The memory they take.
    pub bytes: Gauge,
    /// Closed epochs keyed by digest that no filter covers: every event of
    /// every claim is looked up there.
    pub unfiltered: Gauge,
    /// Lookups in a closed epoch that a filter asked for (its events that
    /// were in the epoch, and the false positives).
    pub lookups: Counter,
    /// Events claimed straight into the current epoch, without
    /// `mq_claim`: a first delivery of one event none of the filters may
    /// hold, when they cover every closed epoch.
    pub straight: Counter,
}

/// What a claim learned from the filters: the closed epochs they cover
/// and when each was closed, and the pairs (a 1-based position among the
/// claim's event ids, an epoch whose filter may hold that event):
/// `mq_claim`'s last four arguments.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Consulted {
    pub(super) filtered: Vec<i32>,
    pub(super) closed_at: Vec<SystemTime>,
    pub(super) suspect_at: Vec<i32>,
    pub(super) suspect_epoch: Vec<i32>,
    /// The epoch the claim may insert straight into, without `mq_claim`:
    /// the filters cover every closed epoch and none may hold any of the
    /// events. Its partition refuses the insert if it is closed since
    /// (migration 0012).
    pub(super) straight: Option<i32>,
    /// The earliest epoch the claim's records can go into, when every
    /// epoch is keyed by digest: where a flush looks for them.
    pub(super) by_digest_from: Option<i32>,
}

/// What a pass of [`Filters::sync`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FilterSync {
    /// Epochs whose stored filter was loaded.
    pub loaded: Vec<i32>,
    /// Epochs whose filter this pass built and stored.
    pub built: Vec<i32>,
    /// Epochs whose filter was let go: the epoch is gone.
    pub dropped: Vec<i32>,
    /// Closed epochs left without a filter: past the memory allowed, or
    /// being built by another worker, or not built in this pass.
    pub unfiltered: Vec<i32>,
    /// Those of them past the memory allowed.
    pub over_memory: Vec<i32>,
    /// The memory the filters held now take.
    pub bytes: usize,
}

/// A filter's hash of a digest: its first 8 bytes (a digest is already
/// uniform: nothing to mix).
fn hash(digest: &Uuid) -> u64 {
    let mut first = [0; 8];
    first.copy_from_slice(&digest.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

/// The filter of these hashes.
fn filter_of(hashes: &[u64]) -> Filter {
    let mut bits = Filter::new(BITS_PER_RECORD, hashes.len().max(1));
    for hash in hashes {
        bits.insert_hash(*hash);
    }
    bits
}

impl Filters {
    /// No filter yet, counting into `counters`.
    pub fn new(counters: EpochCounters) -> Self {
        Self {
            held: RwLock::default(),
            counters,
        }
    }

    /// What the filters count into: the worker's metrics.
    pub fn counters(&self) -> &EpochCounters {
        &self.counters
    }

    /// The epochs whose filter is held, oldest first.
    pub fn epochs(&self) -> Vec<i32> {
        self.held()
            .filters
            .iter()
            .map(|filter| filter.epoch)
            .collect()
    }

    /// The memory the filters held take.
    pub fn bytes(&self) -> usize {
        self.held()
            .filters
            .iter()
            .map(|filter| filter.bytes())
            .sum()
    }

    fn held(&self) -> Arc<Held> {
        // A panic elsewhere cannot leave the Arc half-replaced.
        Arc::clone(&self.held.read().unwrap_or_else(PoisonError::into_inner))
    }

    fn hold(&self, held: Held) {
        self.counters.filtered.set(held.filters.len() as i64);
        self.counters.bytes.set(
            held.filters
                .iter()
                .map(|filter| filter.bytes())
                .sum::<usize>() as i64,
        );
        *self.held.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(held);
    }

    /// Counts an event claimed straight into the current epoch.
    pub(super) fn went_straight(&self) {
        self.counters.straight.inc();
    }

    /// Claims insert through `mq_claim` until the next sync: the epoch they
    /// were told was current is closed.
    pub(super) fn not_straight(&self) {
        let mut held = self.held.write().unwrap_or_else(PoisonError::into_inner);
        if held.straight.is_some() {
            *held = Arc::new(Held {
                filters: held.filters.clone(),
                straight: None,
                by_digest_from: held.by_digest_from,
            });
        }
    }

    /// Which held filters may hold each of `digests`.
    pub(super) fn consult(&self, digests: &[Uuid]) -> Consulted {
        let held = self.held();
        let mut consulted = Consulted {
            filtered: held.filters.iter().map(|filter| filter.epoch).collect(),
            closed_at: held.filters.iter().map(|filter| filter.closed_at).collect(),
            ..Consulted::default()
        };
        for (at, digest) in (1..).zip(digests) {
            let hash = hash(digest);
            for filter in held.filters.iter() {
                if filter.bits.contains_hash(hash) {
                    consulted.suspect_at.push(at);
                    consulted.suspect_epoch.push(filter.epoch);
                }
            }
        }
        self.counters
            .lookups
            .inc_by(consulted.suspect_at.len() as u64);
        if consulted.suspect_at.is_empty() {
            consulted.straight = held.straight;
        }
        consulted.by_digest_from = held.by_digest_from;
        consulted
    }

    /// Brings the filters held in line with the closed epochs: lets go of
    /// those of epochs dropped, loads the stored ones of the others, newest
    /// first, and with `build` builds and stores those nobody has built
    /// (unless another worker is at it), for at most `memory` bytes in all.
    /// A closed epoch left without a filter is looked into for every event,
    /// as a claim without filters does.
    pub async fn sync(
        &self,
        client: &mut Client,
        memory: usize,
        build: bool,
    ) -> Result<FilterSync, StoreError> {
        let Epochs {
            closed,
            current,
            by_text,
        } = epochs(client).await?;
        let mut synced = FilterSync::default();
        let mut kept = Vec::new();
        for filter in self.held().filters.iter() {
            if closed.iter().any(|epoch| epoch.is(filter)) {
                kept.push(Arc::clone(filter));
            } else {
                synced.dropped.push(filter.epoch);
            }
        }
        let mut bytes: usize = kept.iter().map(|filter| filter.bytes()).sum();
        let stored = stored_sizes(client).await?;
        for epoch in closed.iter().rev() {
            if kept.iter().any(|filter| filter.epoch == epoch.epoch) {
                continue;
            }
            let size = stored
                .iter()
                .find(|(stored, _)| *stored == epoch.epoch)
                .map(|(_, size)| *size);
            let expected = size.unwrap_or_else(|| filter_bytes(epoch.records));
            if bytes + expected > memory {
                synced.unfiltered.push(epoch.epoch);
                synced.over_memory.push(epoch.epoch);
                continue;
            }
            let filter = match size {
                Some(_) => load(client, epoch).await?,
                None if build => build_and_store(client, epoch).await?,
                None => None,
            };
            match filter {
                Some(filter) => {
                    bytes += filter.bytes();
                    if size.is_some() {
                        synced.loaded.push(epoch.epoch);
                    } else {
                        synced.built.push(epoch.epoch);
                    }
                    kept.push(Arc::new(filter));
                }
                None => synced.unfiltered.push(epoch.epoch),
            }
        }
        kept.sort_by_key(|filter| filter.epoch);
        synced.bytes = bytes;
        self.counters.unfiltered.set(synced.unfiltered.len() as i64);
        let straight = current.filter(|_| !by_text && synced.unfiltered.is_empty());
        self.hold(Held {
            filters: kept,
            straight,
            by_digest_from: current.filter(|_| !by_text),
        });
        Ok(synced)
    }
}

/// The memory a filter of `records` records takes.
pub fn filter_bytes(records: i64) -> usize {
    usize::try_from(records).unwrap_or(0).max(1) * BITS_PER_RECORD / 8
}

/// A closed epoch keyed by digest, when it was closed, and about how many
/// records it holds.
struct ClosedEpoch {
    epoch: i32,
    closed_at: SystemTime,
    records: i64,
}

impl ClosedEpoch {
    /// Whether `filter` is this epoch's.
    fn is(&self, filter: &EpochFilter) -> bool {
        (filter.epoch, filter.closed_at) == (self.epoch, self.closed_at)
    }
}

/// The epochs, as a sync reads them.
struct Epochs {
    /// The closed epochs keyed by digest, oldest first.
    closed: Vec<ClosedEpoch>,
    /// The current one.
    current: Option<i32>,
    /// Whether an epoch is keyed by text (from before migration 0006).
    by_text: bool,
}

/// The closed epochs keyed by digest, oldest first, each with when the
/// next one opened and the records it took until then (the id sequence's
/// progress); the current epoch, and whether any is keyed by text.
async fn epochs(client: &Client) -> Result<Epochs, StoreError> {
    let rows = client
        .query(
            "SELECT epoch, by_digest, closed_at, next_first - first_id FROM (\
                 SELECT epoch, by_digest, first_id, \
                        lead(opened_at) OVER (ORDER BY epoch) AS closed_at, \
                        lead(first_id) OVER (ORDER BY epoch) AS next_first \
                 FROM mq_consume_epoch) AS epochs \
             ORDER BY epoch",
            &[],
        )
        .await?;
    let mut epochs = Epochs {
        closed: Vec::new(),
        current: None,
        by_text: false,
    };
    for row in &rows {
        let epoch: i32 = row.try_get(0)?;
        let by_digest: bool = row.try_get(1)?;
        epochs.by_text |= !by_digest;
        match row.try_get::<_, Option<SystemTime>>(2)? {
            None => epochs.current = Some(epoch),
            Some(closed_at) if by_digest => epochs.closed.push(ClosedEpoch {
                epoch,
                closed_at,
                records: row.try_get(3)?,
            }),
            Some(_) => {}
        }
    }
    Ok(epochs)
}

/// The epochs whose filter is stored, and its size.
async fn stored_sizes(client: &Client) -> Result<Vec<(i32, usize)>, StoreError> {
    let rows = client
        .query(
            "SELECT epoch, octet_length(filter) FROM mq_consume_filter",
            &[],
        )
        .await?;
    rows.iter()
        .map(|row| {
            let size: i32 = row.try_get(1)?;
            Ok((row.try_get(0)?, usize::try_from(size).unwrap_or(0)))
        })
        .collect()
}

/// The stored filter of `closed`; `None` if it is not (or no longer)
/// there, or not one this idem reads.
async fn load(client: &Client, closed: &ClosedEpoch) -> Result<Option<EpochFilter>, StoreError> {
    let row = client
        .query_opt(
            "SELECT filter FROM mq_consume_filter WHERE epoch = $1",
            &[&closed.epoch],
        )
        .await?;
    let Some(row) = row else { return Ok(None) };
    let bytes: &[u8] = row.try_get(0)?;
    Ok(Filter::from_bytes(bytes).map(|bits| EpochFilter {
        epoch: closed.epoch,
        closed_at: closed.closed_at,
        bits,
    }))
}

/// Builds the filter of closed epoch `epoch` from its records and stores
/// it, unless another worker is building it (`None`). The epoch must be
/// closed: its records are read once every claim that could write them
/// has ended.
async fn build_and_store(
    client: &mut Client,
    closed: &ClosedEpoch,
) -> Result<Option<EpochFilter>, StoreError> {
    let epoch = closed.epoch;
    let started = Instant::now();
    let tx = client.transaction().await?;
    let building: bool = tx.query_one(BUILDER_LOCK, &[&epoch]).await?.try_get(0)?;
    if !building {
        return Ok(None);
    }
    // Built meanwhile by the worker that held the lock before.
    if tx
        .query_opt("SELECT FROM mq_consume_filter WHERE epoch = $1", &[&epoch])
        .await?
        .is_some()
    {
        drop(tx);
        return load(client, closed).await;
    }
    let rows = tx
        .query_raw(
            &format!("SELECT digest FROM mq_consume_record_{epoch}"),
            std::iter::empty::<i32>(),
        )
        .await?;
    let mut rows = std::pin::pin!(rows);
    let mut hashes = Vec::new();
    while let Some(row) = rows.try_next().await? {
        hashes.push(hash(&row.try_get(0)?));
    }
    let bits = filter_of(&hashes);
    let stored = tx
        .execute(
            "INSERT INTO mq_consume_filter (epoch, records, filter) VALUES ($1, $2, $3) \
             ON CONFLICT (epoch) DO NOTHING",
            &[&epoch, &(hashes.len() as i64), &bits.as_bytes()],
        )
        .await;
    match stored {
        Ok(_) => tx.commit().await?,
        // The epoch was dropped meanwhile: nothing to filter.
        Err(error) if error.code() == Some(&SqlState::FOREIGN_KEY_VIOLATION) => return Ok(None),
        Err(error) => return Err(error.into()),
    }
    tracing::info!(
        epoch,
        records = hashes.len(),
        bytes = bits.as_bytes().len(),
        millis = started.elapsed().as_millis() as u64,
        "built the filter of a closed epoch"
    );
    Ok(Some(EpochFilter {
        epoch,
        closed_at: closed.closed_at,
        bits,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::claim::digest;

    #[test]
    fn a_filter_holds_every_record_and_about_one_other_event_in_28_000() {
        let hashes = |ids: std::ops::Range<u32>| -> Vec<u64> {
            ids.map(|i| hash(&digest("group", &format!("event-{i}"))))
                .collect()
        };
        let records = hashes(0..100_000);
        let filter = filter_of(&records);
        assert_eq!(filter.as_bytes().len(), filter_bytes(100_000));
        assert!(records.iter().all(|hash| filter.contains_hash(*hash)));
        let others = hashes(100_000..1_100_000);
        let held = others
            .iter()
            .filter(|hash| filter.contains_hash(**hash))
            .count();
        // 0.0036 % measured on 4 million records: about 36 of a million;
        // 24 bits a record held 144.
        assert!(held <= 100, "{held} of a million other events held");
    }
}
