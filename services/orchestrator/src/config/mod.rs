//! The orchestrator's settings, in sections. Each section is a clap `Args` struct that *is* the
//! configuration: a field's flag, environment variable, default and doc are in its attribute and
//! doc comment, and its range in the section's [`Bounded::bounds`] table, which names the field
//! (the flag an error names comes from the struct). Adding a setting touches one struct.
//!
//! [`Config::default`] is what the flags declare, whatever the environment holds; the binary
//! reads the flags and their environment variables into the same structs.
//!
//! The sections, a file each: `server.rs` (listen address, drain, request size), `llm.rs` (the
//! model fleet), `tool_runners.rs`, `runs.rs` (slots, events, approvals), `limits.rs` (a run's
//! limits and their ceilings), `output.rs` (output bounds), `loop_detector.rs`, `requests.rs`
//! (what one request may carry), `store.rs` (the store's backend, leases, event logs),
//! `signals.rs` (the signal topic), `nats.rs` (NATS credentials and replicas), `telemetry.rs`,
//! `threads.rs` (messages sent to live runs), `console.rs` (the console's port and sessions),
//! `a2a.rs` (the A2A port), `webhooks.rs` (where and how webhooks are delivered).

mod a2a;
mod console;
mod limits;
mod llm;
mod loop_detector;
mod nats;
mod output;
mod requests;
mod runs;
mod server;
mod signals;
mod store;
mod telemetry;
mod threads;
mod tool_runners;
mod webhooks;

pub use a2a::A2aSettings;
pub use console::{ConsoleSettings, MAX_SESSION_TTL};
pub use limits::LimitSettings;
pub use llm::{Header, LlmSettings, LlmTarget, Reader};
pub use loop_detector::LoopDetectorSettings;
pub use nats::{Backend, NatsSettings};
pub use output::OutputSettings;
pub use requests::RequestBounds;
pub use runs::RunSettings;
pub use server::ServerSettings;
pub use signals::{SignalSettings, StreamDiscard};
pub use store::StoreSettings;
pub use telemetry::TelemetrySettings;
pub use threads::ThreadSettings;
pub use tool_runners::{Target, ToolRunnerSettings};
pub use webhooks::WebhookSettings;

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use shared::config::{Bound, Bounded, flag};
use shared::config_file::Renamed;

use crate::Error;

/// Flags renamed: the old names (flag and environment variable) work, with a warning, until the
/// next release.
pub const RENAMED: &[Renamed] = &[
    Renamed {
        old: "handoff-grace",
        new: "hand-over-grace",
        old_env: "ORCHESTRATOR_HANDOFF_GRACE",
        new_env: "ORCHESTRATOR_HAND_OVER_GRACE",
    },
    Renamed {
        old: "max-awaiting-runs",
        new: "max-parked-runs",
        old_env: "ORCHESTRATOR_MAX_AWAITING_RUNS",
        new_env: "ORCHESTRATOR_MAX_PARKED_RUNS",
    },
];

const KIB: usize = 1024;

const MIB: usize = 1024 * 1024;

const fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

const fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

const DAY: Duration = secs(86_400);

/// Everything the server needs; the flags of `serve`.
#[derive(Debug, Clone, Args)]
pub struct Config {
    /// TOML file of settings whose keys are these long flags (`max-concurrency = 64`, lists for
    /// repeatable ones); a flag or its environment variable wins over the file.
    #[arg(long = "config", env = "ORCHESTRATOR_CONFIG", value_name = "FILE")]
    pub config_file: Option<PathBuf>,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub server: ServerSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub llm: LlmSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub tool_runners: ToolRunnerSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub limits: LimitSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub runs: RunSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub threads: ThreadSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub signals: SignalSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub store: StoreSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub nats: NatsSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub telemetry: TelemetrySettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub security: SecuritySettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub console: ConsoleSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub a2a: A2aSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub webhooks: WebhookSettings,
}

shared::security_settings!("ORCHESTRATOR");

