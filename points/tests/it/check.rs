//! `check` on handlers known to be wrong, each caught by the run that
//! should catch it, and on handlers that are right: a transfer handler
//! that nets a batch per account, one that writes through a connection of
//! its own, one that stamps its rows with the clock, one that computes
//! balances from a cache in memory; and the same transfers done right.
//!
//! Over 700 lines: one scenario per test, check's and its wrong handlers in
//! one place.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::ensure;
use idem::broker::AmqpConfig;
use idem::check::{CheckConfig, CheckReport, RunReport, Why};
use idem::handler::{
    Handler, HandlerError, Invalid, Migration, Outbox, OutboxMessage, Transaction,
};
use idem::secret::SecretUrl;
use idem::store::DatabaseConfig;

use crate::support::{amqp_url, database_url, patient};

/// `{"eventId": "t-1", "from": "acct-1", "to": "acct-2", "amount": 10}`
#[derive(Debug, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct Transfer {
    event_id: String,
    from: String,
    to: String,
    amount: i64,
}

/// Accounts that may not go below zero, and one log row per transfer.
const WALLET: &[Migration] = &[Migration {
    version: 1,
    name: "0001_wallet.sql",
    sql: "CREATE TABLE account (id TEXT COLLATE \"C\" PRIMARY KEY, \
                                balance BIGINT NOT NULL CHECK (balance >= 0)); \
          CREATE TABLE transfer_log (event_id TEXT COLLATE \"C\" NOT NULL, \
                                     from_account TEXT NOT NULL, to_account TEXT NOT NULL, \
                                     amount BIGINT NOT NULL, applied_at TIMESTAMPTZ)",
}];

/// Ten accounts of 1,000 each, and ten pairs of empty ones.
const SETUP: &str = "INSERT INTO account SELECT 'acct-' || n, 1000 FROM generate_series(0, 9) n; \
                     INSERT INTO account SELECT 'empty-' || n, 0 FROM generate_series(0, 19) n";

/// Money is neither made nor lost.
const CONSERVED: &str = "SELECT sum(balance) AS total FROM account HAVING sum(balance) <> 10000";

const WITNESS: &str = "SELECT count(*) FROM transfer_log WHERE event_id = $1";

fn decode(body: &[u8]) -> Result<Transfer, Invalid> {
    let transfer: Transfer = serde_json::from_slice(body)?;
    if transfer.amount <= 0 || transfer.from == transfer.to {
        return Err(Invalid::new(
            "a transfer moves a positive amount between two accounts",
        ));
    }
    Ok(transfer)
}

/// Debits `from`, credits `to`, in the transaction; an unknown account can
/// never apply.
async fn move_money(tx: &Transaction<'_>, transfer: &Transfer) -> Result<(), HandlerError> {
    let step = tx
        .prepare_cached("UPDATE account SET balance = balance + $2 WHERE id = $1")
        .await?;
    let (first, second) = ordered(transfer);
    for (account, amount) in [first, second] {
        if tx.execute(&step, &[&account, &amount]).await? != 1 {
            return Err(HandlerError::permanent(format!("no account {account}")));
        }
    }
    Ok(())
}

/// Locks every account of `transfers`, in the accounts' order: batches in
/// flight at once then never wait on each other in a circle.
async fn lock(tx: &Transaction<'_>, transfers: &[&Transfer]) -> Result<(), HandlerError> {
    let accounts: Vec<&str> = transfers
        .iter()
        .flat_map(|t| [t.from.as_str(), t.to.as_str()])
        .collect();
    let lock = tx
        .prepare_cached("SELECT id FROM account WHERE id = ANY($1) ORDER BY id FOR UPDATE")
        .await?;
    tx.query(&lock, &[&accounts]).await?;
    Ok(())
}

/// Locks the accounts, then makes each transfer in turn, in the order given.
async fn each_in_turn(tx: &Transaction<'_>, transfers: &[&Transfer]) -> Result<(), HandlerError> {
    lock(tx, transfers).await?;
    for transfer in transfers {
        move_money(tx, transfer).await?;
    }
    Ok(())
}

/// The two legs of a transfer, in the accounts' order (so that two
/// transactions lock them in one order).
fn ordered(transfer: &Transfer) -> ((&str, i64), (&str, i64)) {
    let debit = (transfer.from.as_str(), -transfer.amount);
    let credit = (transfer.to.as_str(), transfer.amount);
    if debit.0 < credit.0 {
        (debit, credit)
    } else {
        (credit, debit)
    }
}

