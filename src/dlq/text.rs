//! The reports as text: listings, summaries, syncs; every string from a
//! letter made printable.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use super::{ERRORS_SHOWN, Entry, HOLD, IndexedSummary, Report, Synced};
use crate::duration::rfc3339;

/// The summary's failure groups, the largest first, [`ERRORS_SHOWN`] of
/// them and a count of the rest.
fn write_groups(f: &mut fmt::Formatter<'_>, groups: &[crate::store::GroupCount]) -> fmt::Result {
    write!(
        f,
        "\n  by failure group (last error, numbers, ids and quoted values taken out; the \
         console's groups):"
    )?;
    for group in groups.iter().take(ERRORS_SHOWN) {
        // The error itself when the group's letters share it.
        let shown = group.error.as_deref().unwrap_or(&group.fingerprint);
        let fingerprint = if shown.is_empty() {
            "(no failure recorded)".to_owned()
        } else {
            printable(shown).to_string()
        };
        write!(f, "\n    {:>6}  {fingerprint}", group.letters)?;
        match group.invalid {
            0 => {}
            1 if group.letters == 1 => write!(f, " (an invalid body)")?,
            n if n == group.letters => write!(f, " (invalid bodies)")?,
            n => write!(f, " ({n} of them invalid bodies)")?,
        }
        write!(f, "  --group {}", group.id)?;
    }
    if groups.len() > ERRORS_SHOWN {
        let rest = &groups[ERRORS_SHOWN..];
        write!(
            f,
            "\n    {:>6}  in {} other group(s) (`--error TEXT` or `--group ID` narrows the \
             summary)",
            rest.iter().map(|group| group.letters).sum::<i64>(),
            rest.len()
        )?;
    }
    Ok(())
}

impl fmt::Display for IndexedSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let IndexedSummary {
            state,
            summary,
            parked,
        } = self;
        write!(
            f,
            "{} of {} dead-lettered message(s) in {} match",
            summary.letters,
            state.totals.letters,
            printable(&state.queue)
        )?;
        match state.in_queue {
            Some(ready) if state.behind() => write!(
                f,
                " (by the index; the queue holds {ready} ready, some the index does not know \
                 of: `{} dlq sync` adds them, browsing every letter)",
                crate::program::name()
            )?,
            Some(ready) if i64::from(ready) != state.totals.letters => write!(
                f,
                " (by the index; the queue holds {ready} ready: `{} dlq sync` sets the index \
                 to it)",
                crate::program::name()
            )?,
            _ => {}
        }
        fn counted(counts: &BTreeMap<String, i64>) -> Vec<(&String, &i64)> {
            let mut counts: Vec<(&String, &i64)> = counts.iter().collect();
            counts.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
            counts
        }
        let reasons: Vec<String> = counted(&summary.reasons)
            .into_iter()
            .map(|(reason, n)| format!("{} {n}", printable(reason)))
            .collect();
        write!(f, "\n  by reason: {}", reasons.join(", "))?;
        write_groups(f, &summary.groups)?;
        let seconds = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        if let (Some(oldest), Some(newest)) = (summary.oldest, summary.newest) {
            write!(
                f,
                "\n  oldest {}, newest {}",
                rfc3339(seconds(oldest)),
                rfc3339(seconds(newest))
            )?;
        }
        write!(
            f,
            "\n  a replay would apply {}, find {} applied already; {} invalid or unknown \
             (applied as of each letter's death or the last sync: `{} dlq list` looks each \
             up now)",
            summary.would_apply,
            summary.applied,
            summary.invalid,
            crate::program::name()
        )?;
        if let Some(parked) = parked {
            write!(
                f,
                "\n  parked keys: {} key(s) holding {} event(s), {} of them behind a letter \
                 of this queue, whose replay applies it and then its key's events in order \
                 (`{} parked list` names each key's head)",
                parked.keys,
                parked.events,
                parked.dead_heads,
                crate::program::name()
            )?;
        }
        Ok(())
    }
}

/// A sync's outcome, as a line.
pub(super) struct SyncedIn<'a>(&'a str, &'a Synced);

impl fmt::Display for SyncedIn<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let SyncedIn(queue, synced) = self;
        write!(
            f,
            "synced the dead-letter index with {}: {} letter(s) found, {} row(s) of letters no \
             longer there removed",
            printable(queue),
            synced.indexed,
            synced.removed
        )
    }
}

/// `text` with its control characters escaped (`\u{1b}`, `\0`), so that a
/// body or an id cannot drive the terminal it is printed on.
#[doc(hidden)]
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    std::borrow::Cow::Owned(
        text.chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_debug().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect(),
    )
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.event_id, &self.invalid) {
            (Some(id), _) => write!(f, "{}", printable(id))?,
            (None, Some(why)) => write!(f, "(invalid: {})", printable(why))?,
            (None, None) => write!(f, "(no event id)")?,
        }
        match &self.death {
            Some(death) => {
                write!(
                    f,
                    "  queue={} reason={} count={}",
                    printable(&death.queue),
                    printable(&death.reason),
                    death.count
                )?;
                if let Some(time) = death.time {
                    write!(f, " at={}", rfc3339(time))?;
                }
            }
            None => write!(f, "  (no record of its death)")?,
        }
        if self.replays > 0 {
            write!(f, " replays={}", self.replays)?;
        }
        match self.applied {
            Some(false) => write!(f, "  a replay would apply it")?,
            Some(true) => write!(
                f,
                "  applied already: a replay would be acked as a duplicate"
            )?,
            None => {}
        }
        if let Some(failures) = &self.failures {
            write!(
                f,
                "\n    failed {} time(s), last error: {}",
                failures.failures,
                printable(&failures.last_error)
            )?;
        }
        Ok(())
    }
}

