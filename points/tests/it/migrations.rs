//! idem's migrations and each handler's, tracked apart; and databases
//! migrated before handlers had migrations of their own.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use idem::handler::{Handler, HandlerError, Invalid, Migration, Outbox, Transaction};
use idem::store::migrate::{self, MIGRATIONS, MigrateError};
use idem::store::{ReadyError, Store};
use idem::worker::Mode;
use idem_points::points::{PaymentSucceeded, Points};

use crate::support::{GROUP, RunningWorker, TestEnv};

/// A schema beside `env`'s, removed when the test ends however it ends.
struct Schema {
    name: String,
    pool: deadpool_postgres::Pool,
}

impl Schema {
    fn beside(env: &TestEnv, suffix: &str) -> anyhow::Result<Self> {
        let name = format!("{}_{suffix}", env.schema);
        let pool = env.database.clone().with_schema(&name).pool()?;
        Ok(Self { name, pool })
    }

    /// A schema beside `env`'s as an older idem's migrate left it: idem's
    /// first `applied` migrations, recorded in its history.
    async fn left_by(env: &TestEnv, suffix: &str, applied: usize) -> anyhow::Result<Self> {
        let schema = Self::beside(env, suffix)?;
        schema
            .sql(&format!(
                "CREATE SCHEMA {name};
                 CREATE TABLE {name}.idem_schema_migrations (
                     version INTEGER PRIMARY KEY, name TEXT NOT NULL,
                     applied_at TIMESTAMPTZ NOT NULL DEFAULT now());",
                name = schema.name
            ))
            .await?;
        for migration in &MIGRATIONS[..applied] {
            schema.sql(migration.sql).await?;
            schema
                .sql(&format!(
                    "INSERT INTO idem_schema_migrations (version, name) VALUES ({}, '{}')",
                    migration.version, migration.name
                ))
                .await?;
        }
        Ok(schema)
    }

    async fn sql(&self, statements: &str) -> anyhow::Result<()> {
        self.pool.get().await?.batch_execute(statements).await?;
        Ok(())
    }

    /// Publishes `events` and runs a worker on this schema until each is
    /// taken; returns how many it applied and how many were duplicates.
    async fn work_through(
        &self,
        env: &TestEnv,
        events: &[PaymentSucceeded],
    ) -> anyhow::Result<(u64, u64)> {
        env.publish_events(events).await?;
        let mut config = env.worker_config(Mode::Batch);
        config.database.schema = Some(self.name.clone());
        let worker = RunningWorker::start(config);
        worker
            .wait_finished(events.len() as u64, Duration::from_secs(20))
            .await?;
        let stats = worker.stop().await?;
        Ok((stats.applied, stats.duplicates))
    }

    /// How many partitions of the consume records have a primary key.
    async fn record_partition_keys(&self) -> anyhow::Result<i64> {
        Ok(self
            .pool
            .get()
            .await?
            .query_one(
                "SELECT count(*) FROM pg_inherits \
                 JOIN pg_constraint ON pg_constraint.conrelid = pg_inherits.inhrelid \
                 WHERE pg_inherits.inhparent = 'mq_consume_record'::regclass \
                   AND pg_constraint.contype = 'p'",
                &[],
            )
            .await?
            .get(0))
    }

