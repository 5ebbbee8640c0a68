//! The pages that read: the overview, the failure groups, a group's
//! letters, one letter, the audit.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use uuid::Uuid;

use super::Console;
use super::access::Reader;
use super::view::{self, Fields, layout, maybe_time, time};
use crate::broker::connect_with_retry;
use crate::commands::status::{self, QueueState};
use crate::handler::Handler;
use crate::store::console::{self as read, Group, LetterRow, Search};

/// Groups on a page.
const GROUPS_SHOWN: i64 = 50;
/// Letters on a page.
const LETTERS_SHOWN: i64 = 50;
/// Actions on a page of the audit.
const AUDIT_SHOWN: i64 = 100;
/// The chart's span.
const CHART_HOURS: u64 = 24;

/// The most other consumer groups the overview lists.
const OTHER_GROUPS_SHOWN: i64 = 50;

/// How long the overview waits for the broker before it shows the page
/// without the queues.
const BROKER_WAIT: Duration = Duration::from_secs(2);

/// `GET /`: the consumer group at a glance.
pub(super) async fn overview<H: Handler>(
    State(console): State<Console<H>>,
    Reader(who): Reader,
) -> Response {
    let store = &console.inner.store;
    let group = &console.inner.config.target.consumer_group;
    let read = async {
        let tables = status::tables(store).await?;
        let now = SystemTime::now();
        let since = now - Duration::from_secs(CHART_HOURS * 3600);
        let client = store.pool().get().await?;
        let hourly = read::hourly(&client, group, since).await?;
        let others = read::other_groups(&client, group, OTHER_GROUPS_SHOWN).await?;
        Ok::<_, crate::store::StoreError>((tables, (hourly, others), now))
    };
    let (
        status::Tables {
            records,
            epochs,
            failing,
            index: totals,
            parked,
        },
        (hourly, others),
        now,
    ) = match read.await {
        Ok(read) => read,
        Err(error) => return view::unavailable("the database", &error),
    };
    let queues = console.queues().await;
    let body = html! {
        h1 { "Consumer group " code { (group) } }
        div.cards {
            div.card { div.n { (totals.letters) } "dead letters (index)" }
            div.card { div.n { (failing.0) @if failing.1 { "+" } } "events failing now" }
            div.card { div.n { (records.0) } "consume records" div.muted { "oldest " (maybe_time(records.1)) } }
            div.card { div.n { (epochs.epochs) } "epochs" div.muted { (epochs.filtered) " closed with a filter" } }
            @if parked.keys > 0 || console.inner.config.target.topology.is_ordered() {
                div.card {
                    div.n { a href="/parked" { (parked.keys) } }
                    "parked keys"
                    div.muted { (parked.events) " events held, " (parked.dead_heads) " behind a dead letter" }
                }
            }
        }
        h2 { "Queues" }
        @match &queues {
            Ok(queues) => {
                table {
                    thead { tr { th { "queue" } th.n { "ready" } th.n { "consumers" } } }
                    tbody {
                        @for queue in queues {
                            tr {
                                td { code { (queue.name) } }
                                @match queue.counts {
                                    Some((ready, consumers)) => { td.n { (ready) } td.n { (consumers) } }
                                    None => { td.n.muted colspan="2" { "not declared" } }
                                }
                            }
                        }
                    }
                }
            }
            Err(error) => { p.refused { "RabbitMQ could not be reached: " (error) } }
        }
        h2 { "Dead letters by reason" }
        @if totals.reasons.is_empty() {
            p.muted { "None." }
        } @else {
            table {
                thead { tr { th { "reason" } th.n { "letters" } } }
                tbody {
                    @for (reason, letters) in &totals.reasons {
                        tr { td { (reason) } td.n { (letters) } }
                    }
                }
            }
        }
        p.muted { "Index last synced with the queue: " (maybe_time(totals.synced_at)) }
        h2 { "Dead-lettering over time" }
        (view::chart(&hourly, now, CHART_HOURS))
        p { a href="/groups" { "See the failure groups →" } }
        @if !others.is_empty() {
            h2 { "Other consumer groups in this schema" }
            table {
                thead { tr { th { "consumer group" } th.n { "dead letters (index)" } } }
                tbody {
                    @for (name, letters) in &others {
                        tr { td { code { (name) } } td.n { (letters) } }
                    }
                }
            }
            p.muted {
                "Each has a console of its own: " code { "console --consumer-group NAME" } "."
                @if others.len() as i64 == OTHER_GROUPS_SHOWN { " The first " (OTHER_GROUPS_SHOWN) " by name." }
            }
        }
    };
    layout("Overview", who.acting().as_deref(), body).into_response()
}

