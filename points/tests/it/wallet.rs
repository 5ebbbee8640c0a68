//! `examples/wallet`: a transfer given up tells the payer once, however
//! often it dies for the same reason, and again only after a replay; a
//! service's settings are given once, and every command agrees.

#[path = "../../../examples/wallet/wallet.rs"]
#[allow(dead_code)]
mod example;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::ensure;
use idem::broker::{AmqpConfig, Exchange, connect, declare_bound_queue, declare_exchanges};
use idem::probe::{Point, Probe, Verdict};
use idem::secret::SecretUrl;
use idem::store::migrate;
use idem::worker::{Mode, Worker};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::proxy::Proxy;
use crate::support::{
    RunningWorker, TestEnv, Vhost, amqp_address, example_binary, patient, peek, postgres_address,
    ready, wait_for,
};
use example::{EVENTS, Wallet};

/// Queues that take what the wallet says, by routing key.
const TOLD: [(&str, &str); 2] = [
    ("completed", "transfer.completed"),
    ("rejected", "transfer.rejected"),
];

fn transfer(id: &str, from: &str, to: &str, amount: i64) -> Vec<u8> {
    serde_json::json!({"eventId": id, "from": from, "to": to, "amount": amount})
        .to_string()
        .into_bytes()
}

/// Holds the worker at the moment the dead-letter index (and the
/// rejection) recorded the letter of `key`, before the letter reaches the
/// dead-letter queue, and says so once.
#[derive(Debug)]
struct HoldAtDeath {
    key: String,
    held: Notify,
    fired: AtomicBool,
}

impl Probe for HoldAtDeath {
    fn reached<'a>(
        &'a self,
        point: Point,
        events: &'a [&'a str],
    ) -> Pin<Box<dyn Future<Output = Verdict> + Send + 'a>> {
        Box::pin(async move {
            let ours = point == Point::DeadLettered && events.contains(&self.key.as_str());
            if ours && !self.fired.swap(true, Ordering::Relaxed) {
                self.held.notify_one();
                std::future::pending::<()>().await;
            }
            Verdict::Go
        })
    }
}

/// The distinct idempotency keys of the messages in `queue`.
async fn keys(amqp: &AmqpConfig, queue: &str) -> anyhow::Result<Vec<String>> {
    let mut keys: Vec<String> = peek(amqp, queue)
        .await?
        .iter()
        .filter_map(|message| {
            message
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string())
        })
        .collect();
    keys.sort();
    keys.dedup();
    Ok(keys)
}