impl Report {
    /// The dead letters replayed, per queue they went back to.
    pub fn replayed_per_queue(&self) -> BTreeMap<&str, usize> {
        let mut queues = BTreeMap::new();
        for entry in &self.replayed {
            if let Some(death) = &entry.death {
                *queues.entry(death.queue.as_str()).or_default() += 1;
            }
        }
        queues
    }
}

/// What `idem dlq` shows: a report of [`run`](super::run), or the counts of
/// [`summary`](super::summary).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    /// A report, one entry per line.
    Listing,
    /// Counts only, from the dead-letter index ([`summary`](super::summary)); a [`Printed`]
    /// report shows its entries whatever the view.
    Summary,
}

/// A report as `idem dlq` prints it.
pub struct Printed<'a> {
    /// The report.
    pub report: &'a Report,
    /// How.
    pub view: View,
}

impl fmt::Display for Printed<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let report = self.report;
        self.done(f)?;
        if report.skipped_invalid > 0 {
            write!(
                f,
                "; {} invalid body(ies) skipped (--include-invalid replays them)",
                report.skipped_invalid
            )?;
        }
        if !report.failed.is_empty() {
            write!(
                f,
                "; {} could not be replayed and stay there",
                report.failed.len()
            )?;
            for (entry, why) in &report.failed {
                write!(f, "\n  {entry}: {}", printable(why))?;
            }
        }
        if report.moved_to_tail > 0 {
            write!(
                f,
                "\n  ({} letter(s) left in the queue went to its tail: a pass holds at most {HOLD} \
                 unacked, and moves the ones it keeps beyond that)",
                report.moved_to_tail
            )?;
        }
        if report.acked_again > 0 {
            write!(
                f,
                "\n  ({} copy(ies) of letters acted on already came back when the connection was \
                 lost before their acks: acked, not acted on again)",
                report.acked_again
            )?;
        }
        if let Some(why) = &report.stopped_early {
            write!(
                f,
                "\n  (stopped before the end of the queue: {}; the rest is still there)",
                printable(why)
            )?;
        }
        if report.not_looked_at > 0 {
            write!(
                f,
                "\n  ({} letter(s) not looked at: the dead-letter index, which counts every \
                 letter in the queue, counts no more matches; --every-letter looks at each)",
                report.not_looked_at
            )?;
        }
        if let Some(error) = &report.index_stale {
            write!(
                f,
                "\n  (the dead-letter index could not be told: {}; `{} dlq sync` mends it)",
                printable(error),
                crate::program::name()
            )?;
        }
        if let Some(error) = &report.ledger_unavailable {
            write!(
                f,
                "\n  (the failure ledger could not be read: {})",
                printable(error)
            )?;
        }
        Ok(())
    }
}

impl Printed<'_> {
    /// What the pass did: what it replayed, discarded, synced or listed.
    fn done(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let report = self.report;
        let queue = printable(&report.queue);
        if !report.replayed.is_empty() || !report.failed.is_empty() {
            let per_queue: Vec<String> = report
                .replayed_per_queue()
                .iter()
                .map(|(queue, n)| format!("{n} to {}", printable(queue)))
                .collect();
            write!(
                f,
                "replayed {} message(s) from {queue}",
                report.replayed.len()
            )?;
            if !per_queue.is_empty() {
                write!(f, " ({})", per_queue.join(", "))?;
            }
            if report.nacks_retried > 0 {
                write!(
                    f,
                    "; {} nacked by the broker and sent again",
                    report.nacks_retried
                )?;
            }
        } else if let Some(file) = &report.file {
            write!(
                f,
                "discarded {} message(s) from {queue} into {}",
                report.discarded.len(),
                file.display()
            )?;
        } else if let Some(synced) = &report.synced {
            write!(f, "{}", SyncedIn(&report.queue, synced))?;
        } else {
            if report.limited {
                write!(
                    f,
                    "the first {} dead-lettered message(s) in {queue} that match (the limit), \
                     of the {} looked at; the queue holds {} (nothing moved)",
                    report.listed.len(),
                    report.seen,
                    report.in_queue
                )?;
            } else {
                write!(
                    f,
                    "{} of {} dead-lettered message(s) in {queue} match (nothing moved)",
                    report.listed.len(),
                    report.in_queue
                )?;
            }
            for entry in &report.listed {
                write!(f, "\n  {entry}")?;
            }
        }
        Ok(())
    }
}