impl<H: Handler> Console<H> {
    /// Each queue of the topology with its ready messages and consumers,
    /// over a connection kept between pages.
    async fn queues(&self) -> Result<Vec<QueueState>, String> {
        let config = &self.inner.config;
        let mut broker = self.inner.broker.lock().await;
        if broker.as_ref().is_none_or(|c| !c.status().connected()) {
            let connection = connect_with_retry(
                &config.target.amqp,
                "idem console",
                BROKER_WAIT,
                &self.inner.shutdown,
            )
            .await
            .map_err(|e| e.to_string())?;
            *broker = Some(connection);
        }
        let Some(connection) = broker.as_ref() else {
            return Err("not connected".to_owned());
        };
        status::queue_states(connection, &config.target.topology)
            .await
            .map_err(|e| e.to_string())
    }
}

/// `GET /groups`: the failure groups, most letters first.
pub(super) async fn groups<H: Handler>(
    State(console): State<Console<H>>,
    Reader(who): Reader,
    RawQuery(query): RawQuery,
) -> Response {
    let fields = Fields::query(query.as_deref());
    let page: i64 = fields
        .one("page")
        .and_then(|p| p.parse().ok())
        .unwrap_or(0)
        .max(0);
    let listed = async {
        let client = console.inner.store.pool().get().await?;
        let listed = read::groups(
            &client,
            &console.inner.config.target.consumer_group,
            page * GROUPS_SHOWN,
            GROUPS_SHOWN,
        )
        .await?;
        Ok::<_, crate::store::StoreError>(listed)
    };
    let (groups, count) = match listed.await {
        Ok(listed) => listed,
        Err(error) => return view::unavailable("the database", &error),
    };
    let body = html! {
        h1 { "Failure groups" }
        p.muted { (count) " groups: dead letters grouped by their last error, numbers, ids and quoted values taken out." }
        @if groups.is_empty() {
            p { "No dead letters." }
        } @else {
            table {
                thead { tr {
                    th { "error" } th.n { "letters" } th.n { "would apply" } th.n { "applied already" }
                    th.n { "invalid bodies" } th { "first" } th { "last" } th { "sample" }
                } }
                tbody {
                    @for group in &groups {
                        tr {
                            td { a href=(format!("/groups/{}", group.id)) { (fingerprint(group)) } }
                            td.n { (group.letters) }
                            td.n { (group.would_apply) }
                            td.n { (group.applied) }
                            td.n { (group.invalid) }
                            td { (maybe_time(group.first)) }
                            td { (maybe_time(group.last)) }
                            td { @if let Some((key, error)) = &group.sample {
                                a href=(letter_href(key)) { (error.as_deref().unwrap_or(key)) }
                            } }
                        }
                    }
                }
            }
            div.actions {
                @if page > 0 { a href=(format!("/groups?page={}", page - 1)) { "← Previous" } }
                @if (page + 1) * GROUPS_SHOWN < count { a href=(format!("/groups?page={}", page + 1)) { "Next →" } }
            }
        }
    };
    layout("Failure groups", who.acting().as_deref(), body).into_response()
}

fn fingerprint(group: &Group) -> &str {
    if group.fingerprint.is_empty() {
        "(no failure recorded)"
    } else {
        &group.fingerprint
    }
}

/// The address of a letter's page.
pub(super) fn letter_href(key: &str) -> String {
    format!(
        "/letter?key={}",
        form_urlencoded::byte_serialize(key.as_bytes()).collect::<String>()
    )
}

/// A search within a group, from a query or a form.
pub(super) fn search(fields: &Fields) -> Result<Search, String> {
    let at = |name: &str| {
        fields
            .one(name)
            .map(|text| {
                crate::duration::parse_utc(text)
                    .map(|s| UNIX_EPOCH + Duration::from_secs(s))
                    .ok_or_else(|| format!("'{text}' is not a time (2026-12-06T12:30, UTC)"))
            })
            .transpose()
    };
    Ok(Search {
        event_id: fields.one("event_id").map(str::to_owned),
        error: fields.one("error").map(str::to_owned),
        from: at("from")?,
        to: at("to")?,
    })
}

