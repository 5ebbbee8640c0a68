//! Order per key: on an ordered queue each key's events apply in the order
//! they were sent, with several workers and several keys at once; a key
//! whose head fails is parked, its later events kept until the head
//! applies (a retry, a replay) or an operator releases the key; an event
//! without a usable key is invalid.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use idem::broker::Exchange;
use idem::commands::parked::{self, ParkedAction, ParkedReport};
use idem::dlq::{Action, DlqConfig};
use idem::relay::{RelayConfig, RelayCounters};
use idem::worker::ParkedBounds;
use idem::{Mode, Topology};
use tokio_util::sync::CancellationToken;

use crate::steps::{self, Steps};
use crate::support::{Env, Running, patient, wait_for, with_env};

const GROUP: &str = "steps";

/// `idem parked` on `target`.
async fn parked(target: &idem::Target, action: ParkedAction) -> anyhow::Result<ParkedReport> {
    Ok(parked::run::<Steps>(target, &action, &CancellationToken::new()).await?)
}

/// Each order's steps in the order they applied.
async fn applied_steps(env: &Env) -> anyhow::Result<Vec<(String, Vec<i32>)>> {
    let client = env.pool.get().await?;
    let rows = client
        .query(
            "SELECT order_id, array_agg(step ORDER BY applied) FROM order_steps \
             GROUP BY order_id ORDER BY order_id",
            &[],
        )
        .await?;
    Ok(rows.iter().map(|row| (row.get(0), row.get(1))).collect())
}

/// The steps applied of `order`, in the order they applied.
async fn steps_of(env: &Env, order: &str) -> anyhow::Result<Vec<i32>> {
    Ok(applied_steps(env)
        .await?
        .into_iter()
        .find(|(id, _)| id == order)
        .map(|(_, steps)| steps)
        .unwrap_or_default())
}

async fn parked_events(env: &Env) -> anyhow::Result<i64> {
    env.number("SELECT count(*) FROM mq_parked_event").await
}

/// Waits until no key is parked any more.
async fn no_key_parked(env: &Env) -> anyhow::Result<()> {
    wait_for("no key parked", Duration::from_secs(30), || async {
        Ok(env.number("SELECT count(*) FROM mq_parked_key").await? == 0)
    })
    .await
}

/// Whether only the owner of `file` may read or write it (mode 0600).
fn owner_only(file: &std::path::Path) -> std::io::Result<bool> {
    use std::os::unix::fs::PermissionsExt;
    Ok(std::fs::metadata(file)?.permissions().mode() & 0o777 == 0o600)
}

/// Replays the dead letters `dlq` selects; how many it replayed.
async fn replay(dlq: &DlqConfig) -> anyhow::Result<usize> {
    let replay = Action::Replay {
        rate: None,
        include_invalid: false,
    };
    let report = idem::dlq::run(dlq, &replay, &Steps::default(), &CancellationToken::new()).await?;
    Ok(report.replayed.len())
}

