//! Command line: `serve` (the default) with flags that all have environment equivalents, and
//! the client commands `call` (start a run on a running orchestrator, or attach to one),
//! `approvals`, `decide`, `answer` (a tool's questions), `say` (a message for a live run),
//! `thread` (print or delete one) and
//! `runs` (find runs: `ListRuns`) and `usage` (what a principal spent: `GetUsage`).
//! The one-command demo is its own binary (`cargo run -p demo`), so this one carries no stand-in
//! model.

use std::time::Duration;

use clap::{Args, CommandFactory, Parser, Subcommand};
use shared::config::parse_duration;

use crate::Config;

pub mod call;

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
    /// [`shared::config_file`]; a bad file is exit code 2). A refused value is echoed by the error
    /// message, so the userinfo of any URL in it is removed first (`nats://user:password@…`);
    /// `--help` and `--version` print as usual.
    pub fn parse_args() -> Self {
        let argv = shared::config_file::with_settings_file(
            &Self::command(),
            std::env::args_os().collect(),
            "ORCHESTRATOR_CONFIG",
        )
        .unwrap_or_else(|e| {
            eprintln!("error: {}", shared::secrets::without_userinfo(&e));
            std::process::exit(2)
        });
        Self::try_parse_from(argv).unwrap_or_else(|error| {
            if !error.use_stderr() {
                error.exit()
            }
            eprint!("{}", shared::secrets::without_userinfo(&error.render().to_string()));
            std::process::exit(error.exit_code())
        })
    }
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve gRPC (the default).
    Serve(Box<Config>),
    /// Start a run on a running orchestrator and print its events, or attach to one (--attach).
    Call(Box<CallArgs>),
    /// List the tool calls waiting for approval that the caller may decide.
    Approvals(ApprovalsArgs),
    /// Decide tool calls waiting for approval: approve, reject or approve with edited arguments.
    Decide(DecideArgs),
    /// Answer the questions a tool call asks before it can finish (AnswerToolInput).
    Answer(AnswerArgs),
    /// Send a user message to a live run: it joins the run's conversation at its next turn
    /// boundary (SendMessage).
    Say(SayArgs),
    /// Print a thread (GetThread): its runs and messages; or delete it (--delete).
    Thread(ThreadArgs),
    /// Find runs (ListRuns), newest first: yours, or everyone's with the operator role.
    Runs(RunsArgs),
    /// What a principal spent an hour at a time (GetUsage): yours, or anyone's as an operator.
    Usage(UsageArgs),
}

/// Flags of `usage`.
#[derive(Debug, Clone, Args)]
pub struct UsageArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
    /// The principal (default: yours; another's needs the operator role).
    #[arg(long, default_value = "")]
    pub principal: String,
    /// How far back (e.g. 24h, 3d; at most the server's --usage-max-range).
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    pub since: Duration,
}

impl UsageArgs {
    /// Prints the spend.
    pub async fn run(&self) -> Result<bool, crate::Error> {
        let now = shared::sync::unix_ms();
        let from = now
            .saturating_sub(u64::try_from(self.since.as_millis()).unwrap_or(u64::MAX))
            .max(1);
        let c = &self.connection;
        let span = (i64::try_from(from).unwrap_or(1), i64::try_from(now).unwrap_or(0));
        call::usage(&c.endpoint, c.token.as_deref(), &self.principal, span)
            .await
            .map(|()| true)
    }
}

/// Flags of `runs`.
#[derive(Debug, Clone, Args)]
pub struct RunsArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
    /// Runs in this status (repeatable: any of them).
    #[arg(long = "status", value_enum)]
    pub statuses: Vec<StatusArg>,
    /// Runs carrying this label, KEY=VALUE (repeatable: all of them).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = key_value)]
    pub labels: Vec<(String, String)>,
    /// Runs of this thread.
    #[arg(long, default_value = "")]
    pub thread: String,
    /// Runs of this principal (another's needs the operator role).
    #[arg(long, default_value = "")]
    pub principal: String,
    /// Runs admitted within this long before now (e.g. 1h, 7d).
    #[arg(long, value_parser = parse_duration)]
    pub since: Option<Duration>,
    /// Rows per page (0: the server's default).
    #[arg(long, default_value_t = 0)]
    pub page_size: u32,
    /// Continue a listing: the token the previous page printed.
    #[arg(long, default_value = "")]
    pub page_token: String,
    /// Every page, not just the first (at most this many rows).
    #[arg(long, value_name = "MAX_ROWS")]
    pub all: Option<usize>,
}

