//! The effect is applied once per event and consumer group, however many
//! times the event arrives and however many workers race for it.

use std::time::Duration;

use idem_points::generate::{self, LoadSpec};
use idem_points::points::PaymentSucceeded;

use crate::support::{GROUP, RunningWorker, TestEnv};
use idem::worker::Mode;

fn payment(event_id: &str, order_id: &str, points: i64) -> PaymentSucceeded {
    PaymentSucceeded {
        event_id: event_id.into(),
        order_id: order_id.into(),
        points,
    }
}

async fn duplicate_delivery_adds_points_once(mode: Mode) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    assert_eq!(env.points("10001").await?, 0);
    let event = payment("payment-success-10001", "10001", 100);
    env.publish_events(&[event.clone(), event.clone()]).await?;

    let worker = RunningWorker::start(env.worker_config(mode));
    worker.wait_finished(2, Duration::from_secs(20)).await?;
    worker.stop().await?;

    assert_eq!(env.records_of("payment-success-10001", GROUP).await?, 1);
    assert_eq!(env.points("10001").await?, 100);
    Ok(())
}

async fn an_event_published_again_later_is_still_applied_once(mode: Mode) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let event = payment("payment-success-20001", "20001", 30);
    env.publish_events(std::slice::from_ref(&event)).await?;
    let worker = RunningWorker::start(env.worker_config(mode));
    worker.wait_finished(1, Duration::from_secs(20)).await?;
    worker.stop().await?;

    // A producer retry after the first copy was consumed, by a new worker.
    env.publish_events(&[event]).await?;
    let worker = RunningWorker::start(env.worker_config(mode));
    worker.wait_finished(1, Duration::from_secs(20)).await?;
    let stats = worker.stop().await?;

    assert_eq!((stats.applied, stats.duplicates), (0, 1));
    assert_eq!(env.points("20001").await?, 30);
    Ok(())
}

async fn two_workers_on_one_queue_apply_each_event_once(mode: Mode) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let load = generate::events(&LoadSpec {
        // Enough for both workers to take part, however fast the first one.
        count: match mode {
            Mode::PerMessage => 3000,
            Mode::Batch => 15_000,
        },
        duplicate_ratio: 0.4,
        orders: 25,
        seed: 11,
        prefix: env.name.clone(),
    });
    env.publish_events(&load).await?;

    let first = RunningWorker::start(env.worker_config(mode));
    let second = RunningWorker::start(env.worker_config(mode));
    let total = load.len() as u64;
    crate::support::wait_for(
        "every delivery finished by two workers",
        Duration::from_secs(60),
        || async {
            Ok(first.stats.snapshot().finished() + second.stats.snapshot().finished() >= total)
        },
    )
    .await?;
    let (a, b) = (first.stats.snapshot(), second.stats.snapshot());
    first.stop().await?;
    second.stop().await?;

    assert!(
        a.finished() > 0 && b.finished() > 0,
        "both workers took part: {a:?} {b:?}"
    );
    assert_eq!(
        a.applied + b.applied,
        generate::distinct_events(&load) as u64
    );
    assert_eq!(
        env.records(GROUP).await?,
        generate::distinct_events(&load) as i64
    );
    assert_eq!(env.doubly_recorded(GROUP).await?, 0);
    // Claims in event-id order and updates in order-id order: concurrent
    // transactions never deadlock, so nothing had to be retried.
    assert_eq!(a.infrastructure_retries + b.infrastructure_retries, 0);
    assert_eq!(env.all_points().await?, generate::expected_points(&load));
    Ok(())
}

async fn an_event_is_applied_once_per_consumer_group(mode: Mode) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    // A second group: its own queue, bound to the same exchange.
    let mut other = env.topology.clone();
    other.queue = format!("{}.notifications", env.topology.queue);
    other.dead_letter_queue = format!("{}.dlq", other.queue);
    env.declare(&other).await?;
    let event = payment("payment-success-30001", "30001", 10);
    env.publish_events(&[event.clone(), event]).await?;

    let points = RunningWorker::start(env.worker_config(mode));
    let mut config = env.worker_config(mode);
    config.topology = other;
    config.consumer_group = "notifications-group".into();
    let notifications = RunningWorker::start(config);
    points.wait_finished(2, Duration::from_secs(20)).await?;
    notifications
        .wait_finished(2, Duration::from_secs(20))
        .await?;
    let (p, n) = (points.stats.snapshot(), notifications.stats.snapshot());
    points.stop().await?;
    notifications.stop().await?;

    assert_eq!((p.applied, p.duplicates), (1, 1));
    assert_eq!((n.applied, n.duplicates), (1, 1));
    assert_eq!(env.records_of("payment-success-30001", GROUP).await?, 1);
    assert_eq!(
        env.records_of("payment-success-30001", "notifications-group")
            .await?,
        1
    );
    // Both groups run the points effect here, so each added its 10 once.
    assert_eq!(env.points("30001").await?, 20);
    Ok(())
}

in_both_modes!(
    duplicate_delivery_adds_points_once,
    an_event_published_again_later_is_still_applied_once,
    two_workers_on_one_queue_apply_each_event_once,
    an_event_is_applied_once_per_consumer_group,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_in_one_batch_count_once_and_the_first_delivered_wins() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let store = idem::store::Store::new(env.pool.clone(), GROUP);
    let store = idem::store::Applier::new(store, std::sync::Arc::new(idem_points::points::Points))?;
    let first = payment("batch-event-1", "batch-order", 5);
    let later_copy = payment("batch-event-1", "batch-order", 9);
    let other = payment("batch-event-2", "batch-order", 1);

    let mut claimed = store.apply(&[&first, &other, &later_copy]).await?;
    assert!(claimed.take("batch-event-1"), "the first copy went in");
    assert!(
        !claimed.take("batch-event-1"),
        "the second copy is a duplicate"
    );
    assert!(claimed.take("batch-event-2"));
    assert_eq!(env.points("batch-order").await?, 6);

    let mut again = store.apply(&[&later_copy, &other]).await?;
    assert!(!again.take("batch-event-1") && !again.take("batch-event-2"));
    assert_eq!(env.points("batch-order").await?, 6);
    assert_eq!(env.records(GROUP).await?, 2);
    Ok(())
}
