//! Config helpers shared by both binaries: human durations (`30s`, `250ms`), the table of bounds
//! each settings section checks its values against (a value above its cap is a clear startup error
//! naming the flag, not a surprise at run time), and the defaults of a section as its flags
//! declare them.
//!
//! A section is a clap `Args` struct: each field's flag, environment variable, default and doc are
//! in its attribute and doc comment, and [`Bounded::bounds`] lists the range of each limit by field
//! name. The flag an error names comes from the struct itself, so it is never typed twice.

use std::cmp::Ordering;
use std::fmt::Display;
use std::time::Duration;

use clap::{Args, Command, FromArgMatches};

/// A configuration value is out of its allowed range.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// A limit was set above the hard cap the service enforces.
    #[error("{name} = {value} is above its cap of {cap}")]
    AboveCap {
        /// Flag name, e.g. `--max-concurrency`.
        name: String,
        /// The value given.
        value: String,
        /// The largest value allowed.
        cap: String,
    },
    /// A limit was set below the smallest useful value.
    #[error("{name} = {value} is below its minimum of {min}")]
    BelowMin {
        /// Flag name.
        name: String,
        /// The value given.
        value: String,
        /// The smallest value allowed.
        min: String,
    },
}

/// A number or a duration, as a bound compares and prints it (durations in human form, `30s`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Amount {
    /// A count or a size.
    Count(i128),
    /// A time.
    Duration(Duration),
}

impl PartialOrd for Amount {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        match (self, other) {
            (Self::Count(a), Self::Count(b)) => a.partial_cmp(b),
            (Self::Duration(a), Self::Duration(b)) => a.partial_cmp(b),
            _ => None,
        }
    }
}

impl Display for Amount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Count(n) => write!(f, "{n}"),
            Self::Duration(d) => write!(f, "{}", humantime::format_duration(*d)),
        }
    }
}

macro_rules! count_amounts {
    ($($t:ty),*) => {$(
        impl From<$t> for Amount {
            fn from(n: $t) -> Self {
                Self::Count(i128::from(n))
            }
        }
    )*};
}
count_amounts!(u16, u32, u64, i64);

impl From<usize> for Amount {
    fn from(n: usize) -> Self {
        Self::Count(i128::try_from(n).unwrap_or(i128::MAX))
    }
}

impl From<Duration> for Amount {
    fn from(d: Duration) -> Self {
        Self::Duration(d)
    }
}

/// One row of a section's table of bounds: the field (whose flag names it in errors), its value,
/// and the range it must lie in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    /// The field's name, which is its clap argument id.
    pub field: &'static str,
    /// The value set.
    pub value: Amount,
    /// The smallest value allowed.
    pub min: Amount,
    /// The largest value allowed.
    pub cap: Amount,
}

/// A row of a table of bounds: `field` (its name in the section) must lie in `min..=cap`.
pub fn bound(field: &'static str, value: impl Into<Amount>, min: impl Into<Amount>, cap: impl Into<Amount>) -> Bound {
    Bound {
        field,
        value: value.into(),
        min: min.into(),
        cap: cap.into(),
    }
}

/// A settings section whose limits have a range.
pub trait Bounded: Args {
    /// The table of bounds: one row per limit.
    fn bounds(&self) -> Vec<Bound>;

    /// Checks every row of [`bounds`](Self::bounds); the error names the flag of the first value
    /// out of its range.
    fn check_bounds(&self) -> Result<(), ConfigError> {
        let command = Self::augment_args(Command::new("settings"));
        self.bounds().iter().try_for_each(|row| row.check(&command))
    }
}

impl Bound {
    /// Checks the row; `command` says which flag the field is.
    pub fn check(&self, command: &Command) -> Result<(), ConfigError> {
        self.check_as(|| flag_of(command, self.field))
    }

    /// Checks the row, calling the value `name()` in the error (for values that are not flags,
    /// e.g. a manifest's fields).
    pub fn check_as(&self, name: impl Fn() -> String) -> Result<(), ConfigError> {
        if self.value > self.cap {
            return Err(ConfigError::AboveCap {
                name: name(),
                value: self.value.to_string(),
                cap: self.cap.to_string(),
            });
        }
        if self.value < self.min {
            return Err(ConfigError::BelowMin {
                name: name(),
                value: self.value.to_string(),
                min: self.min.to_string(),
            });
        }
        Ok(())
    }
}

/// The flag (`--name`) of the argument `field` of `command`; the field's name when it has none.
pub fn flag_of(command: &Command, field: &str) -> String {
    command
        .get_arguments()
        .find(|arg| arg.get_id() == field)
        .and_then(|arg| arg.get_long())
        .map_or_else(|| field.to_owned(), |long| format!("--{long}"))
}

/// The flag of `S`'s field `field`, for errors raised outside the table of bounds.
pub fn flag<S: Args>(field: &str) -> String {
    flag_of(&S::augment_args(Command::new("settings")), field)
}

