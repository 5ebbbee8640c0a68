//! The transactions `--pgbench` runs under pgbench: per-message mode's
//! statement, the general path's, and the textbook transaction.

use super::*;

/// The first lines of a pgbench script: a fresh event id, a random order.
pub(super) const PGBENCH_VARIABLES: &str =
    "\\set event random(1, 1000000000000)\n\\set order random(1, :orders)\n";
/// One event, one order and 7 points, as the statements' parameters.
pub(super) const PGBENCH_EVENT_IDS: &str = "ARRAY['pgbench-' || :event]::varchar[]";
pub(super) const PGBENCH_GROUP: &str = "'pgbench'";
pub(super) const PGBENCH_ORDERS: &str = "ARRAY['order-' || :order]::varchar[]";
pub(super) const PGBENCH_POINTS: &str = "ARRAY[7]::bigint[]";
/// The event's digest, as the worker computes it.
pub(super) const PGBENCH_DIGESTS: &str = "ARRAY[mq_digest('pgbench', 'pgbench-' || :event)]";

/// A claim without filters (pgbench's schema has no closed epoch to look
/// into).
pub(super) fn unfiltered(statement: &str) -> String {
    [
        ("$4::int[]", "'{}'::int[]"),
        ("$5::timestamptz[]", "'{}'::timestamptz[]"),
        ("$6::int[]", "'{}'::int[]"),
        ("$7::int[]", "'{}'::int[]"),
    ]
    .iter()
    .fold(statement.to_owned(), |statement, (param, none)| {
        statement.replace(param, none)
    })
}

/// Per-message mode's transaction, as pgbench runs it: what the worker
/// runs for a first delivery of one event when no closed epoch may hold
/// it, its claim straight into the current epoch (`epoch`) and the points
/// tally in one statement.
pub(super) fn pgbench_script(epoch: i32) -> String {
    let tally = Points.tally().unwrap_or(points::POINTS);
    let statement = idem::store::straight_claim_and_tally_statement(&tally)
        .replace("$1::varchar", "('pgbench-' || :event)::varchar")
        .replace(
            "$3::uuid",
            "mq_digest('pgbench', 'pgbench-' || :event)::uuid",
        )
        .replace("$2::varchar", &format!("{PGBENCH_GROUP}::varchar"))
        .replace("$4::int", &format!("{epoch}::int"))
        .replace("$5::varchar", "('order-' || :order)::varchar")
        .replace("$6::bigint", "7::bigint");
    format!("{PGBENCH_VARIABLES}{statement};\n")
}

/// The transactions `--pgbench` runs, each on a schema of its own.
#[derive(Debug, Clone, Copy)]
pub(super) enum PgbenchScript {
    /// Per-message mode's: the claim straight into the current epoch with
    /// the tally, one statement.
    Tally,
    /// The general path's five statements.
    General,
    /// The textbook's: BEGIN, record, upsert, COMMIT.
    Textbook,
}

/// The same work as the general path does it, for a handler without a
/// tally: BEGIN, the claim, the effect, the ledger clear, COMMIT.
pub(super) fn pgbench_general_script() -> String {
    let [claim, effect, clear] = idem::store::general_path_statements(&points::POINTS);
    let claim = claim
        .replace("$1::varchar[]", PGBENCH_EVENT_IDS)
        .replace("$3::uuid[]", PGBENCH_DIGESTS)
        .replace("$2", PGBENCH_GROUP);
    let claim = unfiltered(&claim);
    let effect = effect
        .replace("$2::bigint[]", PGBENCH_POINTS)
        .replace("$1::varchar[]", PGBENCH_ORDERS);
    let clear = clear
        .replace("$1::varchar[]", PGBENCH_EVENT_IDS)
        .replace("$2", PGBENCH_GROUP);
    format!("{PGBENCH_VARIABLES}BEGIN;\n{claim};\n{effect};\n{clear};\nCOMMIT;\n")
}

/// The tables of the textbook transaction, beside idem's in the bench's
/// schema (removed with it): a consume record keyed by the event id, and
/// points per order as idem's handler keeps them.
pub(super) const PGBENCH_TEXTBOOK_TABLES: &str = "\
    CREATE TABLE IF NOT EXISTS textbook_consumed (event_id VARCHAR(64) PRIMARY KEY); \
    CREATE TABLE IF NOT EXISTS textbook_points (\
        order_id VARCHAR(64) PRIMARY KEY, points BIGINT NOT NULL DEFAULT 0) \
        WITH (fillfactor = 50);";

/// The transaction a team writes by hand for one message: BEGIN, the
/// consume record, the upsert, COMMIT (an ack follows it).
pub(super) const PGBENCH_TEXTBOOK: &str = "\
\\set event random(1, 1000000000000)
\\set order random(1, :orders)
BEGIN;
INSERT INTO textbook_consumed (event_id) VALUES ('pgbench-' || :event) ON CONFLICT DO NOTHING;
INSERT INTO textbook_points (order_id, points) VALUES ('order-' || :order, 7) \
ON CONFLICT (order_id) DO UPDATE SET points = textbook_points.points + EXCLUDED.points;
COMMIT;
";
