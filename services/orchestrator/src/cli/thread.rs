//! `say`, `thread`, `usage`, `agents` and `signals`: a message for a live run, a thread (printed
//! or deleted), what a principal spent an hour at a time, the named agents one may use, and the
//! signals runs send as they come.

use std::time::Duration;

use clap::Args;
use proto::orchestrator::v1 as pb;
use shared::config::parse_duration;

use super::Connection;
use super::output::{Table, print_json, refused, status_name, utc};
use crate::Error;

/// Flags of `say`.
#[derive(Debug, Clone, Args)]
pub struct SayArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
    /// The live run.
    #[arg(value_parser = super::run_id)]
    pub run_id: String,
    /// The message.
    pub text: String,
}

impl SayArgs {
    /// Sends the message and says how many wait for the run's next turn.
    pub async fn run(&self) -> Result<bool, Error> {
        let client = self.connection.client().await?;
        let waiting = client
            .send_message(&self.run_id, &self.text)
            .await
            .map_err(|e| refused(&format!("send run {:?} a message", self.run_id), e))?;
        if self.connection.json {
            return print_json(
                &pb::SendMessageResponse { waiting },
                "orchestrator.v1.SendMessageResponse",
            )
            .map(|()| true);
        }
        say!(
            "sent; {waiting} message(s) wait for the next turn of run {}",
            self.run_id
        );
        Ok(true)
    }
}

/// Flags of `thread`.
#[derive(Debug, Clone, Args)]
pub struct ThreadArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
    /// The thread.
    #[arg(value_parser = super::thread_id)]
    pub thread_id: String,
    /// Delete the thread instead (DeleteThread).
    #[arg(long)]
    pub delete: bool,
}

impl ThreadArgs {
    /// Prints the thread (its runs, then its messages, a line each), or deletes it.
    pub async fn run(&self) -> Result<bool, Error> {
        let client = self.connection.client().await?;
        if self.delete {
            let deleted = client
                .delete_thread(&self.thread_id)
                .await
                .map_err(|e| refused(&format!("delete thread {:?}", self.thread_id), e))?;
            if self.connection.json {
                return print_json(
                    &pb::DeleteThreadResponse { deleted },
                    "orchestrator.v1.DeleteThreadResponse",
                )
                .map(|()| true);
            }
            say!("thread {} deleted", self.thread_id);
            return Ok(true);
        }
        let thread = client
            .thread(&self.thread_id)
            .await
            .map_err(|e| refused(&format!("thread {:?}", self.thread_id), e))?;
        if self.connection.json {
            return print_json(&thread, "orchestrator.v1.Thread").map(|()| true);
        }
        say!("{}", thread_line(&thread));
        for run in &thread.runs {
            let status = status_name(run.status);
            say!("  run {} · {status} · {} message(s)", run.run_id, run.messages);
        }
        for message in &thread.messages {
            say!("{}", message_line(message));
        }
        Ok(true)
    }
}

/// A thread's first line: its owner, size, the run holding it and those waiting.
pub(super) fn thread_line(t: &pb::Thread) -> String {
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
    /// Prints the spend, an hour a line, and the total.
    pub async fn run(&self) -> Result<bool, Error> {
        let now = shared::sync::unix_ms();
        let from = now.saturating_sub(u64::try_from(self.since.as_millis()).unwrap_or(u64::MAX));
        let span = (i64::try_from(from).unwrap_or(1), i64::try_from(now).unwrap_or(0));
        let client = self.connection.client().await?;
        let spent = client
            .usage(&self.principal, span.0, span.1)
            .await
            .map_err(|e| refused("read the usage", e))?;
        if self.connection.json {
            return print_json(&spent, "orchestrator.v1.GetUsageResponse").map(|()| true);
        }
        let mut table = Table::new(&[
            "HOUR",
            ">PROMPT",
            ">CACHED",
            ">COMPLETION",
            ">RUNS",
            ">TOOL CALLS",
            ">RUN TIME",
        ]);
        let row = |label: String, w: &pb::UsageWindow| {
            vec![
                label,
                w.prompt_tokens.to_string(),
                w.cached_prompt_tokens.to_string(),
                w.completion_tokens.to_string(),
                w.runs.to_string(),
                w.tool_calls.to_string(),
                humantime::format_duration(Duration::from_secs(w.run_ms / 1000)).to_string(),
            ]
        };
        for window in &spent.windows {
            table.row(row(utc(window.start_ms), window));
        }
        table.row(row(
            format!("total ({})", spent.principal),
            &spent.total.unwrap_or_default(),
        ));
        table.print();
        if let Some(budget) = spent.tokens_per_hour {
            say!("tokens_per_hour: {budget}");
        }
        Ok(true)
    }
}