impl Bounded for Config {
    fn bounds(&self) -> Vec<Bound> {
        let sections = [
            self.server.bounds(),
            self.llm.bounds(),
            self.tool_runners.bounds(),
            self.limits.bounds(),
            self.runs.bounds(),
            self.threads.bounds(),
            self.signals.bounds(),
            self.store.bounds(),
            self.a2a.bounds(),
            self.webhooks.bounds(),
            self.nats.bounds(),
            self.telemetry.bounds(),
            self.security.bounds(),
            self.console.bounds(),
        ];
        sections.into_iter().flatten().collect()
    }
}

impl Default for Config {
    fn default() -> Self {
        shared::config::defaults()
    }
}

impl Config {
    /// A configuration talking to `llm_base_url` and `tool_runners`, everything else default.
    pub fn new(llm_base_url: &str, model: &str, tool_runners: Vec<String>) -> Self {
        let mut config = Self::default();
        config.llm.base_urls = vec![llm_base_url.to_owned()];
        config.llm.model = model.to_owned();
        config.tool_runners.endpoints = tool_runners;
        config
    }

    /// Drops the blank entries of lists read from the environment (`ORCHESTRATOR_EXIT_TOOLS=""`,
    /// `"a,,b"`), which mean nothing.
    pub fn without_blanks(mut self) -> Self {
        self.runs.exit_tools.retain(|t| !t.name.is_empty());
        self.runs.approval_tools.retain(|t| !t.trim().is_empty());
        self.llm.headers.retain(|h| !h.is_blank());
        self.llm.base_urls.retain(|u| !u.trim().is_empty());
        self
    }

    /// Checks every limit against its range and every name against its rules; the error names
    /// the flag.
    pub fn validate(&self) -> Result<(), Error> {
        self.check_bounds()?;
        for target in &self.tool_runners.endpoints {
            target
                .parse::<Target>()
                .map_err(|e| Error::Config(format!("{} {e}", flag::<ToolRunnerSettings>("endpoints"))))?;
        }
        self.security.options().map_err(Error::Config)?;
        self.check_llm_headers()?;
        self.llm.targets().map_err(Error::Config)?;
        self.llm.affinity_header().map_err(Error::Config)?;
        self.llm.defaults().map_err(Error::Config)?;
        self.check_nats_names()?;
        self.check_run_store_ttl()?;
        self.check_approvers()?;
        self.check_console()?;
        self.check_exit_tools()
    }

    /// A console without authentication serves loopback only, unless told otherwise.
    fn check_console(&self) -> Result<(), Error> {
        let console = &self.console;
        let open = self.security.auth_tokens.is_none() && !self.security.auth_principal_from_cert;
        match console.console_listen {
            Some(address) if open && !address.ip().is_loopback() && !console.console_allow_unauthenticated => {
                Err(Error::Config(format!(
                    "{} {address}: without authentication (--auth-tokens or --auth-principal-from-cert) anyone who reaches the console reads every run and decides every call; serve it on loopback, turn authentication on, or say {} to serve it so",
                    flag::<ConsoleSettings>("console_listen"),
                    flag::<ConsoleSettings>("console_allow_unauthenticated")
                )))
            }
            _ => Ok(()),
        }
    }

    /// With the NATS store a live run's entries (its record, the index entry that finds it when
    /// its replica is gone) are written once and must outlive the longest run.
    fn check_run_store_ttl(&self) -> Result<(), Error> {
        let (ttl, ceiling) = (self.store.ttl, self.limits.run_timeout_ceiling);
        if matches!(self.store.backend, Backend::Nats(_)) && ttl < ceiling {
            return Err(Error::Config(format!(
                "{} {ttl:?} is shorter than {} {ceiling:?}: a quiet run's entries in the store would expire while it lives",
                flag::<StoreSettings>("ttl"),
                flag::<LimitSettings>("run_timeout_ceiling")
            )));
        }
        Ok(())
    }

