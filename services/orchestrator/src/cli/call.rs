//! A small client of the Orchestrator service for shells: `orchestrator call` and the demo use
//! it to start a run and print its event stream readably. The calls go through the Rust client
//! crate (`orchestrator-client`), as another service's would.

use std::io::Write;
use std::time::Duration;

use orchestrator_client::{ClientBuilder, Event as E, Retry, RunRequest, RunStream};
use proto::orchestrator::v1 as pb;

use crate::Error;

/// What to ask for.
#[derive(Debug, Clone, Default)]
pub struct CallOptions {
    /// Orchestrator address, e.g. `http://127.0.0.1:50051`.
    pub endpoint: String,
    /// The user message.
    pub prompt: String,
    /// The caller's system message.
    pub system: String,
    /// Model override (empty: the server's).
    pub model: String,
    /// Normal tool allowlist (empty: all).
    pub tools: Vec<String>,
    /// Exit tools offered in this run: `(name, description)`.
    pub exit_tools: Vec<(String, String)>,
    /// Run id (empty: generated).
    pub run_id: String,
    /// Deadline of the whole call.
    pub timeout: Duration,
    /// Model parameters (unset fields: the server's defaults).
    pub params: pb::ModelParams,
    /// Attach to this run after this seq instead of starting one.
    pub attach: Option<(String, u64)>,
    /// Normal tools whose calls wait for a person's approval in this run.
    pub needs_approval: Vec<String>,
    /// Bearer token.
    pub token: Option<String>,
    /// The thread the run continues (empty: none).
    pub thread: String,
    /// What the run does when another run holds the thread.
    pub on_busy: pb::ThreadBusyPolicy,
    /// What `ListRuns` finds the run by.
    pub labels: Vec<(String, String)>,
}

/// Prints events as they arrive.
#[derive(Default)]
struct Printer {
    /// The run's id (for the decide hint of a call waiting for approval).
    run_id: String,
    at_line_start: bool,
    turn: u32,
    /// The last delta printed was reasoning (text after it is marked as the answer).
    in_reasoning: bool,
}

impl Printer {
    fn line(&mut self, out: &mut impl Write, text: &str) {
        if !self.at_line_start {
            let _ = writeln!(out);
        }
        let _ = writeln!(out, "{text}");
        self.at_line_start = true;
    }

    fn turn_header(&mut self, out: &mut impl Write, turn: u32) {
        if turn != self.turn {
            self.turn = turn;
            self.in_reasoning = false;
            self.line(out, &format!("── turn {turn}"));
        }
    }

    fn write(&mut self, out: &mut impl Write, text: &str) {
        let _ = write!(out, "{text}");
        self.at_line_start = text.ends_with('\n');
    }

