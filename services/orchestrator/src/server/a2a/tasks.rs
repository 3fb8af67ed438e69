//! Runs as A2A tasks: a message's parts become the run's user message (text and data parts; a
//! file is refused), its context the run's thread; a run reads as a task (its status as the
//! task's state, a run waiting for a person as `INPUT_REQUIRED`, its text as the artifact
//! "answer"), and its events as the task's stream (text as artifact updates, tool calls as status
//! messages). A caller's reply to a task in `INPUT_REQUIRED` decides its calls or answers their
//! questions ([`reply`]).

use proto::lf::a2a::v1 as a2a;
use proto::orchestrator::v1 as pb;
use proto::orchestrator::v1::orchestrate_event::Event as E;

use super::error::RpcError;

/// The artifact that carries a run's text.
const ANSWER: &str = "answer";

/// The user message `message`'s parts make: text parts as they are, data parts as JSON, one
/// after the other on lines of their own.
pub(super) fn user_text(message: &a2a::Message) -> Result<String, RpcError> {
    if message.role != a2a::Role::User as i32 {
        return Err(RpcError::invalid_params("message.role must be ROLE_USER"));
    }
    let mut lines = Vec::with_capacity(message.parts.len());
    for part in &message.parts {
        match &part.content {
            Some(a2a::part::Content::Text(text)) => lines.push(text.clone()),
            Some(a2a::part::Content::Data(value)) => {
                let json =
                    crate::wire::json::to_sparse_json(value, "google.protobuf.Value").map_err(RpcError::internal)?;
                lines.push(json.to_string());
            }
            Some(a2a::part::Content::Raw(_) | a2a::part::Content::Url(_)) => {
                return Err(RpcError::content_type(
                    "files are not taken here: send text or data parts",
                ));
            }
            None => return Err(RpcError::invalid_params("a part carries no content")),
        }
    }
    if lines.iter().all(|l| l.trim().is_empty()) {
        return Err(RpcError::invalid_params("message.parts hold no text or data"));
    }
    Ok(lines.join("\n"))
}

/// The run a new task's first `message` starts: its text as the user message, its context as the
/// run's thread (a new context when it names none), as the named `agent` when given.
pub(super) fn run_request(message: &a2a::Message, agent: Option<&str>) -> Result<pb::OrchestrateRequest, RpcError> {
    let content = user_text(message)?;
    let context = match message.context_id.as_str() {
        "" => uuid::Uuid::now_v7().to_string(),
        id => id.to_owned(),
    };
    Ok(pb::OrchestrateRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content,
            ..Default::default()
        }],
        thread_id: context,
        agent: agent.unwrap_or_default().to_owned(),
        labels: [("a2a".to_owned(), "true".to_owned())].into(),
        ..Default::default()
    })
}

/// What a caller's reply to a task waiting for it does.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Reply {
    /// Decides the calls waiting for approval (`DecideToolCalls`).
    Decide(Vec<pb::ToolCallDecision>),
    /// Answers the questions of calls (`AnswerToolInput`, one request per call).
    Answer(Vec<pb::AnswerToolInputRequest>),
}

/// What the calls waiting in `run` were asked, as a task's follow-up stream passes them by: a
/// call's approval by its id, a question round by call and round.
pub(super) fn asked(run: &pb::RunResult) -> std::collections::HashSet<String> {
    waiting(run)
        .map(|p| match p.input_requests.is_empty() {
            true => p.call_id.clone(),
            false => format!("{}/{}", p.call_id, p.input_round),
        })
        .collect()
}

fn waiting(run: &pb::RunResult) -> impl Iterator<Item = &pb::PendingApproval> {
    run.pending_approvals.iter().filter(|p| p.decision.is_none())
}

/// What `message`, a reply to `run` waiting for its caller, says: for calls waiting for approval,
/// the text "approve" (or "yes") or "reject REASON" (or "no"), or a data part
/// `{"decision": "approve"|"reject", "callId": …, "message": …, "arguments": {…}}` (a list of
/// them under "decisions"); for questions, a data part `{"answers": {KEY: CONTENT}}`, or the text
/// "decline" or "cancel".
pub(super) fn reply(run: &pb::RunResult, message: &a2a::Message) -> Result<Reply, RpcError> {
    let (texts, data) = split_parts(message)?;
    let text = texts.join(" ").trim().to_lowercase();
    let questions = waiting(run).any(|p| !p.input_requests.is_empty());
    match questions {
        true => answers(run, &text, data.as_ref()),
        false => decisions(run, &text, data.as_ref()),
    }
}

