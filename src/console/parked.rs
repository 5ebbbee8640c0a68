//! An ordered queue's parked keys: each with the head that holds it, and,
//! for someone who may act, a release or a discard of one key, a dry run
//! first, then the action, run as `parked release` and `parked discard`
//! run and recorded in the audit.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maud::html;
use tracing::{info, warn};

use super::Console;
use super::access::{Acting, Reader, refused};
use super::view::{self, Fields, layout, maybe_time, time};
use crate::commands::parked::{self, ParkedAction, ParkedReport};
use crate::handler::Handler;
use crate::store::ParkedKey;
use crate::store::console::{self as read, Audited};

/// Keys on the page.
const KEYS_SHOWN: i64 = 100;

/// What an operator may do to a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Release,
    Discard,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Release => "release key",
            Kind::Discard => "discard key",
        }
    }
}

/// The action and key a form asks for.
fn asked(fields: &Fields) -> Result<(Kind, String), String> {
    let kind = match fields.one("action") {
        Some("release") => Kind::Release,
        Some("discard") => Kind::Discard,
        _ => return Err("no such action".to_owned()),
    };
    let key = fields.one("key").ok_or("no key given")?;
    Ok((kind, key.to_owned()))
}

impl<H: Handler> Console<H> {
    /// `kind` of `key` as the command runs it; a discard's events go to a
    /// new file under the discard directory.
    fn parked_action(&self, kind: Kind, key: &str, dry_run: bool) -> Result<ParkedAction, String> {
        let key = key.to_owned();
        Ok(match kind {
            Kind::Release => ParkedAction::Release { key, dry_run },
            Kind::Discard => {
                let dir = &self.inner.config.discard_dir;
                std::fs::create_dir_all(dir)
                    .map_err(|error| format!("the discard directory {}: {error}", dir.display()))?;
                let stamp = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default();
                ParkedAction::Discard {
                    key,
                    file: dir.join(format!("parked-key-{}.jsonl", stamp.as_millis())),
                    dry_run,
                }
            }
        })
    }

    /// The action a form asks for, as the command runs it, or the page
    /// that says why there is none.
    fn requested(
        &self,
        fields: &Fields,
        dry_run: bool,
    ) -> Result<(Kind, String, ParkedAction), Box<Response>> {
        let (kind, key) =
            asked(fields).map_err(|why| Box::new(refused(StatusCode::BAD_REQUEST, &why)))?;
        let action = self
            .parked_action(kind, &key, dry_run)
            .map_err(|why| Box::new(view::unavailable("the console", &why)))?;
        Ok((kind, key, action))
    }

    async fn parked(&self, action: &ParkedAction) -> Result<ParkedReport, String> {
        let inner = &self.inner;
        parked::run::<H>(&inner.config.target, action, &inner.shutdown)
            .await
            .map_err(|error| error.to_string())
    }
}

/// A key's head, as a cell says it.
fn head_state(key: &ParkedKey) -> String {
    if key.head_dead {
        "in the dead letters".to_owned()
    } else {
        format!("waits, next attempt {}", maybe_time(key.due_at))
    }
}

/// `GET /parked`: the parked keys, oldest first.
pub(super) async fn list<H: Handler>(
    State(console): State<Console<H>>,
    Reader(who): Reader,
) -> Response {
    let keys = match console.inner.store.parked_keys(None, KEYS_SHOWN).await {
        Ok(keys) => keys,
        Err(error) => return view::unavailable("the database", &error),
    };
    let body = html! {
        h1 { "Parked keys" }
        p.muted {
            "On an ordered queue, a key whose event failed keeps its later events here, in their order, "
            "until that head applies (a retry, or a replay of its dead letter). "
            "A key whose head was discarded waits for an operator: release it (its events apply without the head) "
            "or discard it (its events are written to a file, then removed)."
        }
        @if keys.is_empty() {
            p { "No key is parked." }
        } @else {
            table {
                thead { tr {
                    th { "key" } th { "head" } th { "head state" } th.n { "events held" }
                    th { "last error" } th { "parked since" } th { "act" }
                } }
                tbody {
                    @for key in &keys {
                        tr {
                            td { code { (key.key) } }
                            td { code { (key.head) } }
                            td { (head_state(key)) }
                            td.n { (key.events) }
                            td { (key.last_error.as_deref().unwrap_or("—")) }
                            td { (time(key.parked_at)) }
                            td {
                                @if who.may_act() {
                                    form method="post" action="/parked/preview" {
                                        input type="hidden" name="form_token" value=(console.form_token());
                                        input type="hidden" name="key" value=(key.key);
                                        div.actions {
                                            button type="submit" name="action" value="release" { "Release…" }
                                            button.danger type="submit" name="action" value="discard" { "Discard…" }
                                        }
                                    }
                                } @else {
                                    a href="/login" { "Log in to act" }
                                }
                            }
                        }
                    }
                }
            }
            @if keys.len() as i64 == KEYS_SHOWN {
                p.muted { "The oldest " (KEYS_SHOWN) " keys; `parked list` lists them all." }
            }
        }
    };
    layout("Parked keys", who.acting().as_deref(), body).into_response()
}

