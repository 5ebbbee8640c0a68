//! What a check compares: the handler's tables (those of its schema that
//! are not idem's), row by row by primary key, and the outbox by
//! idempotency key; the columns left out, and why; and the differences
//! between two such states, with the events that name the rows.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use base64::Engine;
use deadpool_postgres::GenericClient;
use serde::Serialize;
use serde_json::{Value, json};

use super::CheckError;

/// Headers of an outgoing message that differ by nature between two runs:
/// the trace context of the span that sent it.
const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

/// A column the comparisons leave out, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeftOut {
    /// `table.column`.
    pub column: String,
    /// Why.
    pub why: Why,
}

/// Why a column is left out of the comparisons.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Why {
    /// `--ignore-column` said so.
    Asked,
    /// The reference set it differently when run twice in the same order
    /// (a clock, a random value, state kept in memory): the check fails
    /// for it, and leaves it out of what it compares after, so that what
    /// else differs shows.
    Unstable,
    /// Its values come from a sequence (an identity or serial column):
    /// they differ whenever transactions commit, or roll back, in another
    /// order, whatever the handler does.
    Sequence,
}

impl fmt::Display for LeftOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.why {
            Why::Asked => write!(f, "{} (--ignore-column)", self.column),
            Why::Unstable => write!(
                f,
                "{} (differs from itself; left out after the reference)",
                self.column
            ),
            Why::Sequence => write!(f, "{} (drawn from a sequence)", self.column),
        }
    }
}

/// One of the handler's tables, as compared.
#[derive(Debug, Clone)]
struct Table {
    name: String,
    /// Columns left out of it.
    left_out: Vec<String>,
    /// Its primary key's columns, when none is left out: rows are matched
    /// by it. Empty: rows are compared as a multiset.
    key: Vec<String>,
}

/// The handler's tables, found in a schema its migrations made.
#[derive(Debug, Clone)]
pub(crate) struct Tables {
    tables: Vec<Table>,
    /// Every column left out, for the report.
    pub(crate) left_out: Vec<LeftOut>,
}

/// The tables of `schema` (idem's own left aside), their primary keys,
/// and the columns left out: those `ignore` names (`table.column`, each
/// must exist) and those drawn from a sequence.
pub(crate) async fn tables(
    client: &impl GenericClient,
    schema: &str,
    ignore: &[String],
) -> Result<Tables, CheckError> {
    let rows = client
        .query(
            "SELECT c.relname::text, a.attname::text, \
                    a.attidentity <> '' OR coalesce(pg_get_expr(d.adbin, d.adrelid) LIKE 'nextval(%', false), \
                    coalesce(a.attnum = ANY (i.indkey::int2[]), false) \
             FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped \
             LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum \
             LEFT JOIN pg_index i ON i.indrelid = c.oid AND i.indisprimary \
             WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') AND NOT c.relispartition \
               AND c.relname NOT LIKE 'mq\\_%' AND c.relname NOT LIKE 'idem\\_%' \
             ORDER BY c.relname, a.attnum",
            &[&schema],
        )
        .await
        .map_err(|error| CheckError::database("reading the handler's tables", &error))?;
    let mut tables: Vec<(Table, Vec<String>)> = Vec::new();
    let mut left_out = Vec::new();
    let mut asked: BTreeSet<&str> = ignore.iter().map(String::as_str).collect();
    for row in &rows {
        let (table, column): (String, String) = (row.get(0), row.get(1));
        let (drawn, in_key): (bool, bool) = (row.get(2), row.get(3));
        if tables.last().is_none_or(|(last, _)| last.name != table) {
            let fresh = Table {
                name: table.clone(),
                left_out: Vec::new(),
                key: Vec::new(),
            };
            tables.push((fresh, Vec::new()));
        }
        let Some((entry, key)) = tables.last_mut() else {
            continue;
        };
        let qualified = format!("{table}.{column}");
        let why = if asked.remove(qualified.as_str()) {
            Some(Why::Asked)
        } else if drawn {
            Some(Why::Sequence)
        } else {
            None
        };
        if let Some(why) = why {
            entry.left_out.push(column.clone());
            left_out.push(LeftOut {
                column: qualified,
                why,
            });
        }
        if in_key {
            key.push(column);
        }
    }
    if let Some(unknown) = asked.into_iter().next() {
        let names: Vec<&str> = tables
            .iter()
            .map(|(table, _)| table.name.as_str())
            .collect();
        return Err(CheckError::Usage(format!(
            "--ignore-column {unknown}: no such column in the handler's tables ({})",
            if names.is_empty() {
                "it has none".to_owned()
            } else {
                names.join(", ")
            }
        )));
    }
    let tables = tables
        .into_iter()
        .map(|(mut table, key)| {
            if !key.iter().any(|column| table.left_out.contains(column)) {
                table.key = key;
            }
            table
        })
        .collect();
    Ok(Tables { tables, left_out })
}

