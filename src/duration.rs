//! Durations as idem writes them, in flags and in queue names (`250ms`,
//! `30s`, `5m`, `1h`; `7d` in flags), and instants as it prints them
//! (RFC 3339, UTC).

use std::time::Duration;

/// `250ms`, `30s`, `5m`, `1h`, `7d`, or `0`. A number without its unit is refused:
/// `5` could be meant as milliseconds as well as seconds.
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
        "" if number == 0.0 => 0.0,
        "" => {
            return Err(format!(
                "'{text}' has no unit: say {text}ms, {text}s, {text}m, {text}h or {text}d"
            ));
        }
        "ms" => number / 1000.0,
        "s" => number,
        "m" => number * 60.0,
        "h" => number * 3600.0,
        "d" => number * 86_400.0,
        other => {
            return Err(format!(
                "unknown unit '{other}' in '{text}' (use ms, s, m, h or d)"
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

/// [`format()`], in whole days when it is some (`7d`): for windows of
/// retention. Queue names keep [`format()`], which never says days.
pub fn format_days(duration: Duration) -> String {
    let seconds = duration.as_secs();
    if seconds > 0 && seconds.is_multiple_of(86_400) && duration.subsec_nanos() == 0 {
        format!("{}d", seconds / 86_400)
    } else {
        format(duration)
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

/// `1700000000` → `2023-11-14T22:13:20Z`.
pub fn rfc3339(seconds: u64) -> String {
    let days = (seconds / 86_400) as i64;
    let rest = seconds % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("0"), Ok(Duration::ZERO));
        assert!(parse("30").is_err_and(|e| e.contains("has no unit")));
        assert_eq!(parse("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse("1.5h"), Ok(Duration::from_secs(5400)));
        assert!(parse("soon").is_err());
        assert!(parse("5 weeks").is_err());
        assert_eq!(parse("7d"), Ok(Duration::from_secs(7 * 86_400)));
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
    fn timestamps_print_as_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn durations_show_as_they_parse() {
        for shown in ["5ms", "1500ms", "30s", "3m", "90s", "2h", "0s"] {
            assert_eq!(parse(shown).map(format), Ok(shown.to_owned()));
        }
        // Queue names never say days; windows do.
        assert_eq!(parse("2d").map(format), Ok("48h".to_owned()));
        for shown in ["7d", "36h", "90m", "0s"] {
            assert_eq!(parse(shown).map(format_days), Ok(shown.to_owned()));
        }
    }
}

/// `2023-11-14T22:13` or `2023-11-14T22:13:20` (optionally with a `Z`, as
/// a browser's `datetime-local` field sends it, read as UTC) → seconds
/// since the Unix epoch; `None` for anything else.
pub fn parse_utc(text: &str) -> Option<u64> {
    let text = text.trim().trim_end_matches('Z');
    let (date, time) = text.split_once(['T', ' '])?;
    let mut date = date.split('-');
    let year: i64 = date.next()?.parse().ok()?;
    let month: i64 = date.next()?.parse().ok()?;
    let day: i64 = date.next()?.parse().ok()?;
    let mut time = time.split(':');
    let hour: u64 = time.next()?.parse().ok()?;
    let minute: u64 = time.next()?.parse().ok()?;
    let second: u64 = time.next().map_or(Some(0), |s| s.parse().ok())?;
    if date.next().is_some()
        || time.next().is_some()
        || !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    // Howard Hinnant's days_from_civil.
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let seconds = days * 86_400 + (hour * 3600 + minute * 60 + second) as i64;
    u64::try_from(seconds).ok()
}

#[cfg(test)]
mod parse_tests {
    use super::*;

    #[test]
    fn a_datetime_reads_back_as_written() {
        assert_eq!(parse_utc("2023-11-14T22:13:20"), Some(1_700_000_000));
        assert_eq!(parse_utc("2023-11-14T22:13"), Some(1_699_999_980));
        assert_eq!(
            rfc3339(parse_utc("2024-02-29T00:00:00Z").unwrap_or(0)),
            "2024-02-29T00:00:00Z"
        );
        assert_eq!(parse_utc("2023-13-01T00:00"), None);
        assert_eq!(parse_utc("yesterday"), None);
    }
}
