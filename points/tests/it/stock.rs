//! The second handler, `examples/stock`, run as its own worker process
//! against the real services: nothing in idem knows it, and every guarantee
//! holds for it as for the points handler.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::ensure;
use deadpool_postgres::Pool;

use idem::broker::{AmqpConfig, Topology, connect};
use idem::secret::SecretUrl;
use idem::store::DatabaseConfig;
use idem::vars;
use idem::worker::Mode;

use crate::proxy::Proxy;
use crate::support::{
    TEST_RETRY_DELAYS, Vhost, WorkerProcess, clean_up, database_url, drop_schema, example_binary,
    peek, publish, ready, unique_name, wait_for,
};

/// The example's topology and consumer group: its own, not the points
/// worker's; with the tests' short retry delays, which the example is told.
fn topology() -> Topology {
    Topology {
        retry: idem::RetryPolicy::default().with_delays(TEST_RETRY_DELAYS.to_vec()),
        ..Topology::for_queue("stock.reservations").bound_to("inventory", "stock.reserve")
    }
}

const GROUP: &str = "stock-reservations";

/// A reservation as a producer sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Reservation {
    event_id: String,
    sku: String,
    quantity: i64,
}

impl Reservation {
    fn new(event_id: &str, sku: &str, quantity: i64) -> Self {
        Self {
            event_id: event_id.into(),
            sku: sku.into(),
            quantity,
        }
    }

    fn body(&self) -> Vec<u8> {
        serde_json::json!({"eventId": self.event_id, "sku": self.sku, "quantity": self.quantity})
            .to_string()
            .into_bytes()
    }
}

/// A vhost and a schema of the test's own, for the example.
struct StockEnv {
    name: String,
    /// The example's binary.
    binary: PathBuf,
    /// Dropped last: it takes the queues with it.
    vhost: Vhost,
    amqp: AmqpConfig,
    pool: Pool,
}

impl StockEnv {
    /// The example's topology declared on a vhost of its own, and its
    /// tables migrated by the example itself into a schema of its own.
    async fn new() -> anyhow::Result<Self> {
        let vhost = Vhost::add(".*", ".*", ".*")?;
        let name = unique_name();
        let amqp = AmqpConfig::new(SecretUrl::new(vhost.amqp_url()));
        let pool = DatabaseConfig::new(SecretUrl::new(database_url()))
            .with_schema(&name)
            .pool()?;
        let env = Self {
            name,
            binary: example_binary("stock")?,
            vhost,
            amqp,
            pool,
        };
        let connection = connect(&env.amqp, "idem stock test").await?;
        topology().declare(&connection).await?;
        connection.close(200, "OK".into()).await?;
        let migrated = env
            .example(&database_url(), Mode::Batch)
            .arg("migrate")
            .output()
            .await?;
        ensure!(
            migrated.status.success(),
            "stock migrate: {}",
            String::from_utf8_lossy(&migrated.stderr)
        );
        Ok(env)
    }

