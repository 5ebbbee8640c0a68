//! Edit and retry (`--allow-edits`): a letter whose body is wrong (a typo
//! in an id, a field its producer forgot) replayed with a body an operator
//! edited. The handler must decode the edit, as the same event where the
//! letter was a valid one; the operator sees both bodies and confirms; the
//! replay then runs as any replay of that one letter does (its copy acked
//! once the broker confirmed the edited message), the message naming the
//! letter it replaces, both bodies in the audit.

use std::time::SystemTime;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use tracing::info;

use super::Console;
use super::access::{Acting, refused};
use super::pages::{letter_href, shown_body};
use super::view::{Fields, layout};
use crate::dlq::{Action, DlqConfig, Filter};
use crate::handler::Handler;
use crate::progress::Progress;
use crate::store::console::{self as read, Audited};
use crate::worker::WorkerConfig;

/// An edit, checked: the letter, its body as it died, the edited body and
/// its event id.
struct Edit {
    letter: read::Letter,
    before: Vec<u8>,
    after: Vec<u8>,
    event_id: String,
}

/// Why an edit is refused: the status and what to tell the operator.
type Refused = (StatusCode, String);

impl<H: Handler> Console<H> {
    /// The edit `fields` ask for (`key`, `body`), checked against the
    /// console's settings, the letter the index keeps and the handler.
    async fn edit(&self, fields: &Fields) -> Result<Edit, Refused> {
        let config = &self.inner.config;
        if !config.allow_edits {
            return Err((
                StatusCode::FORBIDDEN,
                "edits are off on this console (it runs without --allow-edits)".to_owned(),
            ));
        }
        if config.hide_bodies {
            return Err((
                StatusCode::FORBIDDEN,
                "bodies are hidden on this console: an edit would show them".to_owned(),
            ));
        }
        let (Some(key), Some(edited)) = (fields.one("key"), fields.one("body")) else {
            return Err((
                StatusCode::BAD_REQUEST,
                "no letter or no body given".to_owned(),
            ));
        };
        let read = async {
            let client = self.inner.store.pool().get().await?;
            Ok::<_, crate::store::StoreError>(
                read::letter(&client, &config.target.consumer_group, key).await?,
            )
        };
        let letter = match read.await {
            Ok(Some(letter)) => letter,
            Ok(None) => {
                return Err((
                    StatusCode::NOT_FOUND,
                    format!("no letter {key}: it was replayed or discarded since"),
                ));
            }
            Err(error) => {
                return Err((
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("the database cannot be read: {error}"),
                ));
            }
        };
        let before = whole_body(&letter).ok_or_else(|| {
            (
                StatusCode::CONFLICT,
                "the index keeps only part of this letter's body, or none: it cannot be edited \
                 here"
                    .to_owned(),
            )
        })?;
        let after = edited.as_bytes().to_vec();
        if after == before {
            return Err((
                StatusCode::BAD_REQUEST,
                "the body is the letter's own: nothing was edited (a replay sends it as it is)"
                    .to_owned(),
            ));
        }
        let event = crate::worker::decode(
            &*self.inner.handler,
            &after,
            WorkerConfig::DEFAULT_MAX_BODY_BYTES,
        )
        .map_err(|invalid| {
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("the handler cannot decode the edited body: {invalid}"),
            )
        })?;
        let event_id = self.inner.handler.event_id(&event).to_owned();
        if let Some(was) = letter
            .row
            .event_id
            .as_deref()
            .filter(|was| *was != event_id)
        {
            return Err((
                StatusCode::UNPROCESSABLE_ENTITY,
                format!(
                    "the edit changes the event id from {was} to {event_id}: an edit mends a \
                     letter, it does not make another event"
                ),
            ));
        }
        Ok(Edit {
            letter,
            before,
            after,
            event_id,
        })
    }
}

/// The letter's body, when the index keeps it whole.
fn whole_body(letter: &read::Letter) -> Option<Vec<u8>> {
    let body = letter.body.as_ref()?;
    let whole = letter
        .body_bytes
        .is_some_and(|n| usize::try_from(n).ok() == Some(body.len()));
    whole.then(|| body.clone())
}

/// What the letter's page offers whoever may act: the letter's body to
/// edit, where the console allows edits and the index keeps it whole.
pub(super) fn offered<H: Handler>(console: &Console<H>, letter: &read::Letter) -> Markup {
    let config = &console.inner.config;
    let body = whole_body(letter).filter(|_| config.allow_edits && !config.hide_bodies);
    html! {
        @if let Some(body) = body {
            details.edit {
                summary { "Edit and retry…" }
                (edit_form(&console.form_token(), &letter.row.key, &String::from_utf8_lossy(&body)))
            }
        }
    }
}

