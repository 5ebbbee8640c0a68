//! What idem promises around a team's handler: each event's effect once,
//! however often it arrives; invalid bodies dead-lettered at once; failures
//! retried as the retry policy says, then dead-lettered; messages sent
//! through the outbox once per applied event; a check that passes.

use std::time::Duration;

use idem::Exchange;
use idem::{CheckConfig, Mode, RetryPolicy, Topology};

use crate::deposits::{self, CLOSED, Deposits};
use crate::support::{Running, patient, wait_for, with_env};

const GROUP: &str = "deposits";

/// Every event of `events` on `accounts` accounts, 1 to `events` in
/// amount, each published `copies` times, a copy after every event.
fn deposits_with_copies(events: usize, accounts: usize, copies: usize) -> Vec<Vec<u8>> {
    let mut bodies = Vec::new();
    for i in 0..events {
        let body = deposits::body(
            &format!("deposit-{i}"),
            &format!("acc-{}", i % accounts),
            i as i64 + 1,
        );
        for _ in 0..copies {
            bodies.push(body.clone());
        }
    }
    bodies
}

async fn every_event_applies_once_however_often_it_arrives(mode: Mode) -> anyhow::Result<()> {
    with_env::<Deposits, _, _>(deposits::topology(), move |env| async move {
        let bodies = deposits_with_copies(300, 7, 3);
        env.publish(&bodies).await?;
        let worker = Running::start(env.worker_config(mode, GROUP), Deposits::default());
        worker.settled(900, Duration::from_secs(60)).await?;
        let stats = worker.stop().await?;
        assert_eq!((stats.applied, stats.duplicates), (300, 600));
        // 1 + 2 + … + 300, each once.
        assert_eq!(
            env.number("SELECT sum(amount)::bigint FROM balances")
                .await?,
            45_150
        );
        assert_eq!(env.number("SELECT count(*) FROM balances").await?, 7);
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_applies_once_however_often_it_arrives_in_batch_mode() -> anyhow::Result<()> {
    every_event_applies_once_however_often_it_arrives(Mode::Batch).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_applies_once_however_often_it_arrives_one_message_a_transaction()
-> anyhow::Result<()> {
    every_event_applies_once_however_often_it_arrives(Mode::PerMessage).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_body_is_dead_lettered_at_once_and_the_others_apply() -> anyhow::Result<()> {
    with_env::<Deposits, _, _>(deposits::topology(), |env| async move {
        let bodies = vec![
            deposits::body("deposit-1", "ada", 10),
            b"{not json".to_vec(),
            deposits::body("deposit-2", "ada", -5),
            deposits::body("deposit-3", "ada", 20),
        ];
        env.publish(&bodies).await?;
        let worker = Running::start(env.worker_config(Mode::Batch, GROUP), Deposits::default());
        worker.settled(4, Duration::from_secs(30)).await?;
        let stats = worker.stop().await?;
        assert_eq!((stats.applied, stats.invalid, stats.retried), (2, 2, 0));
        assert_eq!(
            env.number("SELECT amount FROM balances WHERE account = 'ada'")
                .await?,
            30
        );
        assert_eq!(env.ready(&env.topology.dead_letter_queue).await?, 2);
        Ok(())
    })
    .await
}

/// A deposit that would take a balance past the constraint fails as the
/// message's fault: tried as often as the policy says, waiting as it says
/// between attempts, then dead-lettered; the others apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_event_is_tried_as_often_as_its_policy_says_then_dead_lettered()
-> anyhow::Result<()> {
    let delay = Duration::from_millis(300);
    let topology = Topology {
        retry: RetryPolicy::new([delay], 3),
        ..deposits::topology()
    };
    with_env::<Deposits, _, _>(topology, move |env| async move {
        let bodies = vec![
            deposits::body("deposit-1", "ada", 10),
            deposits::body("deposit-big", "ada", 2_000_000),
            deposits::body("deposit-2", "bob", 20),
        ];
        env.publish(&bodies).await?;
        let started = std::time::Instant::now();
        let worker = Running::start(env.worker_config(Mode::Batch, GROUP), Deposits::default());
        worker.settled(3, Duration::from_secs(30)).await?;
        let elapsed = started.elapsed();
        let stats = worker.stop().await?;
        // Three attempts: two retries, each after the policy's delay.
        assert_eq!(
            (stats.applied, stats.retried, stats.dead_lettered),
            (2, 2, 1)
        );
        assert!(elapsed >= delay * 2, "dead-lettered after {elapsed:?}");
        assert_eq!(env.ready(&env.topology.dead_letter_queue).await?, 1);
        assert_eq!(
            env.number("SELECT sum(amount)::bigint FROM balances")
                .await?,
            30
        );
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_the_handler_says_can_never_apply_is_dead_lettered_without_retries()
-> anyhow::Result<()> {
    with_env::<Deposits, _, _>(deposits::topology(), |env| async move {
        env.publish(&[
            deposits::body("deposit-1", CLOSED, 10),
            deposits::body("deposit-2", "ada", 5),
        ])
        .await?;
        let worker = Running::start(env.worker_config(Mode::Batch, GROUP), Deposits::default());
        worker.settled(2, Duration::from_secs(30)).await?;
        let stats = worker.stop().await?;
        assert_eq!(
            (stats.applied, stats.retried, stats.dead_lettered),
            (1, 0, 1)
        );
        assert_eq!(env.ready(&env.topology.dead_letter_queue).await?, 1);
        Ok(())
    })
    .await
}

/// The handler's messages leave through the outbox: one per applied
/// event, none for a copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_applied_event_sends_its_message_once_through_the_outbox() -> anyhow::Result<()> {
    with_env::<Deposits, _, _>(deposits::topology(), |env| async move {
        let (exchange, queue) = env.announced();
        let mut config = env.worker_config(Mode::Batch, GROUP);
        config.outgoing = vec![Exchange::topic(&exchange)];
        let handler = Deposits {
            announce_to: Some(exchange.clone()),
        };
        env.declare_announced().await?;
        env.publish(&deposits_with_copies(100, 5, 2)).await?;
        let worker = Running::start(config, handler);
        worker.settled(200, Duration::from_secs(60)).await?;
        wait_for(
            "every credit announced",
            Duration::from_secs(30),
            || async { Ok(env.ready(&queue).await? >= 100) },
        )
        .await?;
        worker.stop().await?;
        assert_eq!(env.ready(&queue).await?, 100);
        assert_eq!(
            env.number("SELECT count(*) FROM mq_outbox_message WHERE sent_at IS NULL")
                .await?,
            0
        );
        Ok(())
    })
    .await
}

/// `check` puts the handler under idem's faults and compares with its
/// events applied one at a time: a correct handler passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_of_a_correct_handler_passes() -> anyhow::Result<()> {
    let mut events = deposits_with_copies(120, 9, 1);
    events.push(b"{}".to_vec());
    let database = idem::DatabaseConfig::new(idem::SecretUrl::new(crate::support::database_url()));
    let amqp = idem::AmqpConfig::new(idem::SecretUrl::new(crate::support::amqp_url()));
    let mut config = CheckConfig::new(amqp, database, GROUP, events);
    config.patience = patient(CheckConfig::DEFAULT_PATIENCE);
    let report = idem::check::run(&config, Deposits::default).await?;
    assert!(report.passed(), "{}", report.verdict());
    assert_eq!((report.events, report.invalid), (120, 1));
    Ok(())
}

/// A team's schema holds idem's tables and the team's, and no table of the
/// points service's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_migrated_for_a_teams_handler_holds_no_points_table() -> anyhow::Result<()> {
    with_env::<Deposits, _, _>(deposits::topology(), |env| async move {
        let tables = |name: &'static str| {
            let env = std::sync::Arc::clone(&env);
            async move {
                env.number(&format!(
                    "SELECT (to_regclass('{name}') IS NOT NULL)::int::bigint"
                ))
                .await
            }
        };
        assert_eq!(tables("balances").await?, 1);
        assert_eq!(tables("mq_consume_record").await?, 1);
        assert_eq!(tables("user_points").await?, 0);
        Ok(())
    })
    .await
}