    fn print(&mut self, out: &mut impl Write, event: &E) {
        match event {
            E::Started(s) => {
                self.at_line_start = true;
                self.line(out, &started_line(s));
            }
            E::Reasoning { text, turn } => {
                self.turn_header(out, *turn);
                if !self.in_reasoning {
                    self.in_reasoning = true;
                    self.line(out, "  ‥ reasoning");
                }
                self.write(out, text);
            }
            E::Text { text, turn } => {
                self.turn_header(out, *turn);
                if self.in_reasoning {
                    self.in_reasoning = false;
                    self.line(out, "  ‥ answer");
                }
                self.write(out, text);
            }
            E::ToolCallStarted(c) => {
                self.in_reasoning = false;
                self.turn_header(out, c.turn);
                self.line(out, &format!("  ⚙ {} {}  [{}]", c.name, c.arguments_json, c.call_id));
            }
            E::ToolCallFinished(c) => {
                let outcome = match &c.error {
                    Some(e) if !c.ok => format!("✘ {}: {}", e.code, e.message),
                    _ => format!("✔ {}", shared::text::excerpt(&c.content_json)),
                };
                self.line(out, &format!("  {} {} ms {}", c.name, c.duration_ms, outcome));
            }
            E::Signal(s) => self.line(out, &format!("  ⚑ signal {} {}", s.tool_name, s.arguments_json)),
            E::TurnFinished(t) => {
                let usage = t.usage.unwrap_or_default();
                let cached = match usage.cached_prompt_tokens {
                    0 => String::new(),
                    n => format!(" ({n} cached)"),
                };
                self.line(
                    out,
                    &format!(
                        "── turn {} finished · {} prompt{cached} + {} completion tokens · budget left {} · failed turns {}",
                        t.turn,
                        usage.prompt_tokens,
                        usage.completion_tokens,
                        t.tool_call_budget_remaining,
                        t.failed_turns
                    ),
                );
            }
            E::TurnRestarted(t) => self.line(
                out,
                &format!(
                    "↻ turn {} starts again (attempt {}): {}; its text above no longer counts",
                    t.turn, t.attempt, t.reason
                ),
            ),
            E::ApprovalRequested(a) => {
                self.in_reasoning = false;
                self.turn_header(out, a.turn);
                self.line(
                    out,
                    &format!(
                        "  ⏸ {} {}  [{}] waits for approval (orchestrator decide --run-id {} --approve {} | --reject {})",
                        a.name, a.arguments_json, a.call_id, self.run_id, a.call_id, a.call_id
                    ),
                );
            }
            E::ToolInputRequested(asked) => {
                self.in_reasoning = false;
                self.turn_header(out, asked.turn);
                self.line(
                    out,
                    &format!(
                        "  ? {} [{}] asks before it can finish (orchestrator answer --run-id {} --call-id {}):",
                        asked.name, asked.call_id, self.run_id, asked.call_id
                    ),
                );
                for question in &asked.requests {
                    let detail = if question.mode == "url" {
                        &question.url
                    } else {
                        &question.schema_json
                    };
                    self.line(
                        out,
                        &format!(
                            "      {} ({}): {} {detail}",
                            question.key, question.mode, question.message
                        ),
                    );
                }
            }
            E::ToolCallProgress(p) => {
                self.in_reasoning = false;
                self.turn_header(out, p.turn);
                let amount = match (p.progress, p.total) {
                    (done, total) if total > 0.0 => format!(" {done}/{total}"),
                    (done, _) if done > 0.0 => format!(" {done}"),
                    _ => String::new(),
                };
                self.line(out, &format!("  … {} [{}]{amount} {}", p.name, p.call_id, p.message));
            }
            E::MessageAdded(m) => {
                let text = m.message.as_ref().map_or("", |m| m.content.as_str());
                self.line(
                    out,
                    &format!("✉ a message joins turn {}: {}", m.turn, shared::text::excerpt(text)),
                );
            }
            E::Finished(r) => self.line(out, &finished_line(r)),
        }
        let _ = out.flush();
    }
}

/// The run's first line: model, tools and budget.
fn started_line(s: &pb::RunStarted) -> String {
    let list = |names: &[String]| {
        if names.is_empty() {
            "none".to_owned()
        } else {
            names.join(", ")
        }
    };
    let limits = s.limits.unwrap_or_default();
    let thread = match (s.thread_id.as_str(), s.thread_turns_left_out) {
        ("", _) => String::new(),
        (id, 0) => format!(" · thread {id} ({} earlier turn(s))", s.thread_turns),
        (id, left_out) => format!(
            " · thread {id} ({} earlier turn(s), {left_out} older left out)",
            s.thread_turns
        ),
    };
    let queued = match s.queued_ms {
        0 => String::new(),
        ms => format!(
            " · waited {} for a run slot",
            humantime::format_duration(Duration::from_millis(ms))
        ),
    };
    format!(
        "▶ run started · model {} · tools: {} · exit tools: {} · budget {} calls, {} turns{thread}{queued}",
        s.model,
        list(&s.normal_tools),
        list(&s.exit_tools),
        limits.tool_call_budget,
        limits.max_turns,
    )
}

/// A run status as printed: `COMPLETED`, `FAILED` … (`?` for a number this build does not know).
fn status_name(status: i32) -> &'static str {
    pb::RunStatus::try_from(status)
        .map_or("?", |s| s.as_str_name())
        .trim_start_matches("RUN_STATUS_")
}

/// The run's last line: status, counts and, for a failed run, the reason.
fn finished_line(r: &pb::RunResult) -> String {
    let status = status_name(r.status);
    let mut summary = format!(
        "■ {status} · {} turn(s) · {} tool call(s) · {} signal(s) · finish_reason {:?}",
        r.turns,
        r.tool_calls.len(),
        r.signals.len(),
        r.finish_reason
    );
    if r.failure_reason != 0 {
        let reason = pb::FailureReason::try_from(r.failure_reason).map_or("?", |s| s.as_str_name());
        summary.push_str(&format!(" · {reason}: {}", r.failure_detail));
    } else if !r.failure_detail.is_empty() {
        summary.push_str(&format!(" · {}", r.failure_detail));
    }
    summary
}

