//! A small client of the Orchestrator service for shells: `orchestrator call` and the demo use
//! it to start a run and print its event stream readably. The calls go through the Rust client
//! crate (`orchestrator-client`), as another service's would.

use std::io::Write;
use std::time::Duration;

use clap::Args;

use orchestrator_client::{ClientBuilder, Event as E, Retry, RunRequest, RunStream};
use proto::orchestrator::v1 as pb;

use super::output::{refused, status_name};
use crate::Error;
use crate::domain::thread::BusyPolicy;

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
    /// TLS to an `https://` endpoint.
    pub tls: super::TlsArgs,
    /// The thread the run continues (empty: none).
    pub thread: String,
    /// What the run does when another run holds the thread.
    pub on_busy: pb::ThreadBusyPolicy,
    /// What `ListRuns` finds the run by.
    pub labels: Vec<(String, String)>,
    /// Events as JSON Lines on stdout for scripts; what is said besides them goes to stderr.
    pub json: bool,
    /// The run's own timeout (`None`: the server's).
    pub run_timeout: Option<Duration>,
    /// How long a call may wait for a person's decision (`None`: the server's).
    pub approval_timeout: Option<Duration>,
    /// The run's deadline pauses while a call waits for a person.
    pub pause_deadline: bool,
    /// The named agent the run takes its definition from (empty: none).
    pub agent: String,
}

impl CallOptions {
    /// Says `line` beside the events: on stdout among the printed events, on stderr when stdout
    /// carries JSON Lines.
    fn say(&self, line: &str) {
        let line = shared::text::printable(line);
        match self.json {
            true => eprintln!("{line}"),
            false => super::output::line(&line),
        }
    }
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
    /// The output comes as one piece, not turn by turn (no turn headers).
    whole: bool,
}

impl Printer {
    fn line(&mut self, out: &mut impl Write, text: &str) {
        if !self.at_line_start {
            let _ = writeln!(out);
        }
        let _ = writeln!(out, "{}", shared::text::printable(text));
        self.at_line_start = true;
    }

    fn turn_header(&mut self, out: &mut impl Write, turn: u32) {
        if turn != self.turn && !self.whole {
            self.turn = turn;
            self.in_reasoning = false;
            self.line(out, &format!("── turn {turn}"));
        }
    }

    fn write(&mut self, out: &mut impl Write, text: &str) {
        let _ = write!(out, "{}", shared::text::printable(text));
        self.at_line_start = text.ends_with('\n');
    }

