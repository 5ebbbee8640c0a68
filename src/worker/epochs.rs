//! The consume records' epochs while the worker runs: the filters of the
//! closed ones held (loaded, or built once an epoch closes), and the next
//! epoch opened once the current one is full, so that the index claims
//! insert into stays small.

use std::time::Duration;

use deadpool_postgres::Pool;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::store::filter::{FilterSync, filter_bytes};
use crate::store::{DatabaseConfig, Store, StoreError, retention};

/// How the worker keeps the epochs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpochSettings {
    /// Open the next epoch once the current one has taken this many
    /// records; `None`: only the retention opens epochs, by age. Opened
    /// only while the closed epochs' filters, that one's included, fit in
    /// `filter_memory`.
    pub max_records: Option<u64>,
    /// Most memory the closed epochs' filters take in this worker; the
    /// epochs past it (the oldest) are looked into for every event.
    pub filter_memory: usize,
    /// How often to look.
    pub interval: Duration,
}

impl EpochSettings {
    /// Records an epoch takes unless said otherwise: its digest index, 30
    /// to 37 MB a million records, then stays near PostgreSQL's default
    /// `shared_buffers` (128 MB) (docs/guide/performance.md).
    pub const DEFAULT_MAX_RECORDS: u64 = 4_000_000;
    /// Filters held unless said otherwise: 4 bytes a record, so about
    /// 130 million records of closed epochs.
    pub const DEFAULT_FILTER_MEMORY: usize = 512 << 20;
    /// How often the epochs are looked at unless said otherwise.
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);
}

impl Default for EpochSettings {
    fn default() -> Self {
        Self {
            max_records: Some(Self::DEFAULT_MAX_RECORDS),
            filter_memory: Self::DEFAULT_FILTER_MEMORY,
            interval: Self::DEFAULT_INTERVAL,
        }
    }
}

/// How long the keeper's statements may wait for a lock: opening an epoch
/// waits for the claims in flight, and the claims that come meanwhile wait
/// behind it. Past it, the opening is left to the next pass.
const LOCK_TIMEOUT: Duration = Duration::from_secs(2);
/// How long building a filter may read: a whole epoch.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(600);

/// The keeper's own connection: it holds one for seconds while it builds
/// a filter, which the worker's transactions must not wait for.
pub(super) fn pool(database: &DatabaseConfig) -> Result<Pool, crate::store::ConfigError> {
    DatabaseConfig {
        pool_size: 1,
        lock_timeout: LOCK_TIMEOUT,
        statement_timeout: STATEMENT_TIMEOUT,
        ..database.clone()
    }
    .pool()
}

/// Loads the stored filters of the closed epochs, building none: what a
/// worker does before it consumes, so that its first claims do not look
/// into every closed epoch. A failure is logged: the keeper tries again.
pub(super) async fn load(store: &Store, pool: &Pool, settings: &EpochSettings) {
    let loaded = async {
        let mut client = pool.get().await?;
        store
            .filters()
            .sync(&mut client, settings.filter_memory, false)
            .await
    }
    .await;
    match loaded {
        Ok(synced) => report(&synced),
        Err(error) => warn!(%error, "could not load the filters of the closed epochs; retrying"),
    }
}

/// Keeps the epochs every `settings.interval` until `shutdown`. A pass that
/// fails is logged and the next one tries again: claims stay exact without
/// filters, only slower.
pub(super) async fn keep(
    store: Store,
    pool: Pool,
    settings: EpochSettings,
    shutdown: CancellationToken,
) {
    let mut over_memory = Vec::new();
    let mut failing = false;
    loop {
        match pass(&store, &pool, &settings).await {
            Ok(synced) => {
                if std::mem::take(&mut failing) {
                    info!("keeping the epochs again");
                }
                if synced.over_memory != over_memory && !synced.over_memory.is_empty() {
                    warn!(
                        epochs = ?synced.over_memory,
                        "closed epochs without a filter, past the memory allowed: every event \
                         is looked up in each; a retention, or more filter memory, spares that"
                    );
                }
                over_memory = synced.over_memory;
            }
            // Once per outage: the worker says the rest.
            Err(error) if !std::mem::replace(&mut failing, true) => {
                warn!(%error, "keeping the epochs failed; trying again every {}", crate::duration::format(settings.interval));
            }
            Err(error) => tracing::debug!(%error, "keeping the epochs failed again"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(settings.interval) => {}
        }
    }
}

/// Syncs the filters, building the missing ones, and opens the next epoch
/// if the current one is full (then builds the filter of the one it
/// closed). Returns the last sync.
async fn pass(
    store: &Store,
    pool: &Pool,
    settings: &EpochSettings,
) -> Result<FilterSync, StoreError> {
    let mut client = pool.get().await?;
    let synced = store
        .filters()
        .sync(&mut client, settings.filter_memory, true)
        .await?;
    report(&synced);
    let taken = retention::current_records(&client).await?;
    store.filters().counters().current_records.set(taken);
    let Some(max_records) = settings.max_records else {
        return Ok(synced);
    };
    // A closed epoch without a filter costs every claim a lookup, more than
    // a large current epoch does: none is closed by size that would be left
    // without one.
    let records = i64::try_from(max_records).unwrap_or(i64::MAX);
    if taken < records
        || !synced.unfiltered.is_empty()
        || synced.bytes + filter_bytes(records) > settings.filter_memory
    {
        return Ok(synced);
    }
    let Some(opened) =
        retention::unless_locked(retention::rotate(&client, records).await)?.flatten()
    else {
        return Ok(synced);
    };
    info!(
        epoch = opened,
        "opened epoch {opened} of the consume records: the one before had taken {taken} records"
    );
    let synced = store
        .filters()
        .sync(&mut client, settings.filter_memory, true)
        .await?;
    report(&synced);
    Ok(synced)
}

/// One line for what a sync changed.
fn report(synced: &FilterSync) {
    if !(synced.loaded.is_empty() && synced.built.is_empty() && synced.dropped.is_empty()) {
        info!(
            loaded = ?synced.loaded,
            built = ?synced.built,
            dropped = ?synced.dropped,
            unfiltered = ?synced.unfiltered,
            bytes = synced.bytes,
            "filters of the closed epochs: {:.1} MiB held",
            synced.bytes as f64 / f64::from(1 << 20)
        );
    }
}