/// A message's text parts and its data part (the last, when several).
fn split_parts(message: &a2a::Message) -> Result<(Vec<String>, Option<serde_json::Value>), RpcError> {
    let (mut texts, mut data) = (Vec::new(), None);
    for part in &message.parts {
        match &part.content {
            Some(a2a::part::Content::Text(text)) => texts.push(text.clone()),
            Some(a2a::part::Content::Data(value)) => {
                data = Some(
                    crate::wire::json::to_sparse_json(value, "google.protobuf.Value").map_err(RpcError::internal)?,
                );
            }
            _ => return Err(RpcError::content_type("a reply takes text or data parts")),
        }
    }
    Ok((texts, data))
}

fn decisions(run: &pb::RunResult, text: &str, data: Option<&serde_json::Value>) -> Result<Reply, RpcError> {
    let decision = |call_id: &str, kind: pb::DecisionKind, message: &str, arguments: &str| pb::ToolCallDecision {
        call_id: call_id.to_owned(),
        kind: kind.into(),
        message: message.to_owned(),
        arguments_json: arguments.to_owned(),
    };
    if let Some(data) = data {
        let asked: Vec<&serde_json::Value> = match data.get("decisions").and_then(|d| d.as_array()) {
            Some(list) => list.iter().collect(),
            None => vec![data],
        };
        let mut decided = Vec::new();
        for one in asked {
            let kind = match one.get("decision").and_then(|d| d.as_str()) {
                Some("approve") => pb::DecisionKind::Approve,
                Some("reject") => pb::DecisionKind::Reject,
                _ => {
                    return Err(RpcError::invalid_params(
                        "a decision is {\"decision\": \"approve\" or \"reject\", …}",
                    ));
                }
            };
            let message = one.get("message").and_then(|m| m.as_str()).unwrap_or_default();
            let arguments = one.get("arguments").map(|a| a.to_string()).unwrap_or_default();
            let calls: Vec<&str> = match one.get("callId").and_then(|c| c.as_str()) {
                Some(call) => vec![call],
                None => waiting(run).map(|p| p.call_id.as_str()).collect(),
            };
            decided.extend(calls.into_iter().map(|call| decision(call, kind, message, &arguments)));
        }
        return Ok(Reply::Decide(decided));
    }
    let (word, rest) = text.split_once(char::is_whitespace).unwrap_or((text, ""));
    let kind = match word.trim_end_matches(['.', '!', ':', ',']) {
        "approve" | "approved" | "yes" => pb::DecisionKind::Approve,
        "reject" | "rejected" | "no" => pb::DecisionKind::Reject,
        _ => {
            let calls: Vec<String> = waiting(run)
                .map(|p| format!("{}({})", p.name, p.arguments_json))
                .collect();
            return Err(RpcError::invalid_params(format!(
                "task {:?} waits for a decision on {}: reply \"approve\", \"reject REASON\", or a data part {{\"decision\": \"approve\" or \"reject\", \"callId\": …}}",
                run.run_id,
                calls.join(", ")
            )));
        }
    };
    let message = match (kind, rest.trim()) {
        (pb::DecisionKind::Reject, "") => "rejected by the A2A caller",
        (_, rest) => rest,
    };
    Ok(Reply::Decide(
        waiting(run).map(|p| decision(&p.call_id, kind, message, "")).collect(),
    ))
}

fn answers(run: &pb::RunResult, text: &str, data: Option<&serde_json::Value>) -> Result<Reply, RpcError> {
    let given = data.and_then(|d| d.get("answers")).and_then(|a| a.as_object());
    let action = match (given, text) {
        (Some(_), _) => pb::InputAction::Accept,
        (None, "decline") => pb::InputAction::Decline,
        (None, "cancel") => pb::InputAction::Cancel,
        _ => {
            return Err(RpcError::invalid_params(format!(
                "task {:?} waits for answers to its tools' questions: reply with a data part {{\"answers\": {{KEY: CONTENT}}}}, or \"decline\" or \"cancel\"",
                run.run_id
            )));
        }
    };
    let mut requests = Vec::new();
    for call in waiting(run).filter(|p| !p.input_requests.is_empty()) {
        let mut answers = Vec::new();
        for question in &call.input_requests {
            let content_json = match given {
                Some(given) => match given.get(&question.key) {
                    Some(content) => content.to_string(),
                    None => {
                        return Err(RpcError::invalid_params(format!(
                            "no answer for question {:?} of call {}: {}",
                            question.key, call.call_id, question.message
                        )));
                    }
                },
                None => String::new(),
            };
            answers.push(pb::ToolInputAnswer {
                key: question.key.clone(),
                action: action.into(),
                content_json,
            });
        }
        requests.push(pb::AnswerToolInputRequest {
            run_id: run.run_id.clone(),
            call_id: call.call_id.clone(),
            answers,
            round: call.input_round.clone(),
        });
    }
    Ok(Reply::Answer(requests))
}

