//! The consume record: `INSERT … ON CONFLICT DO NOTHING` decides which
//! delivery owns an event's effect.

use sha2::{Digest, Sha256};
use uuid::Uuid;

#[cfg(doc)]
use super::filter::Consulted;
use super::ledger;
use crate::handler::Tally;

/// The `claimed` step: a consume record for each event id of `$1`
/// (distinct) in consumer group `$2`, `$3` their [`digest`]s index for
/// index (`mq_claim`: in the current epoch, for the ids no epoch holds, in
/// digest order so that concurrent batches take the unique index's locks
/// in one order), `$4`…`$7` what the closed epochs' filters said of them
/// ([`Consulted`]). Yields the ids that went in; an id it does not yield
/// was recorded before (or by a concurrent transaction that committed
/// first): a duplicate. An id whose digest another one holds fails the
/// statement.
const CLAIMED: &str = "\
    claimed AS (\
        SELECT claim.event_id \
        FROM mq_claim($1::varchar[], $3::uuid[], $2::varchar, \
                      $4::int[], $5::timestamptz[], $6::int[], $7::int[]) AS claim(event_id))";

/// Which of `event_ids` consumer group `consumer_group` recorded: applied
/// already.
pub async fn recorded(
    client: &impl deadpool_postgres::GenericClient,
    consumer_group: &str,
    event_ids: &[&str],
) -> Result<std::collections::HashSet<String>, tokio_postgres::Error> {
    let statement = client
        .prepare_cached("SELECT event_id FROM mq_recorded($1::varchar[], $2::varchar)")
        .await?;
    client
        .query(&statement, &[&event_ids, &consumer_group])
        .await?
        .iter()
        .map(|row| row.try_get(0))
        .collect()
}

/// The key of an event's consume record in `consumer_group` (`mq_digest`
/// in SQL): the first 16 bytes of the SHA-256 of the group, a zero byte
/// and the event id. Computed here, it costs the database nothing.
pub fn digest(consumer_group: &str, event_id: &str) -> Uuid {
    let hash = Sha256::new()
        .chain_update(consumer_group)
        .chain_update([0])
        .chain_update(event_id)
        .finalize();
    let mut bytes = [0; 16];
    bytes.copy_from_slice(&hash[..16]);
    Uuid::from_bytes(bytes)
}

/// The [`digest`]s of `event_ids`, index for index: the claim's `$3`.
pub(super) fn digests(consumer_group: &str, event_ids: &[&str]) -> Vec<Uuid> {
    event_ids
        .iter()
        .map(|id| digest(consumer_group, id))
        .collect()
}

/// The claim of a transaction whose effect the handler applies afterwards,
/// in the same transaction. Parameters as for [`CLAIMED`].
pub(super) fn claim_statement() -> String {
    format!("WITH {CLAIMED} SELECT event_id FROM claimed")
}

/// Claim, ledger clear (with `clear_ledger`) and a [`Tally`]'s effect as
/// one statement: a statement is a transaction of its own, so this is one
/// round trip and one commit per batch. `$1`…`$7` as for the claim (event
/// ids, distinct, the consumer group, their [`digest`]s, what the filters
/// said), `$8` the tally's keys and `$9` its amounts, index for index with
/// `$1`; yields the event ids that went in. The tally's names must be
/// plain identifiers (checked when the statement is built for a worker).
/// Public for tools that measure it (`idem bench --pgbench`).
pub fn claim_and_tally_statement<E>(tally: &Tally<E>, clear_ledger: bool) -> String {
    claim_tally_then(tally, clear_ledger, "")
}

/// [`claim_and_tally_statement`], and the outbox rows of the events that
/// went in: `$10`…`$17` as [`super::outbox::Rows`].
pub(super) fn claim_tally_and_send_statement<E>(tally: &Tally<E>, clear_ledger: bool) -> String {
    claim_tally_then(
        tally,
        clear_ledger,
        &format!("{}, ", super::outbox::sent_step(10)),
    )
}

