//! Dead-letter triage with `idem dlq`, as an operator runs it: a summary,
//! filtered listings that say what a replay would do, a paced replay that
//! leaves invalid bodies alone, a discard that writes before it removes.
//!
//! Over 700 lines: one scenario per test, every dead-letter command's in one
//! place.

use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicGetOptions, BasicQosOptions, BasicRejectOptions};
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;

use idem::broker::Outgoing;
use idem::dlq::{self, Action, DlqConfig, Filter, Report};
use idem::worker::Mode;
use idem_points::points::{PaymentSucceeded, Points};

use crate::support::{
    GROUP, Removed, RunningWorker, SlowConsumer, TestEnv, patient, publish_messages, rabbitmqctl,
    run_idem, unique_name, wait_for,
};

/// What the dead-letter queue holds, in the order it got them.
struct Letters {
    invalid: Vec<Vec<u8>>,
    poisoned: Vec<PaymentSucceeded>,
    applied: PaymentSucceeded,
    over_the_limit: PaymentSucceeded,
}

impl Letters {
    fn count(&self) -> usize {
        self.invalid.len() + self.poisoned.len() + 2
    }
}

/// Fills `env`'s dead-letter queue with one of each kind: bodies that are
/// not events (one with a NUL in its event id, one with a terminal escape),
/// events that failed their attempts, an event applied already, and one the
/// broker's delivery limit dead-lettered.
async fn dead_letters_of_every_kind(env: &TestEnv) -> anyhow::Result<Letters> {
    let invalid = vec![
        br#"{"eventId": "nul\u0000id", "orderId": "o", "points": 1}"#.to_vec(),
        b"\x1b[2J\x1b[31mnot json".to_vec(),
        br#"{"eventId": "e", "orderId": "o", "points": -1}"#.to_vec(),
    ];
    env.poison_order("poison-order").await?;
    let poisoned: Vec<PaymentSucceeded> = (0..2)
        .map(|i| PaymentSucceeded {
            event_id: format!("{}-poisoned-{i}", env.name),
            order_id: "poison-order".into(),
            points: 1,
        })
        .collect();
    let applied = PaymentSucceeded {
        event_id: format!("{}-applied", env.name),
        order_id: "fine-order".into(),
        points: 3,
    };
    let mut bodies = invalid.clone();
    bodies.extend(poisoned.iter().map(PaymentSucceeded::to_body));
    bodies.push(applied.to_body());
    env.publish_bodies(&bodies).await?;
    let mut config = env.worker_config(Mode::Batch);
    config.topology.retry = config.topology.retry.clone().with_attempts(2);
    let worker = RunningWorker::start(config);
    wait_for("the dead letters", Duration::from_secs(30), || async {
        Ok(env.ready(&env.topology.dead_letter_queue).await? == 5)
    })
    .await?;
    worker.stop().await?;

    // A copy of the applied event that a consumer rejected, and one that
    // went round more often than the queue's delivery limit.
    let over_the_limit = PaymentSucceeded {
        event_id: format!("{}-over-the-limit", env.name),
        order_id: "fine-order".into(),
        points: 4,
    };
    env.publish_events(std::slice::from_ref(&applied)).await?;
    reject(env, &env.topology.queue, 1, false).await?;
    env.publish_events(std::slice::from_ref(&over_the_limit))
        .await?;
    // A quorum queue delivers it the limit and once more, then dead-letters it.
    reject(
        env,
        &env.topology.queue,
        env.topology.delivery_limit + 1,
        true,
    )
    .await?;
    wait_for(
        "all seven dead letters",
        Duration::from_secs(30),
        || async { Ok(env.ready(&env.topology.dead_letter_queue).await? == 7) },
    )
    .await?;
    Ok(Letters {
        invalid,
        poisoned,
        applied,
        over_the_limit,
    })
}

/// Takes `queue`'s next `times` deliveries and rejects each.
async fn reject(env: &TestEnv, queue: &str, times: u32, requeue: bool) -> anyhow::Result<()> {
    let connection = env.connect().await?;
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
    for _ in 0..times {
        let delivery = tokio::time::timeout(patient(Duration::from_secs(10)), consumer.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("the consumer ended"))??;
        delivery.reject(BasicRejectOptions { requeue }).await?;
    }
    connection.close(200, "OK".into()).await?;
    Ok(())
}