/// `POST /parked/preview`: what a release or a discard of a key would do,
/// and the button that does it.
pub(super) async fn preview<H: Handler>(
    State(console): State<Console<H>>,
    Acting { who, fields }: Acting,
) -> Response {
    let (kind, key, action) = match console.requested(&fields, true) {
        Ok(requested) => requested,
        Err(response) => return *response,
    };
    let report = match console.parked(&action).await {
        Ok(report) => report,
        Err(error) => return view::unavailable("the database", &error),
    };
    let body = html! {
        h1 { @match kind { Kind::Release => "Release", Kind::Discard => "Discard" } " a parked key — dry run" }
        pre { (report.to_string()) }
        @if report.done() {
            @match kind {
                Kind::Release => p { "Its parked events apply in their order, without its dead-lettered head." },
                Kind::Discard => p { "Its parked events are written to a file under " code { (console.inner.config.discard_dir.display()) } " (synced), then removed with the key." },
            }
            form method="post" action="/parked" {
                input type="hidden" name="form_token" value=(console.form_token());
                input type="hidden" name="key" value=(key);
                input type="hidden" name="action" value=(match kind { Kind::Release => "release", Kind::Discard => "discard" });
                div.actions {
                    @match kind {
                        Kind::Release => button type="submit" { "Release " (key) },
                        Kind::Discard => button.danger type="submit" { "Discard " (key) },
                    }
                    a href="/parked" { "Cancel" }
                }
            }
        } @else {
            p.refused { "Nothing to do." }
            p { a href="/parked" { "Parked keys" } }
        }
    };
    layout("Dry run", who.acting().as_deref(), body).into_response()
}

/// `POST /parked`: releases or discards a key, recorded in the audit.
pub(super) async fn act<H: Handler>(
    State(console): State<Console<H>>,
    Acting { who, fields }: Acting,
) -> Response {
    let (kind, key, action) = match console.requested(&fields, false) {
        Ok(requested) => requested,
        Err(response) => return *response,
    };
    let file = match &action {
        ParkedAction::Discard { file, .. } => Some(file.display().to_string()),
        _ => None,
    };
    let audited = Audited {
        id: 0,
        consumer_group: console.inner.config.target.consumer_group.clone(),
        action: kind.name().to_owned(),
        who: who.audited(),
        filter: format!("key {key}"),
        expected: 0,
        started_at: SystemTime::now(),
        finished_at: None,
        letters: None,
        outcome: None,
        file,
        edit: None,
    };
    let store = &console.inner.store;
    let started = async {
        let client = store.pool().get().await?;
        Ok::<_, crate::store::StoreError>(read::audit_start(&client, &audited).await?)
    };
    let id = match started.await {
        Ok(id) => id,
        Err(error) => return view::unavailable("the database", &error),
    };
    info!(id, action = kind.name(), who = %audited.who, key = %key, "console action started");
    let report = console.parked(&action).await;
    let events = match &report {
        Ok(ParkedReport::Discarded { events, .. }) => i64::try_from(*events).unwrap_or(i64::MAX),
        Ok(ParkedReport::Released { key, .. }) => key.events,
        _ => 0,
    };
    let outcome = match &report {
        Ok(report) => report.to_string().replace('\n', "; "),
        Err(error) => format!("failed: {error}"),
    };
    info!(id, %outcome, "console action ended");
    let ended = async {
        let client = store.pool().get().await?;
        read::audit_end(&client, id, events, &outcome).await?;
        Ok::<_, crate::store::StoreError>(())
    };
    if let Err(error) = ended.await {
        warn!(id, %error, "the audit could not record how a console action ended");
    }
    let body = html! {
        h1 { @match kind { Kind::Release => "Released", Kind::Discard => "Discarded" } }
        p { "Action " a href=(format!("/actions/{id}")) { "#" (id) } ", in the " a href="/audit" { "audit" } "." }
        pre { (outcome) }
        p { a href="/parked" { "Parked keys" } }
    };
    layout("Parked key", who.acting().as_deref(), body).into_response()
}