/// The rows of one table: by key, or counted, when it has no key.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Rows {
    Keyed(BTreeMap<String, Value>),
    Counted(BTreeMap<String, usize>),
}

/// What a run left: the handler's tables and the outbox's messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct State {
    tables: Vec<(String, Rows)>,
    /// Outbox messages by idempotency key.
    outbox: BTreeMap<String, Value>,
}

/// A cheap summary of a [`State`]'s tables: equal summaries, equal tables
/// (but for a hash collision, one in 2⁶⁴).
pub(crate) type Digest = Vec<(i64, String)>;

impl Tables {
    /// The tables' names, in order.
    pub(crate) fn names(&self) -> Vec<String> {
        self.tables.iter().map(|table| table.name.clone()).collect()
    }

    /// The rows of a table as the comparison sees them: JSON objects
    /// without the columns left out.
    fn select(table: &Table) -> String {
        let left_out: Vec<String> = table
            .left_out
            .iter()
            .map(|column| format!("'{}'", column.replace('\'', "''")))
            .collect();
        format!(
            "SELECT (to_jsonb(t) - ARRAY[{}]::text[])::text AS row FROM {} t",
            left_out.join(", "),
            quoted(&table.name)
        )
    }

    /// A digest of every table's rows, in the session's schema.
    pub(crate) async fn digest(
        &self,
        client: &impl GenericClient,
    ) -> Result<Digest, tokio_postgres::Error> {
        let mut digest = Vec::with_capacity(self.tables.len());
        for table in &self.tables {
            // Order-free: the sum of the rows' hashes, and their count.
            let sql = format!(
                "SELECT count(*), coalesce(sum(('x' || left(md5(row), 16))::bit(64)::bigint::numeric), 0)::text \
                 FROM ({}) rows",
                Self::select(table)
            );
            let row = client.query_one(&sql, &[]).await?;
            digest.push((row.get(0), row.get(1)));
        }
        Ok(digest)
    }

    /// Every table's rows and the outbox, in the session's schema.
    pub(crate) async fn state(&self, client: &impl GenericClient) -> Result<State, CheckError> {
        let read =
            |error: tokio_postgres::Error| CheckError::database("reading a run's tables", &error);
        let mut tables = Vec::with_capacity(self.tables.len());
        for table in &self.tables {
            let rows = client
                .query(&Self::select(table), &[])
                .await
                .map_err(read)?;
            let mut keyed = BTreeMap::new();
            let mut counted = BTreeMap::new();
            for row in rows {
                let text: String = row.get(0);
                if table.key.is_empty() {
                    *counted.entry(text).or_insert(0) += 1;
                    continue;
                }
                let value: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
                keyed.insert(key_of(&table.key, &value), value);
            }
            let rows = if table.key.is_empty() {
                Rows::Counted(counted)
            } else {
                Rows::Keyed(keyed)
            };
            tables.push((table.name.clone(), rows));
        }
        Ok(State {
            tables,
            outbox: outbox(client).await.map_err(read)?,
        })
    }
}

impl State {
    /// The text values of the keys of the rows it holds, in tables with a
    /// key: what names a row an event touches (an account, a show, an
    /// order), as an event's body gives it.
    pub(crate) fn row_names(&self) -> BTreeSet<String> {
        let mut names = BTreeSet::new();
        for (_, rows) in &self.tables {
            let Rows::Keyed(rows) = rows else { continue };
            for key in rows.keys() {
                if let Ok(Value::Array(values)) = serde_json::from_str::<Value>(key) {
                    names.extend(values.into_iter().filter_map(|value| match value {
                        Value::String(text) if text.chars().count() >= 2 => Some(text),
                        _ => None,
                    }));
                }
            }
        }
        names
    }
}

