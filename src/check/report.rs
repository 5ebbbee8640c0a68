//! What a check says: a table of its runs like the lab's, what each found
//! wrong, and a verdict in one line; or the same as JSON, for CI.

use std::fmt;

use serde::Serialize;

use super::state::LeftOut;

/// Everything a check found.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct CheckReport {
    /// Message bodies given.
    pub messages: usize,
    /// Distinct valid events among them.
    pub events: usize,
    /// Bodies the handler cannot decode (each run dead-letters them).
    pub invalid: usize,
    /// The handler's tables, compared row by row (the outbox is too).
    pub tables: Vec<String>,
    /// Columns left out of the comparisons, and why.
    pub left_out: Vec<LeftOut>,
    /// Columns the reference sets differently when run twice in the same
    /// order (a clock, a random value, state kept in memory): each fails
    /// the check until the handler stops it or it is left out.
    pub unstable: Vec<String>,
    /// Whether the effect depends on the order of the events: the runs are
    /// then judged by the invariants, the witness and idem's accounts, not
    /// by the reference's rows.
    pub order_matters: bool,
    /// Whether the effect depends on the order only within each ordering
    /// key (the events applied with the keys interleaved backwards, each
    /// key's in its order, end where the file's order did): the runs on an
    /// ordered queue are then compared with the reference's rows.
    pub order_within_keys_only: bool,
    /// The references and the runs, in order.
    pub runs: Vec<RunReport>,
    /// How long the check took, in seconds.
    pub seconds: f64,
}

/// One run, or reference, of a check.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct RunReport {
    /// What it was.
    pub name: String,
    /// Distinct valid events sent.
    pub events: usize,
    /// Events applied.
    pub applied: usize,
    /// Deliveries acked without effect (worker runs only).
    pub duplicates: Option<u64>,
    /// Events dead-lettered (or, in a reference, given up).
    pub dead_lettered: usize,
    /// Events whose effect is there more than once.
    pub doubled: usize,
    /// Events whose effect is missing: neither applied nor dead-lettered,
    /// or applied without effect by the witness's count.
    pub lost: usize,
    /// Rows of the handler's tables, outgoing messages and events' fates
    /// that differ from the reference (from batches, for batch
    /// equivalence); none when there is no reference to compare with.
    pub diverged: Option<usize>,
    /// Rows the invariants returned.
    pub violations: usize,
    /// Keys whose events applied out of the order they were sent in (runs
    /// on an ordered queue only).
    pub out_of_order: usize,
    /// Messages that reached the service's outgoing exchanges while it
    /// ran: a check relays nothing, so each was sent by the handler itself,
    /// outside idem's outbox (or by another publisher on the vhost).
    pub sent_outside: usize,
    /// Workers killed, connections cut or transactions failed on purpose.
    pub strikes: Option<usize>,
    /// Why the run proved nothing, when it did not: its fault never struck
    /// (a kill mid-batch where no batch went one by one), or its copies
    /// never met an event applied already. A check with such a run does
    /// not pass.
    pub inconclusive: Option<String>,
    /// What it found wrong, first ones first.
    pub findings: Vec<String>,
    /// Why it could not finish, if it could not.
    pub error: Option<String>,
    /// How long it took, in seconds.
    pub seconds: f64,
}

impl RunReport {
    /// Nothing doubled, lost, diverged or broken, and it finished.
    pub fn passed(&self) -> bool {
        self.error.is_none()
            && self.doubled == 0
            && self.lost == 0
            && self.diverged.unwrap_or(0) == 0
            && self.violations == 0
            && self.out_of_order == 0
            && self.sent_outside == 0
    }

    /// What went wrong, in a few words.
    fn trouble(&self) -> Vec<String> {
        let mut trouble = Vec::new();
        if let Some(error) = &self.error {
            trouble.push(format!("did not finish: {error}"));
        }
        for (count, what) in [
            (self.doubled, "doubled"),
            (self.lost, "lost"),
            (self.diverged.unwrap_or(0), "diverged"),
            (self.violations, "broke an invariant"),
            (self.out_of_order, "keys out of order"),
            (self.sent_outside, "sent outside idem's outbox"),
        ] {
            if count > 0 {
                trouble.push(format!("{count} {what}"));
            }
        }
        trouble
    }
}

impl CheckReport {
    /// Every run matched, none was inconclusive, and the reference is the
    /// same when run twice.
    pub fn passed(&self) -> bool {
        self.unstable.is_empty()
            && self.runs.iter().all(RunReport::passed)
            && self.inconclusive().is_empty()
    }

    /// The runs that proved nothing, each with why.
    pub fn inconclusive(&self) -> Vec<String> {
        self.runs
            .iter()
            .filter_map(|run| Some(format!("{}: {}", run.name, run.inconclusive.as_ref()?)))
            .collect()
    }

