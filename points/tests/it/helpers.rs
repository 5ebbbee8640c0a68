//! What every test needs: its own schema and its own exchanges and queues
//! (named after the test process, so a crashed run's leftovers can be swept),
//! a worker to run, and waiting on conditions instead of sleeping.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Once, OnceLock};
use std::time::Duration;

use anyhow::{Context, bail};
use deadpool_postgres::Pool;
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicQosOptions,
    ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str, utf8_percent_encode};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use url::Url;

use idem::broker::{
    AmqpConfig, Outgoing, PublishOptions, PublishReport, Topology, connect, publish_all,
};
use idem::secret::SecretUrl;
use idem::store::{DatabaseConfig, migrate};
use idem::vars;
use idem::worker::{Mode, Stats, Worker, WorkerConfig, WorkerError};
use idem_points::points::PaymentSucceeded;

/// Where the suite finds its services. The environment says, with defaults
/// for a PostgreSQL and a RabbitMQ on this host as installed:
/// `IDEM_TEST_DATABASE_URL` (a URL whose role may create schemas, databases
/// and roles) and `IDEM_TEST_AMQP_URL` (whose user the suite grants its
/// vhosts to, with `rabbitmqctl`).
struct Services {
    database: Url,
    amqp: Url,
}

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

fn services() -> &'static Services {
    static SERVICES: OnceLock<Services> = OnceLock::new();
    SERVICES.get_or_init(|| Services {
        database: setting("IDEM_TEST_DATABASE_URL", DEFAULT_DATABASE_URL, 5432),
        amqp: setting("IDEM_TEST_AMQP_URL", DEFAULT_AMQP_URL, 5672),
    })
}

/// The URL in `variable`, or `default`; a setting the suite cannot use
/// stops it at once, saying which.
fn setting(variable: &str, default: &str, default_port: u16) -> Url {
    let value = std::env::var(variable).unwrap_or_else(|_| default.to_owned());
    let url = Url::parse(&value)
        .ok()
        .filter(|url| url.host_str().is_some() && url.path().len() > 1);
    let Some(mut url) = url else {
        panic!("{variable} must be a URL with a host and a path (the default is {default})");
    };
    if url.port().is_none() {
        url.set_port(Some(default_port))
            .unwrap_or_else(|()| panic!("{variable}: a URL that cannot take a port"));
    }
    url
}

/// Adds `key=value` to `url`'s query, spaces as `%20` (PostgreSQL's
/// parser does not read `+` as a space).
pub fn append_query(url: &mut Url, key: &str, value: &str) {
    const UNRESERVED: &AsciiSet = &NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    let pair = format!("{key}={}", utf8_percent_encode(value, UNRESERVED));
    let query = match url.query() {
        Some(query) if !query.is_empty() => format!("{query}&{pair}"),
        _ => pair,
    };
    url.set_query(Some(&query));
}

/// `url` changed by `edit`.
fn edited(url: &Url, edit: impl FnOnce(&mut Url)) -> String {
    let mut url = url.clone();
    edit(&mut url);
    url.into()
}

/// `host:port` of `url` (set by [`setting`]).
fn host_port(url: &Url) -> String {
    format!(
        "{}:{}",
        url.host_str().unwrap_or_default(),
        url.port().unwrap_or_default()
    )
}

/// An address of `url`'s server, for a proxy in front of it.
fn address_of(url: &Url) -> SocketAddr {
    let host_port = host_port(url);
    host_port
        .to_socket_addrs()
        .ok()
        .and_then(|mut addresses| addresses.next())
        .unwrap_or_else(|| panic!("cannot resolve {host_port}"))
}

/// The database the tests' schemas live in.
pub fn database_url() -> String {
    services().database.to_string()
}

/// The test database's URL changed by `edit` (another user, say).
pub fn database_url_with(edit: impl FnOnce(&mut Url)) -> String {
    edited(&services().database, edit)
}

/// Another database on the same server.
pub fn database_url_in(database: &str) -> String {
    database_url_with(|url| url.set_path(database))
}

/// The test database through a proxy on this host's `port`.
pub fn database_url_at(port: u16) -> String {
    database_url_with(|url| {
        let _ = url.set_host(Some("127.0.0.1"));
        let _ = url.set_port(Some(port));
    })
}

/// The name of the database of [`database_url`].
pub fn database_name() -> String {
    services()
        .database
        .path()
        .trim_start_matches('/')
        .to_owned()
}

/// The database server's `host:port`, as the URL writes it.
pub fn postgres_host_port() -> String {
    host_port(&services().database)
}

/// The database server's address, for a proxy.
pub fn postgres_address() -> SocketAddr {
    address_of(&services().database)
}

/// The broker, on the vhost of [`DEFAULT_AMQP_URL`] unless told otherwise.
pub fn amqp_url() -> String {
    services().amqp.to_string()
}

/// The broker's URL changed by `edit` (a wrong password, say).
pub fn amqp_url_with(edit: impl FnOnce(&mut Url)) -> String {
    edited(&services().amqp, edit)
}

/// The broker's URL on `vhost`.
pub fn amqp_url_on(vhost: &str) -> String {
    amqp_url_with(|url| url.set_path(&utf8_percent_encode(vhost, NON_ALPHANUMERIC).to_string()))
}