/// A run's status as a task's state.
pub(super) fn state(status: i32) -> a2a::TaskState {
    use pb::RunStatus as S;
    match S::try_from(status).unwrap_or(S::Unspecified) {
        S::Running | S::AwaitingTask | S::Unspecified => a2a::TaskState::Working,
        S::Completed => a2a::TaskState::Completed,
        S::Failed => a2a::TaskState::Failed,
        S::Canceled => a2a::TaskState::Canceled,
        S::AwaitingApproval | S::AwaitingInput => a2a::TaskState::InputRequired,
    }
}

/// The state of `run`'s task: a live run with calls waiting for a person reads
/// `INPUT_REQUIRED` from the moment the calls are asked, before the run parks.
pub(super) fn run_state(run: &pb::RunResult) -> a2a::TaskState {
    match state(run.status) {
        a2a::TaskState::Working if waiting(run).next().is_some() => a2a::TaskState::InputRequired,
        state => state,
    }
}

/// Whether a task in `state` has ended or waits for its caller: its stream ends there.
pub(super) fn stops_stream(state: a2a::TaskState) -> bool {
    !matches!(state, a2a::TaskState::Working | a2a::TaskState::Submitted)
}

/// A message of the agent about task `task_id` in `context`.
fn agent_message(task_id: &str, context: &str, text: String) -> a2a::Message {
    a2a::Message {
        message_id: uuid::Uuid::now_v7().to_string(),
        context_id: context.to_owned(),
        task_id: task_id.to_owned(),
        role: a2a::Role::Agent.into(),
        parts: vec![text_part(text)],
        ..Default::default()
    }
}

fn text_part(text: String) -> a2a::Part {
    a2a::Part {
        content: Some(a2a::part::Content::Text(text)),
        ..Default::default()
    }
}

/// What a run in its state says to its caller: why it failed, what waits for a person.
fn status_text(run: &pb::RunResult) -> Option<String> {
    if !run.failure_detail.is_empty() {
        return Some(run.failure_detail.clone());
    }
    let waiting: Vec<String> = waiting(run)
        .map(|p| format!("{}({}) [{}]", p.name, p.arguments_json, p.call_id))
        .collect();
    (!waiting.is_empty()).then(|| format!("waits for a person's decision on {}", waiting.join(", ")))
}

fn timestamp(unix_ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: unix_ms.div_euclid(1000),
        nanos: i32::try_from(unix_ms.rem_euclid(1000) * 1_000_000).unwrap_or(0),
    }
}

/// `run` as a task, its text as the artifact "answer" when `with_text`.
pub(super) fn task(run: &pb::RunResult, with_text: bool) -> a2a::Task {
    let context = context_of(&run.thread_id, &run.run_id);
    let message = status_text(run).map(|text| agent_message(&run.run_id, &context, text));
    let artifacts = match with_text && !run.text.is_empty() {
        true => vec![a2a::Artifact {
            artifact_id: ANSWER.into(),
            name: ANSWER.into(),
            parts: vec![text_part(run.text.clone())],
            ..Default::default()
        }],
        false => Vec::new(),
    };
    a2a::Task {
        id: run.run_id.clone(),
        context_id: context,
        status: Some(a2a::TaskStatus {
            state: run_state(run).into(),
            message,
            timestamp: Some(timestamp(run.updated_at_ms)),
        }),
        artifacts,
        ..Default::default()
    }
}

