//! `idem lab` against the real services: every strategy fails where the
//! design says it does, by the fault the design names, and idem's never.

use std::time::Duration;

use anyhow::ensure;
use tokio::process::Command;

use idem::broker::AmqpConfig;
use idem::secret::SecretUrl;
use idem::store::DatabaseConfig;
use idem::vars;
use idem_points::commands::lab::{
    self, Column, Exactness, Fault, LabConfig, LabReport, Row, Step, Strategy,
};

use crate::support::{amqp_url, database_url, patient, unique_name};

/// The Redis the lab's Redis strategy uses: `IDEM_TEST_REDIS_URL`, or the
/// local one.
fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

const EVENTS: usize = 10;

fn config(name: &str) -> LabConfig {
    LabConfig {
        name: name.to_owned(),
        events: EVENTS,
        load: 300,
        rounds: 1,
        gate_timeout: patient(Duration::from_millis(300)),
        patience: patient(Duration::from_secs(60)),
        ..LabConfig::new(
            AmqpConfig::new(SecretUrl::new(amqp_url())),
            DatabaseConfig::new(SecretUrl::new(database_url())),
            SecretUrl::new(redis_url()),
        )
    }
}

fn row(report: &LabReport, strategy: Strategy) -> anyhow::Result<&Row> {
    report
        .row(strategy)
        .ok_or_else(|| anyhow::anyhow!("no row for {strategy:?}"))
}

/// What one fault did to one strategy.
fn under(row: &Row, fault: Fault) -> Exactness {
    row.runs
        .iter()
        .find(|(f, _)| *f == fault)
        .map(|(_, outcome)| outcome.tally)
        .unwrap_or_default()
}

fn twice(n: usize) -> Exactness {
    Exactness {
        events: EVENTS,
        twice: n,
        lost: 0,
    }
}