/// The broker through a proxy on this host's `port`.
pub fn amqp_url_at(port: u16) -> String {
    amqp_url_with(|url| {
        let _ = url.set_host(Some("127.0.0.1"));
        let _ = url.set_port(Some(port));
    })
}

/// The vhost of [`amqp_url`].
pub fn amqp_vhost() -> String {
    let path = services().amqp.path().trim_start_matches('/');
    percent_decode_str(path).decode_utf8_lossy().into_owned()
}

/// The user the broker knows the suite as.
pub fn amqp_user() -> String {
    percent_decode_str(services().amqp.username())
        .decode_utf8_lossy()
        .into_owned()
}

/// `user:password` of the broker's URL, as it writes them: what no output
/// may show.
pub fn amqp_credentials() -> String {
    let url = &services().amqp;
    format!("{}:{}", url.username(), url.password().unwrap_or_default())
}

/// The broker's `host:port`, as the URL writes it.
pub fn amqp_host_port() -> String {
    host_port(&services().amqp)
}

/// The broker's address, for a proxy.
pub fn amqp_address() -> SocketAddr {
    address_of(&services().amqp)
}

/// `rabbitmqctl` for that broker: `IDEM_TEST_RABBITMQCTL` (split on white
/// space) or `rabbitmqctl`.
pub fn rabbitmqctl() -> std::process::Command {
    let line = std::env::var("IDEM_TEST_RABBITMQCTL").unwrap_or_else(|_| "rabbitmqctl".into());
    let mut words = line.split_whitespace();
    let mut command = std::process::Command::new(words.next().unwrap_or("rabbitmqctl"));
    command.args(words);
    command
}
/// Runs `rabbitmqctl` with `args`; its error output becomes the error.
pub fn rabbitmqctl_run(args: &[&str]) -> anyhow::Result<()> {
    let output = rabbitmqctl()
        .args(args)
        .output()
        .context("running rabbitmqctl")?;
    if !output.status.success() {
        bail!(
            "rabbitmqctl {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

/// A vhost of a test's own, deleted when the test ends, however it ends.
pub struct Vhost(pub String);

impl Vhost {
    /// A name, swept with the rest if this process dies; nothing created yet.
    pub fn named() -> Self {
        Self(unique_name())
    }

    /// A new vhost on which the suite's user has these configure, write and read
    /// permissions (regular expressions over object names).
    pub fn add(configure: &str, write: &str, read: &str) -> anyhow::Result<Self> {
        let vhost = Self::named();
        rabbitmqctl_run(&["add_vhost", &vhost.0])?;
        rabbitmqctl_run(&[
            "set_permissions",
            "-p",
            &vhost.0,
            &amqp_user(),
            configure,
            write,
            read,
        ])?;
        Ok(vhost)
    }

    /// The broker's URL on this vhost.
    pub fn amqp_url(&self) -> String {
        amqp_url_on(&self.0)
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        let _ = rabbitmqctl_run(&["delete_vhost", &self.0]);
    }
}

pub const GROUP: &str = idem_points::points::CONSUMER_GROUP;

/// The retry schedule of the tests' topologies: every guarantee holds with
/// messages waiting between attempts, and short waits keep the suite quick.
pub const TEST_RETRY_DELAYS: [Duration; 2] =
    [Duration::from_millis(100), Duration::from_millis(200)];

/// Names of this process's test objects start with this.
fn process_prefix() -> String {
    format!("idem_t{}_", std::process::id())
}

/// A name for a test's own objects, `idem_t<pid>_<random>`: swept with the
/// rest if this process dies.
pub fn unique_name() -> String {
    format!("{}{:08x}", process_prefix(), fastrand::u32(..))
}

/// A test's own schema, topology and connections; removed on drop.
pub struct TestEnv {
    /// Unique name of this test's objects: `idem_t<pid>_<random>`.
    pub name: String,
    pub schema: String,
    pub topology: Topology,
    pub amqp: AmqpConfig,
    pub database: DatabaseConfig,
    /// For the test's own queries; its search_path is the test's schema.
    pub pool: Pool,
    /// Extra queues and exchanges a test declared, removed on drop too.
    extra_queues: std::sync::Mutex<Vec<String>>,
    /// A database of this test's own, when it has one (it is dropped with
    /// the test); otherwise the schema lives in `postgres`.
    own_database: Option<String>,
}

impl TestEnv {
    /// A migrated schema and a declared topology, both new.
    pub async fn new() -> anyhow::Result<Self> {
        Self::create(None, amqp_url()).await
    }

    /// As [`TestEnv::new`], on the PostgreSQL server at `database_url` (a
    /// server of the test's own, which takes the schema with it).
    pub async fn on_database_server(database_url: String) -> anyhow::Result<Self> {
        Self::create_at(database_url, None, amqp_url()).await
    }

    /// As [`TestEnv::new`], on the broker (or cluster: one URL per node,
    /// separated by commas) at `amqp_url`.
    pub async fn on_broker(amqp_url: String) -> anyhow::Result<Self> {
        Self::create(None, amqp_url).await
    }

    /// As [`TestEnv::new`], in a database of the test's own: for tests that
    /// change what a database allows.
    pub async fn in_own_database() -> anyhow::Result<Self> {
        sweep_leftovers_once();
        let database = unique_name();
        let client = admin().await?;
        client
            .batch_execute(&format!("CREATE DATABASE {database}"))
            .await?;
        Self::create(Some(database), amqp_url()).await
    }

    async fn create(own_database: Option<String>, amqp_url: String) -> anyhow::Result<Self> {
        let url = match &own_database {
            Some(database) => database_url_in(database),
            None => database_url(),
        };
        Self::create_at(url, own_database, amqp_url).await
    }

    async fn create_at(
        url: String,
        own_database: Option<String>,
        amqp_url: String,
    ) -> anyhow::Result<Self> {
        sweep_leftovers_once();
        let name = unique_name();
        let schema = name.clone();
        let mut database = DatabaseConfig::new(SecretUrl::new(url)).with_schema(&schema);
        database.connect_timeout = patient(DatabaseConfig::DEFAULT_CONNECT_TIMEOUT);
        let pool = database.pool()?;
        migrate::run::<idem_points::points::Points>(&pool, Some(&schema)).await?;
        let topology = Topology {
            retry_delays: TEST_RETRY_DELAYS.to_vec(),
            ..idem_points::points::topology().prefixed(&format!("{}.", name.replace('_', "-")))
        };
        let amqp = AmqpConfig::new(SecretUrl::new(amqp_url));
        let env = Self {
            name,
            schema,
            topology,
            amqp,
            database,
            pool,
            extra_queues: Default::default(),
            own_database,
        };
        env.declare(&env.topology).await?;
        Ok(env)
    }

    /// The database this test's schema lives in.
    pub fn database_name(&self) -> String {
        self.own_database.clone().unwrap_or_else(database_name)
    }

    /// Declares `topology` (as the worker would), and removes it on drop.
    pub async fn declare(&self, topology: &Topology) -> anyhow::Result<()> {
        let connection = self.connect().await?;
        topology.declare(&connection).await?;
        connection.close(200, "OK".into()).await?;
        if *topology != self.topology {
            let mut extra = self
                .extra_queues
                .lock()
                .map_err(|_| anyhow::anyhow!("poisoned"))?;
            extra.extend(topology.queues());
        }
        Ok(())
    }

    /// Consumers of `queue`, as the broker counts them.
    pub async fn consumers(&self, queue: &str) -> anyhow::Result<u32> {
        let connection = self.connect().await?;
        let channel = connection.create_channel().await?;
        let (_, consumers) = idem::broker::queue_counts(&channel, queue).await?;
        connection.close(200, "OK".into()).await?;
        Ok(consumers)
    }

    /// Removes `queues` with the test's own when it ends.
    pub fn remove_on_drop(&self, queues: &[String]) -> anyhow::Result<()> {
        self.extra_queues
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .extend_from_slice(queues);
        Ok(())
    }

    pub async fn connect(&self) -> anyhow::Result<Connection> {
        Ok(connect(&self.amqp, "idem test").await?)
    }

    /// Declares a classic queue of this test's own that holds at most
    /// `ready` messages and nacks what comes beyond (`reject-publish`);
    /// what it rejects goes to the dead-letter queue. Removed on drop.
    pub async fn bounded_queue(&self, suffix: &str, ready: i64) -> anyhow::Result<String> {
        let queue = format!("{}.{suffix}", self.topology.queue);
        let connection = self.connect().await?;
        let channel = connection.create_channel().await?;
        let mut arguments = FieldTable::default();
        arguments.insert("x-max-length".into(), AMQPValue::LongLongInt(ready));
        arguments.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
        arguments.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("".into()),
        );
        arguments.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(self.topology.dead_letter_queue.as_str().into()),
        );
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::default(),
                arguments,
            )
            .await?;
        connection.close(200, "OK".into()).await?;
        self.extra_queues
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .push(queue.clone());
        Ok(queue)
    }

    /// A worker configuration for this environment in `mode`: idem's
    /// defaults, with deadlines for a test.
    pub fn worker_config(&self, mode: Mode) -> WorkerConfig {
        let mut config = WorkerConfig::in_mode(
            mode,
            self.amqp.clone(),
            self.database.clone(),
            self.topology.clone(),
            GROUP,
        );
        config.shutdown_timeout = patient(Duration::from_secs(10));
        config.startup_timeout = patient(Duration::from_secs(10));
        config
    }

    /// The broker's URL through a proxy on `port`.
    pub fn amqp_url_via(&self, port: u16) -> String {
        amqp_url_at(port)
    }

    /// The database's URL through a proxy on `port`, with this test's name as
    /// `application_name` so that its sessions can be found.
    pub fn database_url_via(&self, port: u16) -> String {
        database_url_with(|url| {
            let _ = url.set_host(Some("127.0.0.1"));
            let _ = url.set_port(Some(port));
            url.set_path(&self.database_name());
            append_query(url, "application_name", &self.name);
        })
    }

    /// `worker_config`, reaching the services through proxies where given.
    pub fn worker_config_via(
        &self,
        mode: Mode,
        amqp_port: Option<u16>,
        database_port: Option<u16>,
    ) -> WorkerConfig {
        let mut config = self.worker_config(mode);
        if let Some(port) = amqp_port {
            config.amqp.url = SecretUrl::new(self.amqp_url_via(port));
        }
        if let Some(port) = database_port {
            config.database.url = SecretUrl::new(self.database_url_via(port));
        }
        config
    }

    /// Publishes events to this environment's exchange, with confirms.
    pub async fn publish_events(
        &self,
        events: &[PaymentSucceeded],
    ) -> anyhow::Result<PublishReport> {
        let bodies: Vec<Vec<u8>> = events.iter().map(PaymentSucceeded::to_body).collect();
        self.publish_bodies(&bodies).await
    }

    /// Publishes raw bodies to this environment's exchange, with confirms.
    pub async fn publish_bodies(&self, bodies: &[Vec<u8>]) -> anyhow::Result<PublishReport> {
        publish(&self.amqp, &self.topology, bodies).await
    }

    /// Points of `order_id`, 0 when it has none.
    pub async fn points(&self, order_id: &str) -> anyhow::Result<i64> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                "SELECT points FROM user_points WHERE order_id = $1",
                &[&order_id],
            )
            .await?;
        Ok(row.map(|r| r.get(0)).unwrap_or(0))
    }

    /// Points of every order.
    pub async fn all_points(&self) -> anyhow::Result<BTreeMap<String, i64>> {
        let client = self.pool.get().await?;
        let rows = client
            .query("SELECT order_id, points FROM user_points", &[])
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// The single number a `SELECT count(*) …` returns.
    pub async fn count(
        &self,
        query: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> anyhow::Result<i64> {
        let client = self.pool.get().await?;
        Ok(client.query_one(query, params).await?.get(0))
    }

    /// Rows of `table`, in this test's schema.
    pub async fn count_rows(&self, table: &str) -> anyhow::Result<i64> {
        self.count(&format!("SELECT count(*) FROM {table}"), &[])
            .await
    }

    /// Consume records of `group` (all events).
    pub async fn records(&self, group: &str) -> anyhow::Result<i64> {
        self.count(
            "SELECT count(*) FROM mq_consume_record WHERE consumer_group = $1",
            &[&group],
        )
        .await
    }

    /// PostgreSQL sessions whose `application_name` is `name` (see
    /// [`Self::database_url_via`]).
    pub async fn sessions_named(&self, name: &str) -> anyhow::Result<i64> {
        self.count(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            &[&name],
        )
        .await
    }

    /// Consume records of one event in `group`.
    pub async fn records_of(&self, event_id: &str, group: &str) -> anyhow::Result<i64> {
        self.count(
            "SELECT count(*) FROM mq_consume_record WHERE event_id = $1 AND consumer_group = $2",
            &[&event_id, &group],
        )
        .await
    }

    /// Event ids recorded more than once in `group`: must always be none.
    pub async fn doubly_recorded(&self, group: &str) -> anyhow::Result<i64> {
        let client = self.pool.get().await?;
        let row = client
            .query_one(
                "SELECT count(*) FROM (SELECT event_id FROM mq_consume_record \
                 WHERE consumer_group = $1 GROUP BY event_id HAVING count(*) > 1) AS twice",
                &[&group],
            )
            .await?;
        Ok(row.get(0))
    }

    /// Messages ready in `queue` (not counting those delivered and unacked).
    pub async fn ready(&self, queue: &str) -> anyhow::Result<u32> {
        ready(&self.amqp, queue).await
    }

    /// The messages in the dead-letter queue, left in place.
    pub async fn dead_letters(&self) -> anyhow::Result<Vec<DeadLetter>> {
        self.peek(&self.topology.dead_letter_queue).await
    }

    /// The messages ready in `queue`, left in place.
    pub async fn peek(&self, queue: &str) -> anyhow::Result<Vec<DeadLetter>> {
        peek(&self.amqp, queue).await
    }
    /// The dead-letter commands' settings for this test's queue, ledger
    /// and records, with no filter.
    pub fn dlq_config(&self) -> idem::dlq::DlqConfig {
        idem::dlq::DlqConfig::new(
            self.amqp.clone(),
            self.database.clone(),
            GROUP,
            self.topology.dead_letter_queue.clone(),
            patient(Duration::from_secs(5)),
        )
    }

    /// Runs SQL in this test's schema.
    pub async fn sql(&self, statements: &str) -> anyhow::Result<()> {
        let client = self.pool.get().await?;
        client.batch_execute(statements).await?;
        Ok(())
    }

    /// Makes every transaction that adds points to `order_id` fail, counting
    /// the attempts in the sequence `attempts` (which does not roll back).
    pub async fn poison_order(&self, order_id: &str) -> anyhow::Result<()> {
        self.sql(&format!(
            "CREATE SEQUENCE attempts;
             CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.order_id = '{order_id}' THEN
                     PERFORM nextval('attempts');
                     RAISE EXCEPTION 'order % is poisoned', NEW.order_id;
                 END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER poison BEFORE INSERT OR UPDATE ON user_points
                 FOR EACH ROW EXECUTE FUNCTION poison();"
        ))
        .await
    }

    /// Fills the dead-letter queue with `per_order` events of each of
    /// `orders`, each dead-lettered on its first failure by a per-message
    /// worker (a trigger fails every order's points with `order <id>
    /// failed`, and is dropped after): what a bad deploy leaves behind.
    /// Returns the events as published.
    pub async fn failed_events(
        &self,
        orders: &[&str],
        per_order: usize,
    ) -> anyhow::Result<Vec<PaymentSucceeded>> {
        self.sql(
            "CREATE FUNCTION fail_every_order() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN RAISE EXCEPTION 'order % failed', NEW.order_id; END $$;
             CREATE TRIGGER fail_every_order BEFORE INSERT OR UPDATE ON user_points
                 FOR EACH ROW EXECUTE FUNCTION fail_every_order();",
        )
        .await?;
        let events: Vec<PaymentSucceeded> = (0..per_order)
            .flat_map(|i| {
                orders.iter().map(move |order| PaymentSucceeded {
                    event_id: format!("{}-{order}-{i}", self.name),
                    order_id: (*order).to_owned(),
                    points: 1,
                })
            })
            .collect();
        self.publish_events(&events).await?;
        let mut config = self.worker_config(Mode::PerMessage);
        config.max_attempts = 1;
        let worker = RunningWorker::start(config);
        wait_for(
            "every event dead-lettered",
            Duration::from_secs(120),
            || async {
                Ok(self.ready(&self.topology.dead_letter_queue).await? as usize == events.len())
            },
        )
        .await?;
        worker.stop().await?;
        self.sql("DROP TRIGGER fail_every_order ON user_points")
            .await?;
        Ok(events)
    }

    /// The messages in `queue`, ready or delivered and not acked yet, as
    /// `rabbitmqctl list_queues` counts them (vhost `/`): from the queue's
    /// statistics, which lag seconds behind it.
    pub fn messages(&self, queue: &str) -> anyhow::Result<u64> {
        let output = rabbitmqctl()
            .args([
                "list_queues",
                "-q",
                "-p",
                "/",
                "--no-table-headers",
                "name",
                "messages",
            ])
            .output()
            .context("running rabbitmqctl")?;
        anyhow::ensure!(output.status.success(), "rabbitmqctl list_queues failed");
        let listing = String::from_utf8_lossy(&output.stdout);
        listing
            .lines()
            .find_map(|line| {
                let mut words = line.split_whitespace();
                (words.next() == Some(queue)).then(|| words.next()?.parse().ok())?
            })
            .with_context(|| format!("queue {queue} is not in: {listing}"))
    }

    /// How many transactions `poison_order` failed.
    pub async fn poisoned_attempts(&self) -> anyhow::Result<i64> {
        let client = self.pool.get().await?;
        let row = client
            .query_one(
                "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM attempts",
                &[],
            )
            .await?;
        Ok(row.get(0))
    }
}

/// Publishes `bodies` to `topology`'s exchange with its routing key, with
/// confirms; fails unless every one is confirmed.
pub async fn publish(
    amqp: &AmqpConfig,
    topology: &Topology,
    bodies: &[Vec<u8>],
) -> anyhow::Result<PublishReport> {
    let messages: Vec<Outgoing> = bodies
        .iter()
        .map(|body| topology.event(body.clone()))
        .collect();
    publish_messages(amqp, &messages).await
}

/// Publishes `messages` with confirms; fails unless every one is confirmed.
pub async fn publish_messages(
    amqp: &AmqpConfig,
    messages: &[Outgoing],
) -> anyhow::Result<PublishReport> {
    let options = PublishOptions {
        window: 500,
        patience: patient(Duration::from_secs(10)),
    };
    let report = publish_all(amqp, messages, &options, &CancellationToken::new()).await?;
    if !report.all_confirmed() {
        bail!("test publish not confirmed: {report:?}");
    }
    Ok(report)
}

/// Messages ready in `queue` of `amqp`'s vhost (not counting those
/// delivered and unacked).
pub async fn ready(amqp: &AmqpConfig, queue: &str) -> anyhow::Result<u32> {
    let connection = connect(amqp, "idem test").await?;
    let channel = connection.create_channel().await?;
    let ready = idem::broker::ready_messages(&channel, queue).await;
    channel.close(200, "OK".into()).await?;
    connection.close(200, "OK".into()).await?;
    Ok(ready?)
}

/// The messages ready in `queue` of `amqp`'s vhost, left in place.
pub async fn peek(amqp: &AmqpConfig, queue: &str) -> anyhow::Result<Vec<DeadLetter>> {
    let connection = connect(amqp, "idem test").await?;
    let channel = connection.create_channel().await?;
    let mut letters = Vec::new();
    let mut last = None;
    while let Some(message) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await?
    {
        last = Some(message.delivery.delivery_tag);
        letters.push(DeadLetter {
            body: message.delivery.data.clone(),
            properties: message.delivery.properties.clone(),
        });
    }
    if let Some(tag) = last {
        channel
            .basic_nack(
                tag,
                BasicNackOptions {
                    multiple: true,
                    requeue: true,
                },
            )
            .await?;
    }
    channel.close(200, "OK".into()).await?;
    // A quorum queue makes what was given back ready a moment later: wait
    // for it, so that the next look sees every message.
    let channel = connection.create_channel().await?;
    let peeked = u32::try_from(letters.len()).unwrap_or(u32::MAX);
    wait_for(
        "what was peeked to be back",
        Duration::from_secs(10),
        || async { Ok(idem::broker::ready_messages(&channel, queue).await? >= peeked) },
    )
    .await?;
    connection.close(200, "OK".into()).await?;
    Ok(letters)
}

/// A file removed when the test ends, however it ends.
pub struct Removed(pub std::path::PathBuf);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A consumer that holds each message for a while before it acks it, and
/// keeps the bodies: what a publisher meets behind a slow consumer.
pub struct SlowConsumer {
    bodies: tokio::sync::watch::Receiver<Vec<Vec<u8>>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl SlowConsumer {
    /// Consumes `queue`, one message at a time, each held for `hold`.
    pub async fn start(amqp: &AmqpConfig, queue: &str, hold: Duration) -> anyhow::Result<Self> {
        let connection = connect(amqp, "idem test").await?;
        let channel = connection.create_channel().await?;
        channel.basic_qos(1, BasicQosOptions::default()).await?;
        let mut consumer = channel
            .basic_consume(
                queue.into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let (tell, bodies) = tokio::sync::watch::channel(Vec::new());
        let task = tokio::spawn(async move {
            let _connection = connection;
            while let Some(delivery) = consumer.next().await {
                let delivery = delivery?;
                tokio::time::sleep(hold).await;
                delivery.ack(BasicAckOptions::default()).await?;
                tell.send_modify(|bodies| bodies.push(delivery.data));
            }
            Ok(())
        });
        Ok(Self { bodies, task })
    }

    /// Waits until it has acked `count` messages; their bodies, sorted.
    pub async fn received(
        mut self,
        count: usize,
        timeout: Duration,
    ) -> anyhow::Result<Vec<Vec<u8>>> {
        let got = tokio::time::timeout(
            patient(timeout),
            self.bodies.wait_for(|bodies| bodies.len() >= count),
        )
        .await
        .map(|bodies| bodies.map(|bodies| bodies.clone()));
        self.task.abort();
        let mut bodies = match got {
            Ok(bodies) => bodies?,
            Err(_) => bail!(
                "the consumer got {} of {count} messages",
                self.bodies.borrow().len()
            ),
        };
        bodies.sort();
        Ok(bodies)
    }
}

/// A message read from the dead-letter queue.
#[derive(Debug)]
pub struct DeadLetter {
    pub body: Vec<u8>,
    pub properties: BasicProperties,
}

impl DeadLetter {
    pub fn death(&self) -> Option<idem::broker::death::Death> {
        idem::broker::death::Death::latest(self.properties.headers().as_ref())
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        let mut queues = self.topology.queues();
        queues.extend(
            self.extra_queues
                .lock()
                .map(|q| q.clone())
                .unwrap_or_default(),
        );
        let exchanges = self.topology.exchanges().map(str::to_owned).to_vec();
        // A database of the test's own goes with its schema in it.
        let (schemas, databases) = match &self.own_database {
            Some(database) => (vec![], vec![database.clone()]),
            None => (vec![self.schema.clone()], vec![]),
        };
        clean_up(remove(
            self.amqp.clone(),
            queues,
            exchanges,
            schemas,
            databases,
        ));
    }
}

/// Runs `cleanup` to its end on a thread and runtime of its own: a `Drop`
/// runs inside the test's runtime, which cannot block on it.
pub fn clean_up(cleanup: impl Future<Output = anyhow::Result<()>> + Send + 'static) {
    let done = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(cleanup)
    })
    .join();
    if let Ok(Err(error)) = done {
        eprintln!("test cleanup failed: {error:#}");
    }
}

/// Removes `schema` and all it holds.
pub async fn drop_schema(schema: String) -> anyhow::Result<()> {
    let amqp = AmqpConfig::new(SecretUrl::new(amqp_url()));
    remove(amqp, vec![], vec![], vec![schema], vec![]).await
}

/// A client of the `postgres` database, for what a test does as an
/// administrator (creating and dropping databases, say).
pub async fn admin() -> anyhow::Result<tokio_postgres::Client> {
    let (client, connection) =
        tokio_postgres::connect(&database_url(), tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

async fn remove(
    amqp: AmqpConfig,
    queues: Vec<String>,
    exchanges: Vec<String>,
    schemas: Vec<String>,
    databases: Vec<String>,
) -> anyhow::Result<()> {
    if !queues.is_empty() || !exchanges.is_empty() {
        let connection = connect(&amqp, "idem test cleanup").await?;
        let channel = connection.create_channel().await?;
        for queue in queues {
            channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await?;
        }
        for exchange in exchanges {
            channel
                .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                .await?;
        }
        channel.close(200, "OK".into()).await?;
        connection.close(200, "OK".into()).await?;
    }
    if !schemas.is_empty() || !databases.is_empty() {
        let client = admin().await?;
        for schema in schemas {
            client
                .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                .await?;
        }
        for database in databases {
            client
                .batch_execute(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
                .await?;
        }
    }
    Ok(())
}

/// Removes what earlier test processes that died left behind: objects whose
/// names carry the pid of a process that no longer runs.
fn sweep_leftovers_once() {
    static SWEEP: Once = Once::new();
    SWEEP.call_once(|| {
        let swept = std::thread::spawn(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(sweep())
        })
        .join();
        if let Ok(Err(error)) = swept {
            eprintln!("sweeping leftovers of earlier test runs failed: {error:#}");
        }
    });
}

fn is_orphan(name: &str) -> bool {
    // A test's own objects, and those of a check the suite ran.
    let Some(rest) = ["idem_t", "idem-t", "idem_check_", "idem-check-"]
        .iter()
        .find_map(|prefix| name.strip_prefix(prefix))
    else {
        return false;
    };
    let pid: String = rest.chars().take_while(char::is_ascii_digit).collect();
    match pid.parse::<u32>() {
        Ok(pid) => {
            pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        }
        Err(_) => false,
    }
}

async fn sweep() -> anyhow::Result<()> {
    // Worker logs and certificates in the temporary directory.
    if let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) {
        for entry in entries.flatten() {
            if entry.file_name().to_str().is_some_and(is_orphan) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    // PostgreSQL servers of a test's own (`pg_createcluster`).
    for version in std::fs::read_dir("/etc/postgresql")
        .into_iter()
        .flatten()
        .flatten()
    {
        let clusters = std::fs::read_dir(version.path())
            .into_iter()
            .flatten()
            .flatten();
        for cluster in clusters {
            if cluster.file_name().to_str().is_some_and(is_orphan) {
                let _ = std::process::Command::new("pg_dropcluster")
                    .arg("--stop")
                    .arg(version.file_name())
                    .arg(cluster.file_name())
                    .output();
            }
        }
    }
    // Queues and exchanges live in the suite's vhost; vhosts are global.
    let vhost = amqp_vhost();
    let list = |what: &str| -> Vec<String> {
        let mut command = rabbitmqctl();
        command.args([what, "-q", "--no-table-headers", "name"]);
        if what != "list_vhosts" {
            command.args(["-p", &vhost]);
        }
        command
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| {
                String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let queues: Vec<String> = list("list_queues")
        .into_iter()
        .filter(|n| is_orphan(n))
        .collect();
    let exchanges: Vec<String> = list("list_exchanges")
        .into_iter()
        .filter(|n| is_orphan(n))
        .collect();
    for vhost in list("list_vhosts").into_iter().filter(|n| is_orphan(n)) {
        let _ = rabbitmqctl().args(["delete_vhost", &vhost]).output();
    }
    let (client, connection) =
        tokio_postgres::connect(&database_url(), tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    let orphans = |query: &'static str| {
        let client = &client;
        async move {
            anyhow::Ok(
                client
                    .query(query, &[])
                    .await?
                    .iter()
                    .map(|r| r.get::<_, String>(0))
                    .filter(|n| is_orphan(n))
                    .collect::<Vec<_>>(),
            )
        }
    };
    let schemas =
        orphans("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'idem\\_%'").await?;
    let databases =
        orphans("SELECT datname::text FROM pg_database WHERE datname LIKE 'idem\\_t%'").await?;
    drop(client);
    let amqp = AmqpConfig::new(SecretUrl::new(amqp_url()));
    remove(amqp, queues, exchanges, schemas, databases).await
}

/// How much slower than a quiet machine this run may be: `IDEM_TEST_SLACK`
/// (a factor, 1 unless set; `.ci/run` sets more, for a shared machine whose
/// speed can drop tenfold). Every deadline of the suite is `patient(d)`.
pub fn slack() -> f64 {
    std::env::var("IDEM_TEST_SLACK")
        .ok()
        .and_then(|factor| factor.parse::<f64>().ok())
        .filter(|factor| factor.is_finite() && *factor >= 1.0)
        .unwrap_or(1.0)
}

/// A deadline that was right on a quiet machine, stretched by [`slack`].
pub fn patient(deadline: Duration) -> Duration {
    deadline.mul_f64(slack())
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
            .with_context(|| format!("while waiting for {what}"))?
        {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

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

    /// Asks it to stop and waits until it has.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        Ok(tokio::time::timeout(patient(Duration::from_secs(30)), self.handle).await???)
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

/// The `idem` binary with nothing of this process's environment but `PATH`,
/// pointed at `env`'s schema and topology and at the given services.
pub fn idem_command(env: &TestEnv, amqp_url: &str, database_url: &str) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"));
    command
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env(vars::AMQP_URL, amqp_url)
        .env(vars::DATABASE_URL, database_url)
        .env(vars::SCHEMA, &env.schema)
        .envs(vars::topology(&env.topology))
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    command
}

/// What a run of `idem` printed, and its exit code.
pub struct Ran {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `idem` with `args` on `env`, against the session's servers, and
/// waits (patiently, up to a minute) for it to exit.
pub async fn run_idem(env: &TestEnv, args: &[&str]) -> anyhow::Result<Ran> {
    let output = tokio::time::timeout(
        patient(Duration::from_secs(60)),
        idem_command(env, &amqp_url(), &database_url())
            .args(args)
            .output(),
    )
    .await??;
    Ok(Ran {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    })
}

/// Runs `idem worker` as `command` says, and asserts that it exits 1 at
/// once, without retrying, with one line on stderr; returns that line.
pub async fn worker_exits_at_once(command: tokio::process::Command) -> anyhow::Result<String> {
    worker_exits_at_once_with(command, 1).await
}

/// [`worker_exits_at_once`], with exit code `code` (2 for settings that
/// can never work, as for clap's usage errors).
pub async fn worker_exits_at_once_with(
    mut command: tokio::process::Command,
    code: i32,
) -> anyhow::Result<String> {
    command.arg("worker");
    let started = std::time::Instant::now();
    let output = tokio::time::timeout(patient(Duration::from_secs(60)), command.output())
        .await
        .context("the worker did not exit")??;
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(code), "{stderr}");
    assert!(
        started.elapsed() < patient(Duration::from_secs(10)),
        "it retried: {stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    Ok(stderr)
}

/// `idem worker` as a real process, with its log in a file of its own.
pub struct WorkerProcess {
    child: tokio::process::Child,
    log: std::path::PathBuf,
}

impl WorkerProcess {
    /// Starts `idem worker` on `env`'s schema and topology, reaching the
    /// services at the given URLs (a proxy's, say), with extra arguments.
    pub fn spawn(
        env: &TestEnv,
        mode: Mode,
        amqp_url: &str,
        database_url: &str,
        args: &[&str],
    ) -> anyhow::Result<Self> {
        let mut command = idem_command(env, amqp_url, database_url);
        command
            .args(["worker", "--mode", mode.as_flag()])
            .args(args);
        Self::start(command)
    }

    /// Starts `command` (a worker), logging at `info` to a file of its own.
    pub fn start(mut command: tokio::process::Command) -> anyhow::Result<Self> {
        let log = std::env::temp_dir().join(format!("{}.log", unique_name()));
        let file = std::fs::File::create(&log)?;
        let child = command
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()?;
        Ok(Self { child, log })
    }

    /// SIGKILL, and wait until it is gone.
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill().await?;
        Ok(())
    }

    /// Sends `signal` (e.g. `-TERM`) and returns at once.
    pub async fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let pid = self.child.id().context("the worker already exited")?;
        let status = tokio::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .await?;
        anyhow::ensure!(status.success(), "kill {signal} {pid} failed");
        Ok(())
    }

    /// Waits for it to exit, for at most `patient(timeout)`; returns its exit code.
    pub async fn wait(&mut self, timeout: Duration) -> anyhow::Result<Option<i32>> {
        let timeout = patient(timeout);
        let status = tokio::time::timeout(timeout, self.child.wait())
            .await
            .with_context(|| {
                format!(
                    "the worker did not exit within {timeout:?}; its log:\n{}",
                    self.log()
                )
            })??;
        Ok(status.code())
    }

    /// SIGTERM, then wait; asserts a clean exit.
    pub async fn stop(mut self) -> anyhow::Result<String> {
        self.signal("-TERM").await?;
        let code = self.wait(Duration::from_secs(40)).await?;
        let log = self.log();
        anyhow::ensure!(
            code == Some(0),
            "the worker exited with {code:?}; its log:\n{log}"
        );
        Ok(log)
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A port nothing listens on now, for a server a test is about to start.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `GET path` from the HTTP server on `127.0.0.1:port`: its status code and
/// body.
pub async fn http_get(port: u16, path: &str) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .context("no status line")?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// The value of the sample `name{labels…}` of a Prometheus text page whose
/// labels include every one of `labels` (`outcome="applied"`, say).
pub fn sample(page: &str, name: &str, labels: &[&str]) -> Option<f64> {
    page.lines().find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
        (metric == name && labels.iter().all(|label| rest.contains(label)))
            .then(|| value.parse().ok())?
    })
}

/// The repository's root: the library's crate, above this suite's.
pub fn repository() -> std::path::PathBuf {
    let suite = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    suite.parent().unwrap_or(suite).to_path_buf()
}

/// Example `name`'s binary, which `cargo test` builds beside this test binary
/// (`cargo test --test it` does not: a binary older than its sources would
/// test old code, so it is refused).
pub fn example_binary(name: &str) -> anyhow::Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    let target = exe
        .parent()
        .and_then(|deps| deps.parent())
        .context("no target directory above the test binary")?;
    let binary = target.join("examples").join(name);
    let rebuild = "`cargo test` builds it, as does `cargo build --examples`";
    let built = std::fs::metadata(&binary)
        .and_then(|meta| meta.modified())
        .with_context(|| format!("{} is missing: {rebuild}", binary.display()))?;
    // The library's sources and this crate's, and the example's own
    // (the library's examples or this crate's).
    let library = repository();
    let suite = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut sources = newest(&library.join("src"))?.max(newest(&suite.join("src"))?);
    for examples in [library.join("examples"), suite.join("examples")] {
        if examples.join(name).exists() {
            sources = sources.max(newest(&examples.join(name))?);
        }
    }
    anyhow::ensure!(
        built >= sources,
        "{} is older than its sources: {rebuild}",
        binary.display()
    );
    Ok(binary)
}

/// When the newest file under `dir` was last changed.
fn newest(dir: &std::path::Path) -> anyhow::Result<std::time::SystemTime> {
    let mut latest = std::time::SystemTime::UNIX_EPOCH;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let changed = if entry.file_type()?.is_dir() {
            newest(&entry.path())?
        } else {
            entry.metadata()?.modified()?
        };
        latest = latest.max(changed);
    }
    Ok(latest)
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