    /// The example's binary, pointed at this vhost and schema only.
    fn example(&self, database_url: &str, mode: Mode) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.binary);
        command
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env(vars::AMQP_URL, self.vhost.amqp_url())
            .env(vars::DATABASE_URL, database_url)
            .env(vars::SCHEMA, &self.name)
            .env(vars::MODE, mode.as_flag())
            .env(
                vars::RETRY_DELAYS,
                idem::duration::format_list(topology().retry.delays()),
            )
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        command
    }

    /// `stock worker` as a process of its own.
    fn worker(&self, database_url: &str, mode: Mode) -> anyhow::Result<WorkerProcess> {
        let mut command = self.example(database_url, mode);
        command.arg("worker");
        WorkerProcess::start(command)
    }

    /// The database's URL through a proxy on `port`.
    fn database_url_via(port: u16) -> String {
        crate::support::database_url_at(port)
    }

    async fn sql(&self, statements: &str) -> anyhow::Result<()> {
        self.pool.get().await?.batch_execute(statements).await?;
        Ok(())
    }

    async fn publish(&self, bodies: &[Vec<u8>]) -> anyhow::Result<()> {
        publish(&self.amqp, &topology(), bodies).await?;
        Ok(())
    }

    async fn available(&self) -> anyhow::Result<BTreeMap<String, i64>> {
        let client = self.pool.get().await?;
        let rows = client
            .query("SELECT sku::text, available FROM stock", &[])
            .await?;
        Ok(rows.iter().map(|row| (row.get(0), row.get(1))).collect())
    }

    async fn records(&self) -> anyhow::Result<i64> {
        let client = self.pool.get().await?;
        Ok(client
            .query_one(
                "SELECT count(*) FROM mq_consume_record WHERE consumer_group = $1",
                &[&GROUP],
            )
            .await?
            .get(0))
    }

    async fn dead_letters(&self) -> anyhow::Result<Vec<Vec<u8>>> {
        let mut bodies: Vec<Vec<u8>> = peek(&self.amqp, &topology().dead_letter_queue)
            .await?
            .into_iter()
            .map(|letter| letter.body)
            .collect();
        bodies.sort();
        Ok(bodies)
    }

    async fn wait_dead_letters(&self, n: u32) -> anyhow::Result<()> {
        wait_for(
            &format!("{n} dead letters"),
            Duration::from_secs(60),
            || async { Ok(ready(&self.amqp, &topology().dead_letter_queue).await? == n) },
        )
        .await
    }

    async fn wait_records(&self, n: i64, timeout: Duration) -> anyhow::Result<()> {
        wait_for(&format!("{n} consume records"), timeout, || async {
            Ok(self.records().await? >= n)
        })
        .await
    }

    /// Every distinct reservation of `load` applied once, the work queue
    /// empty, and the stock at exactly what is left of `initial`.
    async fn assert_exact(
        &self,
        initial: i64,
        load: &[Reservation],
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let mut seen = HashSet::new();
        let mut expected: BTreeMap<String, i64> = BTreeMap::new();
        for reservation in load {
            let left = expected.entry(reservation.sku.clone()).or_insert(initial);
            if seen.insert(reservation.event_id.as_str()) {
                *left -= reservation.quantity;
            }
        }
        self.wait_records(seen.len() as i64, timeout).await?;
        wait_for("the work queue to drain", timeout, || async {
            Ok(ready(&self.amqp, &topology().queue).await? == 0)
        })
        .await?;
        assert_eq!(
            self.records().await?,
            seen.len() as i64,
            "one record per reservation"
        );
        assert_eq!(self.available().await?, expected, "stock left per SKU");
        assert_eq!(self.dead_letters().await?, Vec::<Vec<u8>>::new());
        Ok(())
    }
}

impl Drop for StockEnv {
    fn drop(&mut self) {
        clean_up(drop_schema(self.name.clone()));
    }
}

/// `count` reservations over `skus` SKUs, a share of them sent twice.
fn reservations(env: &StockEnv, count: usize, skus: usize) -> Vec<Reservation> {
    let mut rng = fastrand::Rng::new();
    let mut load: Vec<Reservation> = Vec::with_capacity(count);
    for i in 0..count {
        if i > 0 && rng.f64() < 0.2 {
            let again = load[rng.usize(..load.len())].clone();
            load.push(again);
        } else {
            load.push(Reservation::new(
                &format!("{}-{i}", env.name),
                &format!("SKU-{}", rng.usize(..skus)),
                rng.i64(1..=5),
            ));
        }
    }
    load
}

/// Stock of each SKU of `load`.
async fn stock_up(env: &StockEnv, load: &[Reservation], units: i64) -> anyhow::Result<()> {
    let skus: HashSet<&str> = load.iter().map(|r| r.sku.as_str()).collect();
    let values: Vec<String> = skus
        .iter()
        .map(|sku| format!("('{sku}', {units})"))
        .collect();
    env.sql(&format!("INSERT INTO stock VALUES {}", values.join(", ")))
        .await
}

