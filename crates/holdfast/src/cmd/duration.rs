//! Durations on the command line: `250ms`, `10s`, `2m`; a bare number is seconds.

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

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 250ms, 10s or 2m"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" | "" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        _ => Err(format!("{s:?} has an unknown unit (use ms, s or m)")),
    }
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
        assert!(parse_duration("1h").is_err());
        assert!(parse_duration("s").is_err());
        assert!(parse_ttl("0").unwrap_err().contains("leave --ttl out"));
        assert!(parse_ttl("0s").is_err());
        assert_eq!(parse_ttl("3"), Ok(Duration::from_secs(3)));
        assert_eq!(show(Duration::from_millis(1500)), "1500ms");
        assert_eq!(show(Duration::from_secs(120)), "2m");
    }
}