/// The form that edits `key`'s letter, holding `body`: on the letter's
/// page, and again where an edit was refused.
fn edit_form(form_token: &str, key: &str, body: &str) -> Markup {
    html! {
        form.edit method="post" action="/edits/preview" {
            input type="hidden" name="form_token" value=(form_token);
            input type="hidden" name="key" value=(key);
            label for="edited" { "The body to send in its place" }
            textarea #edited name="body" rows="12" spellcheck="false" { (body) }
            div.actions {
                button type="submit" { "Check the edit…" }
            }
        }
    }
}

/// `POST /edits/preview`: the letter's body beside the edit, once the
/// handler decodes it; asks to confirm.
pub(super) async fn preview<H: Handler>(
    State(console): State<Console<H>>,
    Acting { who, fields }: Acting,
) -> Response {
    let acting = who.acting();
    let edit = match console.edit(&fields).await {
        Ok(edit) => edit,
        Err((status, why)) => return refused_edit(&console, &fields, status, &why, acting),
    };
    let key = &edit.letter.row.key;
    let body = html! {
        h1 { "Edit and retry — check" }
        p {
            "Letter " a href=(letter_href(key)) { code { (key) } }
            ", event " code { (edit.event_id) } ", back to " code { (edit.letter.queue) } "."
        }
        (bodies(&edit.before, &edit.after))
        p {
            "The handler decodes the edit. Sent, it carries the header "
            code { (crate::broker::death::REPLACES_HEADER) } " naming this letter, with a fresh \
             budget of attempts; the letter is acked once the broker confirmed it. The audit \
             keeps both bodies."
        }
        form method="post" action="/edits" {
            input type="hidden" name="form_token" value=(console.form_token());
            input type="hidden" name="key" value=(key);
            textarea name="body" hidden { (String::from_utf8_lossy(&edit.after)) }
            div.actions {
                button type="submit" { "Send the edited letter" }
                a href=(letter_href(key)) { "Cancel" }
            }
        }
    };
    layout("Edit and retry", acting.as_deref(), body).into_response()
}

/// An edit refused for `why`, with the form again where the operator can
/// mend it.
fn refused_edit<H: Handler>(
    console: &Console<H>,
    fields: &Fields,
    status: StatusCode,
    why: &str,
    acting: Option<String>,
) -> Response {
    let (Some(key), Some(edited)) = (fields.one("key"), fields.one("body")) else {
        return refused(status, why);
    };
    if !console.inner.config.allow_edits || console.inner.config.hide_bodies {
        return refused(status, why);
    }
    let body = html! {
        h1 { "Edit and retry — refused" }
        p.refused { (why) }
        (edit_form(&console.form_token(), key, edited))
        p { a href=(letter_href(key)) { "Back to the letter" } }
    };
    (status, layout("Edit refused", acting.as_deref(), body)).into_response()
}

/// `POST /edits`: checks the edit again and replays the letter with it,
/// recorded in the audit with both bodies; its page follows it.
pub(super) async fn start<H: Handler>(
    State(console): State<Console<H>>,
    Acting { who, fields }: Acting,
) -> Response {
    let Edit {
        letter,
        before,
        after,
        event_id,
    } = match console.edit(&fields).await {
        Ok(edit) => edit,
        Err((status, why)) => return refused_edit(&console, &fields, status, &why, who.acting()),
    };
    let config = &console.inner.config;
    let key = letter.row.key.clone();
    let audited = Audited {
        id: 0,
        consumer_group: config.target.consumer_group.clone(),
        action: "edit".to_owned(),
        who: who.audited(),
        filter: format!("letter {key}, replayed edited"),
        expected: i64::from(letter.row.copies),
        started_at: SystemTime::now(),
        finished_at: None,
        letters: None,
        outcome: None,
        file: None,
        edit: Some((before, after.clone())),
    };
    let id = match console.inner.store.pool().get().await {
        Ok(client) => read::audit_start(&client, &audited).await,
        Err(error) => return super::view::unavailable("the database", &error),
    };
    let id = match id {
        Ok(id) => id,
        Err(error) => return super::view::unavailable("the database", &error),
    };
    let mut dlq = DlqConfig::new(config.target.clone());
    dlq.filter = Filter {
        keys: vec![key.clone()],
        ..Filter::default()
    };
    let action = Action::ReplayEdited {
        body: after,
        event_id,
    };
    let progress = Progress::counted();
    if let Ok(mut running) = console.inner.running.lock() {
        running.insert(id, progress.clone());
    }
    info!(id, action = "edit", who = %audited.who, letter = %key, "console action started");
    console.inner.tasks.spawn(super::actions::run(
        console.clone(),
        id,
        dlq,
        action,
        progress,
    ));
    Redirect::to(&format!("/actions/{id}")).into_response()
}

/// An edit's two bodies, as the action's page shows them.
pub(super) fn bodies(before: &[u8], after: &[u8]) -> Markup {
    html! {
        div.bodies {
            div { h2 { "The letter's body" } pre.body { (shown_body(before)) } }
            div { h2 { "Sent in its place" } pre.body { (shown_body(after)) } }
        }
    }
}