async fn stock_reservations_apply_once_and_an_oversold_one_is_dead_lettered_then_replayed(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = StockEnv::new().await?;
    env.sql("INSERT INTO stock VALUES ('SKU-A', 10), ('SKU-B', 100)")
        .await?;
    let first = Reservation::new("reservation-1", "SKU-A", 3);
    let second = Reservation::new("reservation-2", "SKU-A", 4);
    let oversold = Reservation::new("reservation-3", "SKU-A", 11);
    let fourth = Reservation::new("reservation-4", "SKU-B", 5);
    let unknown = Reservation::new("reservation-5", "SKU-Z", 1);
    let invalid = br#"{"eventId": "reservation-6", "sku": "SKU-B", "quantity": -2}"#.to_vec();
    let bodies = vec![
        first.body(),
        first.body(),
        second.body(),
        oversold.body(),
        fourth.body(),
        unknown.body(),
        fourth.body(),
        invalid.clone(),
    ];
    env.publish(&bodies).await?;

    let worker = env.worker(&database_url(), mode)?;
    env.wait_dead_letters(3).await?;
    let mut expected = vec![oversold.body(), unknown.body(), invalid.clone()];
    expected.sort();
    assert_eq!(env.dead_letters().await?, expected);
    assert_eq!(
        env.records().await?,
        3,
        "one record per applied reservation"
    );
    assert_eq!(
        env.available().await?,
        BTreeMap::from([("SKU-A".into(), 3), ("SKU-B".into(), 95)])
    );
    let client = env.pool.get().await?;
    let ledger: BTreeMap<String, (i32, String)> = client
        .query(
            "SELECT event_id::text, failures, last_error FROM mq_failure_ledger",
            &[],
        )
        .await?
        .iter()
        .map(|row| (row.get(0), (row.get(1), row.get(2))))
        .collect();
    let (failures, error) = &ledger["reservation-3"];
    assert_eq!(*failures, 5);
    assert!(error.contains("stock_available_check"), "{error}");
    let (failures, error) = &ledger["reservation-5"];
    assert_eq!(*failures, 1, "an unknown SKU is dead-lettered at once");
    assert_eq!(error, "no such SKU", "the SKU is the detail, not the text");

    // Restocked, and the missing SKU added: a replay applies both, once.
    env.sql(
        "UPDATE stock SET available = available + 20 WHERE sku = 'SKU-A';
         INSERT INTO stock VALUES ('SKU-Z', 5);",
    )
    .await?;
    let replay = env
        .example(&database_url(), mode)
        .arg("requeue")
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&replay.stdout);
    assert!(
        replay.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&replay.stderr)
    );
    assert!(stdout.contains("replayed 3 message(s)"), "{stdout}");
    env.wait_records(5, Duration::from_secs(30)).await?;
    // The invalid one is dead-lettered again at once.
    env.wait_dead_letters(1).await?;
    worker.stop().await?;
    assert_eq!(env.dead_letters().await?, vec![invalid]);
    assert_eq!(
        env.available().await?,
        BTreeMap::from([
            ("SKU-A".into(), 12),
            ("SKU-B".into(), 95),
            ("SKU-Z".into(), 4)
        ])
    );
    assert_eq!(env.records().await?, 5);
    Ok(())
}

async fn a_database_outage_holds_stock_reservations_and_dead_letters_none(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = StockEnv::new().await?;
    let database = Proxy::start(crate::support::postgres_address()).await?;
    let load = reservations(&env, 3000, 20);
    stock_up(&env, &load, 1_000_000).await?;
    let bodies: Vec<Vec<u8>> = load.iter().map(Reservation::body).collect();
    let (before, after) = bodies.split_at(bodies.len() / 2);
    env.publish(before).await?;

    let worker = env.worker(&StockEnv::database_url_via(database.port), mode)?;
    env.wait_records(300, Duration::from_secs(60)).await?;
    database.sever();
    // The rest goes out now, so that the worker has work to hold however
    // fast it went through the first half.
    env.publish(after).await?;
    wait_for(
        "the worker to hold its deliveries",
        Duration::from_secs(30),
        || async { Ok(worker.log().contains("database unavailable")) },
    )
    .await?;
    let during = env.records().await?;
    // It keeps trying: three connections turned away while severed.
    wait_for(
        "the worker to keep trying",
        Duration::from_secs(30),
        || async { Ok(database.turned_away() >= 3) },
    )
    .await?;
    assert_eq!(env.records().await?, during, "nothing commits in an outage");
    assert_eq!(ready(&env.amqp, &topology().dead_letter_queue).await?, 0);
    database.restore();

    env.assert_exact(1_000_000, &load, Duration::from_secs(90))
        .await?;
    let log = worker.stop().await?;
    assert!(log.contains("database answers again"), "{log}");
    Ok(())
}