/// The search's fields, to carry into a link or a form.
pub(super) fn search_fields(search: &Search) -> Vec<(&'static str, String)> {
    let mut fields = Vec::new();
    if let Some(id) = &search.event_id {
        fields.push(("event_id", id.clone()));
    }
    if let Some(error) = &search.error {
        fields.push(("error", error.clone()));
    }
    if let Some(from) = search.from {
        fields.push(("from", view::field_time(from)));
    }
    if let Some(to) = search.to {
        fields.push(("to", view::field_time(to)));
    }
    fields
}

/// `GET /groups/{id}`: a group's letters, searched and paged, with the
/// actions on them.
pub(super) async fn group<H: Handler>(
    State(console): State<Console<H>>,
    Reader(who): Reader,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let Ok(id) = Uuid::parse_str(&id) else {
        return view::not_found().await;
    };
    let fields = Fields::query(query.as_deref());
    let search = match search(&fields) {
        Ok(search) => search,
        Err(why) => return super::access::refused(StatusCode::BAD_REQUEST, &why),
    };
    let after = fields.one("after").and_then(|after| {
        let (seconds, key) = after.split_once('|')?;
        let micros: u64 = seconds.parse().ok()?;
        Some((UNIX_EPOCH + Duration::from_micros(micros), key.to_owned()))
    });
    let group_id = id;
    let read = async {
        let mut client = console.inner.store.pool().get().await?;
        let consumer_group = &console.inner.config.target.consumer_group;
        let group = read::group_by_id(&client, consumer_group, group_id).await?;
        let letters = read::letters(
            &mut client,
            consumer_group,
            group_id,
            &search,
            after,
            LETTERS_SHOWN,
        )
        .await?;
        Ok::<_, crate::store::StoreError>((group, letters))
    };
    let (group, page) = match read.await {
        Ok(read) => read,
        Err(error) => return view::unavailable("the database", &error),
    };
    let Some(group) = group else {
        let body = html! {
            h1 { "No such group" }
            p { "This group has no dead letters (any more): they were replayed or discarded." }
            p { a href="/groups" { "Failure groups" } }
        };
        return (
            StatusCode::NOT_FOUND,
            layout("No such group", who.acting().as_deref(), body),
        )
            .into_response();
    };
    let form_token = who.may_act().then(|| console.form_token());
    let body = group_page(&id, &group, &page, &search, form_token.as_deref());
    layout("Failure group", who.acting().as_deref(), body).into_response()
}

