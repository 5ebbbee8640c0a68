//! The rounds: the bench's schema and topology, each run of a round
//! (the ceiling, idem's modes, the contenders, the outbox, a baseline
//! build), and the check after every run.
//!
//! Over 700 lines: each run is a step of the one `Bench` that holds the
//! schema, the topology and the pool, and they read best side by side.

use super::*;

impl Bench<'_> {
    pub(super) async fn rounds(&self) -> anyhow::Result<BenchReport> {
        let config = self.config;
        let bench = self;
        let mut load = generate::events(&LoadSpec {
            count: config.messages,
            duplicate_ratio: config.duplicate_ratio,
            orders: config.orders,
            seed: 42,
            prefix: "bench".into(),
        });
        if config.uuid_ids {
            generate::with_uuid_ids(&mut load, 42);
        }
        let ordered = bench.ordered();
        let mut report = BenchReport {
            settings: format!(
                "{} messages ({:.0}% duplicates, {} orders, {} event ids), {} consume records before each worker run, quorum queue, prefetch {}; batch mode: {} per batch, {:?} wait, {} in flight; per-message mode: {} in flight; the batched peer: {} per batch or 5ms, {} in flight, prefetch {}",
                config.messages,
                config.duplicate_ratio * 100.0,
                config.orders,
                if config.uuid_ids {
                    "random UUID"
                } else {
                    "sequential"
                },
                config
                    .prefill
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(" / "),
                config.prefetch,
                config.batch_size,
                config.batch_wait,
                config.batch_in_flight,
                config.per_message_in_flight,
                config.peer.batch_size,
                config.peer.in_flight,
                config.peer.prefetch
            ),
            ..BenchReport::default()
        };
        if let Some(slots) = config.ordered {
            report.settings.push_str(&format!(
                "; ordered runs: {slots} slots, keyed by order; the poisoned order: {}",
                Bench::poisoned_key(&load)
            ));
        }
        for round in 1..=config.rounds {
            eprintln!("round {round} of {}", config.rounds);
            bench.reset().await?;
            bench.publish(&load).await?;
            settle_down().await;
            if config.modes.contains(&Mode::Ceiling) {
                let ceiling = bench.ceiling(config.messages).await?;
                eprintln!("  ceiling      {:>9.0} msgs/s", ceiling.rate);
                report.push(CEILING.to_owned(), ceiling);
            }
            for (wanted, args, keys) in [
                (
                    Mode::PerMessage,
                    bench.per_message_args(),
                    [PER_MESSAGE, PER_MESSAGE_BASELINE],
                ),
                (Mode::Batch, bench.batch_args(), [BATCH, BATCH_BASELINE]),
            ] {
                if !config.modes.contains(&wanted) {
                    continue;
                }
                for (key, binary) in builds(config, keys, round) {
                    for &prefill in &config.prefill {
                        let removals = if config.prune_during && prefill > 0 {
                            &[false, true][..]
                        } else {
                            &[false][..]
                        };
                        for &removal in removals {
                            bench.reset().await?;
                            let floor = bench.prefill(prefill).await?;
                            bench.publish(&load).await?;
                            settle_down().await;
                            let run = Run {
                                records: IDEM_RECORDS,
                                floor,
                                outbox: false,
                                removal: removal.then(|| bench.layout(prefill).len()),
                                poisoned: false,
                            };
                            let measured = bench.worker(binary, &args, &load, run).await?;
                            let mut key = over(key, prefill);
                            if removal {
                                key.push_str(REMOVING);
                            }
                            eprintln!("  {:<30} {:>9.0} msgs/s", label(&key), measured.rate);
                            report.push(key, measured);
                        }
                    }
                }
                bench
                    .acked_after_standbys(wanted, &args, &load, &mut report)
                    .await?;
                if let Some(ordered) = &ordered {
                    let runs: &[(&str, bool)] = match wanted {
                        Mode::PerMessage => &[(PER_MESSAGE_ORDERED, false)],
                        _ => &[(BATCH_ORDERED, false), (BATCH_POISONED, true)],
                    };
                    for &(key, poisoned) in runs {
                        let run = Run {
                            records: IDEM_RECORDS,
                            floor: 0,
                            outbox: false,
                            removal: None,
                            poisoned,
                        };
                        let measured = ordered
                            .run_afresh(&config.worker_binary, &load, &args, run)
                            .await?;
                        eprintln!("  {:<30} {:>9.0} msgs/s", label(key), measured.rate);
                        report.push(key.to_owned(), measured);
                    }
                }
                if config.contenders {
                    let (key, args) = match wanted {
                        Mode::PerMessage => (TEXTBOOK, bench.contender_args(Contender::Textbook)),
                        _ => (BATCHED, bench.contender_args(Contender::Batched)),
                    };
                    let run = Run {
                        records: contender::TABLE,
                        floor: 0,
                        outbox: false,
                        removal: None,
                        poisoned: false,
                    };
                    let measured = bench
                        .run_afresh(&config.worker_binary, &load, &args, run)
                        .await?;
                    eprintln!("  {:<30} {:>9.0} msgs/s", label(key), measured.rate);
                    report.push(key.to_owned(), measured);
                }
            }
            if config.outbox && config.modes.contains(&Mode::Batch) {
                let mut args = bench.batch_args();
                args.extend(["--credits-exchange".into(), bench.topology.exchange.clone()]);
                for (key, binary) in builds(config, [BATCH_OUTBOX, BATCH_OUTBOX_BASELINE], round) {
                    let run = Run {
                        records: IDEM_RECORDS,
                        floor: 0,
                        outbox: true,
                        removal: None,
                        poisoned: false,
                    };
                    let measured = bench.run_afresh(binary, &load, &args, run).await?;
                    eprintln!("  {:<30} {:>9.0} msgs/s", label(key), measured.rate);
                    report.push(key.to_owned(), measured);
                }
                let alone = bench.publish_alone(&load).await?;
                eprintln!(
                    "  {:<30} {:>9.0} msgs/s",
                    label(PUBLISHED_ALONE),
                    alone.rate
                );
                report.push(PUBLISHED_ALONE.to_owned(), alone);
                report.credits_per_message =
                    generate::distinct_events(&load) as f64 / load.len() as f64;
            }
            if config.pgbench {
                for (transaction, runs) in [
                    (PgbenchScript::Tally, &mut report.pgbench),
                    (PgbenchScript::General, &mut report.pgbench_general),
                    (PgbenchScript::Textbook, &mut report.pgbench_textbook),
                ] {
                    bench.reset().await?;
                    let (name, script) = match transaction {
                        // Into the epoch the reset opened.
                        PgbenchScript::Tally => {
                            ("idem's tally", pgbench_script(bench.current_epoch().await?))
                        }
                        PgbenchScript::General => ("idem's general path", pgbench_general_script()),
                        PgbenchScript::Textbook => ("textbook", PGBENCH_TEXTBOOK.to_owned()),
                    };
                    let run = bench.pgbench(&script).await?;
                    eprintln!("  pgbench, {name:<20} {:>9.0} tps", run.tps);
                    runs.push(run);
                }
            }
        }
        Ok(report)
    }
}

