//! Publishing, counting and peeking at queues, and a consumer that holds
//! what it takes.

use super::*;

/// Publishes `bodies` to `topology`'s exchange with its routing key, with
/// confirms; fails unless every one is confirmed.
pub async fn publish(
    amqp: &AmqpConfig,
    topology: &Topology,
    bodies: &[Vec<u8>],
) -> anyhow::Result<PublishReport> {
    let messages: Vec<Outgoing> = bodies
        .iter()
        .map(|body| topology.event(body.clone()))
        .collect();
    publish_messages(amqp, &messages).await
}

/// Publishes `messages` with confirms; fails unless every one is confirmed.
pub async fn publish_messages(
    amqp: &AmqpConfig,
    messages: &[Outgoing],
) -> anyhow::Result<PublishReport> {
    let options = PublishOptions {
        window: 500,
        patience: patient(Duration::from_secs(10)),
    };
    let report = publish_all(amqp, messages, &options, &CancellationToken::new()).await?;
    if !report.all_confirmed() {
        bail!("test publish not confirmed: {report:?}");
    }
    Ok(report)
}

/// Messages ready in `queue` of `amqp`'s vhost (not counting those
/// delivered and unacked).
pub async fn ready(amqp: &AmqpConfig, queue: &str) -> anyhow::Result<u32> {
    let connection = connect(amqp, "idem test").await?;
    let channel = connection.create_channel().await?;
    let ready = idem::broker::ready_messages(&channel, queue).await;
    channel.close(200, "OK".into()).await?;
    connection.close(200, "OK".into()).await?;
    Ok(ready?)
}

/// The messages ready in `queue` of `amqp`'s vhost, left in place.
pub async fn peek(amqp: &AmqpConfig, queue: &str) -> anyhow::Result<Vec<DeadLetter>> {
    let connection = connect(amqp, "idem test").await?;
    let channel = connection.create_channel().await?;
    let mut letters = Vec::new();
    let mut last = None;
    while let Some(message) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await?
    {
        last = Some(message.delivery.delivery_tag);
        letters.push(DeadLetter {
            body: message.delivery.data.clone(),
            properties: message.delivery.properties.clone(),
        });
    }
    if let Some(tag) = last {
        channel
            .basic_nack(
                tag,
                BasicNackOptions {
                    multiple: true,
                    requeue: true,
                },
            )
            .await?;
    }
    channel.close(200, "OK".into()).await?;
    // A quorum queue makes what was given back ready a moment later: wait
    // for it, so that the next look sees every message.
    let channel = connection.create_channel().await?;
    let peeked = u32::try_from(letters.len()).unwrap_or(u32::MAX);
    wait_for(
        "what was peeked to be back",
        Duration::from_secs(10),
        || async { Ok(idem::broker::ready_messages(&channel, queue).await? >= peeked) },
    )
    .await?;
    connection.close(200, "OK".into()).await?;
    Ok(letters)
}

/// A file removed when the test ends, however it ends.
pub struct Removed(pub std::path::PathBuf);

impl Drop for Removed {
    fn drop(&mut self) {
        if self.0.is_dir() {
            let _ = std::fs::remove_dir_all(&self.0);
        } else {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

/// A consumer that holds each message for a while before it acks it, and
/// keeps the bodies: what a publisher meets behind a slow consumer.
pub struct SlowConsumer {
    bodies: tokio::sync::watch::Receiver<Vec<Vec<u8>>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl SlowConsumer {
    /// Consumes `queue`, one message at a time, each held for `hold`.
    pub async fn start(amqp: &AmqpConfig, queue: &str, hold: Duration) -> anyhow::Result<Self> {
        let connection = connect(amqp, "idem test").await?;
        let channel = connection.create_channel().await?;
        channel.basic_qos(1, BasicQosOptions::default()).await?;
        let mut consumer = channel
            .basic_consume(
                queue.into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let (tell, bodies) = tokio::sync::watch::channel(Vec::new());
        let task = tokio::spawn(async move {
            let _connection = connection;
            while let Some(delivery) = consumer.next().await {
                let delivery = delivery?;
                tokio::time::sleep(hold).await;
                delivery.ack(BasicAckOptions::default()).await?;
                tell.send_modify(|bodies| bodies.push(delivery.data));
            }
            Ok(())
        });
        Ok(Self { bodies, task })
    }

    /// Waits until it has acked `count` messages; their bodies, sorted.
    pub async fn received(
        mut self,
        count: usize,
        timeout: Duration,
    ) -> anyhow::Result<Vec<Vec<u8>>> {
        let got = tokio::time::timeout(
            patient(timeout),
            self.bodies.wait_for(|bodies| bodies.len() >= count),
        )
        .await
        .map(|bodies| bodies.map(|bodies| bodies.clone()));
        self.task.abort();
        let mut bodies = match got {
            Ok(bodies) => bodies?,
            Err(_) => bail!(
                "the consumer got {} of {count} messages",
                self.bodies.borrow().len()
            ),
        };
        bodies.sort();
        Ok(bodies)
    }
}

/// A message read from the dead-letter queue.
#[derive(Debug)]
pub struct DeadLetter {
    pub body: Vec<u8>,
    pub properties: BasicProperties,
}

impl DeadLetter {
    pub fn death(&self) -> Option<idem::broker::death::Death> {
        idem::broker::death::Death::latest(self.properties.headers().as_ref())
    }
}
