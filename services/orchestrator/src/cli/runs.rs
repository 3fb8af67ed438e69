//! `get`, `cancel` and `runs`: a run as `GetRun` answers it, a cancel (at once, or once its turn
//! in progress has ended), and the runs `ListRuns` finds, a line each.

use std::time::Duration;

use clap::Args;
use proto::orchestrator::v1 as pb;
use shared::config::parse_duration;

use super::Connection;
use super::output::{Table, print_json, refused, status_name, utc};
use crate::Error;

/// Flags of `get`.
#[derive(Debug, Clone, Args)]
pub struct GetArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
    /// The run.
    #[arg(value_parser = super::run_id)]
    pub run_id: String,
}

impl GetArgs {
    /// Prints the run; how it ended (see [`super::Outcome`]).
    pub async fn run(&self) -> Result<super::Outcome, Error> {
        let client = self.connection.client().await?;
        let run = client
            .get_run(&self.run_id)
            .await
            .map_err(|e| refused(&format!("run {:?}", self.run_id), e))?;
        if self.connection.json {
            print_json(&run, "orchestrator.v1.RunResult")?;
        } else {
            print_run(&run);
        }
        Ok(super::Outcome::of_run(run.status))
    }
}

/// Flags of `cancel`.
#[derive(Debug, Clone, Args)]
pub struct CancelArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
    /// The live run.
    #[arg(value_parser = super::run_id)]
    pub run_id: String,
    /// Let the turn in progress end first: its tool calls run and are recorded, no new model
    /// request is made, and the run ends CANCELED with everything kept.
    #[arg(long)]
    pub after_turn: bool,
}

impl CancelArgs {
    /// Cancels the run and says what became of it.
    pub async fn run(&self) -> Result<bool, Error> {
        let mode = match self.after_turn {
            true => pb::CancelMode::AfterTurn,
            false => pb::CancelMode::Immediate,
        };
        let client = self.connection.client().await?;
        let answer = client
            .cancel_with(&self.run_id, mode)
            .await
            .map_err(|e| refused(&format!("cancel run {:?}", self.run_id), e))?;
        if self.connection.json {
            print_json(&answer, "orchestrator.v1.CancelRunResponse")?;
            return Ok(true);
        }
        let status = status_name(answer.status);
        match (answer.canceled, self.after_turn) {
            (true, false) => say!("run {} canceled ({status}); its output so far is kept", self.run_id),
            (true, true) => say!(
                "run {} ends CANCELED once its turn in progress has ended ({status} now)",
                self.run_id
            ),
            (false, _) => say!("run {} had already ended ({status}); nothing to cancel", self.run_id),
        }
        Ok(true)
    }
}