/// The claim and tally statement with `steps` (each ending in `, `) added.
fn claim_tally_then<E>(tally: &Tally<E>, clear_ledger: bool, steps: &str) -> String {
    let Tally {
        table, key, amount, ..
    } = tally;
    let cleared = if clear_ledger {
        format!("{}, ", ledger::CLEARED)
    } else {
        String::new()
    };
    format!(
        "WITH {CLAIMED}, {cleared}{steps}\
         tallied AS (\
            INSERT INTO {table} ({key}, {amount}) \
            SELECT batch.tally_key, sum(batch.tally_amount)::bigint \
            FROM unnest($1::varchar[], $8::varchar[], $9::bigint[]) \
                AS batch(event_id, tally_key, tally_amount) \
            JOIN claimed USING (event_id) \
            GROUP BY batch.tally_key ORDER BY batch.tally_key \
            {upsert}) \
         SELECT event_id FROM claimed",
        upsert = tally.upsert(),
    )
}

/// The claim of one event straight into the epoch `$4`, without
/// `mq_claim` (for a worker whose filters cover every closed epoch and say
/// none holds the event), and a [`Tally`]'s effect of it, as one statement: `$1` the event id, `$2` the consumer group, `$3`
/// its [`digest`], `$5` the tally's key, `$6` its amount. Yields the event
/// id if it went in. Nothing in: a duplicate, or another event holds its
/// digest, which `mq_claim` tells apart. A closed epoch refuses the record
/// (`check_violation`). No ledger clear: for first deliveries. Public for
/// tools that measure it (`idem bench --pgbench`).
pub fn straight_claim_and_tally_statement<E>(tally: &Tally<E>) -> String {
    let Tally {
        table, key, amount, ..
    } = tally;
    format!(
        "WITH claimed AS (\
            INSERT INTO mq_consume_record AS record (event_id, consumer_group, digest, epoch) \
            VALUES ($1::varchar, $2::varchar, $3::uuid, $4::int) \
            ON CONFLICT DO NOTHING \
            RETURNING record.event_id), \
         tallied AS (\
            INSERT INTO {table} ({key}, {amount}) \
            SELECT $5::varchar, $6::bigint FROM claimed \
            {upsert}) \
         SELECT event_id FROM claimed",
        upsert = tally.upsert(),
    )
}

/// The statements of the general path for a tally's effect, in order
/// (inside BEGIN … COMMIT): the claim (`$1` event ids, `$2` the group, `$3`
/// their digests, `$4`…`$7` what the filters said), the effect (`$1` keys,
/// `$2` amounts), the ledger clear (`$1` and `$2` as the claim). For tools that measure it (`idem bench
/// --pgbench`).
#[doc(hidden)]
pub fn general_path_statements<E>(tally: &Tally<E>) -> [String; 3] {
    [
        claim_statement(),
        tally.statement(),
        ledger::RESET.to_owned(),
    ]
}

/// `statement` (one of the claims above, ending in `SELECT event_id FROM
/// claimed`) committing without waiting for its WAL flush: for a store
/// whose lanes flush for it ([`super::Lanes`]). The setting is the
/// transaction's own (`set_config(…, true)`), set as the first event that
/// went in is read; a transaction in which none went in has written no
/// consume record, and commits as any does.
pub(super) fn unflushed(statement: &str) -> String {
    debug_assert!(statement.ends_with("SELECT event_id FROM claimed"));
    format!("{statement} WHERE set_config('synchronous_commit', 'off', true) IS NOT NULL")
}

/// Rows are updated in key order, so that concurrent batches cannot
/// deadlock on each other's rows.
#[cfg(test)]
mod tests {
    use super::*;

    /// The values `mq_digest` gives (migration 0006): a record claimed by
    /// SQL and one claimed here must share their key.
    #[test]
    fn the_digest_is_the_one_sql_computes() {
        for (group, id, sql) in [
            ("points", "pay-1", "99770f1f-0e5b-bb69-9fc7-6107f5ab7c0e"),
            ("", "", "6e340b9c-ffb3-7a98-9ca5-44e6bb780a2c"),
            ("grüppe", "é", "0428f540-d6d7-0f4e-5816-83f5a905dbe6"),
        ] {
            assert_eq!(digest(group, id).to_string(), sql, "{group:?} {id:?}");
        }
    }

    #[test]
    fn the_group_and_the_id_are_kept_apart() {
        assert_ne!(digest("ab", "c"), digest("a", "bc"));
    }
}