async fn log(
    tx: &Transaction<'_>,
    transfers: &[&Transfer],
    stamped: bool,
) -> Result<(), HandlerError> {
    let sql = if stamped {
        "INSERT INTO transfer_log VALUES ($1, $2, $3, $4, now())"
    } else {
        "INSERT INTO transfer_log VALUES ($1, $2, $3, $4, NULL)"
    };
    let insert = tx.prepare_cached(sql).await?;
    for t in transfers {
        tx.execute(&insert, &[&t.event_id, &t.from, &t.to, &t.amount])
            .await?;
    }
    Ok(())
}

/// A transfer handler whose `apply` is `body`, with the handler, the
/// transaction, the batch's transfers and the outbox named as given; each
/// transfer it makes sends `transfer.completed`.
macro_rules! transfer_handler {
    ($name:ident, |$this:ident, $tx:ident, $transfers:ident, $outbox:ident| $body:block) => {
        impl Handler for $name {
            type Event = Transfer;
            const NAME: &'static str = "wallet";
            const MIGRATIONS: &'static [Migration] = WALLET;
            const SENDS_MESSAGES: bool = true;

            fn decode(&self, body: &[u8]) -> Result<Transfer, Invalid> {
                decode(body)
            }

            fn event_id<'e>(&self, transfer: &'e Transfer) -> &'e str {
                &transfer.event_id
            }

            /// Every transfer made says so, through the outbox.
            fn outgoing(&self, transfer: &Transfer) -> Vec<OutboxMessage> {
                let body = serde_json::to_vec(transfer).unwrap_or_default();
                vec![OutboxMessage::json(
                    "wallet.events",
                    "transfer.completed",
                    body,
                )]
            }

            async fn apply(
                &self,
                tx: &Transaction<'_>,
                transfers: &[&Transfer],
                outbox: &mut Outbox<'_>,
            ) -> Result<(), HandlerError> {
                let ($this, $tx, $transfers, $outbox) = (self, tx, transfers, outbox);
                $body
            }
        }
    };
}

/// Right: locks the batch's accounts in order, then makes each transfer in
/// turn, in the order given.
struct Wallet;
transfer_handler!(Wallet, |_this, tx, transfers, _outbox| {
    each_in_turn(tx, transfers).await?;
    log(tx, transfers, false).await
});

/// Wrong: sums the batch per account and moves the net, as `examples/stock`
/// does for reservations; a batch holding `a → b 10` and `b → a 10` on two
/// empty accounts passes whole, though neither transfer passes alone.
struct Netting;
transfer_handler!(Netting, |_this, tx, transfers, _outbox| {
    lock(tx, transfers).await?;
    let mut net = BTreeMap::<&str, i64>::new();
    for t in transfers {
        *net.entry(&t.from).or_default() -= t.amount;
        *net.entry(&t.to).or_default() += t.amount;
    }
    let (accounts, deltas): (Vec<&str>, Vec<i64>) = net.into_iter().unzip();
    let update = tx
        .prepare_cached(
            "UPDATE account SET balance = balance + d.delta \
                 FROM unnest($1::text[], $2::bigint[]) AS d(id, delta) WHERE account.id = d.id",
        )
        .await?;
    tx.execute(&update, &[&accounts, &deltas]).await?;
    log(tx, transfers, false).await
});

