//! `idem parked`: the keys of an ordered queue parked behind a failed head
//! (the head waiting for its next attempt, or lying in the dead letters),
//! and what an operator does with one whose head will never apply: release
//! its parked events to apply without the head (once the head was
//! discarded), or discard them too, each written to a file first. Both
//! say what they would do with `dry_run`, and log what they did.

use std::fmt;
use std::io::Write;
use std::path::PathBuf;
use std::time::UNIX_EPOCH;

use base64::Engine;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::dlq::printable;
use crate::duration::rfc3339;
use crate::handler::Handler;
use crate::store::{DiscardError, ParkedEvent, ParkedKey, ReadyError};
use crate::target::{OpenError, Target};

/// What to do with the parked keys.
#[derive(Debug, Clone)]
pub enum ParkedAction {
    /// List the parked keys, oldest first (only `key` when given).
    List {
        /// One key.
        key: Option<String>,
        /// At most this many.
        limit: i64,
    },
    /// Let the events parked behind `key`'s dead head apply without it.
    Release {
        /// The key.
        key: String,
        /// Say what it would do; do nothing.
        dry_run: bool,
    },
    /// Remove `key` and its parked events, each appended to `file` (and
    /// synced) before.
    Discard {
        /// The key.
        key: String,
        /// The JSON-lines file the events go to.
        file: PathBuf,
        /// Say what it would do; do nothing.
        dry_run: bool,
    },
}

/// What `idem parked` did.
#[derive(Debug)]
pub enum ParkedReport {
    /// The parked keys.
    Listed(Vec<ParkedKey>),
    /// The key's events apply (or would) without its head.
    Released {
        /// The key as it was.
        key: ParkedKey,
        /// Nothing was done.
        dry_run: bool,
    },
    /// The key's events were (or would be) discarded.
    Discarded {
        /// The key as it was.
        key: ParkedKey,
        /// Where they went.
        file: PathBuf,
        /// How many.
        events: usize,
        /// Nothing was done.
        dry_run: bool,
    },
    /// The key is not parked.
    NotParked(String),
    /// The key's head waits for its next attempt: it is not released.
    HeadWaits(ParkedKey),
}

impl ParkedReport {
    /// Whether the command did what it was asked (or would).
    pub fn done(&self) -> bool {
        !matches!(self, Self::NotParked(_) | Self::HeadWaits(_))
    }
}

/// Runs `action` on the target's consumer group.
pub async fn run<H: Handler>(
    target: &Target,
    action: &ParkedAction,
    shutdown: &CancellationToken,
) -> crate::error::CommandResult<ParkedReport> {
    let act = async {
        let store = match target.ready_store::<H>(shutdown).await {
            Err(OpenError::Ready(ReadyError::Interrupted)) => anyhow::bail!("interrupted"),
            store => store?,
        };
        let one = |key: &str| {
            let store = store.clone();
            let key = key.to_owned();
            async move {
                store
                    .parked_keys(Some(&key), 1)
                    .await
                    .map(|mut keys| keys.pop())
            }
        };
        let report = match action {
            ParkedAction::List { key, limit } => {
                ParkedReport::Listed(store.parked_keys(key.as_deref(), *limit).await?)
            }
            ParkedAction::Release { key, dry_run } => match one(key).await? {
                None => ParkedReport::NotParked(key.clone()),
                Some(parked) if !parked.head_dead => ParkedReport::HeadWaits(parked),
                Some(parked) => {
                    if !dry_run && !store.release_key(key).await? {
                        ParkedReport::NotParked(key.clone())
                    } else {
                        if !dry_run {
                            info!(ordering.key = %key, head = %parked.head, events = parked.events, "released a parked key: its events apply without its head");
                        }
                        ParkedReport::Released {
                            key: parked,
                            dry_run: *dry_run,
                        }
                    }
                }
            },
            ParkedAction::Discard { key, file, dry_run } => {
                let Some(parked) = one(key).await? else {
                    return Ok(ParkedReport::NotParked(key.clone()));
                };
                let events = if *dry_run {
                    usize::try_from(parked.events).unwrap_or(0)
                } else {
                    match store
                        .discard_key(key, |events| keep(file, key, events))
                        .await
                    {
                        Ok(Some(events)) => events.len(),
                        Ok(None) => return Ok(ParkedReport::NotParked(key.clone())),
                        Err(DiscardError::Store(error)) => return Err(error.into()),
                        Err(DiscardError::Keep(error)) => anyhow::bail!(
                            "cannot write the parked events of {} to {}: {error}; nothing was discarded",
                            printable(key),
                            file.display()
                        ),
                    }
                };
                if !dry_run {
                    info!(ordering.key = %key, events, file = %file.display(), "discarded a parked key and its events");
                }
                ParkedReport::Discarded {
                    key: parked,
                    file: file.clone(),
                    events,
                    dry_run: *dry_run,
                }
            }
        };
        Ok(report)
    };
    Ok(act.await?)
}