/// `name` as a quoted identifier.
fn quoted(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A row's key, as a JSON array of its key columns' values.
fn key_of(key: &[String], row: &Value) -> String {
    let values: Vec<Value> = key
        .iter()
        .map(|column| row.get(column).cloned().unwrap_or(Value::Null))
        .collect();
    Value::Array(values).to_string()
}

/// The outbox's messages by idempotency key, as compared: where they go,
/// their headers (the trace context aside) and their bodies.
async fn outbox(
    client: &impl GenericClient,
) -> Result<BTreeMap<String, Value>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT message_id::text, exchange, routing_key, content_type, headers::text, body \
             FROM mq_outbox_message",
            &[],
        )
        .await?;
    let mut messages = BTreeMap::new();
    for row in rows {
        let headers: BTreeMap<String, String> =
            serde_json::from_str(row.get::<_, &str>(4)).unwrap_or_default();
        let message = Message {
            exchange: row.get(1),
            routing_key: row.get(2),
            content_type: row.get(3),
            headers,
            body: row.get(5),
        };
        let key: String = row.get(0);
        // Two rows under one key: the second shows as a message of its own.
        let key = if messages.contains_key(&key) {
            format!("{key} (again)")
        } else {
            key
        };
        messages.insert(key, message.value());
    }
    Ok(messages)
}

/// An outgoing message, as the comparisons see it.
pub(crate) struct Message {
    pub(crate) exchange: String,
    pub(crate) routing_key: String,
    pub(crate) content_type: Option<String>,
    pub(crate) headers: BTreeMap<String, String>,
    pub(crate) body: Vec<u8>,
}

impl Message {
    /// The message as JSON, its body as text where it is UTF-8.
    pub(crate) fn value(mut self) -> Value {
        for header in TRACE_HEADERS {
            self.headers.remove(header);
        }
        let body = match String::from_utf8(self.body) {
            Ok(text) => json!(text),
            Err(bytes) => json!({
                "base64": base64::engine::general_purpose::STANDARD.encode(bytes.as_bytes())
            }),
        };
        json!({
            "exchange": self.exchange,
            "routing_key": self.routing_key,
            "content_type": self.content_type,
            "headers": self.headers,
            "body": body,
        })
    }
}

/// A row (or outbox message) that differs between two states.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Difference {
    /// The table, or `outbox`.
    pub table: String,
    /// Its primary key (the message's idempotency key), when it has one.
    pub key: Option<String>,
    /// The row in the state compared with (the reference), if there.
    pub expected: Option<Value>,
    /// The row in the state compared (the run), if there.
    pub found: Option<Value>,
    /// Events whose body names the row's key (or, for a table without one,
    /// its text values): where to look first.
    pub events: Vec<String>,
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let row = |value: &Option<Value>| match value {
            Some(value) => value.to_string(),
            None => "(none)".to_owned(),
        };
        match &self.key {
            Some(key) => write!(f, "{} {key}: ", self.table)?,
            None => write!(f, "{}: ", self.table)?,
        }
        write!(
            f,
            "expected {}, found {}",
            row(&self.expected),
            row(&self.found)
        )?;
        if !self.events.is_empty() {
            write!(f, " (events naming it: {})", self.events.join(", "))?;
        }
        Ok(())
    }
}

/// Where a difference's events are looked up: every event's id and body.
pub(crate) struct Lookup<'a> {
    pub(crate) events: &'a [(String, &'a [u8])],
}

impl Lookup<'_> {
    /// Up to three events a row names: those whose id is one of the row's
    /// values (a log row of the event), else those whose body holds one of
    /// the key's values as a JSON string (an account the event moves).
    fn involved(&self, row: &[&str], key: &[&str]) -> Vec<String> {
        let own: Vec<String> = self
            .events
            .iter()
            .filter(|(id, _)| row.contains(&id.as_str()))
            .map(|(id, _)| id.clone())
            .take(3)
            .collect();
        if !own.is_empty() {
            return own;
        }
        let needles: Vec<String> = key
            .iter()
            .filter(|value| value.chars().count() >= 2)
            .map(|value| Value::String((*value).to_owned()).to_string())
            .collect();
        if needles.is_empty() {
            return Vec::new();
        }
        self.events
            .iter()
            .filter(|(_, body)| {
                let body = String::from_utf8_lossy(body);
                needles.iter().any(|needle| body.contains(needle.as_str()))
            })
            .map(|(id, _)| id.clone())
            .take(3)
            .collect()
    }

    /// `differences` with the events of the first `shown` of them.
    pub(crate) fn name(&self, differences: &mut [Difference], shown: usize) {
        for difference in differences.iter_mut().take(shown) {
            let row = difference.expected.as_ref().or(difference.found.as_ref());
            let values = row.map(strings).unwrap_or_default();
            let key: Option<Value> = difference
                .key
                .as_deref()
                .and_then(|key| serde_json::from_str(key).ok());
            let key = match &key {
                Some(key) if difference.table != "outbox" => strings(key),
                _ => values.clone(),
            };
            difference.events = self.involved(&values, &key);
        }
    }
}