/// Starts a run on the orchestrator at `options.endpoint` (or attaches to one), prints its
/// events to stdout, and returns the final result.
pub async fn call(options: &CallOptions) -> Result<pb::RunResult, Error> {
    let client = connect(&options.endpoint, options.token.as_deref(), options.timeout).await?;
    let run = match &options.attach {
        Some((run_id, after)) => client
            .attach(run_id, *after)
            .await
            .map_err(|e| Error::Call(format!("AttachRun was refused: {e}")))?,
        None => client
            .orchestrate(run_request(options))
            .await
            .map_err(|e| Error::Call(format!("Orchestrate was refused: {e}")))?,
    };
    print_to_end(run).await
}

/// A client of the orchestrator at `endpoint`, with `token` when given; each call within
/// `timeout`.
async fn connect(endpoint: &str, token: Option<&str>, timeout: Duration) -> Result<orchestrator_client::Client, Error> {
    let mut builder = ClientBuilder::new(endpoint.to_owned())
        .connect_timeout(Duration::from_secs(5))
        .timeout(timeout)
        .retry(Retry::none());
    if let Some(token) = token {
        builder = builder.token(token);
    }
    builder
        .connect()
        .await
        .map_err(|e| Error::Call(format!("cannot connect to {endpoint}: {e}")))
}

/// Lists the calls waiting for approval that the caller may decide (of `run_id` only, unless
/// empty), a line each, and returns them.
pub async fn approvals(endpoint: &str, token: Option<&str>, run_id: &str) -> Result<Vec<pb::PendingApproval>, Error> {
    let client = connect(endpoint, token, Duration::from_secs(30)).await?;
    let pending = client
        .pending_approvals(Some(run_id).filter(|r| !r.is_empty()))
        .await
        .map_err(|e| Error::Call(format!("ListPendingApprovals was refused: {e}")))?;
    let now = shared::sync::unix_ms();
    for call in &pending {
        let left = Duration::from_millis(call.expires_at_unix_ms.saturating_sub(now) / 1000 * 1000);
        let waits = if call.input_requests.is_empty() {
            "approval"
        } else {
            "answers"
        };
        println!(
            "{}  {}  {} {}  (turn {}, owner {:?}, waits for {waits}, expires in {})",
            call.run_id,
            call.call_id,
            call.name,
            call.arguments_json,
            call.turn,
            call.principal,
            humantime::format_duration(left)
        );
        for question in &call.input_requests {
            let detail = if question.mode == "url" {
                &question.url
            } else {
                &question.schema_json
            };
            println!(
                "    ? {} ({}): {} {detail}",
                question.key, question.mode, question.message
            );
        }
    }
    if pending.is_empty() {
        println!("no tool call waits for a person");
    }
    Ok(pending)
}

/// Sends `decisions` on `run_id`'s calls and prints the calls still waiting.
pub async fn decide(
    endpoint: &str,
    token: Option<&str>,
    run_id: &str,
    decisions: Vec<pb::ToolCallDecision>,
) -> Result<(), Error> {
    let client = connect(endpoint, token, Duration::from_secs(30)).await?;
    let still = client
        .decide(run_id, decisions)
        .await
        .map_err(|e| Error::Call(format!("DecideToolCalls was refused: {e}")))?;
    match still.len() {
        0 => println!("decided; run {run_id} goes on"),
        n => println!("decided; {n} call(s) of run {run_id} still wait"),
    }
    Ok(())
}

/// Sends `answers` to the questions of `call_id` of `run_id` and prints what still waits.
pub async fn answer(
    endpoint: &str,
    token: Option<&str>,
    run_id: &str,
    call_id: &str,
    answers: Vec<pb::ToolInputAnswer>,
) -> Result<(), Error> {
    if answers.is_empty() {
        return Err(Error::Config(
            "answer each question of the call: --accept KEY[=JSON], --decline KEY or --cancel KEY".into(),
        ));
    }
    let client = connect(endpoint, token, Duration::from_secs(30)).await?;
    let still = client
        .answer(run_id, call_id, answers)
        .await
        .map_err(|e| Error::Call(format!("AnswerToolInput was refused: {e}")))?;
    match still.len() {
        0 => println!("answered; run {run_id} goes on"),
        n => println!("answered; {n} call(s) of run {run_id} still wait"),
    }
    Ok(())
}

