//! Epochs and retention: deduplication stays exact across the opening of
//! an epoch, and a prune drops whole epochs, keeping what a dead letter
//! still needs.
//!
//! Over 700 lines: one scenario per test, retention's in one place.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use idem::broker::Outgoing;
use idem::handler::Handler;
use idem::store::filter::EpochCounters;
use idem::store::{Applier, Filters, Store, retention};
use idem::worker::{EpochSettings, Mode};
use idem_points::points::{PaymentSucceeded, Points};

use crate::support::{
    GROUP, RunningWorker, TestEnv, Untallied, WorkerProcess, amqp_url, apply, database_url,
    idem_command, publish_messages, run_idem, sample, wait_for,
};

const RACERS: usize = 4;
const ROUNDS: usize = 40;
const EVENTS_PER_ROUND: usize = 10;

/// `RACERS` tasks that apply `events` one at a time, each in an order of
/// its own, once `start` (the barrier returned, which the caller waits on
/// too) lets them go.
fn race<H>(
    applier: &Arc<Applier<H>>,
    events: &Arc<Vec<PaymentSucceeded>>,
    first_deliveries: bool,
) -> (
    Arc<tokio::sync::Barrier>,
    tokio::task::JoinSet<anyhow::Result<usize>>,
)
where
    H: Handler<Event = PaymentSucceeded> + Send + Sync + 'static,
{
    let start = Arc::new(tokio::sync::Barrier::new(RACERS + 1));
    let mut racers = tokio::task::JoinSet::new();
    for racer in 0..RACERS {
        let (applier, events, start) = (applier.clone(), events.clone(), start.clone());
        racers.spawn(async move {
            start.wait().await;
            let mut went_in = 0;
            for i in 0..events.len() {
                let event = &events[(i + racer * 3) % events.len()];
                let mut claimed = if first_deliveries {
                    applier
                        .apply_first_deliveries(&[event])
                        .await
                        .map_err(|failure| anyhow::anyhow!("{}", failure.reason))?
                } else {
                    apply(&applier, &[event]).await?
                };
                went_in += usize::from(claimed.take(&event.event_id));
            }
            anyhow::Ok(went_in)
        });
    }
    (start, racers)
}

/// How many events the racers put in, all told.
async fn went_in(mut racers: tokio::task::JoinSet<anyhow::Result<usize>>) -> anyhow::Result<usize> {
    let mut went_in = 0;
    while let Some(racer) = racers.join_next().await {
        went_in += racer??;
    }
    Ok(went_in)
}