/// The strings among a row's (or key's) values.
fn strings(value: &Value) -> Vec<&str> {
    match value {
        Value::String(text) => vec![text.as_str()],
        Value::Array(values) => values.iter().flat_map(strings).collect(),
        Value::Object(fields) => fields.values().flat_map(strings).collect(),
        _ => Vec::new(),
    }
}

/// The columns whose values make `expected` and `found` differ: those of
/// the rows that differ, matched by key; in a table without a key, the
/// columns whose values are not the same multiset in both, when leaving
/// them out makes the rows the same. A table whose rows differ otherwise
/// (one more, one fewer) is named whole.
pub(crate) fn unstable(expected: &State, found: &State) -> Vec<String> {
    let mut columns = BTreeSet::new();
    let mut add = |table: &str, named: Vec<String>| {
        if named.is_empty() {
            columns.insert(format!("{table} (whole rows)"));
        } else {
            columns.extend(named);
        }
    };
    for ((table, expected), (_, found)) in expected.tables.iter().zip(&found.tables) {
        match (expected, found) {
            (Rows::Keyed(expected), Rows::Keyed(found)) => {
                let keys: BTreeSet<&String> = expected.keys().chain(found.keys()).collect();
                for key in keys {
                    match (expected.get(key), found.get(key)) {
                        (Some(a), Some(b)) if a != b => add(table, changed(table, a, b)),
                        (Some(_), None) | (None, Some(_)) => add(table, Vec::new()),
                        _ => {}
                    }
                }
            }
            (Rows::Counted(expected), Rows::Counted(found)) if expected != found => {
                add(table, unstable_in_bag(table, expected, found));
            }
            _ => {}
        }
    }
    if expected.outbox != found.outbox {
        columns.insert("outbox (messages)".to_owned());
    }
    columns.into_iter().collect()
}

/// The columns of `table` whose values differ between two rows.
fn changed(table: &str, a: &Value, b: &Value) -> Vec<String> {
    let (Value::Object(a), Value::Object(b)) = (a, b) else {
        return Vec::new();
    };
    let names: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    names
        .into_iter()
        .filter(|name| a.get(*name) != b.get(*name))
        .map(|name| format!("{table}.{name}"))
        .collect()
}

/// The columns of a table without a key whose values differ between two
/// multisets of rows, if leaving them out makes the rows the same.
fn unstable_in_bag(
    table: &str,
    expected: &BTreeMap<String, usize>,
    found: &BTreeMap<String, usize>,
) -> Vec<String> {
    let rows = |bag: &BTreeMap<String, usize>| -> Vec<serde_json::Map<String, Value>> {
        bag.iter()
            .flat_map(|(row, count)| {
                let row = match serde_json::from_str(row) {
                    Ok(Value::Object(fields)) => fields,
                    _ => serde_json::Map::new(),
                };
                std::iter::repeat_n(row, *count)
            })
            .collect()
    };
    let (expected, found) = (rows(expected), rows(found));
    let names: BTreeSet<String> = expected
        .iter()
        .chain(&found)
        .flat_map(|row| row.keys().cloned())
        .collect();
    let values = |rows: &[serde_json::Map<String, Value>], name: &str| -> Vec<String> {
        let mut values: Vec<String> = rows
            .iter()
            .map(|row| row.get(name).map(Value::to_string).unwrap_or_default())
            .collect();
        values.sort();
        values
    };
    let differing: Vec<String> = names
        .into_iter()
        .filter(|name| values(&expected, name) != values(&found, name))
        .collect();
    let without = |rows: &[serde_json::Map<String, Value>]| -> Vec<String> {
        let mut rows: Vec<String> = rows
            .iter()
            .map(|row| {
                let mut row = row.clone();
                for name in &differing {
                    row.remove(name);
                }
                Value::Object(row).to_string()
            })
            .collect();
        rows.sort();
        rows
    };
    if differing.is_empty() || without(&expected) != without(&found) {
        return Vec::new();
    }
    differing
        .into_iter()
        .map(|name| format!("{table}.{name}"))
        .collect()
}

/// Every difference between `expected` and `found`, in table order.
pub(crate) fn differences(expected: &State, found: &State) -> Vec<Difference> {
    let mut differences = Vec::new();
    for ((table, expected), (_, found)) in expected.tables.iter().zip(&found.tables) {
        match (expected, found) {
            (Rows::Keyed(expected), Rows::Keyed(found)) => {
                keyed(table, expected, found, &mut differences);
            }
            (Rows::Counted(expected), Rows::Counted(found)) => {
                counted(table, expected, found, &mut differences);
            }
            _ => {}
        }
    }
    keyed("outbox", &expected.outbox, &found.outbox, &mut differences);
    differences
}

