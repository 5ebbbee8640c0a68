//! Replays and discards from the console: a dry run counts what an action
//! would take and asks for confirmation; the action then runs as `dlq
//! replay` and `dlq discard` run, in this process, recorded in the audit,
//! its progress on a page of its own.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use maud::html;
use tracing::{info, warn};
use uuid::Uuid;

use super::Console;
use super::access::{Acting, Reader, refused};
use super::pages::{encode, search, search_fields};
use super::view::{self, Fields, layout, maybe_time, time};
use crate::dlq::{self, Action, DlqConfig, Filter};
use crate::handler::Handler;
use crate::progress::Progress;
use crate::store::IndexSummary;
use crate::store::console::{self as read, Audited, Group, Search};

/// What an action does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Replay,
    Discard,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Replay => "replay",
            Kind::Discard => "discard",
        }
    }
}

/// Which letters an action takes: a group's (searched), or some of them.
#[derive(Debug, Clone)]
struct Selection {
    group: Uuid,
    search: Search,
    keys: Vec<String>,
}

/// What a form asks for.
fn asked(fields: &Fields) -> Result<(Kind, Selection), String> {
    let (kind, selected) = match fields.one("action") {
        Some("replay") => (Kind::Replay, false),
        Some("discard") => (Kind::Discard, false),
        Some("replay-selected") => (Kind::Replay, true),
        Some("discard-selected") => (Kind::Discard, true),
        _ => return Err("no such action".to_owned()),
    };
    let group = fields
        .one("group")
        .and_then(|g| Uuid::parse_str(g).ok())
        .ok_or("no group given")?;
    let keys = if selected {
        fields.all("keys")
    } else {
        Vec::new()
    };
    if selected && keys.is_empty() {
        return Err("no letter was selected: tick the letters to act on first".to_owned());
    }
    let search = if selected {
        Search::default()
    } else {
        search(fields)?
    };
    Ok((
        kind,
        Selection {
            group,
            search,
            keys,
        },
    ))
}

impl Selection {
    /// The pass's filter, the search's times as ages from now.
    fn filter(&self) -> Filter {
        let now = SystemTime::now();
        let age = |at: SystemTime| now.duration_since(at).unwrap_or(Duration::ZERO);
        Filter {
            event_id: self.search.event_id.clone(),
            error: self.search.error.clone(),
            newer_than: self.search.from.map(age),
            older_than: self.search.to.map(age),
            group: Some(self.group),
            keys: self.keys.clone(),
            ..Filter::default()
        }
    }

    /// As the audit records it.
    fn described(&self, fingerprint: &str) -> String {
        let mut parts = vec![format!("group {} ({fingerprint})", self.group)];
        if !self.keys.is_empty() {
            let shown: Vec<&str> = self.keys.iter().take(5).map(String::as_str).collect();
            let more = self.keys.len().saturating_sub(shown.len());
            parts.push(format!(
                "{} selected: {}{}",
                self.keys.len(),
                shown.join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            ));
        }
        if let Some(id) = &self.search.event_id {
            parts.push(format!("event id {id}"));
        }
        if let Some(error) = &self.search.error {
            parts.push(format!("error contains {error:?}"));
        }
        if let Some(from) = self.search.from {
            parts.push(format!("died from {}", time(from)));
        }
        if let Some(to) = self.search.to {
            parts.push(format!("died before {}", time(to)));
        }
        parts.join("; ")
    }
}

impl<H: Handler> Console<H> {
    /// Group `id`, if it has letters.
    async fn group(&self, id: Uuid) -> Result<Option<Group>, crate::store::StoreError> {
        let client = self.inner.store.pool().get().await?;
        Ok(read::group_by_id(&client, &self.inner.config.target.consumer_group, id).await?)
    }