/// Every round, `RACERS` appliers apply the same new events at the same
/// moment, each in an order of its own, while epochs are opened under
/// them: each event must go in exactly once.
async fn duplicates_race_across_new_epochs<H>(handler: H) -> anyhow::Result<()>
where
    H: Handler<Event = PaymentSucceeded> + Send + Sync + 'static,
{
    let env = TestEnv::new().await?;
    let store = Store::new(env.pool.clone(), GROUP.to_owned());
    let applier = Arc::new(Applier::new(store, Arc::new(handler))?);
    let order = format!("{}-order", env.name);
    let epochs_before = retention::epochs(&*env.pool.get().await?).await?.len();
    for round in 0..ROUNDS {
        let events: Arc<Vec<PaymentSucceeded>> = Arc::new(
            (0..EVENTS_PER_ROUND)
                .map(|i| PaymentSucceeded {
                    event_id: format!("{}-{round}-{i}", env.name),
                    order_id: order.clone(),
                    points: 1,
                })
                .collect(),
        );
        let (start, racers) = race(&applier, &events, false);
        let client = env.pool.get().await?;
        start.wait().await;
        // Two epochs opened while the racers claim, the second as soon as
        // the first is current.
        for _ in 0..2 {
            retention::open_epoch(&client).await?;
        }
        assert_eq!(went_in(racers).await?, EVENTS_PER_ROUND, "round {round}");
    }

    let client = env.pool.get().await?;
    let row = client
        .query_one(
            "SELECT count(*), count(DISTINCT event_id), count(DISTINCT epoch) \
             FROM mq_consume_record WHERE consumer_group = $1",
            &[&GROUP],
        )
        .await?;
    let (records, events, epochs): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    let all = (ROUNDS * EVENTS_PER_ROUND) as i64;
    assert_eq!((records, events), (all, all));
    // The records are spread over many epochs: the races were across the
    // boundaries.
    assert!(epochs > ROUNDS as i64, "records in only {epochs} epochs");
    assert_eq!(
        retention::epochs(&client).await?.len(),
        epochs_before + 2 * ROUNDS
    );
    assert_eq!(env.points(&order).await?, all);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_racing_across_new_epochs_apply_once_in_one_statement() -> anyhow::Result<()> {
    duplicates_race_across_new_epochs(Points).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_racing_across_new_epochs_apply_once_in_a_longer_transaction()
-> anyhow::Result<()> {
    duplicates_race_across_new_epochs(Untallied(Points)).await
}

/// Every round, `RACERS` appliers apply the same new events and copies of
/// events of earlier rounds, while epochs close under them (by size, as a
/// worker closes them, and by age) and their filters are built and taken
/// up: each new event goes in exactly once, and every earlier one, now in
/// a closed epoch the claims look into through its filter, is a duplicate.
async fn duplicates_race_across_filtered_epochs<H>(
    handler: H,
    first_deliveries: bool,
) -> anyhow::Result<()>
where
    H: Handler<Event = PaymentSucceeded> + Send + Sync + 'static,
{
    let env = TestEnv::new().await?;
    let counters = EpochCounters::default();
    let filters = Arc::new(Filters::new(counters.clone()));
    let store = Store::new(env.pool.clone(), GROUP.to_owned()).with_filters(filters.clone());
    let applier = Arc::new(Applier::new(store, Arc::new(handler))?);
    let order = format!("{}-order", env.name);
    let event = |round: usize, i: usize| PaymentSucceeded {
        event_id: format!("{}-{round}-{i}", env.name),
        order_id: order.clone(),
        points: 1,
    };
    let mut keeper = env.pool.get().await?;
    for round in 0..ROUNDS {
        // This round's events, then copies of two earlier rounds' events.
        let events: Arc<Vec<PaymentSucceeded>> = Arc::new(
            (0..EVENTS_PER_ROUND)
                .map(|i| event(round, i))
                .chain(
                    [round.checked_sub(1), round.checked_sub(4)]
                        .into_iter()
                        .flatten()
                        .flat_map(|earlier| (0..EVENTS_PER_ROUND).map(move |i| (earlier, i)))
                        .map(|(earlier, i)| event(earlier, i)),
                )
                .collect(),
        );
        let (start, racers) = race(&applier, &events, first_deliveries);
        start.wait().await;
        // An epoch closed by size (one record is enough), one by age, and
        // the filters synced, while the racers claim.
        retention::rotate(&keeper, 1).await?;
        retention::open_epoch(&keeper).await?;
        filters.sync(&mut keeper, usize::MAX, true).await?;
        assert_eq!(went_in(racers).await?, EVENTS_PER_ROUND, "round {round}");
    }

    let row = keeper
        .query_one(
            "SELECT count(*), count(DISTINCT event_id) FROM mq_consume_record \
             WHERE consumer_group = $1",
            &[&GROUP],
        )
        .await?;
    let all = (ROUNDS * EVENTS_PER_ROUND) as i64;
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (all, all));
    assert_eq!(env.points(&order).await?, all);
    // The copies were found through the filters: they asked for lookups,
    // and held most closed epochs by the end.
    assert!(counters.lookups.get() > 0, "no lookup asked for");
    let closed = retention::epochs(&keeper).await?.len() - 1;
    assert!(
        filters.epochs().len() + 2 >= closed,
        "{} filters for {closed} closed epochs",
        filters.epochs().len()
    );
    // One event at a time, first deliveries, a tally: after each sync, the
    // claims went straight into the epoch the sync found current, until the
    // epochs opened under them refused them.
    assert_eq!(
        counters.straight.get() > 0,
        first_deliveries,
        "{} straight claims",
        counters.straight.get()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_racing_across_filtered_epochs_apply_once_in_one_statement() -> anyhow::Result<()>
{
    duplicates_race_across_filtered_epochs(Points, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_racing_across_filtered_epochs_apply_once_straight_into_the_current_epoch()
-> anyhow::Result<()> {
    duplicates_race_across_filtered_epochs(Points, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_racing_across_filtered_epochs_apply_once_in_a_longer_transaction()
-> anyhow::Result<()> {
    duplicates_race_across_filtered_epochs(Untallied(Points), false).await
}

/// A database restored from before an epoch closed has that epoch current
/// again; it takes other records, and closes again at another moment. A
/// worker that rode out the restore holds the filter of the epoch of that
/// number it saw before: a claim looks into the epoch as if it had none,
/// and the worker's next sync replaces it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_of_an_epoch_closed_before_a_restore_covers_nothing() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let filters = Arc::new(Filters::default());
    let store = Store::new(env.pool.clone(), GROUP.to_owned()).with_filters(filters.clone());
    let applier = Applier::new(store, Arc::new(Points))?;
    let payment = |id: &str| PaymentSucceeded {
        event_id: format!("{}-{id}", env.name),
        order_id: format!("{}-order", env.name),
        points: 1,
    };
    let (before, after) = (payment("before"), payment("after"));
    let mut client = env.pool.get().await?;
    let epoch = *epoch_numbers(&env).await?.last().context("no epoch")?;
    apply(&applier, &[&before]).await?;
    retention::open_epoch(&client).await?;
    filters.sync(&mut client, usize::MAX, true).await?;
    assert_eq!(filters.epochs(), vec![epoch]);

    // The restore: the epoch current again, without its filter, its
    // partition taking records again; a record goes in; another process
    // closes it again.
    client
        .batch_execute(&format!(
            "DROP TABLE mq_consume_record_{next};
             DELETE FROM mq_consume_epoch WHERE epoch = {next};
             DELETE FROM mq_consume_filter WHERE epoch = {epoch};
             ALTER TABLE mq_consume_record_{epoch} DROP CONSTRAINT mq_consume_record_{epoch}_closed;",
            next = epoch + 1
        ))
        .await?;
    // A first delivery: the sync above let claims go straight into the
    // epoch after, whose partition is gone; it goes in through the claim.
    let first = applier
        .apply_first_deliveries(&[&after])
        .await
        .map_err(|failure| anyhow::anyhow!("{}", failure.reason))?;
    let mut first = first;
    assert!(first.take(&after.event_id));
    retention::open_epoch(&client).await?;

    // The filter held is from before: the copy is found all the same.
    assert_eq!(filters.epochs(), vec![epoch]);
    assert!(!apply(&applier, &[&after]).await?.take(&after.event_id));
    assert!(!apply(&applier, &[&before]).await?.take(&before.event_id));
    assert_eq!(env.points(&after.order_id).await?, 2);
    let synced = filters.sync(&mut client, usize::MAX, true).await?;
    assert_eq!((synced.dropped, synced.built), (vec![epoch], vec![epoch]));
    assert!(!apply(&applier, &[&after]).await?.take(&after.event_id));
    assert_eq!(env.points(&after.order_id).await?, 2);
    Ok(())
}

/// A worker opens an epoch whenever the current one has taken its share,
/// builds and stores the filter of the one it closed, and finds the events
/// of earlier epochs through their filters: each event is applied once
/// however far apart its copies come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_opens_epochs_by_size_and_finds_earlier_events_through_their_filters()
-> anyhow::Result<()> {
    // Ids come from a sequence that hands each session a thousand at a
    // time: an epoch's share is measured in those, so the waves are larger.
    const WAVE: usize = 3000;
    let env = TestEnv::new().await?;
    let epochs_before = epoch_numbers(&env).await?.len();
    let mut config = env.worker_config(Mode::Batch);
    config.epochs = EpochSettings {
        max_records: Some(1000),
        interval: Duration::from_millis(100),
        ..EpochSettings::default()
    };
    let worker = RunningWorker::start(config);
    let wave = |n: usize| -> Vec<PaymentSucceeded> {
        (0..WAVE)
            .map(|i| PaymentSucceeded {
                event_id: format!("{}-{n}-{i}", env.name),
                order_id: format!("{}-{}", env.name, i % 10),
                points: 1,
            })
            .collect()
    };
    let mut finished = 0;
    for n in 0..4 {
        // Each wave's events, with copies of the wave before and of the
        // first: by then in closed epochs.
        let mut events = wave(n);
        for earlier in [n.checked_sub(1), (n > 1).then_some(0)]
            .into_iter()
            .flatten()
        {
            events.extend(wave(earlier));
        }
        env.publish_events(&events).await?;
        finished += events.len() as u64;
        worker
            .wait_finished(finished, Duration::from_secs(30))
            .await?;
        wait_for(
            "an epoch closed by size during the wave, and every closed one's filter stored",
            Duration::from_secs(20),
            || async {
                let closed = epoch_numbers(&env).await?.len() - 1;
                Ok(closed >= epochs_before + n
                    && env.count_rows("mq_consume_filter").await? == closed as i64)
            },
        )
        .await?;
    }
    let stats = worker.stats.snapshot();
    let metrics = worker.stats.encode();
    worker.stop().await?;

    assert_eq!(
        (stats.applied, stats.duplicates),
        (4 * WAVE as u64, 5 * WAVE as u64)
    );
    let points: i64 = {
        let client = env.pool.get().await?;
        client
            .query_one("SELECT sum(points)::bigint FROM user_points", &[])
            .await?
            .get(0)
    };
    assert_eq!(points, 4 * WAVE as i64);
    assert!(epoch_numbers(&env).await?.len() >= epochs_before + 4);
    assert!(
        sample(&metrics, "idem_epoch_filters", &[]).is_some_and(|epochs| epochs >= 4.0),
        "{metrics}"
    );
    // The first wave's copies were looked up where their filter said.
    assert!(
        sample(&metrics, "idem_epoch_lookups_total", &[])
            .is_some_and(|lookups| lookups >= 2.0 * WAVE as f64),
        "{metrics}"
    );
    Ok(())
}

/// Without memory for a filter, a worker opens no epoch by size: a closed
/// epoch without one would cost every claim a lookup, more than a large
/// current epoch does. One closed by age is looked into for every event,
/// and its events are found there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_memory_for_filters_no_epoch_opens_by_size_and_earlier_events_are_still_found()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let mut config = env.worker_config(Mode::Batch);
    config.epochs = EpochSettings {
        max_records: Some(100),
        filter_memory: 0,
        interval: Duration::from_millis(100),
    };
    let epochs = epoch_numbers(&env).await?;
    let worker = RunningWorker::start(config);
    let events: Vec<PaymentSucceeded> = (0..3000)
        .map(|i| PaymentSucceeded {
            event_id: format!("{}-{i}", env.name),
            order_id: format!("{}-{}", env.name, i % 10),
            points: 1,
        })
        .collect();
    env.publish_events(&events).await?;
    worker.wait_finished(3000, Duration::from_secs(30)).await?;
    wait_for(
        "the keeper to see the current epoch's records",
        Duration::from_secs(20),
        || async {
            Ok(
                sample(&worker.stats.encode(), "idem_current_epoch_records", &[])
                    .is_some_and(|records| records >= 3000.0),
            )
        },
    )
    .await?;
    assert_eq!(
        epoch_numbers(&env).await?,
        epochs,
        "an epoch opened by size"
    );

    // An epoch closed by age, as the retention closes them: no filter for
    // it, and the copies are found there.
    retention::open_epoch(&*env.pool.get().await?).await?;
    wait_for(
        "the keeper to see the closed epoch",
        Duration::from_secs(20),
        || async { Ok(sample(&worker.stats.encode(), "idem_unfiltered_epochs", &[]) == Some(1.0)) },
    )
    .await?;
    env.publish_events(&events).await?;
    worker.wait_finished(6000, Duration::from_secs(30)).await?;
    let stats = worker.stop().await?;
    assert_eq!((stats.applied, stats.duplicates), (3000, 3000));
    assert_eq!(env.count_rows("mq_consume_filter").await?, 0);
    Ok(())
}

/// `idem prune` against the test's schema and queues, with the safety
/// rule's settings given.
async fn prune(env: &TestEnv, args: &[&str]) -> anyhow::Result<(Option<i32>, String)> {
    idem(env, &[&["prune"], args].concat()).await
}

/// `idem` with `args`, on `env`; its exit code and all it printed.
async fn idem(env: &TestEnv, args: &[&str]) -> anyhow::Result<(Option<i32>, String)> {
    let ran = run_idem(env, args).await?;
    Ok((ran.code, format!("{}{}", ran.stdout, ran.stderr)))
}

async fn epoch_numbers(env: &TestEnv) -> anyhow::Result<Vec<i32>> {
    let client = env.pool.get().await?;
    Ok(retention::epochs(&client)
        .await?
        .iter()
        .map(|epoch| epoch.epoch)
        .collect())
}

/// Ages every epoch by `days`, as if the records had been written then.
async fn age_epochs(env: &TestEnv, days: i32) -> anyhow::Result<()> {
    env.pool
        .get()
        .await?
        .execute(
            "UPDATE mq_consume_epoch SET opened_at = opened_at - make_interval(days => $1)",
            &[&days],
        )
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prune_drops_whole_epochs_past_the_window_and_keeps_what_a_dead_letter_needs()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let store = Store::new(env.pool.clone(), GROUP.to_owned());
    let applier = Applier::new(store, Arc::new(Points))?;
    let event = |n: usize| PaymentSucceeded {
        event_id: format!("{}-{n}", env.name),
        order_id: format!("{}-order", env.name),
        points: 1,
    };
    let client = env.pool.get().await?;
    // Epoch A holds events 1 and 2, epoch B event 3, the current one 4.
    apply(&applier, &[&event(1), &event(2)]).await?;
    let a = retention::epochs(&client)
        .await?
        .last()
        .context("no epoch")?
        .epoch;
    let b = retention::open_epoch(&client).await?;
    apply(&applier, &[&event(3)]).await?;
    let current = retention::open_epoch(&client).await?;
    apply(&applier, &[&event(4)]).await?;
    // Old ledger and outbox rows, and new ones; and an old ledger row of
    // event 3, whose letter the dead-letter queue will hold.
    env.sql(&format!(
        "INSERT INTO mq_failure_ledger (event_id, consumer_group, failures, first_failed_at, \
             last_failed_at, last_error) VALUES \
             ('old', 'g', 1, now() - interval '30 days', now() - interval '30 days', 'x'), \
             ('new', 'g', 1, now(), now(), 'x'), \
             ('{}', '{GROUP}', 4, now() - interval '30 days', now() - interval '30 days', 'x'); \
         INSERT INTO mq_outbox (message_id, exchange, routing_key, body, sent_at) VALUES \
             (gen_random_uuid(), 'e', 'k', '', now() - interval '30 days'), \
             (gen_random_uuid(), 'e', 'k', '', now()), \
             (gen_random_uuid(), 'e', 'k', '', NULL); \
         INSERT INTO mq_dead_letter_hourly (consumer_group, hour, letters) VALUES \
             ('g', date_trunc('hour', now() - interval '30 days'), 5), \
             ('g', date_trunc('hour', now()), 2);",
        event(3).event_id
    ))
    .await?;

    // A window shorter than the minimum is refused, in one line, and
    // nothing moves.
    let (code, text) = prune(&env, &["--older-than", "1d"]).await?;
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("shorter than --min-retention (7d)"), "{text}");
    assert_eq!(text.trim().lines().count(), 1, "{text}");
    // So is one the retries take longer than.
    let (code, text) = prune(
        &env,
        &[
            "--older-than",
            "1h",
            "--min-retention",
            "1h",
            "--retry-delays",
            "30m,40m",
        ],
    )
    .await?;
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("not longer than a message's retries wait in all (150m)"),
        "{text}"
    );

    // A copy of event 3 waits in the dead-letter queue: a replay after its
    // record went would apply it again.
    let dead_letters = env.topology.dead_letter_queue.clone();
    publish_messages(
        &env.amqp,
        &[Outgoing::json("", &dead_letters, event(3).to_body())],
    )
    .await?;
    age_epochs(&env, 10).await?;
    // The current epoch has been open for longer than an epoch's length:
    // the prune opens the next. The letter came by hand, not through
    // idem's worker: the index does not know it, so every epoch stays.
    let (code, text) = prune(&env, &["--older-than", "8d"]).await?;
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains(
            "kept every epoch and the failure ledger: the dead-letter queue holds 1 letter(s), \
             the index knows of 0"
        ),
        "{text}"
    );
    assert!(
        text.contains(&format!("opened epoch {}", current + 1)),
        "{text}"
    );
    // The tally's hour from before the window goes, no letter being of it;
    // this hour's stays.
    assert!(
        text.contains("and 1 hour(s) of the dead-letter tally"),
        "{text}"
    );
    let hours = env
        .count(
            "SELECT count(*) FROM mq_dead_letter_hourly WHERE consumer_group = 'g'",
            &[],
        )
        .await?;
    assert_eq!(hours, 1, "{text}");
    assert_eq!(
        epoch_numbers(&env).await?,
        vec![a, b, current, current + 1],
        "{text}"
    );
    // Once a sync has indexed it, its epoch and the later ones stay. A dry
    // run says so, and what would go, and changes nothing.
    let (code, text) = idem(&env, &["dlq", "sync"]).await?;
    assert_eq!(code, Some(0), "{text}");
    let (code, text) = prune(&env, &["--older-than", "8d", "--dry-run"]).await?;
    assert_eq!(code, Some(0), "{text}");
    for said in [
        "a dry run: nothing is changed".to_owned(),
        format!("kept epoch {b} and later"),
        format!("would drop epoch {a} (about 2 consume records)"),
        "would remove 1 failure ledger row(s), 0 sent outbox row(s)".to_owned(),
    ] {
        assert!(text.contains(&said), "no {said:?} in:\n{text}");
    }
    assert_eq!(
        epoch_numbers(&env).await?,
        vec![a, b, current, current + 1],
        "{text}"
    );
    assert_eq!(env.count_rows("mq_failure_ledger").await?, 3);
    let (code, text) = prune(&env, &["--older-than", "8d"]).await?;
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains(&format!("kept epoch {b} and later")),
        "{text}"
    );
    assert!(
        text.contains(&format!("dropped epoch {a} (about 2 consume records)")),
        "{text}"
    );
    assert_eq!(
        epoch_numbers(&env).await?,
        vec![b, current, current + 1],
        "{text}"
    );
    assert_eq!(env.records_of(&event(1).event_id, GROUP).await?, 0);
    assert_eq!(env.records_of(&event(3).event_id, GROUP).await?, 1);
    // Event 3's old ledger row stays with its letter: `dlq list` shows it.
    assert_eq!(env.count_rows("mq_failure_ledger").await?, 2);
    assert_eq!(env.count_rows("mq_outbox").await?, 2);

    // The letter goes by a purge, behind idem's back: the index still
    // holds it, so the prune still keeps its epoch (it reads the index,
    // not the queue, and keeping too much is the safe side) ...
    let connection = env.connect().await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_purge(dead_letters.as_str().into(), Default::default())
        .await?;
    connection.close(200, "OK".into()).await?;
    let (code, text) = prune(&env, &["--older-than", "8d"]).await?;
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains(&format!("kept epoch {b} and later")),
        "{text}"
    );
    // ... until a sync sets the index to the queue. Then its epoch goes
    // too; the one closed just now stays, whatever the age of its records.
    let (code, text) = idem(&env, &["dlq", "sync"]).await?;
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("0 letter(s) found, 1 row(s) of letters no longer there removed"),
        "{text}"
    );
    let (code, text) = prune(&env, &["--older-than", "8d"]).await?;
    assert_eq!(code, Some(0), "{text}");
    assert!(!text.contains("opened epoch"), "{text}");
    assert_eq!(
        epoch_numbers(&env).await?,
        vec![current, current + 1],
        "{text}"
    );
    assert_eq!(env.records_of(&event(3).event_id, GROUP).await?, 0);
    assert_eq!(env.records_of(&event(4).event_id, GROUP).await?, 1);
    // Its letter gone, so is its ledger row.
    assert_eq!(env.count_rows("mq_failure_ledger").await?, 1);
    Ok(())
}

