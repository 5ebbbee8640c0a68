//! The business effect of the reference handler: an order's points go up.

use deadpool_postgres::Transaction;

use crate::event::PaymentSucceeded;

/// Adds points per order, summed; orders are updated in `order_id` order so
/// that concurrent transactions cannot deadlock on each other's rows.
const ADD: &str = "\
    INSERT INTO user_points (order_id, points) \
    SELECT order_id, sum(points)::bigint \
    FROM unnest($1::varchar[], $2::bigint[]) AS earned(order_id, points) \
    GROUP BY order_id ORDER BY order_id \
    ON CONFLICT (order_id) DO UPDATE SET points = user_points.points + EXCLUDED.points";

pub(super) async fn add(
    tx: &Transaction<'_>,
    events: &[&PaymentSucceeded],
) -> Result<(), tokio_postgres::Error> {
    if events.is_empty() {
        return Ok(());
    }
    let order_ids: Vec<&str> = events.iter().map(|e| e.order_id.as_str()).collect();
    let points: Vec<i64> = events.iter().map(|e| e.points).collect();
    let statement = tx.prepare_cached(ADD).await?;
    tx.execute(&statement, &[&order_ids, &points]).await?;
    Ok(())
}