/// The run `options` ask for.
fn run_request(options: &CallOptions) -> RunRequest {
    let mut request = RunRequest::prompt(options.prompt.clone())
        .system(options.system.clone())
        .model(options.model.clone())
        .run_id(options.run_id.clone())
        .params(options.params.clone());
    for tool in &options.tools {
        request = request.tool(tool.clone());
    }
    for (name, description) in &options.exit_tools {
        request = request.exit_tool(name.clone(), description.clone());
    }
    for tool in &options.needs_approval {
        request = request.needs_approval(tool.clone());
    }
    if !options.thread.is_empty() {
        request = request.thread(options.thread.clone()).on_busy(options.on_busy);
    }
    for (key, value) in &options.labels {
        request = request.label(key.clone(), value.clone());
    }
    request
}

/// Prints the runs `request` finds, a line each (every page with `all`, up to its rows), and
/// the token of the next page when there is one.
pub async fn runs(
    endpoint: &str,
    token: Option<&str>,
    mut request: pb::ListRunsRequest,
    all: Option<usize>,
) -> Result<(), Error> {
    let client = connect(endpoint, token, Duration::from_secs(30)).await?;
    let refused = |e: orchestrator_client::Error| Error::Call(format!("ListRuns was refused: {e}"));
    let (mut printed, max) = (0usize, all.unwrap_or(usize::MAX));
    let mut page = client.list_runs(request.clone()).await.map_err(refused)?;
    println!(
        "{:<36}  {:<17}  {:<12}  {:<12}  {:>5}  {:>9}  {:<24}  LABELS",
        "RUN", "STATUS", "PRINCIPAL", "THREAD", "TURNS", "TOKENS", "CREATED"
    );
    loop {
        for run in page.runs.iter().take(max - printed) {
            println!("{}", run_line(run));
            printed += 1;
        }
        match (all.is_some() && printed < max, page.next_page_token.is_empty()) {
            (_, true) => break,
            (true, false) => {
                request.page_token = page.next_page_token;
                page = client.list_runs(request.clone()).await.map_err(refused)?;
            }
            (false, false) => {
                println!("more: --page-token {}", page.next_page_token);
                break;
            }
        }
    }
    if printed == 0 {
        println!("no run matches");
    }
    Ok(())
}

/// Prints what `principal` (empty: the caller) spent over `span` (Unix ms), an hour a line, and
/// the total.
pub async fn usage(endpoint: &str, token: Option<&str>, principal: &str, span: (i64, i64)) -> Result<(), Error> {
    let client = connect(endpoint, token, Duration::from_secs(30)).await?;
    let spent = client
        .usage(principal, span.0, span.1)
        .await
        .map_err(|e| Error::Call(format!("GetUsage was refused: {e}")))?;
    println!(
        "{:<24}  {:>12}  {:>12}  {:>12}  {:>6}  {:>10}  {:>10}",
        "HOUR", "PROMPT", "CACHED", "COMPLETION", "RUNS", "TOOL CALLS", "RUN TIME"
    );
    let line = |label: String, w: &pb::UsageWindow| {
        println!(
            "{:<24}  {:>12}  {:>12}  {:>12}  {:>6}  {:>10}  {:>10}",
            label,
            w.prompt_tokens,
            w.cached_prompt_tokens,
            w.completion_tokens,
            w.runs,
            w.tool_calls,
            humantime::format_duration(Duration::from_secs(w.run_ms / 1000))
        );
    };
    for window in &spent.windows {
        line(utc(window.start_ms), window);
    }
    line(format!("total ({})", spent.principal), &spent.total.unwrap_or_default());
    if let Some(budget) = spent.tokens_per_hour {
        println!("tokens_per_hour: {budget}");
    }
    Ok(())
}

