//! Go's standard-library number and duration parsers, as stunnerd (and kubectl) read config
//! values and flags with them: `strconv.Atoi` and `time.ParseDuration`. Written once here, so
//! the config reader, the TURN REST usernames and the control plane's flags agree on what a
//! number or a duration is.

/// Go's `strconv.Atoi`: an optional sign, then base-10 digits, no overflow.
pub fn atoi(text: &str) -> Option<i64> {
    let digits = text.strip_prefix(['+', '-']).unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// Go's `time.ParseDuration` (`1h`, `1.5h`, `1h30m`, `300ms`, `-2s`), in seconds.
pub fn parse_duration(text: &str) -> Option<f64> {
    let (sign, mut rest) = match text.strip_prefix('-') {
        Some(rest) => (-1.0, rest),
        None => (1.0, text.strip_prefix('+').unwrap_or(text)),
    };
    if rest == "0" {
        return Some(0.0);
    }
    if rest.is_empty() {
        return None;
    }
    let mut total = 0.0;
    while !rest.is_empty() {
        let number_len = rest
            .bytes()
            .take_while(|b| b.is_ascii_digit() || *b == b'.')
            .count();
        let number: f64 = rest[..number_len].parse().ok()?;
        rest = &rest[number_len..];
        let unit_len = rest
            .bytes()
            .take_while(|b| !b.is_ascii_digit() && *b != b'.')
            .count();
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += number * scale;
    }
    Some(sign * total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atoi_takes_a_sign_and_digits_only() {
        assert_eq!(atoi("42"), Some(42));
        assert_eq!(atoi("+7"), Some(7));
        assert_eq!(atoi("-3"), Some(-3));
        for bad in ["", "+", "1.5", " 1", "0x10", "99999999999999999999"] {
            assert_eq!(atoi(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn durations_parse_as_go_does() {
        assert_eq!(parse_duration("1h30m"), Some(5400.0));
        assert_eq!(parse_duration("300ms"), Some(0.3));
        assert_eq!(parse_duration("-2s"), Some(-2.0));
        assert_eq!(parse_duration("0"), Some(0.0));
        for bad in ["", "5", "1d", "s", "1.5"] {
            assert_eq!(parse_duration(bad), None, "{bad:?}");
        }
    }
}
