//! What a handler can do wrong, and what idem makes of it: the failure stays
//! with the one message it belongs to, the others apply, and the worker
//! goes on.

use std::time::Duration;

use idem::handler::{Handler, HandlerError, Invalid, Outbox, Transaction};
use idem::worker::Mode;
use idem_points::points::{PaymentSucceeded, Points};

use crate::support::{RunningWorker, TestEnv, assert_exact, load, wait_for};

/// What goes wrong on the chosen event.
#[derive(Debug, Clone, Copy)]
enum Flaw {
    /// `apply` panics.
    Panics,
    /// `apply` ignores a failed statement and returns `Ok`: the
    /// transaction is aborted, and a commit would roll it back without a word.
    SwallowsAnError,
    /// `apply` says the event can never apply.
    NeverApplies,
}

/// The points effect, through the general path (no tally), with a flaw on
/// one event.
struct Flawed {
    chosen: String,
    flaw: Flaw,
}

impl Handler for Flawed {
    type Event = PaymentSucceeded;

    const NAME: &'static str = "points";

    fn decode(&self, body: &[u8]) -> Result<PaymentSucceeded, Invalid> {
        Points.decode(body)
    }

    fn event_id<'e>(&self, event: &'e PaymentSucceeded) -> &'e str {
        &event.event_id
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        events: &[&PaymentSucceeded],
        outbox: &mut Outbox<'_>,
    ) -> Result<(), HandlerError> {
        Points.apply(tx, events, outbox).await?;
        if events.iter().any(|event| event.event_id == self.chosen) {
            match self.flaw {
                Flaw::Panics => panic!("the flawed handler panics on {}", self.chosen),
                Flaw::SwallowsAnError => {
                    let _ = tx.execute("SELECT 1 / 0", &[]).await;
                }
                Flaw::NeverApplies => {
                    return Err(HandlerError::permanent(format!(
                        "{} was cancelled",
                        self.chosen
                    )));
                }
            }
        }
        Ok(())
    }
}

/// `attempts`: how many times the chosen event is tried before it is
/// dead-lettered.
async fn a_flawed_handler(
    mode: Mode,
    flaw: Flaw,
    last_error: &str,
    attempts: u64,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let good = load(&env, 600, 0.1, 10);
    let chosen = PaymentSucceeded {
        event_id: format!("{}-chosen", env.name),
        order_id: "chosen-order".into(),
        points: 1,
    };
    let mut messages = good.clone();
    messages.insert(300, chosen.clone());
    env.publish_events(&messages).await?;

    let handler = Flawed {
        chosen: chosen.event_id.clone(),
        flaw,
    };
    let worker = RunningWorker::start_with(env.worker_config(mode), handler);
    worker
        .wait_finished(messages.len() as u64, Duration::from_secs(60))
        .await?;
    wait_for(
        "the chosen event in the dead-letter queue",
        Duration::from_secs(20),
        || async { Ok(env.ready(&env.topology.dead_letter_queue).await? == 1) },
    )
    .await?;
    let stats = worker.stop().await?;

    assert_exact(&env, &good, &[chosen.to_body()]).await?;
    assert_eq!(
        (stats.retried, stats.dead_lettered),
        (attempts - 1, 1),
        "{stats:?}"
    );
    let client = env.pool.get().await?;
    let row = client
        .query_one(
            "SELECT failures, last_error FROM mq_failure_ledger WHERE event_id = $1",
            &[&chosen.event_id],
        )
        .await?;
    let (failures, error): (i32, String) = (row.get(0), row.get(1));
    assert_eq!(
        failures, attempts as i32,
        "counted as any failure of the message"
    );
    assert!(error.contains(last_error), "{error}");
    Ok(())
}

async fn a_handler_that_panics_on_one_event_fails_that_event_alone(
    mode: Mode,
) -> anyhow::Result<()> {
    a_flawed_handler(
        mode,
        Flaw::Panics,
        "panicked: the flawed handler panics on",
        5,
    )
    .await
}

async fn a_handler_that_swallows_an_error_cannot_commit_its_events_away(
    mode: Mode,
) -> anyhow::Result<()> {
    a_flawed_handler(
        mode,
        Flaw::SwallowsAnError,
        "current transaction is aborted",
        5,
    )
    .await
}

async fn an_event_the_handler_says_can_never_apply_is_dead_lettered_at_its_first_attempt(
    mode: Mode,
) -> anyhow::Result<()> {
    a_flawed_handler(mode, Flaw::NeverApplies, "-chosen was cancelled", 1).await
}

in_both_modes!(
    a_handler_that_panics_on_one_event_fails_that_event_alone,
    a_handler_that_swallows_an_error_cannot_commit_its_events_away,
    an_event_the_handler_says_can_never_apply_is_dead_lettered_at_its_first_attempt,
);

/// The budget is the event's, not the copy's: a copy published after the
/// event's attempts were spent is dead-lettered without spending another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_arrives_after_its_event_ran_out_of_attempts_spends_no_more()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let chosen = PaymentSucceeded {
        event_id: format!("{}-chosen", env.name),
        order_id: "chosen-order".into(),
        points: 1,
    };
    let config = env.worker_config(Mode::Batch);
    let attempts = u64::from(config.topology.retry.attempts());
    let handler = Flawed {
        chosen: chosen.event_id.clone(),
        flaw: Flaw::SwallowsAnError,
    };
    let worker = RunningWorker::start_with(config, handler);
    let dead = |letters: u32| {
        let env = &env;
        move || async move { Ok(env.ready(&env.topology.dead_letter_queue).await? == letters) }
    };
    env.publish_events(std::slice::from_ref(&chosen)).await?;
    wait_for("the event dead-lettered", Duration::from_secs(30), dead(1)).await?;
    env.publish_events(std::slice::from_ref(&chosen)).await?;
    wait_for(
        "its late copy dead-lettered",
        Duration::from_secs(30),
        dead(2),
    )
    .await?;
    let stats = worker.stop().await?;
    assert_eq!(
        (stats.retried, stats.dead_lettered),
        (attempts - 1, 2),
        "{stats:?}"
    );
    let failures: i32 = env
        .pool
        .get()
        .await?
        .query_one(
            "SELECT failures FROM mq_failure_ledger WHERE event_id = $1",
            &[&chosen.event_id],
        )
        .await?
        .get(0);
    assert_eq!(i64::from(failures), attempts as i64);
    Ok(())
}