/// `idem` with `args`, on `env`; its exit code and standard output.
async fn idem(env: &TestEnv, args: &[&str]) -> anyhow::Result<(Option<i32>, String)> {
    let ran = run_idem(env, args).await?;
    Ok((ran.code, ran.stdout))
}

fn config(env: &TestEnv, filter: Filter) -> DlqConfig {
    let mut config = DlqConfig::new(env.target());
    config.filter = filter;
    config
}

async fn run(env: &TestEnv, filter: Filter, action: Action) -> anyhow::Result<Report> {
    Ok(dlq::run(
        &config(env, filter),
        &action,
        &Points,
        &CancellationToken::new(),
    )
    .await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_summary_counts_dead_letters_per_reason_and_last_error() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let letters = dead_letters_of_every_kind(&env).await?;
    // Two letters came without idem's worker: the index lacks them, and
    // the summary says so.
    let (code, stdout) = idem(&env, &["dlq", "summary"]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.contains(&format!(
            "5 of 5 dead-lettered message(s) in {} match (by the index; the queue holds 7 \
             ready, some the index does not know of: `idem dlq sync` adds them",
            env.topology.dead_letter_queue
        )),
        "{stdout}"
    );
    let (code, stdout) = idem(&env, &["dlq", "sync"]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    let (code, stdout) = idem(&env, &["dlq", "summary"]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.contains("7 of 7 dead-lettered message(s)"),
        "{stdout}"
    );
    assert!(!stdout.contains("dlq sync"), "{stdout}");
    assert!(
        stdout.contains("by reason: rejected 6, delivery_limit 1\n"),
        "{stdout}"
    );
    // The console's groups, each with its id, the invalid bodies each in
    // the group of why it is invalid.
    for line in [
        "     2  (no failure recorded)  --group d41d8cd9-8f00-b204-e980-0998ecf8427e",
        "     2  order poison-order is poisoned (SQLSTATE P0001)  --group ",
        "     1  body is not a payment event: not a JSON object (an invalid body)  --group ",
        "     1  field `eventId` contains a control character (an invalid body)  --group ",
        "     1  field `points` must be a positive integer that fits 64 bits, got -1 (an invalid body)",
    ] {
        assert!(stdout.contains(line), "no {line:?} in:\n{stdout}");
    }
    assert!(
        stdout.contains("oldest 20") && stdout.contains(", newest 20"),
        "{stdout}"
    );
    // The poisoned two and the one over the limit would apply; the
    // rejected copy of an applied event would not.
    assert!(
        stdout.contains("a replay would apply 3, find 1 applied already; 3 invalid or unknown"),
        "{stdout}"
    );
    // Read from the index, as of each letter's death: it says so.
    assert!(
        stdout.contains("(applied as of each letter's death or the last sync: `idem dlq list` looks each up now)"),
        "{stdout}"
    );
    // A listing's second number is the queue's letters, with a limit or not.
    let (_, listed) = idem(&env, &["dlq", "list"]).await?;
    let queue = &env.topology.dead_letter_queue;
    assert!(
        listed.contains(&format!("7 of 7 dead-lettered message(s) in {queue} match")),
        "{listed}"
    );
    let (_, limited) = idem(&env, &["dlq", "list", "--limit", "2"]).await?;
    // How many it looked at before the limit stopped it depends on how
    // many deliveries had arrived: at least the two, at most the queue.
    let head = format!(
        "the first 2 dead-lettered message(s) in {} that match (the limit), of the ",
        env.topology.dead_letter_queue
    );
    let looked_at = limited
        .split_once(&head)
        .and_then(|(_, rest)| rest.split_once(" looked at; the queue holds 7 (nothing moved)"))
        .and_then(|(seen, _)| seen.parse::<usize>().ok());
    assert!(
        looked_at.is_some_and(|seen| (2..=7).contains(&seen)),
        "{limited}"
    );
    // The summary read the tally the index's triggers keep; one by time
    // reads the rows, and finds the same (every letter died within a day).
    for filter in [&[][..], &["--reason", "rejected"], &["--error", "poisoned"]] {
        let by_tally = idem(&env, &[&["dlq", "summary"], filter].concat()).await?;
        let by_rows = idem(
            &env,
            &[&["dlq", "summary"], filter, &["--newer-than", "1d"]].concat(),
        )
        .await?;
        assert_eq!(by_tally, by_rows, "{filter:?}");
    }
    assert_eq!(
        env.ready(&env.topology.dead_letter_queue).await? as usize,
        letters.count(),
        "a summary moves nothing"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_filters_and_says_what_a_replay_would_do() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let letters = dead_letters_of_every_kind(&env).await?;
    let ids = |report: &Report| -> Vec<Option<String>> {
        report.listed.iter().map(|e| e.event_id.clone()).collect()
    };

    let by_reason = Filter {
        reason: Some("delivery_limit".into()),
        ..Filter::default()
    };
    let listed = run(&env, by_reason, Action::List).await?;
    assert_eq!(
        ids(&listed),
        vec![Some(letters.over_the_limit.event_id.clone())]
    );
    assert_eq!(listed.listed[0].applied, Some(false));
    assert_eq!(listed.seen, letters.count(), "it looked at all of them");

    let by_event = Filter {
        event_id: Some(letters.applied.event_id.clone()),
        ..Filter::default()
    };
    let listed = run(&env, by_event, Action::List).await?;
    assert_eq!(ids(&listed), vec![Some(letters.applied.event_id.clone())]);
    assert_eq!(
        listed.listed[0].applied,
        Some(true),
        "a duplicate if replayed"
    );

    let by_error = Filter {
        error: Some("poisoned".into()),
        ..Filter::default()
    };
    let listed = run(&env, by_error, Action::List).await?;
    let mut poisoned: Vec<Option<String>> = letters
        .poisoned
        .iter()
        .map(|e| Some(e.event_id.clone()))
        .collect();
    poisoned.sort();
    // Each failing event waits and dies on its own clock: their letters
    // come in no set order.
    let mut found = ids(&listed);
    found.sort();
    assert_eq!(found, poisoned);
    assert!(
        listed
            .listed
            .iter()
            .all(|e| e.failures.as_ref().is_some_and(|f| f.failures == 2))
    );

    let old = Filter {
        older_than: Some(Duration::from_secs(3600)),
        ..Filter::default()
    };
    assert_eq!(run(&env, old, Action::List).await?.listed.len(), 0);
    let recent = Filter {
        newer_than: Some(Duration::from_secs(3600)),
        ..Filter::default()
    };
    assert_eq!(
        run(&env, recent, Action::List).await?.listed.len(),
        letters.count()
    );
    assert_eq!(
        env.ready(&env.topology.dead_letter_queue).await? as usize,
        letters.count(),
        "listings move nothing"
    );
    Ok(())
}

/// Found by trying: an event id with a NUL made every later ledger lookup
/// fail, and bodies with terminal escapes were printed raw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_in_an_event_id_hides_no_ledger_entry_and_nothing_raw_reaches_the_terminal()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let letters = dead_letters_of_every_kind(&env).await?;
    // An error text with a terminal escape in it, as a handler's message
    // could carry one, for the second poisoned event.
    env.sql(&format!(
        "UPDATE mq_failure_ledger SET last_error = last_error || chr(27) || '[2J' \
         WHERE event_id = '{}'",
        letters.poisoned[1].event_id
    ))
    .await?;
    let (code, stdout) = idem(&env, &["dlq", "list"]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        !stdout.contains('\u{1b}') && !stdout.contains('\0'),
        "{stdout:?}"
    );
    assert!(stdout.contains(r"\u{1b}[2J"), "shown escaped: {stdout}");
    assert!(
        stdout.contains(r"(SQLSTATE P0001)\u{1b}[2J"),
        "the ledger's error escaped: {stdout}"
    );
    assert!(!stdout.contains("could not be read"), "{stdout}");
    for event in &letters.poisoned {
        let line = stdout
            .lines()
            .position(|line| line.contains(&event.event_id))
            .and_then(|at| stdout.lines().nth(at + 1));
        assert!(
            line.is_some_and(|line| line
                .contains("failed 2 time(s), last error: order poison-order is poisoned")),
            "{stdout}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_takes_the_filters_leaves_invalid_bodies_and_keeps_to_its_rate()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let letters = dead_letters_of_every_kind(&env).await?;
    env.sql("DROP TRIGGER poison ON user_points").await?;

    // Only the poisoned ones, now that the cause is fixed.
    let (code, stdout) = idem(&env, &["dlq", "replay", "--error", "poisoned"]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.starts_with(&format!(
            "replayed 2 message(s) from {} (2 to {})",
            env.topology.dead_letter_queue, env.topology.queue
        )),
        "{stdout}"
    );
    assert_eq!(env.ready(&env.topology.queue).await?, 2);

    // The rest, but the invalid bodies stay.
    let (code, stdout) = idem(&env, &["dlq", "replay"]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.contains("replayed 2 message(s)") && stdout.contains("3 invalid body(ies) skipped"),
        "{stdout}"
    );
    assert_eq!(env.ready(&env.topology.queue).await?, 4);
    assert_eq!(
        env.ready(&env.topology.dead_letter_queue).await? as usize,
        letters.invalid.len()
    );
    let worker = RunningWorker::start(env.worker_config(Mode::Batch));
    worker.wait_finished(4, Duration::from_secs(20)).await?;
    let stats = worker.stop().await?;
    assert_eq!((stats.applied, stats.duplicates), (3, 1), "{stats:?}");
    assert_eq!(env.points("poison-order").await?, 2);
    assert_eq!(env.points("fine-order").await?, 3 + 4);

    // At a rate: twenty replays at ten a second take two seconds.
    let bodies: Vec<Vec<u8>> = (0..20).map(|i| format!("bad {i}").into_bytes()).collect();
    env.publish_bodies(&bodies).await?;
    let worker = RunningWorker::start(env.worker_config(Mode::Batch));
    wait_for(
        "twenty more dead letters",
        Duration::from_secs(30),
        || async { Ok(env.ready(&env.topology.dead_letter_queue).await? == 23) },
    )
    .await?;
    worker.stop().await?;
    let started = Instant::now();
    let report = run(
        &env,
        Filter {
            error: Some("not a payment event".into()),
            ..Filter::default()
        },
        Action::Replay {
            rate: Some(10.0),
            include_invalid: true,
        },
    )
    .await?;
    let took = started.elapsed();
    assert_eq!(
        report.replayed.len(),
        21,
        "the twenty and the one that is not JSON"
    );
    assert!(
        took >= Duration::from_millis(1900),
        "21 replays at 10/s took {took:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discard_writes_each_message_to_a_synced_file_before_it_removes_it() -> anyhow::Result<()>
{
    let env = TestEnv::new().await?;
    let letters = dead_letters_of_every_kind(&env).await?;
    let file = std::env::temp_dir().join(format!("{}-discarded.jsonl", unique_name()));
    let _remove = Removed(file.clone());
    std::fs::write(&file, "{\"kept\": \"an earlier discard\"}\n")?;

    let path = file.display().to_string();
    let (code, stdout) = idem(
        &env,
        &[
            "dlq",
            "discard",
            "--reason",
            "rejected",
            "--invalid",
            "--to",
            &path,
        ],
    )
    .await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(stdout.starts_with("discarded 3 message(s)"), "{stdout}");
    let text = std::fs::read_to_string(&file)?;
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert_eq!(lines.len(), 4, "appended after what was there");
    let mut bodies: Vec<Vec<u8>> = lines[1..]
        .iter()
        .map(|line| match (&line["body"], &line["body_base64"]) {
            (serde_json::Value::String(text), _) => text.clone().into_bytes(),
            (_, serde_json::Value::String(encoded)) => {
                use base64::Engine;
                base64::engine::general_purpose::STANDARD
                    .decode(encoded)
                    .unwrap_or_default()
            }
            _ => Vec::new(),
        })
        .collect();
    bodies.sort();
    let mut expected = letters.invalid.clone();
    expected.sort();
    assert_eq!(bodies, expected, "every body, byte for byte");
    for line in &lines[1..] {
        assert_eq!(line["death"]["reason"], "rejected");
        assert_eq!(line["death"]["queue"], env.topology.queue.as_str());
        assert!(line["invalid"].is_string());
    }
    assert_eq!(
        env.ready(&env.topology.dead_letter_queue).await? as usize,
        letters.count() - 3,
        "the others stay"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_the_broker_nacks_goes_again_on_a_fresh_channel_until_it_is_confirmed()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let events: Vec<PaymentSucceeded> = (0..5)
        .map(|i| PaymentSucceeded {
            event_id: format!("{}-{i}", env.name),
            order_id: "an-order".into(),
            points: 1,
        })
        .collect();
    // They die in a queue that takes one message at a time, so that their
    // replays go back to it.
    let queue = env.bounded_queue("bounded", 1).await?;
    for event in &events {
        publish_messages(&env.amqp, &[Outgoing::json("", &queue, event.to_body())]).await?;
        reject(&env, &queue, 1, false).await?;
    }
    // Behind a slow consumer, most replays are nacked at first.
    let consumer = SlowConsumer::start(&env.amqp, &queue, Duration::from_millis(500)).await?;
    let mut config = config(&env, Filter::default());
    config.target.patience = patient(Duration::from_secs(30));
    let action = Action::Replay {
        rate: None,
        include_invalid: false,
    };
    let report = dlq::run(&config, &action, &Points, &CancellationToken::new()).await?;
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_eq!(report.replayed.len(), events.len());
    assert!(report.nacks_retried > 0, "nothing was nacked: {report:?}");
    let mut bodies: Vec<Vec<u8>> = events.iter().map(PaymentSucceeded::to_body).collect();
    bodies.sort();
    assert_eq!(
        consumer
            .received(bodies.len(), Duration::from_secs(30))
            .await?,
        bodies,
        "each replay arrived once"
    );
    assert_eq!(env.ready(&env.topology.dead_letter_queue).await?, 0);
    Ok(())
}

/// Two dead copies of one failing event share its ledger row: a filter on
/// its error finds both, and a discard by error leaves neither behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_dead_copies_of_one_event_both_match_its_error() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    env.poison_order("poison-order").await?;
    let event = PaymentSucceeded {
        event_id: format!("{}-poisoned-twice", env.name),
        order_id: "poison-order".into(),
        points: 1,
    };
    env.publish_events(&[event.clone(), event.clone()]).await?;
    let mut config = env.worker_config(Mode::Batch);
    config.topology.retry = config.topology.retry.clone().with_attempts(2);
    let worker = RunningWorker::start(config);
    wait_for("both copies dead", Duration::from_secs(30), || async {
        Ok(env.ready(&env.topology.dead_letter_queue).await? == 2)
    })
    .await?;
    worker.stop().await?;

    let by_error = || Filter {
        error: Some("poisoned".into()),
        ..Filter::default()
    };
    let listed = run(&env, by_error(), Action::List).await?;
    assert_eq!(
        listed.listed.len(),
        2,
        "both copies carry the event's last error"
    );
    assert!(
        listed.listed.iter().all(|entry| entry
            .failures
            .as_ref()
            .is_some_and(|l| l.last_error.contains("poisoned"))),
        "{:?}",
        listed.listed
    );
    let file = std::env::temp_dir().join(format!("{}-discarded.jsonl", unique_name()));
    let discarded = run(&env, by_error(), Action::Discard { file: file.clone() }).await;
    let _ = std::fs::remove_file(&file);
    assert_eq!(discarded?.discarded.len(), 2);
    assert_eq!(env.ready(&env.topology.dead_letter_queue).await?, 0);
    Ok(())
}

/// The dead-letter index of `env`'s group: each row's key, reason, count of
/// failures, whether its body is invalid, and copies, by key. Checks first
/// that the tallies the index's triggers keep count its rows.
async fn index_rows(env: &TestEnv) -> anyhow::Result<Vec<(String, String, i32, bool, i32)>> {
    let client = env.pool.get().await?;
    let disagree: i64 = client
        .query_one(
            "WITH counted AS (\
                 SELECT consumer_group, reason, invalid, applied, \
                        coalesce(last_error, '') AS last_error, sum(copies) AS letters \
                 FROM mq_dead_letter GROUP BY 1, 2, 3, 4, 5), \
             tallied AS (\
                 SELECT consumer_group, reason, invalid, applied, last_error, letters \
                 FROM mq_dead_letter_error_tally), \
             by_reason AS (\
                 SELECT consumer_group, reason, sum(copies) AS letters \
                 FROM mq_dead_letter GROUP BY 1, 2), \
             reasons AS (\
                 SELECT consumer_group, reason, letters FROM mq_dead_letter_tally \
                 WHERE letters <> 0) \
             SELECT (SELECT count(*) FROM ((TABLE counted EXCEPT TABLE tallied) \
                                           UNION ALL (TABLE tallied EXCEPT TABLE counted)) d) \
                  + (SELECT count(*) FROM ((TABLE by_reason EXCEPT TABLE reasons) \
                                           UNION ALL (TABLE reasons EXCEPT TABLE by_reason)) d)",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(disagree, 0, "the tallies and the index's rows disagree");
    let rows = client
        .query(
            "SELECT letter_key, reason, failures, invalid, copies FROM mq_dead_letter \
             WHERE consumer_group = $1 ORDER BY letter_key",
            &[&GROUP],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4)))
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_follows_the_queue_through_the_worker_a_sync_a_replay_and_a_discard()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let dead_letters = env.topology.dead_letter_queue.clone();
    let letters = dead_letters_of_every_kind(&env).await?;
    let event = |id: &str| format!("event {id}");

    // The worker indexed the five it dead-lettered, each with the ledger's
    // count; the two that consumers rejected by hand it never saw.
    let rows = index_rows(&env).await?;
    let bodies: Vec<_> = rows
        .iter()
        .filter(|row| row.0.starts_with("body "))
        .collect();
    assert_eq!(bodies.len(), letters.invalid.len(), "{rows:?}");
    assert!(
        bodies
            .iter()
            .all(|row| row.1 == "rejected" && row.2 == 0 && row.3 && row.4 == 1),
        "{rows:?}"
    );
    for poisoned in &letters.poisoned {
        assert!(
            rows.contains(&(event(&poisoned.event_id), "rejected".into(), 2, false, 1)),
            "{rows:?}"
        );
    }
    assert_eq!(rows.len(), 5, "{rows:?}");

    // A status reads the index and says where it and the queue differ.
    let (code, stdout) = idem(&env, &["status"]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.contains(
            "dead letters       rejected 5 (by the index, never synced; the dead-letter queue \
             holds 7 ready: `idem dlq sync` sets the index to it)"
        ),
        "{stdout}"
    );

    // A row whose letter is gone (as after a purge), and a sync: the index
    // is what the queue holds, which it leaves as it was.
    env.sql(&format!(
        "INSERT INTO mq_dead_letter (consumer_group, letter_key, event_id, queue, reason, \
             failures, invalid, copies, dead_at) \
         VALUES ('{GROUP}', 'event ghost', 'ghost', 'q', 'rejected', 0, false, 1, now())"
    ))
    .await?;
    let (code, stdout) = idem(&env, &["dlq", "sync"]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.contains(&format!(
            "synced the dead-letter index with {dead_letters}: 7 letter(s) found, 1 row(s) of \
             letters no longer there removed"
        )),
        "{stdout}"
    );
    assert_eq!(env.ready(&dead_letters).await?, 7);
    let rows = index_rows(&env).await?;
    assert_eq!(rows.len(), 7, "{rows:?}");
    assert!(!rows.iter().any(|row| row.0 == "event ghost"), "{rows:?}");
    assert!(
        rows.contains(&(
            event(&letters.over_the_limit.event_id),
            "delivery_limit".into(),
            0,
            false,
            1
        )),
        "{rows:?}"
    );
    assert!(
        rows.contains(&(
            event(&letters.applied.event_id),
            "rejected".into(),
            0,
            false,
            1
        )),
        "{rows:?}"
    );
    // What the worker had indexed kept the ledger's count.
    for poisoned in &letters.poisoned {
        assert!(
            rows.contains(&(event(&poisoned.event_id), "rejected".into(), 2, false, 1)),
            "{rows:?}"
        );
    }
    let (code, stdout) = idem(&env, &["status"]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.contains(
            "dead letters       delivery_limit 1, rejected 6 (by the index, last synced 20"
        ),
        "{stdout}"
    );
    assert!(!stdout.contains("dlq sync"), "{stdout}");

    // A replay and a discard take what they acked off the index.
    let replayed = &letters.poisoned[0].event_id;
    let (code, stdout) = idem(&env, &["dlq", "replay", "--event-id", replayed]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    let rows = index_rows(&env).await?;
    assert!(!rows.iter().any(|row| row.0 == event(replayed)), "{rows:?}");
    let file = std::env::temp_dir().join(format!("{}-discarded.jsonl", unique_name()));
    let _remove = Removed(file.clone());
    let to = file.display().to_string();
    let (code, stdout) = idem(&env, &["dlq", "discard", "--invalid", "--to", &to]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    let rows = index_rows(&env).await?;
    assert_eq!(rows.len(), 3, "{rows:?}");
    assert!(!rows.iter().any(|row| row.3), "{rows:?}");
    assert_eq!(env.ready(&dead_letters).await?, 3);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_summary_count_from_the_index_and_take_no_letter_off_the_queue()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let dead_letters = env.topology.dead_letter_queue.clone();
    env.poison_order("poison-order").await?;
    let mut bodies = vec![b"not json".to_vec(), b"{}".to_vec()];
    bodies.extend((0..3).map(|i| {
        PaymentSucceeded {
            event_id: format!("{}-poisoned-{i}", env.name),
            order_id: "poison-order".into(),
            points: 1,
        }
        .to_body()
    }));
    env.publish_bodies(&bodies).await?;
    let mut config = env.worker_config(Mode::Batch);
    config.topology.retry = config.topology.retry.clone().with_attempts(2);
    let worker = RunningWorker::start(config);
    wait_for("the dead letters", Duration::from_secs(30), || async {
        Ok(env.ready(&dead_letters).await? == 5)
    })
    .await?;
    worker.stop().await?;

    let (code, stdout) = idem(&env, &["status"]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.contains("dead letters       rejected 5 (by the index, never synced)"),
        "{stdout}"
    );
    let (code, stdout) = idem(&env, &["dlq", "summary", "--error", "poisoned"]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.starts_with(&format!(
            "3 of 5 dead-lettered message(s) in {dead_letters} match"
        )),
        "{stdout}"
    );
    assert!(
        stdout.contains("a replay would apply 3, find 0 applied already; 0 invalid or unknown"),
        "{stdout}"
    );

    // Neither took a letter off the queue: each is delivered now for the
    // first time (a browse gives back every letter it takes, redelivered).
    // RabbitMQ 4 marks a dead letter redelivered from its first delivery
    // on (the source queue's delivery count goes with it): the flag tells
    // only on 3.x.
    let connection = env.connect().await?;
    let version = rabbitmqctl().arg("version").output()?;
    let flags_first_deliveries = String::from_utf8_lossy(&version.stdout)
        .trim()
        .starts_with("3.");
    let channel = connection.create_channel().await?;
    let mut first_deliveries = 0;
    while let Some(message) = channel
        .basic_get(
            dead_letters.as_str().into(),
            BasicGetOptions { no_ack: false },
        )
        .await?
    {
        assert!(
            !flags_first_deliveries || !message.delivery.redelivered,
            "taken off the queue before: {}",
            String::from_utf8_lossy(&message.delivery.data)
        );
        first_deliveries += 1;
    }
    assert_eq!(first_deliveries, 5);
    connection.close(200, "OK".into()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_over_more_letters_than_a_quorum_queue_hands_out_moves_what_it_keeps_to_the_tail()
-> anyhow::Result<()> {
    // A quorum queue hands a consumer without a prefetch limit 2,000
    // unacked messages at most: a pass that held every letter it leaves
    // would wait for ever on a bigger queue.
    let env = TestEnv::new().await?;
    let dead_letters = env.topology.dead_letter_queue.clone();
    let failed = env.failed_events(&["order-a"], 3).await?;
    let invalid: Vec<Vec<u8>> = (0..2600)
        .map(|i| format!("not an event {i}").into_bytes())
        .collect();
    env.publish_bodies(&invalid).await?;
    let total = failed.len() + invalid.len();
    let worker = RunningWorker::start(env.worker_config(Mode::Batch));
    wait_for(
        "every body dead-lettered",
        Duration::from_secs(120),
        || async { Ok(env.ready(&dead_letters).await? as usize == total) },
    )
    .await?;
    worker.stop().await?;

    let (code, stdout) = idem(&env, &["dlq", "sync"]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.contains(&format!("{total} letter(s) found, 0 row(s)")),
        "{stdout}"
    );
    assert!(stdout.contains("went to its tail"), "{stdout}");
    assert_eq!(env.ready(&dead_letters).await? as usize, total);
    assert_eq!(index_rows(&env).await?.len(), total);

    // The failed events came first, so the sync moved them: their copies
    // still say, in `x-death`, which queue they died in.
    let (code, stdout) = idem(&env, &["dlq", "replay", "--error", "order order-a failed"]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.contains(&format!(
            "replayed 3 message(s) from {dead_letters} (3 to {})",
            env.topology.queue
        )),
        "{stdout}"
    );
    assert_eq!(env.ready(&env.topology.queue).await?, 3);
    wait_for(
        "the dead-letter queue to hold every letter not replayed",
        Duration::from_secs(10),
        || async { Ok(env.ready(&dead_letters).await? as usize == invalid.len()) },
    )
    .await?;
    let rows = index_rows(&env).await?;
    assert_eq!(rows.len(), invalid.len());
    assert!(rows.iter().all(|row| row.3), "{rows:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_stops_once_it_found_the_matches_the_index_counts_when_it_counts_every_letter()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let dead_letters = env.topology.dead_letter_queue.clone();
    // Ten events that fail, dead-lettered first, then 290 bodies that are
    // not events: the index counts every letter in the queue.
    env.poison_order("poison-order").await?;
    let poisoned: Vec<Vec<u8>> = (0..10)
        .map(|i| {
            PaymentSucceeded {
                event_id: format!("{}-poisoned-{i}", env.name),
                order_id: "poison-order".into(),
                points: 1,
            }
            .to_body()
        })
        .collect();
    let mut config = env.worker_config(Mode::Batch);
    config.topology.retry = config.topology.retry.clone().with_attempts(1);
    let worker = RunningWorker::start(config);
    env.publish_bodies(&poisoned).await?;
    wait_for("the failed events", Duration::from_secs(30), || async {
        Ok(env.ready(&dead_letters).await? == 10)
    })
    .await?;
    let invalid: Vec<Vec<u8>> = (0..290)
        .map(|i| format!("not an event {i}").into_bytes())
        .collect();
    env.publish_bodies(&invalid).await?;
    wait_for("every dead letter", Duration::from_secs(30), || async {
        Ok(env.ready(&dead_letters).await? == 300)
    })
    .await?;
    worker.stop().await?;

    // The replay of the ten stops once it found them: the letters after
    // them in the queue are not taken.
    let (code, stdout) = idem(&env, &["dlq", "replay", "--error", "poisoned"]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(stdout.starts_with("replayed 10 message(s)"), "{stdout}");
    let not_looked_at: usize = stdout
        .split_once("\n  (")
        .and_then(|(_, rest)| rest.split_once(" letter(s) not looked at"))
        .and_then(|(n, _)| n.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no letters left unseen in: {stdout}"))?;
    assert!(not_looked_at > 0 && not_looked_at < 290, "{stdout}");
    assert_eq!(env.ready(&env.topology.queue).await?, 10);
    assert_eq!(env.ready(&dead_letters).await?, 290);
    let connection = env.connect().await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_purge(env.topology.queue.as_str().into(), Default::default())
        .await?;
    connection.close(200, "OK".into()).await?;

    // A letter that came by the broker's hop, which the index does not
    // know of: the queue holds more than it counts, and a replay looks at
    // every letter to find it.
    let unknown = PaymentSucceeded {
        event_id: format!("{}-unknown", env.name),
        order_id: "fine-order".into(),
        points: 2,
    };
    env.publish_events(std::slice::from_ref(&unknown)).await?;
    reject(&env, &env.topology.queue, 1, false).await?;
    wait_for(
        "the letter the index lacks",
        Duration::from_secs(30),
        || async { Ok(env.ready(&dead_letters).await? == 291) },
    )
    .await?;
    let (code, stdout) = idem(&env, &["dlq", "replay", "--event-id", &unknown.event_id]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(stdout.starts_with("replayed 1 message(s)"), "{stdout}");
    assert!(!stdout.contains("not looked at"), "{stdout}");
    assert_eq!(env.ready(&env.topology.queue).await?, 1);
    assert_eq!(env.ready(&dead_letters).await?, 290);

    // --every-letter looks at every letter even when the index agrees.
    let (code, stdout) = idem(
        &env,
        &["dlq", "list", "--error", "poisoned", "--every-letter"],
    )
    .await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.starts_with(&format!(
            "0 of 290 dead-lettered message(s) in {dead_letters} match"
        )),
        "{stdout}"
    );
    assert!(!stdout.contains("not looked at"), "{stdout}");
    let (code, stdout) = idem(&env, &["dlq", "list", "--error", "poisoned"]).await?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.starts_with(&format!(
            "0 of 290 dead-lettered message(s) in {dead_letters} match"
        )) && stdout.contains("(290 letter(s) not looked at"),
        "{stdout}"
    );
    assert_eq!(env.ready(&dead_letters).await?, 290);
    Ok(())
}