async fn a_key_s_events_apply_in_the_order_they_were_sent(mode: Mode) -> anyhow::Result<()> {
    with_env::<Steps, _, _>(steps::topology(8, &[]), move |env| async move {
        let (orders, steps) = (200, 5);
        env.publish_keyed(&steps::interleaved(orders, steps))
            .await?;
        let config = env.worker_config(mode, GROUP);
        let workers = [
            Running::start(config.clone(), Steps::default()),
            Running::start(config, Steps::default()),
        ];
        let total = (orders * steps as usize) as i64;
        wait_for("every step applied", Duration::from_secs(120), || async {
            let refused: u64 = workers
                .iter()
                .map(|w| w.stats.snapshot().dead_lettered)
                .sum();
            anyhow::ensure!(refused == 0, "{refused} steps refused as out of order");
            Ok(env.number("SELECT count(*) FROM order_steps").await? == total)
        })
        .await?;
        let mut dead = 0;
        for worker in workers {
            dead += worker.stop().await?.dead_lettered;
        }
        assert_eq!(dead, 0, "no step was refused as out of order");
        let applied = applied_steps(&env).await?;
        assert_eq!(applied.len(), orders);
        for (order, applied) in applied {
            assert_eq!(
                applied,
                (1..=steps).collect::<Vec<_>>(),
                "the steps of {order}"
            );
        }
        for slot in env.topology.slot_queues() {
            assert_eq!(env.ready(&slot).await?, 0);
        }
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_s_events_apply_in_the_order_they_were_sent_in_batch_mode() -> anyhow::Result<()> {
    a_key_s_events_apply_in_the_order_they_were_sent(Mode::Batch).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_s_events_apply_in_the_order_they_were_sent_one_message_a_transaction()
-> anyhow::Result<()> {
    a_key_s_events_apply_in_the_order_they_were_sent(Mode::PerMessage).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_workers_share_the_slots_and_each_does_its_part() -> anyhow::Result<()> {
    with_env::<Steps, _, _>(steps::topology(8, &[]), |env| async move {
        let config = env.worker_config(Mode::Batch, GROUP);
        let workers: Vec<Running> = (0..4)
            .map(|_| Running::start(config.clone(), Steps::default()))
            .collect();
        wait_for("two slots each", Duration::from_secs(30), || async {
            Ok(workers.iter().all(|w| w.stats.snapshot().slots == 2))
        })
        .await?;
        let (orders, steps) = (500, 4);
        env.publish_keyed(&steps::interleaved(orders, steps))
            .await?;
        let total = (orders * steps as usize) as i64;
        wait_for("every step applied", Duration::from_secs(120), || async {
            Ok(env.number("SELECT count(*) FROM order_steps").await? == total)
        })
        .await?;
        let mut applied = Vec::new();
        for worker in workers {
            let stats = worker.stop().await?;
            assert_eq!(stats.dead_lettered, 0, "{stats:?}");
            assert_eq!(
                (stats.sessions, stats.slots),
                (1, 0),
                "one session, left: {stats:?}"
            );
            applied.push(stats.applied);
        }
        assert!(
            applied.iter().all(|n| *n > 0),
            "each worker applied some: {applied:?}"
        );
        assert_eq!(applied.iter().sum::<u64>(), total as u64);
        for (order, applied) in applied_steps(&env).await? {
            assert_eq!(
                applied,
                (1..=steps).collect::<Vec<_>>(),
                "the steps of {order}"
            );
        }
        assert_eq!(
            env.number("SELECT count(*) FROM mq_slot_member").await?,
            0,
            "each left"
        );
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_head_parks_its_key_until_a_replay_or_a_release() -> anyhow::Result<()> {
    with_env::<Steps, _, _>(steps::topology(4, &[]), |env| async move {
        let handler = Steps::default();
        // Each blocked order's first step applies; its second fails for
        // good, and its third and fourth are parked behind it.
        let mut messages = Vec::new();
        for n in 1..=4 {
            for order in ["poisoned", "dropped", "healthy-1", "healthy-2"] {
                messages.push(steps::step(order, n));
            }
        }
        env.publish_keyed(&messages[..4]).await?;
        let worker = Running::start(env.worker_config(Mode::Batch, GROUP), handler.clone());
        wait_for("the first steps", Duration::from_secs(30), || async {
            Ok(env.number("SELECT count(*) FROM order_steps").await? == 4)
        })
        .await?;
        handler.block(&["poisoned", "dropped"]);
        env.publish_keyed(&messages[4..]).await?;
        wait_for(
            "the healthy orders done, the blocked ones parked",
            Duration::from_secs(30),
            || async {
                Ok(steps_of(&env, "healthy-1").await? == [1, 2, 3, 4]
                    && steps_of(&env, "healthy-2").await? == [1, 2, 3, 4]
                    && parked_events(&env).await? == 4
                    && env.ready(&env.topology.dead_letter_queue).await? == 2)
            },
        )
        .await?;
        assert_eq!(steps_of(&env, "poisoned").await?, [1]);
        assert_eq!(steps_of(&env, "dropped").await?, [1]);
        assert_eq!(
            env.number("SELECT count(*) FROM mq_parked_key WHERE head_dead")
                .await?,
            2
        );

        // The cause fixed, a replay applies the head, then what it held.
        handler.unblock("poisoned");
        let mut dlq = DlqConfig::new(env.worker_config(Mode::Batch, GROUP).target());
        dlq.filter.event_id = Some(steps::step_id("poisoned", 2));
        assert_eq!(replay(&dlq).await?, 1, "one letter replayed");
        wait_for(
            "the poisoned order's steps in order",
            Duration::from_secs(30),
            || async { Ok(steps_of(&env, "poisoned").await? == [1, 2, 3, 4]) },
        )
        .await?;

        // A head discarded, its key released: the order goes on without it.
        handler.unblock("dropped");
        let file = std::env::temp_dir().join(format!("{}-discarded.jsonl", env.schema));
        dlq.filter.event_id = Some(steps::step_id("dropped", 2));
        let discard = Action::Discard { file: file.clone() };
        let report =
            idem::dlq::run(&dlq, &discard, &Steps::default(), &CancellationToken::new()).await?;
        let mode = owner_only(&file);
        std::fs::remove_file(&file)?;
        assert!(mode?, "a discard's file is its owner's alone");
        assert_eq!(report.discarded.len(), 1, "{report:?}");
        let target = env.worker_config(Mode::Batch, GROUP).target();
        let listed = parked(
            &target,
            ParkedAction::List {
                key: None,
                limit: 10,
            },
        )
        .await?;
        let ParkedReport::Listed(keys) = listed else {
            anyhow::bail!("not a listing: {listed:?}");
        };
        let keys: Vec<_> = keys
            .iter()
            .map(|k| (k.key.as_str(), k.head_dead, k.events))
            .collect();
        assert_eq!(keys, [("dropped", true, 2)]);
        let release = |dry_run| ParkedAction::Release {
            key: "dropped".to_owned(),
            dry_run,
        };
        let dry = parked(&target, release(true)).await?;
        assert!(
            matches!(dry, ParkedReport::Released { dry_run: true, .. }),
            "{dry:?}"
        );
        assert_eq!(
            env.number("SELECT count(*) FROM mq_parked_key WHERE head_dead")
                .await?,
            1
        );
        let released = parked(&target, release(false)).await?;
        assert!(released.done(), "{released}");
        wait_for(
            "the dropped order's later steps",
            Duration::from_secs(30),
            || async { Ok(steps_of(&env, "dropped").await? == [1, 3, 4]) },
        )
        .await?;
        no_key_parked(&env).await?;
        let stats = worker.stop().await?;
        // The four later steps, and the replayed head, which went before them.
        assert_eq!(stats.parked, 5, "{stats:?}");
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_discarded_keeps_its_events_in_a_file_and_its_next_event_applies()
-> anyhow::Result<()> {
    with_env::<Steps, _, _>(steps::topology(2, &[]), |env| async move {
        let handler = Steps::default();
        env.publish_keyed(&[steps::step("gone", 1)]).await?;
        let worker = Running::start(env.worker_config(Mode::Batch, GROUP), handler.clone());
        worker.settled(1, Duration::from_secs(30)).await?;
        handler.block(&["gone"]);
        env.publish_keyed(&[2, 3, 4].map(|n| steps::step("gone", n)))
            .await?;
        wait_for("two steps parked", Duration::from_secs(30), || async {
            Ok(parked_events(&env).await? == 2)
        })
        .await?;
        let target = env.worker_config(Mode::Batch, GROUP).target();
        let file = std::env::temp_dir().join(format!("{}-parked.jsonl", env.schema));
        let discard = |dry_run| ParkedAction::Discard {
            key: "gone".to_owned(),
            file: file.clone(),
            dry_run,
        };
        let dry = parked(&target, discard(true)).await?;
        assert!(
            matches!(
                dry,
                ParkedReport::Discarded {
                    events: 2,
                    dry_run: true,
                    ..
                }
            ),
            "{dry:?}"
        );
        assert!(!file.exists(), "a dry run writes nothing");
        assert_eq!(parked_events(&env).await?, 2);
        let done = parked(&target, discard(false)).await?;
        let kept = std::fs::read_to_string(&file)?;
        let mode = owner_only(&file);
        std::fs::remove_file(&file)?;
        assert!(mode?, "a discard's file is its owner's alone");
        assert!(
            matches!(
                done,
                ParkedReport::Discarded {
                    events: 2,
                    dry_run: false,
                    ..
                }
            ),
            "{done:?}"
        );
        let ids: Vec<String> = kept
            .lines()
            .map(
                |line| Ok(serde_json::from_str::<serde_json::Value>(line)?["event_id"].to_string()),
            )
            .collect::<anyhow::Result<_>>()?;
        assert_eq!(
            ids,
            [3, 4].map(|n| format!("\"{}\"", steps::step_id("gone", n)))
        );
        assert_eq!(env.number("SELECT count(*) FROM mq_parked_key").await?, 0);
        let again = parked(&target, discard(false)).await?;
        assert!(matches!(again, ParkedReport::NotParked(_)), "{again:?}");
        // The key is no longer parked: its next step applies.
        handler.unblock("gone");
        env.publish_keyed(&[steps::step("gone", 5)]).await?;
        wait_for("the next step", Duration::from_secs(30), || async {
            Ok(steps_of(&env, "gone").await? == [1, 5])
        })
        .await?;
        worker.stop().await?;
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_that_fails_twice_then_applies_on_a_delayed_retry_is_not_overtaken()
-> anyhow::Result<()> {
    let delays = [Duration::from_millis(300), Duration::from_millis(600)];
    with_env::<Steps, _, _>(steps::topology(2, &delays), |env| async move {
        let handler = Steps::default();
        handler.heal_after("slow", 2);
        let messages: Vec<_> = (1..=5)
            .flat_map(|n| [steps::step("slow", n), steps::step("quick", n)])
            .collect();
        env.publish_keyed(&messages).await?;
        let worker = Running::start(env.worker_config(Mode::PerMessage, GROUP), handler);
        wait_for("both orders' steps", Duration::from_secs(30), || async {
            Ok(env.number("SELECT count(*) FROM order_steps").await? == 10
                && env.number("SELECT count(*) FROM mq_parked_key").await? == 0)
        })
        .await?;
        let stats = worker.stop().await?;
        assert_eq!(steps_of(&env, "slow").await?, [1, 2, 3, 4, 5]);
        assert_eq!(steps_of(&env, "quick").await?, [1, 2, 3, 4, 5]);
        assert_eq!((stats.retried, stats.dead_lettered), (2, 0), "{stats:?}");
        assert!(
            stats.parked >= 1,
            "the slow order's later steps waited: {stats:?}"
        );
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_without_a_usable_ordering_key_is_invalid() -> anyhow::Result<()> {
    with_env::<Steps, _, _>(steps::topology(2, &[]), |env| async move {
        let (body, _) = steps::step("o1", 1);
        let keyed = |event_id: &str, order: &str| {
            serde_json::json!({"eventId": event_id, "order": order, "step": 1})
                .to_string()
                .into_bytes()
        };
        let long = "k".repeat(129);
        let control = "o\u{7}2".to_owned();
        env.publish_keyed(&[
            // Routed by another key than the body's.
            (body.clone(), Some("o2".to_owned())),
            (keyed("long-key", &long), Some(long.clone())),
            (keyed("control-key", &control), Some(control.clone())),
            (body, Some("o1".to_owned())),
        ])
        .await?;
        let worker = Running::start(env.worker_config(Mode::Batch, GROUP), Steps::default());
        worker.settled(4, Duration::from_secs(30)).await?;
        let stats = worker.stop().await?;
        assert_eq!((stats.invalid, stats.applied), (3, 1), "{stats:?}");
        assert_eq!(env.ready(&env.topology.dead_letter_queue).await?, 3);
        assert_eq!(steps_of(&env, "o1").await?, [1]);
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_published_without_the_header_is_dead_lettered_as_invalid() -> anyhow::Result<()> {
    with_env::<Steps, _, _>(steps::topology(2, &[]), |env| async move {
        // The exchange routes it to a slot all the same (it hashes nothing).
        let (body, _) = steps::step("o1", 1);
        env.publish_keyed(&[(body, None)]).await?;
        let worker = Running::start(env.worker_config(Mode::Batch, GROUP), Steps::default());
        worker.settled(1, Duration::from_secs(30)).await?;
        let stats = worker.stop().await?;
        assert_eq!((stats.invalid, stats.applied), (1, 0), "{stats:?}");
        assert_eq!(env.ready(&env.topology.dead_letter_queue).await?, 1);
        Ok(())
    })
    .await
}

#[test]
fn an_ordered_topology_names_its_slots_and_its_hash_exchange() {
    let topology = Topology::for_queue("steps.applied").ordered(3);
    assert_eq!(
        topology.slot_queues(),
        [
            "steps.applied.slot.0",
            "steps.applied.slot.1",
            "steps.applied.slot.2"
        ]
    );
    assert_eq!(topology.slots_exchange(), "steps.applied.slots");
    assert_eq!(topology.consumed_queues(), topology.slot_queues());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_out_of_attempts_on_its_retry_is_dead_lettered_and_a_replay_keeps_the_order()
-> anyhow::Result<()> {
    // Two attempts: the first fails in the slot, the second, from the
    // parked keys once it is due, fails too and dead-letters the head.
    let mut topology = steps::topology(2, &[Duration::from_millis(200)]);
    topology.retry = topology.retry.with_attempts(2);
    with_env::<Steps, _, _>(topology, |env| async move {
        let handler = Steps::default();
        handler.stall("late");
        let messages: Vec<_> = (1..=3)
            .flat_map(|n| [steps::step("late", n), steps::step("other", n)])
            .collect();
        env.publish_keyed(&messages).await?;
        let worker = Running::start(env.worker_config(Mode::Batch, GROUP), handler.clone());
        wait_for(
            "the other order done, the late head dead-lettered from its parked key",
            Duration::from_secs(30),
            || async {
                Ok(steps_of(&env, "other").await? == [1, 2, 3]
                    && env.ready(&env.topology.dead_letter_queue).await? == 1
                    && env
                        .number("SELECT count(*) FROM mq_parked_key WHERE head_dead")
                        .await?
                        == 1)
            },
        )
        .await?;
        assert_eq!(steps_of(&env, "late").await?, Vec::<i32>::new());
        assert_eq!(
            parked_events(&env).await?,
            2,
            "the late order's steps 2 and 3"
        );
        let indexed = env
            .number(&format!(
                "SELECT count(*) FROM mq_dead_letter WHERE event_id = '{}' \
                 AND failures = 2 AND last_error LIKE '%not ready yet%'",
                steps::step_id("late", 1)
            ))
            .await?;
        assert_eq!(indexed, 1, "the index holds the head with its failures");
        let dlq = DlqConfig::new(env.worker_config(Mode::Batch, GROUP).target());
        let summary = idem::dlq::summary::<Steps>(&dlq, &CancellationToken::new()).await?;
        let parked = summary.parked.expect("the summary counts the parked keys");
        assert_eq!((parked.keys, parked.events, parked.dead_heads), (1, 2, 1));
        assert!(
            summary
                .to_string()
                .contains("parked keys: 1 key(s) holding 2 event(s), 1 of them behind a letter"),
            "{summary}"
        );

        // Fixed and replayed, the letter goes back to its key's slot (its
        // ordering key kept through the parked copy) and applies before
        // the rest.
        handler.fix("late");
        assert_eq!(replay(&dlq).await?, 1, "one letter replayed");
        wait_for(
            "the late order's steps in order",
            Duration::from_secs(30),
            || async { Ok(steps_of(&env, "late").await? == [1, 2, 3]) },
        )
        .await?;
        no_key_parked(&env).await?;
        let stats = worker.stop().await?;
        assert_eq!(stats.dead_lettered, 1, "{stats:?}");
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_bound_of_events_per_key_the_next_events_wait_unacked_in_their_order()
-> anyhow::Result<()> {
    // The head keeps waiting for its next attempt through the test.
    let mut topology = steps::topology(2, &[Duration::from_secs(2)]);
    topology.retry = topology.retry.with_attempts(15);
    with_env::<Steps, _, _>(topology, |env| async move {
        let handler = Steps::default();
        handler.stall("full");
        let messages: Vec<_> = (1..=6)
            .flat_map(|n| [steps::step("full", n), steps::step("other", n)])
            .collect();
        env.publish_keyed(&messages).await?;
        let mut config = env.worker_config(Mode::Batch, GROUP);
        config.parked_bounds = ParkedBounds {
            events_per_key: 3,
            keys: 10,
        };
        let worker = Running::start(config, handler.clone());
        wait_for(
            "the other order done, the full one holding three events and waiting",
            Duration::from_secs(30),
            || async {
                Ok(steps_of(&env, "other").await? == [1, 2, 3, 4, 5, 6]
                    && parked_events(&env).await? == 3
                    && worker.stats.snapshot().parked_bound_waits >= 2)
            },
        )
        .await?;
        // The head waits for its next attempt with steps 2 and 3 behind
        // it; 4 to 6 wait in the worker, unacked: nothing more is parked.
        assert_eq!(parked_events(&env).await?, 3);
        assert_eq!(steps_of(&env, "full").await?, Vec::<i32>::new());
        handler.fix("full");
        wait_for(
            "the full order in order",
            Duration::from_secs(30),
            || async { Ok(steps_of(&env, "full").await? == [1, 2, 3, 4, 5, 6]) },
        )
        .await?;
        no_key_parked(&env).await?;
        let stats = worker.stop().await?;
        assert_eq!(stats.dead_lettered, 0, "{stats:?}");
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_bound_of_keys_a_failed_head_waits_unacked_and_its_key_keeps_its_order()
-> anyhow::Result<()> {
    let mut topology = steps::topology(1, &[Duration::from_secs(2)]);
    topology.retry = topology.retry.with_attempts(15);
    with_env::<Steps, _, _>(topology, |env| async move {
        let handler = Steps::default();
        handler.stall("first");
        handler.stall("second");
        let mut config = env.worker_config(Mode::PerMessage, GROUP);
        config.parked_bounds = ParkedBounds {
            events_per_key: 100,
            keys: 1,
        };
        let worker = Running::start(config, handler.clone());
        env.publish_keyed(&[steps::step("first", 1), steps::step("first", 2)])
            .await?;
        wait_for(
            "the first order parked",
            Duration::from_secs(30),
            || async {
                Ok(env.number("SELECT count(*) FROM mq_parked_key").await? == 1
                    && parked_events(&env).await? == 2)
            },
        )
        .await?;
        env.publish_keyed(&[steps::step("second", 1), steps::step("second", 2)])
            .await?;
        wait_for(
            "the second order's head waiting in the worker",
            Duration::from_secs(30),
            || async { Ok(worker.stats.snapshot().parked_bound_waits >= 2) },
        )
        .await?;
        assert_eq!(
            env.number("SELECT count(*) FROM mq_parked_key").await?,
            1,
            "one key parked, as the bound allows"
        );
        wait_for("the gauges to say so", Duration::from_secs(30), || async {
            let metrics = worker.stats.encode();
            let gauge = |name: &str| {
                metrics
                    .lines()
                    .find(|line| line.starts_with(&format!("{name}{{")))
                    .and_then(|line| line.rsplit(' ').next())
                    .map(str::to_owned)
            };
            Ok(gauge("idem_parked_keys").as_deref() == Some("1")
                && gauge("idem_parked_events").as_deref() == Some("2"))
        })
        .await?;
        handler.fix("second");
        handler.fix("first");
        wait_for("both orders in order", Duration::from_secs(30), || async {
            Ok(steps_of(&env, "first").await? == [1, 2]
                && steps_of(&env, "second").await? == [1, 2])
        })
        .await?;
        let stats = worker.stop().await?;
        assert_eq!(stats.dead_lettered, 0, "{stats:?}");
        Ok(())
    })
    .await
}

/// Every message of `queue`, in the order it holds them, taken off it.
async fn drain_queue(env: &Env, queue: &str) -> anyhow::Result<Vec<Vec<u8>>> {
    let channel = env.connection.create_channel().await?;
    let mut bodies = Vec::new();
    while let Some(message) = channel
        .basic_get(
            queue.into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await?
    {
        bodies.push(message.delivery.data);
    }
    channel.close(200, "OK".into()).await?;
    Ok(bodies)
}

/// The steps each order's messages announce, in the order they arrived.
fn announced_steps(bodies: &[Vec<u8>]) -> anyhow::Result<BTreeMap<String, Vec<i64>>> {
    let mut steps: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for body in bodies {
        let message: serde_json::Value = serde_json::from_slice(body)?;
        let order = message["order"].as_str().context("an order")?;
        let step = message["step"].as_i64().context("a step")?;
        steps.entry(order.to_owned()).or_default().push(step);
    }
    Ok(steps)
}

/// `orders` orders of `steps` steps each, published an order's steps one
/// after another (its messages land in transactions close together, which
/// relays taking rows at once would send out of order) and applied by a
/// worker that relays nothing, announcing each step to `exchange`.
async fn applied_unsent(
    env: &Env,
    exchange: &str,
    orders: usize,
    steps: i32,
) -> anyhow::Result<()> {
    let events: Vec<_> = (0..orders)
        .flat_map(|order| (1..=steps).map(move |n| steps::step(&format!("o{order}"), n)))
        .collect();
    env.publish_keyed(&events).await?;
    let mut config = env.worker_config(Mode::Batch, GROUP);
    config.relay = false;
    config.batch_size = 16;
    let handler = steps::Announcing {
        steps: Steps::default(),
        exchange: exchange.to_owned(),
    };
    let worker = Running::start(config, handler);
    worker
        .settled(events.len() as u64, Duration::from_secs(120))
        .await?;
    worker.stop().await?;
    Ok(())
}

/// Runs `relays` relays of two lanes each at once, each on a pool of its
/// own, until nothing is due; what they sent and had refused.
async fn relay_until_empty(env: &Env, exchange: &str, relays: usize) -> anyhow::Result<(u64, u64)> {
    let mut relay = RelayConfig::new(env.amqp.clone(), patient(Duration::from_secs(10)));
    relay.outgoing = vec![Exchange::topic(exchange)];
    relay.batch_size = 4;
    relay.lanes = 2;
    relay.until_empty = true;
    let relays = (0..relays).map(|_| {
        let mut database = env.database.clone();
        database.pool_size = relay.connections();
        let relay = relay.clone();
        tokio::spawn(async move {
            let pool = database.pool()?;
            let counters = RelayCounters::default();
            let report =
                idem::relay::run(&pool, &relay, &counters, &CancellationToken::new()).await?;
            anyhow::Ok(report)
        })
    });
    let (mut sent, mut refused) = (0, 0);
    for relay in futures::future::join_all(relays).await {
        let report = relay??;
        sent += report.sent;
        refused += report.refused;
    }
    Ok((sent, refused))
}

/// Asserts that `queue` holds the messages of `orders` orders, each
/// order's steps 1 to `steps` once, in order.
async fn announced_in_order(
    env: &Env,
    queue: &str,
    orders: usize,
    steps: i32,
) -> anyhow::Result<()> {
    let announced = announced_steps(&drain_queue(env, queue).await?)?;
    assert_eq!(announced.len(), orders);
    for (order, announced) in announced {
        assert_eq!(
            announced,
            (1..=i64::from(steps)).collect::<Vec<_>>(),
            "the messages of {order}"
        );
    }
    Ok(())
}

/// The messages a key's events send leave in the order the events applied,
/// with six relays of two lanes each at work on the outbox at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_s_outgoing_messages_leave_in_order_with_several_relays() -> anyhow::Result<()> {
    with_env::<Steps, _, _>(steps::topology(4, &[]), |env| async move {
        let (exchange, queue) = env.announced();
        env.declare_announced().await?;
        let (orders, steps) = (100, 6);
        applied_unsent(&env, &exchange, orders, steps).await?;
        let (sent, refused) = relay_until_empty(&env, &exchange, 6).await?;
        assert_eq!((sent, refused), ((orders * steps as usize) as u64, 0));
        announced_in_order(&env, &queue, orders, steps).await
    })
    .await
}

/// A message the broker refuses waits for its next attempt, and its key's
/// later messages wait behind it, though the broker takes them by then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_message_holds_its_key_s_later_messages_back() -> anyhow::Result<()> {
    with_env::<Steps, _, _>(steps::topology(4, &[]), |env| async move {
        let (exchange, queue) = env.announced();
        env.declare_announced().await?;
        let (orders, steps) = (20, 4);
        applied_unsent(&env, &exchange, orders, steps).await?;
        // Nothing routes: every message is refused or held back.
        env.bind_announced(false).await?;
        let (sent, refused) = relay_until_empty(&env, &exchange, 1).await?;
        assert_eq!(sent, 0);
        assert!(refused > 0);
        let held = "SELECT count(*) FROM mq_outbox WHERE attempts = 0";
        assert!(env.number(held).await? > 0, "later messages held back");
        // Routed again: the held messages are due, but not before their
        // keys' refused ones.
        env.bind_announced(true).await?;
        let (sent, _) = relay_until_empty(&env, &exchange, 1).await?;
        assert_eq!(sent, 0, "nothing sent ahead of a refused message");
        wait_for(
            "the refused messages due",
            Duration::from_secs(30),
            || async {
                Ok(env
                    .number("SELECT count(*) FROM mq_outbox WHERE next_attempt_at > now()")
                    .await?
                    == 0)
            },
        )
        .await?;
        let (sent, refused) = relay_until_empty(&env, &exchange, 2).await?;
        assert_eq!((sent, refused), ((orders * steps as usize) as u64, 0));
        announced_in_order(&env, &queue, orders, steps).await
    })
    .await
}

/// A head dead-lettered from its parked key (out of attempts on a retry)
/// sends what the handler's `given_up` says, once, as one dead-lettered
/// from its slot does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_dead_lettered_from_its_parked_key_sends_its_given_up_message() -> anyhow::Result<()>
{
    let mut topology = steps::topology(2, &[Duration::from_millis(200)]);
    topology.retry = topology.retry.with_attempts(2);
    with_env::<Steps, _, _>(topology, |env| async move {
        let (exchange, queue) = env.announced();
        env.declare_announced().await?;
        let handler = steps::Announcing {
            steps: Steps::default(),
            exchange: exchange.clone(),
        };
        handler.steps.stall("late");
        let messages: Vec<_> = (1..=2)
            .flat_map(|n| [steps::step("late", n), steps::step("other", n)])
            .collect();
        env.publish_keyed(&messages).await?;
        let mut config = env.worker_config(Mode::Batch, GROUP);
        config.outgoing = vec![Exchange::topic(&exchange)];
        let worker = Running::start(config, handler);
        wait_for(
            "the late head dead-lettered from its parked key",
            Duration::from_secs(30),
            || async {
                Ok(env
                    .number("SELECT count(*) FROM mq_parked_key WHERE head_dead")
                    .await?
                    == 1)
            },
        )
        .await?;
        wait_for("every message sent", Duration::from_secs(30), || async {
            Ok(env
                .number("SELECT count(*) FROM mq_outbox_message WHERE sent_at IS NULL")
                .await?
                == 0)
        })
        .await?;
        let stats = worker.stop().await?;
        assert_eq!(stats.dead_lettered, 1, "{stats:?}");
        let mut bodies: Vec<String> = drain_queue(&env, &queue)
            .await?
            .into_iter()
            .map(String::from_utf8)
            .collect::<Result<_, _>>()?;
        bodies.sort();
        assert_eq!(
            bodies,
            [
                r#"{"givenUp":1,"order":"late"}"#,
                r#"{"order":"other","step":1}"#,
                r#"{"order":"other","step":2}"#,
            ]
        );
        Ok(())
    })
    .await
}

/// `check` on a handler that names keys adds runs on an ordered queue
/// (workers sharing the slots, one killed, heads failed then replayed),
/// and a worker that keeps each key's order passes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_of_an_ordered_handler_runs_ordered_runs_and_passes() -> anyhow::Result<()> {
    let events: Vec<Vec<u8>> = steps::interleaved(40, 4)
        .into_iter()
        .map(|(body, _)| body)
        .collect();
    let database = idem::DatabaseConfig::new(idem::SecretUrl::new(crate::support::database_url()));
    let amqp = idem::AmqpConfig::new(idem::SecretUrl::new(crate::support::amqp_url()));
    let mut config = idem::check::CheckConfig::new(amqp, database, GROUP, events);
    config.patience = patient(idem::check::CheckConfig::DEFAULT_PATIENCE);
    let report = idem::check::run(&config, Steps::default).await?;
    assert!(report.passed(), "{report}");
    assert!(report.order_matters, "{report}");
    assert!(report.order_within_keys_only, "{report}");
    let ordered: Vec<_> = report
        .runs
        .iter()
        .filter(|run| run.name.starts_with("ordered"))
        .collect();
    assert_eq!(ordered.len(), 6, "{report}");
    for run in ordered {
        assert_eq!((run.applied, run.dead_lettered), (160, 0), "{report}");
        assert_eq!(
            run.diverged,
            Some(0),
            "compared with the reference: {report}"
        );
    }
    Ok(())
}

/// Transactions the worker ran so far (its batch-size histogram's count).
fn transactions(worker: &Running) -> anyhow::Result<u64> {
    let metrics = worker.stats.encode();
    let line = metrics
        .lines()
        .find(|line| line.starts_with("idem_batch_size_count"))
        .context("a batch size count")?;
    Ok(line.rsplit(' ').next().context("a count")?.parse()?)
}

/// A tally (the same in any order) that sends nothing commits a batch
/// holding several events of a key at once instead of a round each; a
/// key whose events fail is still parked, none of them applied, while
/// every other key's apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tally_commits_a_key_s_events_together_and_still_parks_a_failing_key()
-> anyhow::Result<()> {
    with_env::<steps::Totals, _, _>(steps::topology(1, &[Duration::from_secs(60)]), |env| async move {
        let (orders, steps) = (20, 5);
        // Each order's steps one after another: by rounds, the batch that
        // holds an order's five takes five transactions.
        let events: Vec<_> = (0..orders)
            .flat_map(|order| (1..=steps).map(move |n| steps::step(&format!("o{order}"), n)))
            .collect();
        env.publish_keyed(&events).await?;
        let worker = Running::start(env.worker_config(Mode::Batch, GROUP), steps::Totals);
        worker.settled(events.len() as u64, Duration::from_secs(60)).await?;
        let merged = transactions(&worker)?;
        assert!(merged < 5, "{merged} transactions for {} events", events.len());
        let poisoned: Vec<_> = (1..=3)
            .flat_map(|n| [steps::step("poisoned", n), steps::step("later", n)])
            .collect();
        env.publish_keyed(&poisoned).await?;
        wait_for("the poisoned order parked, the later one applied", Duration::from_secs(30), || async {
            Ok(env.number("SELECT count(*) FROM mq_parked_event").await? == 3
                && env.number("SELECT coalesce(sum(steps), 0)::bigint FROM order_total WHERE order_id = 'later'").await? == 6)
        })
        .await?;
        let stats = worker.stop().await?;
        assert_eq!(stats.dead_lettered, 0, "{stats:?}");
        assert_eq!(
            env.number("SELECT count(*) FROM order_total WHERE order_id = 'poisoned'").await?,
            0
        );
        let total = env
            .number("SELECT sum(steps)::bigint FROM order_total WHERE order_id <> 'later'")
            .await?;
        assert_eq!(total, orders as i64 * 15, "every order's steps, once");
        Ok(())
    })
    .await
}
