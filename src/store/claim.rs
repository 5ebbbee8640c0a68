//! The consume record: `INSERT … ON CONFLICT DO NOTHING` decides which
//! delivery owns an event's effect.

use super::ledger;
use crate::handler::Tally;

/// The `claimed` step: a consume record for each event id of `$1`
/// (distinct) in consumer group `$2` (`mq_claim`: in the current epoch,
/// for the ids no epoch holds, in id order so that concurrent batches take
/// the unique index's locks in one order). Yields the ids that went in; an
/// id it does not yield was recorded before (or by a concurrent transaction
/// that committed first): a duplicate.
const CLAIMED: &str = "\
    claimed AS (\
        SELECT claim.event_id FROM mq_claim($1::varchar[], $2::varchar) AS claim(event_id))";

/// The event ids of `$1` recorded for consumer group `$2`: applied already.
pub(super) const RECORDED: &str = "\
    SELECT event_id FROM mq_consume_record \
    WHERE consumer_group = $2 AND event_id = ANY($1::varchar[])";

/// The claim of a transaction whose effect the handler applies afterwards,
/// in the same transaction. Parameters as for [`CLAIMED`].
pub(super) fn claim_statement() -> String {
    format!("WITH {CLAIMED} SELECT event_id FROM claimed")
}

/// Claim, ledger clear and a [`Tally`]'s effect as one statement: a
/// statement is a transaction of its own, so this is one round trip and one
/// commit per batch. `$1` event ids (distinct), `$2` the consumer group,
/// `$3` the tally's keys and `$4` its amounts, index for index with `$1`;
/// yields the event ids that went in. The tally's names must be plain
/// identifiers (checked when the statement is built for a worker). Public
/// for tools that measure it (`idem bench --pgbench`).
pub fn claim_and_tally_statement<E>(tally: &Tally<E>) -> String {
    claim_tally_then(tally, "")
}

/// [`claim_and_tally_statement`], and the outbox rows of the events that
/// went in: `$5`…`$11` as [`super::outbox::Rows`].
pub(super) fn claim_tally_and_send_statement<E>(tally: &Tally<E>) -> String {
    claim_tally_then(tally, &format!("{}, ", super::outbox::sent_step(5)))
}

/// The claim and tally statement with `steps` (each ending in `, `) added.
fn claim_tally_then<E>(tally: &Tally<E>, steps: &str) -> String {
    let Tally {
        table, key, amount, ..
    } = tally;
    format!(
        "WITH {CLAIMED}, {cleared}, {steps}\
         tallied AS (\
            INSERT INTO {table} ({key}, {amount}) \
            SELECT batch.tally_key, sum(batch.tally_amount)::bigint \
            FROM unnest($1::varchar[], $3::varchar[], $4::bigint[]) \
                AS batch(event_id, tally_key, tally_amount) \
            JOIN claimed USING (event_id) \
            GROUP BY batch.tally_key ORDER BY batch.tally_key \
            {upsert}) \
         SELECT event_id FROM claimed",
        cleared = ledger::CLEARED,
        upsert = upsert(tally),
    )
}

/// A [`Tally`]'s effect alone, inside a transaction: `$1` keys, `$2` amounts.
pub(super) fn tally_statement<E>(tally: &Tally<E>) -> String {
    let Tally {
        table, key, amount, ..
    } = tally;
    format!(
        "INSERT INTO {table} ({key}, {amount}) \
         SELECT batch.tally_key, sum(batch.tally_amount)::bigint \
         FROM unnest($1::varchar[], $2::bigint[]) AS batch(tally_key, tally_amount) \
         GROUP BY batch.tally_key ORDER BY batch.tally_key \
         {}",
        upsert(tally)
    )
}

/// The statements of the general path for a tally's effect, in order
/// (inside BEGIN … COMMIT): the claim (`$1` event ids, `$2` the group), the
/// effect (`$1` keys, `$2` amounts), the ledger clear (as the claim). For
/// tools that measure it (`idem bench --pgbench`).
pub(crate) fn general_path_statements<E>(tally: &Tally<E>) -> [String; 3] {
    [
        claim_statement(),
        tally_statement(tally),
        ledger::RESET.to_owned(),
    ]
}

/// Rows are updated in key order, so that concurrent batches cannot
/// deadlock on each other's rows.
fn upsert<E>(tally: &Tally<E>) -> String {
    let Tally {
        table, key, amount, ..
    } = tally;
    format!("ON CONFLICT ({key}) DO UPDATE SET {amount} = {table}.{amount} + EXCLUDED.{amount}")
}
