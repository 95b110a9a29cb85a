//! Durations on the command line: `250ms`, `10s`, `2m`, `1h30m` (humantime's syntax); a bare number is
//! seconds.

use std::time::Duration;

/// A duration the way [`parse_duration`] reads them (`250ms`, `10s`, `2m`).
pub fn show(d: Duration) -> String {
    let ms = d.as_millis();
    if ms.is_multiple_of(60_000) && ms > 0 {
        format!("{}m", ms / 60_000)
    } else if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// A session TTL: a duration that is not zero (the server checks its range, 2 s to 5 min by default).
/// The API reads a TTL of 0 as "the server's default", which on a command line would be a surprise.
pub fn parse_ttl(s: &str) -> Result<Duration, String> {
    match parse_duration(s)? {
        d if d.is_zero() => {
            Err("0 is not a TTL: give one from 2s to 5m, or leave --ttl out for 10s".into())
        }
        d => Ok(d),
    }
}

/// Whole milliseconds only: the API carries milliseconds, so a finer duration would be cut (a TTL of
/// `0.5ms` would become 0, which the server reads as its default).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let bad = |why: String| format!("{s:?} is not a duration like 250ms, 10s, 2m or 1h30m: {why}");
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return s
            .parse()
            .map(Duration::from_secs)
            .map_err(|e| bad(e.to_string()));
    }
    // humantime 2 panics on a few sums that overflow (`18446744073709551615s1000ms`) instead of
    // returning its overflow error; such input is an error here too.
    let parsed = std::panic::catch_unwind(|| humantime::parse_duration(s))
        .map_err(|_| bad("too large".into()))?
        .map_err(|e| bad(e.to_string()))?;
    if parsed.subsec_nanos() % 1_000_000 != 0 {
        return Err(bad("finer than a millisecond".into()));
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5_400)));
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration("-5s").is_err());
        assert!(parse_duration("10 parsecs")
            .unwrap_err()
            .contains("like 250ms"));
        // Too big is an error, not an overflow (`n * 60` used to overflow).
        assert!(parse_duration("307445734561825861m").is_err());
        assert!(parse_duration("99999999999999999999").is_err());
        assert!(parse_duration("18446744073709551615s1000ms").is_err());
        assert!(parse_duration("500us").unwrap_err().contains("millisecond"));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1_500)));
        assert!(parse_ttl("0.5ms").is_err());
        assert!(parse_ttl("0").unwrap_err().contains("leave --ttl out"));
        assert!(parse_ttl("0s").is_err());
        assert_eq!(parse_ttl("3"), Ok(Duration::from_secs(3)));
        assert_eq!(show(Duration::from_millis(1500)), "1500ms");
        assert_eq!(show(Duration::from_secs(120)), "2m");
    }
}
