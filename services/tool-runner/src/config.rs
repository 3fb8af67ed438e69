//! The runner's configuration (built from flags by [`crate::cli`], or directly by tests), with
//! defaults and the caps every limit is checked against.

use std::path::PathBuf;
use std::time::Duration;

use shared::config::{check_duration, check_range};

use crate::Error;
use crate::registry::ArgLimits;
use crate::tools::builtin::BuiltinConfig;

/// Defaults and caps of every limit, in one place (also printed by `--help`).
pub mod limits {
    use std::time::Duration;

    /// Default concurrent `RunTool` calls.
    pub const MAX_CONCURRENCY: usize = 64;
    /// Cap on `--max-concurrency`.
    pub const MAX_CONCURRENCY_CAP: usize = 10_000;
    /// Default largest `arguments_json` (1 MiB).
    pub const MAX_ARGUMENT_BYTES: usize = 1024 * 1024;
    /// Cap on `--max-argument-bytes` (16 MiB).
    pub const MAX_ARGUMENT_BYTES_CAP: usize = 16 * 1024 * 1024;
    /// Default deepest JSON nesting of arguments.
    pub const MAX_JSON_DEPTH: usize = 64;
    /// Cap on `--max-json-depth` (serde_json's own recursion limit).
    pub const MAX_JSON_DEPTH_CAP: usize = 128;
    /// Default longest `sleep`.
    pub const SLEEP_MAX: Duration = Duration::from_secs(60);
    /// Cap on `--sleep-max`.
    pub const SLEEP_MAX_CAP: Duration = Duration::from_secs(3600);
    /// Default largest file `read_file` returns, and largest body `http_get` returns (1 MiB).
    pub const MAX_READ_BYTES: u64 = 1024 * 1024;
    /// Cap on `--read-max-bytes` and `--http-max-bytes` (16 MiB).
    pub const MAX_READ_BYTES_CAP: u64 = 16 * 1024 * 1024;
    /// Default most entries `list_dir` returns.
    pub const LIST_MAX_ENTRIES: usize = 1000;
    /// Cap on `--list-max-entries`.
    pub const LIST_MAX_ENTRIES_CAP: usize = 100_000;
    /// Default timeout of built-ins that do I/O.
    pub const IO_TIMEOUT: Duration = Duration::from_secs(30);
    /// Cap on `--io-timeout`.
    pub const IO_TIMEOUT_CAP: Duration = Duration::from_secs(600);
    /// Default drain grace period.
    pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
    /// Cap on `--shutdown-grace`.
    pub const SHUTDOWN_GRACE_CAP: Duration = Duration::from_secs(3600);
    /// Default size of payloads recorded on spans (when turned on).
    pub const TRACE_PAYLOAD: usize = 1024;
    /// Cap on recorded payloads.
    pub const TRACE_PAYLOAD_CAP: usize = 64 * 1024;
}

/// Everything `run` needs.
#[derive(Debug, Clone)]
pub struct Config {
    /// TOML manifest of command tools; `None` = built-ins only.
    pub tools_manifest: Option<PathBuf>,
    /// Settings of the built-in tools.
    pub builtins: BuiltinConfig,
    /// Most `RunTool` calls in flight; more are refused with `RESOURCE_EXHAUSTED`.
    pub max_concurrency: usize,
    /// Size and depth limits on arguments.
    pub arg_limits: ArgLimits,
    /// How long in-flight calls may take to finish after a stop signal.
    pub shutdown_grace: Duration,
    /// Record tool arguments and results on spans, truncated to this many bytes; `None` = off.
    pub trace_payloads: Option<usize>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            tools_manifest: None,
            builtins: BuiltinConfig {
                sleep_max: limits::SLEEP_MAX,
                sandbox_root: None,
                read_max_bytes: limits::MAX_READ_BYTES,
                list_max_entries: limits::LIST_MAX_ENTRIES,
                http_allow_hosts: Vec::new(),
                http_max_bytes: limits::MAX_READ_BYTES,
                io_timeout: limits::IO_TIMEOUT,
            },
            max_concurrency: limits::MAX_CONCURRENCY,
            arg_limits: ArgLimits {
                max_bytes: limits::MAX_ARGUMENT_BYTES,
                max_depth: limits::MAX_JSON_DEPTH,
            },
            shutdown_grace: limits::SHUTDOWN_GRACE,
            trace_payloads: None,
        }
    }
}

