//! What every test of the library needs: the servers (from
//! `IDEM_TEST_DATABASE_URL` and `IDEM_TEST_AMQP_URL`, as the points suite
//! reads them), a schema and queues of the test's own, removed at its end
//! however it ends, a worker run on a cancellation token, and waiting on a
//! condition with a deadline a slow host can stretch (`IDEM_TEST_SLACK`).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use idem::tokio_postgres::NoTls;
use idem::worker::{Snapshot, Stats, WorkerError};
use idem::{
    AmqpConfig, DatabaseConfig, Handler, SecretUrl, Topology, Worker, WorkerConfig, migrate,
};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Where PostgreSQL is, for a role that may create schemas.
pub fn database_url() -> String {
    std::env::var("IDEM_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// Where RabbitMQ is.
pub fn amqp_url() -> String {
    std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// A deadline that was right on a quiet machine, stretched by
/// `IDEM_TEST_SLACK`.
pub fn patient(deadline: Duration) -> Duration {
    let slack = std::env::var("IDEM_TEST_SLACK")
        .ok()
        .and_then(|factor| factor.parse::<f64>().ok())
        .filter(|factor| factor.is_finite() && *factor >= 1.0)
        .unwrap_or(1.0);
    deadline.mul_f64(slack)
}

/// Polls `condition` until it holds, failing after `patient(timeout)`.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut condition: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    let timeout = patient(timeout);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if condition()
            .await
            .with_context(|| format!("waiting for {what}"))?
        {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A name no other test (of this run or another) has: the process's id
/// and a counter. Schemas start with `idemlib_`, queues with `idemlib-`.
fn unique_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "idemlib_p{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A test's own schema, migrated for `H`, and its own topology, declared.
pub struct Env {
    pub schema: String,
    pub database: DatabaseConfig,
    pub pool: idem::deadpool_postgres::Pool,
    pub amqp: AmqpConfig,
    pub topology: Topology,
    pub connection: Connection,
}

impl Env {
    /// A schema migrated for `H` and `topology` under names of the test's
    /// own, declared. Sweeps what earlier runs that died left first.
    pub async fn new<H: Handler>(topology: Topology) -> anyhow::Result<Self> {
        sweep_dead_runs().await?;
        let schema = unique_name();
        let database = DatabaseConfig::new(SecretUrl::new(database_url())).with_schema(&schema);
        let pool = database.pool()?;
        migrate::run::<H>(&pool, Some(&schema)).await?;
        let topology = Topology {
            quorum_size: 1,
            ..topology.prefixed(&format!("{}.", schema.replace('_', "-")))
        };
        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
        if let Err(error) = topology.declare(&connection).await {
            // What it declared before it failed goes, and so does the
            // schema, on a connection of its own: the broker may have closed
            // this one over the failure.
            drop(pool);
            drop_schema(&schema).await?;
            // Best effort: the error to report is the declare's.
            let cleanup = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
            let _ = topology.delete(&cleanup.create_channel().await?).await;
            let _ = cleanup.close(200, "OK".into()).await;
            return Err(error.into());
        }
        Ok(Self {
            schema,
            database,
            pool,
            amqp: AmqpConfig::new(SecretUrl::new(amqp_url())),
            topology,
            connection,
        })
    }

    /// A worker of `group` on this test's schema and topology, in `mode`.
    pub fn worker_config(&self, mode: idem::Mode, group: &str) -> WorkerConfig {
        let mut config = WorkerConfig::in_mode(
            mode,
            self.amqp.clone(),
            self.database.clone(),
            self.topology.clone(),
            group,
        );
        config.summary_interval = Duration::ZERO;
        config.startup_timeout = patient(Duration::from_secs(30));
        config
    }

    /// Publishes `bodies` to the topology's exchange, each confirmed.
    pub async fn publish(&self, bodies: &[Vec<u8>]) -> anyhow::Result<()> {
        let plain: Vec<(Vec<u8>, Option<String>)> =
            bodies.iter().map(|body| (body.clone(), None)).collect();
        self.publish_keyed(&plain).await
    }

    /// Publishes each body to the topology's exchange, confirmed, with its
    /// ordering key in the header an ordered queue routes by, when it has
    /// one.
    pub async fn publish_keyed(
        &self,
        messages: &[(Vec<u8>, Option<String>)],
    ) -> anyhow::Result<()> {
        let bodies: Vec<(&Vec<u8>, BasicProperties)> = messages
            .iter()
            .map(|(body, key)| {
                let mut headers = FieldTable::default();
                if let Some(key) = key {
                    headers.insert(
                        idem::handler::ORDERING_KEY_HEADER.into(),
                        lapin::types::AMQPValue::LongString(key.as_str().into()),
                    );
                }
                (
                    body,
                    BasicProperties::default()
                        .with_delivery_mode(2)
                        .with_headers(headers),
                )
            })
            .collect();
        let channel = self.connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let mut confirms = Vec::with_capacity(bodies.len());
        for (body, properties) in bodies {
            confirms.push(
                channel
                    .basic_publish(
                        self.topology.exchange.as_str().into(),
                        self.topology.routing_key.as_str().into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        body,
                        properties,
                    )
                    .await?,
            );
        }
        for confirm in confirms {
            let confirmation = confirm.await?;
            if !confirmation.is_ack() || confirmation.take_message().is_some() {
                bail!("a test event was nacked or returned");
            }
        }
        channel.close(200, "OK".into()).await?;
        Ok(())
    }

    /// Messages ready in `queue`.
    pub async fn ready(&self, queue: &str) -> anyhow::Result<u32> {
        let channel = self.connection.create_channel().await?;
        let declared = channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        channel.close(200, "OK".into()).await?;
        Ok(declared.message_count())
    }

    /// The single number `sql` returns, in this test's schema.
    pub async fn number(&self, sql: &str) -> anyhow::Result<i64> {
        let client = self.pool.get().await?;
        Ok(client.query_one(sql, &[]).await?.get(0))
    }

    /// An exchange of the test's own for the handler's messages, and a
    /// queue bound to it that takes them all: (exchange, queue).
    pub fn announced(&self) -> (String, String) {
        let exchange = format!("{}.announced", self.topology.queue);
        let queue = format!("{exchange}.all");
        (exchange, queue)
    }

    /// Declares [`Env::announced`]: a durable topic exchange, and a queue
    /// bound to it with `#`.
    pub async fn declare_announced(&self) -> anyhow::Result<()> {
        let (exchange, queue) = self.announced();
        let channel = self.connection.create_channel().await?;
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                durable,
                FieldTable::default(),
            )
            .await?;
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .queue_declare(queue.as_str().into(), durable, FieldTable::default())
            .await?;
        channel.close(200, "OK".into()).await?;
        self.bind_announced(true).await
    }

    /// Binds [`Env::announced`]'s queue to its exchange with `#`, or
    /// unbinds it: then nothing the exchange gets is routed.
    pub async fn bind_announced(&self, bound: bool) -> anyhow::Result<()> {
        let (exchange, queue) = self.announced();
        let channel = self.connection.create_channel().await?;
        let (queue, exchange) = (queue.as_str().into(), exchange.as_str().into());
        if bound {
            let options = QueueBindOptions::default();
            channel
                .queue_bind(queue, exchange, "#".into(), options, FieldTable::default())
                .await?;
        } else {
            channel
                .queue_unbind(queue, exchange, "#".into(), FieldTable::default())
                .await?;
        }
        channel.close(200, "OK".into()).await?;
        Ok(())
    }

    /// Removes the schema, the queues and the exchanges.
    pub async fn remove(self) -> anyhow::Result<()> {
        let channel = self.connection.create_channel().await?;
        self.topology.delete(&channel).await?;
        let (exchange, queue) = self.announced();
        channel
            .queue_delete(queue.as_str().into(), Default::default())
            .await?;
        channel
            .exchange_delete(exchange.as_str().into(), Default::default())
            .await?;
        channel.close(200, "OK".into()).await?;
        self.connection.close(200, "OK".into()).await?;
        drop_schema(&self.schema).await
    }
}

/// Runs `test` on an [`Env`] for `H` on `topology`, then removes the env,
/// whether the test passed, failed or panicked.
pub async fn with_env<H, F, Fut>(topology: Topology, test: F) -> anyhow::Result<()>
where
    H: Handler,
    F: FnOnce(Arc<Env>) -> Fut,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let env = Arc::new(Env::new::<H>(topology).await?);
    let outcome = tokio::spawn(test(Arc::clone(&env))).await;
    let env = Arc::into_inner(env).context("the test kept its env past its end")?;
    let removed = env.remove().await;
    match outcome {
        Ok(result) => result.and(removed),
        Err(panicked) => std::panic::resume_unwind(panicked.into_panic()),
    }
}

async fn admin() -> anyhow::Result<idem::tokio_postgres::Client> {
    let (client, connection) = idem::tokio_postgres::connect(&database_url(), NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

async fn drop_schema(schema: &str) -> anyhow::Result<()> {
    admin()
        .await?
        .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
        .await?;
    Ok(())
}

/// Drops the schemas of test processes that are gone (killed before they
/// could remove their own).
async fn sweep_dead_runs() -> anyhow::Result<()> {
    let client = admin().await?;
    let rows = client
        .query(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'idemlib\\_p%'",
            &[],
        )
        .await?;
    for row in rows {
        let schema: String = row.get(0);
        let pid = schema
            .strip_prefix("idemlib_p")
            .and_then(|rest| rest.split('_').next())
            .and_then(|pid| pid.parse::<u32>().ok());
        let alive = pid.is_some_and(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists());
        if !alive {
            drop_schema(&schema).await?;
        }
    }
    Ok(())
}

/// A worker running in a task of its own until [`Running::stop`].
pub struct Running {
    pub stats: Arc<Stats>,
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), WorkerError>>,
}

impl Running {
    /// Starts `handler` under `config`.
    /// `IDEM_TEST_LOG` (a filter, `idem=debug` say) shows its log.
    pub fn start<H: Handler>(config: WorkerConfig, handler: H) -> Self {
        if let Ok(filter) = std::env::var("IDEM_TEST_LOG") {
            idem::telemetry::init(&filter, idem::telemetry::LogFormat::Text);
        }
        let worker = Worker::new(config, handler);
        let stats = worker.stats();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(worker.run(shutdown.clone()));
        Self {
            stats,
            shutdown,
            task,
        }
    }

    /// Waits until the worker has settled `deliveries` (applied, duplicate,
    /// invalid or dead-lettered) in all.
    pub async fn settled(&self, deliveries: u64, timeout: Duration) -> anyhow::Result<()> {
        wait_for("the worker to settle its deliveries", timeout, || async {
            if self.task.is_finished() {
                bail!("the worker stopped by itself");
            }
            Ok(self.stats.snapshot().finished() >= deliveries)
        })
        .await
    }

    /// Drains and stops the worker; its error, if it failed, or its final
    /// counts (a running worker counts a delivery after its commit, so a
    /// snapshot taken while it runs may not count one just committed).
    pub async fn stop(self) -> anyhow::Result<Snapshot> {
        self.shutdown.cancel();
        self.task.await??;
        Ok(self.stats.snapshot())
    }
}
