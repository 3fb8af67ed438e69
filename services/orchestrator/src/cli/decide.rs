//! `approvals`, `decide` and `answer`: the calls that wait for a person, a person's decisions on
//! calls that need approval, and their answers to a tool's questions.

use std::time::Duration;

use clap::Args;
use proto::orchestrator::v1 as pb;

use super::Connection;
use super::output::{print_json, refused, status_name};
use crate::Error;

/// Flags of `approvals`.
#[derive(Debug, Clone, Args)]
pub struct ApprovalsArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
    /// Only this run's calls.
    #[arg(value_name = "RUN_ID", value_parser = super::run_id, conflicts_with = "run_id")]
    pub run: Option<String>,
    /// The same as a flag.
    #[arg(long, value_name = "RUN_ID", value_parser = super::run_id)]
    pub run_id: Option<String>,
    /// With --watch, a call that comes to wait is a line as listed, and one decided, answered
    /// or expired a line "… no longer waits" (with --json: a `PendingApproval` line, and
    /// `{"noLongerWaits": {"runId": …, "callId": …}}`).
    #[command(flatten)]
    pub watch: super::watch::WatchArgs,
}

impl ApprovalsArgs {
    /// Lists the calls waiting, a line each (and a line per question).
    pub async fn run(&self) -> Result<bool, Error> {
        let client = self.connection.client().await?;
        let run_id = self.run.as_ref().or(self.run_id.as_ref());
        let request = pb::ListPendingApprovalsRequest {
            run_id: run_id.cloned().unwrap_or_default(),
            limit: 0,
        };
        let answer = client
            .list_pending_approvals(request.clone())
            .await
            .map_err(|e| refused("list the calls waiting for a person", e))?;
        if self.connection.json {
            print_json(&answer, "orchestrator.v1.ListPendingApprovalsResponse")?;
        } else {
            let now = shared::sync::unix_ms();
            for call in &answer.approvals {
                print_pending(call, now);
            }
            match (answer.approvals.is_empty(), answer.truncated) {
                (true, _) => say!("no tool call waits for a person"),
                (false, true) => say!("more calls wait than are listed"),
                (false, false) => {}
            }
        }
        if self.watch.watch {
            self.follow(&client, request, answer.approvals).await?;
        }
        Ok(true)
    }

    /// `--watch`: lists again at its pace and prints each call that comes to wait (or asks a
    /// new round) and each that no longer waits.
    async fn follow(
        &self,
        client: &orchestrator_client::Client,
        request: pb::ListPendingApprovalsRequest,
        first: Vec<pb::PendingApproval>,
    ) -> Result<(), Error> {
        let json = self.connection.json;
        let list = || async {
            let answer = client.list_pending_approvals(request.clone()).await;
            Ok(answer
                .map_err(|e| refused("list the calls waiting for a person", e))?
                .approvals)
        };
        let key = |call: &pb::PendingApproval| (call.run_id.clone(), call.call_id.clone());
        let show = |change: super::watch::Change<'_, pb::PendingApproval>| match change {
            super::watch::Change::New(call) if json => {
                if let Ok(line) = super::output::json(call, "orchestrator.v1.PendingApproval") {
                    super::output::line(&line);
                }
            }
            super::watch::Change::New(call) => print_pending(call, shared::sync::unix_ms()),
            super::watch::Change::Gone(call) if json => {
                let gone = serde_json::json!({"noLongerWaits": {"runId": call.run_id, "callId": call.call_id}});
                super::output::line(&gone.to_string());
            }
            super::watch::Change::Gone(call) => {
                say!("{}  {}  {} no longer waits", call.run_id, call.call_id, call.name);
            }
        };
        super::watch::changes(self.watch.watch_every, first, key, list, show).await
    }
}

/// One call waiting, and its questions.
fn print_pending(call: &pb::PendingApproval, now: u64) {
    let left = Duration::from_millis(call.expires_at_unix_ms.saturating_sub(now) / 1000 * 1000);
    let waits = match (call.input_requests.is_empty(), call.in_doubt) {
        (true, false) => "approval".to_owned(),
        (true, true) => "a decision to run it again: it ran and is IN DOUBT (its tool-runner went away before its outcome was kept; it may or may not have taken effect)".to_owned(),
        (false, _) => format!("answers to round {}", call.input_round),
    };
    say!(
        "{}  {}  {} {}  (turn {}, owner {:?}, waits for {waits}, expires in {})",
        call.run_id,
        call.call_id,
        call.name,
        call.arguments_json,
        call.turn,
        call.principal,
        humantime::format_duration(left)
    );
    print_context(call);
    for question in &call.input_requests {
        let detail = match question.mode.as_str() {
            "url" => &question.url,
            _ => &question.schema_json,
        };
        say!(
            "    ? {} ({}): {} {detail}",
            question.key,
            question.mode,
            question.message
        );
    }
}