impl Bench<'_> {
    /// With `--ack-after-standbys`, `wanted`'s run once more with it.
    async fn acked_after_standbys(
        &self,
        wanted: Mode,
        args: &[String],
        load: &[PaymentSucceeded],
        report: &mut BenchReport,
    ) -> anyhow::Result<()> {
        let Some(standbys) = self.config.ack_after_standbys else {
            return Ok(());
        };
        let key = match wanted {
            Mode::PerMessage => PER_MESSAGE_STANDBYS,
            _ => BATCH_STANDBYS,
        };
        let mut args = args.to_vec();
        args.extend(["--ack-after-standbys".into(), standbys.to_string()]);
        let run = Run {
            records: IDEM_RECORDS,
            floor: 0,
            outbox: false,
            removal: None,
            poisoned: false,
        };
        let measured = self
            .run_afresh(&self.config.worker_binary, load, &args, run)
            .await?;
        eprintln!("  {:<30} {:>9.0} msgs/s", label(key), measured.rate);
        report.push(key.to_owned(), measured);
        Ok(())
    }
}

/// The bench's own schema and topology.
#[derive(Clone)]
pub(super) struct Bench<'a> {
    pub(super) config: &'a BenchConfig,
    pub(super) schema: String,
    pub(super) topology: Topology,
    pub(super) database: DatabaseConfig,
    pub(super) pool: Pool,
}

impl<'a> Bench<'a> {
    pub(super) async fn new(config: &'a BenchConfig) -> anyhow::Result<Self> {
        let schema = format!("idem_bench_{}", std::process::id());
        let mut database = config.database.clone().with_schema(&schema);
        database.pool_size = 2;
        let pool = database.pool()?;
        Ok(Self {
            config,
            topology: Self::topologies(config, std::process::id())[0].clone(),
            schema,
            database,
            pool,
        })
    }

    /// The topologies of the bench process `pid`: its unordered one, then,
    /// with `--ordered`, its ordered one.
    fn topologies(config: &BenchConfig, pid: u32) -> Vec<Topology> {
        let unordered = points::topology().prefixed(&format!("idem-bench-{pid}."));
        let ordered = config.ordered.map(|slots| {
            points::topology()
                .prefixed(&format!("idem-bench-{pid}-ordered."))
                .ordered(slots)
        });
        std::iter::once(unordered).chain(ordered).collect()
    }

