//! A publish counts only when confirmed and routed; anything else is a
//! failure the publisher reports.

use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use tokio_util::sync::CancellationToken;

use idem::broker::{Outgoing, PublishOptions, Refusal, SessionError, publish_all};

use crate::helpers::{TestEnv, patient};

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
async fn a_publish_to_a_full_queue_is_reported_as_nacked() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let queue = format!("{}.full", env.topology.queue);
    let connection = env.connect().await?;
    let channel = connection.create_channel().await?;
    let mut arguments = FieldTable::default();
    arguments.insert("x-max-length".into(), AMQPValue::LongLongInt(1));
    arguments.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                auto_delete: false,
                exclusive: false,
                ..QueueDeclareOptions::default()
            },
            arguments,
        )
        .await?;
    channel.close(200, "OK".into()).await?;
    connection.close(200, "OK".into()).await?;
    let messages: Vec<Outgoing> = (0..3).map(|_| message("", &queue, b"{}")).collect();
    let options = PublishOptions {
        window: 1,
        ..options()
    };
    let report = publish_all(&env.amqp, &messages, &options, &CancellationToken::new()).await;
    // Remove the queue before asserting.
    let connection = env.connect().await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await?;
    channel.close(200, "OK".into()).await?;
    connection.close(200, "OK".into()).await?;
    let report = report?;
    assert_eq!(report.confirmed, 1);
    assert_eq!(
        report.refused,
        vec![(1, Refusal::Nacked), (2, Refusal::Nacked)]
    );
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