/// The body of a group's page: its counts, the search form, the actions on
/// the group or the search, and a page of its letters.
fn group_page(
    id: &Uuid,
    group: &Group,
    page: &read::LetterPage,
    search: &Search,
    // The form token of a reader who may act; `None` for one who may not.
    form_token: Option<&str>,
) -> Markup {
    let letters = &page.letters;
    let next = page.next.as_ref().map(|(dead_at, key)| {
        let micros = dead_at
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros();
        let mut pairs: Vec<(&str, String)> = search_fields(search);
        pairs.push(("after", format!("{micros}|{key}")));
        format!("/groups/{id}?{}", encode(&pairs))
    });
    let searched = search.event_id.is_some()
        || search.error.is_some()
        || search.from.is_some()
        || search.to.is_some();
    html! {
        h1 { "Group: " (fingerprint(group)) }
        div.cards {
            div.card { div.n { (group.letters) } "letters" }
            div.card { div.n { (group.would_apply) } "a replay would apply" }
            div.card { div.n { (group.applied) } "applied already" }
            div.card { div.n { (group.invalid) } "invalid bodies" }
            div.card { "first " (maybe_time(group.first)) br; "last " (maybe_time(group.last)) }
        }
        p.muted { "Group id " code { (group.id) } " (" code { "dlq replay --group " (group.id) } ")" }
        form.search method="get" action=(format!("/groups/{id}")) {
            label { "event id" input type="text" name="event_id" value=(search.event_id.as_deref().unwrap_or_default()); }
            label { "error contains" input type="text" name="error" value=(search.error.as_deref().unwrap_or_default()); }
            label { "died from (UTC)" input type="datetime-local" step="1" name="from" value=(search.from.map(view::field_time).unwrap_or_default()); }
            label { "until (UTC)" input type="datetime-local" step="1" name="to" value=(search.to.map(view::field_time).unwrap_or_default()); }
            button.plain type="submit" { "Search" }
            @if searched { a href=(format!("/groups/{id}")) { "clear" } }
        }
        @if let Some(form_token) = form_token {
            form method="post" action="/actions/preview" {
                input type="hidden" name="form_token" value=(form_token);
                input type="hidden" name="group" value=(group.id);
                @for (name, value) in search_fields(search) {
                    input type="hidden" name=(name) value=(value);
                }
                div.actions {
                    button type="submit" name="action" value="replay" { @if searched { "Replay the search's letters…" } @else { "Replay the group…" } }
                    button.danger type="submit" name="action" value="discard" { @if searched { "Discard the search's letters…" } @else { "Discard the group…" } }
                }
            }
            form method="post" action="/actions/preview" {
                input type="hidden" name="form_token" value=(form_token);
                input type="hidden" name="group" value=(group.id);
                (letters_table(letters, true))
                @if page.searched_out {
                    p.muted { "This page looked at " (read::SEARCHED) " letters and found these; the next page searches the older ones." }
                }
                div.actions {
                    button type="submit" name="action" value="replay-selected" { "Replay selected…" }
                    button.danger type="submit" name="action" value="discard-selected" { "Discard selected…" }
                    @if let Some(next) = &next { a href=(next) { "Next page →" } }
                }
            }
        } @else {
            (view::log_in_to("replay or discard these letters"))
            (letters_table(letters, false))
            @if page.searched_out {
                p.muted { "This page looked at " (read::SEARCHED) " letters and found these; the next page searches the older ones." }
            }
            @if let Some(next) = &next { div.actions { a href=(next) { "Next page →" } } }
        }
    }
}

/// A letter's body and headers; only their size, digest and names when
/// the console hides bodies.
fn letter_contents(letter: &read::Letter, hide: bool) -> Markup {
    html! {
        h2 { "Body" }
        p.muted {
            (letter.body_bytes.map_or_else(|| "size unknown".to_owned(), |n| format!("{n} bytes")))
            @if let Some(digest) = &letter.body_sha256 { ", SHA-256 " code { (digest.iter().map(|b| format!("{b:02x}")).collect::<String>()) } }
        }
        @if hide {
            p.muted { "Bodies are hidden on this console." }
        } @else {
            @match &letter.body {
                Some(body) => {
                    pre.body { (shown_body(body)) }
                    @if letter.body_bytes.is_some_and(|n| usize::try_from(n).unwrap_or(0) > body.len()) {
                        p.muted { "The first " (body.len()) " bytes: the index keeps no more." }
                    }
                }
                None => { p.muted { "The index keeps no body for this letter (dead-lettered before the console's migration, or with bodies not kept): " code { "dlq list --event-id" } " shows it from the queue." } }
            }
        }
        h2 { "Headers" }
        @match &letter.headers {
            Some(headers) if hide => {
                p.muted { "Hidden on this console; their names: "
                    (headers.get("headers").and_then(|h| h.as_object()).map(|h| h.keys().cloned().collect::<Vec<_>>().join(", ")).unwrap_or_default()) }
            }
            Some(headers) => { pre { (serde_json::to_string_pretty(headers).unwrap_or_default()) } }
            None => { p.muted { "Not kept for this letter." } }
        }
    }
}

/// Query-string pairs, encoded.
pub(super) fn encode(pairs: &[(&str, String)]) -> String {
    form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs.iter().map(|(k, v)| (*k, v.as_str())))
        .finish()
}

fn letters_table(letters: &[LetterRow], selectable: bool) -> Markup {
    html! {
        @if letters.is_empty() {
            p.muted { "No letter matches." }
        } @else {
            table {
                thead { tr {
                    @if selectable { th { "" } }
                    th { "event" } th { "died" } th { "reason" } th.n { "copies" } th { "last error" } th { "a replay" }
                } }
                tbody {
                    @for letter in letters {
                        tr {
                            @if selectable { td { input type="checkbox" name="keys" value=(letter.key) aria-label=(format!("select {}", letter.key)); } }
                            td { a href=(letter_href(&letter.key)) { (letter.event_id.as_deref().unwrap_or(&letter.key)) } }
                            td { (time(letter.dead_at)) }
                            td { (letter.reason) }
                            td.n { (letter.copies) }
                            td { (letter.error.as_deref().unwrap_or("—")) }
                            td { (verdict(letter.invalid, Some(letter.applied))) }
                        }
                    }
                }
            }
        }
    }
}