    /// The same bench on its ordered topology, with `--ordered`.
    pub(super) fn ordered(&self) -> Option<Self> {
        let topology = Self::topologies(self.config, std::process::id())
            .get(1)?
            .clone();
        Some(Self {
            topology,
            ..self.clone()
        })
    }

    /// The order whose events fail in a poisoned run: the first event's,
    /// so that its head fails before any of its later events come.
    pub(super) fn poisoned_key(load: &[PaymentSucceeded]) -> &str {
        load.first().map_or("", |event| event.order_id.as_str())
    }

    /// A trigger on the points that fails every credit of the poisoned
    /// key ([`Bench::poisoned_key`]) when `poisoned`, else of no key: the
    /// same trigger in every ordered run, so that only the failing differs.
    pub(super) async fn poison(
        &self,
        load: &[PaymentSucceeded],
        poisoned: bool,
    ) -> anyhow::Result<()> {
        let key = if poisoned {
            Self::poisoned_key(load)
        } else {
            "no order at all"
        };
        let key = key.replace('\'', "''");
        self.pool
            .get()
            .await?
            .batch_execute(&format!(
                "CREATE FUNCTION bench_poisoned() RETURNS trigger LANGUAGE plpgsql AS \
                 $$ BEGIN RAISE EXCEPTION 'order % is poisoned (idem bench)', NEW.order_id; END $$; \
                 CREATE TRIGGER bench_poisoned BEFORE INSERT OR UPDATE ON user_points \
                 FOR EACH ROW WHEN (NEW.order_id = '{key}') EXECUTE FUNCTION bench_poisoned()"
            ))
            .await
            .context("installing the poisoned key's trigger")?;
        Ok(())
    }

    /// The current epoch of the bench's schema.
    pub(super) async fn current_epoch(&self) -> anyhow::Result<i32> {
        Ok(self
            .pool
            .get()
            .await?
            .query_one("SELECT max(epoch) FROM mq_consume_epoch", &[])
            .await?
            .try_get(0)?)
    }

