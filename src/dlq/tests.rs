//! The dead letters' text and matching, without servers.

use std::time::Duration;

use super::*;
use crate::handler::Invalid;
use crate::store::dead_letters::event_key;
use std::time::SystemTime;

/// The event id of a body the handler can apply; for one it cannot,
/// why and how it starts (an entry's `invalid`).
fn event_id(handler: &impl Handler, body: &[u8]) -> Result<String, String> {
    decoded_id(handler, body).map_err(|invalid| described(&invalid, body))
}

/// `{"eventId": …, "points": N}`, N above 0.
struct Credits;

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Credit {
    event_id: String,
    points: i64,
}

impl Handler for Credits {
    type Event = Credit;

    const NAME: &'static str = "credits";

    fn decode(&self, body: &[u8]) -> Result<Credit, Invalid> {
        let credit: Credit = serde_json::from_slice(body)?;
        if credit.points <= 0 {
            return Err(Invalid::new(format!(
                "field `points` must be above 0, got {}",
                credit.points
            )));
        }
        Ok(credit)
    }

    fn event_id<'e>(&self, event: &'e Credit) -> &'e str {
        &event.event_id
    }
}

#[test]
fn an_invalid_body_is_shown_with_why_and_how_it_starts() {
    let handler = Credits;
    assert_eq!(
        event_id(&handler, br#"{"eventId":"e-1","orderId":"o","points":2}"#),
        Ok("e-1".to_owned())
    );
    assert_eq!(
        event_id(&handler, br#"{"eventId":"e-2","orderId":"o","points":-1}"#),
        Err(r#"field `points` must be above 0, got -1; the body starts "{\"eventId\":\"e-2\",\"orderId\":\"o\",\"points\":-1}""#.to_owned())
    );
    let long = event_id(&handler, "x".repeat(100).as_bytes());
    assert!(long.is_err_and(|described| described.ends_with(&format!("{}…\"", "x".repeat(79)))));
}

#[test]
fn control_characters_never_reach_the_terminal() {
    assert_eq!(printable("plain"), "plain");
    assert_eq!(printable("a\u{1b}[2Jb\0c"), "a\\u{1b}[2Jb\\0c");
}

fn entry(reason: &str, time: u64, error: Option<&str>) -> Entry {
    Entry {
        key: event_key("e"),
        event_id: Some("e".into()),
        invalid: None,
        death: Some(Death {
            queue: "work".into(),
            reason: reason.into(),
            count: 1,
            time: Some(time),
            exchange: "x".into(),
            routing_keys: vec![],
        }),
        replays: 0,
        failures: error.map(|error| LedgerEntry {
            failures: 5,
            first_failed_at: SystemTime::UNIX_EPOCH,
            last_failed_at: SystemTime::UNIX_EPOCH,
            last_error: error.into(),
        }),
        indexed_error: None,
        group: None,
        applied: Some(false),
    }
}

#[test]
fn a_filter_by_group_or_by_letters_takes_only_those() {
    let group = uuid::Uuid::from_u128(7);
    let mut grouped = entry("rejected", 100, Some("order 1 failed"));
    grouped.group = Some(group);
    let ungrouped = entry("rejected", 100, Some("order 1 failed"));
    let by_group = Filter {
        group: Some(group),
        ..Filter::default()
    };
    assert!(by_group.matches(&grouped, 200));
    assert!(
        !by_group.matches(&ungrouped, 200),
        "a letter the index lacks is in no group"
    );
    let by_key = Filter {
        keys: vec![event_key("e")],
        ..Filter::default()
    };
    assert!(by_key.matches(&grouped, 200));
    let other = Filter {
        keys: vec![event_key("f")],
        ..Filter::default()
    };
    assert!(!other.matches(&grouped, 200));
}

#[test]
fn every_part_of_a_filter_must_hold() {
    let now = 10_000;
    let old = entry("rejected", now - 7200, Some("order 1 is poisoned"));
    let recent = entry("delivery_limit", now - 60, None);
    let filter = |f: Filter| (f.matches(&old, now), f.matches(&recent, now));
    assert_eq!(filter(Filter::default()), (true, true));
    let by_reason = Filter {
        reason: Some("rejected".into()),
        ..Filter::default()
    };
    assert_eq!(filter(by_reason), (true, false));
    let by_error = Filter {
        error: Some("poisoned".into()),
        ..Filter::default()
    };
    let by_error_again = by_error.clone();
    assert_eq!(filter(by_error), (true, false));
    let older = Filter {
        older_than: Some(Duration::from_secs(3600)),
        ..Filter::default()
    };
    assert_eq!(filter(older), (true, false));
    let newer = Filter {
        newer_than: Some(Duration::from_secs(3600)),
        ..Filter::default()
    };
    assert_eq!(filter(newer), (false, true));
    let both = Filter {
        reason: Some("rejected".into()),
        newer_than: Some(Duration::from_secs(3600)),
        ..Filter::default()
    };
    assert_eq!(filter(both), (false, false));
    let invalid = Filter {
        invalid: true,
        ..Filter::default()
    };
    assert_eq!(filter(invalid.clone()), (false, false));
    // Once a replay reset its ledger, the index still says why it died.
    let replayed_and_cut_off = Entry {
        failures: None,
        indexed_error: Some("order 1 is poisoned".into()),
        ..old.clone()
    };
    assert!(by_error_again.matches(&replayed_and_cut_off, now));
    let garbage = Entry {
        event_id: None,
        invalid: Some("not JSON".into()),
        ..old.clone()
    };
    assert!(invalid.matches(&garbage, now));
}