    /// The names of the runs that did not pass.
    pub fn failed_runs(&self) -> Vec<&str> {
        self.runs
            .iter()
            .filter(|run| !run.passed())
            .map(|run| run.name.as_str())
            .collect()
    }

    /// The verdict, in one line.
    pub fn verdict(&self) -> String {
        if self.passed() {
            return format!(
                "check passed: {} runs, {} events, nothing doubled, lost or diverged{}",
                self.runs.len(),
                self.events,
                if self.order_matters {
                    " (the order of the events matters: judged by idem's accounts, the witness and the invariants)"
                } else {
                    ""
                }
            );
        }
        let mut said: Vec<String> = self
            .runs
            .iter()
            .filter(|run| !run.passed())
            .map(|run| format!("{}: {}", run.name, run.trouble().join(", ")))
            .collect();
        let inconclusive = self.inconclusive();
        if said.is_empty() && self.unstable.is_empty() {
            return format!(
                "check INCONCLUSIVE: nothing went wrong, but {} proved nothing: {} (more events, \
                 or another --seed, give them something to strike)",
                match inconclusive.len() {
                    1 => "1 run".to_owned(),
                    n => format!("{n} runs"),
                },
                inconclusive.join("; ")
            );
        }
        said.extend(
            inconclusive
                .into_iter()
                .map(|why| format!("inconclusive, {why}")),
        );
        if !self.unstable.is_empty() {
            said.insert(
                0,
                format!(
                    "the reference differs from itself in {} (a clock, a random value, or state kept \
                     in memory; --ignore-column leaves a column out)",
                    self.unstable.join(", ")
                ),
            );
        }
        format!("check FAILED: {}", said.join("; "))
    }
}

fn count(value: Option<impl fmt::Display>) -> String {
    value.map_or_else(|| "—".to_owned(), |value| value.to_string())
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "check: {} messages, {} distinct events, {} that do not decode; {:.1} s.",
            self.messages, self.events, self.invalid, self.seconds
        )?;
        let mut compared = self.tables.clone();
        compared.push("the outbox".to_owned());
        write!(f, "Compared: {}", compared.join(", "))?;
        if self.left_out.is_empty() {
            writeln!(f, ".")?;
        } else {
            let left: Vec<String> = self.left_out.iter().map(ToString::to_string).collect();
            writeln!(f, "; left out: {}.", left.join(", "))?;
        }
        writeln!(
            f,
            "Cells: events; diverged: rows, messages and fates unlike the reference's (— when the order of \
             the events matters: on an ordered queue, across keys); invariant: rows the invariants \
             returned."
        )?;
        writeln!(f)?;
        // The longest run's name sets the first column.
        let width = self
            .runs
            .iter()
            .map(|run| run.name.chars().count())
            .max()
            .unwrap_or(0)
            .max(48);
        let header = format!(
            "{:<width$} {:>7} {:>7} {:>7} {:>5} {:>7} {:>5} {:>8} {:>9} {:>6} {:>6}",
            "run",
            "events",
            "applied",
            "dupl.",
            "dead",
            "doubled",
            "lost",
            "diverged",
            "invariant",
            "faults",
            "secs"
        );
        writeln!(f, "{}", header.trim_end())?;
        for run in &self.runs {
            let line = format!(
                "{:<width$} {:>7} {:>7} {:>7} {:>5} {:>7} {:>5} {:>8} {:>9} {:>6} {:>6.1}",
                run.name,
                run.events,
                run.applied,
                count(run.duplicates),
                run.dead_lettered,
                run.doubled,
                run.lost,
                count(run.diverged),
                run.violations,
                count(run.strikes),
                run.seconds,
            );
            let line = match &run.error {
                Some(_) => format!("{:<width$} did not finish", run.name),
                None => line,
            };
            writeln!(f, "{}", line.trim_end())?;
        }
        let told: Vec<&RunReport> = self
            .runs
            .iter()
            .filter(|run| {
                !run.findings.is_empty() || run.error.is_some() || run.inconclusive.is_some()
            })
            .collect();
        if !told.is_empty() {
            writeln!(f)?;
            writeln!(f, "What they found:")?;
            for run in told {
                writeln!(f, "  {}:", run.name)?;
                if let Some(error) = &run.error {
                    writeln!(f, "    did not finish: {error}")?;
                }
                if let Some(why) = &run.inconclusive {
                    writeln!(f, "    inconclusive: {why}")?;
                }
                for finding in &run.findings {
                    writeln!(f, "    {finding}")?;
                }
            }
        }
        writeln!(f)?;
        write!(f, "{}", self.verdict())
    }
}