/// A copy that waits in the work queue while no worker runs may be older
/// than the window: until a worker has taken it, no epoch goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prune_keeps_every_epoch_while_messages_wait_for_a_worker() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let store = Store::new(env.pool.clone(), GROUP.to_owned());
    let applier = Applier::new(store, Arc::new(Points))?;
    let event = PaymentSucceeded {
        event_id: format!("{}-1", env.name),
        order_id: format!("{}-order", env.name),
        points: 1,
    };
    apply(&applier, &[&event]).await?;
    let client = env.pool.get().await?;
    let recorded_in = retention::epochs(&client)
        .await?
        .last()
        .context("no epoch")?
        .epoch;
    retention::open_epoch(&client).await?;
    age_epochs(&env, 10).await?;
    env.publish_events(std::slice::from_ref(&event)).await?;

    let (code, text) = prune(&env, &["--older-than", "8d"]).await?;
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("kept every epoch: 1 message(s) wait in the work queue"),
        "{text}"
    );
    assert!(text.contains("no epoch older than the window"), "{text}");
    assert_eq!(epoch_numbers(&env).await?.first(), Some(&recorded_in));

    // A worker takes the copy (a duplicate); then the epoch goes.
    let worker = RunningWorker::start(env.worker_config(Mode::Batch));
    worker.wait_finished(1, Duration::from_secs(20)).await?;
    let stats = worker.stop().await?;
    assert_eq!((stats.applied, stats.duplicates), (0, 1));
    let (code, text) = prune(&env, &["--older-than", "8d"]).await?;
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains(&format!("dropped epoch {recorded_in}")),
        "{text}"
    );
    assert!(!text.contains("kept every epoch"), "{text}");
    Ok(())
}