fn lost(n: usize) -> Exactness {
    Exactness {
        events: EVENTS,
        twice: 0,
        lost: n,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_strategy_fails_by_the_fault_the_design_names_and_idems_never() -> anyhow::Result<()>
{
    if let Ok(filter) = std::env::var("IDEM_TEST_LOG") {
        idem::telemetry::init(&filter, idem::telemetry::LogFormat::Text);
    }
    let name = unique_name();
    let report = lab::run(&config(&name)).await?;
    println!("{report}");
    let none = twice(0);

    // Check, then act races: every copy sees no record.
    let check = row(&report, Strategy::CheckThenAct)?;
    assert_eq!(under(check, Fault::SameEventAtOnce), twice(EVENTS));
    assert_eq!(under(check, Fault::Killed(Step::Effect)), twice(EVENTS));
    assert_eq!(under(check, Fault::EffectFails), none);

    // FOR UPDATE of a record that does not exist yet locks nothing.
    let pessimistic = row(&report, Strategy::Pessimistic)?;
    assert_eq!(under(pessimistic, Fault::SameEventAtOnce), twice(EVENTS));
    assert_eq!(pessimistic.tally(Column::Killed).twice, 0);
    assert_eq!(pessimistic.tally(Column::Killed).lost, 0);

    // The version check closes the race, at the price of reading again.
    let optimistic = row(&report, Strategy::Optimistic)?;
    for column in [
        Column::AtOnce,
        Column::Killed,
        Column::EffectFails,
        Column::AfterTtl,
    ] {
        assert!(optimistic.tally(column).clean(), "optimistic, {column:?}");
    }
    assert!(optimistic.conflicts() >= EVENTS as u64, "{report}");

    // idem's row is clean under every fault, the load's duplicates included.
    let idem = row(&report, Strategy::Idem)?;
    assert!(idem.clean(), "{report}");
    assert_eq!(
        idem.runs.len(),
        1 + 1 + Strategy::Idem.crash_points().len() + 2,
        "every fault ran"
    );

    // Redis: the key outlives a crash or a failure of the effect, and dies
    // before the message does.
    let redis = row(&report, Strategy::Redis)?;
    assert_eq!(under(redis, Fault::Killed(Step::Claim)), lost(EVENTS));
    assert_eq!(under(redis, Fault::Killed(Step::Effect)), none);
    assert_eq!(under(redis, Fault::EffectFails), lost(EVENTS));
    assert_eq!(under(redis, Fault::ComesBackAfterTtl), twice(EVENTS));
    assert_eq!(under(redis, Fault::SameEventAtOnce), none);

    // Ack before commit: whatever happens after the ack is lost.
    let ack_first = row(&report, Strategy::AckBeforeCommit)?;
    for step in [Step::Ack, Step::Claim, Step::Effect] {
        assert_eq!(
            under(ack_first, Fault::Killed(step)),
            lost(EVENTS),
            "{step:?}"
        );
    }
    assert_eq!(under(ack_first, Fault::EffectFails), lost(EVENTS));

    // Two transactions: record first loses, effect first doubles.
    let record_first = row(&report, Strategy::RecordThenEffect)?;
    assert_eq!(
        under(record_first, Fault::Killed(Step::Claim)),
        lost(EVENTS)
    );
    assert_eq!(under(record_first, Fault::EffectFails), lost(EVENTS));
    let effect_first = row(&report, Strategy::EffectThenRecord)?;
    assert_eq!(
        under(effect_first, Fault::Killed(Step::Effect)),
        twice(EVENTS)
    );
    assert_eq!(under(effect_first, Fault::SameEventAtOnce), twice(EVENTS));

    // Only the strategies the design rejects have causes to show.
    for row in &report.rows {
        let expected_clean = matches!(row.strategy, Strategy::Idem | Strategy::Optimistic);
        if expected_clean {
            assert!(
                row.causes().is_empty(),
                "{:?}: {:?}",
                row.strategy,
                row.causes()
            );
        } else {
            ensure!(
                !row.causes().is_empty(),
                "{:?} shows no failure",
                row.strategy
            );
        }
        assert!(row.throughput().is_some_and(|rate| rate > 0.0));
    }
    assert_removed(&name).await
}

/// The lab leaves no schema and no queue behind.
async fn assert_removed(name: &str) -> anyhow::Result<()> {
    let (client, connection) =
        tokio_postgres::connect(&database_url(), tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    let schemas: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_namespace WHERE starts_with(nspname, $1)",
            &[&name],
        )
        .await?
        .get(0);
    assert_eq!(schemas, 0, "schemas left");
    let amqp = AmqpConfig::new(SecretUrl::new(amqp_url()));
    for strategy in Strategy::ALL {
        let queue = format!("{name}.{}", strategy.slug());
        assert!(
            crate::support::ready(&amqp, &queue).await.is_err(),
            "{queue} was left"
        );
    }
    Ok(())
}

fn idem_lab(name: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
    command
        .env(vars::AMQP_URL, amqp_url())
        .env(vars::DATABASE_URL, database_url())
        .env(vars::REDIS_URL, redis_url())
        .args(["lab", "--name", name]);
    command
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_prints_the_table_and_names_an_unreachable_redis_without_its_password()
-> anyhow::Result<()> {
    let name = unique_name();
    let output = idem_lab(&name)
        .args([
            "--strategies",
            "idem,redis",
            "--events",
            "3",
            "--load",
            "50",
        ])
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    assert!(
        stdout.contains("4 idem: unique record, same tx"),
        "{stdout}"
    );
    assert!(stdout.contains("5 Redis SET NX, then db"), "{stdout}");
    assert!(!stdout.contains("check, then act"), "{stdout}");
    assert!(stdout.contains("What caused it:"), "{stdout}");

    let output = idem_lab(&name)
        .env(vars::REDIS_URL, "redis://:hunter2@127.0.0.1:1")
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("cannot reach Redis"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
    assert_removed(&name).await
}