impl Config {
    /// Checks every limit against its range; the error names the flag.
    pub fn validate(&self) -> Result<(), Error> {
        use limits::*;
        let b = &self.builtins;
        check_range("--max-concurrency", self.max_concurrency, 1, MAX_CONCURRENCY_CAP)?;
        check_range(
            "--max-argument-bytes",
            self.arg_limits.max_bytes,
            2,
            MAX_ARGUMENT_BYTES_CAP,
        )?;
        check_range("--max-json-depth", self.arg_limits.max_depth, 1, MAX_JSON_DEPTH_CAP)?;
        check_duration("--sleep-max", b.sleep_max, Duration::ZERO, SLEEP_MAX_CAP)?;
        check_range("--read-max-bytes", b.read_max_bytes, 1, MAX_READ_BYTES_CAP)?;
        check_range("--http-max-bytes", b.http_max_bytes, 1, MAX_READ_BYTES_CAP)?;
        check_range("--list-max-entries", b.list_max_entries, 1, LIST_MAX_ENTRIES_CAP)?;
        check_duration("--io-timeout", b.io_timeout, Duration::from_millis(1), IO_TIMEOUT_CAP)?;
        check_duration(
            "--shutdown-grace",
            self.shutdown_grace,
            Duration::ZERO,
            SHUTDOWN_GRACE_CAP,
        )?;
        if let Some(max) = self.trace_payloads {
            check_range("--trace-payload-max-bytes", max, 1, TRACE_PAYLOAD_CAP)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_every_cap_is_enforced_on_both_sides() {
        assert!(Config::default().validate().is_ok());
        let at_caps = Config {
            max_concurrency: limits::MAX_CONCURRENCY_CAP,
            arg_limits: ArgLimits {
                max_bytes: limits::MAX_ARGUMENT_BYTES_CAP,
                max_depth: limits::MAX_JSON_DEPTH_CAP,
            },
            builtins: BuiltinConfig {
                sleep_max: limits::SLEEP_MAX_CAP,
                read_max_bytes: limits::MAX_READ_BYTES_CAP,
                http_max_bytes: limits::MAX_READ_BYTES_CAP,
                list_max_entries: limits::LIST_MAX_ENTRIES_CAP,
                io_timeout: limits::IO_TIMEOUT_CAP,
                ..Config::default().builtins
            },
            shutdown_grace: limits::SHUTDOWN_GRACE_CAP,
            ..Config::default()
        };
        assert!(at_caps.validate().is_ok());
        type Change = Box<dyn Fn(&mut Config)>;
        let over: Vec<(&str, Change)> = vec![
            ("--max-concurrency", Box::new(|c| c.max_concurrency += 1)),
            ("--max-concurrency", Box::new(|c| c.max_concurrency = 0)),
            ("--max-argument-bytes", Box::new(|c| c.arg_limits.max_bytes += 1)),
            ("--max-json-depth", Box::new(|c| c.arg_limits.max_depth += 1)),
            (
                "--sleep-max",
                Box::new(|c| c.builtins.sleep_max += Duration::from_millis(1)),
            ),
            ("--read-max-bytes", Box::new(|c| c.builtins.read_max_bytes += 1)),
            ("--http-max-bytes", Box::new(|c| c.builtins.http_max_bytes += 1)),
            ("--list-max-entries", Box::new(|c| c.builtins.list_max_entries += 1)),
            (
                "--io-timeout",
                Box::new(|c| c.builtins.io_timeout += Duration::from_millis(1)),
            ),
            (
                "--shutdown-grace",
                Box::new(|c| c.shutdown_grace += Duration::from_secs(1)),
            ),
        ];
        for (flag, change) in over {
            let mut c = at_caps.clone();
            change(&mut c);
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(flag), "{err} should name {flag}");
        }
    }
}
