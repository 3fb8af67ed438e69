//! Command line: `serve` (the default) with flags that all have environment equivalents, and
//! the client commands, one per thing a person does with runs ([`ClientCommand`]): `call`
//! (start a run, or attach to one: [`call`]), `get`, `cancel` and `runs` ([`runs`]), `approvals`,
//! `decide` and `answer` ([`decide`]), `say`, `thread`, `usage` and `agents` ([`thread`]),
//! `webhooks` ([`webhooks`]); each prints JSON with `--json` ([`output`]): one line of the
//! answer, or for `call` one line per event; `runs` and `approvals` follow changes with
//! `--watch` ([`watch`]). The one-command demo is its own binary
//! (`cargo run -p demo`), so this one carries no stand-in model.

use std::time::Duration;

use clap::{Args, CommandFactory, Parser, Subcommand};

use crate::Config;

/// `println!` for lines that carry text the CLI did not write (a model's, a tool's, a server's):
/// printed without terminal control sequences ([`shared::text::printable`]).
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::cli::output::line(&shared::text::printable(&format!($($arg)*)))
    };
}

pub mod call;
pub mod decide;
pub mod output;
pub mod runs;
pub mod thread;
pub mod watch;
pub mod webhooks;

/// The orchestrator: runs LLM tool loops for other services over gRPC.
#[derive(Debug, Parser)]
#[command(name = "orchestrator", version, about, args_conflicts_with_subcommands = true)]
pub struct Cli {
    /// What to do; `serve` when omitted.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Flags of `serve`, accepted without the subcommand too.
    #[command(flatten)]
    pub serve: Config,
}

impl Cli {
    /// Parses the command line, the environment and the `--config` file (see
    /// [`shared::config_file`]; a bad file is exit code 2); a renamed flag's old name is said in a
    /// warning. A refused value is echoed by the error message, so the userinfo of any URL in it
    /// is removed first (`nats://user:password@…`); `--help` and `--version` print as usual.
    pub fn parse_args() -> Self {
        let argv = shared::config_file::with_settings_file(
            &Self::command(),
            std::env::args_os().collect(),
            "ORCHESTRATOR_CONFIG",
        )
        .unwrap_or_else(|e| {
            eprintln!(
                "error: {}",
                shared::text::printable(&shared::secrets::without_userinfo(&e))
            );
            std::process::exit(2)
        });
        let (argv, renamed) = shared::config_file::with_renamed_flags(&Self::command(), argv, crate::config::RENAMED);
        for warning in renamed {
            eprintln!("warning: {warning}");
        }
        Self::try_parse_from(argv).unwrap_or_else(|error| {
            if !error.use_stderr() {
                error.exit()
            }
            let message = match unknown_command(&error) {
                Some(word) => not_a_command(&word),
                None => error.render().to_string(),
            };
            eprint!(
                "{}",
                shared::text::printable(&shared::secrets::without_userinfo(&message))
            );
            std::process::exit(error.exit_code())
        })
    }
}

/// The word a command line gave where a command goes, when it is none.
fn unknown_command(error: &clap::Error) -> Option<String> {
    if error.kind() != clap::error::ErrorKind::InvalidSubcommand {
        return None;
    }
    match error.get(clap::error::ContextKind::InvalidSubcommand) {
        Some(clap::error::ContextValue::String(word)) => Some(word.clone()),
        _ => None,
    }
}

/// What a word that is no command is told: the one command it is a typo of, when one is
/// clearly closest (clap's own hint lists every command that is somewhat close, such as `call`
/// for `cancle`, which starts a run), and the commands there are.
fn not_a_command(word: &str) -> String {
    let command = Cli::command();
    let names: Vec<&str> = command
        .get_subcommands()
        .flat_map(|c| std::iter::once(c.get_name()).chain(c.get_visible_aliases()))
        .collect();
    let hint = match typo_of(word, &names) {
        Some(name) => format!("; did you mean '{name}'?"),
        None => String::new(),
    };
    format!(
        "error: '{word}' is not a command of orchestrator{hint}\n  commands: {}\n  see orchestrator --help\n",
        names.join(", ")
    )
}

