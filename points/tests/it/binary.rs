//! The `idem` binary as users run it: exit codes, one-line errors, signals.
//!
//! Over 700 lines: one scenario per test, the binary's in one place.

use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use tokio::process::Command;

use idem::store::migrate;
use idem_points::points::PaymentSucceeded;

use crate::support::{
    GROUP, TestEnv, amqp_url, database_url, patient, wait_for, worker_exits_at_once,
};
use idem::worker::Mode;

/// `idem` pointed at `env`'s schema and topology and the local services.
fn idem(env: &TestEnv) -> Command {
    crate::support::idem_command(env, &amqp_url(), &database_url())
}

async fn output(mut command: Command) -> anyhow::Result<(Option<i32>, String, String)> {
    let timeout = patient(Duration::from_secs(60));
    let output = tokio::time::timeout(timeout, command.output())
        .await
        .with_context(|| format!("the command did not finish within {timeout:?}"))??;
    Ok((
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_flag_gets_one_line_naming_it() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    for (args, names) in [
        (vec!["worker", "--prefetch", "many"], "--prefetch"),
        (vec!["worker", "--no-such-flag"], "--no-such-flag"),
        (
            vec![
                "publish",
                "--event-id",
                "e",
                "--order-id",
                "o",
                "--points",
                "-1",
            ],
            "points",
        ),
    ] {
        let mut command = idem(&env);
        command.args(&args);
        let (code, _, stderr) = output(command).await?;
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(names), "{args:?}: {stderr}");
        assert!(matches!(code, Some(1) | Some(2)), "{args:?}: exit {code:?}");
        assert!(!stderr.contains("panicked"));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_credentials_or_vhost_end_the_worker_at_once_without_echoing_the_password()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    for url in [
        crate::support::amqp_url_with(|url| {
            let _ = url.set_password(Some("not-the-password"));
        }),
        crate::support::amqp_url_on("no-such-vhost-for-idem"),
    ] {
        let mut command = idem(&env);
        command.env("AMQP_URL", &url);
        let stderr = worker_exits_at_once(command).await?;
        assert!(
            stderr.starts_with("idem: ") && stderr.contains("refused"),
            "{stderr}"
        );
        assert!(
            !stderr.contains("not-the-password"),
            "the password leaked: {stderr}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_are_idempotent_and_safe_to_run_concurrently() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    // A fresh schema, migrated by four processes at once.
    let schema = format!("{}_m", env.schema);
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let mut command = idem(&env);
            command.env("IDEM_SCHEMA", &schema).arg("migrate");
            output(command)
        })
        .collect();
    let results = futures::future::join_all(runs).await;
    let mut applied = 0;
    for result in results {
        let (code, stdout, stderr) = result?;
        assert_eq!(code, Some(0), "{stderr}");
        applied += usize::from(stdout.contains("applied"));
    }
    let database = env.database.clone().with_schema(&schema);
    let pool = database.pool()?;
    let again = migrate::run::<idem_points::points::Points>(&pool, Some(&schema)).await;
    let client = pool.get().await?;
    let recorded: i64 = client
        .query_one("SELECT count(*) FROM idem_schema_migrations", &[])
        .await?
        .get(0);
    client
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await?;
    assert_eq!(applied, 1, "exactly one process applied the migrations");
    assert_eq!(again?, Vec::<&str>::new());
    assert_eq!(recorded, migrate::MIGRATIONS.len() as i64);
    Ok(())
}

/// `idem publish` of one event.
const PUBLISH_ONE: [&str; 7] = [
    "publish",
    "--event-id",
    "e-1",
    "--order-id",
    "o-1",
    "--points",
    "3",
];

/// A missing exchange or queue will not appear by reconnecting: `publish`
/// and `requeue` stop at once with the broker's reason (they used to
/// reconnect in a tight loop, hammering the broker, until killed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_exchange_or_dead_letter_queue_ends_publish_or_requeue_at_once()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let missing_exchange = format!("{}.missing", env.topology.exchange);
    let missing_queue = format!("{}.missing", env.topology.dead_letter_queue);
    let publish = [
        &PUBLISH_ONE[..],
        &["--exchange", missing_exchange.as_str()][..],
    ]
    .concat();
    let requeue = ["requeue", "--dead-letter-queue", missing_queue.as_str()];
    for (args, missing) in [
        (&publish[..], &missing_exchange),
        (&requeue[..], &missing_queue),
    ] {
        let mut command = idem(&env);
        command.args(args).env("IDEM_STARTUP_TIMEOUT", "30s");
        // Retrying would log a line per attempt and, after 30 s of waits,
        // end with a different error: one line saying "refused" is no retry.
        let (code, stdout, stderr) = output(command).await?;
        assert_eq!(code, Some(1), "{args:?}: {stdout}{stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(
            stderr.starts_with("idem: ")
                && stderr.contains("refused")
                && stderr.contains("NOT_FOUND")
                && stderr.contains(missing.as_str()),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_exits_non_zero_when_a_message_is_returned() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let mut command = idem(&env);
    command
        .args(PUBLISH_ONE)
        .args(["--routing-key", "routes.nowhere"]);
    let (code, stdout, stderr) = output(command).await?;
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert!(
        stdout.contains("1 refused") && stdout.contains("NO_ROUTE"),
        "{stdout}"
    );

    let mut command = idem(&env);
    command.args([
        "publish",
        "--count",
        "20",
        "--duplicate-ratio",
        "0.5",
        "--orders",
        "3",
        "--seed",
        "1",
    ]);
    command.env("RUST_LOG", "info");
    let (code, stdout, stderr) = output(command).await?;
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    let distinct = idem_points::generate::distinct_events(&idem_points::generate::events(
        &idem_points::generate::LoadSpec {
            count: 20,
            duplicate_ratio: 0.5,
            orders: 3,
            seed: 1,
            prefix: "load-1".into(),
        },
    ));
    assert!(distinct < 20);
    assert!(
        stdout.contains(&format!(
            "published 20 messages ({distinct} distinct events): 20 confirmed"
        )),
        "{stdout}"
    );
    // Not on a terminal: progress as log lines, the last one at the end.
    assert!(stderr.contains("publishing: 20 of 20"), "{stderr}");
    assert_eq!(env.ready(&env.topology.queue).await?, 20);
    Ok(())
}

async fn sigterm_with_deliveries_in_flight_commits_acks_and_exits_zero(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    // Slow transactions, so that SIGTERM lands while several are in flight.
    env.sql(
        "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_sleep(0.2); RETURN NEW; END $$;
         CREATE TRIGGER slow BEFORE INSERT OR UPDATE ON user_points
             FOR EACH ROW EXECUTE FUNCTION slow();",
    )
    .await?;
    let events: Vec<PaymentSucceeded> = (0..60)
        .map(|i| PaymentSucceeded {
            event_id: format!("sigterm-{i}"),
            order_id: format!("order-{i}"),
            points: 1,
        })
        .collect();
    env.publish_events(&events).await?;

    let mut command = idem(&env);
    command
        .args(["worker", "--prefetch", "8", "--max-in-flight", "4"])
        .args(["--mode", mode.as_flag()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = command.spawn()?;
    wait_for(
        "some transactions to commit",
        Duration::from_secs(20),
        || async { Ok(env.records(GROUP).await? >= 4) },
    )
    .await?;
    let pid = child.id().context("no pid")?;
    let killed = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await?;
    assert!(killed.success());
    let status = tokio::time::timeout(patient(Duration::from_secs(30)), child.wait()).await??;
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        use tokio::io::AsyncReadExt;
        pipe.read_to_string(&mut stderr).await?;
    }
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("worker stopped"), "{stderr}");

    // Everything taken was committed and acked, or given back uncommitted:
    // nothing committed came back, nothing acked was lost.
    let committed = env.records(GROUP).await?;
    let ready = i64::from(env.ready(&env.topology.queue).await?);
    assert!(committed < 60, "the worker stopped before the end");
    assert_eq!(
        committed + ready,
        60,
        "committed {committed}, back in the queue {ready}"
    );
    let total: i64 = env.all_points().await?.values().sum();
    assert_eq!(total, committed);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_database_or_an_unmigrated_schema_ends_the_worker_at_once() -> anyhow::Result<()>
{
    let env = TestEnv::new().await?;
    let cases = [
        (
            "DATABASE_URL",
            crate::support::database_url_in("idem_no_such_database"),
            "does not exist",
        ),
        (
            "IDEM_SCHEMA",
            format!("{}_never_migrated", env.schema),
            "run `idem migrate` first",
        ),
    ];
    for (variable, value, says) in cases {
        let mut command = idem(&env);
        command.env(variable, &value);
        let stderr = worker_exits_at_once(command).await?;
        assert!(stderr.contains(says), "{stderr}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_permission_on_its_queue_ends_the_worker_at_once() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    // Configure and write, but no read: declaring a queue with a
    // dead-letter exchange needs read permission on it.
    let vhost = crate::support::Vhost::add(".*", ".*", "^$")?;
    let mut command = idem(&env);
    command.env("AMQP_URL", vhost.amqp_url());
    let stderr = worker_exits_at_once(command).await?;
    assert!(
        stderr.starts_with("idem: RabbitMQ refused to declare queue")
            && stderr.contains("ACCESS_REFUSED")
            && stderr.contains("permissions"),
        "{stderr}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrate_that_cannot_connect_says_why_once_in_one_line() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let mut command = idem(&env);
    command
        .env(
            "DATABASE_URL",
            crate::support::database_url_with(|url| {
                let _ = url.set_username("idem_no_such_role");
                let _ = url.set_password(Some("hunter2"));
            }),
        )
        .arg("migrate");
    let (code, _, stderr) = output(command).await?;
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert_eq!(
        stderr.matches("idem_no_such_role\" does not exist").count(),
        1,
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");
    Ok(())
}

/// A worker holding deliveries it cannot commit: the database is cut off.
async fn worker_holding_deliveries(
    env: &TestEnv,
    mode: Mode,
    database: &crate::proxy::Proxy,
    load: &[PaymentSucceeded],
    shutdown_timeout: &str,
) -> anyhow::Result<crate::support::WorkerProcess> {
    env.publish_events(load).await?;
    let worker = crate::support::WorkerProcess::spawn(
        env,
        mode,
        &amqp_url(),
        &env.database_url_via(database.port),
        &["--shutdown-timeout", shutdown_timeout, "--prefetch", "10"],
    )?;
    wait_for("some commits", Duration::from_secs(30), || async {
        Ok(env.records(GROUP).await? >= 5)
    })
    .await?;
    database.sever();
    wait_for(
        "the worker to hold its deliveries",
        Duration::from_secs(30),
        || async { Ok(worker.log().contains("database unavailable")) },
    )
    .await?;
    Ok(worker)
}

async fn past_the_shutdown_deadline_the_worker_closes_exits_zero_and_loses_nothing(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let database = crate::proxy::Proxy::start(crate::support::postgres_address()).await?;
    let load = crate::support::load(&env, 300, 0.1, 10);
    let mut worker = worker_holding_deliveries(&env, mode, &database, &load, "2s").await?;

    worker.signal("-TERM").await?;
    let started = std::time::Instant::now();
    let code = worker.wait(Duration::from_secs(20)).await?;
    let log = worker.log();
    assert_eq!(code, Some(0), "{log}");
    assert!(
        started.elapsed() < patient(Duration::from_secs(8)),
        "took {:?}",
        started.elapsed()
    );
    assert!(log.contains("shutdown timeout reached"), "{log}");

    // What it held went back to the queue: another worker applies it all.
    database.restore();
    let next = crate::support::RunningWorker::start(env.worker_config(mode));
    next.wait_finished(1, Duration::from_secs(30)).await?;
    wait_for("every event", Duration::from_secs(60), || async {
        Ok(env.records(GROUP).await? == idem_points::generate::distinct_events(&load) as i64)
    })
    .await?;
    next.stop().await?;
    crate::support::assert_exact(&env, &load, &[]).await
}

async fn a_second_signal_exits_at_once(mode: Mode) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let database = crate::proxy::Proxy::start(crate::support::postgres_address()).await?;
    let load = crate::support::load(&env, 300, 0.1, 10);
    // Far longer than the test may take: only the second signal can end it.
    let mut worker = worker_holding_deliveries(&env, mode, &database, &load, "10m").await?;

    worker.signal("-TERM").await?;
    wait_for(
        "the first signal to be seen",
        Duration::from_secs(10),
        || async { Ok(worker.log().contains("shutdown signal received")) },
    )
    .await?;
    worker.signal("-INT").await?;
    let started = std::time::Instant::now();
    let code = worker.wait(Duration::from_secs(10)).await?;
    assert_eq!(code, Some(130), "{}", worker.log());
    assert!(
        started.elapsed() < patient(Duration::from_secs(1)),
        "took {:?}",
        started.elapsed()
    );

    database.restore();
    let next = crate::support::RunningWorker::start(env.worker_config(mode));
    wait_for("every event", Duration::from_secs(60), || async {
        Ok(env.records(GROUP).await? == idem_points::generate::distinct_events(&load) as i64)
    })
    .await?;
    next.stop().await?;
    crate::support::assert_exact(&env, &load, &[]).await
}

in_both_modes!(
    sigterm_with_deliveries_in_flight_commits_acks_and_exits_zero,
    past_the_shutdown_deadline_the_worker_closes_exits_zero_and_loses_nothing,
    a_second_signal_exits_at_once,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_usage_error_says_in_one_line_what_is_wrong_and_which_help_to_read() -> anyhow::Result<()>
{
    let env = TestEnv::new().await?;
    for (args, says, code) in [
        (
            &["publish", "--event-id", "e"][..],
            &[
                "required arguments were not provided: --order-id <ORDER_ID>, --points <POINTS>",
                "(see idem publish --help)",
            ][..],
            2,
        ),
        (
            &["worker", "--batchsize", "3"][..],
            &["'--batchsize'", "a similar argument exists: '--batch-size'"][..],
            2,
        ),
        (
            &["worker", "--mode", "fast"][..],
            &[
                "[possible values: batch, per-message]",
                "(see idem worker --help)",
            ][..],
            2,
        ),
        (
            &["dlq", "replay", "--rate", "fast"][..],
            &["(see idem dlq replay --help)"][..],
            2,
        ),
        (
            &["worker", "--batch-wait", "5"][..],
            &["'5' has no unit: say 5ms, 5s, 5m, 5h or 5d"][..],
            2,
        ),
        (
            &["worker", "--prefetch", "100", "--batch-size", "500"][..],
            &[
                "--batch-size (500) is above --prefetch (100)",
                "(see idem worker --help)",
            ][..],
            2,
        ),
    ] {
        let mut command = idem(&env);
        command.args(args);
        let (exit, _, stderr) = output(command).await?;
        assert_eq!(exit, Some(code), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        for part in says {
            assert!(stderr.contains(part), "{args:?}: {stderr}");
        }
    }
    // Each value is blamed on where it came from: the environment or a flag.
    for (env_var, args, says, code) in [
        (
            Some(("IDEM_BATCH_WAIT", "5")),
            &["worker"][..],
            "invalid value '5' in IDEM_BATCH_WAIT (read for --batch-wait)",
            2,
        ),
        (
            None,
            &["worker", "--http-addr", "9475"][..],
            "say HOST:PORT, such as 127.0.0.1:9475",
            2,
        ),
        (
            None,
            &["worker", "--database-url", "mysql://x"][..],
            "--database-url is not a valid PostgreSQL connection string: \
             it must start with postgres:// or postgresql://, not mysql://",
            1,
        ),
        (
            Some(("DATABASE_URL", "mysql://x")),
            &["worker"][..],
            "DATABASE_URL is not a valid PostgreSQL connection string",
            1,
        ),
        (
            Some(("AMQP_URL", "amqp//x")),
            &[
                "publish",
                "--event-id",
                "e",
                "--order-id",
                "o",
                "--points",
                "1",
            ][..],
            "cannot use AMQP_URL for RabbitMQ: not a valid amqp:// or amqps:// URL",
            1,
        ),
    ] {
        let mut command = idem(&env);
        if let Some((name, value)) = env_var {
            command.env(name, value);
        }
        command.args(args);
        let (exit, _, stderr) = output(command).await?;
        assert_eq!(exit, Some(code), "{env_var:?} {args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{env_var:?} {args:?}: {stderr}");
    }
    // As JSON, with the JSON log format.
    let mut command = idem(&env);
    command.args(["--log-format", "json", "worker", "--mode", "fast"]);
    let (_, _, stderr) = output(command).await?;
    let line: serde_json::Value = serde_json::from_str(stderr.trim())?;
    assert_eq!(line["level"], "ERROR");
    assert!(
        line["fields"]["message"]
            .as_str()
            .is_some_and(|message| message.contains("invalid value 'fast'")),
        "{stderr}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_startup_timeout_is_honoured_to_the_second_by_migrate_and_the_worker()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    // Nothing listens on port 1: every attempt is refused at once.
    let nowhere = &crate::support::database_url_at(1);
    let server =
        idem::store::DatabaseConfig::new(idem::secret::SecretUrl::new(nowhere.clone())).describe();
    for subcommand in ["migrate", "worker"] {
        let mut command = crate::support::idem_command(&env, &amqp_url(), nowhere);
        command
            .env("IDEM_STARTUP_TIMEOUT", "2s")
            .env("RUST_LOG", "warn")
            .arg(subcommand);
        let started = std::time::Instant::now();
        let (code, _, stderr) = output(command).await?;
        let took = started.elapsed();
        assert_eq!(code, Some(1), "{subcommand}: {stderr}");
        assert!(
            took >= Duration::from_secs(2) && took < patient(Duration::from_secs(4)),
            "{subcommand} gave up after {took:?}: {stderr}"
        );
        assert!(
            stderr.contains(&format!("PostgreSQL at {server} is unavailable"))
                && stderr.contains("for 2s more")
                && stderr.contains("did not answer within 2s")
                && stderr
                    .contains("(--startup-timeout, IDEM_STARTUP_TIMEOUT, says how long to wait)"),
            "{subcommand}: {stderr}"
        );
    }
    Ok(())
}

/// A server that takes no writes (here a database whose sessions are
/// read-only; a standby says the same with "a standby"): the worker waits
/// for it as for one that does not answer, each attempt's line saying why
/// and what to give it instead, and gives up at its startup timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_server_is_named_as_such_with_what_to_give_the_worker_instead()
-> anyhow::Result<()> {
    let env = TestEnv::in_own_database().await?;
    let database = env.database_name();
    crate::support::admin()
        .await?
        .batch_execute(&format!(
            "ALTER DATABASE {database} SET default_transaction_read_only = on"
        ))
        .await?;
    let url = crate::support::database_url_in(&database);
    let mut command = crate::support::idem_command(&env, &amqp_url(), &url);
    command
        .env("IDEM_STARTUP_TIMEOUT", "2s")
        .env("RUST_LOG", "warn")
        .arg("worker");
    let (code, _, stderr) = output(command).await?;
    assert_eq!(code, Some(1), "{stderr}");
    let said = "the server is read-only (default_transaction_read_only) and takes no writes; \
        idem writes, so it needs the primary: give it every host of the primary and its \
        standbys with target_session_attrs=read-write";
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(
        lines.len() >= 2 && lines.iter().all(|line| line.contains(said)),
        "every attempt and the last line say so: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmigrated_schema_is_named_and_the_dead_letter_commands_say_to_migrate_once()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let schema = format!("{}_never_migrated", env.schema);
    for args in [&["worker"][..], &["requeue"][..], &["dlq", "list"][..]] {
        let mut command = idem(&env);
        command.env("IDEM_SCHEMA", &schema).args(args);
        let (code, stdout, stderr) = output(command).await?;
        assert_eq!(code, Some(1), "{args:?}: {stdout}{stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "in {}, schema {schema} (which does not exist) is at migration 0",
                env.database.describe()
            )) && stderr.matches("run `idem migrate` first").count() == 1,
            "{args:?}: {stderr}"
        );
    }
    Ok(())
}

/// A lock held by someone else becomes a logged hold, not a silent hang:
/// the lock timeout makes the transaction fail as the infrastructure's.
async fn a_stray_lock_becomes_a_logged_hold_and_the_worker_goes_on_when_it_is_released(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let load = crate::support::load(&env, 200, 0.1, 5);
    // Someone's open transaction holds the points table.
    let (locker, connection) = tokio_postgres::connect(
        &crate::support::database_url_with(|url| {
            let search_path = format!("-c search_path={}", env.schema);
            crate::support::append_query(url, "options", &search_path);
        }),
        tokio_postgres::NoTls,
    )
    .await?;
    tokio::spawn(connection);
    locker
        .batch_execute("BEGIN; LOCK TABLE user_points IN ACCESS EXCLUSIVE MODE")
        .await?;
    env.publish_events(&load).await?;
    let worker = crate::support::WorkerProcess::spawn(
        &env,
        mode,
        &amqp_url(),
        &database_url(),
        &["--lock-timeout", "500ms"],
    )?;
    wait_for(
        "the worker to report the hold",
        Duration::from_secs(30),
        || async { Ok(worker.log().contains("lock timeout")) },
    )
    .await?;
    assert!(
        worker.log().contains("database unavailable"),
        "{}",
        worker.log()
    );
    assert_eq!(
        env.records(GROUP).await?,
        0,
        "nothing committed under the lock"
    );
    locker.batch_execute("ROLLBACK").await?;
    wait_for("every event", Duration::from_secs(30), || async {
        Ok(env.records(GROUP).await? == idem_points::generate::distinct_events(&load) as i64)
    })
    .await?;
    let log = worker.stop().await?;
    assert!(log.contains("database answers again"), "{log}");
    crate::support::assert_exact(&env, &load, &[]).await
}

in_both_modes!(a_stray_lock_becomes_a_logged_hold_and_the_worker_goes_on_when_it_is_released);

/// The demo runs on data of its own, says what it leaves behind, and
/// `--clean` removes all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_says_what_it_leaves_behind_and_clean_removes_it() -> anyhow::Result<()> {
    let env = TestEnv::in_own_database().await?;
    let vhost = crate::support::Vhost::add(".*", ".*", ".*")?;
    let database = crate::support::database_url_in(&env.database_name());
    let demo = |args: &[&str]| {
        let mut command = crate::support::idem_command(&env, &vhost.amqp_url(), &database);
        command
            .env_remove(idem::vars::SCHEMA)
            .arg("demo")
            .args(args);
        command
    };
    let (code, stdout, stderr) = output(demo(&[])).await?;
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stdout.contains("applied              4")
            && stdout.contains(
                "left behind: schema idem_demo, queues and exchanges named idem-demo.*; \
                 `idem demo --clean` removes them"
            ),
        "{stdout}"
    );
    let schema_exists = || async {
        let client = tokio_postgres::connect(&database, tokio_postgres::NoTls).await;
        let (client, connection) = client?;
        tokio::spawn(connection);
        let row = client
            .query_one(
                "SELECT count(*) FROM pg_namespace WHERE nspname = 'idem_demo'",
                &[],
            )
            .await?;
        anyhow::Ok(row.try_get::<_, i64>(0)? == 1)
    };
    let queues = || -> anyhow::Result<usize> {
        let listed = crate::support::rabbitmqctl()
            .args(["list_queues", "-q", "-p", &vhost.0, "name"])
            .output()?;
        anyhow::ensure!(listed.status.success(), "rabbitmqctl list_queues failed");
        Ok(String::from_utf8_lossy(&listed.stdout)
            .lines()
            .filter(|line| line.starts_with("idem-demo."))
            .count())
    };
    assert!(schema_exists().await?);
    assert!(queues()? > 0);

    let (code, stdout, stderr) = output(demo(&["--clean"])).await?;
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("removed schema idem_demo"), "{stdout}");
    assert!(!schema_exists().await?, "the demo's schema is gone");
    assert_eq!(queues()?, 0, "the demo's queues are gone");
    Ok(())
}