    /// Approvers come from the tokens file: a server that lets only approvers decide needs one.
    fn check_approvers(&self) -> Result<(), Error> {
        if self.runs.approvals_need_approver && self.security.auth_tokens.is_none() {
            return Err(Error::Config(format!(
                "{} needs {}: the approver role is given in the tokens file",
                flag::<RunSettings>("approvals_need_approver"),
                flag::<SecuritySettings>("auth_tokens")
            )));
        }
        Ok(())
    }

    /// Every extra LLM header is `Name: value`; the error never shows the entry (it may be a
    /// credential without its name).
    fn check_llm_headers(&self) -> Result<(), Error> {
        if let Some(index) = self.llm.headers.iter().position(Header::is_malformed) {
            return Err(Error::Config(format!(
                "{} entry {} is not `Name: value` (not shown: it may hold a credential)",
                flag::<LlmSettings>("headers"),
                index + 1
            )));
        }
        if let Some(header) = self.llm.headers.iter().find(|h| h.is_framing()) {
            return Err(Error::Config(format!(
                "{} may not set {:?}: the HTTP client frames each request itself",
                flag::<LlmSettings>("headers"),
                header.name
            )));
        }
        Ok(())
    }

    /// NATS subjects, streams and buckets are dot-separated tokens of letters, digits, `_`, `-`.
    fn check_nats_names(&self) -> Result<(), Error> {
        let token = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        let prefix = &self.signals.subject_prefix;
        if !prefix.split('.').all(token) {
            return Err(Error::Config(format!(
                "{} {prefix:?}: dot-separated tokens of letters, digits, '_' or '-'",
                flag::<SignalSettings>("subject_prefix")
            )));
        }
        for (flag, name) in [
            (flag::<SignalSettings>("stream"), &self.signals.stream),
            (flag::<StoreSettings>("bucket"), &self.store.bucket),
            (flag::<StoreSettings>("event_log_stream"), &self.store.event_log_stream),
        ] {
            if !token(name) {
                return Err(Error::Config(format!("{flag} {name:?}: letters, digits, '_' or '-'")));
            }
        }
        Ok(())
    }

