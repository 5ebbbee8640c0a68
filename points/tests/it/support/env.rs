//! A test's environment: its schema, exchanges and queues, named after the
//! test process, removed when it ends.

use super::*;

pub const GROUP: &str = idem_points::points::CONSUMER_GROUP;

/// The retry schedule of the tests' topologies: every guarantee holds with
/// messages waiting between attempts, and short waits keep the suite quick.
pub const TEST_RETRY_DELAYS: [Duration; 2] =
    [Duration::from_millis(100), Duration::from_millis(200)];

/// Names of this process's test objects start with this.
pub(crate) fn process_prefix() -> String {
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
        Self::create_at(database_url, None, amqp_url(), 0).await
    }

    /// As [`TestEnv::new`], on the broker (or cluster: one URL per node,
    /// separated by commas) at `amqp_url`.
    pub async fn on_broker(amqp_url: String) -> anyhow::Result<Self> {
        Self::create(None, amqp_url).await
    }

    /// As [`TestEnv::on_broker`], the work queue ordered per order over
    /// `slots` slots.
    pub async fn ordered_on_broker(amqp_url: String, slots: u16) -> anyhow::Result<Self> {
        Self::create_at(database_url(), None, amqp_url, slots).await
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
        Self::create_at(url, own_database, amqp_url, 0).await
    }

    async fn create_at(
        url: String,
        own_database: Option<String>,
        amqp_url: String,
        slots: u16,
    ) -> anyhow::Result<Self> {
        sweep_leftovers_once();
        let name = unique_name();
        let schema = name.clone();
        let mut database = DatabaseConfig::new(SecretUrl::new(url)).with_schema(&schema);
        database.connect_timeout = patient(DatabaseConfig::DEFAULT_CONNECT_TIMEOUT);
        let pool = database.pool()?;
        migrate::run::<idem_points::points::Points>(&pool, Some(&schema)).await?;
        let topology = Topology {
            retry: idem::RetryPolicy::default().with_delays(TEST_RETRY_DELAYS.to_vec()),
            ..idem_points::points::topology()
                .prefixed(&format!("{}.", name.replace('_', "-")))
                .ordered(slots)
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
        idem::dlq::DlqConfig::new(self.target())
    }

    /// What an operator command works on in this test: its servers, group
    /// and queues, waiting five (patient) seconds for the servers.
    pub fn target(&self) -> idem::Target {
        idem::Target::new(
            self.amqp.clone(),
            self.database.clone(),
            self.topology.clone(),
            GROUP,
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
        config.topology.retry = config.topology.retry.clone().with_attempts(1);
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

impl Drop for TestEnv {
    fn drop(&mut self) {
        let mut queues = self.topology.queues();
        queues.extend(
            self.extra_queues
                .lock()
                .map(|q| q.clone())
                .unwrap_or_default(),
        );
        let mut exchanges = self.topology.exchanges().map(str::to_owned).to_vec();
        if self.topology.is_ordered() {
            exchanges.push(self.topology.slots_exchange());
        }
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
