//! The business effect of the reference handler: an order's points go up.

/// The `earned` step of the apply statement: adds the points of the events
/// that `claimed` yielded, summed per order, updating orders in `order_id`
/// order so that concurrent batches cannot deadlock on each other's rows.
/// `$1`, `$3` and `$4` are the batch's event ids, order ids and points,
/// index for index.
pub(super) const EARNED: &str = "\
    earned AS (\
        INSERT INTO user_points (order_id, points) \
        SELECT batch.order_id, sum(batch.points)::bigint \
        FROM unnest($1::varchar[], $3::varchar[], $4::bigint[]) AS batch(event_id, order_id, points) \
        JOIN claimed USING (event_id) \
        GROUP BY batch.order_id ORDER BY batch.order_id \
        ON CONFLICT (order_id) DO UPDATE SET points = user_points.points + EXCLUDED.points)";
