//! The workers sharing an ordered queue's slots (migration 0019): each one
//! says it is alive every few seconds, and reads who else is.

use std::time::Duration;

use super::{Store, StoreError};

const SEEN: &str = "\
    INSERT INTO mq_slot_member (consumer_group, queue, member) VALUES ($1, $2, $3) \
    ON CONFLICT (consumer_group, queue, member) DO UPDATE SET seen_at = now()";

const LIVE: &str = "\
    SELECT member FROM mq_slot_member \
    WHERE consumer_group = $1 AND queue = $2 AND seen_at > now() - $3::float8 * interval '1 millisecond' \
    ORDER BY member";

const GONE: &str = "\
    DELETE FROM mq_slot_member WHERE consumer_group = $1 AND queue = $2 \
    AND (member = $3 OR seen_at < now() - interval '1 day')";

impl Store {
    /// Says that `member` consumes `queue`'s slots now, and returns the
    /// members seen within `alive`, in the order of their ids (`member`
    /// among them).
    pub async fn slot_members(
        &self,
        queue: &str,
        member: uuid::Uuid,
        alive: Duration,
    ) -> Result<Vec<uuid::Uuid>, StoreError> {
        let client = self.pool.get().await?;
        client
            .execute(SEEN, &[&self.consumer_group, &queue, &member])
            .await?;
        let alive = alive.as_secs_f64() * 1000.0;
        let rows = client
            .query(LIVE, &[&self.consumer_group, &queue, &alive])
            .await?;
        Ok(rows.iter().map(|row| row.get(0)).collect())
    }

    /// `member` leaves `queue`'s slots (and members not seen for a day are
    /// forgotten).
    pub async fn leave_slots(&self, queue: &str, member: uuid::Uuid) -> Result<(), StoreError> {
        let client = self.pool.get().await?;
        client
            .execute(GONE, &[&self.consumer_group, &queue, &member])
            .await?;
        Ok(())
    }
}