/// One row of `runs`.
fn run_line(run: &pb::RunSummary) -> String {
    let status = match pb::RunStatus::try_from(run.status) {
        Ok(status) => status.as_str_name().trim_start_matches("RUN_STATUS_").to_owned(),
        Err(_) => run.status.to_string(),
    };
    let usage = run.usage.unwrap_or_default();
    let labels: Vec<String> = run.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mut labels = labels;
    labels.sort();
    format!(
        "{:<36}  {:<17}  {:<12}  {:<12}  {:>5}  {:>9}  {:<24}  {}",
        run.run_id,
        status,
        if run.principal.is_empty() { "-" } else { &run.principal },
        if run.thread_id.is_empty() { "-" } else { &run.thread_id },
        run.turns,
        usage.prompt_tokens + usage.completion_tokens,
        utc(run.created_at_ms),
        labels.join(",")
    )
}

/// A Unix time in ms as RFC 3339 (UTC, ms).
fn utc(ms: i64) -> String {
    let at = std::time::UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_millis(at).to_string()
}

/// Prints the run's events as they come and returns its result.
async fn print_to_end(mut run: RunStream) -> Result<pb::RunResult, Error> {
    let mut printer = Printer::default();
    let mut stdout = std::io::stdout();
    // Read to the end of the call (its trailers, which the client reads after run_finished).
    let mut result = None;
    while let Some(event) = run
        .next_event()
        .await
        .map_err(|e| Error::Call(format!("the event stream broke off: {e}")))?
    {
        if let Some(id) = run.run_id() {
            printer.run_id = id.to_owned();
        }
        printer.print(&mut stdout, &event);
        if let E::Finished(finished) = event {
            result = Some(finished);
        }
    }
    result.ok_or_else(|| Error::Call("the event stream ended without run_finished".into()))
}

/// Sends `text` to the live run `run_id` and says how many messages wait for its next turn.
pub async fn say(endpoint: &str, token: Option<&str>, run_id: &str, text: &str) -> Result<(), Error> {
    let client = connect(endpoint, token, Duration::from_secs(30)).await?;
    let waiting = client
        .send_message(run_id, text)
        .await
        .map_err(|e| Error::Call(format!("SendMessage was refused: {e}")))?;
    println!("sent; {waiting} message(s) wait for the next turn of run {run_id}");
    Ok(())
}

/// Prints thread `thread_id` (its runs, then its messages, a line each), or deletes it.
pub async fn thread(endpoint: &str, token: Option<&str>, thread_id: &str, delete: bool) -> Result<(), Error> {
    let client = connect(endpoint, token, Duration::from_secs(30)).await?;
    if delete {
        client
            .delete_thread(thread_id)
            .await
            .map_err(|e| Error::Call(format!("DeleteThread was refused: {e}")))?;
        println!("thread {thread_id} deleted");
        return Ok(());
    }
    let thread = client
        .thread(thread_id)
        .await
        .map_err(|e| Error::Call(format!("GetThread was refused: {e}")))?;
    println!("{}", thread_line(&thread));
    for run in &thread.runs {
        let status = status_name(run.status);
        println!("  run {} · {status} · {} message(s)", run.run_id, run.messages);
    }
    for message in &thread.messages {
        println!("{}", message_line(message));
    }
    Ok(())
}

/// A thread's first line: its owner, size, the run holding it and those waiting.
fn thread_line(t: &pb::Thread) -> String {
    let mut line = format!(
        "thread {} · {} run(s) · {} message(s) · {} bytes",
        t.thread_id,
        t.runs.len(),
        t.messages.len(),
        t.bytes
    );
    if !t.principal.is_empty() {
        line.push_str(&format!(" · owner {}", t.principal));
    }
    if t.dropped_turns > 0 {
        line.push_str(&format!(" · {} older turn(s) dropped", t.dropped_turns));
    }
    if !t.live_run_id.is_empty() {
        line.push_str(&format!(" · held by run {}", t.live_run_id));
    }
    if !t.waiting_run_ids.is_empty() {
        line.push_str(&format!(" · waiting: {}", t.waiting_run_ids.join(", ")));
    }
    line
}

/// One message of a thread, on one line.
fn message_line(m: &pb::ChatMessage) -> String {
    let calls: Vec<String> = m
        .tool_calls
        .iter()
        .map(|c| format!("⚙ {} {}", c.name, shared::text::excerpt(&c.arguments_json)))
        .collect();
    let text = shared::text::excerpt(m.content.trim());
    match (m.role.as_str(), calls.is_empty()) {
        ("assistant", false) => format!("  assistant: {text} {}", calls.join(" ")),
        ("tool", _) => format!("  tool [{}]: {text}", m.tool_call_id),
        (role, _) => format!("  {role}: {text}"),
    }
}