    /// Exit tools have valid, distinct names and usable schemas.
    fn check_exit_tools(&self) -> Result<(), Error> {
        let flag = flag::<RunSettings>("exit_tools");
        let mut seen = std::collections::HashSet::new();
        for tool in self.runs.exit_tools.iter().filter(|t| !t.name.is_empty()) {
            if !shared::tools::valid_tool_name(&tool.name) {
                return Err(Error::Config(format!(
                    "{flag} {:?}: names are 1-64 of letters, digits, '_' or '-'",
                    tool.name
                )));
            }
            if !seen.insert(&tool.name) {
                return Err(Error::Config(format!("{flag} {:?} is given twice", tool.name)));
            }
            shared::tools::check_schema(&tool.parameters)
                .map_err(|e| Error::Config(format!("{flag} {}: {e}", tool.name)))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::runs::exit_tool;
    use super::*;
    use crate::domain::params::ToolChoice;
    use shared::secrets::Secret;

    /// Settings whose range depends on this one, set so that both edges of this one are valid.
    fn companions(flag: &str) -> Vec<String> {
        let others: &[&str] = match flag {
            "--loop-window" => &["--loop-threshold=2"],
            "--llm-max-line-bytes" => &["--llm-max-event-bytes=67108864"],
            "--max-turns-ceiling" => &["--max-turns=1"],
            "--tool-call-budget-ceiling" => &["--tool-call-budget=0"],
            "--max-tool-failures-ceiling" => &["--max-tool-failures=0"],
            "--tool-timeout-ceiling" => &["--tool-timeout=1ms"],
            "--run-timeout-ceiling" => &["--run-timeout=1ms"],
            "--approval-timeout-ceiling" => &["--approval-timeout=1ms"],
            "--input-timeout-ceiling" => &["--input-timeout=1ms"],
            "--max-total-tokens-ceiling" => &["--max-total-tokens=1"],
            "--trace-payload-max-bytes" => &["--trace-tool-payloads"],
            _ => &[],
        };
        others.iter().map(|o| (*o).to_owned()).collect()
    }

    /// With NATS, results must be kept at least as long as the longest run may last.
    #[test]
    fn the_nats_store_keeps_entries_at_least_as_long_as_the_longest_run() {
        use clap::Parser;
        #[derive(Parser)]
        struct Flags {
            #[command(flatten)]
            config: Config,
        }
        let validate = |args: &[&str]| {
            let mut argv = vec!["orchestrator"];
            argv.extend_from_slice(args);
            let flags = Flags::try_parse_from(argv).map_err(|e| e.to_string())?;
            flags.config.validate().map_err(|e| e.to_string())
        };
        let nats = |ttl: &'static str| {
            [
                "--run-store",
                "nats://127.0.0.1:4222",
                "--run-store-ttl",
                ttl,
                "--run-timeout-ceiling",
                "1h",
            ]
        };
        assert!(validate(&nats("1h")).is_ok());
        let refused = validate(&nats("59m")).unwrap_err();
        assert!(
            refused.contains("--run-store-ttl") && refused.contains("--run-timeout-ceiling"),
            "{refused}"
        );
        assert!(validate(&["--run-store-ttl", "1m"]).is_ok(), "no NATS, no check");
    }

    /// The grace a runner is held to when the store keeps none is the one the flag defaults to.
    #[test]
    fn the_default_fence_grace_is_the_shared_one() {
        assert_eq!(Config::default().store.fence_grace, shared::fence::DEFAULT_GRACE);
    }

    #[test]
    fn the_defaults_are_valid() {
        assert!(Config::default().validate().is_ok());
    }

    /// Every row of the table, through the real flags, on both sides of both edges.
    #[test]
    fn every_bound_holds_on_both_sides() {
        let validate = |c: &Config| c.validate().map_err(|e| e.to_string());
        assert_eq!(shared::config::check_every_bound(validate, companions), Ok(()));
    }

    #[test]
    fn names_and_exit_tools_are_checked() {
        let mut config = Config::default();
        config.signals.subject_prefix = "a..b".into();
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("--signal-subject-prefix")
        );
        let mut config = Config::default();
        config.runs.exit_tools = vec![exit_tool("done").unwrap(), exit_tool("done").unwrap()];
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("--exit-tool \"done\" is given twice")
        );
        let mut config = Config::default();
        config.tool_runners.endpoints = vec!["dns://x".into()];
        assert!(config.validate().unwrap_err().to_string().contains("--tool-runner"));
        for (urls, refused) in [
            (vec!["dns://x/v1"], true),
            (vec!["dns:///x/v1"], true),
            (vec!["ftp://x/v1"], true),
            (vec![], true),
            (vec!["dns:///vllm.models:8000/v1", "http://a:1/v1"], false),
        ] {
            let mut config = Config::default();
            config.llm.base_urls = urls.iter().map(|u| (*u).to_owned()).collect();
            let checked = config.validate();
            assert_eq!(checked.is_err(), refused, "{urls:?}: {checked:?}");
            if let Err(e) = checked {
                assert!(e.to_string().contains("--llm-base-url"), "{e}");
            }
        }
        let mut config = Config::default();
        config.llm.affinity_header = Some("not a header".into());
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("--llm-affinity-header")
        );
    }

    #[test]
    fn blank_list_entries_mean_nothing() {
        let mut config = Config::default();
        config.runs.exit_tools = vec![exit_tool("a").unwrap(), exit_tool("").unwrap()];
        config.llm.headers = vec!["".parse().unwrap(), "X-A: 1".parse().unwrap()];
        assert!(config.validate().is_ok());
        let config = config.without_blanks();
        assert_eq!(config.runs.exit_tools.len(), 1);
        assert_eq!(config.llm.headers.len(), 1);
    }

    #[test]
    fn secrets_stay_out_of_debug_output() {
        let mut config = Config::default();
        config.llm.api_key = Some(Secret::from("sk-secret"));
        config.llm.headers = vec!["X-Gateway-Key: hunter2".parse().unwrap()];
        let debug = format!("{config:?}");
        assert!(!debug.contains("sk-secret") && !debug.contains("hunter2"), "{debug}");
        assert!(debug.contains("X-Gateway-Key"), "{debug}");
    }

    #[test]
    fn run_defaults_from_flags_are_checked_like_a_request() {
        use clap::Parser;
        #[derive(Parser)]
        struct Flags {
            #[command(flatten)]
            llm: LlmSettings,
        }
        let parse = |args: &[&str]| {
            let mut argv = vec!["orchestrator"];
            argv.extend_from_slice(args);
            Flags::try_parse_from(argv).map_err(|e| e.to_string())?.llm.defaults()
        };
        let ok = parse(&[
            "--llm-temperature",
            "2",
            "--llm-tool-choice",
            "required",
            "--llm-extra-body",
            r#"{"top_k": 5}"#,
        ])
        .unwrap();
        assert_eq!(
            (ok.temperature, ok.tool_choice),
            (Some(2.0), Some(ToolChoice::Required))
        );
        assert_eq!(ok.extra_body["top_k"], 5);
        assert!(
            parse(&["--llm-temperature", "2.1"])
                .unwrap_err()
                .contains("temperature = 2.1 is outside 0..=2")
        );
        assert!(
            parse(&["--llm-extra-body", r#"{"stream": false}"#])
                .unwrap_err()
                .contains("may not set \"stream\"")
        );
        assert!(
            parse(&["--llm-extra-body", "nope"])
                .unwrap_err()
                .contains("--llm-extra-body")
        );
        assert!(parse(&["--llm-tool-choice", "two words"]).is_err());
        assert!(parse(&["--llm-reasoning-effort", "HIGH"]).is_err());
    }

    #[test]
    fn framing_headers_are_refused_and_others_pass() {
        for framing in [
            "Content-Length: 5",
            "transfer-encoding: chunked",
            "HOST: evil",
            "Connection: close",
            "TE: trailers",
        ] {
            let mut config = Config::default();
            config.llm.headers = vec![framing.parse().unwrap()];
            let error = config.validate().unwrap_err().to_string();
            assert!(error.contains("--llm-header may not set"), "{framing}: {error}");
        }
        let mut config = Config::default();
        config.llm.headers = vec![
            "X-Content-Length-Hint: 5".parse().unwrap(),
            "Authorization-Extra: x".parse().unwrap(),
        ];
        assert!(config.validate().is_ok());
    }

    #[test]
    fn only_approvers_deciding_needs_a_tokens_file() {
        let mut config = Config::default();
        config.runs.approvals_need_approver = true;
        let error = config.validate().unwrap_err().to_string();
        assert!(
            error.contains("--approvals-need-approver needs --auth-tokens"),
            "{error}"
        );
        config.security.auth_tokens = Some("tokens.toml".into());
        assert!(config.validate().is_ok());
    }

    #[test]
    fn a_malformed_header_is_refused_without_being_shown() {
        let mut config = Config::default();
        config.llm.headers = vec!["X-A: 1".parse().unwrap(), "X-Gateway-Key hunter2".parse().unwrap()];
        let error = config.without_blanks().validate().unwrap_err().to_string();
        assert!(error.contains("--llm-header entry 2 is not `Name: value`"), "{error}");
        assert!(!error.contains("hunter2"), "{error}");
    }

    #[test]
    fn nats_credentials_stay_out_of_the_backend_and_its_errors() {
        let backend: Backend = "nats://svc:pa55word@nats:4222".parse().unwrap();
        let shown = format!("{backend:?}");
        assert!(!shown.contains("pa55word") && shown.contains("nats:4222"), "{shown}");
        let error = "natz://svc:pa55word@nats:4222".parse::<Backend>().unwrap_err();
        assert!(!error.contains("pa55word"), "{error}");
    }
}