fn keyed(
    table: &str,
    expected: &BTreeMap<String, Value>,
    found: &BTreeMap<String, Value>,
    differences: &mut Vec<Difference>,
) {
    let keys: BTreeSet<&String> = expected.keys().chain(found.keys()).collect();
    for key in keys {
        let (before, after) = (expected.get(key), found.get(key));
        if before == after {
            continue;
        }
        differences.push(Difference {
            table: table.to_owned(),
            key: Some(key.clone()),
            expected: before.cloned(),
            found: after.cloned(),
            events: Vec::new(),
        });
    }
}

fn counted(
    table: &str,
    expected: &BTreeMap<String, usize>,
    found: &BTreeMap<String, usize>,
    differences: &mut Vec<Difference>,
) {
    let rows: BTreeSet<&String> = expected.keys().chain(found.keys()).collect();
    for row in rows {
        let (before, after) = (
            expected.get(row).copied().unwrap_or(0),
            found.get(row).copied().unwrap_or(0),
        );
        let value: Value = serde_json::from_str(row).unwrap_or_else(|_| json!(row));
        let (missing, extra) = (before.saturating_sub(after), after.saturating_sub(before));
        let sides = std::iter::repeat_n((Some(&value), None), missing)
            .chain(std::iter::repeat_n((None, Some(&value)), extra));
        for (expected, found) in sides {
            differences.push(Difference {
                table: table.to_owned(),
                key: None,
                expected: expected.cloned(),
                found: found.cloned(),
                events: Vec::new(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(rows: &[(&str, i64)], bag: &[&str]) -> State {
        let keyed = rows
            .iter()
            .map(|(id, balance)| {
                let row = json!({"id": id, "balance": balance});
                (key_of(&["id".to_owned()], &row), row)
            })
            .collect();
        let mut counted = BTreeMap::new();
        for row in bag {
            *counted.entry((*row).to_owned()).or_insert(0) += 1;
        }
        State {
            tables: vec![
                ("accounts".into(), Rows::Keyed(keyed)),
                ("log".into(), Rows::Counted(counted)),
            ],
            outbox: BTreeMap::new(),
        }
    }

    #[test]
    fn a_column_that_differs_in_a_table_without_a_key_is_found_by_leaving_it_out() {
        let stamped = |at: &[&str]| State {
            tables: vec![(
                "log".into(),
                Rows::Counted(
                    at.iter()
                        .enumerate()
                        .map(|(n, at)| (json!({"n": n, "at": at}).to_string(), 1))
                        .collect(),
                ),
            )],
            outbox: BTreeMap::new(),
        };
        let (first, second) = (stamped(&["10:00", "10:01"]), stamped(&["11:00", "11:01"]));
        assert_eq!(unstable(&first, &second), ["log.at"]);
        assert!(unstable(&first, &first).is_empty());
    }

    #[test]
    fn rows_differ_by_key_and_a_table_without_one_by_how_often_a_row_is_there() {
        let bodies: Vec<(String, Vec<u8>)> = vec![
            ("t-1".into(), br#"{"from":"acct-a","to":"acct-b"}"#.to_vec()),
            ("t-2".into(), br#"{"from":"acct-b","to":"acct-c"}"#.to_vec()),
        ];
        let events: Vec<(String, &[u8])> = bodies
            .iter()
            .map(|(id, body)| (id.clone(), body.as_slice()))
            .collect();
        let lookup = Lookup { events: &events };
        let expected = state(&[("acct-a", 10), ("acct-b", 5)], &[r#"{"t":"x"}"#]);
        let found = state(
            &[("acct-a", 10), ("acct-b", 7), ("acct-c", 1)],
            &[r#"{"t":"t-2"}"#, r#"{"t":"x"}"#],
        );
        let mut differences = differences(&expected, &found);
        lookup.name(&mut differences, 3);
        let shown: Vec<String> = differences.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                r#"accounts ["acct-b"]: expected {"balance":5,"id":"acct-b"}, found {"balance":7,"id":"acct-b"} (events naming it: t-1, t-2)"#,
                r#"accounts ["acct-c"]: expected (none), found {"balance":1,"id":"acct-c"} (events naming it: t-2)"#,
                r#"log: expected (none), found {"t":"t-2"} (events naming it: t-2)"#,
            ]
        );
        assert_eq!(
            unstable(&expected, &found),
            [
                "accounts (whole rows)",
                "accounts.balance",
                "log (whole rows)"
            ]
        );
        assert!(self::differences(&expected, &expected).is_empty());
    }
}
