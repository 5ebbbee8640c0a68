//! Durations as idem writes them, in flags and in queue names: `250ms`,
//! `30s`, `5m`, `1h`.

use std::time::Duration;

/// `250ms`, `30s`, `5m`, `1h`, or a plain number of seconds.
pub fn parse(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("'{text}' is not a duration (e.g. 250ms, 30s, 5m)"))?;
    let seconds = match unit.trim() {
        "ms" => number / 1000.0,
        "" | "s" => number,
        "m" => number * 60.0,
        "h" => number * 3600.0,
        other => {
            return Err(format!(
                "unknown unit '{other}' in '{text}' (use ms, s, m or h)"
            ));
        }
    };
    Duration::try_from_secs_f64(seconds).map_err(|e| format!("'{text}': {e}"))
}

/// The shortest of `1h`, `5m`, `30s` or `250ms` that says `duration` to the
/// millisecond; [`parse`] reads it back.
pub fn format(duration: Duration) -> String {
    let millis = duration.as_millis();
    match millis {
        0 => "0s".to_owned(),
        _ if millis.is_multiple_of(3_600_000) => format!("{}h", millis / 3_600_000),
        _ if millis.is_multiple_of(60_000) => format!("{}m", millis / 60_000),
        _ if millis.is_multiple_of(1000) => format!("{}s", millis / 1000),
        _ => format!("{millis}ms"),
    }
}

/// A comma-separated list of durations, `1s,10s,1m`; each no longer than
/// `most`.
pub fn parse_list(text: &str, most: Duration) -> Result<Vec<Duration>, String> {
    let list = text.split(',').map(parse).collect::<Result<Vec<_>, _>>()?;
    if let Some(long) = list.iter().find(|delay| **delay > most) {
        return Err(format!(
            "{} is longer than the longest allowed, {}",
            format(*long),
            format(most)
        ));
    }
    Ok(list)
}

/// `list` as [`parse_list`] reads it.
pub fn format_list(list: &[Duration]) -> String {
    list.iter()
        .map(|duration| format(*duration))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse("1.5h"), Ok(Duration::from_secs(5400)));
        assert!(parse("soon").is_err());
        assert!(parse("5 weeks").is_err());
    }

    #[test]
    fn a_list_reads_back_as_it_is_written_and_refuses_what_is_too_long() {
        let day = Duration::from_secs(86_400);
        assert_eq!(
            parse_list("1s,10s,1m,5m", day).map(|list| format_list(&list)),
            Ok("1s,10s,1m,5m".to_owned())
        );
        assert_eq!(parse_list("0", day), Ok(vec![Duration::ZERO]));
        assert!(parse_list("1s,,2s", day).is_err());
        assert!(parse_list("2d", day).is_err());
        assert!(parse_list("25h", day).is_err_and(|e| e.contains("longer")));
    }

    #[test]
    fn durations_show_as_they_parse() {
        for shown in ["5ms", "1500ms", "30s", "3m", "90s", "2h", "0s"] {
            assert_eq!(parse(shown).map(format), Ok(shown.to_owned()));
        }
    }
}