/// What a person deciding `call` reads of its run: what it was asked, its labels, what the
/// model said before the call.
fn print_context(call: &pb::PendingApproval) {
    if !call.prompt.is_empty() {
        say!("    asked: {}", super::runs::one_line(&call.prompt));
    }
    if !call.labels.is_empty() {
        let mut labels: Vec<String> = call.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        labels.sort();
        say!("    labels: {}", labels.join(", "));
    }
    if !call.said_before.is_empty() {
        say!("    the model said: {}", super::runs::one_line(&call.said_before));
    }
}

/// What a run does after a decision or an answer, as a line.
fn after_decision(run_id: &str, status: i32, still: &[pb::PendingApproval]) -> String {
    match still.len() {
        0 => format!("run {run_id} goes on ({})", status_name(status)),
        n => format!("{n} call(s) of run {run_id} still wait ({})", status_name(status)),
    }
}

/// The run a command acts on: given alone (`decide RUN_ID`, as `get RUN_ID`) or as
/// `--run-id RUN_ID` (as `call` names it).
#[derive(Debug, Clone, Args)]
pub struct RunArg {
    /// The run.
    #[arg(value_name = "RUN_ID", value_parser = super::run_id, required_unless_present = "run_id", conflicts_with = "run_id")]
    run: Option<String>,
    /// The same as a flag.
    #[arg(long, value_name = "RUN_ID", value_parser = super::run_id)]
    run_id: Option<String>,
}

impl RunArg {
    /// The run's id, however it was given.
    pub fn id(&self) -> &str {
        self.run.as_deref().or(self.run_id.as_deref()).unwrap_or_default()
    }
}

/// Flags of `decide`.
#[derive(Debug, Clone, Args)]
pub struct DecideArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub run: RunArg,
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

impl DecideArgs {
    /// Sends the decisions and says what the run does now.
    pub async fn run(&self) -> Result<bool, Error> {
        let decisions = self.decisions().map_err(Error::Config)?;
        let client = self.connection.client().await?;
        let run_id = self.run.id();
        let request = pb::DecideToolCallsRequest {
            run_id: run_id.to_owned(),
            decisions,
        };
        let answer = client
            .decide_tool_calls(request)
            .await
            .map_err(|e| refused(&format!("decide on run {run_id:?}"), e))?;
        if self.connection.json {
            return print_json(&answer, "orchestrator.v1.DecideToolCallsResponse").map(|()| true);
        }
        let after = after_decision(run_id, answer.status, &answer.still_pending);
        say!("decided; {after}");
        Ok(true)
    }

    /// The decisions these flags describe, in the order approve, reject, edit.
    pub fn decisions(&self) -> Result<Vec<pb::ToolCallDecision>, String> {
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

/// Flags of `answer`: one answer per question of the call.
#[derive(Debug, Clone, Args)]
pub struct AnswerArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub run: RunArg,
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
    /// The round of questions answered, as `approvals` prints it: answers to a round the call
    /// no longer asks (its run moved and asked again) are refused, not taken for the new one.
    /// Without it: whichever round the call asks now.
    #[arg(long)]
    pub round: Option<String>,
}

impl AnswerArgs {
    /// Sends the answers and says what the run does now.
    pub async fn run(&self) -> Result<bool, Error> {
        let answers = self.answers();
        if answers.is_empty() {
            return Err(Error::Config(
                "answer each question of the call: --accept KEY[=JSON], --decline KEY or --cancel KEY".into(),
            ));
        }
        let client = self.connection.client().await?;
        let run_id = self.run.id();
        let request = pb::AnswerToolInputRequest {
            run_id: run_id.to_owned(),
            call_id: self.call_id.clone(),
            answers,
            round: self.round.clone().unwrap_or_default(),
        };
        let answer = client
            .answer_tool_input(request)
            .await
            .map_err(|e| refused(&format!("answer call {:?} of run {run_id:?}", self.call_id), e))?;
        if self.connection.json {
            return print_json(&answer, "orchestrator.v1.AnswerToolInputResponse").map(|()| true);
        }
        let after = after_decision(run_id, answer.status, &answer.still_pending);
        say!("answered; {after}");
        Ok(true)
    }

    /// The answers these flags describe, in the order accept, decline, cancel.
    pub fn answers(&self) -> Vec<pb::ToolInputAnswer> {
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