    /// An empty schema and an empty topology, with a queue that takes the
    /// credits the outbox sends (to the topology's exchange).
    pub(super) async fn reset(&self) -> anyhow::Result<()> {
        self.remove().await?;
        migrate::run::<Points>(&self.pool, Some(&self.schema)).await?;
        self.pool
            .get()
            .await?
            .batch_execute(contender::CREATE_TABLE)
            .await?;
        let connection = connect(&self.config.amqp, "idem bench").await?;
        self.topology.declare(&connection).await?;
        let channel = connection.create_channel().await?;
        // Not durable, unlike a downstream service's: what the bench
        // measures is idem's side of the publish, not the queue's disk.
        let credited = credited_queue(&self.topology);
        channel
            .queue_declare(
                credited.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_bind(
                credited.as_str().into(),
                self.topology.exchange.as_str().into(),
                points::CREDITED_ROUTING_KEY.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        channel.close(200, "OK".into()).await?;
        connection.close(200, "OK".into()).await?;
        Ok(())
    }

    pub(super) async fn remove(&self) -> anyhow::Result<()> {
        Self::remove_objects(
            self.config,
            &self.pool,
            &self.schema,
            &Self::topologies(self.config, std::process::id()),
        )
        .await
    }

    /// Removes the schema and topology of earlier bench processes that died
    /// (their names carry the pid of a process that no longer runs).
    pub(super) async fn sweep_leftovers(&self) {
        let Ok(client) = self.pool.get().await else {
            return;
        };
        let Ok(rows) = client
            .query(
                "SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'idem\\_bench\\_%'",
                &[],
            )
            .await
        else {
            return;
        };
        for row in rows {
            let Ok(schema) = row.try_get::<_, String>(0) else {
                continue;
            };
            let Some(pid) = schema.strip_prefix("idem_bench_") else {
                continue;
            };
            if std::path::Path::new(&format!("/proc/{pid}")).exists() {
                continue;
            }
            let Ok(pid) = pid.parse() else {
                continue;
            };
            let topologies = Self::topologies(self.config, pid);
            if let Err(error) =
                Self::remove_objects(self.config, &self.pool, &schema, &topologies).await
            {
                eprintln!("could not remove the leftovers of bench {pid}: {error:#}");
            }
        }
    }

    pub(super) async fn remove_objects(
        config: &BenchConfig,
        pool: &Pool,
        schema: &str,
        topologies: &[Topology],
    ) -> anyhow::Result<()> {
        let client = pool.get().await.context("cannot reach PostgreSQL")?;
        client
            .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .await?;
        let connection = connect(&config.amqp, "idem bench").await?;
        let channel = connection.create_channel().await?;
        for topology in topologies {
            topology.delete(&channel).await?;
            channel
                .queue_delete(
                    credited_queue(topology).as_str().into(),
                    QueueDeleteOptions::default(),
                )
                .await?;
        }
        channel.close(200, "OK".into()).await?;
        connection.close(200, "OK".into()).await?;
        Ok(())
    }

    /// Publishes the load, each event with its order as its ordering key
    /// when the queue is ordered.
    pub(super) async fn publish(&self, load: &[PaymentSucceeded]) -> anyhow::Result<()> {
        let ordered = self.topology.is_ordered();
        let messages: Vec<Outgoing> = load
            .iter()
            .map(|event| {
                let message = self.topology.event(event.to_body());
                if ordered {
                    message.with_ordering_key(&event.order_id)
                } else {
                    message
                }
            })
            .collect();
        self.publish_confirmed(&messages, 2000, "the load").await
    }

    /// Publishes `messages` with `publish_all`, `window` confirms at once,
    /// and fails unless every one of them (`what`) was confirmed.
    pub(super) async fn publish_confirmed(
        &self,
        messages: &[Outgoing],
        window: usize,
        what: &str,
    ) -> anyhow::Result<()> {
        let options = PublishOptions {
            window,
            patience: Duration::from_secs(10),
        };
        let report = publish_all(
            &self.config.amqp,
            messages,
            &options,
            &CancellationToken::new(),
        )
        .await?;
        ensure!(
            report.all_confirmed(),
            "{what} was not confirmed: {report:?}"
        );
        Ok(())
    }

    /// The outbox run's credits published again as the relay sent them
    /// (the handler's messages of each event, under their keys), alone,
    /// the way `idem publish` publishes (`publish_all`, its default window
    /// of confirms), to the same queue emptied first: what a confirmed
    /// publish of those messages costs the broker and the publisher
    /// without a relay around it.
    pub(super) async fn publish_alone(
        &self,
        load: &[PaymentSucceeded],
    ) -> anyhow::Result<Measurement> {
        let handler = Points.announcing(self.topology.exchange.as_str());
        let mut seen = std::collections::HashSet::new();
        let messages: Vec<Outgoing> = load
            .iter()
            .filter(|event| seen.insert(event.event_id.as_str()))
            .flat_map(|event| {
                let id = |index| message_id(points::CONSUMER_GROUP, &event.event_id, index);
                handler
                    .outgoing(event)
                    .into_iter()
                    .enumerate()
                    .map(move |(index, message)| Unsent {
                        taken: idem::store::outbox::Taken::Row(0),
                        message_id: id(index).to_string(),
                        exchange: message.exchange,
                        routing_key: message.routing_key,
                        content_type: message.content_type,
                        headers: message.headers,
                        body: message.body,
                        attempts: 0,
                        ordering_key: None,
                        held: false,
                    })
            })
            .map(|unsent| idem::relay::outgoing(&unsent))
            .collect();
        let connection = connect(&self.config.amqp, "idem bench").await?;
        let channel = connection.create_channel().await?;
        channel
            .queue_purge(
                credited_queue(&self.topology).as_str().into(),
                QueuePurgeOptions::default(),
            )
            .await?;
        close_channel(&channel).await;
        close(&connection).await;
        settle_down().await;
        let me = std::process::id();
        let (services, before) = (ServiceCpu::now(), ProcessUsage::read(me));
        let started = Instant::now();
        self.publish_confirmed(
            &messages,
            PublishOptions::DEFAULT_WINDOW,
            "the credits published alone",
        )
        .await?;
        let elapsed = started.elapsed();
        let (_, rabbitmq) = ServiceCpu::now().per_message(&services, messages.len() as f64);
        let publisher = ProcessUsage::read(me).zip(before).map(|(after, before)| {
            (after.cpu - before.cpu).as_secs_f64() * 1e6 / messages.len() as f64
        });
        Ok(Measurement {
            rate: messages.len() as f64 / elapsed.as_secs_f64(),
            cpu_us_per_message: publisher,
            rabbitmq_us_per_message: rabbitmq,
            ..Measurement::default()
        })
    }

    /// Consumes `messages` and acks them with `multiple`, as fast as the
    /// broker delivers.
    pub(super) async fn ceiling(&self, messages: usize) -> anyhow::Result<Measurement> {
        let connection = connect(&self.config.amqp, "idem bench ceiling").await?;
        let channel = connection.create_channel().await?;
        channel
            .basic_qos(self.config.prefetch, BasicQosOptions::default())
            .await?;
        let mut consumer = channel
            .basic_consume(
                self.topology.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        // Ack a tenth of the window at a time, so that the broker never waits.
        let every = (usize::from(self.config.prefetch) / 10).max(1);
        let services = ServiceCpu::now();
        let mut started = None;
        for n in 1..=messages {
            let delivery = consumer
                .next()
                .await
                .context("the consumer ended early")??;
            started.get_or_insert_with(Instant::now);
            if n % every == 0 || n == messages {
                channel
                    .basic_ack(delivery.delivery_tag, BasicAckOptions { multiple: true })
                    .await?;
            }
        }
        let elapsed = started.map_or(Duration::ZERO, |s| s.elapsed());
        let (_, rabbitmq) = ServiceCpu::now().per_message(&services, messages as f64);
        channel.close(200, "OK".into()).await?;
        connection.close(200, "OK".into()).await?;
        Ok(Measurement {
            rate: messages as f64 / elapsed.as_secs_f64(),
            rabbitmq_us_per_message: rabbitmq,
            ..Measurement::default()
        })
    }

    pub(super) fn common_args(&self) -> Vec<String> {
        let mut args = vec![
            "worker".into(),
            "--prefetch".into(),
            self.config.prefetch.to_string(),
        ];
        if let Some(records) = self.config.epoch_records {
            args.extend(["--epoch-records".into(), records.to_string()]);
        }
        args
    }

    /// `args` run by `binary` as [`Bench::worker`] does, on an empty
    /// schema and topology with the load published anew.
    pub(super) async fn run_afresh(
        &self,
        binary: &std::path::Path,
        load: &[PaymentSucceeded],
        args: &[String],
        run: Run,
    ) -> anyhow::Result<Measurement> {
        self.reset().await?;
        if self.topology.is_ordered() {
            self.poison(load, run.poisoned).await?;
        }
        self.publish(load).await?;
        settle_down().await;
        self.worker(binary, args, load, run).await
    }

    /// A contender with the settings of the mode it stands beside.
    pub(super) fn contender_args(&self, contender: Contender) -> Vec<String> {
        let peer = &self.config.peer;
        let prefetch = match contender {
            Contender::Textbook => self.config.prefetch,
            Contender::Batched => peer.prefetch,
        };
        let mut args: Vec<String> = vec![
            "contender".into(),
            contender.as_arg().into(),
            "--prefetch".into(),
            prefetch.to_string(),
        ];
        match contender {
            Contender::Textbook => args.extend([
                "--in-flight".into(),
                self.config.per_message_in_flight.to_string(),
            ]),
            // Its own batches (by default 1,000 deliveries or 5 ms, 2 in
            // flight: the fastest of a sweep).
            Contender::Batched => args.extend([
                "--batch-size".into(),
                peer.batch_size.to_string(),
                "--batch-wait".into(),
                "5ms".into(),
                "--in-flight".into(),
                peer.in_flight.to_string(),
            ]),
        }
        args
    }

    pub(super) fn per_message_args(&self) -> Vec<String> {
        let mut args = self.common_args();
        args.extend([
            "--mode".into(),
            idem::worker::Mode::PerMessage.as_flag().into(),
            "--max-in-flight".into(),
            self.config.per_message_in_flight.to_string(),
        ]);
        args
    }

    pub(super) fn batch_args(&self) -> Vec<String> {
        let mut args = self.common_args();
        args.extend([
            "--mode".into(),
            idem::worker::Mode::Batch.as_flag().into(),
            "--batch-size".into(),
            self.config.batch_size.to_string(),
            "--batch-wait".into(),
            format!("{}ms", self.config.batch_wait.as_millis()),
            "--max-in-flight".into(),
            self.config.batch_in_flight.to_string(),
        ]);
        args
    }

    /// The prefilled epochs' records ([`prefill_layout`]).
    pub(super) fn layout(&self, count: u64) -> Vec<u64> {
        prefill_layout(
            count,
            self.config.prefill_epochs,
            self.config
                .epoch_records
                .unwrap_or(EpochSettings::DEFAULT_MAX_RECORDS),
        )
    }

    /// Fills the consume records with `prefill` rows of random UUID ids in
    /// the worker's consumer group, spread over epochs ([`Bench::layout`])
    /// a day apart, the last of them current (a retention window of that
    /// many days, at the end of its last day), fast: each partition's
    /// unique index is dropped, the rows loaded, the index built again.
    /// Then VACUUM, for a table as a long-running one is, the closed
    /// epochs' filters, as the workers that closed them would have built
    /// them, and a checkpoint, so that the run starts where a steady state
    /// would. Returns the highest id among them: the run's own records are
    /// above it.
    pub(super) async fn prefill(&self, count: u64) -> anyhow::Result<i64> {
        if count == 0 {
            return Ok(0);
        }
        let started = Instant::now();
        let mut client = self.pool.get().await?;
        client
            .batch_execute("SET statement_timeout = 0; SET maintenance_work_mem = '512MB'")
            .await?;
        let layout = self.layout(count);
        let epochs = layout.len() as i64;
        for (day, rows) in (0..).zip(&layout) {
            if day > 0 {
                client.batch_execute("SELECT mq_open_epoch()").await?;
            }
            let epoch: i32 = client
                .query_one("SELECT max(epoch) FROM mq_consume_epoch", &[])
                .await?
                .try_get(0)?;
            let partition = format!("mq_consume_record_{epoch}");
            let rows = i64::try_from(*rows)?;
            client
                .batch_execute(&format!(
                    "ALTER TABLE {partition} DROP CONSTRAINT {partition}_key"
                ))
                .await?;
            client
                .execute(
                    "INSERT INTO mq_consume_record \
                         (event_id, consumer_group, digest, consumed_at, epoch) \
                     SELECT id, $1, mq_digest($1, id), \
                         now() - make_interval(days => $3::int), $4 \
                     FROM (SELECT gen_random_uuid()::text AS id \
                           FROM generate_series(1, $2::bigint)) AS ids",
                    &[
                        &points::CONSUMER_GROUP,
                        &rows,
                        &i32::try_from(epochs - 1 - day)?,
                        &epoch,
                    ],
                )
                .await
                .context("prefilling the consume records")?;
            client
                .batch_execute(&format!(
                    "ALTER TABLE {partition} \
                     ADD CONSTRAINT {partition}_key UNIQUE (digest)"
                ))
                .await?;
        }
        // A day apart, the current one opened a day ago: as a daily
        // rotation leaves them.
        client
            .batch_execute(
                "UPDATE mq_consume_epoch SET opened_at = now() - \
                 make_interval(days => (SELECT max(epoch) FROM mq_consume_epoch) - epoch + 1)",
            )
            .await?;
        client
            .batch_execute("VACUUM (ANALYZE) mq_consume_record")
            .await?;
        let filtering = Instant::now();
        let synced = Filters::default()
            .sync(&mut client, usize::MAX, true)
            .await
            .context("building the closed epochs' filters")?;
        eprintln!(
            "  built the filters of {} closed epochs in {:.0} s",
            synced.built.len(),
            filtering.elapsed().as_secs_f64()
        );
        if let Err(error) = client.batch_execute("CHECKPOINT").await {
            eprintln!(
                "  no checkpoint after the prefill ({}): the run may write fewer full pages than a steady state",
                idem::store::describe(&error)
            );
        }
        client
            .batch_execute("RESET statement_timeout; RESET maintenance_work_mem")
            .await?;
        let floor: i64 = client
            .query_one("SELECT coalesce(max(id), 0) FROM mq_consume_record", &[])
            .await?
            .try_get(0)?;
        eprintln!(
            "  prefilled {count} consume records in {:.0} s",
            started.elapsed().as_secs_f64()
        );
        Ok(floor)
    }

    /// Runs `binary worker` with `args` until the load is applied, checks
    /// the result, and measures. The run's consume records are those
    /// whose id is above `floor`.
    pub(super) async fn worker(
        &self,
        binary: &std::path::Path,
        args: &[String],
        load: &[PaymentSucceeded],
        run: Run,
    ) -> anyhow::Result<Measurement> {
        let Run {
            records: table,
            floor,
            outbox,
            removal,
            poisoned,
        } = run;
        let mut removing = None;
        let client = self.pool.get().await?;
        let wal_before = wal(&client).await;
        let services = ServiceCpu::now();
        let mut worker = tokio::process::Command::new(binary);
        if let Some(ca_file) = &self.database.ca_file {
            worker.env(vars::DATABASE_CA_FILE, ca_file);
        }
        if let Some(ca_file) = &self.config.amqp.ca_file {
            worker.env(vars::AMQP_CA_FILE, ca_file);
        }
        let mut child = worker
            .env(vars::AMQP_URL, self.config.amqp.url.expose())
            .env(vars::DATABASE_URL, self.database.url.expose())
            .env(vars::SCHEMA, &self.schema)
            .envs(vars::topology(&self.topology))
            .env("RUST_LOG", "error")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("cannot start the worker")?;
        let pid = child.id().context("the worker exited at once")?;
        let poison = Poison::of(load, poisoned);
        let distinct = generate::distinct_events(load) as i64 - poison.distinct;
        let probe = QueueProbe::open(&self.config.amqp).await?;
        // No deadline for the whole load, which a slow machine stretches
        // without end; only for a stall: nothing taken, nothing recorded.
        const STALL: Duration = Duration::from_secs(120);
        let mut seen = (u32::MAX, -1);
        // Counted until every event is: the count scans the records, and
        // would load the database while the relay still sends.
        let mut all_recorded = false;
        let mut progressed = Instant::now();
        let mut all_sent: Option<String> = None;
        loop {
            // The broker first: counting records scans the table, which
            // would load the database under measurement.
            let ready = probe.ready_in(&self.topology.consumed_queues()).await?;
            if let Some(epochs) = removal
                && removing.is_none()
                && (ready as usize) < load.len() / 2
            {
                removing = Some(tokio::spawn(remove_oldest_day(self.pool.clone(), epochs)));
            }
            let mut recorded = -1;
            if ready == 0 {
                recorded = if all_recorded {
                    distinct
                } else {
                    client
                        .query_one(
                            &format!("SELECT count(*) FROM {table} WHERE id > $1"),
                            &[&floor],
                        )
                        .await?
                        .try_get(0)?
                };
                all_recorded = recorded >= distinct && poison.all_parked(&client).await?;
                if all_recorded && (!outbox || idem::store::outbox::unsent(&client).await? == 0) {
                    // A relay removes what it sent: the last is sent by now
                    // (within the 50 ms between two looks).
                    if outbox {
                        all_sent = Some(
                            client
                                .query_one("SELECT clock_timestamp()::text", &[])
                                .await?
                                .try_get(0)?,
                        );
                    }
                    break;
                }
            }
            if (ready, recorded) != seen {
                seen = (ready, recorded);
                progressed = Instant::now();
            }
            if let Ok(Some(status)) = child.try_wait() {
                bail!("the worker exited with {status} before the load was applied");
            }
            ensure!(
                progressed.elapsed() < STALL,
                "the worker made no progress for {} s ({ready} messages ready)",
                STALL.as_secs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if outbox {
            // Confirmed, each in the queue bound for the credits: exactly
            // one per event, since nothing was killed.
            let credited = probe.ready(&credited_queue(&self.topology)).await?;
            ensure!(
                i64::from(credited) == distinct,
                "{credited} credits sent for {distinct} events"
            );
        }
        probe.close().await;
        if let Some(removing) = removing {
            let (dropped, took) = removing.await??;
            ensure!(
                !dropped.is_empty(),
                "the removal during the run dropped no epoch"
            );
            eprintln!(
                "  removed epochs {dropped:?} in {:.0} ms while the worker ran",
                took.as_secs_f64() * 1e3
            );
        }
        let usage = ProcessUsage::read(pid);
        let (postgres, rabbitmq) = ServiceCpu::now().per_message(&services, load.len() as f64);
        let lsn_after = wal_lsn(&client).await;
        let stopped = tokio::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .await?;
        ensure!(stopped.success(), "cannot stop the worker");
        let status = tokio::time::timeout(Duration::from_secs(60), child.wait()).await??;
        ensure!(status.success(), "the worker exited with {status}");
        let fpi_after = settled_fpi(&client).await;

        // With the outbox, until the last message was sent.
        let span: f64 = client
            .query_one(
                &format!(
                    "SELECT extract(epoch FROM greatest(max(consumed_at), \
                         $2::text::timestamptz) - min(consumed_at))::float8 \
                     FROM {table} WHERE id > $1"
                ),
                &[&floor, &all_sent],
            )
            .await?
            .try_get(0)?;
        self.verify(load, table, floor, &poison).await?;
        // The poisoned key's messages wait, and count for nothing.
        let messages = (load.len() - poison.messages) as f64;
        let wal_bytes = match (&wal_before, lsn_after) {
            (Some(before), Some(after)) => client
                .query_one(
                    "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)::float8",
                    &[&after, &before.lsn],
                )
                .await
                .ok()
                .and_then(|row| row.try_get::<_, f64>(0).ok()),
            _ => None,
        };
        let wal_fpi = wal_before
            .as_ref()
            .zip(fpi_after)
            .map(|(before, after)| after - before.fpi);
        Ok(Measurement {
            rate: messages / span.max(1e-3),
            cpu_us_per_message: usage.as_ref().map(|u| u.cpu.as_secs_f64() * 1e6 / messages),
            peak_rss_mib: usage.map(|u| u.peak_rss_kib as f64 / 1024.0),
            postgres_us_per_message: postgres,
            rabbitmq_us_per_message: rabbitmq,
            wal_bytes_per_message: wal_bytes.map(|bytes| bytes / messages),
            wal_fpi_per_message: wal_fpi.map(|fpi| fpi / messages),
        })
    }

    /// Every order at its exact total, one record per distinct event (above
    /// `floor`, the prefilled ones), nothing dead-lettered; with a poisoned
    /// key, every other key so, and the poisoned one parked, none of its
    /// events applied, at most its head dead-lettered.
    pub(super) async fn verify(
        &self,
        load: &[PaymentSucceeded],
        table: &str,
        floor: i64,
        poison: &Poison,
    ) -> anyhow::Result<()> {
        let client = self.pool.get().await?;
        let points: BTreeMap<String, i64> = client
            .query("SELECT order_id, points FROM user_points", &[])
            .await?
            .iter()
            .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
            .collect::<Result<_, tokio_postgres::Error>>()?;
        let mut expected = generate::expected_points(load);
        if let Some(key) = &poison.key {
            expected.remove(key);
            let parked: Vec<String> = client
                .query("SELECT ordering_key FROM mq_parked_key", &[])
                .await?
                .iter()
                .map(|row| row.try_get(0))
                .collect::<Result<_, _>>()?;
            ensure!(
                parked == [key.clone()],
                "parked keys {parked:?}, expected only {key}"
            );
        }
        ensure!(points == expected, "per-order totals are wrong");
        let (records, events): (i64, i64) = {
            let row = client
                .query_one(
                    &format!(
                        "SELECT count(*), count(DISTINCT event_id) FROM {table} WHERE id > $1"
                    ),
                    &[&floor],
                )
                .await?;
            (row.try_get(0)?, row.try_get(1)?)
        };
        let distinct = generate::distinct_events(load) as i64 - poison.distinct;
        ensure!(
            records == distinct && events == distinct,
            "{records} records for {distinct} events"
        );
        let probe = QueueProbe::open(&self.config.amqp).await?;
        let dead = probe.ready(&self.topology.dead_letter_queue).await;
        probe.close().await;
        let dead = dead?;
        let head = u32::from(poison.key.is_some());
        ensure!(dead <= head, "{dead} messages were dead-lettered");
        Ok(())
    }

    /// pgbench at 16 clients for 10 s running `transaction` (a pgbench
    /// script) on fresh event ids, in the bench's schema.
    pub(super) async fn pgbench(&self, transaction: &str) -> anyhow::Result<Pgbench> {
        let script = std::env::temp_dir().join(format!("{}.sql", self.schema));
        std::fs::write(&script, transaction)?;
        self.pool
            .get()
            .await?
            .batch_execute(&format!(
                "SET search_path TO {schema}; {PGBENCH_TEXTBOOK_TABLES}",
                schema = self.schema
            ))
            .await?;
        settle_down().await;
        let before = ServiceCpu::now();
        let output = tokio::process::Command::new("pgbench")
            .env("PGOPTIONS", format!("-c search_path={}", self.schema))
            .args([
                "--no-vacuum",
                "--client=16",
                "--jobs=2",
                "--time=10",
                "--protocol=prepared",
            ])
            .arg(format!("--file={}", script.display()))
            .arg(format!("--define=orders={}", self.config.orders))
            .arg(self.database.url.expose())
            .output()
            .await
            .context("cannot run pgbench (is it installed?)")?;
        let _ = std::fs::remove_file(&script);
        let stdout = String::from_utf8_lossy(&output.stdout);
        ensure!(
            output.status.success(),
            "pgbench failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let after = ServiceCpu::now();
        let field = |prefix: &str| {
            stdout.lines().find_map(|line| {
                let rest = line.strip_prefix(prefix)?;
                rest.split_whitespace().next()?.parse::<f64>().ok()
            })
        };
        let tps = field("tps = ").context("no tps in pgbench's output")?;
        let transactions = field("number of transactions actually processed: ")
            .context("no transaction count in pgbench's output")?;
        let (postgres_us, _) = after.per_message(&before, transactions);
        Ok(Pgbench { tps, postgres_us })
    }
}

/// The poisoned key of a run, if any: its events, and how to tell that
/// every one but its head is parked.
#[derive(Debug, Default)]
pub(super) struct Poison {
    /// The key.
    pub(super) key: Option<String>,
    /// Its distinct events.
    pub(super) distinct: i64,
    /// Its messages, duplicates included.
    pub(super) messages: usize,
}

impl Poison {
    pub(super) fn of(load: &[PaymentSucceeded], poisoned: bool) -> Self {
        if !poisoned {
            return Self::default();
        }
        let key = Bench::poisoned_key(load);
        let events: Vec<PaymentSucceeded> = load
            .iter()
            .filter(|event| event.order_id == key)
            .cloned()
            .collect();
        Self {
            key: Some(key.to_owned()),
            distinct: generate::distinct_events(&events) as i64,
            messages: events.len(),
        }
    }

    /// Whether every event of the key but its head is parked (the head
    /// too, while it waits for its next attempt).
    pub(super) async fn all_parked(
        &self,
        client: &deadpool_postgres::Client,
    ) -> anyhow::Result<bool> {
        let Some(key) = &self.key else {
            return Ok(true);
        };
        let parked: i64 = client
            .query_one(
                "SELECT count(*) FROM mq_parked_event WHERE ordering_key = $1",
                &[key],
            )
            .await?
            .try_get(0)?;
        Ok(parked >= self.distinct - 1)
    }
}