/// The one name of `names` that `word` is a typo of: within one edit (or a swap) per four
/// letters, and closer than every other.
fn typo_of<'a>(word: &str, names: &[&'a str]) -> Option<&'a str> {
    let most = (word.chars().count() / 4).max(1);
    let mut ranked: Vec<(usize, &str)> = names
        .iter()
        .map(|name| (strsim::damerau_levenshtein(word, name), *name))
        .filter(|(distance, _)| *distance <= most)
        .collect();
    ranked.sort();
    match ranked.as_slice() {
        [(best, name), rest @ ..] if rest.first().is_none_or(|(next, _)| next > best) => Some(name),
        _ => None,
    }
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve gRPC (the default).
    Serve(Box<Config>),
    #[allow(missing_docs)]
    #[command(flatten)]
    Client(Box<ClientCommand>),
}

/// The commands that call a running orchestrator.
#[derive(Debug, Subcommand)]
pub enum ClientCommand {
    /// Start a run on a running orchestrator and print its events, start one in the background
    /// (--detach: its id), or attach to one (--attach).
    Call(Box<call::CallArgs>),
    /// Show a run, live or ended (GetRun): its status, output so far, calls and what it waits for.
    #[command(visible_alias = "show")]
    Get(runs::GetArgs),
    /// Cancel a live run, at once or once its turn in progress has ended (CancelRun).
    Cancel(runs::CancelArgs),
    /// Find runs (ListRuns), newest first: yours, or everyone's with the operator role.
    #[command(visible_alias = "list")]
    Runs(runs::RunsArgs),
    /// List the tool calls waiting for a person's decision or answers that the caller may take.
    Approvals(decide::ApprovalsArgs),
    /// Decide tool calls waiting for approval: approve, reject or approve with edited arguments.
    Decide(decide::DecideArgs),
    /// Answer the questions a tool call asks before it can finish (AnswerToolInput).
    Answer(decide::AnswerArgs),
    /// Send a user message to a live run: it joins the run's conversation at its next turn
    /// boundary (SendMessage).
    Say(thread::SayArgs),
    /// Print a thread (GetThread): its runs and messages; or delete it (--delete).
    Thread(thread::ThreadArgs),
    /// What a principal spent an hour at a time (GetUsage): yours, or anyone's as an operator.
    Usage(thread::UsageArgs),
    /// The named agents you may run as (ListAgents): `call --agent NAME` names one.
    Agents(thread::AgentsArgs),
    /// Your webhooks: `add URL`, `list`, `delete ID`, and `deliveries` with their attempts.
    Webhooks(webhooks::WebhooksArgs),
    /// Follow the signals (exit calls) runs send, as they come (SubscribeSignals).
    Signals(thread::SignalsArgs),
    /// Print a shell completion script: `orchestrator completions bash > /etc/bash_completion.d/orchestrator`.
    Completions(CompletionsArgs),
}

/// Flags of `completions`.
#[derive(Debug, Clone, Args)]
pub struct CompletionsArgs {
    /// The shell.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

impl CompletionsArgs {
    /// Prints the completion script of `shell` for every command and flag.
    pub fn run(&self) -> Outcome {
        let mut command = <Cli as clap::CommandFactory>::command();
        let mut script = Vec::new();
        clap_complete::generate(self.shell, &mut command, "orchestrator", &mut script);
        output::line(String::from_utf8_lossy(&script).trim_end());
        Outcome::Success
    }
}

/// How a client command ended, which its exit code says — the same in the Python and
/// TypeScript clients: 0 it succeeded (a run completed, or is still live where a command only
/// reads it), 1 the run failed (or the command did not succeed), 2 the run was canceled (2 is
/// also a command line that is not one), 3 the call itself failed (refused by the server, or the
/// server not reached), 141 its reader went away (`| head`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// 0.
    Success,
    /// 1.
    Failed,
    /// 2.
    Canceled,
}

impl Outcome {
    /// The outcome of a command that followed or read a run with status `status`.
    pub fn of_run(status: i32) -> Self {
        use proto::orchestrator::v1::RunStatus as S;
        match S::try_from(status).unwrap_or_default() {
            S::Failed => Self::Failed,
            S::Canceled => Self::Canceled,
            _ => Self::Success,
        }
    }

    fn of(succeeded: bool) -> Self {
        if succeeded { Self::Success } else { Self::Failed }
    }
}

/// The exit code of a client command that ended with `result`, its failure printed on stderr.
pub fn exit_code(result: Result<Outcome, crate::Error>) -> std::process::ExitCode {
    use shared::runtime::Failure as _;
    std::process::ExitCode::from(match result {
        Ok(Outcome::Success) => 0,
        Ok(Outcome::Failed) => 1,
        Ok(Outcome::Canceled) => 2,
        Err(e) => {
            eprintln!("orchestrator: {e}");
            if e.is_usage() { 2 } else { 3 }
        }
    })
}