/// What a replay would do with a letter, as `dlq` says it.
fn verdict(invalid: bool, applied: Option<bool>) -> &'static str {
    match (invalid, applied) {
        (true, _) => "leaves it: the body is invalid",
        (false, Some(true)) => "is acked as a duplicate: applied already",
        (false, Some(false)) => "applies it",
        (false, None) => "applies it, unless applied since",
    }
}

/// `GET /letter?key=…`: one letter, whole.
pub(super) async fn letter<H: Handler>(
    State(console): State<Console<H>>,
    Reader(who): Reader,
    RawQuery(query): RawQuery,
) -> Response {
    let fields = Fields::query(query.as_deref());
    let Some(key) = fields.one("key") else {
        return view::not_found().await;
    };
    let read = async {
        let client = console.inner.store.pool().get().await?;
        Ok::<_, crate::store::StoreError>(
            read::letter(&client, &console.inner.config.target.consumer_group, key).await?,
        )
    };
    let letter = match read.await {
        Ok(Some(letter)) => letter,
        Ok(None) => {
            let body = html! {
                h1 { "No such letter" }
                p { "The index has no letter " code { (key) } ": it was replayed or discarded, or never dead-lettered here." }
            };
            return (
                StatusCode::NOT_FOUND,
                layout("No such letter", who.acting().as_deref(), body),
            )
                .into_response();
        }
        Err(error) => return view::unavailable("the database", &error),
    };
    let hide = console.inner.config.hide_bodies;
    let row = &letter.row;
    let body = html! {
        h1 { "Letter " code { (row.event_id.as_deref().unwrap_or(&row.key)) } }
        table {
            tbody {
                tr { th { "key" } td { code { (row.key) } } }
                tr { th { "event id" } td { (row.event_id.as_deref().unwrap_or("— (the body is not a valid event)")) } }
                tr { th { "died in" } td { code { (letter.queue) } ", " (row.reason) ", " (time(row.dead_at)) } }
                tr { th { "copies in the queue" } td { (row.copies) } }
                tr { th { "group" } td { a href=(format!("/groups/{}", letter.group)) { (letter.group) } } }
                tr { th { "applied since" } td { @match letter.applied_now {
                    Some(true) => { span.ok { "yes" } " — the group has applied this event" }
                    Some(false) => { "no" }
                    None => { "—" }
                } } }
                tr { th { "a replay now" } td { strong { (verdict(row.invalid, letter.applied_now)) } } }
            }
        }
        (failures(&letter))
        (letter_contents(&letter, hide))
        @if who.may_act() {
            (super::edits::offered(&console, &letter))
        }
        @if who.may_act() {
            form method="post" action="/actions/preview" {
                input type="hidden" name="form_token" value=(console.form_token());
                input type="hidden" name="group" value=(letter.group);
                input type="hidden" name="keys" value=(row.key);
                div.actions {
                    button type="submit" name="action" value="replay-selected" { "Replay this letter…" }
                    button.danger type="submit" name="action" value="discard-selected" { "Discard this letter…" }
                }
            }
        } @else {
            (view::log_in_to("replay or discard this letter"))
        }
    };
    layout("Letter", who.acting().as_deref(), body).into_response()
}