    /// The points of `order_id` in this schema.
    async fn points(&self, order_id: &str) -> anyhow::Result<i64> {
        Ok(self
            .pool
            .get()
            .await?
            .query_one(
                "SELECT points FROM user_points WHERE order_id = $1",
                &[&order_id],
            )
            .await?
            .get(0))
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        crate::support::clean_up(crate::support::drop_schema(self.name.clone()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_migrated_before_handlers_had_migrations_moves_forward_keeping_its_data()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    // What idem's migrate left before handlers had migrations: its first
    // two migrations, the first of which created user_points.
    let old = Schema::left_by(&env, "old", 2).await?;
    old.sql(&format!(
        "INSERT INTO user_points VALUES ('order-1', 100);
         INSERT INTO mq_consume_record (event_id, consumer_group) VALUES ('{}-1', '{GROUP}');",
        env.name
    ))
    .await?;

    // This idem's worker will not start on it before `idem migrate`.
    let store = Store::new(old.pool.clone(), GROUP);
    let refused = store
        .wait_until_ready::<Points>(
            "the test database",
            Duration::from_secs(5),
            &CancellationToken::new(),
        )
        .await;
    match refused {
        Err(error @ ReadyError::NotMigrated { .. }) => {
            let line = error.to_string();
            assert!(
                line.contains(&format!(
                    "migration 2 of idem, this idem needs {}",
                    migrate::latest(MIGRATIONS)
                )) && line.contains("run `idem migrate` first"),
                "{line}"
            );
        }
        other => anyhow::bail!("expected NotMigrated, got {other:?}"),
    }

    let applied = migrate::run::<Points>(&old.pool, Some(&old.name)).await?;
    // Then idem's functions, each from its file.
    let (migrations, functions) = applied.split_at(applied.len() - 12);
    assert!(
        functions.iter().all(|name| name.starts_with("functions/")),
        "{applied:?}"
    );
    assert_eq!(
        migrations,
        vec![
            "0003_handler_migrations.sql",
            "0004_outbox.sql",
            "0005_consume_record_epochs.sql",
            "0006_consume_record_digest_key.sql",
            "0007_epoch_filters.sql",
            "0008_claim_fast_paths.sql",
            "0009_claim_one_event.sql",
            "0010_dead_letter_index.sql",
            "0011_dead_letter_summary_tally.sql",
            "0012_closed_epochs_refuse_records.sql",
            "0013_given_up_messages.sql",
            "0014_migration_checksums.sql",
            "0015_console.sql",
            "0016_records_without_id_key.sql",
            "0017_outbox_batches.sql",
            "0018_points_table_leaves_the_baseline.sql",
            "0019_parked_keys.sql",
            "0020_outbox_order_per_key.sql",
            "0021_console_edits.sql",
            "points/0001_user_points.sql"
        ]
    );
    assert_eq!(
        migrate::run::<Points>(&old.pool, Some(&old.name)).await?,
        Vec::<String>::new()
    );

    // Its data is where it was, and the worker goes on from it.
    let first = PaymentSucceeded {
        event_id: format!("{}-1", env.name),
        order_id: "order-1".into(),
        points: 100,
    };
    let second = PaymentSucceeded {
        event_id: format!("{}-2", env.name),
        order_id: "order-1".into(),
        points: 5,
    };
    assert_eq!(old.work_through(&env, &[first, second]).await?, (1, 1));
    assert_eq!(old.points("order-1").await?, 105);

    // No partition of the records keeps a key on `id` (0016), nor does one
    // opened since.
    assert_eq!(old.record_partition_keys().await?, 0);
    old.sql("SELECT mq_open_epoch()").await?;
    assert_eq!(old.record_partition_keys().await?, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_an_epoch_keyed_by_text_still_deduplicate_after_the_digest_key()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    // What idem's migrate left with epochs, before the digest key: its
    // first five migrations, and the records of a worker of then.
    let old = Schema::left_by(&env, "text", 5).await?;
    let id = |n: u32| format!("{}-{n}", env.name);
    old.sql(&format!(
        "INSERT INTO user_points VALUES ('order-1', 100);
         SELECT mq_claim(ARRAY['{}'], '{GROUP}');",
        id(1)
    ))
    .await?;

    let applied = migrate::run::<Points>(&old.pool, Some(&old.name)).await?;
    assert_eq!(applied[0], "0006_consume_record_digest_key.sql");
    // The epoch keyed by text is kept, closed; claims go to one keyed by
    // digest. A claim of an idem from before, computing the digest in SQL,
    // still runs, and the worker's digest is the same.
    let client = old.pool.get().await?;
    let epochs: Vec<(i32, bool)> = client
        .query(
            "SELECT epoch, by_digest FROM mq_consume_epoch ORDER BY epoch",
            &[],
        )
        .await?
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(epochs, vec![(1, false), (2, true)]);
    client
        .batch_execute(&format!("SELECT mq_claim(ARRAY['{}'], '{GROUP}')", id(2)))
        .await?;

    let events: Vec<PaymentSucceeded> = (1..=3)
        .map(|n| PaymentSucceeded {
            event_id: id(n),
            order_id: "order-1".into(),
            points: 5,
        })
        .collect();
    assert_eq!(old.work_through(&env, &events).await?, (1, 2));
    assert_eq!(old.points("order-1").await?, 105);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epochs_closed_before_filters_get_one_and_still_deduplicate() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    // What idem's migrate left with the digest key, before filters: its
    // first six migrations, a record in an epoch since closed, and one in
    // the current epoch, claimed as a worker of then did.
    let old = Schema::left_by(&env, "digest", 6).await?;
    let id = |n: u32| format!("{}-{n}", env.name);
    old.sql(&format!(
        "INSERT INTO user_points VALUES ('order-1', 100);
         SELECT mq_claim(ARRAY['{one}'], ARRAY[mq_digest('{GROUP}', '{one}')], '{GROUP}');
         SELECT mq_open_epoch();
         SELECT mq_claim(ARRAY['{two}'], ARRAY[mq_digest('{GROUP}', '{two}')], '{GROUP}');",
        one = id(1),
        two = id(2)
    ))
    .await?;
    let client = old.pool.get().await?;
    let closed: i32 = client
        .query_one("SELECT max(epoch) - 1 FROM mq_consume_epoch", &[])
        .await?
        .get(0);

    let applied = migrate::run::<Points>(&old.pool, Some(&old.name)).await?;
    assert_eq!(applied[0], "0007_epoch_filters.sql");
    // Every epoch knows where its ids started; a claim of an idem from
    // before still runs.
    let unknown: i64 = client
        .query_one(
            "SELECT count(*) FROM mq_consume_epoch WHERE first_id IS NULL",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(unknown, 0);
    client
        .batch_execute(&format!(
            "SELECT mq_claim(ARRAY['{three}'], ARRAY[mq_digest('{GROUP}', '{three}')], '{GROUP}')",
            three = id(3)
        ))
        .await?;

    // A worker builds the closed epoch's filter, and finds the event there
    // through it.
    let mut config = env.worker_config(Mode::Batch);
    config.database.schema = Some(old.name.clone());
    let worker = RunningWorker::start(config);
    crate::support::wait_for(
        "the closed epoch's filter",
        Duration::from_secs(20),
        || async {
            Ok(client
                .query_opt("SELECT FROM mq_consume_filter WHERE epoch = $1", &[&closed])
                .await?
                .is_some())
        },
    )
    .await?;
    let events: Vec<PaymentSucceeded> = (1..=4)
        .map(|n| PaymentSucceeded {
            event_id: id(n),
            order_id: "order-1".into(),
            points: 5,
        })
        .collect();
    env.publish_events(&events).await?;
    worker.wait_finished(4, Duration::from_secs(20)).await?;
    let stats = worker.stats.snapshot();
    let metrics = worker.stats.encode();
    worker.stop().await?;
    assert_eq!((stats.applied, stats.duplicates), (1, 3));
    assert_eq!(old.points("order-1").await?, 105);
    assert!(
        crate::support::sample(&metrics, "idem_epoch_lookups_total", &[])
            .is_some_and(|lookups| lookups >= 1.0),
        "{metrics}"
    );
    Ok(())
}

/// A handler with migrations of its own: `Notes<N>` is a build of it that
/// knows the migration list `NOTES[N]`.
struct Notes<const N: usize>;

const NOTE_TABLE: Migration = Migration {
    version: 1,
    name: "0001_notes.sql",
    sql: "CREATE TABLE notes (id TEXT PRIMARY KEY)",
};
const NOTE_TEXT: Migration = Migration {
    version: 2,
    name: "0002_note_text.sql",
    sql: "ALTER TABLE notes ADD COLUMN text TEXT",
};
const NOTE_AUTHOR: Migration = Migration {
    version: 3,
    name: "0003_note_author.sql",
    sql: "ALTER TABLE notes ADD COLUMN author TEXT",
};

/// The second migration, edited after it was applied.
const NOTE_TEXT_EDITED: Migration = Migration {
    version: 2,
    name: "0002_note_text.sql",
    sql: "ALTER TABLE notes ADD COLUMN text VARCHAR(200)",
};

/// The builds: with two migrations, with three, one whose list skips a
/// number (a mistake in its code), and one whose second migration was
/// edited.
const NOTES: [&[Migration]; 4] = [
    &[NOTE_TABLE, NOTE_TEXT],
    &[NOTE_TABLE, NOTE_TEXT, NOTE_AUTHOR],
    &[NOTE_TABLE, NOTE_AUTHOR],
    &[NOTE_TABLE, NOTE_TEXT_EDITED, NOTE_AUTHOR],
];
const TWO: usize = 0;
const THREE: usize = 1;
const GAPPED: usize = 2;
const EDITED: usize = 3;

impl<const N: usize> Handler for Notes<N> {
    type Event = String;

    const NAME: &'static str = "notes";

    const MIGRATIONS: &'static [Migration] = NOTES[N];

    fn decode(&self, body: &[u8]) -> Result<String, Invalid> {
        Ok(String::from_utf8(body.to_vec())?)
    }

    fn event_id<'e>(&self, event: &'e String) -> &'e str {
        event
    }

    async fn apply(
        &self,
        _: &Transaction<'_>,
        _: &[&String],
        _: &mut Outbox<'_>,
    ) -> Result<(), HandlerError> {
        Ok(())
    }
}

/// A schema starts without the points handler's table unless the points
/// handler migrates it; a schema an older idem migrated keeps the table it
/// was given, with what it holds, whatever handler migrates it next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_points_handler_gives_a_new_schema_its_table_and_an_old_schema_keeps_it()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let has_points = |schema: &Schema| {
        let pool = schema.pool.clone();
        async move {
            let client = pool.get().await?;
            let row = client
                .query_one("SELECT to_regclass('user_points') IS NOT NULL", &[])
                .await?;
            anyhow::Ok(row.get::<_, bool>(0))
        }
    };
    let notes = Schema::beside(&env, "notes")?;
    migrate::run::<Notes<TWO>>(&notes.pool, Some(&notes.name)).await?;
    assert!(
        !has_points(&notes).await?,
        "a schema for notes has user_points"
    );

    let points = Schema::beside(&env, "pts")?;
    migrate::run::<Points>(&points.pool, Some(&points.name)).await?;
    assert!(
        has_points(&points).await?,
        "a schema for points lacks user_points"
    );

    let old = Schema::left_by(&env, "old", 17).await?;
    old.sql("INSERT INTO user_points VALUES ('order-1', 7)")
        .await?;
    migrate::run::<Notes<TWO>>(&old.pool, Some(&old.name)).await?;
    let client = old.pool.get().await?;
    let kept: i64 = client
        .query_one(
            "SELECT points FROM user_points WHERE order_id = 'order-1'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(kept, 7);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_handler_has_a_migration_history_of_its_own() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let schema = Some(env.schema.as_str());
    assert_eq!(
        migrate::run::<Notes<TWO>>(&env.pool, schema).await?,
        vec!["notes/0001_notes.sql", "notes/0002_note_text.sql"],
        "idem's own are applied already; the handler's are new"
    );
    let client = env.pool.get().await?;
    let histories: Vec<(String, i32)> = client
        .query(
            "SELECT handler::text, version FROM idem_handler_migrations ORDER BY 1, 2",
            &[],
        )
        .await?
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(
        histories,
        vec![
            ("notes".to_owned(), 1),
            ("notes".to_owned(), 2),
            ("points".to_owned(), 1)
        ]
    );

    // A newer build of the handler needs its third: the worker says so.
    let store = Store::new(env.pool.clone(), GROUP);
    let refused = store
        .wait_until_ready::<Notes<THREE>>(
            "the test database",
            Duration::from_secs(5),
            &CancellationToken::new(),
        )
        .await
        .err()
        .map(|error| error.to_string())
        .unwrap_or_default();
    assert!(
        refused.contains("migration 2 of handler notes, this idem needs 3"),
        "{refused}"
    );
    assert_eq!(
        migrate::run::<Notes<THREE>>(&env.pool, schema).await?,
        vec!["notes/0003_note_author.sql"]
    );
    store
        .wait_until_ready::<Notes<THREE>>(
            "the test database",
            Duration::from_secs(5),
            &CancellationToken::new(),
        )
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_whose_migrations_skip_a_number_is_refused_before_anything_runs()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    match migrate::run::<Notes<GAPPED>>(&env.pool, Some(&env.schema)).await {
        Err(error @ MigrateError::Handler { .. }) => {
            assert!(error.to_string().contains("expected 2"), "{error}");
        }
        other => anyhow::bail!("expected a refusal, got {other:?}"),
    }
    let client = env.pool.get().await?;
    let notes: i64 = client
        .query_one(
            "SELECT count(*) FROM idem_handler_migrations WHERE handler = 'notes'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(notes, 0, "not even its first migration was applied");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_index_from_before_the_summary_tally_is_tallied_and_knows_what_was_applied()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    // What idem's migrate left with the dead-letter index, before its
    // summary tally: three rows, one of an event the group applied.
    let old = Schema::left_by(&env, "index", 10).await?;
    let applied = format!("{}-applied", env.name);
    old.sql(&format!(
        "SELECT mq_claim(ARRAY['{applied}'], '{GROUP}');
         INSERT INTO mq_dead_letter (consumer_group, letter_key, event_id, queue, reason, \
             failures, last_error, invalid, copies, dead_at) VALUES \
         ('{GROUP}', 'event {applied}', '{applied}', 'q', 'rejected', 0, NULL, false, 2, now()), \
         ('{GROUP}', 'event e-2', 'e-2', 'q', 'rejected', 3, 'boom', false, 1, now()), \
         ('{GROUP}', 'body 00', NULL, 'q', 'rejected', 0, 'not JSON', true, 1, now()), \
         ('other', 'event e-3', 'e-3', 'q', 'delivery_limit', 0, NULL, false, 4, now());"
    ))
    .await?;

    let migrated = migrate::run::<Points>(&old.pool, Some(&old.name)).await?;
    assert_eq!(migrated[0], "0011_dead_letter_summary_tally.sql");
    let client = old.pool.get().await?;
    let applied_rows: Vec<String> = client
        .query(
            "SELECT letter_key FROM mq_dead_letter WHERE applied ORDER BY 1",
            &[],
        )
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(applied_rows, [format!("event {applied}")]);
    let tally: Vec<(String, String, bool, bool, String, i64)> = client
        .query(
            "SELECT consumer_group, reason, invalid, applied, last_error, letters \
             FROM mq_dead_letter_error_tally ORDER BY 1, 2, 3, 4, 5",
            &[],
        )
        .await?
        .iter()
        .map(|row| {
            (
                row.get(0),
                row.get(1),
                row.get(2),
                row.get(3),
                row.get(4),
                row.get(5),
            )
        })
        .collect();
    let row = |group: &str, reason: &str, invalid, applied, error: &str, letters| {
        (
            group.to_owned(),
            reason.to_owned(),
            invalid,
            applied,
            error.to_owned(),
            letters,
        )
    };
    assert_eq!(
        tally,
        [
            row("other", "delivery_limit", false, false, "", 4),
            row(GROUP, "rejected", false, false, "boom", 1),
            row(GROUP, "rejected", false, true, "", 2),
            row(GROUP, "rejected", true, false, "not JSON", 1),
        ]
    );
    Ok(())
}

/// Each function of `schema` as PostgreSQL prints it, by name and
/// arguments, its schema's name taken out.
async fn function_definitions(schema: &Schema) -> anyhow::Result<Vec<String>> {
    Ok(schema
        .pool
        .get()
        .await?
        .query(
            "SELECT replace(pg_get_functiondef(p.oid), n.nspname || '.', '') \
             FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace \
             WHERE n.nspname = $1 \
             ORDER BY p.proname, pg_get_function_identity_arguments(p.oid)",
            &[&schema.name],
        )
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_from_before_checksums_keeps_its_functions_and_an_edited_migration_is_then_refused()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    // What idem's migrate left before it kept checksums: its first 13
    // migrations, the functions as their CREATE OR REPLACE left them.
    let old = Schema::left_by(&env, "sums", 13).await?;
    let before = function_definitions(&old).await?;
    assert!(before.len() >= 10, "{before:?}");

    let applied = migrate::run::<Points>(&old.pool, Some(&old.name)).await?;
    assert_eq!(
        applied[..9],
        [
            "0014_migration_checksums.sql",
            "0015_console.sql",
            "0016_records_without_id_key.sql",
            "0017_outbox_batches.sql",
            "0018_points_table_leaves_the_baseline.sql",
            "0019_parked_keys.sql",
            "0020_outbox_order_per_key.sql",
            "0021_console_edits.sql",
            "points/0001_user_points.sql"
        ]
    );
    let functions: Vec<&str> = applied[9..].iter().map(String::as_str).collect();
    assert!(
        functions.len() == 12
            && functions.contains(&"functions/mq_claim.sql")
            && functions.iter().all(|name| name.starts_with("functions/")),
        "{applied:?}"
    );
    // sql/functions holds what the migrations had made, to the character,
    // but for mq_open_epoch, whose partitions lost their key on `id` since
    // (0016; and the console's migration adds functions of its own, as
    // acks after standbys do).
    let opens = |definition: &String| definition.contains("FUNCTION mq_open_epoch(");
    let mut after = function_definitions(&old).await?;
    after.retain(|definition| {
        !definition.contains("FUNCTION mq_error_fingerprint(")
            && !definition.contains("FUNCTION mq_dead_letter_groups(")
            && !definition.contains("FUNCTION mq_standbys_have(")
            && !opens(definition)
    });
    let mut before = before;
    before.retain(|definition| !opens(definition));
    assert_eq!(after, before);
    // Every migration has its checksum, those applied before included.
    let client = old.pool.get().await?;
    let unsummed: i64 = client
        .query_one(
            "SELECT (SELECT count(*) FROM idem_schema_migrations WHERE checksum IS NULL) \
                  + (SELECT count(*) FROM idem_handler_migrations WHERE checksum IS NULL)",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(unsummed, 0);
    assert_eq!(
        migrate::run::<Points>(&old.pool, Some(&old.name)).await?,
        Vec::<String>::new()
    );

    // A migration that landed, edited since: refused, and nothing applied.
    client
        .batch_execute(
            "UPDATE idem_schema_migrations SET checksum = md5('edited') WHERE version = 5",
        )
        .await?;
    match migrate::run::<Notes<TWO>>(&old.pool, Some(&old.name)).await {
        Err(error @ MigrateError::Edited { .. }) => {
            let said = error.to_string();
            assert!(
                said.contains("migration 0005_consume_record_epochs.sql of idem")
                    && said.contains("new migration"),
                "{said}"
            );
        }
        other => anyhow::bail!("expected a refusal, got {other:?}"),
    }
    let notes: i64 = client
        .query_one(
            "SELECT count(*) FROM idem_handler_migrations WHERE handler = 'notes'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(notes, 0, "nothing was applied");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_migration_edited_after_it_was_applied_is_refused() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let schema = Some(env.schema.as_str());
    migrate::run::<Notes<TWO>>(&env.pool, schema).await?;
    match migrate::run::<Notes<EDITED>>(&env.pool, schema).await {
        Err(error @ MigrateError::Edited { .. }) => assert!(
            error
                .to_string()
                .contains("migration 0002_note_text.sql of handler notes"),
            "{error}"
        ),
        other => anyhow::bail!("expected a refusal, got {other:?}"),
    }
    // The build that has the applied text goes on.
    assert_eq!(
        migrate::run::<Notes<THREE>>(&env.pool, schema).await?,
        ["notes/0003_note_author.sql"]
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_the_schema_never_had_waits_for_migrate_and_an_older_idem_keeps_a_newer_one()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let schema = Schema::beside(&env, "functions")?;
    migrate::run::<Points>(&schema.pool, Some(&schema.name)).await?;
    let client = schema.pool.get().await?;
    let store = Store::new(schema.pool.clone(), GROUP);
    let never = CancellationToken::new();
    let ready =
        || store.wait_until_ready::<Points>("the test database", Duration::from_secs(5), &never);
    ready().await?;

    // A newer idem replaced the claim since: this one's migrate keeps the
    // newer text, and this one's worker runs on it.
    client
        .batch_execute(
            "INSERT INTO idem_schema_functions (name, checksum) VALUES ('mq_claim', md5('newer'))",
        )
        .await?;
    assert_eq!(
        migrate::run::<Points>(&schema.pool, Some(&schema.name)).await?,
        Vec::<String>::new()
    );
    ready().await?;

    // A build whose claim the schema never had: its worker waits for its
    // migrate, which applies the claim.
    client
        .batch_execute("DELETE FROM idem_schema_functions WHERE name = 'mq_claim'")
        .await?;
    let refused = ready()
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        refused.contains("holds an older definition of mq_claim than this idem: run `")
            && refused.contains("migrate` first"),
        "{refused}"
    );
    assert_eq!(
        migrate::run::<Points>(&schema.pool, Some(&schema.name)).await?,
        ["functions/mq_claim.sql"]
    );
    ready().await?;
    Ok(())
}
