//! A publish counts only when confirmed and routed; anything else is a
//! failure the publisher reports.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use idem::broker::{Outgoing, PublishOptions, Refusal, SessionError, publish_all};

use crate::support::{SlowConsumer, TestEnv, patient};

fn message(exchange: &str, routing_key: &str, body: &[u8]) -> Outgoing {
    Outgoing::json(exchange, routing_key, body.to_vec())
}

fn options() -> PublishOptions {
    PublishOptions {
        window: 16,
        patience: patient(Duration::from_secs(5)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_publish_is_reported_as_returned() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let messages = [
        message(&env.topology.exchange, &env.topology.routing_key, b"{}"),
        message(&env.topology.exchange, "no.queue.is.bound.for.this", b"{}"),
    ];
    let report = publish_all(&env.amqp, &messages, &options(), &CancellationToken::new()).await?;
    assert_eq!(report.confirmed, 1);
    assert_eq!(
        report.refused,
        vec![(
            1,
            Refusal::Returned {
                code: 312,
                text: "NO_ROUTE".into()
            }
        )]
    );
    assert!(!report.all_confirmed());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_that_a_full_queue_keeps_nacking_is_reported_once_the_patience_is_spent()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let queue = env.bounded_queue("full", 1).await?;
    let messages: Vec<Outgoing> = (0..3).map(|_| message("", &queue, b"{}")).collect();
    let options = PublishOptions {
        window: 1,
        patience: Duration::from_secs(2),
    };
    let started = Instant::now();
    let report = publish_all(&env.amqp, &messages, &options, &CancellationToken::new()).await?;
    assert_eq!(report.confirmed, 1);
    assert_eq!(
        report.refused,
        vec![(1, Refusal::Nacked), (2, Refusal::Nacked)]
    );
    assert!(report.nacks_retried > 0, "{report:?}");
    assert!(
        started.elapsed() >= options.patience,
        "gave up after {:?}",
        started.elapsed()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_full_queue_nacks_goes_again_on_a_fresh_channel_until_it_is_confirmed()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let queue = env.bounded_queue("slow", 1).await?;
    // One message held by the consumer, one ready: the next is nacked
    // until the consumer takes another.
    let consumer = SlowConsumer::start(&env.amqp, &queue, Duration::from_millis(500)).await?;
    let bodies: Vec<Vec<u8>> = (0..6)
        .map(|i| format!("{{\"n\":{i}}}").into_bytes())
        .collect();
    let messages: Vec<Outgoing> = bodies
        .iter()
        .map(|body| message("", &queue, body))
        .collect();
    let options = PublishOptions {
        window: 1,
        patience: patient(Duration::from_secs(30)),
    };
    let report = publish_all(&env.amqp, &messages, &options, &CancellationToken::new()).await?;
    assert!(report.all_confirmed(), "{report:?}");
    assert_eq!(report.confirmed, messages.len());
    assert!(report.nacks_retried > 0, "nothing was nacked: {report:?}");
    let received = consumer
        .received(bodies.len(), Duration::from_secs(30))
        .await?;
    assert_eq!(received, bodies, "each message arrived once");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_to_a_missing_exchange_fails_with_the_brokers_reason() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let missing = format!("{}.missing", env.topology.exchange);
    let messages: Vec<Outgoing> = (0..3)
        .map(|_| message(&missing, &env.topology.routing_key, b"{}"))
        .collect();
    let options = PublishOptions {
        // Long enough that running out of patience could not pass for a refusal.
        patience: Duration::from_secs(600),
        ..options()
    };
    let never = CancellationToken::new();
    let publishing = publish_all(&env.amqp, &messages, &options, &never);
    let outcome = tokio::time::timeout(patient(Duration::from_secs(60)), publishing)
        .await
        .map_err(|_| anyhow::anyhow!("publish_all kept retrying a refused publish"))?;
    match outcome {
        Err(SessionError::Refused(reason)) => {
            assert!(
                reason.contains("NOT_FOUND") && reason.contains(&missing),
                "{reason}"
            );
            assert!(
                reason.contains("0 of 3 messages were confirmed"),
                "{reason}"
            );
        }
        other => anyhow::bail!("expected a refusal, got {other:?}"),
    }
    Ok(())
}
