//! The report as text: a table of the medians of the rounds, and the ratios.

use super::*;

impl BenchReport {
    /// The median over the rounds of what `pick` reads of `mode`'s runs.
    fn median_of(&self, mode: &str, pick: fn(&Measurement) -> Option<f64>) -> Option<f64> {
        self.runs(mode)
            .and_then(|runs| median(runs.iter().filter_map(pick)))
    }

    /// The outbox against what publishing alone allows: batch mode with the
    /// outbox on against its bound, `1 / (1 / off + credits per message /
    /// credits published alone per second)` (a relay costing exactly what
    /// publishing its messages alone costs), round by round; the relay's
    /// whole-process CPU per credit (outbox on less off) against
    /// publishing's (the publisher's and RabbitMQ's); WAL on against off.
    fn outbox_against_its_bound(
        &self,
        f: &mut fmt::Formatter<'_>,
        rates: &dyn Fn(&str) -> Vec<f64>,
    ) -> fmt::Result {
        let credits = self.credits_per_message;
        if credits <= 0.0 {
            return Ok(());
        }
        let (on, off, alone) = (rates(BATCH_OUTBOX), rates(BATCH), rates(PUBLISHED_ALONE));
        let of_bound = median(
            on.iter()
                .zip(&off)
                .zip(&alone)
                .map(|((on, off), alone)| on * (1.0 / off + credits / alone)),
        );
        let bound = median(
            off.iter()
                .zip(&alone)
                .map(|(off, alone)| 1.0 / (1.0 / off + credits / alone)),
        );
        if let (Some(of_bound), Some(bound)) = (of_bound, bound) {
            writeln!(
                f,
                "batch, outbox on / its bound ({bound:.0} msgs/s: off, and {credits:.2} credits \
                 a message published alone): {of_bound:.2} ×"
            )?;
        }
        let of = |mode, pick| self.median_of(mode, pick);
        if let (Some(on), Some(off), Some(worker), Some(rabbitmq)) = (
            of(BATCH_OUTBOX, Measurement::all_cpu_us_per_message),
            of(BATCH, Measurement::all_cpu_us_per_message),
            of(PUBLISHED_ALONE, |m| m.cpu_us_per_message),
            of(PUBLISHED_ALONE, |m| m.rabbitmq_us_per_message),
        ) {
            let relayed = (on - off) / credits;
            let alone = worker + rabbitmq;
            writeln!(
                f,
                "all-process CPU per credit: relayed {relayed:.1} µs (outbox on less off), \
                 published alone {alone:.1} µs (publisher and RabbitMQ): {:.2} ×",
                relayed / alone
            )?;
        }
        if let (Some(on), Some(off)) = (
            of(BATCH_OUTBOX, |m| m.wal_bytes_per_message),
            of(BATCH, |m| m.wal_bytes_per_message),
        ) {
            writeln!(f, "WAL per message, outbox on / off: {:.2} ×", on / off)?;
        }
        Ok(())
    }
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "idem bench: {}", self.settings)?;
        let rates = |mode: &str| -> Vec<f64> {
            self.runs(mode)
                .map(|runs| runs.iter().map(|m| m.rate).collect())
                .unwrap_or_default()
        };
        // Ratios are taken within each round, then their median: the
        // machine's speed drifts between rounds, much less within one.
        let ratio =
            |over: &[f64], under: &[f64]| median(over.iter().zip(under).map(|(a, b)| a / b));
        let ceiling = rates(CEILING);
        writeln!(
            f,
            "{:<42} {:>10} {:>10} {:>11} {:>13} {:>13} {:>13} {:>11} {:>6} {:>10} {:>10}",
            "mode (medians of the rounds)",
            "msgs/s",
            "× ceiling",
            "worker CPU",
            "worker peak",
            "PostgreSQL",
            "RabbitMQ",
            "all CPU",
            "cores",
            "WAL",
            "WAL full"
        )?;
        writeln!(
            f,
            "{:<42} {:>10} {:>10} {:>11} {:>13} {:>13} {:>13} {:>11} {:>6} {:>10} {:>10}",
            "",
            "",
            "",
            "µs/msg",
            "RSS MiB",
            "CPU µs/msg",
            "CPU µs/msg",
            "µs/msg",
            "busy",
            "B/msg",
            "pages/msg"
        )?;
        for (mode, runs) in &self.rounds {
            let mode = mode.as_str();
            let median_of =
                |pick: fn(&Measurement) -> Option<f64>| median(runs.iter().filter_map(pick));
            let rate = median_of(|m| Some(m.rate)).unwrap_or(0.0);
            let of_ceiling = ratio(&rates(mode), &ceiling);
            let show = |value: Option<f64>, precision: usize| {
                value.map_or("-".to_owned(), |v| format!("{v:.precision$}"))
            };
            writeln!(
                f,
                "{:<42} {:>10.0} {:>10} {:>11} {:>13} {:>13} {:>13} {:>11} {:>6} {:>10} {:>10}",
                label(mode),
                rate,
                show(of_ceiling, 2),
                show(median_of(|m| m.cpu_us_per_message), 1),
                show(median_of(|m| m.peak_rss_mib), 1),
                show(median_of(|m| m.postgres_us_per_message), 1),
                show(median_of(|m| m.rabbitmq_us_per_message), 1),
                show(median_of(Measurement::all_cpu_us_per_message), 1),
                show(median_of(Measurement::cores_busy), 2),
                show(median_of(|m| m.wal_bytes_per_message), 0),
                show(median_of(|m| m.wal_fpi_per_message), 3),
            )?;
        }
        if let Some(times) = ratio(&rates(BATCH), &rates(PER_MESSAGE)) {
            writeln!(f, "batch / per-message: {times:.1} ×")?;
        }
        for (ordered, unordered) in [(PER_MESSAGE_ORDERED, PER_MESSAGE), (BATCH_ORDERED, BATCH)] {
            if let Some(times) = ratio(&rates(ordered), &rates(unordered)) {
                writeln!(f, "{} / unordered: {times:.2} ×", label(ordered))?;
            }
        }
        for (waiting, at_commit) in [(PER_MESSAGE_STANDBYS, PER_MESSAGE), (BATCH_STANDBYS, BATCH)] {
            if let Some(times) = ratio(&rates(waiting), &rates(at_commit)) {
                writeln!(f, "{} / acked at commit: {times:.2} ×", label(waiting))?;
            }
        }
        if let Some(times) = ratio(&rates(BATCH_POISONED), &rates(BATCH_ORDERED)) {
            writeln!(
                f,
                "batch, ordered: every other key's throughput with one key poisoned / none: {times:.3} × \
                 (a cost of {:.1} %)",
                (1.0 - times) * 100.0
            )?;
        }
        if let Some(times) = ratio(&rates(BATCH_OUTBOX), &rates(BATCH)) {
            writeln!(f, "batch, outbox on / off: {times:.2} ×")?;
        }
        let rabbitmq = |mode| self.median_of(mode, |m| m.rabbitmq_us_per_message);
        if let (Some(on), Some(off), Some(alone)) = (
            rabbitmq(BATCH_OUTBOX),
            rabbitmq(BATCH),
            rabbitmq(PUBLISHED_ALONE),
        ) && self.credits_per_message > 0.0
        {
            let relayed = (on - off) / self.credits_per_message;
            writeln!(
                f,
                "RabbitMQ CPU per credit: relayed {relayed:.1} µs (outbox on less off), \
                 published alone {alone:.1} µs ({:.2} ×)",
                relayed / alone
            )?;
        }
        self.outbox_against_its_bound(f, &rates)?;
        let all_cpu = |mode: &str| -> Vec<f64> {
            self.runs(mode)
                .map(|runs| {
                    runs.iter()
                        .filter_map(Measurement::all_cpu_us_per_message)
                        .collect()
                })
                .unwrap_or_default()
        };
        for (idem, contender) in [(PER_MESSAGE, TEXTBOOK), (BATCH, BATCHED)] {
            if let Some(throughput) = ratio(&rates(idem), &rates(contender)) {
                let against = label(contender)
                    .split_once(", ")
                    .map_or(contender, |(_, c)| c);
                write!(
                    f,
                    "{} / {against}: throughput {throughput:.2} ×",
                    label(idem)
                )?;
                if let Some(cpu) = ratio(&all_cpu(idem), &all_cpu(contender)) {
                    write!(f, ", all-process CPU per message {cpu:.2} ×")?;
                }
                writeln!(f)?;
            }
        }
        for (mode, _) in &self.rounds {
            if let Some(times) = mode
                .strip_suffix(REMOVING)
                .and_then(|without| ratio(&rates(mode), &rates(without)))
            {
                writeln!(f, "{} / without: {times:.2} ×", label(mode))?;
                continue;
            }
            if [TEXTBOOK, BATCHED].contains(&mode.as_str()) {
                continue;
            }
            for plain in [PER_MESSAGE, PER_MESSAGE_BASELINE, BATCH, BATCH_BASELINE] {
                if let Some(times) = mode
                    .strip_prefix(plain)
                    // A prefilled run of that build, not another build.
                    .filter(|rest| {
                        rest.strip_prefix(", ")
                            .and_then(|rest| rest.strip_suffix(" records before"))
                            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
                    })
                    .and_then(|_| ratio(&rates(mode), &rates(plain)))
                {
                    writeln!(f, "{} / on an empty table: {times:.2} ×", label(mode))?;
                }
            }
        }
        let cpu = |mode: &str| -> Vec<f64> {
            self.runs(mode)
                .map(|runs| runs.iter().filter_map(|m| m.cpu_us_per_message).collect())
                .unwrap_or_default()
        };
        for (build, baseline) in [
            (PER_MESSAGE, PER_MESSAGE_BASELINE),
            (BATCH, BATCH_BASELINE),
            (BATCH_OUTBOX, BATCH_OUTBOX_BASELINE),
        ] {
            if let (Some(throughput), Some(worker_cpu)) = (
                ratio(&rates(build), &rates(baseline)),
                ratio(&cpu(build), &cpu(baseline)),
            ) {
                writeln!(
                    f,
                    "{} / baseline build: throughput {throughput:.3} ×, worker CPU per message {worker_cpu:.3} ×",
                    label(build)
                )?;
            }
        }
        let tps = |runs: &[Pgbench]| runs.iter().map(|run| run.tps).collect::<Vec<_>>();
        let postgres = |runs: &[Pgbench]| median(runs.iter().filter_map(|run| run.postgres_us));
        for (name, runs) in [
            (
                "per-message transaction (the claim straight into the current epoch and the tally in one statement)",
                &self.pgbench,
            ),
            (
                "the same as the general path's five statements",
                &self.pgbench_general,
            ),
            (
                "the textbook transaction (BEGIN, record, upsert, COMMIT)",
                &self.pgbench_textbook,
            ),
        ] {
            if let Some(rate) = median(tps(runs).into_iter()) {
                let cpu = postgres(runs).map_or("-".to_owned(), |us| format!("{us:.0}"));
                writeln!(
                    f,
                    "pgbench, 16 clients, {name}: {rate:.0} tps, PostgreSQL CPU {cpu} µs/tx"
                )?;
            }
        }
        if let Some(times) = ratio(&rates(PER_MESSAGE), &tps(&self.pgbench)) {
            writeln!(
                f,
                "per-message mode / pgbench of its transaction: {times:.2} ×"
            )?;
        }
        if let Some(times) = ratio(&tps(&self.pgbench), &tps(&self.pgbench_textbook)) {
            writeln!(
                f,
                "pgbench, idem's transaction / the textbook's: {times:.2} × the tps"
            )?;
        }
        let cpu_ratio = median(
            self.pgbench
                .iter()
                .zip(&self.pgbench_textbook)
                .filter_map(|(idem, textbook)| Some(idem.postgres_us? / textbook.postgres_us?)),
        );
        if let Some(times) = cpu_ratio {
            writeln!(
                f,
                "pgbench, idem's transaction / the textbook's: {times:.2} × the PostgreSQL CPU"
            )?;
        }
        let rounds = self
            .rounds
            .iter()
            .map(|(_, runs)| runs.len())
            .max()
            .unwrap_or(0);
        write!(
            f,
            "rounds: {rounds}; every run checked: exact totals, one record per event, nothing dead-lettered"
        )?;
        if self.runs(BATCH_POISONED).is_some() {
            write!(
                f,
                " (with one key poisoned: every other key so, the poisoned one parked, none of its events applied)"
            )?;
        }
        Ok(())
    }
}
