//! The bodies a check sends: a file of JSON lines, one body a line, or the
//! file `dlq discard --to` writes (one dead letter a line, its body in
//! `body` or `body_base64`), so that an incident's letters become a test.

use std::io::BufRead;
use std::path::Path;

use base64::Engine;
use serde_json::Value;

use super::CheckError;

/// The bodies of `path`, in the file's order; blank lines are skipped.
pub fn read(path: &Path) -> Result<Vec<Vec<u8>>, CheckError> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path)
        .map_err(|error| CheckError::Usage(format!("cannot open {name}: {error}")))?;
    let bodies = bodies(std::io::BufReader::new(file), &name)?;
    if bodies.is_empty() {
        return Err(CheckError::Usage(format!("{name} holds no event")));
    }
    Ok(bodies)
}

fn bodies(reader: impl BufRead, name: &str) -> Result<Vec<Vec<u8>>, CheckError> {
    let mut bodies = Vec::new();
    for (index, line) in reader.split(b'\n').enumerate() {
        let line =
            line.map_err(|error| CheckError::Usage(format!("cannot read {name}: {error}")))?;
        let line = line.strip_suffix(b"\r").unwrap_or(&line);
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let body = discarded_body(line)
            .map_err(|reason| CheckError::Usage(format!("{name}:{}: {reason}", index + 1)))?;
        bodies.push(body.unwrap_or_else(|| line.to_vec()));
    }
    Ok(bodies)
}

/// The body of a line of a `dlq discard` file; `None` for any other line,
/// which is a body itself (even one that is no JSON: the check sends it as
/// it is, and the worker dead-letters it).
pub(crate) fn discarded_body(line: &[u8]) -> Result<Option<Vec<u8>>, String> {
    let Ok(Value::Object(fields)) = serde_json::from_slice::<Value>(line) else {
        return Ok(None);
    };
    let is_letter = ["discarded_at", "dead_letter_queue"]
        .iter()
        .all(|field| fields.contains_key(*field));
    if !is_letter {
        return Ok(None);
    }
    match (fields.get("body"), fields.get("body_base64")) {
        (Some(Value::String(text)), _) => Ok(Some(text.as_bytes().to_vec())),
        (_, Some(Value::String(encoded))) => base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .map(Some)
            .map_err(|error| {
                format!("a discarded letter whose body_base64 does not decode: {error}")
            }),
        _ => Err("a discarded letter without its body (body or body_base64)".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_lines_are_bodies_and_discarded_letters_give_theirs() -> Result<(), CheckError> {
        let file = concat!(
            "{\"eventId\":\"a\"}\r\n",
            "\n",
            "{\"discarded_at\":\"2026-01-01T00:00:00Z\",\"dead_letter_queue\":\"q.dlq\",",
            "\"body\":\"{\\\"eventId\\\":\\\"b\\\"}\"}\n",
            "{\"discarded_at\":\"x\",\"dead_letter_queue\":\"q.dlq\",\"body_base64\":\"/w==\"}\n",
            "not json at all\n",
        );
        let read = bodies(file.as_bytes(), "events")?;
        assert_eq!(
            read,
            vec![
                br#"{"eventId":"a"}"#.to_vec(),
                br#"{"eventId":"b"}"#.to_vec(),
                vec![0xff],
                b"not json at all".to_vec(),
            ]
        );
        Ok(())
    }

    #[test]
    fn a_letter_without_its_body_is_refused_with_its_line() {
        let file = "{}\n{\"discarded_at\":\"x\",\"dead_letter_queue\":\"q\"}\n";
        let error = bodies(file.as_bytes(), "incident.jsonl")
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            error.as_deref(),
            Some("incident.jsonl:2: a discarded letter without its body (body or body_base64)")
        );
    }
}