impl ClientCommand {
    /// Runs the command: how it ended (see [`Outcome`]).
    pub async fn run(self) -> Result<Outcome, crate::Error> {
        match self {
            Self::Call(args) if args.detach => call::start_detached(&args.to_options()?).await,
            Self::Call(args) => Ok(Outcome::of_run(call::call(&args.to_options()?).await?.status)),
            Self::Get(args) => args.run().await,
            Self::Cancel(args) => args.run().await.map(Outcome::of),
            Self::Runs(args) => args.run().await.map(Outcome::of),
            Self::Approvals(args) => args.run().await.map(Outcome::of),
            Self::Decide(args) => args.run().await.map(Outcome::of),
            Self::Answer(args) => args.run().await.map(Outcome::of),
            Self::Say(args) => args.run().await.map(Outcome::of),
            Self::Thread(args) => args.run().await.map(Outcome::of),
            Self::Usage(args) => args.run().await.map(Outcome::of),
            Self::Agents(args) => args.run().await.map(Outcome::of),
            Self::Webhooks(args) => args.run().await.map(Outcome::of),
            Self::Signals(args) => args.run().await.map(Outcome::of),
            Self::Completions(args) => Ok(args.run()),
        }
    }
}

/// How the client commands reach the orchestrator, and how they print.
#[derive(Debug, Clone, Args)]
pub struct Connection {
    /// The orchestrator's address, with its scheme (http:// or https://).
    #[arg(long, global = true, env = "ORCHESTRATOR_ENDPOINT", default_value = "http://127.0.0.1:50051", value_parser = endpoint)]
    pub endpoint: String,
    /// Bearer token sent with each call (when the orchestrator authenticates callers).
    #[arg(long, global = true, env = "ORCHESTRATOR_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Print the answer as one line of JSON (protobuf's JSON mapping, every field) for scripts.
    #[arg(long, global = true)]
    pub json: bool,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub tls: TlsArgs,
}

impl Connection {
    /// A client of the orchestrator, each call within 30 s.
    pub async fn client(&self) -> Result<orchestrator_client::Client, crate::Error> {
        let timeout = Duration::from_secs(30);
        // One attempt: a refusal of a call that writes (a webhook, a decision) is said, not
        // repeated.
        let once = orchestrator_client::Retry::none();
        call::connect(&self.endpoint, self.token.as_deref(), &self.tls, timeout, once).await
    }
}

/// The TLS a client command speaks to an orchestrator that serves it (an `https://` endpoint).
#[derive(Debug, Clone, Default, Args)]
pub struct TlsArgs {
    /// The CA that signed the orchestrator's certificate, PEM (an https:// endpoint needs it).
    #[arg(long = "ca", global = true, env = "ORCHESTRATOR_CA", value_name = "FILE")]
    pub ca: Option<std::path::PathBuf>,
    /// This client's certificate, PEM, for an orchestrator that asks for one (mTLS; with --key).
    #[arg(long = "cert", global = true, env = "ORCHESTRATOR_CLIENT_CERT", value_name = "FILE")]
    pub cert: Option<std::path::PathBuf>,
    /// This client's private key, PEM (with --cert).
    #[arg(long = "key", global = true, env = "ORCHESTRATOR_CLIENT_KEY", value_name = "FILE")]
    pub key: Option<std::path::PathBuf>,
}

impl TlsArgs {
    /// `builder` speaking TLS to `endpoint` as these flags say; an `https://` endpoint without
    /// `--ca`, or TLS flags for an `http://` one, is refused saying which flag to change.
    pub fn apply(
        &self,
        endpoint: &str,
        builder: orchestrator_client::ClientBuilder,
    ) -> Result<orchestrator_client::ClientBuilder, crate::Error> {
        let read = |flag: &str, path: &std::path::Path| {
            std::fs::read(path).map_err(|e| crate::Error::Config(format!("{flag} {}: {e}", path.display())))
        };
        let https = endpoint.starts_with("https://");
        let identity = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => Some((read("--cert", cert)?, read("--key", key)?)),
            (None, None) => None,
            _ => return Err(crate::Error::Config("--cert and --key go together (mTLS)".into())),
        };
        match (&self.ca, https) {
            (None, false) if identity.is_none() => Ok(builder),
            (None, true) => Err(crate::Error::Config(format!(
                "{endpoint} serves TLS: pass --ca FILE, the CA that signed its certificate (or set ORCHESTRATOR_CA)"
            ))),
            (_, false) => Err(crate::Error::Config(format!(
                "--ca, --cert and --key are for an https:// endpoint, not {endpoint}"
            ))),
            (Some(ca), true) => {
                let builder = builder.tls_ca_pem(read("--ca", ca)?);
                Ok(match identity {
                    Some((cert, key)) => builder.tls_identity_pem(cert, key),
                    None => builder,
                })
            }
        }
    }
}