/// Flags of `agents`.
#[derive(Debug, Clone, Args)]
pub struct AgentsArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
}

impl AgentsArgs {
    /// Prints the agents the caller may use, a line each: name, version, model, tools and what
    /// a request may override.
    pub async fn run(&self) -> Result<bool, Error> {
        let client = self.connection.client().await?;
        let agents = client.list_agents().await.map_err(|e| refused("list the agents", e))?;
        if self.connection.json {
            let answer = pb::ListAgentsResponse { agents };
            return print_json(&answer, "orchestrator.v1.ListAgentsResponse").map(|()| true);
        }
        let list = |names: &[String], none: &str| match names.is_empty() {
            true => none.to_owned(),
            false => names.join(","),
        };
        let mut table = Table::new(&[
            "AGENT",
            "VERSION",
            "MODEL",
            "TOOLS",
            "APPROVAL",
            "OVERRIDABLE",
            "DESCRIPTION",
        ]);
        for agent in &agents {
            table.row(vec![
                agent.name.clone(),
                agent.version.clone(),
                match agent.model.as_str() {
                    "" => "(server's)".to_owned(),
                    model => model.to_owned(),
                },
                list(&agent.tools, "(all)"),
                list(&agent.needs_approval, "-"),
                list(&agent.overridable, "-"),
                shared::text::printable(&agent.description).into_owned(),
            ]);
        }
        table.print();
        if agents.is_empty() {
            say!("no agents you may use (the server's --agents file names them)");
        }
        Ok(true)
    }
}

/// Flags of `signals`.
#[derive(Debug, Clone, Args)]
pub struct SignalsArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
    /// Only this run's signals.
    #[arg(long, default_value = "", value_parser = run_id_or_none)]
    pub run_id: String,
    /// Only signals of this exit tool (repeatable).
    #[arg(long = "tool", value_name = "EXIT_TOOL")]
    pub tools: Vec<String>,
    /// Stop after this many signals (default: follow until interrupted).
    #[arg(long)]
    pub count: Option<u64>,
}

fn run_id_or_none(text: &str) -> Result<String, String> {
    match text {
        "" => Ok(String::new()),
        id => super::run_id(id),
    }
}

impl SignalsArgs {
    /// Prints each signal as it comes (SubscribeSignals), a line each (with --json, the
    /// `SignalEvent`), until --count signals or the server ends the stream.
    pub async fn run(&self) -> Result<bool, Error> {
        use futures::StreamExt;
        let client = self.connection.client().await?;
        let tools: Vec<&str> = self.tools.iter().map(String::as_str).collect();
        let mut stream = client
            .subscribe_signals(&self.run_id, &tools)
            .await
            .map_err(|e| refused("subscribe to the signals", e))?;
        let mut seen = 0u64;
        while self.count.is_none_or(|count| seen < count) {
            let Some(item) = stream.next().await else { break };
            let event = item.map_err(|e| refused("the signal stream broke off", e))?;
            if self.connection.json {
                print_json(&event, "orchestrator.v1.SignalEvent")?;
            }
            match event.event {
                Some(pb::signal_event::Event::Signal(signal)) => {
                    seen += 1;
                    if !self.connection.json {
                        say!(
                            "{}  {}  {}  {} {}",
                            utc(i64::try_from(signal.emitted_at_unix_ms).unwrap_or(0)),
                            signal.run_id,
                            signal.call_id,
                            signal.tool_name,
                            signal.arguments_json
                        );
                    }
                }
                Some(pb::signal_event::Event::Missed(missed)) if !self.connection.json => {
                    say!("… {missed} signal(s) missed: this reader fell behind");
                }
                _ => {}
            }
        }
        Ok(true)
    }
}
