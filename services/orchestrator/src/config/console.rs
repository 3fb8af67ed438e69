//! The console: the pages people use to watch runs and decide, served on a port of their own.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use shared::config::{Bound, Bounded, bound, parse_duration};

use super::{DAY, KIB, MIB, secs};

/// The longest a console session may last (`--console-session-ttl`'s cap): ended sessions are
/// kept this long.
pub const MAX_SESSION_TTL: Duration = DAY.saturating_mul(7);

/// The console (off unless `--console-listen` is set).
#[derive(Debug, Clone, PartialEq, Eq, Args)]
#[command(next_help_heading = "Console")]
pub struct ConsoleSettings {
    /// Serve the console (pages for watching runs, deciding tool calls and answering tools'
    /// questions) on this address, with the TLS and tokens of the gRPC port (unset: off).
    #[arg(long, env = "ORCHESTRATOR_CONSOLE_LISTEN")]
    pub console_listen: Option<SocketAddr>,
    /// The URL people open the console at when it is not its listen address (behind an Ingress:
    /// `https://console.example.com`): requests naming that host are taken, and with `https://`
    /// the session cookie is `Secure` and answers carry HSTS (unset: addresses and localhost
    /// only).
    #[arg(long, env = "ORCHESTRATOR_CONSOLE_PUBLIC_URL", value_name = "URL")]
    pub console_public_url: Option<String>,
    /// Serve the console without authentication on an address other than loopback: anyone who
    /// reaches it reads every run and decides every call (off: such a console does not start).
    #[arg(long, env = "ORCHESTRATOR_CONSOLE_ALLOW_UNAUTHENTICATED")]
    pub console_allow_unauthenticated: bool,
    /// How long a console sign-in lasts; lowering it shortens the sessions signed in before
    /// (cap 7d).
    #[arg(long, env = "ORCHESTRATOR_CONSOLE_SESSION_TTL", default_value = "8h", value_parser = parse_duration)]
    pub console_session_ttl: Duration,
    /// File holding the secret (at least 32 bytes) that signs console sessions: give every
    /// replica the same one, so a session signed in on one is good on all (unset: a secret of
    /// this process, its sessions good here only).
    #[arg(long, env = "ORCHESTRATOR_CONSOLE_SESSION_KEY_FILE", value_name = "FILE")]
    pub console_session_key_file: Option<PathBuf>,
    /// Live run pages the console follows at once; more are refused until one closes (cap
    /// 10000).
    #[arg(long, env = "ORCHESTRATOR_CONSOLE_MAX_STREAMS", default_value_t = 256)]
    pub console_max_streams: usize,
    /// Live run pages one session follows at once, so one person (or one stolen cookie) cannot
    /// hold every one of `--console-max-streams` (cap 1000).
    #[arg(long, env = "ORCHESTRATOR_CONSOLE_MAX_STREAMS_PER_SESSION", default_value_t = 8)]
    pub console_max_streams_per_session: usize,
    /// How often a live run page hears from the console while the run is quiet; each time its
    /// session is checked again, so a page whose session ended, expired or lost its token closes
    /// within one (cap 5m).
    #[arg(long, env = "ORCHESTRATOR_CONSOLE_KEEP_ALIVE", default_value = "15s", value_parser = parse_duration)]
    pub console_keep_alive: Duration,
    /// Sign-ins one address may try per minute; more are refused (`429`) until the minute
    /// ends (cap 10000).
    #[arg(long, env = "ORCHESTRATOR_CONSOLE_SIGN_INS_PER_MINUTE", default_value_t = 30)]
    pub console_sign_ins_per_minute: u32,
    /// How long the console waits for a request's head (a client that sends it slower holds a
    /// connection for nothing) (cap 5m).
    #[arg(long, env = "ORCHESTRATOR_CONSOLE_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub console_header_timeout: Duration,
    /// Largest request body the console takes, in bytes (a decision, an answer; cap 4 MiB).
    #[arg(long, env = "ORCHESTRATOR_CONSOLE_MAX_BODY_BYTES", default_value_t = 256 * KIB)]
    pub console_max_body_bytes: usize,
}

impl Bounded for ConsoleSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound(
                "console_session_ttl",
                self.console_session_ttl,
                secs(60),
                MAX_SESSION_TTL,
            ),
            bound(
                "console_max_streams_per_session",
                self.console_max_streams_per_session,
                1usize,
                1000usize,
            ),
            bound("console_keep_alive", self.console_keep_alive, secs(1), secs(300)),
            bound(
                "console_sign_ins_per_minute",
                self.console_sign_ins_per_minute,
                1u32,
                10_000u32,
            ),
            bound(
                "console_header_timeout",
                self.console_header_timeout,
                secs(1),
                secs(300),
            ),
            bound("console_max_streams", self.console_max_streams, 1usize, 10_000usize),
            bound("console_max_body_bytes", self.console_max_body_bytes, KIB, 4 * MIB),
        ]
    }
}