async fn killing_the_stock_worker_mid_load_keeps_the_stock_exact(mode: Mode) -> anyhow::Result<()> {
    let env = StockEnv::new().await?;
    let load = reservations(&env, 4000, 20);
    stock_up(&env, &load, 1_000_000).await?;
    let bodies: Vec<Vec<u8>> = load.iter().map(Reservation::body).collect();
    env.publish(&bodies).await?;

    let mut first = env.worker(&database_url(), mode)?;
    env.wait_records(400, Duration::from_secs(60)).await?;
    first.kill().await?;
    let distinct = load
        .iter()
        .map(|r| &r.event_id)
        .collect::<HashSet<_>>()
        .len();
    assert!(
        env.records().await? < distinct as i64,
        "killed after the end"
    );
    let second = env.worker(&database_url(), mode)?;
    env.assert_exact(1_000_000, &load, Duration::from_secs(90))
        .await?;
    second.stop().await?;
    Ok(())
}

/// Runs the example's own `args` and returns what it printed, asserting it
/// exits 0.
async fn run_example(env: &StockEnv, args: &[&str]) -> anyhow::Result<String> {
    let ran = env
        .example(&database_url(), Mode::Batch)
        .args(args)
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&ran.stdout).into_owned();
    ensure!(
        ran.status.success(),
        "stock {args:?}: {stdout}{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    Ok(stdout)
}

/// The operator's commands of the example's own binary, against its dead
/// letters: the handler's decode gives the summary's verdicts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_stock_binary_triages_reports_prunes_and_replays_its_own_dead_letters()
-> anyhow::Result<()> {
    let env = StockEnv::new().await?;
    env.sql("INSERT INTO stock VALUES ('SKU-A', 10)").await?;
    let applied = Reservation::new("reservation-1", "SKU-A", 3);
    let oversold = Reservation::new("reservation-2", "SKU-A", 11);
    let unknown = Reservation::new("reservation-3", "SKU-Z", 1);
    let invalid = br#"{"eventId": "reservation-4", "sku": "SKU-A", "quantity": 0}"#.to_vec();
    env.publish(&[applied.body(), oversold.body(), unknown.body(), invalid])
        .await?;
    let worker = env.worker(&database_url(), Mode::Batch)?;
    env.wait_dead_letters(3).await?;
    worker.stop().await?;

    let summary = run_example(&env, &["dlq", "summary"]).await?;
    for expected in [
        "3 of 3 dead-lettered message(s) in stock.reservations.dlq match",
        "no such SKU",
        "stock_available_check",
        "a replay would apply 2, find 0 applied already; 1 invalid or unknown",
    ] {
        assert!(summary.contains(expected), "no {expected:?} in:\n{summary}");
    }
    let status = run_example(&env, &["status"]).await?;
    for expected in [
        "consumer group stock-reservations",
        "stock.reservations.dlq",
        "consume records    1",
        // The two that failed their transaction are dead-lettered now, so
        // nothing is still failing: the ledger's rows only count toward
        // "failing" while the event may yet be retried.
        "failure ledger     0 event(s) failing",
        "dead letters       rejected 3",
    ] {
        assert!(status.contains(expected), "no {expected:?} in:\n{status}");
    }
    let pruned = run_example(&env, &["prune", "--older-than", "30d"]).await?;
    assert!(
        pruned.contains("no epoch older than the window"),
        "{pruned}"
    );

    env.sql(
        "UPDATE stock SET available = available + 20 WHERE sku = 'SKU-A';
         INSERT INTO stock VALUES ('SKU-Z', 5);",
    )
    .await?;
    let replayed = run_example(&env, &["requeue"]).await?;
    assert!(replayed.contains("replayed 3 message(s)"), "{replayed}");
    let worker = env.worker(&database_url(), Mode::Batch)?;
    env.wait_records(3, Duration::from_secs(30)).await?;
    env.wait_dead_letters(1).await?;
    worker.stop().await?;
    assert_eq!(
        env.available().await?,
        BTreeMap::from([("SKU-A".into(), 16), ("SKU-Z".into(), 4)])
    );
    Ok(())
}