/// A section's values as its flags declare their defaults, whatever the environment holds (tests
/// and embedded uses must not change with the shell they run in).
///
/// # Panics
/// The settings `S` from the environment alone (each flag's environment variable, else its
/// default), for a program that embeds a service: `program` names it in errors, which say which
/// variable holds a bad value.
pub fn from_env<S: Args + FromArgMatches>(program: &'static str) -> Result<S, String> {
    let command = S::augment_args(Command::new(program));
    command
        .try_get_matches_from([program])
        .and_then(|matches| S::from_arg_matches(&matches))
        .map_err(|e| {
            let rendered = e.render().to_string();
            let first = rendered.lines().next().unwrap_or_default();
            format!("from the environment: {}", first.trim_start_matches("error: "))
        })
}

/// When a field of `S` has no default: a programming error that every section's unit test
/// catches.
#[allow(clippy::expect_used)]
pub fn defaults<S: Args + FromArgMatches>() -> S {
    let command = S::augment_args(Command::new("defaults")).mut_args(|arg| arg.env(None));
    let matches = command
        .try_get_matches_from(["defaults"])
        .expect("every setting has a default");
    S::from_arg_matches(&matches).expect("the defaults parse into the settings")
}

/// Drives every row of `C`'s table of bounds through its real flags (the environment ignored):
/// at its cap and at its minimum the value must be taken, one past either refused with an error
/// naming the flag. `companions(flag)` lists other flags to set so that both edges of `flag` are
/// valid (a default must lie below its ceiling). For each service's unit tests.
pub fn check_every_bound<C>(
    validate: impl Fn(&C) -> Result<(), String>,
    companions: impl Fn(&str) -> Vec<String>,
) -> Result<(), String>
where
    C: Bounded + FromArgMatches,
{
    let command = C::augment_args(Command::new("service")).mut_args(|arg| arg.env(None));
    let parse = |args: Vec<String>| -> Result<(), String> {
        let matches = command.clone().try_get_matches_from(args).map_err(|e| e.to_string())?;
        validate(&C::from_arg_matches(&matches).map_err(|e| e.to_string())?)
    };
    for row in defaults::<C>().bounds() {
        let flag = flag_of(&command, row.field);
        let with = |value: &str| {
            let mut args = vec!["service".to_owned(), format!("{flag}={value}")];
            args.extend(companions(&flag));
            args
        };
        for (edge, outward) in [(row.cap, true), (row.min, false)] {
            parse(with(&edge.to_string())).map_err(|e| format!("{flag} = {edge} must be accepted: {e}"))?;
            let Some(past) = edge.step(outward) else { continue };
            match parse(with(&past)) {
                Ok(()) => return Err(format!("{flag} = {past} must be refused")),
                Err(e) if !e.contains(&flag) => {
                    return Err(format!("the error for {flag} = {past} does not name it: {e}"));
                }
                Err(_) => {}
            }
        }
    }
    Ok(())
}

impl Amount {
    /// The value one step past this one, up or down, as a flag would be given; `None` below a zero
    /// duration.
    fn step(self, up: bool) -> Option<String> {
        let tick = Duration::from_millis(1);
        match (self, up) {
            (Self::Count(n), true) => Some((n + 1).to_string()),
            (Self::Count(n), false) => Some((n - 1).to_string()),
            (Self::Duration(d), true) => Some(humantime::format_duration(d + tick).to_string()),
            (Self::Duration(d), false) => d.checked_sub(tick).map(|d| humantime::format_duration(d).to_string()),
        }
    }
}

/// Parses a human duration such as `30s`, `1m 30s` or `250ms` (for clap's `value_parser`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| format!("invalid duration {s:?}: {e} (examples: 30s, 250ms, 2m)"))
}