/// Appends `events` of `key` to `file`, one JSON line each, and syncs it.
fn keep(file: &std::path::Path, key: &str, events: &[ParkedEvent]) -> std::io::Result<()> {
    let mut out = crate::files::append_private(file)?;
    for event in events {
        let mut line = json!({
            "ordering_key": key,
            "event_id": event.event_id,
            "queue": event.queue,
            "properties": event.properties,
        });
        let body = match std::str::from_utf8(&event.body) {
            Ok(text) => ("body", Value::String(text.to_owned())),
            Err(_) => (
                "body_base64",
                Value::String(base64::engine::general_purpose::STANDARD.encode(&event.body)),
            ),
        };
        if let Value::Object(fields) = &mut line {
            fields.insert(body.0.to_owned(), body.1);
        }
        writeln!(out, "{line}")?;
    }
    out.sync_all()
}

fn when(time: Option<std::time::SystemTime>) -> String {
    time.and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or_else(|| "-".to_owned(), |t| rfc3339(t.as_secs()))
}

fn describe(f: &mut fmt::Formatter<'_>, key: &ParkedKey) -> fmt::Result {
    let state = if key.head_dead {
        "dead-lettered".to_owned()
    } else {
        format!("retried at {}", when(key.due_at))
    };
    write!(
        f,
        "{}: {} event(s) behind {} ({state}; parked {})",
        printable(&key.key),
        key.events,
        printable(&key.head),
        when(Some(key.parked_at))
    )?;
    if let Some(error) = &key.last_error {
        write!(f, "; last error: {}", printable(error))?;
    }
    Ok(())
}

impl fmt::Display for ParkedReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let program = crate::program::name();
        match self {
            Self::Listed(keys) if keys.is_empty() => write!(f, "no key is parked"),
            Self::Listed(keys) => {
                writeln!(f, "{} parked key(s), oldest first:", keys.len())?;
                for key in keys {
                    write!(f, "  ")?;
                    describe(f, key)?;
                    writeln!(f)?;
                }
                Ok(())
            }
            Self::Released { key, dry_run } => {
                let verb = if *dry_run {
                    "would release"
                } else {
                    "released"
                };
                write!(f, "{verb} ")?;
                describe(f, key)?;
                write!(
                    f,
                    "\nits events apply in their order without {}",
                    printable(&key.head)
                )
            }
            Self::Discarded {
                key,
                file,
                events,
                dry_run,
            } => {
                let verb = if *dry_run {
                    "would discard"
                } else {
                    "discarded"
                };
                write!(f, "{verb} ")?;
                describe(f, key)?;
                write!(f, "\n{events} event(s) written to {}", file.display())
            }
            Self::NotParked(key) => write!(f, "the key {} is not parked", printable(key)),
            Self::HeadWaits(key) => {
                describe(f, key)?;
                write!(
                    f,
                    "\nits head waits for its next attempt: it is released once the head \
                     applies or is dead-lettered and discarded (`{program} dlq discard`)"
                )
            }
        }
    }
}