    /// The dry run: what the index counts of the selection, and the group's
    /// fingerprint.
    async fn dry_run(
        &self,
        selection: &Selection,
    ) -> Result<Option<(IndexSummary, String)>, crate::store::StoreError> {
        let Some(group) = self.group(selection.group).await? else {
            return Ok(None);
        };
        let whole = selection.keys.is_empty()
            && selection.search.event_id.is_none()
            && selection.search.error.is_none()
            && selection.search.from.is_none()
            && selection.search.to.is_none();
        let summary = if whole {
            // The group's tally: no letter read.
            IndexSummary {
                letters: group.letters,
                would_apply: group.would_apply,
                applied: group.applied,
                invalid: group.invalid,
                ..IndexSummary::default()
            }
        } else {
            self.inner
                .store
                .dead_letter_summary(&selection.filter())
                .await?
        };
        Ok(Some((summary, group.fingerprint)))
    }
}

/// `POST /actions/preview`: what the action would take; asks to confirm.
pub(super) async fn preview<H: Handler>(
    State(console): State<Console<H>>,
    Acting { who, fields }: Acting,
) -> Response {
    let (kind, selection) = match asked(&fields) {
        Ok(asked) => asked,
        Err(why) => return refused(StatusCode::BAD_REQUEST, &why),
    };
    let (summary, fingerprint) = match console.dry_run(&selection).await {
        Ok(Some(found)) => found,
        Ok(None) => return refused(StatusCode::NOT_FOUND, "this group has no dead letters"),
        Err(error) => return view::unavailable("the database", &error),
    };
    let taken = match kind {
        Kind::Replay => summary.letters - summary.invalid,
        Kind::Discard => summary.letters,
    };
    let back = format!(
        "/groups/{}?{}",
        selection.group,
        encode(&search_fields(&selection.search))
    );
    let body = html! {
        h1 { @match kind { Kind::Replay => "Replay", Kind::Discard => "Discard" } " — dry run" }
        p { "Letters: " (selection.described(&fingerprint)) }
        table {
            tbody {
                tr { th { "letters that match (index)" } td.n { (summary.letters) } }
                tr { th { "events a replay would apply" } td.n { (summary.would_apply) } }
                tr { th { "events applied already (a replay is acked as a duplicate)" } td.n { (summary.applied) } }
                tr { th { "invalid bodies (a replay leaves them)" } td.n { (summary.invalid) } }
            }
        }
        @match kind {
            Kind::Replay => p { "A replay sends " strong { (taken) } " letters back to the queue they died in, each with a fresh budget of attempts; each dead-letter copy is acked only once the broker confirmed its replay." },
            Kind::Discard => p { "A discard writes " strong { (taken) } " letters to a file under " code { (console.inner.config.discard_dir.display()) } " (synced before each is acked), then removes them from the queue." },
        }
        @if taken == 0 {
            p.refused { "Nothing to do." }
        } @else {
            form method="post" action="/actions" {
                input type="hidden" name="form_token" value=(console.form_token());
                @for (name, value) in [("action", fields.one("action").unwrap_or_default().to_owned()), ("group", selection.group.to_string()), ("expected", taken.to_string())] {
                    input type="hidden" name=(name) value=(value);
                }
                @for (name, value) in search_fields(&selection.search) {
                    input type="hidden" name=(name) value=(value);
                }
                @for key in &selection.keys {
                    input type="hidden" name="keys" value=(key);
                }
                div.actions {
                    @match kind {
                        Kind::Replay => button type="submit" { "Replay " (taken) " letters" },
                        Kind::Discard => button.danger type="submit" { "Discard " (taken) " letters" },
                    }
                    a href=(back) { "Cancel" }
                }
            }
        }
    };
    layout("Dry run", who.acting().as_deref(), body).into_response()
}