/// A vhost where no worker has run holds no work queue, so nothing waits
/// there: a prune says so and goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prune_on_a_vhost_where_no_worker_ran_says_there_is_no_queue_yet() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let vhost = crate::support::Vhost::add(".*", ".*", ".*")?;
    let output = tokio::time::timeout(
        crate::support::patient(Duration::from_secs(60)),
        idem_command(&env, &vhost.amqp_url(), &database_url())
            .args(["prune", "--older-than", "8d", "--dry-run"])
            .output(),
    )
    .await??;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(
        text.contains(&format!(
            "there is no work queue {} yet",
            env.topology.queue
        )),
        "{text}"
    );
    assert!(text.contains("a dry run: nothing is changed"), "{text}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_a_retention_prunes_as_it_runs_and_refuses_a_window_too_short()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let mut command = idem_command(&env, &amqp_url(), &database_url());
    command.env(idem::vars::RETENTION, "1d");
    let line = crate::support::worker_exits_at_once_with(command, 2).await?;
    assert!(
        line.contains("--retention: a window of 1d is shorter than --min-retention (7d)"),
        "{line}"
    );

    let client = env.pool.get().await?;
    let second = retention::open_epoch(&client).await?;
    age_epochs(&env, 10).await?;
    let mut command = idem_command(&env, &amqp_url(), &database_url());
    command.args(["worker", "--retention", "8d", "--prune-interval", "100ms"]);
    let worker = WorkerProcess::start(command)?;
    // The first epoch is past the window; the second, current for longer
    // than half of it, is closed and stays.
    wait_for("the worker's pruner", Duration::from_secs(30), || async {
        Ok(epoch_numbers(&env).await? == vec![second, second + 1])
    })
    .await?;
    worker.stop().await?;
    Ok(())
}

