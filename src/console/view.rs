//! What every page shares: the frame, the fields of a form or a query,
//! times, the chart, the stylesheet.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use maud::{DOCTYPE, Markup, html};

/// A page: the frame around `body`; `acting` names who may act, when
/// someone may.
pub(super) fn layout(title: &str, acting: Option<&str>, body: Markup) -> Html<String> {
    let page = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · idem console" }
                link rel="stylesheet" href="/console.css";
            }
            body {
                header {
                    nav {
                        strong { "idem" }
                        a href="/" { "Overview" }
                        a href="/groups" { "Failure groups" }
                        a href="/parked" { "Parked keys" }
                        a href="/audit" { "Audit" }
                        span.who {
                            @match acting {
                                Some(who) => { a href="/login" { (who) } }
                                None => { a href="/login" { "Log in to act" } }
                            }
                        }
                    }
                }
                main { (body) }
            }
        }
    };
    Html(page.into_string())
}

/// What a reader who may not act sees where the actions would be: a way
/// to log in, not buttons that would be refused.
pub(super) fn log_in_to(what: &str) -> Markup {
    html! {
        p.muted.act { a href="/login" { "Log in" } " to " (what) "." }
    }
}

/// The fields of a form or a query string, each name possibly more than
/// once (the letters ticked in a listing).
#[derive(Debug, Default)]
pub(super) struct Fields(Vec<(String, String)>);

impl Fields {
    pub(super) fn parse(bytes: &[u8]) -> Self {
        Self(
            form_urlencoded::parse(bytes)
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect(),
        )
    }

    pub(super) fn query(query: Option<&str>) -> Self {
        Self::parse(query.unwrap_or_default().as_bytes())
    }

    /// The first non-empty value of `name`.
    pub(super) fn one(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, v)| k == name && !v.trim().is_empty())
            .map(|(_, v)| v.trim())
    }

    /// Every value of `name`.
    pub(super) fn all(&self, name: &str) -> Vec<String> {
        self.0
            .iter()
            .filter(|(k, v)| k == name && !v.is_empty())
            .map(|(_, v)| v.clone())
            .collect()
    }
}

/// A time as the pages show it: UTC, to the second.
pub(super) fn time(at: SystemTime) -> String {
    crate::duration::rfc3339(at.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs())
}

/// An optional time, or a dash.
pub(super) fn maybe_time(at: Option<SystemTime>) -> String {
    at.map_or_else(|| "—".to_owned(), time)
}

/// A time for a `datetime-local` field: `2026-12-06T12:30:00`.
pub(super) fn field_time(at: SystemTime) -> String {
    time(at).trim_end_matches('Z').to_owned()
}

/// Letters that came per hour over the last `hours`, as bars: drawn here,
/// an SVG in the page (no script, no image to fetch).
pub(super) fn chart(hourly: &[(SystemTime, i64)], now: SystemTime, hours: u64) -> Markup {
    // A bar per hour, the current one last.
    let (width, height, bar) = ((hours + 1) as f64 * 12.0, 80.0, 10.0);
    let start = now - Duration::from_secs(hours * 3600);
    let start_hour = start
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
        / 3600;
    let mut per_hour = vec![0_i64; usize::try_from(hours).unwrap_or(0) + 1];
    for (hour, letters) in hourly {
        let at = hour
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs()
            / 3600;
        if let Some(slot) = at
            .checked_sub(start_hour)
            .and_then(|i| per_hour.get_mut(usize::try_from(i).unwrap_or(usize::MAX)))
        {
            *slot += letters;
        }
    }
    let most = per_hour.iter().copied().max().unwrap_or(0).max(1) as f64;
    let total: i64 = per_hour.iter().sum();
    html! {
        figure.chart {
            svg xmlns="http://www.w3.org/2000/svg" width=(width) height=(height + 14.0)
                viewBox=(format!("0 0 {width} {}", height + 14.0)) role="img"
                aria-label=(format!("{total} letters dead-lettered in the last {hours} hours")) {
                @for (i, letters) in per_hour.iter().enumerate() {
                    @let h = if *letters > 0 { (*letters as f64 / most * height).max(2.0) } else { 0.0 };
                    rect x=(i as f64 * 12.0) y=(height - h) width=(bar) height=(h) {
                        title { (format!("{}: {letters}", time(UNIX_EPOCH + Duration::from_secs((start_hour + i as u64) * 3600)))) }
                    }
                }
                line x1="0" y1=(height) x2=(width) y2=(height) {}
                text x="0" y=(height + 12.0) { (format!("{hours} h ago")) }
                text x=(width) y=(height + 12.0) text-anchor="end" { "now" }
            }
            figcaption { (total) " letters dead-lettered in the last " (hours) " hours (most in an hour: " (most as i64) ")" }
        }
    }
}

/// `GET /console.css`.
pub(super) async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=3600"),
        ],
        include_str!("console.css"),
    )
        .into_response()
}

/// Any other address.
pub(super) async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        layout(
            "Not found",
            None,
            html! { h1 { "Not found" } p { a href="/" { "Overview" } } },
        ),
    )
        .into_response()
}

/// A page saying the database or the broker could not answer.
pub(super) fn unavailable(what: &str, error: &dyn std::fmt::Display) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        layout(
            "Unavailable",
            None,
            html! { h1 { "Unavailable" } p.refused { (what) ": " (error) } },
        ),
    )
        .into_response()
}