/// Wrong: logs each transfer through a connection of its own, outside
/// idem's transaction, as a call to another service would: committed even
/// when idem's transaction is not.
struct OwnConnection;
transfer_handler!(OwnConnection, |_this, tx, transfers, _outbox| {
    each_in_turn(tx, transfers).await?;
    let schema: String = tx
        .query_one("SELECT current_schema()::text", &[])
        .await?
        .get(0);
    let (client, connection) =
        tokio_postgres::connect(&database_url(), tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    client
        .batch_execute(&format!("SET search_path TO {schema}"))
        .await?;
    for t in transfers {
        client
            .execute(
                "INSERT INTO transfer_log VALUES ($1, $2, $3, $4, NULL)",
                &[&t.event_id, &t.from, &t.to, &t.amount],
            )
            .await?;
    }
    Ok(())
});

/// Wrong: stamps each log row with the clock, which no run repeats.
struct Stamped;
transfer_handler!(Stamped, |_this, tx, transfers, _outbox| {
    each_in_turn(tx, transfers).await?;
    log(tx, transfers, true).await
});

/// Wrong: says how many transfers it made in one message per call, under
/// the first transfer's key: a batch sends one, its transfers one at a time
/// send one each.
struct Summarizing;
transfer_handler!(Summarizing, |_this, tx, transfers, outbox| {
    each_in_turn(tx, transfers).await?;
    log(tx, transfers, false).await?;
    let summary = format!("{{\"transfers\": {}}}", transfers.len()).into_bytes();
    let message = OutboxMessage::json("wallet.events", "transfers.made", summary);
    outbox.send(&transfers[0].event_id, message)
});

/// Wrong: writes balances computed from what it cached of them, so that a
/// second worker's transfers (or a transaction rolled back) are lost.
#[derive(Default)]
struct Cached {
    balances: Mutex<HashMap<String, i64>>,
}
transfer_handler!(Cached, |this, tx, transfers, _outbox| {
    this.transfer(tx, transfers).await
});

impl Cached {
    async fn balance(&self, tx: &Transaction<'_>, account: &str) -> Result<i64, HandlerError> {
        let cached = self
            .balances
            .lock()
            .ok()
            .and_then(|b| b.get(account).copied());
        match cached {
            Some(balance) => Ok(balance),
            None => Ok(tx
                .query_one("SELECT balance FROM account WHERE id = $1", &[&account])
                .await?
                .get(0)),
        }
    }

    async fn transfer(
        &self,
        tx: &Transaction<'_>,
        transfers: &[&Transfer],
    ) -> Result<(), HandlerError> {
        lock(tx, transfers).await?;
        let set = tx
            .prepare_cached("UPDATE account SET balance = $2 WHERE id = $1")
            .await?;
        for transfer in transfers {
            let (first, second) = ordered(transfer);
            for (account, amount) in [first, second] {
                let balance = self.balance(tx, account).await? + amount;
                tx.execute(&set, &[&account, &balance]).await?;
                if let Ok(mut balances) = self.balances.lock() {
                    balances.insert(account.to_owned(), balance);
                }
            }
        }
        log(tx, transfers, false).await
    }
}

/// Wrong: announces each transfer itself, with a channel of its own, from
/// `apply` (as a team that publishes with lapin where the outbox belongs):
/// sent whether or not idem's transaction commits, and again when it runs
/// again.
struct Publishing {
    exchange: String,
    channel: tokio::sync::OnceCell<lapin::Channel>,
}

impl Publishing {
    fn to(exchange: &str) -> Self {
        Self {
            exchange: exchange.to_owned(),
            channel: tokio::sync::OnceCell::new(),
        }
    }
}

impl Handler for Publishing {
    type Event = Transfer;
    const NAME: &'static str = "wallet";
    const MIGRATIONS: &'static [Migration] = WALLET;

    fn decode(&self, body: &[u8]) -> Result<Transfer, Invalid> {
        decode(body)
    }

    fn event_id<'e>(&self, transfer: &'e Transfer) -> &'e str {
        &transfer.event_id
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        transfers: &[&Transfer],
        _outbox: &mut Outbox<'_>,
    ) -> Result<(), HandlerError> {
        each_in_turn(tx, transfers).await?;
        log(tx, transfers, false).await?;
        let channel = self
            .channel
            .get_or_try_init(|| async {
                let connection =
                    lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
                        .await?;
                connection.create_channel().await
            })
            .await
            .map_err(HandlerError::infrastructure)?;
        for transfer in transfers {
            let body = serde_json::to_vec(transfer).map_err(HandlerError::message)?;
            channel
                .basic_publish(
                    self.exchange.as_str().into(),
                    "transfer.completed".into(),
                    lapin::options::BasicPublishOptions::default(),
                    &body,
                    lapin::BasicProperties::default(),
                )
                .await
                .map_err(HandlerError::infrastructure)?;
        }
        Ok(())
    }
}

/// An exchange of the test's own, deleted when the test ends.
struct OwnExchange(String);

impl OwnExchange {
    fn new(what: &str) -> Self {
        Self(format!("{}.{what}", crate::support::unique_name()))
    }
}