    fn print(&mut self, out: &mut impl Write, event: &E) {
        match event {
            E::Started(s) => {
                self.at_line_start = true;
                let line = started_line(&self.run_id, s);
                self.line(out, &line);
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
            E::TurnFinished(t) => self.line(out, &turn_finished_line(t)),
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
                let line = approval_line(a, &self.run_id);
                self.line(out, &line);
            }
            E::ToolInputRequested(asked) => self.questions(out, asked),
            E::CallDecided(d) => {
                let decision = d.decision.clone().unwrap_or_default();
                let line = super::output::decision_line(&d.name, &d.call_id, &decision, Some(d.waited_ms));
                self.line(out, &format!("  {line}"));
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

    /// A call's questions, with the command that answers them.
    fn questions(&mut self, out: &mut impl Write, asked: &pb::ToolInputRequested) {
        self.in_reasoning = false;
        self.turn_header(out, asked.turn);
        self.line(
            out,
            &format!(
                "  ? {} [{}] asks before it can finish (orchestrator answer {} --call-id {}):",
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
}

/// A turn's last line: its tokens, the budget left and the failed turns.
fn turn_finished_line(t: &pb::TurnFinished) -> String {
    let usage = t.usage.unwrap_or_default();
    let cached = match usage.cached_prompt_tokens {
        0 => String::new(),
        n => format!(" ({n} cached)"),
    };
    format!(
        "── turn {} finished · {} prompt{cached} + {} completion tokens · budget left {} · failed turns {}",
        t.turn, usage.prompt_tokens, usage.completion_tokens, t.tool_call_budget_remaining, t.failed_turns
    )
}

/// A call waiting for a person, until when, with the command that decides it.
fn approval_line(a: &pb::ApprovalRequested, run_id: &str) -> String {
    let left = Duration::from_millis(a.expires_at_unix_ms.saturating_sub(shared::sync::unix_ms()) / 1000 * 1000);
    format!(
        "  ⏸ {} {}  [{}] {} for {} (orchestrator decide {run_id} --approve {} | --reject {})",
        a.name,
        a.arguments_json,
        a.call_id,
        match a.in_doubt {
            true =>
                "ran and is IN DOUBT (its tool-runner went away before its outcome was kept): run it again? It waits",
            false => "waits for approval",
        },
        humantime::format_duration(left),
        a.call_id,
        a.call_id
    )
}

/// The run's first line: its id, model, tools and budget.
fn started_line(run_id: &str, s: &pb::RunStarted) -> String {
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
        "▶ run {run_id} started · model {} · tools: {} · exit tools: {} · budget {} calls, {} turns{thread}{queued}",
        s.model,
        list(&s.normal_tools),
        list(&s.exit_tools),
        limits.tool_call_budget,
        limits.max_turns,
    )
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
/// events to stdout, and returns the final result. A run that moves to another replica (its
/// own drained, or the connection broke) is followed there: the client re-attaches after the
/// last seq printed, under its default [`Retry`] (only refusals of calls that did not start a
/// run are tried again), and a line says so.
pub async fn call(options: &CallOptions) -> Result<pb::RunResult, Error> {
    let client = connect(
        &options.endpoint,
        options.token.as_deref(),
        &options.tls,
        options.timeout,
        Retry::default(),
    )
    .await?;
    let Some((run_id, after)) = &options.attach else {
        let run = start_telling(&client, options).await?;
        let whole = run.replay() == Some(orchestrator_client::Replay::Result);
        match run.replay() {
            Some(orchestrator_client::Replay::Log) => {
                options.say(&format!(
                    "▶ run {} had ended: its events as logged, replayed",
                    options.run_id
                ));
            }
            Some(orchestrator_client::Replay::Result) => options.say(&format!(
                "▶ run {} had ended and its log no longer holds it whole: its output, replayed as one piece",
                options.run_id
            )),
            None => {}
        }
        return print_to_end(run, whole, options.json)
            .await?
            .ok_or_else(|| Error::Call("the event stream ended without run_finished".into()));
    };
    let run = client
        .attach(run_id, *after)
        .await
        .map_err(|e| refused(&format!("attach to run {run_id:?}"), e))?;
    match after {
        0 => options.say(&format!("▶ attached to run {run_id}: its events from the first")),
        seq => options.say(&format!("▶ attached to run {run_id}: its events after seq {seq}")),
    }
    if let Some(result) = print_to_end(run, false, options.json).await? {
        return Ok(result);
    }
    // Nothing after `after`: the run had ended by then.
    let result = client
        .get_run(run_id)
        .await
        .map_err(|e| refused(&format!("run {run_id:?}"), e))?;
    options.say(&format!(
        "run {run_id} has no events after seq {after}: it ended {}",
        super::output::status_name(result.status)
    ));
    Ok(result)
}

/// Starts the run in the background (`StartRun`) and prints its id alone on stdout (with
/// `json`, the answer as one line of JSON); says on stderr how to follow it. Whether a run is
/// going on: a run id whose run had ended starts nothing, and that run's status decides.
pub async fn start_detached(options: &CallOptions) -> Result<super::Outcome, Error> {
    let client = connect(
        &options.endpoint,
        options.token.as_deref(),
        &options.tls,
        options.timeout,
        Retry::default(),
    )
    .await?;
    let started = client
        .start(run_request(options))
        .await
        .map_err(|e| refused("start the run", e))?;
    let status = pb::RunStatus::try_from(started.status).unwrap_or_default();
    match options.json {
        true => super::output::print_json(&started, "orchestrator.v1.StartRunResponse")?,
        false => super::output::line(&started.run_id),
    }
    let run_id = &started.run_id;
    if status != pb::RunStatus::Running {
        eprintln!(
            "run {run_id} had ended {}: nothing was started (follow it: orchestrator call --attach {run_id})",
            status_name(started.status)
        );
        return Ok(super::Outcome::of_run(started.status));
    }
    eprintln!(
        "▶ run {run_id} goes on in the background; follow it with `orchestrator call --attach {run_id}`, \
         see it with `orchestrator get {run_id}`"
    );
    Ok(super::Outcome::Success)
}

/// Starts the run; while it is not let in yet (its thread held by another run, or every run
/// slot it may use taken), says so every few seconds when what it waits for changes.
async fn start_telling(client: &orchestrator_client::Client, options: &CallOptions) -> Result<RunStream, Error> {
    let started = client.orchestrate(run_request(options));
    tokio::pin!(started);
    let mut told = String::new();
    let mut tick = tokio::time::interval_at(
        tokio::time::Instant::now() + Duration::from_secs(1),
        Duration::from_secs(2),
    );
    loop {
        tokio::select! {
            run = &mut started => return run.map_err(|e| refused("start the run", e)),
            _ = tick.tick() => {
                let line = waiting_line(client, options).await;
                if line != told {
                    options.say(&line);
                    told = line;
                }
            }
        }
    }
}

/// What a run not let in yet waits for, as a line.
async fn waiting_line(client: &orchestrator_client::Client, options: &CallOptions) -> String {
    let slot = "… the run waits to be let in: every run slot it may use is taken".to_owned();
    if options.thread.is_empty() {
        return slot;
    }
    let Ok(thread) = client.thread(&options.thread).await else {
        return slot;
    };
    let place = thread.waiting_run_ids.iter().position(|id| *id == options.run_id);
    match (thread.live_run_id.as_str(), place) {
        ("", _) => slot,
        (holder, Some(place)) => format!(
            "… the run waits for thread {}: run {holder} holds it; it is {} of {} waiting",
            options.thread,
            place + 1,
            thread.waiting_run_ids.len()
        ),
        (holder, None) => format!("… the run waits for thread {}: run {holder} holds it", options.thread),
    }
}

/// A client of the orchestrator at `endpoint`, with `token` when given; each call within
/// `timeout`.
pub(super) async fn connect(
    endpoint: &str,
    token: Option<&str>,
    tls: &super::TlsArgs,
    timeout: Duration,
    retry: Retry,
) -> Result<orchestrator_client::Client, Error> {
    super::endpoint(endpoint).map_err(Error::Config)?;
    let builder = ClientBuilder::new(endpoint.to_owned())
        .connect_timeout(Duration::from_secs(5))
        .timeout(timeout)
        .retry(retry);
    let mut builder = tls.apply(endpoint, builder)?;
    if let Some(token) = token {
        builder = builder.token(token);
    }
    builder.connect().await.map_err(|e| {
        let why = match &e {
            orchestrator_client::Error::Connect(transport) => super::output::causes(transport),
            other => other.to_string(),
        };
        Error::Call(format!("cannot reach the orchestrator at {endpoint}: {why}"))
    })
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
    if let Some(timeout) = options.run_timeout {
        request = request.run_timeout(timeout);
    }
    if let Some(timeout) = options.approval_timeout {
        request = request.approval_timeout(timeout, false);
    }
    if options.pause_deadline {
        request = request.pause_deadline_while_waiting();
    }
    if !options.agent.is_empty() {
        request = request.agent(options.agent.clone());
    }
    request
}

/// Prints the run's events as they come (readably, or as JSON Lines with `json`) and returns its
/// result (`None`: the stream ended before `run_finished`, as an attach past the run's last event
/// does). `whole`: the run's output comes as one piece (a replay of its result), under no turn's
/// header.
async fn print_to_end(mut run: RunStream, whole: bool, json: bool) -> Result<Option<pb::RunResult>, Error> {
    let mut printer = Printer {
        whole,
        at_line_start: true,
        ..Printer::default()
    };
    let mut stdout = super::output::Stdout;
    // Read to the end of the call (its trailers, which the client reads after run_finished).
    let mut result = None;
    let mut followed = 0;
    loop {
        let event = match run.next_event().await {
            Ok(Some(event)) => event,
            Ok(None) | Err(orchestrator_client::Error::Unfinished) => break,
            Err(e) => return Err(refused("the run's event stream broke off", e)),
        };
        if let Some(id) = run.run_id() {
            printer.run_id = id.to_owned();
        }
        if run.reattached() > followed {
            followed = run.reattached();
            let line = followed_line(&printer.run_id, run.last_seq().saturating_sub(1));
            match json {
                true => eprintln!("{line}"),
                false => printer.line(&mut stdout, &line),
            }
        }
        if let E::Finished(finished) = &event {
            result = Some(finished.as_ref().clone());
        }
        match json {
            true => print_json_line(&run, event)?,
            false => printer.print(&mut stdout, &event),
        }
    }
    Ok(result)
}

/// Said where the events go on after the client re-attached to the run (`after`: the last seq
/// printed before).
fn followed_line(run_id: &str, after: u64) -> String {
    format!("↪ run {run_id} moved to another replica (or the connection broke): following it there after seq {after}")
}

/// Prints `event` of `run` as one line of JSON: the `OrchestrateEvent` the contract sent.
fn print_json_line(run: &RunStream, event: E) -> Result<(), Error> {
    let event = pb::OrchestrateEvent {
        run_id: run.run_id().unwrap_or_default().to_owned(),
        seq: run.last_seq(),
        event: Some(event.into_proto()),
    };
    super::output::print_json(&event, "orchestrator.v1.OrchestrateEvent")
}

/// Flags of `call`.
#[derive(Debug, Clone, Args)]
pub struct CallArgs {
    /// The orchestrator's address, with its scheme (http:// or https://).
    #[arg(long, env = "ORCHESTRATOR_ENDPOINT", default_value = "http://127.0.0.1:50051", value_parser = super::endpoint)]
    pub endpoint: String,
    /// The user message (required unless --attach).
    #[arg(long, required_unless_present = "attach", conflicts_with = "attach")]
    pub prompt: Option<String>,
    /// Attach to this run (live or finished, on any replica) instead of starting one, and print
    /// its events from --after on.
    #[arg(long, value_name = "RUN_ID")]
    pub attach: Option<String>,
    /// With --attach: the last seq already seen (0: from the start).
    #[arg(long, value_name = "SEQ")]
    pub after: Option<u64>,
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
    /// Run id (default: a new UUIDv7).
    #[arg(long, value_parser = super::run_id)]
    pub run_id: Option<String>,
    /// Deadline of the call. It bounds the run too, unless --detach (which bounds only the wait
    /// for the run to be let in).
    #[arg(long, default_value = "10m", value_parser = shared::config::parse_duration)]
    pub timeout: Duration,
    /// Start the run in the background (StartRun): print its id once it is let in and return;
    /// the run goes on bounded by its own timeout (--run-timeout, or the server's).
    #[arg(long, conflicts_with = "attach")]
    pub detach: bool,
    /// The run's own timeout (default: the server's run timeout).
    #[arg(long, value_parser = shared::config::parse_duration)]
    pub run_timeout: Option<Duration>,
    /// How long a call may wait for a person's decision before it is rejected (default: the
    /// server's). A wait never outlasts the run: it ends at the run's deadline (--timeout, or
    /// --run-timeout with --detach) when that comes first, and the approval says when.
    #[arg(long, value_parser = shared::config::parse_duration)]
    pub approval_timeout: Option<Duration>,
    /// The run's deadline pauses while a call waits for a person: the wait is bounded by
    /// --approval-timeout alone (use with --detach: an attached call still ends at --timeout).
    #[arg(long)]
    pub pause_deadline: bool,
    /// Run as this named agent (`orchestrator agents` lists them): its model, system message,
    /// tools and limits; the other flags set only what the agent lets a request override.
    #[arg(long, value_name = "NAME")]
    pub agent: Option<String>,
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
    #[allow(missing_docs)]
    #[command(flatten)]
    pub tls: super::TlsArgs,
    /// Continue this thread: the model sees its earlier runs, and this run joins it.
    #[arg(long, value_name = "THREAD_ID", value_parser = super::thread_id)]
    pub thread: Option<String>,
    /// With --thread: what the run does when another run holds the thread (default: reject).
    #[arg(long, value_enum)]
    pub on_busy: Option<BusyPolicy>,
    /// A label ListRuns finds the run by, KEY=VALUE (repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = super::key_value)]
    pub labels: Vec<(String, String)>,
    /// Print each event as one line of JSON (JSON Lines of orchestrator.v1.OrchestrateEvent,
    /// protobuf's JSON mapping) for scripts; lines said besides the events go to stderr.
    #[arg(long)]
    pub json: bool,
}

/// `--on-busy`: the domain's busy policies, by their names, each with its help line.
impl clap::ValueEnum for BusyPolicy {
    fn value_variants<'a>() -> &'a [Self] {
        &Self::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        let help = match self {
            Self::Reject => "Refused (ABORTED, naming the run holding the thread)",
            Self::Enqueue => "Wait until the runs before it have ended",
            Self::Interrupt => "The run holding the thread ends after its turn; this one starts from there",
            Self::Rollback => "The run holding the thread is canceled and its messages dropped",
        };
        Some(clap::builder::PossibleValue::new(self.name()).help(help))
    }
}

impl CallArgs {
    /// The client options these flags describe; flags that make no sense together refused.
    pub fn to_options(&self) -> Result<CallOptions, Error> {
        if self.after.is_some() && self.attach.is_none() {
            return Err(Error::Config(
                "--after needs --attach RUN_ID: it is the last seq already seen of the run attached to".into(),
            ));
        }
        if self.on_busy.is_some() && self.thread.is_none() {
            return Err(Error::Config(
                "--on-busy needs --thread THREAD_ID: it says what the run does when another run holds that thread"
                    .into(),
            ));
        }
        Ok(CallOptions {
            endpoint: self.endpoint.clone(),
            prompt: self.prompt.clone().unwrap_or_default(),
            attach: self.attach.clone().map(|run_id| (run_id, self.after.unwrap_or(0))),
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
            // Named here, so that a run waiting for its thread finds its place among those waiting.
            run_id: self.run_id.clone().unwrap_or_else(|| uuid::Uuid::now_v7().to_string()),
            timeout: self.timeout,
            needs_approval: self.needs_approval.clone(),
            token: self.token.clone(),
            tls: self.tls.clone(),
            thread: self.thread.clone().unwrap_or_default(),
            // Unset: the server's default (reject), or the named agent's policy.
            on_busy: self.on_busy.map_or(pb::ThreadBusyPolicy::Unspecified, Into::into),
            labels: self.labels.clone(),
            json: self.json,
            run_timeout: self.run_timeout,
            approval_timeout: self.approval_timeout,
            pause_deadline: self.pause_deadline,
            agent: self.agent.clone().unwrap_or_default(),
            params: pb::ModelParams {
                tool_choice: self.tool_choice.clone(),
                temperature: self.temperature,
                max_tokens: self.max_tokens,
                ..Default::default()
            },
        })
    }
}