/// A listed run as a task (its state; a listing holds no output).
pub(super) fn listed(run: &pb::RunSummary) -> a2a::Task {
    a2a::Task {
        id: run.run_id.clone(),
        context_id: context_of(&run.thread_id, &run.run_id),
        status: Some(a2a::TaskStatus {
            state: state(run.status).into(),
            timestamp: Some(timestamp(run.updated_at_ms)),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A task's context: its run's thread (a run without one is its own context).
fn context_of<'a>(thread_id: &'a str, run_id: &'a str) -> String {
    match thread_id {
        "" => run_id.to_owned(),
        thread => thread.to_owned(),
    }
}

/// Turns a run's events into its task's stream: text as appends to the artifact "answer", tool
/// calls as status messages, a call waiting for a person as `INPUT_REQUIRED`, the end as the
/// final state.
pub(super) struct Streamer {
    task_id: String,
    context: String,
    /// Text was sent: the next text appends to it.
    texted: bool,
    /// The asks the caller has replied to (see [`asked`]): a follow-up stream, which reads the
    /// run from its start, passes them by.
    answered: std::collections::HashSet<String>,
}

impl Streamer {
    pub(super) fn new(task_id: &str, context: &str) -> Self {
        Self {
            task_id: task_id.to_owned(),
            context: context.to_owned(),
            texted: false,
            answered: std::collections::HashSet::new(),
        }
    }

    /// The stream after the caller replied to `answered` (see [`asked`]).
    pub(super) fn after(mut self, answered: std::collections::HashSet<String>) -> Self {
        self.answered = answered;
        self
    }

    /// What `event` says on the task's stream (nothing for most), and whether the stream ends.
    pub(super) fn items(&mut self, event: &pb::OrchestrateEvent) -> (Vec<a2a::StreamResponse>, bool) {
        use a2a::stream_response::Payload;
        let (task_id, context) = (self.task_id.clone(), self.context.clone());
        let status = |state: a2a::TaskState, text: Option<String>| {
            Payload::StatusUpdate(a2a::TaskStatusUpdateEvent {
                task_id: task_id.clone(),
                context_id: context.clone(),
                status: Some(a2a::TaskStatus {
                    state: state.into(),
                    message: text.map(|text| agent_message(&task_id, &context, text)),
                    timestamp: Some(timestamp(shared::sync::unix_ms().try_into().unwrap_or(i64::MAX))),
                }),
                ..Default::default()
            })
        };
        let (payloads, ends) = match &event.event {
            Some(E::TextDelta(delta)) => (vec![self.text(delta.text.clone(), false)], false),
            Some(E::ToolCallStarted(call)) => {
                let said = format!("calling {}({})", call.name, call.arguments_json);
                (vec![status(a2a::TaskState::Working, Some(said))], false)
            }
            Some(E::ApprovalRequested(asked)) if self.answered.contains(&asked.call_id) => (Vec::new(), false),
            Some(E::ToolInputRequested(asked))
                if self.answered.contains(&format!("{}/{}", asked.call_id, asked.round)) =>
            {
                (Vec::new(), false)
            }
            Some(E::ApprovalRequested(asked)) => {
                let said = format!(
                    "tool call {}({}) [{}] waits for a person's approval",
                    asked.name, asked.arguments_json, asked.call_id
                );
                (vec![status(a2a::TaskState::InputRequired, Some(said))], true)
            }
            Some(E::ToolInputRequested(asked)) => {
                let said = format!(
                    "tool call {} [{}] asks questions before it can finish",
                    asked.name, asked.call_id
                );
                (vec![status(a2a::TaskState::InputRequired, Some(said))], true)
            }
            Some(E::RunFinished(finished)) => {
                let run = finished.result.clone().unwrap_or_default();
                let mut payloads = Vec::new();
                if self.texted {
                    payloads.push(self.text(String::new(), true));
                }
                payloads.push(status(state(run.status), status_text(&run)));
                (payloads, true)
            }
            _ => (Vec::new(), false),
        };
        let items = payloads
            .into_iter()
            .map(|payload| a2a::StreamResponse { payload: Some(payload) })
            .collect();
        (items, ends)
    }

    /// An update of the artifact "answer": `text` appended to what was sent (the first is the
    /// artifact's start), the last one marked.
    fn text(&mut self, text: String, last: bool) -> a2a::stream_response::Payload {
        let append = self.texted;
        self.texted = true;
        a2a::stream_response::Payload::ArtifactUpdate(a2a::TaskArtifactUpdateEvent {
            task_id: self.task_id.clone(),
            context_id: self.context.clone(),
            artifact: Some(a2a::Artifact {
                artifact_id: ANSWER.into(),
                name: ANSWER.into(),
                parts: vec![text_part(text)],
                ..Default::default()
            }),
            append,
            last_chunk: last,
            ..Default::default()
        })
    }
}

/// The context a task's stream names: its run's thread, or the run.
pub(super) fn context(run: &pb::RunResult) -> String {
    context_of(&run.thread_id, &run.run_id)
}

#[cfg(test)]
mod tests;