/// Defines a service's `SecuritySettings` section: TLS, mTLS, authentication and the plaintext
/// health address, with the service's environment prefix (`ORCHESTRATOR`, `TOOL_RUNNER`). One
/// definition for both services, so the flags are the same everywhere.
#[macro_export]
macro_rules! security_settings {
    ($prefix:literal) => {
        /// Who may connect and call: TLS, mTLS, authentication, and the plaintext health
        /// address for probes.
        #[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
        #[command(next_help_heading = "Security")]
        pub struct SecuritySettings {
            /// PEM certificate chain to serve TLS with (needs --tls-key); reloaded when it changes.
            #[arg(long, env = concat!($prefix, "_TLS_CERT"))]
            pub tls_cert: Option<std::path::PathBuf>,
            /// PEM private key of --tls-cert.
            #[arg(long, env = concat!($prefix, "_TLS_KEY"))]
            pub tls_key: Option<std::path::PathBuf>,
            /// PEM CA bundle: callers must present a certificate it signed (mTLS; needs --tls-cert).
            #[arg(long, env = concat!($prefix, "_TLS_CLIENT_CA"))]
            pub tls_client_ca: Option<std::path::PathBuf>,
            /// How often the TLS files, --auth-tokens and the orchestrator's --agents and --tool-runner-* files are checked for changes (cap 1h).
            #[arg(long, env = concat!($prefix, "_TLS_RELOAD_INTERVAL"), default_value = "10s", value_parser = $crate::config::parse_duration)]
            pub tls_reload_interval: std::time::Duration,
            /// Longest TLS handshake before the connection is closed (cap 60s).
            #[arg(long, env = concat!($prefix, "_TLS_HANDSHAKE_TIMEOUT"), default_value = "10s", value_parser = $crate::config::parse_duration)]
            pub tls_handshake_timeout: std::time::Duration,
            /// TLS handshakes in progress at once; connections beyond it are closed at once, so a
            /// flood of slow handshakes cannot take the server's memory (cap 65536).
            #[arg(long, env = concat!($prefix, "_TLS_MAX_PENDING_HANDSHAKES"), default_value_t = 1024)]
            pub tls_max_pending_handshakes: usize,
            /// Tokens file (TOML `[[token]]` entries: principal, sha256, tools, max_runs, limits); callers then need `authorization: Bearer <token>`.
            #[arg(long, env = concat!($prefix, "_AUTH_TOKENS"))]
            pub auth_tokens: Option<std::path::PathBuf>,
            /// Take the principal from the verified client certificate's subject (common name) when no token is sent (needs --tls-client-ca).
            #[arg(long, env = concat!($prefix, "_AUTH_PRINCIPAL_FROM_CERT"))]
            pub auth_principal_from_cert: bool,
            /// Also serve plaintext gRPC health (only) on this address, for Kubernetes probes when the main port needs TLS or auth.
            #[arg(long, env = concat!($prefix, "_HEALTH_LISTEN"))]
            pub health_listen: Option<std::net::SocketAddr>,
        }

        impl $crate::config::Bounded for SecuritySettings {
            fn bounds(&self) -> Vec<$crate::config::Bound> {
                use std::time::Duration;
                vec![
                    $crate::config::bound("tls_reload_interval", self.tls_reload_interval, Duration::from_secs(1), Duration::from_secs(3600)),
                    $crate::config::bound("tls_handshake_timeout", self.tls_handshake_timeout, Duration::from_millis(100), Duration::from_secs(60)),
                    $crate::config::bound("tls_max_pending_handshakes", self.tls_max_pending_handshakes, 1usize, 65536usize),
                ]
            }
        }

        impl SecuritySettings {
            /// The TLS files, when TLS is on; an error when the flags do not go together.
            pub fn tls_files(&self) -> Result<Option<$crate::tls::ServerTlsFiles>, String> {
                $crate::serving::tls_files(self.tls_cert.as_deref(), self.tls_key.as_deref(), self.tls_client_ca.as_deref(), self.auth_principal_from_cert)
            }

            /// What [`$crate::serving::Security::start`] needs.
            pub fn options(&self) -> Result<$crate::serving::SecurityOptions, String> {
                Ok($crate::serving::SecurityOptions {
                    tls: self.tls_files()?,
                    auth_tokens: self.auth_tokens.clone(),
                    principal_from_cert: self.auth_principal_from_cert,
                    reload_interval: self.tls_reload_interval,
                    handshakes: $crate::tls::Handshakes {
                        timeout: self.tls_handshake_timeout,
                        max_pending: self.tls_max_pending_handshakes,
                    },
                    health_listen: self.health_listen,
                })
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A section as the services declare theirs.
    #[derive(Debug, Clone, clap::Args)]
    struct Section {
        /// A count.
        #[arg(long = "n-things", env = "SHARED_TEST_N_THINGS", default_value_t = 5)]
        n: u32,
        /// A time.
        #[arg(long, env = "SHARED_TEST_GRACE", default_value = "9s", value_parser = parse_duration)]
        grace: Duration,
    }

    impl Bounded for Section {
        fn bounds(&self) -> Vec<Bound> {
            vec![
                bound("n", self.n, 1u32, 10u32),
                bound("grace", self.grace, Duration::ZERO, Duration::from_secs(10)),
            ]
        }
    }

    #[test]
    fn counts_are_checked_at_both_edges_and_the_error_names_the_flag() {
        let at = |n| Section { n, ..defaults() };
        assert!(at(10).check_bounds().is_ok());
        assert!(at(1).check_bounds().is_ok());
        assert_eq!(
            at(11).check_bounds().unwrap_err().to_string(),
            "--n-things = 11 is above its cap of 10"
        );
        assert!(matches!(at(0).check_bounds(), Err(ConfigError::BelowMin { .. })));
    }

    #[test]
    fn durations_compare_by_value_not_by_text() {
        let at = |secs| Section {
            grace: Duration::from_secs(secs),
            ..defaults()
        };
        assert!(at(10).check_bounds().is_ok());
        assert_eq!(
            at(11).check_bounds().unwrap_err().to_string(),
            "--grace = 11s is above its cap of 10s"
        );
    }

    #[test]
    fn defaults_come_from_the_flags() {
        let section: Section = defaults();
        assert_eq!((section.n, section.grace), (5, Duration::from_secs(9)));
        assert_eq!(flag::<Section>("n"), "--n-things");
    }

    #[test]
    fn parses_human_durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration(" 2m "), Ok(Duration::from_secs(120)));
        assert!(parse_duration("soon").unwrap_err().contains("invalid duration"));
    }
}