impl Drop for OwnExchange {
    fn drop(&mut self) {
        let amqp = AmqpConfig::new(SecretUrl::new(amqp_url()));
        let exchanges = vec![self.0.clone()];
        crate::support::clean_up(crate::support::remove(
            amqp,
            vec![],
            exchanges,
            vec![],
            vec![],
        ));
    }
}

/// Transfers among the ten full accounts that no order can overdraw
/// (at most 30 × 20 out of 1,000), and ten pairs `empty-2k → empty-2k+1`
/// and back, 10 each, side by side: neither can pass alone, in any order.
fn transfers() -> Vec<Vec<u8>> {
    transfers_with(true)
}

/// [`transfers`], without the pairs of empty accounts when `pairs` is false:
/// every transfer then passes, in any batch.
fn transfers_with(pairs: bool) -> Vec<Vec<u8>> {
    let mut rng = fastrand::Rng::with_seed(7);
    let mut bodies = Vec::new();
    let mut id = 0;
    let mut push = |from: String, to: String, amount: i64, bodies: &mut Vec<Vec<u8>>| {
        id += 1;
        let transfer = Transfer {
            event_id: format!("t-{id}"),
            from,
            to,
            amount,
        };
        bodies.push(serde_json::to_vec(&transfer).unwrap_or_default());
    };
    for n in 0..300 {
        let from = rng.usize(0..10);
        let to = (from + rng.usize(1..10)) % 10;
        push(
            format!("acct-{from}"),
            format!("acct-{to}"),
            rng.i64(1..=20),
            &mut bodies,
        );
        if pairs && n % 30 == 0 {
            let pair = n / 30;
            let (a, b) = (
                format!("empty-{}", 2 * pair),
                format!("empty-{}", 2 * pair + 1),
            );
            push(a.clone(), b.clone(), 10, &mut bodies);
            push(b, a, 10, &mut bodies);
        }
    }
    bodies
}

fn config(events: Vec<Vec<u8>>) -> CheckConfig {
    let mut config = CheckConfig::new(
        AmqpConfig::new(SecretUrl::new(amqp_url())),
        DatabaseConfig::new(SecretUrl::new(database_url())),
        "wallet",
        events,
    )
    .setup(SETUP)
    .invariant(CONSERVED)
    .witness(WITNESS);
    config.patience = patient(Duration::from_secs(120));
    config
}