in_both_modes!(
    stock_reservations_apply_once_and_an_oversold_one_is_dead_lettered_then_replayed,
    a_database_outage_holds_stock_reservations_and_dead_letters_none,
    killing_the_stock_worker_mid_load_keeps_the_stock_exact,
);

/// A service's whole binary is its handler plus one call: the example stays
/// within a screen, comments and blank lines aside (62 lines once it locked
/// its rows in order, which `check` showed it had to: its UPDATE deadlocked
/// against itself under two workers).
#[test]
fn the_stock_service_fits_in_a_screen() -> anyhow::Result<()> {
    let source =
        std::fs::read_to_string(crate::support::repository().join("examples/stock/main.rs"))?;
    let code = source
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with("//"))
        .count();
    ensure!(
        code <= 64,
        "examples/stock/main.rs has {code} lines of code"
    );
    Ok(())
}

/// The example's binary serves the console with no code of its own: its
/// groups, a letter, and a replay of one group with the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_stock_binary_serves_the_console_of_its_own_dead_letters() -> anyhow::Result<()> {
    let env = StockEnv::new().await?;
    env.sql("INSERT INTO stock VALUES ('SKU-A', 10)").await?;
    let oversold = Reservation::new("reservation-1", "SKU-A", 11);
    let unknown = Reservation::new("reservation-2", "SKU-Z", 1);
    env.publish(&[oversold.body(), unknown.body()]).await?;
    let worker = env.worker(&database_url(), Mode::Batch)?;
    env.wait_dead_letters(2).await?;

    let port = crate::support::free_port()?;
    let mut command = env.example(&database_url(), Mode::Batch);
    command
        .args(["console", "--http-addr", &format!("127.0.0.1:{port}")])
        .env(vars::CONSOLE_TOKEN, "stock-token");
    let console = WorkerProcess::start(command)?;
    let _ = idem::tls::provider().install_default();
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    let url = |path: &str| format!("http://127.0.0.1:{port}{path}");
    wait_for("the console to answer", Duration::from_secs(30), || async {
        Ok(http
            .get(url("/"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200))
    })
    .await?;
    let overview = http.get(url("/")).send().await?.text().await?;
    ensure!(overview.contains("stock-reservations"), "{overview}");
    ensure!(overview.contains("stock.reservations.dlq"), "{overview}");
    let groups = http.get(url("/groups")).send().await?.text().await?;
    ensure!(groups.contains("no such SKU"), "{groups}");
    ensure!(groups.contains("stock_available_check"), "{groups}");

    // The unknown SKU added: its group replayed, by a program with the token.
    env.sql("INSERT INTO stock VALUES ('SKU-Z', 5)").await?;
    let group: uuid::Uuid = env
        .pool
        .get()
        .await?
        .query_one(
            "SELECT group_id FROM mq_dead_letter_group WHERE fingerprint LIKE '%no such SKU%'",
            &[],
        )
        .await?
        .get(0);
    let started = http
        .post(url("/actions"))
        .bearer_auth("stock-token")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("action=replay&group={group}&expected=1"))
        .send()
        .await?;
    ensure!(started.status() == 303, "{}", started.text().await?);
    env.wait_records(1, Duration::from_secs(30)).await?;
    env.wait_dead_letters(1).await?;
    wait_for(
        "the audit to record the replay",
        Duration::from_secs(30),
        || async {
            let audit = http.get(url("/audit")).send().await?.text().await?;
            Ok(audit.contains("replayed 1") && audit.contains("holder (bearer)"))
        },
    )
    .await?;
    console.stop().await?;
    worker.stop().await?;
    assert_eq!(
        env.available().await?,
        BTreeMap::from([("SKU-A".into(), 10), ("SKU-Z".into(), 4)])
    );
    Ok(())
}