/// Prints a run: its status line, its text so far, each tool call, its signals and what it
/// waits for.
fn print_run(run: &pb::RunResult) {
    let usage = run.usage.unwrap_or_default();
    let mut line = format!(
        "run {} · {} · {} turn(s) · {} tool call(s) · {} signal(s) · {} prompt + {} completion tokens",
        run.run_id,
        status_name(run.status),
        run.turns,
        run.tool_calls.len(),
        run.signals.len(),
        usage.prompt_tokens,
        usage.completion_tokens
    );
    if !run.thread_id.is_empty() {
        line.push_str(&format!(" · thread {}", run.thread_id));
    }
    if !run.agent.is_empty() {
        line.push_str(&format!(" · agent {} (version {})", run.agent, run.agent_version));
    }
    say!("{line}");
    if run.failure_reason != 0 {
        let reason = pb::FailureReason::try_from(run.failure_reason).map_or("?", |s| s.as_str_name());
        say!("  {reason}: {}", run.failure_detail);
    }
    if !run.prompt.is_empty() {
        say!("  asked: {}", one_line(&run.prompt));
    }
    if !run.text.is_empty() {
        // The text indented under its label, line by line.
        say!(
            "  text: {}",
            shared::text::excerpt(run.text.trim()).replace('\n', "\n        ")
        );
    }
    for call in &run.tool_calls {
        let outcome = match &call.error {
            Some(e) if !call.ok => format!("✘ {}: {}", e.code, e.message),
            _ => "✔".to_owned(),
        };
        say!(
            "  ⚙ turn {} {} {} {} ms {outcome}  [{}]",
            call.turn,
            call.name,
            shared::text::excerpt(&call.arguments_json),
            call.duration_ms,
            call.call_id
        );
        if let Some(decision) = &call.approval {
            say!(
                "      {}",
                super::output::decision_line(&call.name, &call.call_id, decision, None)
            );
        }
    }
    for signal in &run.signals {
        say!("  ⚑ signal {} {}", signal.tool_name, signal.arguments_json);
    }
    for waiting in &run.pending_approvals {
        let what = match waiting.input_requests.is_empty() {
            true => "approval",
            false => "answers",
        };
        say!(
            "  ⏸ {} {}  [{}] waits for {what} until {}",
            waiting.name,
            shared::text::excerpt(&waiting.arguments_json),
            waiting.call_id,
            utc(i64::try_from(waiting.expires_at_unix_ms).unwrap_or(i64::MAX))
        );
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
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = super::key_value)]
    pub labels: Vec<(String, String)>,
    /// Runs of this thread.
    #[arg(long, default_value = "", value_parser = thread_id_or_none)]
    pub thread: String,
    /// Runs of this principal (another's needs the operator role).
    #[arg(long, default_value = "")]
    pub principal: String,
    /// Runs of this named agent (`orchestrator agents` lists them).
    #[arg(long, default_value = "")]
    pub agent: String,
    /// Runs admitted within this long before now (e.g. 1h, 7d), or since this time (RFC 3339,
    /// e.g. 2026-12-01T05:00:00Z: what the next page's hint names, so a page token still fits).
    #[arg(long, value_parser = since_arg)]
    pub since: Option<Since>,
    /// Rows per page (0: the server's default).
    #[arg(long, default_value_t = 0)]
    pub page_size: u32,
    /// Continue a listing: the token the previous page printed.
    #[arg(long, default_value = "")]
    pub page_token: String,
    /// Every page, not just the first (at most this many rows).
    #[arg(long, value_name = "MAX_ROWS", conflicts_with = "watch")]
    pub all: Option<usize>,
    /// With --watch, each new or changed run is a row (with --json, a `RunSummary` line).
    #[command(flatten)]
    pub watch: super::watch::WatchArgs,
}

/// `--since`: a span before now, or a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Since {
    /// This long before the command runs.
    Ago(Duration),
    /// This Unix time in ms.
    At(u64),
}

fn since_arg(text: &str) -> Result<Since, String> {
    if let Ok(ago) = parse_duration(text) {
        return Ok(Since::Ago(ago));
    }
    let at = humantime::parse_rfc3339_weak(text)
        .map_err(|_| format!("{text:?} is neither a span (1h, 7d) nor a time (RFC 3339, e.g. 2026-12-01T05:00:00Z)"))?;
    let ms = at
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| format!("{text:?} is before 1970"))?;
    Ok(Since::At(u64::try_from(ms.as_millis()).unwrap_or(u64::MAX)))
}