/// A session keeps the plans of the claim's statements. Made while the
/// current partition held a few rows, a plan that read it whole would go
/// on doing so as it grows, and the claim would slow down without end: the
/// claim's lookups stay index lookups, however the partition started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_never_reads_a_partition_whole() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let mut client = env.pool.get().await?;
    let current = retention::epochs(&client)
        .await?
        .last()
        .map(|epoch| epoch.epoch)
        .context("no epoch")?;
    let tx = client.transaction().await?;
    // Batches of new ids, each with one id of the batch before (a
    // duplicate, whose digest is looked up): more than the five runs
    // after which a session may keep a generic plan.
    for batch in 0..20 {
        let ids: Vec<String> = (0..200)
            .map(|i| format!("{}-{batch}-{i}", env.name))
            .chain((batch > 0).then(|| format!("{}-{}-0", env.name, batch - 1)))
            .collect();
        let digests: Vec<uuid::Uuid> = ids
            .iter()
            .map(|id| idem::store::digest(GROUP, id))
            .collect();
        tx.query(
            "SELECT mq_claim($1::varchar[], $2::uuid[], $3::varchar)",
            &[&ids, &digests, &GROUP],
        )
        .await?;
    }
    let read: i64 = tx
        .query_one(
            "SELECT coalesce(sum(seq_tup_read), 0)::bigint FROM pg_stat_xact_user_tables \
             WHERE relid = $1::text::regclass",
            &[&format!("mq_consume_record_{current}")],
        )
        .await?
        .get(0);
    tx.rollback().await?;
    assert_eq!(
        read, 0,
        "rows of the current partition read by a sequential scan"
    );
    Ok(())
}