/// Waits until the outbox is empty: what was written is published.
async fn until_relayed(env: &TestEnv) -> anyhow::Result<()> {
    wait_for(
        "the outbox to be relayed",
        patient(Duration::from_secs(30)),
        || async { Ok(env.count_rows("mq_outbox_message").await? == 0) },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transfer_given_up_tells_the_payer_once_and_again_only_after_a_replay()
-> anyhow::Result<()> {
    let vhost = Vhost::add(".*", ".*", ".*")?;
    let env = TestEnv::on_broker(vhost.amqp_url()).await?;
    migrate::run::<Wallet>(&env.pool, Some(&env.schema)).await?;
    env.sql("INSERT INTO account VALUES ('alice', 100), ('bob', 0)")
        .await?;
    let connection = connect(&env.amqp, "idem wallet test").await?;
    declare_exchanges(&connection, &[Exchange::topic(EVENTS)]).await?;
    let channel = connection.create_channel().await?;
    for (queue, key) in TOLD {
        declare_bound_queue(&channel, queue, EVENTS, key).await?;
    }
    connection.close(200, "OK".into()).await?;

    let mut config = env.worker_config(Mode::Batch);
    config.outgoing = vec![Exchange::topic(EVENTS)];
    let first = RunningWorker::start_with(config.clone(), Wallet);

    // t-1 is made; t-2 names an account that does not exist yet.
    env.publish_bodies(&[
        transfer("t-1", "alice", "bob", 10),
        transfer("t-2", "alice", "carol", 5),
    ])
    .await?;
    let dead_letters = env.topology.dead_letter_queue.clone();
    wait_for("t-2's letter", patient(Duration::from_secs(30)), || async {
        Ok(env.ready(&dead_letters).await? == 1)
    })
    .await?;
    until_relayed(&env).await?;
    assert_eq!(keys(&env.amqp, "completed").await?.len(), 1);
    let rejected = peek(&env.amqp, "rejected").await?;
    assert_eq!(rejected.len(), 1, "one rejection for t-2");
    let said: serde_json::Value = serde_json::from_slice(&rejected[0].body)?;
    assert_eq!(said["eventId"], "t-2");
    assert_eq!(said["reason"], "no such account");
    // Dead-lettered, t-2 is not failing: its ledger row stays for `dlq`.
    let target = idem::Target::new(
        env.amqp.clone(),
        env.database.clone(),
        env.topology.clone(),
        crate::support::GROUP,
        patient(Duration::from_secs(5)),
    );
    let status = idem::commands::status::run::<Wallet>(&target, &CancellationToken::new()).await?;
    assert_eq!(status.failing, (0, false), "{status}");
    assert_eq!(
        env.count("SELECT count(*) FROM mq_failure_ledger", &[])
            .await?,
        1
    );

    // Carol opens an account: the replay applies t-2, once, and rejects nothing.
    env.sql("INSERT INTO account VALUES ('carol', 0)").await?;
    let replay = idem::dlq::Action::Replay {
        rate: None,
        include_invalid: false,
    };
    let cancel = CancellationToken::new();
    let replayed = idem::dlq::run(&env.dlq_config(), &replay, &Wallet, &cancel).await?;
    assert_eq!(replayed.replayed.len(), 1);
    wait_for("t-2 made", patient(Duration::from_secs(30)), || async {
        Ok(env
            .count("SELECT count(*) FROM transfer WHERE event_id = 't-2'", &[])
            .await?
            == 1)
    })
    .await?;
    until_relayed(&env).await?;
    assert_eq!(keys(&env.amqp, "completed").await?.len(), 2);
    assert_eq!(
        ready(&env.amqp, "rejected").await?,
        1,
        "no second rejection of t-2"
    );

    // t-3 names a stranger. A worker that relays nothing, whose
    // connections pass through proxies, dies after the rejection is
    // written and before the letter is in the queue, as kill -9 would: the
    // next one dead-letters the redelivery, and writes no second rejection.
    first.stop().await?;
    let (broker, database) = (
        Proxy::start(amqp_address()).await?,
        Proxy::start(postgres_address()).await?,
    );
    let mut proxied = url::Url::parse(&vhost.amqp_url())?;
    let _ = proxied.set_port(Some(broker.port));
    let mut dying = env.worker_config_via(Mode::Batch, None, Some(database.port));
    dying.amqp = AmqpConfig::new(SecretUrl::new(proxied.to_string()));
    dying.outgoing = vec![Exchange::topic(EVENTS)];
    dying.relay = false;
    let probe = Arc::new(HoldAtDeath {
        key: "event t-3".into(),
        held: Notify::new(),
        fired: AtomicBool::new(false),
    });
    let shutdown = CancellationToken::new();
    let held = tokio::spawn(
        Worker::new(dying, Wallet)
            .probed(probe.clone())
            .run(shutdown.clone()),
    );
    env.publish_bodies(&[transfer("t-3", "alice", "dave", 1)])
        .await?;
    tokio::time::timeout(patient(Duration::from_secs(30)), probe.held.notified()).await?;
    broker.sever();
    database.sever();
    held.abort();
    shutdown.cancel();
    let second = RunningWorker::start_with(config, Wallet);
    wait_for("t-3's letter", patient(Duration::from_secs(30)), || async {
        Ok(env.ready(&dead_letters).await? >= 1)
    })
    .await?;
    until_relayed(&env).await?;
    second.stop().await?;
    // Only the second worker relayed, each row once.
    let rejections = peek(&env.amqp, "rejected").await?;
    let of_t3 = rejections
        .iter()
        .filter(|message| String::from_utf8_lossy(&message.body).contains("\"t-3\""))
        .count();
    assert_eq!(of_t3, 1, "one rejection of t-3");
    assert_eq!(
        env.count("SELECT count(*) FROM mq_given_up", &[]).await?,
        2,
        "t-2's first death and t-3's"
    );
    Ok(())
}

#[tokio::test]
async fn the_wallet_service_s_commands_agree_on_its_settings_without_a_flag() -> anyhow::Result<()>
{
    let wallet = example_binary("wallet")?;
    let vhost = Vhost::add(".*", ".*", ".*")?;
    let schema = crate::support::unique_name();
    let command = |args: &[&str]| {
        let mut command = tokio::process::Command::new(&wallet);
        command
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env(idem::vars::AMQP_URL, vhost.amqp_url())
            .env(idem::vars::DATABASE_URL, crate::support::database_url())
            .env(idem::vars::SCHEMA, &schema)
            .args(args)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        command
    };
    let outcome = async {
        let migrated = command(&["migrate"]).output().await?;
        ensure!(migrated.status.success(), "{migrated:?}");
        let worker = crate::support::WorkerProcess::start(command(&["worker"]))?;
        // The worker declared its wait queues, which status shows by the
        // service's delays, and its outgoing exchange.
        let amqp = AmqpConfig::new(SecretUrl::new(vhost.amqp_url()));
        wait_for(
            "the worker's queues",
            patient(Duration::from_secs(30)),
            || async { Ok(ready(&amqp, "wallet.transfers.retry.5s").await.is_ok()) },
        )
        .await?;
        let status = command(&["status"]).output().await?;
        let stdout = String::from_utf8_lossy(&status.stdout);
        ensure!(status.status.success(), "{status:?}");
        for queue in ["wallet.transfers.retry.1s", "wallet.transfers.retry.5s"] {
            ensure!(stdout.contains(queue), "no {queue} in:\n{stdout}");
        }
        ensure!(!stdout.contains("missing"), "{stdout}");
        let connection = connect(&amqp, "idem wallet test").await?;
        let channel = connection.create_channel().await?;
        declare_bound_queue(&channel, "told", EVENTS, "#").await?;
        connection.close(200, "OK".into()).await?;
        let version = command(&["--version"]).output().await?;
        ensure!(version.status.success(), "{version:?}");
        let version = String::from_utf8_lossy(&version.stdout);
        ensure!(
            version.trim() == concat!("wallet 0.1.0 (idem ", env!("CARGO_PKG_VERSION"), ")"),
            "{version}"
        );
        worker.stop().await.map(drop)?;

        // Under another name, it says that one.
        let renamed =
            std::env::temp_dir().join(format!("{}-wallet-service", crate::support::unique_name()));
        std::fs::copy(&wallet, &renamed)?;
        let _removed = crate::support::Removed(renamed.clone());
        let wrong = tokio::process::Command::new(&renamed)
            .args(["worker", "--bogus"])
            .output()
            .await?;
        let name = renamed
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default();
        assert_eq!(wrong.status.code(), Some(2));
        assert_eq!(
            String::from_utf8_lossy(&wrong.stderr).trim(),
            format!("{name}: unexpected argument '--bogus' found (see {name} worker --help)")
        );
        Ok(())
    }
    .await;
    crate::support::clean_up(crate::support::drop_schema(schema));
    outcome
}
