//! `check` on handlers known to be wrong, each caught by the run that
//! should catch it, and on handlers that are right: the transfer handlers
//! of `examples/mistakes` (netting a batch, a connection of its own, the
//! clock, a message per batch, a cache in memory, a publish from `apply`, a
//! read-modify-write without a lock) and the same transfers done right;
//! then the services' own checks, through their binaries.

use std::time::Duration;

use anyhow::ensure;
use idem::broker::AmqpConfig;
use idem::check::{CheckConfig, CheckReport, RunReport, Why};
use idem::secret::SecretUrl;
use idem::store::DatabaseConfig;

use crate::support::{amqp_url, database_url, patient};

/// The handlers judged: `examples/mistakes`, as the crate ships them.
#[path = "../../../examples/mistakes/transfers.rs"]
mod transfers;

use transfers::{
    Cached, Netting, OwnConnection, Publishing, Stamped, Summarizing, Transfer, Unlocked, Wallet,
};

/// Ten accounts of 1,000 each, and ten pairs of empty ones.
const SETUP: &str = "INSERT INTO account SELECT 'acct-' || n, 1000 FROM generate_series(0, 9) n; \
                     INSERT INTO account SELECT 'empty-' || n, 0 FROM generate_series(0, 19) n";

/// Money is neither made nor lost.
const CONSERVED: &str = "SELECT sum(balance) AS total FROM account HAVING sum(balance) <> 10000";

const WITNESS: &str = "SELECT count(*) FROM transfer_log WHERE event_id = $1";

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

/// Transfers as a producer sends them, where the netting mistake hides: ten
/// pairs of empty accounts, each pair's first transfer among the first
/// thirty and its way back among the last ten, 270 and more apart, so that
/// no batch of the file's order holds both.
fn transfers_far_apart() -> Vec<Vec<u8>> {
    let mut bodies = transfers_with(false);
    let body = |id: String, from: String, to: String| {
        let transfer = Transfer {
            event_id: id,
            from,
            to,
            amount: 10,
        };
        serde_json::to_vec(&transfer).unwrap_or_default()
    };
    for pair in 0..10 {
        let (a, b) = (
            format!("empty-{}", 2 * pair),
            format!("empty-{}", 2 * pair + 1),
        );
        bodies.insert(
            3 * pair,
            body(format!("there-{pair}"), a.clone(), b.clone()),
        );
        bodies.push(body(format!("back-{pair}"), b, a));
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

/// The report's batch equivalence.
fn equivalence(report: &CheckReport) -> anyhow::Result<&RunReport> {
    report
        .runs
        .iter()
        .find(|run| run.name.starts_with("batch equivalence"))
        .ok_or_else(|| anyhow::anyhow!("no batch equivalence in\n{report}"))
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
    // Commits the worker never heard of come back as duplicates, nothing
    // doubled or lost.
    for mode in ["batch", "per message"] {
        let cut = run(&report, &format!("database cut, commit in flight · {mode}"))?;
        ensure!(cut.strikes == Some(3), "{report}");
        ensure!(cut.duplicates.is_some_and(|n| n > 0), "{report}");
        ensure!(cut.inconclusive.is_none() && cut.passed(), "{report}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_publishes_from_apply_is_caught_sending_outside_the_outbox()
-> anyhow::Result<()> {
    let events = OwnExchange::new("wallet-events");
    let config = config(transfers_with(false)).outgoing(idem::broker::Exchange::topic(&events.0));
    let report = idem::check::run(&config, || Publishing::to(&amqp_url(), &events.0)).await?;
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
    let equivalence = equivalence(&report)?;
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
async fn a_handler_that_nets_a_batch_is_caught_on_events_whose_collisions_are_far_apart()
-> anyhow::Result<()> {
    let report = idem::check::run(&config(transfers_far_apart()), || Netting).await?;
    ensure!(!report.passed(), "{report}");
    let equivalence = equivalence(&report)?;
    ensure!(
        equivalence.findings.iter().any(|finding| {
            finding.contains("the batch applies whole, but ")
                && finding.contains("check constraint")
                && finding.contains("but back-")
        }),
        "{report}"
    );
    // One worker's batches hold both ways too, and apply what the reference
    // gives up on.
    ensure!(
        !run(&report, "killed after commit · batch")?.passed(),
        "{report}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_whose_messages_depend_on_the_batch_fails_batch_equivalence() -> anyhow::Result<()>
{
    let report = idem::check::run(&config(transfers_with(false)), || Summarizing).await?;
    let equivalence = equivalence(&report)?;
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
    let report = idem::check::run(&config(transfers_with(false)), || OwnConnection {
        database_url: database_url(),
    })
    .await?;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_reads_then_writes_a_balance_without_a_lock_loses_transfers_to_a_second_worker()
-> anyhow::Result<()> {
    let report = idem::check::run(&config(transfers_with(false)), || Unlocked).await?;
    ensure!(!report.passed(), "{report}");
    // One transaction at a time, nothing races: the references agree.
    ensure!(
        run(&report, "reference · the file's order, again")?.passed(),
        "{report}"
    );
    // Two workers' batches of one account at once: a write is lost, money
    // with it.
    let shared = run(&report, "2 workers sharing the load · batch")?;
    ensure!(
        shared.violations > 0 && shared.diverged.unwrap_or(0) > 0,
        "{report}"
    );
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
    check_command(binary, &[], events, args).await
}

/// [`check_binary`], with `before` the words before `check`.
async fn check_command(
    binary: &std::path::Path,
    before: &[&str],
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
        .args(before)
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
async fn the_mistakes_example_fails_its_check_on_the_handler_named_first() -> anyhow::Result<()> {
    let mistakes = crate::support::example_binary("mistakes")?;
    // The example's outgoing exchange, which the check's capture declares:
    // removed when the test ends.
    let _events = OwnExchange("mistakes.events".to_owned());
    // The files the example ships, as its guide runs them.
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mistakes");
    let transfers: Vec<Vec<u8>> = std::fs::read(shipped.join("transfers.jsonl"))?
        .split(|byte| *byte == b'\n')
        .filter(|line| !line.is_empty())
        .map(<[u8]>::to_vec)
        .collect();
    let setup = shipped.join("seed.sql").display().to_string();
    let args = [
        "--setup",
        setup.as_str(),
        "--invariant",
        CONSERVED,
        "--witness",
        WITNESS,
    ];
    let netting = check_command(&mistakes, &["netting"], &transfers, &args).await?;
    ensure!(
        netting.code == Some(1)
            && netting.stdout.contains("check FAILED: batch equivalence")
            && netting.stdout.contains("mistakes netting check --events"),
        "exit {:?}\n{}{}",
        netting.code,
        netting.stdout,
        netting.stderr
    );
    // A first word that names no handler: the list, and a usage error.
    let unknown = tokio::process::Command::new(&mistakes)
        .args(["nettting", "check"])
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&unknown.stderr);
    ensure!(
        unknown.status.code() == Some(2) && stderr.contains("name a handler first (right, netting"),
        "{unknown:?}"
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