/// A thread id by the rule every command and RPC checks (empty: none).
fn thread_id_or_none(text: &str) -> Result<String, String> {
    match text {
        "" => Ok(String::new()),
        id => super::thread_id(id),
    }
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

impl From<StatusArg> for pb::RunStatus {
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

impl RunsArgs {
    /// Lists the runs.
    pub async fn run(&self) -> Result<bool, Error> {
        let client = self.connection.client().await?;
        let (mut request, max) = (self.request(), self.all.unwrap_or(usize::MAX));
        let listing = |e| refused("list the runs", e);
        let mut page = client.list_runs(request.clone()).await.map_err(listing)?;
        let watched = (request.clone(), page.runs.clone());
        if self.connection.json {
            // Every page asked for, as one answer.
            while self.all.is_some() && !page.next_page_token.is_empty() && page.runs.len() < max {
                request.page_token = std::mem::take(&mut page.next_page_token);
                let next = client.list_runs(request.clone()).await.map_err(listing)?;
                page.runs.extend(next.runs);
                page.next_page_token = next.next_page_token;
            }
            page.runs.truncate(max);
            print_json(&page, "orchestrator.v1.ListRunsResponse")?;
            return self.follow(&client, watched).await;
        }
        let mut table = Table::new(&[
            "RUN",
            "STATUS",
            "PRINCIPAL",
            "THREAD",
            "AGENT",
            ">TURNS",
            ">TOKENS",
            "CREATED",
            "LABELS",
            "ASKED",
        ]);
        let mut printed = 0usize;
        let more = loop {
            for run in page.runs.iter().take(max - printed) {
                table.row(run_row(run));
                printed += 1;
            }
            match (self.all.is_some() && printed < max, page.next_page_token.is_empty()) {
                (_, true) => break None,
                (true, false) => {
                    request.page_token = page.next_page_token;
                    page = client.list_runs(request.clone()).await.map_err(listing)?;
                }
                (false, false) => break Some(page.next_page_token),
            }
        };
        match printed {
            0 => say!("no run matches"),
            _ => table.print(),
        }
        if let Some(token) = more {
            // The token belongs to this listing's filters: a relative --since names its time.
            let since = match request.created_after_ms {
                0 => String::new(),
                ms => {
                    let at = std::time::UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0));
                    format!("--since {} ", humantime::format_rfc3339_millis(at))
                }
            };
            say!("more: {since}--page-token {token}");
        }
        self.follow(&client, watched).await
    }

    /// With `--watch`: lists the first page again at its pace and prints each run new or
    /// changed since (a run that leaves the page is no news).
    async fn follow(
        &self,
        client: &orchestrator_client::Client,
        (request, first): (pb::ListRunsRequest, Vec<pb::RunSummary>),
    ) -> Result<bool, Error> {
        if !self.watch.watch {
            return Ok(true);
        }
        let json = self.connection.json;
        let list = || async {
            let page = client.list_runs(request.clone()).await;
            Ok(page.map_err(|e| refused("list the runs", e))?.runs)
        };
        let key = |run: &pb::RunSummary| run.run_id.clone();
        let show = |change: super::watch::Change<'_, pb::RunSummary>| match change {
            super::watch::Change::New(run) if json => {
                if let Ok(line) = super::output::json(run, "orchestrator.v1.RunSummary") {
                    super::output::line(&line);
                }
            }
            super::watch::Change::New(run) => say!("{}", run_row(run).join("  ")),
            super::watch::Change::Gone(_) => {}
        };
        super::watch::changes(self.watch.watch_every, first, key, list, show).await?;
        Ok(true)
    }

    /// The `ListRuns` request these flags describe.
    fn request(&self) -> pb::ListRunsRequest {
        let since = self.since.map(|since| {
            let at = match since {
                Since::Ago(ago) => {
                    let ago = u64::try_from(ago.as_millis()).unwrap_or(u64::MAX);
                    shared::sync::unix_ms().saturating_sub(ago)
                }
                Since::At(ms) => ms,
            };
            i64::try_from(at.max(1)).unwrap_or(1)
        });
        pb::ListRunsRequest {
            statuses: self.statuses.iter().map(|s| pb::RunStatus::from(*s).into()).collect(),
            thread_id: self.thread.clone(),
            principal: self.principal.clone(),
            labels: self.labels.iter().cloned().collect(),
            created_after_ms: since.unwrap_or(0),
            created_before_ms: 0,
            agent: self.agent.clone(),
            page_size: self.page_size,
            page_token: self.page_token.clone(),
        }
    }
}

/// One row of `runs`.
fn run_row(run: &pb::RunSummary) -> Vec<String> {
    let usage = run.usage.unwrap_or_default();
    let mut labels: Vec<String> = run.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    labels.sort();
    let or_dash = |text: &str| {
        if text.is_empty() {
            "-".to_owned()
        } else {
            text.to_owned()
        }
    };
    vec![
        run.run_id.clone(),
        status_name(run.status).to_owned(),
        or_dash(&run.principal),
        or_dash(&run.thread_id),
        or_dash(&run.agent),
        run.turns.to_string(),
        (usage.prompt_tokens + usage.completion_tokens).to_string(),
        utc(run.created_at_ms),
        labels.join(","),
        brief(&run.prompt),
    ]
}

/// How many characters of a run's prompt a row of `runs` shows.
const BRIEF_CHARS: usize = 48;

/// `text` on one line (its line breaks as spaces).
pub(super) fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The first [`BRIEF_CHARS`] characters of `text` on one line, `…` when cut.
fn brief(text: &str) -> String {
    let line = one_line(text);
    match line.char_indices().nth(BRIEF_CHARS) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line,
    }
}