/// `--status`: a run's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StatusArg {
    /// Live, running.
    Running,
    /// Live, waiting for a person's decision on its tool calls.
    AwaitingApproval,
    /// Live, waiting for a person's answers to a tool's questions.
    AwaitingInput,
    /// Live, parked while a tool's task runs on its MCP server.
    AwaitingTask,
    /// Ended: the model answered.
    Completed,
    /// Ended: a limit or an error.
    Failed,
    /// Ended: canceled.
    Canceled,
}

impl From<StatusArg> for proto::orchestrator::v1::RunStatus {
    fn from(status: StatusArg) -> Self {
        match status {
            StatusArg::Running => Self::Running,
            StatusArg::AwaitingApproval => Self::AwaitingApproval,
            StatusArg::AwaitingInput => Self::AwaitingInput,
            StatusArg::AwaitingTask => Self::AwaitingTask,
            StatusArg::Completed => Self::Completed,
            StatusArg::Failed => Self::Failed,
            StatusArg::Canceled => Self::Canceled,
        }
    }
}

/// `KEY=VALUE`.
fn key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("{text:?} is not KEY=VALUE")),
    }
}

impl RunsArgs {
    /// Lists the runs.
    pub async fn run(&self) -> Result<bool, crate::Error> {
        let since = self.since.map(|ago| {
            let now = shared::sync::unix_ms();
            i64::try_from(
                now.saturating_sub(u64::try_from(ago.as_millis()).unwrap_or(u64::MAX))
                    .max(1),
            )
            .unwrap_or(1)
        });
        let request = proto::orchestrator::v1::ListRunsRequest {
            statuses: self
                .statuses
                .iter()
                .map(|s| proto::orchestrator::v1::RunStatus::from(*s).into())
                .collect(),
            thread_id: self.thread.clone(),
            principal: self.principal.clone(),
            labels: self.labels.iter().cloned().collect(),
            created_after_ms: since.unwrap_or(0),
            created_before_ms: 0,
            page_size: self.page_size,
            page_token: self.page_token.clone(),
        };
        let c = &self.connection;
        call::runs(&c.endpoint, c.token.as_deref(), request, self.all)
            .await
            .map(|()| true)
    }
}

/// How the client commands reach the orchestrator.
#[derive(Debug, Clone, Args)]
pub struct Connection {
    /// The orchestrator's address.
    #[arg(long, env = "ORCHESTRATOR_ENDPOINT", default_value = "http://127.0.0.1:50051")]
    pub endpoint: String,
    /// Bearer token sent with each call (when the orchestrator authenticates callers).
    #[arg(long, env = "ORCHESTRATOR_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// Flags of `approvals`.
#[derive(Debug, Clone, Args)]
pub struct ApprovalsArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
    /// Only this run's calls.
    #[arg(long, default_value = "")]
    pub run_id: String,
}

/// Flags of `decide`.
#[derive(Debug, Clone, Args)]
pub struct DecideArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
    /// The run whose calls are decided.
    #[arg(long)]
    pub run_id: String,
    /// Approve this call as the model wrote it (repeatable).
    #[arg(long = "approve", value_name = "CALL_ID")]
    pub approve: Vec<String>,
    /// Reject this call; the message (after `=`) is fed back to the model (repeatable).
    #[arg(long = "reject", value_name = "CALL_ID[=MESSAGE]")]
    pub reject: Vec<String>,
    /// Approve this call with these arguments instead (a JSON object; repeatable).
    #[arg(long = "edit", value_name = "CALL_ID=JSON")]
    pub edit: Vec<String>,
}

