//! Long work shows how far it got: a bar on a terminal (done of total,
//! rate, time left), a log line at intervals elsewhere (a pipe, a log
//! shipper), nothing at all for work run inside a test or another command.

#[cfg(feature = "cli")]
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[cfg(feature = "cli")]
use std::fmt;

#[cfg(feature = "cli")]
use indicatif::{HumanDuration, ProgressBar, ProgressState, ProgressStyle};
use tracing::info;

/// How often a line is logged when there is no terminal to draw on.
const LINE_EVERY: Duration = Duration::from_secs(5);

/// How long the work runs before the time left is estimated from its rate.
#[cfg(feature = "cli")]
const ESTIMATE_AFTER: Duration = Duration::from_secs(3);

/// The progress of one piece of work; cheap to clone, shared by the tasks
/// that make it.
#[derive(Debug, Clone)]
pub struct Progress(Option<Arc<Shown>>);

#[derive(Debug)]
enum Shown {
    /// On a terminal, with the `cli` feature.
    #[cfg(feature = "cli")]
    Bar(ProgressBar),
    Lines {
        what: &'static str,
        total: AtomicU64,
        done: AtomicU64,
        started: Instant,
        last: Mutex<Instant>,
    },
    /// Counted for someone who asks ([`Progress::counts`]), not shown.
    Counted { total: AtomicU64, done: AtomicU64 },
}

impl Progress {
    /// Shows nothing.
    pub fn hidden() -> Self {
        Self(None)
    }

    /// Progress of `what` ("publishing") over `total` items: a bar when
    /// standard error is a terminal (with the `cli` feature), a line every
    /// few seconds when not.
    pub fn new(what: &'static str, total: u64) -> Self {
        #[cfg(feature = "cli")]
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(total).with_message(what);
            let template = "{msg} {wide_bar} {pos}/{len} {rate}{left}";
            if let Ok(style) = ProgressStyle::with_template(template) {
                bar.set_style(
                    style
                        .with_key("rate", |state: &ProgressState, out: &mut dyn fmt::Write| {
                            let _ = write!(out, "{:.0}/s", state.per_sec());
                        })
                        .with_key("left", |state: &ProgressState, out: &mut dyn fmt::Write| {
                            // The first seconds' rate says little of the rest.
                            if state.elapsed() >= ESTIMATE_AFTER {
                                let _ = write!(out, ", about {} left", HumanDuration(state.eta()));
                            }
                        }),
                );
            }
            return Self(Some(Arc::new(Shown::Bar(bar))));
        }
        Self(Some(Arc::new(Shown::Lines {
            what,
            total: AtomicU64::new(total),
            done: AtomicU64::new(0),
            started: Instant::now(),
            last: Mutex::new(Instant::now()),
        })))
    }

    /// Counts, for a page that shows how far the work got, and shows
    /// nothing itself.
    pub fn counted() -> Self {
        Self(Some(Arc::new(Shown::Counted {
            total: AtomicU64::new(0),
            done: AtomicU64::new(0),
        })))
    }

    /// Done and total so far; `None` when nothing is counted.
    pub fn counts(&self) -> Option<(u64, u64)> {
        match self.0.as_deref()? {
            #[cfg(feature = "cli")]
            Shown::Bar(bar) => Some((bar.position(), bar.length().unwrap_or(0))),
            Shown::Lines { total, done, .. } | Shown::Counted { total, done } => {
                Some((done.load(Ordering::Relaxed), total.load(Ordering::Relaxed)))
            }
        }
    }

    /// The total, once it is known.
    pub fn set_total(&self, total: u64) {
        match self.0.as_deref() {
            #[cfg(feature = "cli")]
            Some(Shown::Bar(bar)) => bar.set_length(total),
            Some(Shown::Lines { total: known, .. } | Shown::Counted { total: known, .. }) => {
                known.store(total, Ordering::Relaxed);
            }
            None => {}
        }
    }

    /// `n` more done.
    pub fn inc(&self, n: u64) {
        match self.0.as_deref() {
            #[cfg(feature = "cli")]
            Some(Shown::Bar(bar)) => bar.inc(n),
            Some(shown @ Shown::Lines { done, last, .. }) => {
                done.fetch_add(n, Ordering::Relaxed);
                let due = last.lock().is_ok_and(|mut last| {
                    let due = last.elapsed() >= LINE_EVERY;
                    if due {
                        *last = Instant::now();
                    }
                    due
                });
                if due {
                    shown.line(false);
                }
            }
            Some(Shown::Counted { done, .. }) => {
                done.fetch_add(n, Ordering::Relaxed);
            }
            None => {}
        }
    }

    /// Ends the progress of work that `outcome` says how it ended. Either
    /// way the bar is cleared, for the summary or the error follows; a log
    /// gets a last line with the rate reached, unless the work failed (the
    /// error says how far it got) or there was none.
    pub fn finish<T, E>(&self, outcome: &Result<T, E>) {
        match self.0.as_deref() {
            #[cfg(feature = "cli")]
            Some(Shown::Bar(bar)) => bar.finish_and_clear(),
            Some(shown @ Shown::Lines { .. }) if outcome.is_ok() => shown.line(true),
            _ => {}
        }
    }
}

impl Shown {
    /// How far the work got: with the time left while it runs, with the
    /// time it took once `finished`.
    fn line(&self, finished: bool) {
        #[cfg_attr(not(feature = "cli"), allow(irrefutable_let_patterns))]
        let Shown::Lines {
            what,
            total,
            done,
            started,
            ..
        } = self
        else {
            return;
        };
        let (done, total) = (done.load(Ordering::Relaxed), total.load(Ordering::Relaxed));
        let rate = done as f64 / started.elapsed().as_secs_f64().max(1e-3);
        if done == 0 {
            return;
        }
        if finished {
            info!(
                done,
                total,
                "{what}: {done} of {total} in {:.1}s ({rate:.0}/s)",
                started.elapsed().as_secs_f64()
            );
            return;
        }
        let left = total.saturating_sub(done) as f64 / rate;
        info!(
            done,
            total,
            "{what}: {done} of {total} ({rate:.0}/s, about {} left)",
            crate::duration::format(Duration::from_secs(left.ceil() as u64))
        );
    }
}