/// An orchestrator address: `http://` or `https://` and a host (a bare `host:port` is refused
/// naming the scheme it lacks, rather than failing later as a "transport error").
pub fn endpoint(text: &str) -> Result<String, String> {
    let text = text.trim();
    match text.split_once("://") {
        Some(("http" | "https", rest)) if !rest.is_empty() => Ok(text.to_owned()),
        Some((scheme, _)) => Err(format!(
            "{text:?} has the scheme {scheme:?}: the orchestrator is reached over http:// or https://"
        )),
        None => Err(format!(
            "{text:?} has no scheme: write http://{text} (or https://{text} when the orchestrator serves TLS)"
        )),
    }
}

/// A run id, by the one rule of ids (`domain::ids`).
fn run_id(text: &str) -> Result<String, String> {
    crate::domain::ids::check("run id", text).map(|()| text.to_owned())
}

/// A thread id, by the one rule of ids.
fn thread_id(text: &str) -> Result<String, String> {
    crate::domain::ids::check("thread id", text).map(|()| text.to_owned())
}

/// `KEY=VALUE`.
fn key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("{text:?} is not KEY=VALUE")),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn flags_that_make_no_sense_together_are_refused() {
        let refused = |args: &[&str]| match Cli::try_parse_from([&["orchestrator", "call"][..], args].concat()) {
            Ok(Cli {
                command: Some(Command::Client(client)),
                ..
            }) => match *client {
                ClientCommand::Call(call) => call.to_options().is_err(),
                _ => false,
            },
            _ => true,
        };
        assert!(refused(&["--prompt", "x", "--after", "3"]), "--after without --attach");
        assert!(
            refused(&["--prompt", "x", "--on-busy", "enqueue"]),
            "--on-busy without --thread"
        );
        assert!(refused(&["--prompt", "x", "--thread", ""]), "an empty thread id");
        assert!(!refused(&["--attach", "r", "--after", "3"]));
        assert!(!refused(&["--prompt", "x", "--thread", "t", "--on-busy", "enqueue"]));
    }

    #[test]
    fn an_endpoint_names_the_scheme_it_lacks() {
        assert_eq!(
            endpoint("http://127.0.0.1:50051"),
            Ok("http://127.0.0.1:50051".to_owned())
        );
        assert!(endpoint("https://orchestrator:443").is_ok());
        let bare = endpoint("127.0.0.1:50051").unwrap_err();
        assert!(bare.contains("http://127.0.0.1:50051"), "{bare}");
        assert!(endpoint("grpc://x:1").unwrap_err().contains("http://"));
        assert!(endpoint("http://").is_err());
    }

    #[test]
    fn a_typo_names_only_the_command_it_is_a_typo_of() {
        assert!(Cli::try_parse_from(["orchestrator", "cancel", "r-1"]).is_ok());
        assert!(Cli::try_parse_from(["orchestrator", "get", "r-1"]).is_ok());
        let error = Cli::try_parse_from(["orchestrator", "cancle", "r-1"]).unwrap_err();
        assert_eq!(unknown_command(&error).as_deref(), Some("cancle"));
        for (typo, meant) in [
            ("cancle", Some("cancel")),
            ("canel", Some("cancel")),
            ("lsit", Some("list")),
            ("shwo", Some("show")),
            ("decid", Some("decide")),
            ("thred", Some("thread")),
            ("remove", None),
            ("stop", None),
            ("delete", None),
            ("status", None),
        ] {
            let told = not_a_command(typo);
            match meant {
                Some(name) => assert!(told.contains(&format!("did you mean '{name}'")), "{typo}: {told}"),
                None => assert!(!told.contains("did you mean"), "{typo}: {told}"),
            }
            assert!(told.contains("commands: ") && told.contains("cancel"), "{told}");
        }
    }
}