/// `POST /actions`: starts a confirmed action; its page follows it.
pub(super) async fn start<H: Handler>(
    State(console): State<Console<H>>,
    Acting { who, fields }: Acting,
) -> Response {
    let (kind, selection) = match asked(&fields) {
        Ok(asked) => asked,
        Err(why) => return refused(StatusCode::BAD_REQUEST, &why),
    };
    let expected: i64 = fields
        .one("expected")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    // The group's fingerprint, for the audit; the count was the dry run's.
    let fingerprint = match console.group(selection.group).await {
        Ok(Some(group)) => group.fingerprint,
        Ok(None) => return refused(StatusCode::NOT_FOUND, "this group has no dead letters"),
        Err(error) => return view::unavailable("the database", &error),
    };
    let config = &console.inner.config;
    let file = match kind {
        Kind::Discard => {
            if let Err(error) = std::fs::create_dir_all(&config.discard_dir) {
                return view::unavailable(
                    &format!("the discard directory {}", config.discard_dir.display()),
                    &error,
                );
            }
            let stamp = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            Some(config.discard_dir.join(format!(
                "discard-{}-{}.jsonl",
                stamp.as_millis(),
                &selection.group.simple().to_string()[..8]
            )))
        }
        Kind::Replay => None,
    };
    let audited = Audited {
        id: 0,
        consumer_group: config.target.consumer_group.clone(),
        action: kind.name().to_owned(),
        who: who.audited(),
        filter: selection.described(&fingerprint),
        expected,
        started_at: SystemTime::now(),
        finished_at: None,
        letters: None,
        outcome: None,
        file: file.as_ref().map(|f| f.display().to_string()),
        edit: None,
    };
    let id = match console.inner.store.pool().get().await {
        Ok(client) => read::audit_start(&client, &audited).await,
        Err(error) => return view::unavailable("the database", &error),
    };
    let id = match id {
        Ok(id) => id,
        Err(error) => return view::unavailable("the database", &error),
    };
    let action = match file {
        Some(file) => Action::Discard { file },
        None => Action::Replay {
            rate: None,
            include_invalid: false,
        },
    };
    let mut dlq = DlqConfig::new(config.target.clone());
    dlq.filter = selection.filter();
    let progress = Progress::counted();
    if let Ok(mut running) = console.inner.running.lock() {
        running.insert(id, progress.clone());
    }
    info!(id, action = kind.name(), who = %audited.who, filter = %audited.filter, "console action started");
    console
        .inner
        .tasks
        .spawn(run(console.clone(), id, dlq, action, progress));
    Redirect::to(&format!("/actions/{id}")).into_response()
}

/// Runs the action audited as `id` in the console's process, showing its
/// `progress`, and records in the audit how it ended.
pub(super) async fn run<H: Handler>(
    console: Console<H>,
    id: i64,
    dlq: DlqConfig,
    action: Action,
    progress: Progress,
) {
    let inner = &console.inner;
    let report = dlq::run_showing(&dlq, &action, &*inner.handler, &progress, &inner.shutdown).await;
    let (letters, outcome) = match &report {
        Ok(report) => outcome(report),
        Err(error) => (0, format!("failed: {error}")),
    };
    info!(id, letters, %outcome, "console action ended");
    let ended = async {
        let client = inner.store.pool().get().await?;
        read::audit_end(&client, id, letters, &outcome).await?;
        Ok::<_, crate::store::StoreError>(())
    };
    if let Err(error) = ended.await {
        warn!(id, %error, "the audit could not record how a console action ended");
    }
    if let Ok(mut running) = inner.running.lock() {
        running.remove(&id);
    }
}

/// How many letters a pass acted on, and what it says of them.
fn outcome(report: &dlq::Report) -> (i64, String) {
    let acted = report.replayed.len() + report.discarded.len();
    let mut said = match (&report.file, report.replayed.len()) {
        (Some(file), _) => format!("discarded {acted} (written to {})", file.display()),
        (None, n) => format!("replayed {n}"),
    };
    if report.skipped_invalid > 0 {
        said.push_str(&format!("; {} invalid bodies left", report.skipped_invalid));
    }
    if !report.failed.is_empty() {
        said.push_str(&format!(
            "; {} could not be replayed and stay",
            report.failed.len()
        ));
    }
    if let Some(why) = &report.stopped_early {
        said.push_str(&format!("; stopped early: {why}"));
    }
    (i64::try_from(acted).unwrap_or(i64::MAX), said)
}