/// A letter's failures (when it died, with the handler's detail, and in
/// the ledger now) and the deaths the broker recorded.
fn failures(letter: &read::Letter) -> Markup {
    let row = &letter.row;
    html! {
    h2 { "Failures" }
    table {
        thead { tr { th { "" } th.n { "failures" } th { "error" } th { "first" } th { "last" } } }
        tbody {
            tr {
                td { "when it died" }
                td.n { (letter.failures) }
                td {
                    (row.error.as_deref().unwrap_or("—"))
                    @if let Some(detail) = death_detail(letter) {
                        div.detail { "the handler's detail: " q { (detail) } }
                    }
                }
                td { "—" }
                td { (time(row.dead_at)) }
            }
            @if let Some((failures, error, first, last)) = &letter.ledger {
                tr { td { "the ledger now" } td.n { (failures) } td { (error) } td { (maybe_time(*first)) } td { (maybe_time(*last)) } }
            }
        }
    }
    @if let Some(deaths) = letter.headers.as_ref().and_then(|h| h.pointer("/headers/x-death")).and_then(|d| d.as_array()) {
        h3 { "Deaths the broker recorded (x-death)" }
        table {
            thead { tr { th { "queue" } th { "reason" } th.n { "count" } th { "time" } } }
            tbody {
                @for death in deaths {
                    tr {
                        td { (death.get("queue").and_then(|v| v.as_str()).unwrap_or("—")) }
                        td { (death.get("reason").and_then(|v| v.as_str()).unwrap_or("—")) }
                        td.n { (death.get("count").map(|v| v.to_string()).unwrap_or_default()) }
                        td { (death.get("time").and_then(serde_json::Value::as_u64).map(crate::duration::rfc3339).unwrap_or_default()) }
                    }
                }
            }
        }
    }
    }
}

/// The handler's detail of the failure that killed `letter`, which idem's
/// dead-letter copy carries in a header of its own.
fn death_detail(letter: &read::Letter) -> Option<&str> {
    letter
        .headers
        .as_ref()?
        .get("headers")?
        .get(crate::broker::death::DEATH_DETAIL_HEADER)?
        .as_str()
}

/// A body as text: pretty-printed JSON where it is JSON, its keys in the
/// order they were sent, the text (bytes that are not UTF-8 replaced)
/// otherwise. Escaped by the template.
pub(super) fn shown_body(body: &[u8]) -> String {
    let mut pretty = Vec::with_capacity(body.len() * 2);
    let mut from = serde_json::Deserializer::from_slice(body);
    let mut to = serde_json::Serializer::pretty(&mut pretty);
    // Streamed, not read into a map: a map would sort the keys.
    let transcoded = serde_transcode::transcode(&mut from, &mut to).and_then(|()| from.end());
    match (transcoded, String::from_utf8(pretty)) {
        (Ok(()), Ok(text)) => text,
        _ => String::from_utf8_lossy(body).into_owned(),
    }
}

/// `GET /audit`: every action taken from the console, newest first.
pub(super) async fn audit<H: Handler>(
    State(console): State<Console<H>>,
    Reader(who): Reader,
    RawQuery(query): RawQuery,
) -> Response {
    let fields = Fields::query(query.as_deref());
    let before: Option<i64> = fields.one("before").and_then(|b| b.parse().ok());
    let read = async {
        let client = console.inner.store.pool().get().await?;
        Ok::<_, crate::store::StoreError>(read::audit(&client, before, AUDIT_SHOWN).await?)
    };
    let actions = match read.await {
        Ok(actions) => actions,
        Err(error) => return view::unavailable("the database", &error),
    };
    let body = html! {
        h1 { "Audit" }
        p.muted { "Every replay and discard started from a console on this database." }
        @if actions.is_empty() {
            p { "Nothing was done from the console yet." }
        } @else {
            table {
                thead { tr {
                    th.n { "#" } th { "started" } th { "who" } th { "action" } th { "group" } th { "letters" }
                    th.n { "expected" } th.n { "done" } th { "outcome" } th { "finished" }
                } }
                tbody {
                    @for action in &actions {
                        tr {
                            td.n { a href=(format!("/actions/{}", action.id)) { (action.id) } }
                            td { (time(action.started_at)) }
                            td { (action.who) }
                            td { (action.action) }
                            td { code { (action.consumer_group) } }
                            td { (action.filter) }
                            td.n { (action.expected) }
                            td.n { (action.letters.map(|n| n.to_string()).unwrap_or_default()) }
                            td { (action.outcome.as_deref().unwrap_or("running, or its process stopped")) }
                            td { (maybe_time(action.finished_at)) }
                        }
                    }
                }
            }
            @if actions.len() == AUDIT_SHOWN as usize {
                @if let Some(last) = actions.last() {
                    p { a href=(format!("/audit?before={}", last.id)) { "Older →" } }
                }
            }
        }
    };
    layout("Audit", who.acting().as_deref(), body).into_response()
}