/// Flags of `answer`: one answer per question of the call.
#[derive(Debug, Clone, Args)]
pub struct AnswerArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
    /// The run.
    #[arg(long)]
    pub run_id: String,
    /// The call whose questions are answered.
    #[arg(long)]
    pub call_id: String,
    /// Accept this question, with content (a JSON object its schema takes) after `=`; a URL
    /// question takes none (repeatable).
    #[arg(long = "accept", value_name = "KEY[=JSON]")]
    pub accept: Vec<String>,
    /// Decline this question (repeatable).
    #[arg(long = "decline", value_name = "KEY")]
    pub decline: Vec<String>,
    /// Dismiss this question without a choice (repeatable).
    #[arg(long = "cancel", value_name = "KEY")]
    pub cancel: Vec<String>,
}

impl AnswerArgs {
    /// Sends the answers.
    pub async fn run(&self) -> Result<bool, crate::Error> {
        let c = &self.connection;
        call::answer(
            &c.endpoint,
            c.token.as_deref(),
            &self.run_id,
            &self.call_id,
            self.answers(),
        )
        .await
        .map(|()| true)
    }

    /// The answers these flags describe, in the order accept, decline, cancel.
    pub fn answers(&self) -> Vec<proto::orchestrator::v1::ToolInputAnswer> {
        use orchestrator_client::decision;
        let mut answers: Vec<_> = self
            .accept
            .iter()
            .map(|a| {
                let (key, content) = a.split_once('=').unwrap_or((a, ""));
                decision::accept(key, content)
            })
            .collect();
        answers.extend(self.decline.iter().map(decision::decline));
        answers.extend(self.cancel.iter().map(decision::cancel));
        answers
    }
}

/// Flags of `say`.
#[derive(Debug, Clone, Args)]
pub struct SayArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
    /// The live run.
    pub run_id: String,
    /// The message.
    pub text: String,
}

/// Flags of `thread`.
#[derive(Debug, Clone, Args)]
pub struct ThreadArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
    /// The thread.
    pub thread_id: String,
    /// Delete the thread instead (DeleteThread).
    #[arg(long)]
    pub delete: bool,
}

impl ThreadArgs {
    /// Prints or deletes the thread.
    pub async fn run(&self) -> Result<bool, crate::Error> {
        let c = &self.connection;
        call::thread(&c.endpoint, c.token.as_deref(), &self.thread_id, self.delete)
            .await
            .map(|()| true)
    }
}

impl SayArgs {
    /// Sends the message.
    pub async fn run(&self) -> Result<bool, crate::Error> {
        let c = &self.connection;
        call::say(&c.endpoint, c.token.as_deref(), &self.run_id, &self.text)
            .await
            .map(|()| true)
    }
}

impl ApprovalsArgs {
    /// Lists the calls waiting.
    pub async fn run(&self) -> Result<bool, crate::Error> {
        let c = &self.connection;
        call::approvals(&c.endpoint, c.token.as_deref(), &self.run_id)
            .await
            .map(|_| true)
    }
}

impl DecideArgs {
    /// Sends the decisions.
    pub async fn run(&self) -> Result<bool, crate::Error> {
        let decisions = self.decisions().map_err(crate::Error::Config)?;
        let c = &self.connection;
        call::decide(&c.endpoint, c.token.as_deref(), &self.run_id, decisions)
            .await
            .map(|()| true)
    }

    /// The decisions these flags describe, in the order approve, reject, edit.
    pub fn decisions(&self) -> Result<Vec<proto::orchestrator::v1::ToolCallDecision>, String> {
        use orchestrator_client::decision;
        let mut decisions: Vec<_> = self.approve.iter().map(decision::approve).collect();
        for reject in &self.reject {
            let (call, message) = reject.split_once('=').unwrap_or((reject, ""));
            decisions.push(decision::reject(call, message));
        }
        for edit in &self.edit {
            let (call, arguments) = edit
                .split_once('=')
                .ok_or_else(|| format!("--edit {edit:?}: write CALL_ID={{...}}"))?;
            decisions.push(decision::edit(call, arguments));
        }
        if decisions.is_empty() {
            return Err("name at least one call with --approve, --reject or --edit".into());
        }
        Ok(decisions)
    }
}

