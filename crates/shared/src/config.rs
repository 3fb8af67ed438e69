//! Config helpers shared by both binaries: human durations (`30s`, `250ms`) and limit checks that
//! turn a value above its cap into a clear startup error instead of a surprise at run time.

use std::fmt::Display;
use std::time::Duration;

/// A configuration value is out of its allowed range.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// A limit was set above the hard cap the service enforces.
    #[error("{name} = {value} is above its cap of {cap}")]
    AboveCap {
        /// Flag name, e.g. `--max-concurrency`.
        name: &'static str,
        /// The value given.
        value: String,
        /// The largest value allowed.
        cap: String,
    },
    /// A limit was set below the smallest useful value.
    #[error("{name} = {value} is below its minimum of {min}")]
    BelowMin {
        /// Flag name.
        name: &'static str,
        /// The value given.
        value: String,
        /// The smallest value allowed.
        min: String,
    },
}

/// Checks `min <= value <= cap`, naming the flag in the error.
pub fn check_range<T: PartialOrd + Display>(name: &'static str, value: T, min: T, cap: T) -> Result<(), ConfigError> {
    if value > cap {
        return Err(ConfigError::AboveCap {
            name,
            value: value.to_string(),
            cap: cap.to_string(),
        });
    }
    if value < min {
        return Err(ConfigError::BelowMin {
            name,
            value: value.to_string(),
            min: min.to_string(),
        });
    }
    Ok(())
}

/// Like [`check_range`] for durations, printed in human form (`30s`).
pub fn check_duration(name: &'static str, value: Duration, min: Duration, cap: Duration) -> Result<(), ConfigError> {
    let human = |d: Duration| humantime::format_duration(d).to_string();
    if value > cap {
        return Err(ConfigError::AboveCap {
            name,
            value: human(value),
            cap: human(cap),
        });
    }
    if value < min {
        return Err(ConfigError::BelowMin {
            name,
            value: human(value),
            min: human(min),
        });
    }
    Ok(())
}

/// Parses a human duration such as `30s`, `1m 30s` or `250ms` (for clap's `value_parser`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| format!("invalid duration {s:?}: {e} (examples: 30s, 250ms, 2m)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_accepts_edges_and_refuses_beyond() {
        assert!(check_range("--n", 10, 1, 10).is_ok());
        assert!(check_range("--n", 1, 1, 10).is_ok());
        let err = check_range("--n", 11, 1, 10).unwrap_err();
        assert_eq!(err.to_string(), "--n = 11 is above its cap of 10");
        assert!(matches!(
            check_range("--n", 0, 1, 10),
            Err(ConfigError::BelowMin { .. })
        ));
    }

    #[test]
    fn durations_compare_by_value_not_by_text() {
        let s = Duration::from_secs;
        assert!(check_duration("--grace", s(9), s(0), s(10)).is_ok());
        assert!(check_duration("--grace", s(10), s(0), s(10)).is_ok());
        let err = check_duration("--grace", s(11), s(0), s(10)).unwrap_err();
        assert_eq!(err.to_string(), "--grace = 11s is above its cap of 10s");
    }

    #[test]
    fn parses_human_durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration(" 2m "), Ok(Duration::from_secs(120)));
        assert!(parse_duration("soon").unwrap_err().contains("invalid duration"));
    }
}
