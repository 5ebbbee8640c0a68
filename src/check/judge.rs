//! A check's steps and its judgement: the references, each run, and what
//! is compared after it (the tables, the outbox, idem's own accounts, the
//! invariants and the witness).

use std::collections::{BTreeMap, HashMap};

use deadpool_postgres::GenericClient;
use futures::{StreamExt, TryStreamExt};
use tokio::time::Instant;

use super::{
    Check, CheckError, Decoded, Equivalence, Event, Fates, Lookup, OUTGOING_LOOKED_AT, Observed,
    Plan, Rig, RunReport, SHOWN, Scratch, Tables, capture, collide, fates_of, reference, runs,
    state,
};
use crate::CheckReport;
use crate::handler::{Handler, message_id};

impl<G: Handler, F: Fn() -> G + Send + Sync> Check<'_, F> {
    pub(super) async fn everything(
        &self,
        decoded: &Decoded<G::Event>,
    ) -> Result<CheckReport, CheckError> {
        let config = self.config;
        let events: Vec<&Event<G::Event>> = decoded.events.iter().collect();
        let mut report = CheckReport {
            messages: config.events.len(),
            events: events.len(),
            invalid: decoded.invalid,
            ..CheckReport::default()
        };
        let lookup_events: Vec<(String, &[u8])> = events
            .iter()
            .map(|event| (event.id.clone(), event.body.as_slice()))
            .collect();
        let lookup = Lookup {
            events: &lookup_events,
        };

        let keys = &decoded.keys;
        let keyed: Vec<(&str, &str)> = events
            .iter()
            .filter_map(|event| {
                let key = keys.get(&event.body)?;
                Some((key.as_str(), event.id.as_str()))
            })
            .collect();

        let capture = self.capture(&events).await?;
        let from = report.runs.len();
        let (tables, expected) = self.references(&events, &lookup, &mut report).await?;
        attribute(capture.as_ref(), &mut report, from).await?;
        let reference = (!report.order_matters).then_some(&expected);
        if report.order_matters && !keyed.is_empty() {
            let from = report.runs.len();
            self.keys_backwards(&events, keys, &tables, &expected, &lookup, &mut report)
                .await?;
            attribute(capture.as_ref(), &mut report, from).await?;
        }
        let ordered_reference =
            (!report.order_matters || report.order_within_keys_only).then_some(&expected);

        // Events that name a same row side by side, as hot rows put them
        // in production's batches.
        let placed: Vec<collide::Placed<'_>> = events
            .iter()
            .map(|event| collide::Placed {
                body: &event.body,
                key: keys.get(&event.body).map(String::as_str),
            })
            .collect();
        let order = collide::side_by_side(&placed, &expected.state.row_names());
        let side_by_side: Vec<&Event<G::Event>> = order.iter().map(|&at| events[at]).collect();
        let load = collide::bodies_in_order(&config.events, &placed, &order);

        // Batch equivalence, on two cuts of the events.
        let at = report.runs.len();
        report.runs.push(
            self.equivalence(&side_by_side, &tables, reference, &lookup)
                .await?,
        );
        attribute(capture.as_ref(), &mut report, at).await?;

        // The real worker, under every fault.
        let bodies: Vec<(String, Vec<u8>)> = events
            .iter()
            .map(|event| (event.id.clone(), event.body.clone()))
            .collect();
        let rig = Rig {
            amqp: &config.amqp,
            upstream: self.upstream,
            connection: self.connection,
            make: self.make,
            consumer_group: &config.consumer_group,
            prefix: &self.queue_prefix(),
            bodies: &load,
            events: &bodies,
            keys,
            keyed: &keyed,
            max_attempts: config.max_attempts,
            seed: config.seed,
            patience: config.patience,
        };
        let ordered = !keys.is_empty();
        for plan in runs::plans(config.copies, config.batch_size, config.seed, ordered) {
            let reference = if plan.slots > 0 {
                ordered_reference
            } else {
                reference
            };
            let row = self
                .worker_run(&rig, &plan, &events, &tables, reference, &lookup)
                .await;
            let at = report.runs.len();
            report.runs.push(row?);
            attribute(capture.as_ref(), &mut report, at).await?;
        }
        Ok(report)
    }

    /// A queue bound to the service's outgoing exchanges (on a direct one,
    /// to the routing keys the events' outbox messages use), emptied before
    /// the first reference.
    async fn capture(
        &self,
        events: &[&Event<G::Event>],
    ) -> Result<Option<capture::Capture>, CheckError> {
        let handler = (self.make)();
        let mut direct_keys = BTreeMap::<String, std::collections::BTreeSet<String>>::new();
        for event in events {
            for message in handler.outgoing(&event.event) {
                direct_keys
                    .entry(message.exchange)
                    .or_default()
                    .insert(message.routing_key);
            }
        }
        let queue = format!("{}.outgoing", self.queue_prefix());
        let capture =
            capture::Capture::start(self.connection, queue, &self.config.outgoing, &direct_keys)
                .await?;
        if let Some(capture) = &capture {
            capture.taken().await?;
        }
        Ok(capture)
    }

    /// The references: the events one at a time in the file's order, which
    /// also finds the tables to compare; again, which tells the columns
    /// the events do not decide (left out from then on, and a failure);
    /// and reversed, which tells whether the order matters. Their rows go
    /// into `report`; the shape of the comparisons and the reference come
    /// back.
    pub(super) async fn references(
        &self,
        events: &[&Event<G::Event>],
        lookup: &Lookup<'_>,
        report: &mut CheckReport,
    ) -> Result<(Tables, Observed), CheckError> {
        let config = self.config;
        let started = Instant::now();
        let first = self.scratch("reference", 2).await?;
        let client = first
            .pool
            .get()
            .await
            .map_err(|error| CheckError::Failed(error.into()))?;
        let mut tables = state::tables(&client, &first.schema, &config.ignore_columns).await?;
        self.validate_queries(&client).await?;
        drop(client);
        let fates = self.one_at_a_time(&first, events).await?;
        let mut expected = self.observe(&first, &tables, Some(fates.clone())).await?;
        let mut first_row = self.row(
            "reference · the file's order",
            events,
            &expected,
            None,
            lookup,
        );
        first_row.seconds = started.elapsed().as_secs_f64();

        // The same order again: what differs is not the events' doing.
        let started = Instant::now();
        let again = self.scratch("again", 2).await?;
        let again_fates = self.one_at_a_time(&again, events).await?;
        let repeated = self.observe(&again, &tables, Some(again_fates)).await?;
        let mut unstable = state::differences(&expected.state, &repeated.state);
        report.unstable = state::unstable(&expected.state, &repeated.state);
        let mut again_row = self.row(
            "reference · the file's order, again",
            events,
            &repeated,
            None,
            lookup,
        );
        again_row.diverged = Some(unstable.len());
        lookup.name(&mut unstable, SHOWN);
        let rows = unstable.iter().map(ToString::to_string).collect();
        again_row.findings.extend(first_few(rows, "rows", ""));
        again_row.seconds = started.elapsed().as_secs_f64();
        if !unstable.is_empty() {
            // Compared from here on without them, so that what else differs shows.
            let mut ignore = config.ignore_columns.clone();
            ignore.extend(
                report
                    .unstable
                    .iter()
                    .filter(|column| !column.ends_with(')'))
                    .cloned(),
            );
            let client = first
                .pool
                .get()
                .await
                .map_err(|error| CheckError::Failed(error.into()))?;
            tables = state::tables(&client, &first.schema, &ignore).await?;
            drop(client);
            expected = self.observe(&first, &tables, Some(fates)).await?;
            first_row = RunReport {
                seconds: first_row.seconds,
                ..self.row(
                    "reference · the file's order",
                    events,
                    &expected,
                    None,
                    lookup,
                )
            };
        }
        report.left_out = tables.left_out.clone();
        // The check's own, not the team's: labelled as such.
        for left_out in &mut report.left_out {
            if report.unstable.contains(&left_out.column)
                && !config.ignore_columns.contains(&left_out.column)
            {
                left_out.why = state::Why::Unstable;
            }
        }
        report.tables = tables.names();
        report.runs.push(first_row);
        report.runs.push(again_row);

        self.reversed(events, &tables, &expected, lookup, report)
            .await?;
        Ok((tables, expected))
    }

    /// The reference in reverse order, which tells whether the order
    /// matters; its row goes into `report`.
    async fn reversed(
        &self,
        events: &[&Event<G::Event>],
        tables: &Tables,
        expected: &Observed,
        lookup: &Lookup<'_>,
        report: &mut CheckReport,
    ) -> Result<(), CheckError> {
        let started = Instant::now();
        let reversed_events: Vec<&Event<G::Event>> = events.iter().rev().copied().collect();
        let (reversed, mut order, fate_changes) = self
            .in_another_order("reversed", &reversed_events, tables, expected)
            .await?;
        report.order_matters = !order.is_empty() || !fate_changes.is_empty();
        let mut reversed_row = self.row("reference · reversed", events, &reversed, None, lookup);
        if report.order_matters {
            reversed_row.findings.push(format!(
                "the effect depends on the order of the events ({} rows and {} events' fates differ \
                 from the file's order): the runs are judged by the invariants, the witness and \
                 idem's accounts, not by the reference's rows",
                order.len(),
                fate_changes.len()
            ));
            reversed_row
                .findings
                .extend(first_few(fate_changes, "events", ""));
            lookup.name(&mut order, SHOWN);
            let rows = order.iter().map(ToString::to_string).collect();
            reversed_row.findings.extend(first_few(rows, "rows", ""));
        }
        reversed_row.seconds = started.elapsed().as_secs_f64();
        report.runs.push(reversed_row);
        Ok(())
    }

    /// The reference with the keys interleaved backwards, each key's
    /// events in their order (those without a key reversed too), which
    /// tells whether the order matters only within a key; its row goes
    /// into `report`.
    async fn keys_backwards(
        &self,
        events: &[&Event<G::Event>],
        keys: &HashMap<Vec<u8>, String>,
        tables: &Tables,
        expected: &Observed,
        lookup: &Lookup<'_>,
        report: &mut CheckReport,
    ) -> Result<(), CheckError> {
        let started = Instant::now();
        let backwards = keys_backwards(events, |event| keys.get(&event.body));
        let (observed, rows, fate_changes) = self
            .in_another_order("keys_backwards", &backwards, tables, expected)
            .await?;
        report.order_within_keys_only = rows.is_empty() && fate_changes.is_empty();
        let mut row = self.row(
            "reference · keys interleaved backwards",
            events,
            &observed,
            None,
            lookup,
        );
        row.findings.push(if report.order_within_keys_only {
            "the effect depends on the order only within each key: the runs on an ordered queue \
             are compared with the reference's rows"
                .to_owned()
        } else {
            format!(
                "the effect depends on the order across keys too ({} rows and {} events' fates \
                 differ): the runs on an ordered queue are judged as the others",
                rows.len(),
                fate_changes.len()
            )
        });
        row.seconds = started.elapsed().as_secs_f64();
        report.runs.push(row);
        Ok(())
    }

    /// `events` applied one at a time, in their order, on a schema of
    /// their own (`run`): what they left, and its rows and fates that
    /// differ from `expected`.
    async fn in_another_order(
        &self,
        run: &str,
        events: &[&Event<G::Event>],
        tables: &Tables,
        expected: &Observed,
    ) -> Result<(Observed, Vec<state::Difference>, Vec<String>), CheckError> {
        let scratch = self.scratch(run, 2).await?;
        let fates = self.one_at_a_time(&scratch, events).await?;
        let observed = self.observe(&scratch, tables, Some(fates)).await?;
        let rows = state::differences(&expected.state, &observed.state);
        let fates = fate_differences(&expected.fates, &observed.fates);
        Ok((observed, rows, fates))
    }

    /// `events` applied one at a time on `scratch`, in their order.
    pub(super) async fn one_at_a_time(
        &self,
        scratch: &Scratch,
        events: &[&Event<G::Event>],
    ) -> Result<Fates, CheckError> {
        reference::one_at_a_time(scratch, (self.make)(), &self.config.consumer_group, events).await
    }

    /// A schema of the check's own for `run`, migrated and set up.
    pub(super) async fn scratch(&self, run: &str, pool_size: usize) -> Result<Scratch, CheckError> {
        Scratch::create::<G>(
            &self.config.database,
            format!("{}_{run}", self.prefix),
            self.config.setup.as_deref(),
            pool_size,
        )
        .await
    }

    /// Runs every invariant and the witness once on a fresh schema: a query
    /// that cannot run is a usage error, said before any run.
    pub(super) async fn validate_queries(
        &self,
        client: &impl GenericClient,
    ) -> Result<(), CheckError> {
        for (place, invariant) in self.config.invariants.iter().enumerate() {
            client
                .query(&invariant_query(invariant), &[])
                .await
                .map_err(|error| {
                    CheckError::Usage(format!(
                        "--invariant {} cannot run: {}",
                        place + 1,
                        crate::store::describe(&error)
                    ))
                })?;
        }
        if let Some(witness) = &self.config.witness {
            let cannot = |why: String| CheckError::Usage(format!("--witness cannot run: {why}"));
            let statement = client
                .prepare(witness)
                .await
                .map_err(|error| cannot(crate::store::describe(&error)))?;
            if statement.params().len() != 1 {
                return Err(cannot(format!(
                    "it must take the event id as $1, its one parameter (it takes {})",
                    statement.params().len()
                )));
            }
            witness_count(client, witness, "").await.map_err(cannot)?;
        }
        Ok(())
    }

    /// What `scratch` holds after a run: its tables, the events' fates
    /// (those given, or idem's records and dead letters), and what is
    /// doubled, lost or breaks an invariant.
    pub(super) async fn observe(
        &self,
        scratch: &Scratch,
        tables: &Tables,
        fates: Option<Fates>,
    ) -> Result<Observed, CheckError> {
        let config = self.config;
        let client = scratch
            .pool
            .get()
            .await
            .map_err(|error| CheckError::Failed(error.into()))?;
        let client = &client;
        let ids = &self.ids;
        let fates = match fates {
            Some(fates) => fates,
            None => fates_of(client, &config.consumer_group, ids).await?,
        };
        let state = tables.state(client).await?;
        let read =
            |error: tokio_postgres::Error| CheckError::database("reading a run's accounts", &error);
        let mut doubled = BTreeMap::new();
        let records = client
            .query(
                "SELECT event_id::text, count(*) FROM mq_consume_record \
                 WHERE consumer_group = $1 GROUP BY event_id HAVING count(*) > 1",
                &[&config.consumer_group],
            )
            .await
            .map_err(read)?;
        for row in records {
            let count: i64 = row.get(1);
            doubled.insert(row.get(0), format!("{count} consume records"));
        }
        let mut lost = BTreeMap::new();
        for id in ids {
            if !fates.applied.contains(*id) && !fates.dead.contains_key(*id) {
                lost.insert(
                    (*id).to_owned(),
                    "neither applied nor dead-lettered".to_owned(),
                );
            }
        }
        if let Some(witness) = &config.witness {
            let counts = witness_counts(client, witness, ids)
                .await
                .map_err(|error| CheckError::Failed(format!("--witness: {error}").into()))?;
            for (id, count) in ids.iter().zip(counts) {
                let expected = i64::from(fates.applied.contains(*id));
                if count > expected {
                    let what = if expected == 0 {
                        format!("the witness counts {count} though idem did not apply it")
                    } else {
                        format!("the witness counts {count}")
                    };
                    doubled.entry((*id).to_owned()).or_insert(what);
                } else if count < expected {
                    lost.entry((*id).to_owned())
                        .or_insert_with(|| "applied, but the witness counts 0".to_owned());
                }
            }
        }
        for (id, what) in self.outbox_doubled(client).await? {
            doubled.entry(id).or_insert(what);
        }
        let mut violations = (0, Vec::new());
        for (place, invariant) in config.invariants.iter().enumerate() {
            let rows = client
                .query(&invariant_query(invariant), &[])
                .await
                .map_err(read)?;
            violations.0 += rows.len();
            for row in rows.iter().take(SHOWN) {
                let text: Option<String> = row.get(0);
                violations.1.push(format!(
                    "invariant {} returned {}",
                    place + 1,
                    text.unwrap_or_default()
                ));
            }
        }
        Ok(Observed {
            state,
            fates,
            doubled,
            lost,
            violations,
        })
    }

    /// The events whose messages are in the outbox more than once (the
    /// check's workers relay nothing): their idempotency keys are derived
    /// from the event, so a key twice is an effect twice.
    pub(super) async fn outbox_doubled(
        &self,
        client: &impl GenericClient,
    ) -> Result<Vec<(String, String)>, CheckError> {
        let twice = client
            .query(
                "SELECT message_id, count(*) FROM mq_outbox_message GROUP BY 1 HAVING count(*) > 1",
                &[],
            )
            .await
            .map_err(|error| CheckError::database("reading the outbox", &error))?;
        if twice.is_empty() {
            return Ok(Vec::new());
        }
        let group = &self.config.consumer_group;
        let keys: HashMap<uuid::Uuid, &str> = self
            .ids
            .iter()
            .flat_map(|id| {
                (0..OUTGOING_LOOKED_AT).map(move |index| (message_id(group, id, index), *id))
            })
            .collect();
        Ok(twice
            .iter()
            .map(|row| {
                let (key, count): (uuid::Uuid, i64) = (row.get(0), row.get(1));
                let what = format!("its message {key} is in the outbox {count} times");
                let event = keys
                    .get(&key)
                    .map_or_else(|| format!("message {key}"), |id| (*id).to_owned());
                (event, what)
            })
            .collect())
    }

    /// A run's row of the report: its counts, and what it found wrong,
    /// compared with `reference` when there is one to compare with.
    pub(super) fn row(
        &self,
        name: &str,
        events: &[&Event<G::Event>],
        observed: &Observed,
        reference: Option<&Observed>,
        lookup: &Lookup<'_>,
    ) -> RunReport {
        let mut row = RunReport {
            name: name.to_owned(),
            events: events.len(),
            applied: observed.fates.applied.len(),
            dead_lettered: observed.fates.dead.len(),
            doubled: observed.doubled.len(),
            lost: observed.lost.len(),
            violations: observed.violations.0,
            ..RunReport::default()
        };
        let listed = |events: &BTreeMap<String, String>| {
            events
                .iter()
                .take(SHOWN)
                .map(|(id, how)| format!("{id} ({how})"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if !observed.doubled.is_empty() {
            row.findings
                .push(format!("doubled: {}", listed(&observed.doubled)));
        }
        if !observed.lost.is_empty() {
            row.findings
                .push(format!("lost: {}", listed(&observed.lost)));
        }
        row.findings.extend(observed.violations.1.iter().cloned());
        if let Some(reference) = reference {
            let mut rows = state::differences(&reference.state, &observed.state);
            let fates = fate_differences(&reference.fates, &observed.fates);
            row.diverged = Some(rows.len() + fates.len());
            lookup.name(&mut rows, SHOWN);
            row.findings.extend(first_few(fates, "events", ""));
            let rows = rows.iter().map(ToString::to_string).collect();
            row.findings.extend(first_few(rows, "rows", ""));
        }
        row
    }

    /// Batch equivalence on two cuts of the events: from the first one, and
    /// from half a batch in, so that two neighbours of the file share a
    /// batch in one of them.
    pub(super) async fn equivalence(
        &self,
        events: &[&Event<G::Event>],
        tables: &Tables,
        reference: Option<&Observed>,
        lookup: &Lookup<'_>,
    ) -> Result<RunReport, CheckError> {
        let started = Instant::now();
        let size = self.config.batch_size;
        let handler = (self.make)();
        let mut row = RunReport::default();
        let (mut batches, mut unequal, mut shown) = (0, 0, 0);
        for (cut, offset) in [("batches", 0), ("batches_half", size / 2)] {
            let scratch = self.scratch(cut, 1).await?;
            let found: Equivalence = reference::batch_equivalence(
                &scratch,
                &handler,
                &self.config.consumer_group,
                tables,
                events,
                (size, offset),
            )
            .await?;
            batches += found.batches;
            unequal += found.unequal.len();
            let observed = self.observe(&scratch, tables, Some(found.fates)).await?;
            let judged = self.row("", events, &observed, reference, lookup);
            if offset == 0 {
                row = judged;
            } else {
                row.doubled = row.doubled.max(judged.doubled);
                row.lost = row.lost.max(judged.lost);
                row.violations = row.violations.max(judged.violations);
                row.diverged = row.diverged.zip(judged.diverged).map(|(a, b)| a.max(b));
                row.findings.extend(judged.findings);
            }
            for batch in found.unequal.iter().take(SHOWN.saturating_sub(shown)) {
                let named: Vec<&str> = batch.batch.iter().take(8).map(String::as_str).collect();
                let more = if batch.batch.len() > named.len() {
                    ", …"
                } else {
                    ""
                };
                row.findings.push(format!(
                    "{} (a batch of {}: {}{more})",
                    batch.how,
                    batch.batch.len(),
                    named.join(", ")
                ));
                if let Some((alone, whole)) = &batch.rows {
                    let mut differences = state::differences(alone, whole);
                    lookup.name(&mut differences, SHOWN);
                    let rows = differences
                        .iter()
                        .map(|difference| format!("one at a time vs whole: {difference}"))
                        .collect();
                    row.findings.extend(first_few(rows, "rows", "  "));
                }
            }
            shown += found.unequal.len().min(SHOWN.saturating_sub(shown));
        }
        if unequal > shown {
            row.findings
                .push(format!("… and {} more batches", unequal - shown));
        }
        row.name =
            format!("batch equivalence ({batches} batches of {size}, two cuts, rows together)");
        row.diverged = Some(row.diverged.unwrap_or(0) + unequal);
        row.seconds = started.elapsed().as_secs_f64();
        Ok(row)
    }

    /// One run on the real worker, judged.
    pub(super) async fn worker_run(
        &self,
        rig: &Rig<'_, F>,
        plan: &Plan,
        events: &[&Event<G::Event>],
        tables: &Tables,
        reference: Option<&Observed>,
        lookup: &Lookup<'_>,
    ) -> Result<RunReport, CheckError> {
        let started = Instant::now();
        let pool_size = 2;
        let scratch = self.scratch(&plan.slug, pool_size).await?;
        let ran = rig.run(plan, &scratch).await;
        let mut row = match ran {
            Ok(ran) => {
                let observed = self.observe(&scratch, tables, None).await?;
                let mut row = self.row(&plan.name, events, &observed, reference, lookup);
                row.duplicates = Some(ran.duplicates);
                row.strikes = Some(ran.strikes);
                row.inconclusive = inconclusive(plan, &ran);
                if plan.slots > 0 {
                    let out_of_order =
                        out_of_order(&scratch, &self.config.consumer_group, rig.keyed).await?;
                    row.out_of_order = out_of_order.len();
                    row.findings
                        .extend(first_few(out_of_order, "keys out of order", ""));
                }
                let cut = matches!(
                    plan.fault,
                    runs::Fault::CutDatabase | runs::Fault::CutCommit
                );
                if ran.retried > 0 && !cut {
                    let (count, verb) = match ran.retried {
                        1 => ("1 transaction".to_owned(), "was"),
                        n => (format!("{n} transactions"), "were"),
                    };
                    row.findings.push(format!(
                        "note: {count} {verb} refused by the database for a while and ran again \
                         (a deadlock or a lock timeout): right, but slow; lock the rows a batch \
                         touches in a stable order"
                    ));
                }
                row
            }
            // A run that did not settle is a finding, not the end of the check.
            Err(CheckError::Failed(error)) => RunReport {
                name: plan.name.clone(),
                events: events.len(),
                error: Some(error.to_string()),
                ..RunReport::default()
            },
            Err(error) => return Err(error),
        };
        row.seconds = started.elapsed().as_secs_f64();
        Ok(row)
    }
}

/// Why the run `plan` that `ran` so proved nothing, if it did not: its
/// fault never struck, or its copies met no event applied already.
fn inconclusive(plan: &Plan, ran: &runs::Ran) -> Option<String> {
    if plan.fault != runs::Fault::None && ran.strikes == 0 {
        return Some(match plan.fault {
            runs::Fault::Kill(runs::Moment::MidBatch) => {
                "no batch of several events went one by one, so no worker died mid-batch".to_owned()
            }
            _ => "its fault never struck".to_owned(),
        });
    }
    // A commit the worker did not hear of comes back as duplicates.
    if plan.fault == runs::Fault::CutCommit && ran.duplicates == 0 {
        return Some(
            "no commit went through unheard: none of the transactions cut came back as duplicates"
                .to_owned(),
        );
    }
    if plan.load.repeats.copies > 1 && ran.duplicates == 0 {
        return Some("no copy met an event applied already".to_owned());
    }
    None
}

/// What reached the outgoing exchanges since the last look, charged to
/// the row `at` of `report` (the first of the step that ran meanwhile).
async fn attribute(
    capture: Option<&capture::Capture>,
    report: &mut CheckReport,
    at: usize,
) -> Result<(), CheckError> {
    let Some(capture) = capture else {
        return Ok(());
    };
    let captured = capture.taken().await?;
    let Some(row) = report.runs.get_mut(at) else {
        return Ok(());
    };
    if let Some((exchange, routing_key)) = &captured.first {
        row.sent_outside += captured.messages;
        row.findings.push(format!(
            "sent outside idem's outbox: {} message(s) reached the outgoing exchanges while this              ran (the first to {exchange} with routing key {routing_key:?}), though a check              relays nothing: the handler sends them itself, and sends again when a transaction              rolls back or runs again; send them through the Outbox (or, if another publisher              shares this vhost, check on a vhost of your own)",
            captured.messages
        ));
    }
    Ok(())
}

/// The first [`SHOWN`] of `items` (each after `indent`), then how many
/// more `what` there are.
pub(super) fn first_few(items: Vec<String>, what: &str, indent: &str) -> Vec<String> {
    let more = items.len().saturating_sub(SHOWN);
    let mut few: Vec<String> = items
        .into_iter()
        .take(SHOWN)
        .map(|item| format!("{indent}{item}"))
        .collect();
    if more > 0 {
        few.push(format!("{indent}… and {more} more {what}"));
    }
    few
}

/// The events applied in one and dead-lettered in the other.
pub(super) fn fate_differences(expected: &Fates, found: &Fates) -> Vec<String> {
    let mut differences = Vec::new();
    for (id, error) in &found.dead {
        if expected.applied.contains(id) {
            differences.push(format!(
                "{id}: applied in the reference, dead-lettered here ({error})"
            ));
        }
    }
    for (id, error) in &expected.dead {
        if found.applied.contains(id) {
            differences.push(format!(
                "{id}: dead-lettered in the reference ({error}), applied here"
            ));
        }
    }
    differences
}

/// An invariant as a query of one JSON text column per row it returns.
pub(super) fn invariant_query(sql: &str) -> String {
    let sql = sql.trim().trim_end_matches(';');
    format!("SELECT to_jsonb(violation)::text FROM ({sql}) violation")
}

/// What the witness counts for each of `ids`, in their order: one
/// statement, its executions sent without waiting for each answer.
pub(super) async fn witness_counts(
    client: &impl GenericClient,
    witness: &str,
    ids: &[&str],
) -> Result<Vec<i64>, String> {
    let statement = client
        .prepare(witness)
        .await
        .map_err(|error| crate::store::describe(&error))?;
    futures::stream::iter(ids)
        .map(|id| {
            let statement = &statement;
            async move {
                let row = client
                    .query_one(statement, &[id])
                    .await
                    .map_err(|error| crate::store::describe(&error))?;
                count_of(&row)
            }
        })
        .buffered(64)
        .try_collect()
        .await
}

/// The count a witness returned.
pub(super) fn count_of(row: &tokio_postgres::Row) -> Result<i64, String> {
    row.try_get::<_, i64>(0)
        .or_else(|_| row.try_get::<_, i32>(0).map(i64::from))
        .map_err(|_| "it must return one row of one integer (count(*), say)".to_owned())
}

/// What the witness counts for `event_id`.
pub(super) async fn witness_count(
    client: &impl GenericClient,
    witness: &str,
    event_id: &str,
) -> Result<i64, String> {
    let row = client
        .query_one(witness, &[&event_id])
        .await
        .map_err(|error| crate::store::describe(&error))?;
    count_of(&row)
}

/// The keys of `keyed` (each key and event id, in the order they were
/// sent) whose applied events did not apply in that order, as the
/// transactions that recorded them began, each with the first two events
/// that show it. (A key's events in one transaction apply in their order,
/// in rounds; its next transaction begins after that one commits.)
pub(super) async fn out_of_order(
    scratch: &Scratch,
    consumer_group: &str,
    keyed: &[(&str, &str)],
) -> Result<Vec<String>, CheckError> {
    let read =
        |error: tokio_postgres::Error| CheckError::database("reading a run's records", &error);
    let client = scratch
        .pool
        .get()
        .await
        .map_err(|error| CheckError::Failed(error.into()))?;
    let rows = client
        .query(
            "SELECT event_id::text, consumed_at FROM mq_consume_record WHERE consumer_group = $1",
            &[&consumer_group],
        )
        .await
        .map_err(read)?;
    let mut applied_at = HashMap::new();
    for row in rows {
        let id: String = row.try_get(0).map_err(read)?;
        let at: std::time::SystemTime = row.try_get(1).map_err(read)?;
        applied_at.insert(id, at);
    }
    Ok(keys_out_of_order(keyed, &applied_at))
}

/// The keys of `keyed` whose events' times in `applied_at` go back, each
/// with the first two events that show it.
fn keys_out_of_order<T: Ord + Copy>(
    keyed: &[(&str, &str)],
    applied_at: &HashMap<String, T>,
) -> Vec<String> {
    // Per key, the last applied event seen so far, in the order sent.
    let mut last: HashMap<&str, (&str, T)> = HashMap::new();
    let mut broken: Vec<String> = Vec::new();
    let mut told = std::collections::HashSet::new();
    for &(key, id) in keyed {
        let Some(&at) = applied_at.get(id) else {
            continue;
        };
        if let Some(&(before, before_at)) = last.get(key)
            && at < before_at
            && told.insert(key)
        {
            broken.push(format!(
                "key {key}: {id} applied before {before}, which was sent before it"
            ));
        }
        last.insert(key, (id, at));
    }
    broken
}

/// `events` backwards, except that each key's events keep their order:
/// each key's places in the reversed list take its events in their order.
pub(super) fn keys_backwards<'e, E, K: Eq + std::hash::Hash>(
    events: &[&'e E],
    key_of: impl Fn(&E) -> Option<K>,
) -> Vec<&'e E> {
    let reversed: Vec<&'e E> = events.iter().rev().copied().collect();
    let mut in_order: HashMap<K, std::collections::VecDeque<&'e E>> = HashMap::new();
    for &event in events {
        if let Some(key) = key_of(event) {
            in_order.entry(key).or_default().push_back(event);
        }
    }
    reversed
        .into_iter()
        .map(|event| {
            key_of(event)
                .and_then(|key| in_order.get_mut(&key)?.pop_front())
                .unwrap_or(event)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_backwards_reverses_the_keys_and_keeps_each_key_s_order() {
        let events = ["a1", "b1", "x", "a2", "c1", "b2", "y"];
        let refs: Vec<&&str> = events.iter().collect();
        let key = |event: &&str| (event.len() == 2).then(|| event.as_bytes()[0]);
        let backwards: Vec<&str> = keys_backwards(&refs, key).into_iter().copied().collect();
        assert_eq!(backwards, ["y", "b1", "c1", "a1", "x", "b2", "a2"]);
    }

    #[test]
    fn a_key_whose_later_event_applied_first_is_out_of_order_once() {
        let keyed = [
            ("a", "a1"),
            ("b", "b1"),
            ("a", "a2"),
            ("b", "b2"),
            ("a", "a3"),
            ("b", "b3"),
        ];
        // b2 never applied; a's third and second in one transaction.
        let at = [("a1", 1), ("a2", 5), ("a3", 5), ("b1", 4), ("b3", 2)];
        let at: HashMap<String, i32> = at.iter().map(|(id, t)| ((*id).to_owned(), *t)).collect();
        assert_eq!(
            keys_out_of_order(&keyed, &at),
            ["key b: b3 applied before b1, which was sent before it"]
        );
        let swapped: HashMap<String, i32> = at.into_iter().map(|(id, t)| (id, -t)).collect();
        assert_eq!(
            keys_out_of_order(&keyed, &swapped),
            ["key a: a2 applied before a1, which was sent before it"]
        );
    }
}