/// Flags of `call`.
#[derive(Debug, Clone, Args)]
pub struct CallArgs {
    /// The orchestrator's address.
    #[arg(long, env = "ORCHESTRATOR_ENDPOINT", default_value = "http://127.0.0.1:50051")]
    pub endpoint: String,
    /// The user message (required unless --attach).
    #[arg(long, required_unless_present = "attach", conflicts_with = "attach")]
    pub prompt: Option<String>,
    /// Attach to this run (live or finished, on any replica) instead of starting one, and print
    /// its events from --after on.
    #[arg(long, value_name = "RUN_ID")]
    pub attach: Option<String>,
    /// With --attach: the last seq already seen (0: from the start).
    #[arg(long, value_name = "SEQ", default_value_t = 0, requires = "attach")]
    pub after: u64,
    /// A system message for the run.
    #[arg(long, default_value = "")]
    pub system: String,
    /// Model override.
    #[arg(long, default_value = "")]
    pub model: String,
    /// Normal tool the model may use (repeatable; default all).
    #[arg(long = "tool")]
    pub tools: Vec<String>,
    /// Exit tool for this run: NAME or NAME=DESCRIPTION (repeatable).
    #[arg(long = "exit-tool")]
    pub exit_tools: Vec<String>,
    /// Run id (default: generated).
    #[arg(long, default_value = "")]
    pub run_id: String,
    /// Deadline of the call.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub timeout: Duration,
    /// tool_choice: auto, none, required or a tool name (required and a name: first turn only).
    #[arg(long, default_value = "")]
    pub tool_choice: String,
    /// Sampling temperature (default: the server's).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Most tokens the model may generate per turn (default: the server's).
    #[arg(long)]
    pub max_tokens: Option<u32>,
    /// Calls of this normal tool wait for a person's approval (repeatable; decide them with
    /// `orchestrator decide`).
    #[arg(long = "needs-approval", value_name = "TOOL")]
    pub needs_approval: Vec<String>,
    /// Bearer token sent with each call (when the orchestrator authenticates callers).
    #[arg(long, env = "ORCHESTRATOR_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Continue this thread: the model sees its earlier runs, and this run joins it.
    #[arg(long, value_name = "THREAD_ID", default_value = "")]
    pub thread: String,
    /// With --thread: what the run does when another run holds the thread.
    #[arg(long, value_enum, default_value_t = OnBusy::Reject, requires = "thread")]
    pub on_busy: OnBusy,
    /// A label ListRuns finds the run by, KEY=VALUE (repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = key_value)]
    pub labels: Vec<(String, String)>,
}

/// `--on-busy`: the thread's busy policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnBusy {
    /// Refused (ABORTED, naming the run holding the thread).
    Reject,
    /// Wait until the runs before it have ended.
    Enqueue,
    /// The run holding the thread ends after its turn; this one starts from there.
    Interrupt,
    /// The run holding the thread is canceled and its messages dropped.
    Rollback,
}

impl From<OnBusy> for proto::orchestrator::v1::ThreadBusyPolicy {
    fn from(policy: OnBusy) -> Self {
        match policy {
            OnBusy::Reject => Self::Reject,
            OnBusy::Enqueue => Self::Enqueue,
            OnBusy::Interrupt => Self::Interrupt,
            OnBusy::Rollback => Self::Rollback,
        }
    }
}

impl CallArgs {
    /// The client options these flags describe.
    pub fn to_options(&self) -> call::CallOptions {
        call::CallOptions {
            endpoint: self.endpoint.clone(),
            prompt: self.prompt.clone().unwrap_or_default(),
            attach: self.attach.clone().map(|run_id| (run_id, self.after)),
            system: self.system.clone(),
            model: self.model.clone(),
            tools: self.tools.clone(),
            exit_tools: self
                .exit_tools
                .iter()
                .map(|s| match s.split_once('=') {
                    Some((name, description)) => (name.trim().to_owned(), description.trim().to_owned()),
                    None => (s.trim().to_owned(), String::new()),
                })
                .collect(),
            run_id: self.run_id.clone(),
            timeout: self.timeout,
            needs_approval: self.needs_approval.clone(),
            token: self.token.clone(),
            thread: self.thread.clone(),
            on_busy: self.on_busy.into(),
            labels: self.labels.clone(),
            params: proto::orchestrator::v1::ModelParams {
                tool_choice: self.tool_choice.clone(),
                temperature: self.temperature,
                max_tokens: self.max_tokens,
                ..Default::default()
            },
        }
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
}
