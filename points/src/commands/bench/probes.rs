//! What a run measures besides its messages: the WAL written, the queues'
//! depth, the servers' and the worker's CPU and memory.

use super::*;

/// Where PostgreSQL's WAL stood before a run.
#[derive(Debug, Clone)]
pub(super) struct Wal {
    /// `pg_current_wal_lsn()`: the bytes written since are the difference.
    pub(super) lsn: String,
    /// `pg_stat_wal.wal_fpi`: full-page images written so far.
    pub(super) fpi: f64,
}

/// Where the WAL stands (PostgreSQL 14 and later, for `pg_stat_wal`);
/// `None` where it cannot be read.
pub(super) async fn wal(client: &tokio_postgres::Client) -> Option<Wal> {
    let row = client
        .query_one(
            "SELECT pg_current_wal_lsn()::text, wal_fpi::float8 FROM pg_stat_wal",
            &[],
        )
        .await
        .ok()?;
    Some(Wal {
        lsn: row.try_get(0).ok()?,
        fpi: row.try_get(1).ok()?,
    })
}

pub(super) async fn wal_lsn(client: &tokio_postgres::Client) -> Option<String> {
    client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .ok()?
        .try_get(0)
        .ok()
}

/// `pg_stat_wal.wal_fpi` once it stops moving: sessions report their WAL
/// statistics when they have been idle a moment, or when they end, not
/// as they write. Gives up waiting after 10 s.
pub(super) async fn settled_fpi(client: &tokio_postgres::Client) -> Option<f64> {
    let read = || async {
        client
            .query_one("SELECT wal_fpi::float8 FROM pg_stat_wal", &[])
            .await
            .ok()?
            .try_get::<_, f64>(0)
            .ok()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = read().await?;
    loop {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let now = read().await?;
        if now == last || Instant::now() > deadline {
            return Some(now);
        }
        last = now;
    }
}

/// Reads queue depths over one channel, so that polling costs the broker
/// next to nothing.
pub(super) struct QueueProbe {
    pub(super) connection: lapin::Connection,
    pub(super) channel: lapin::Channel,
}

impl QueueProbe {
    pub(super) async fn open(amqp: &AmqpConfig) -> anyhow::Result<Self> {
        let connection = connect(amqp, "idem bench probe").await?;
        let channel = connection.create_channel().await?;
        Ok(Self {
            connection,
            channel,
        })
    }

    /// Messages ready in `queue`.
    pub(super) async fn ready(&self, queue: &str) -> anyhow::Result<u32> {
        Ok(ready_messages(&self.channel, queue).await?)
    }

    /// Messages ready in all of `queues` (an ordered queue's slots).
    pub(super) async fn ready_in(&self, queues: &[String]) -> anyhow::Result<u32> {
        let mut ready = 0;
        for queue in queues {
            ready += self.ready(queue).await?;
        }
        Ok(ready)
    }

    pub(super) async fn close(self) {
        close_channel(&self.channel).await;
        close(&self.connection).await;
    }
}

/// CPU time used so far by the local PostgreSQL and RabbitMQ servers (all
/// processes named `postgres`, and `beam.smp`), from `/proc`; zero when
/// they run elsewhere.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct ServiceCpu {
    pub(super) postgres_ticks: u64,
    pub(super) rabbitmq_ticks: u64,
}

impl ServiceCpu {
    pub(super) fn now() -> Self {
        let mut total = Self::default();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return total;
        };
        for entry in entries.flatten() {
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            let Some((head, rest)) = stat.rsplit_once(')') else {
                continue;
            };
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let ticks = |i: usize| {
                fields
                    .get(i)
                    .and_then(|f| f.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            // With the time of children reaped: a backend (or autovacuum
            // worker) that exits during a run leaves its CPU in the
            // postmaster's count instead of taking it away.
            let used = ticks(11) + ticks(12) + ticks(13) + ticks(14);
            if head.ends_with("(postgres") {
                total.postgres_ticks += used;
            } else if head.ends_with("(beam.smp") {
                total.rabbitmq_ticks += used;
            }
        }
        total
    }

    /// Microseconds per message of each server since `earlier`; `None` for
    /// a server not seen on this machine.
    pub(super) fn per_message(&self, earlier: &Self, messages: f64) -> (Option<f64>, Option<f64>) {
        let per = |now: u64, then: u64| {
            (now > 0).then(|| now.saturating_sub(then) as f64 * 10_000.0 / messages)
        };
        (
            per(self.postgres_ticks, earlier.postgres_ticks),
            per(self.rabbitmq_ticks, earlier.rabbitmq_ticks),
        )
    }
}

/// Waits, for at most 20 s, until the local servers are nearly idle: after
/// a load is published, RabbitMQ goes on writing it to disk for a while, and
/// a measurement started then would measure that too.
pub(super) async fn settle_down() {
    const WINDOW: Duration = Duration::from_millis(500);
    // Ticks are 10 ms: under 5 % of a core over the window.
    const QUIET_TICKS: u64 = 2;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut before = ServiceCpu::now();
    while Instant::now() < deadline {
        tokio::time::sleep(WINDOW).await;
        let now = ServiceCpu::now();
        let busy = (now.postgres_ticks + now.rabbitmq_ticks)
            .saturating_sub(before.postgres_ticks + before.rabbitmq_ticks);
        if busy <= QUIET_TICKS {
            return;
        }
        before = now;
    }
}

/// CPU time and peak memory of a process, from `/proc`.
pub(super) struct ProcessUsage {
    pub(super) cpu: Duration,
    pub(super) peak_rss_kib: u64,
}

impl ProcessUsage {
    pub(super) fn read(pid: u32) -> Option<Self> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the command name, which is in parentheses.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let ticks: u64 =
            fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let peak_rss_kib = status
            .lines()
            .find_map(|line| line.strip_prefix("VmHWM:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        // Linux reports CPU time in clock ticks of 1/100 s (USER_HZ).
        Some(Self {
            cpu: Duration::from_millis(ticks * 10),
            peak_rss_kib,
        })
    }
}

pub(super) fn median(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut values: Vec<f64> = values.collect();
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    Some(values[values.len() / 2])
}
