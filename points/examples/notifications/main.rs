//! A downstream service: it consumes the points worker's `points.credited`
//! (`idem worker --credits-exchange points.events`) as a consumer group of
//! its own, and queues one notification per credit, once however often a
//! credit arrives.
//!
//! The points worker sends each credit through its outbox: at least once,
//! every copy under the same idempotency key, derived one to one from the
//! payment event that earned the points. So this handler's deduplication
//! key is that event, `sourceEventId`.
//!
//! ```sh
//! cargo run --example notifications -- migrate
//! cargo run --example notifications -- worker     # until SIGINT/SIGTERM
//! cargo run --example notifications -- --help     # every idem command
//! ```

use std::process::ExitCode;

use idem::broker::Topology;
use idem::handler::{Handler, HandlerError, Invalid, Migration, Outbox, Transaction};
use idem_points::points::{CREDITED_ROUTING_KEY, PointsCredited};

/// Queues a notification per credit.
struct Notifications;

/// A batch's notifications in one statement, in key order. `$1` source
/// events, `$2` orders, `$3` points.
const QUEUE: &str = "\
    INSERT INTO notification (source_event_id, order_id, points) \
    SELECT * FROM unnest($1::varchar[], $2::varchar[], $3::bigint[]) \
    ORDER BY 1";

impl Handler for Notifications {
    type Event = PointsCredited;

    const NAME: &'static str = "notifications";

    const MIGRATIONS: &'static [Migration] = &[Migration {
        version: 1,
        name: "0001_notifications.sql",
        sql: include_str!("0001_notifications.sql"),
    }];

    fn decode(&self, body: &[u8]) -> Result<PointsCredited, Invalid> {
        let credited: PointsCredited = serde_json::from_slice(body)?;
        if credited.order_id.trim().is_empty() || credited.order_id.chars().count() > 64 {
            return Err(Invalid::new("orderId must be 1 to 64 characters"));
        }
        Ok(credited)
    }

    fn event_id<'e>(&self, credited: &'e PointsCredited) -> &'e str {
        &credited.source_event_id
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        credits: &[&PointsCredited],
        _: &mut Outbox<'_>,
    ) -> Result<(), HandlerError> {
        let sources: Vec<&str> = credits.iter().map(|c| c.source_event_id.as_str()).collect();
        let orders: Vec<&str> = credits.iter().map(|c| c.order_id.as_str()).collect();
        let points: Vec<i64> = credits.iter().map(|c| c.points).collect();
        let queue = tx.prepare_cached(QUEUE).await?;
        tx.execute(&queue, &[&sources, &orders, &points]).await?;
        Ok(())
    }
}

fn main() -> ExitCode {
    idem::cli::Service::new(Notifications)
        .topology(
            Topology::for_queue("notifications.points-credited")
                .bound_to("points.events", CREDITED_ROUTING_KEY),
        )
        .consumer_group("notifications")
        .run()
}