/// `GET /actions/{id}`: how far an action got, or how it ended.
pub(super) async fn progress<H: Handler>(
    State(console): State<Console<H>>,
    Reader(who): Reader,
    Path(id): Path<String>,
) -> Response {
    let Ok(id) = id.parse::<i64>() else {
        return view::not_found().await;
    };
    let action = match console.inner.store.pool().get().await {
        Ok(client) => read::audited_by_id(&client, id).await,
        Err(error) => return view::unavailable("the database", &error),
    };
    let action = match action {
        Ok(Some(action)) => action,
        Ok(None) => return view::not_found().await,
        Err(error) => return view::unavailable("the database", &error),
    };
    let counts = console
        .inner
        .running
        .lock()
        .ok()
        .and_then(|running| running.get(&id).and_then(Progress::counts));
    let running = action.finished_at.is_none() && counts.is_some();
    let body = html! {
        @if running {
            // Reloads itself while the action runs: no script needed.
            meta http-equiv="refresh" content="1";
        }
        h1 { "Action #" (action.id) ": " (action.action) }
        table {
            tbody {
                tr { th { "letters" } td { (action.filter) } }
                tr { th { "who" } td { (action.who) } }
                tr { th { "started" } td { (time(action.started_at)) } }
                tr { th { "expected" } td { (action.expected) } }
                @if let Some(file) = &action.file { tr { th { "discard file" } td {
                    code { (file) }
                    @if who.may_act() {
                        " " a href=(format!("/actions/{}/file", action.id)) download { "download" }
                    }
                } } }
                tr { th { "finished" } td { (maybe_time(action.finished_at)) } }
                tr { th { "outcome" } td {
                    @match (&action.outcome, counts) {
                        (Some(outcome), _) => { strong { (outcome) } }
                        (None, Some((done, total))) => {
                            "running: " (done) " of " (total) " letters in the queue looked at "
                            progress value=(done) max=(total.max(1)) {}
                        }
                        (None, None) => { "not finished, and not running in this console: it ran in another process, which stopped before it ended (what it confirmed was acked; the rest is still dead-lettered)" }
                    }
                } }
            }
        }
        @if let Some((before, after)) = &action.edit {
            @if console.inner.config.hide_bodies {
                p.muted { "An edit: its bodies are hidden on this console." }
            } @else {
                (super::edits::bodies(before, after))
            }
        }
        p { a href="/audit" { "Audit" } " · " a href="/groups" { "Failure groups" } }
    };
    layout("Action", who.acting().as_deref(), body).into_response()
}

/// `GET /actions/{id}/file`: the discard file an action wrote, for whoever
/// may act (it holds the letters' bodies). Only a file the audit names, and
/// only under the discard directory: an audit row pointing elsewhere opens
/// nothing.
pub(super) async fn file<H: Handler>(
    State(console): State<Console<H>>,
    Reader(who): Reader,
    Path(id): Path<String>,
) -> Response {
    if !who.may_act() {
        return refused(
            StatusCode::FORBIDDEN,
            "a discard file holds the letters' bodies: log in to download it",
        );
    }
    let Ok(id) = id.parse::<i64>() else {
        return view::not_found().await;
    };
    let action = match console.inner.store.pool().get().await {
        Ok(client) => read::audited_by_id(&client, id).await,
        Err(error) => return view::unavailable("the database", &error),
    };
    let file = match action {
        Ok(Some(Audited {
            file: Some(file), ..
        })) => file,
        Ok(_) => return view::not_found().await,
        Err(error) => return view::unavailable("the database", &error),
    };
    let discards = console.inner.config.discard_dir.clone();
    let under_discards = tokio::task::spawn_blocking(move || {
        let dir = std::fs::canonicalize(discards)?;
        let path = std::fs::canonicalize(file)?;
        if !path.starts_with(&dir) {
            return Err(std::io::Error::other("outside the discard directory"));
        }
        let file = std::fs::File::open(&path)?;
        Ok((path, file))
    });
    let Ok(Ok((path, file))) = under_discards.await else {
        return view::not_found().await;
    };
    // Streamed: a discard of many large letters is not read into memory.
    let bytes = axum::body::Body::from_stream(tokio_util::io::ReaderStream::new(
        tokio::fs::File::from_std(file),
    ));
    let name = path
        .file_name()
        .and_then(|name| name.to_str())
        .filter(|name| {
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        })
        .unwrap_or("discarded.jsonl")
        .to_owned();
    (
        [
            (
                axum::http::header::CONTENT_TYPE,
                "application/x-ndjson".to_owned(),
            ),
            (
                axum::http::header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"{name}\""),
            ),
        ],
        bytes,
    )
        .into_response()
}