/// The run named `name`, which must be in the report.
fn run<'r>(report: &'r CheckReport, name: &str) -> anyhow::Result<&'r RunReport> {
    report
        .runs
        .iter()
        .find(|run| run.name == name)
        .ok_or_else(|| anyhow::anyhow!("no run {name:?} in\n{report}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transfers_applied_each_in_turn_pass_every_run() -> anyhow::Result<()> {
    // Its messages go through the outbox: nothing reaches the exchange.
    let events = OwnExchange::new("wallet-events");
    let config = config(transfers()).outgoing(idem::broker::Exchange::topic(&events.0));
    let report = idem::check::run(&config, || Wallet).await?;
    ensure!(report.passed(), "{report}");
    let first = run(&report, "reference · the file's order")?;
    assert_eq!((first.applied, first.dead_lettered), (300, 20), "{report}");
    ensure!(!report.order_matters, "{report}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_publishes_from_apply_is_caught_sending_outside_the_outbox()
-> anyhow::Result<()> {
    let events = OwnExchange::new("wallet-events");
    let config = config(transfers_with(false)).outgoing(idem::broker::Exchange::topic(&events.0));
    let report = idem::check::run(&config, || Publishing::to(&events.0)).await?;
    ensure!(!report.passed(), "{report}");
    let first = run(&report, "reference · the file's order")?;
    ensure!(first.sent_outside >= 300, "{report}");
    ensure!(
        first
            .findings
            .iter()
            .any(|f| f.starts_with("sent outside idem's outbox") && f.contains(&events.0)),
        "{report}"
    );
    // Every run on the worker sends them too, and is failed for it.
    for name in [
        "killed before commit · batch",
        "2 workers sharing the load · per message",
    ] {
        let worker_run = run(&report, name)?;
        ensure!(worker_run.sent_outside > 0, "{name}:\n{report}");
        ensure!(!worker_run.passed(), "{name}:\n{report}");
    }
    ensure!(
        report.verdict().contains("sent outside idem's outbox"),
        "{}",
        report.verdict()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_check_whose_fault_never_strikes_is_inconclusive_not_passed() -> anyhow::Result<()> {
    // One event: no batch of several can go one by one, so no worker can
    // die mid-batch; every other run proves what it proves.
    let one = transfers_with(false).into_iter().take(1).collect();
    let report = idem::check::run(&config(one), || Wallet).await?;
    ensure!(!report.passed(), "{report}");
    ensure!(report.failed_runs().is_empty(), "{report}");
    assert_eq!(
        report.inconclusive(),
        [
            "killed mid-batch · batch: no batch of several events went one by one, so no worker \
          died mid-batch"
        ],
        "{report}"
    );
    ensure!(
        report
            .verdict()
            .starts_with("check INCONCLUSIVE: nothing went wrong, but 1 run"),
        "{}",
        report.verdict()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_nets_a_batch_per_account_fails_batch_equivalence() -> anyhow::Result<()> {
    let report = idem::check::run(&config(transfers()), || Netting).await?;
    ensure!(!report.passed(), "{report}");
    let equivalence = report
        .runs
        .iter()
        .find(|run| run.name.starts_with("batch equivalence"))
        .ok_or_else(|| anyhow::anyhow!("no batch equivalence in\n{report}"))?;
    ensure!(!equivalence.passed(), "{report}");
    ensure!(
        equivalence.findings.iter().any(|finding| {
            finding.contains("the batch applies whole, but t-")
                && finding.contains("check constraint")
        }),
        "{report}"
    );
    ensure!(
        report.verdict().contains("batch equivalence"),
        "{}",
        report.verdict()
    );
    // The worker's batches apply the pairs that the reference gives up on.
    ensure!(
        !run(&report, "3 copies at once · batch")?.passed(),
        "{report}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_whose_messages_depend_on_the_batch_fails_batch_equivalence() -> anyhow::Result<()>
{
    let report = idem::check::run(&config(transfers_with(false)), || Summarizing).await?;
    let equivalence = report
        .runs
        .iter()
        .find(|run| run.name.starts_with("batch equivalence"))
        .ok_or_else(|| anyhow::anyhow!("no batch equivalence in\n{report}"))?;
    ensure!(
        equivalence
            .findings
            .iter()
            .any(|finding| finding.starts_with(
                "the batch applied whole sends other messages than its events applied one at a time"
            )),
        "{report}"
    );
    // The worker's batches send one message per batch, not per transfer.
    ensure!(
        !run(&report, "2 workers sharing the load · batch")?.passed(),
        "{report}"
    );
    ensure!(
        run(&report, "2 workers sharing the load · per message")?.passed(),
        "{report}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_writes_through_a_connection_of_its_own_is_doubled_when_killed_before_commit()
-> anyhow::Result<()> {
    let report = idem::check::run(&config(transfers_with(false)), || OwnConnection).await?;
    ensure!(!report.passed(), "{report}");
    for name in [
        "killed before commit · batch",
        "killed before commit · per message",
    ] {
        let killed = run(&report, name)?;
        ensure!(killed.doubled > 0, "{name} doubled nothing:\n{report}");
        ensure!(
            killed
                .findings
                .iter()
                .any(|f| f.starts_with("doubled: ") && f.contains("the witness counts")),
            "{report}"
        );
    }
    ensure!(
        run(&report, "3 copies at once · batch")?.passed(),
        "{report}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_stamps_its_rows_with_the_clock_differs_from_itself_unless_the_column_is_left_out()
-> anyhow::Result<()> {
    let report = idem::check::run(&config(transfers()), || Stamped).await?;
    ensure!(!report.passed(), "{report}");
    assert_eq!(report.unstable, ["transfer_log.applied_at"], "{report}");
    ensure!(
        !run(&report, "reference · the file's order, again")?.passed(),
        "{report}"
    );
    ensure!(
        report.verdict().contains("transfer_log.applied_at"),
        "{}",
        report.verdict()
    );
    // Every other run is judged without the column, and matches; the
    // column is said to be left out by the check, not by the team.
    assert_eq!(
        report.failed_runs(),
        ["reference · the file's order, again"],
        "{report}"
    );
    let left_out_by = |report: &CheckReport| {
        report
            .left_out
            .iter()
            .map(|left| (left.column.clone(), left.why))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        left_out_by(&report),
        [("transfer_log.applied_at".to_owned(), Why::Unstable)],
        "{report}"
    );

    let left_out = config(transfers()).ignore_column("transfer_log.applied_at");
    let report = idem::check::run(&left_out, || Stamped).await?;
    ensure!(report.passed(), "{report}");
    assert_eq!(
        left_out_by(&report),
        [("transfer_log.applied_at".to_owned(), Why::Asked)],
        "{report}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_computes_balances_from_a_cache_loses_updates_once_two_workers_share_the_load()
-> anyhow::Result<()> {
    // Batches of ten: each worker's later batches start after the other's
    // first ones committed, behind a cache that missed them.
    let mut config = config(transfers_with(false));
    config.batch_size = 10;
    let report = idem::check::run(&config, Cached::default).await?;
    ensure!(!report.passed(), "{report}");
    // One worker at a time, the cache is right: the references agree.
    ensure!(
        run(&report, "reference · the file's order, again")?.passed(),
        "{report}"
    );
    for name in [
        "2 workers sharing the load · batch",
        "2 workers sharing the load · per message",
    ] {
        // Balances diverge; money is often, not always, lost too: a stale
        // write to both accounts of a transfer cancels out.
        let shared = run(&report, name)?;
        ensure!(shared.diverged.unwrap_or(0) > 0, "{name}:\n{report}");
    }
    Ok(())
}

/// What `binary check` printed and how it exited, on `events` written to a
/// file of the test's own, with `args` after `--events FILE`.
struct Checked {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

async fn check_binary(
    binary: &std::path::Path,
    events: &[Vec<u8>],
    args: &[&str],
) -> anyhow::Result<Checked> {
    let file = std::env::temp_dir().join(format!("{}.jsonl", crate::support::unique_name()));
    std::fs::write(&file, events.join(&b'\n'))?;
    let output = tokio::process::Command::new(binary)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env(idem::vars::DATABASE_URL, database_url())
        .env(idem::vars::AMQP_URL, amqp_url())
        .arg("check")
        .arg("--events")
        .arg(&file)
        .args(args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output()
        .await;
    let _ = std::fs::remove_file(&file);
    let output = output?;
    Ok(Checked {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    })
}

/// The report of a `check --json`, which must have passed.
fn passed(checked: &Checked) -> anyhow::Result<serde_json::Value> {
    ensure!(
        checked.code == Some(0),
        "exit {:?}\n{}{}",
        checked.code,
        checked.stdout,
        checked.stderr
    );
    let report: serde_json::Value = serde_json::from_str(&checked.stdout)?;
    let runs = report["runs"].as_array().map_or(0, Vec::len);
    ensure!(runs >= 19, "only {runs} runs in {}", checked.stdout);
    Ok(report)
}

/// Payments over twenty orders, a tenth of them sent twice, and a body that
/// is no payment.
fn payments() -> Vec<Vec<u8>> {
    let spec = idem_points::generate::LoadSpec {
        count: 330,
        duplicate_ratio: 0.1,
        orders: 20,
        seed: 3,
        prefix: "check".into(),
    };
    let mut bodies: Vec<Vec<u8>> = idem_points::generate::events(&spec)
        .iter()
        .map(idem_points::points::PaymentSucceeded::to_body)
        .collect();
    bodies.push(b"{\"eventId\": \"broken\"}".to_vec());
    bodies
}

#[tokio::test]
async fn the_points_handler_passes_idem_check() -> anyhow::Result<()> {
    let idem = std::path::Path::new(env!("CARGO_BIN_EXE_idem"));
    let args = [
        "--invariant",
        "SELECT order_id FROM user_points WHERE points < 0",
    ];
    let checked = check_binary(idem, &payments(), &args).await?;
    ensure!(
        checked.code == Some(0),
        "{}{}",
        checked.stdout,
        checked.stderr
    );
    let verdict = checked.stdout.lines().last().unwrap_or_default();
    ensure!(verdict.starts_with("check passed: "), "{}", checked.stdout);
    ensure!(
        checked.stdout.contains("331 messages") && checked.stdout.contains("1 that do not decode"),
        "{}",
        checked.stdout
    );
    Ok(())
}

#[tokio::test]
async fn the_stock_example_passes_its_check() -> anyhow::Result<()> {
    let stock = crate::support::example_binary("stock")?;
    let mut rng = fastrand::Rng::with_seed(5);
    let mut reservations: Vec<Vec<u8>> = (0..300)
        .map(|n| {
            serde_json::json!({
                "eventId": format!("reservation-{n}"),
                "sku": format!("SKU-{}", rng.usize(0..8)),
                "quantity": rng.i64(1..=5),
            })
            .to_string()
            .into_bytes()
        })
        .collect();
    // A SKU the table does not know: dead-lettered at once, in every run.
    reservations
        .push(br#"{"eventId": "reservation-lost", "sku": "SKU-NONE", "quantity": 1}"#.to_vec());
    let setup = std::env::temp_dir().join(format!("{}.sql", crate::support::unique_name()));
    std::fs::write(
        &setup,
        "INSERT INTO stock SELECT 'SKU-' || n, 10000 FROM generate_series(0, 7) n",
    )?;
    let setup_arg = setup.display().to_string();
    let args = [
        "--setup",
        setup_arg.as_str(),
        "--invariant",
        "SELECT sku FROM stock WHERE available < 0",
        "--json",
    ];
    let checked = check_binary(&stock, &reservations, &args).await;
    let _ = std::fs::remove_file(&setup);
    let report = passed(&checked?)?;
    assert_eq!(report["runs"][0]["dead_lettered"], 1, "{report:#}");
    Ok(())
}

#[tokio::test]
async fn the_notifications_example_passes_its_check_with_its_clock_column_left_out()
-> anyhow::Result<()> {
    let notifications = crate::support::example_binary("notifications")?;
    let credits: Vec<Vec<u8>> = (0..300)
        .map(|n| {
            serde_json::to_vec(&idem_points::points::PointsCredited {
                source_event_id: format!("payment-{n}"),
                order_id: format!("order-{}", n % 17),
                points: 10 + n % 7,
            })
            .unwrap_or_default()
        })
        .collect();
    let witness = "SELECT count(*) FROM notification WHERE source_event_id = $1";
    let args = ["--witness", witness, "--json"];
    let stamped = check_binary(&notifications, &credits, &args).await?;
    ensure!(
        stamped.code == Some(1),
        "{}{}",
        stamped.stdout,
        stamped.stderr
    );
    let report: serde_json::Value = serde_json::from_str(&stamped.stdout)?;
    assert_eq!(
        report["unstable"],
        serde_json::json!(["notification.queued_at"])
    );
    // Failed, it says how to run the same check again, off the JSON.
    let again = stamped
        .stderr
        .lines()
        .find(|line| line.starts_with("seed 1; the same runs again"))
        .unwrap_or_default();
    ensure!(
        again.contains(": notifications check --events /")
            && again.contains("--seed 1")
            && again.contains(&format!("--witness '{witness}'")),
        "{}",
        stamped.stderr
    );

    let args = [
        "--witness",
        witness,
        "--ignore-column",
        "notification.queued_at",
        "--json",
    ];
    passed(&check_binary(&notifications, &credits, &args).await?)?;
    Ok(())
}

#[tokio::test]
async fn check_refuses_what_cannot_work_with_one_line_and_exit_2() -> anyhow::Result<()> {
    let idem = std::path::Path::new(env!("CARGO_BIN_EXE_idem"));
    let unknown = check_binary(idem, &payments(), &["--ignore-column", "user_points.nope"]).await?;
    assert_eq!(
        unknown.code,
        Some(2),
        "{}{}",
        unknown.stdout,
        unknown.stderr
    );
    assert_eq!(
        unknown.stderr.trim(),
        "idem: --ignore-column user_points.nope: no such column in the handler's tables \
         (user_points) (see idem check --help)"
    );
    let broken = check_binary(idem, &payments(), &["--invariant", "SELECT FROM nowhere"]).await?;
    assert_eq!(broken.code, Some(2), "{}", broken.stderr);
    ensure!(
        broken
            .stderr
            .starts_with("idem: --invariant 1 cannot run: relation \"nowhere\" does not exist"),
        "{}",
        broken.stderr
    );
    let missing = tokio::process::Command::new(idem)
        .args(["check", "--events", "/nonexistent/events.jsonl"])
        .output()
        .await?;
    assert_eq!(missing.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&missing.stderr);
    ensure!(
        stderr.starts_with("idem: --events: cannot open /nonexistent/events.jsonl: "),
        "{stderr}"
    );
    Ok(())
}
