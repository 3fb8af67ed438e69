//! Wire mapping: domain results, signals and events as proto messages and back (the result
//! store reads its records through the same mapping), and the `grpc-timeout` header.

use std::time::Duration;

use proto::orchestrator::v1 as pb;

use crate::Error;
use crate::domain::approval::{ApprovalDecision, ApprovalOutcome, PendingApproval};
use crate::domain::input::{InputAction, InputAnswer, InputMode, InputRequest, Questions};
use crate::domain::{
    Delivery, Event, FailureReason, Limits, NumberedEvent, RunResult, RunStatus, Signal, ToolCallError,
};

/// A duration in whole milliseconds, as the wire's `u32` limits carry it (saturating).
pub(crate) fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

/// Parses a `grpc-timeout` header value (`100m`, `5S`, …) into a duration.
pub(crate) fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// One mapping per enum, both directions from the same list of variants: the domain → proto
/// `match` is exhaustive over the domain enum and the proto → domain one over the proto enum, so
/// a variant added on either side without the other does not compile. Proto's `UNSPECIFIED` has
/// no domain value: reading it is an error ([`Error::Contract`]), as is a number this build does
/// not know.
macro_rules! one_to_one {
    ($domain:ident <=> $proto:ident, unspecified: $unspecified:ident, [$($variant:ident),+ $(,)?]) => {
        impl From<$domain> for pb::$proto {
            fn from(value: $domain) -> Self {
                match value {
                    $($domain::$variant => Self::$variant,)+
                }
            }
        }

        impl TryFrom<pb::$proto> for $domain {
            type Error = Error;
            fn try_from(value: pb::$proto) -> Result<Self, Error> {
                match value {
                    $(pb::$proto::$variant => Ok(Self::$variant),)+
                    pb::$proto::$unspecified => Err(Error::Contract {
                        field: stringify!($proto),
                        value: value as i32,
                    }),
                }
            }
        }

        impl $domain {
            /// Every value, in declaration order.
            pub const ALL: &[Self] = &[$(Self::$variant),+];

            /// The wire value (an `i32` field of a proto message) as this value.
            pub fn from_wire(value: i32) -> Result<Self, Error> {
                let known = pb::$proto::try_from(value).map_err(|_| Error::Contract {
                    field: stringify!($proto),
                    value,
                })?;
                Self::try_from(known)
            }
        }
    };
}

one_to_one!(RunStatus <=> RunStatus, unspecified: Unspecified, [Running, Completed, Failed, Canceled, AwaitingApproval, AwaitingInput, AwaitingTask]);
one_to_one!(ApprovalOutcome <=> ApprovalOutcome, unspecified: Unspecified, [Approved, Edited, Rejected, TimedOut, Answered]);
one_to_one!(Delivery <=> SignalDelivery, unspecified: Unspecified, [Pending, Delivered, Undelivered]);
one_to_one!(FailureReason <=> FailureReason, unspecified: Unspecified, [
    ToolParseError,
    ToolExecutionError,
    ToolBudgetExhausted,
    ToolFailureLimit,
    RepeatedLineLoop,
    MaxTurnsExceeded,
    LlmError,
    LlmStreamStalled,
    DeadlineExceeded,
    UnknownError,
    OrchestratorLost,
    OutputLimit,
    ApprovalTimeout,
    TokenBudget,
]);

/// A run's failure reason on the wire: `UNSPECIFIED` is "did not fail".
pub(super) fn reason_from_wire(value: i32) -> Result<Option<FailureReason>, Error> {
    if value == pb::FailureReason::Unspecified as i32 {
        return Ok(None);
    }
    FailureReason::from_wire(value).map(Some)
}

pub(super) fn reason_to_wire(reason: Option<FailureReason>) -> i32 {
    reason
        .map_or(pb::FailureReason::Unspecified, pb::FailureReason::from)
        .into()
}

pub(super) fn error_pb(e: &ToolCallError) -> pb::ToolCallError {
    pb::ToolCallError {
        code: e.code.clone(),
        message: e.message.clone(),
    }
}

pub(crate) fn usage_pb(u: crate::domain::chat::Usage) -> pb::Usage {
    pb::Usage {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        cached_prompt_tokens: u.cached_prompt_tokens,
    }
}

fn usage_of(u: pb::Usage) -> crate::domain::chat::Usage {
    crate::domain::chat::Usage {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        cached_prompt_tokens: u.cached_prompt_tokens,
    }
}

impl From<&Signal> for pb::Signal {
    fn from(s: &Signal) -> Self {
        Self {
            run_id: s.run_id.clone(),
            call_id: s.call_id.clone(),
            tool_name: s.tool_name.clone(),
            arguments_json: s.arguments_json.clone(),
            arguments_valid: s.arguments_valid,
            turn: s.turn,
            emitted_at_unix_ms: s.emitted_at_unix_ms,
            metadata: s.metadata.clone().into_iter().collect(),
            delivery: pb::SignalDelivery::from(s.delivery).into(),
            principal: s.principal.clone(),
        }
    }
}

impl TryFrom<pb::Signal> for Signal {
    type Error = Error;

    fn try_from(s: pb::Signal) -> Result<Self, Error> {
        Ok(Self {
            delivery: Delivery::from_wire(s.delivery)?,
            run_id: s.run_id,
            call_id: s.call_id,
            tool_name: s.tool_name,
            arguments_json: s.arguments_json,
            arguments_valid: s.arguments_valid,
            turn: s.turn,
            emitted_at_unix_ms: s.emitted_at_unix_ms,
            metadata: s.metadata.into_iter().collect(),
            principal: s.principal,
        })
    }
}

impl From<&ApprovalDecision> for pb::ApprovalDecision {
    fn from(d: &ApprovalDecision) -> Self {
        Self {
            outcome: pb::ApprovalOutcome::from(d.outcome).into(),
            principal: d.principal.clone(),
            decided_at_unix_ms: d.decided_at_unix_ms,
            message: d.message.clone(),
            original_arguments_json: d.original_arguments_json.clone(),
            edited_arguments_json: d.edited_arguments_json.clone(),
            answers: d.answers.iter().map(pb::ToolInputAnswer::from).collect(),
        }
    }
}

impl From<&InputAnswer> for pb::ToolInputAnswer {
    fn from(a: &InputAnswer) -> Self {
        let action = match a.action {
            InputAction::Accept => pb::InputAction::Accept,
            InputAction::Decline => pb::InputAction::Decline,
            InputAction::Cancel => pb::InputAction::Cancel,
        };
        Self {
            key: a.key.clone(),
            action: action.into(),
            content_json: a.content.as_ref().map(ToString::to_string).unwrap_or_default(),
        }
    }
}

impl TryFrom<pb::ToolInputAnswer> for InputAnswer {
    type Error = String;

    /// An answer as asked for: a known action, content that is JSON.
    fn try_from(a: pb::ToolInputAnswer) -> Result<Self, String> {
        let action = match pb::InputAction::try_from(a.action) {
            Ok(pb::InputAction::Accept) => InputAction::Accept,
            Ok(pb::InputAction::Decline) => InputAction::Decline,
            Ok(pb::InputAction::Cancel) => InputAction::Cancel,
            _ => {
                return Err(format!(
                    "the answer to question {:?} has no action (accept, decline or cancel)",
                    a.key
                ));
            }
        };
        let content = match a.content_json.trim() {
            "" => None,
            json => Some(
                serde_json::from_str(json)
                    .map_err(|e| format!("the content for question {:?} is not JSON: {e}", a.key))?,
            ),
        };
        Ok(Self {
            key: a.key,
            action,
            content,
        })
    }
}

impl From<&InputRequest> for pb::ToolInputRequest {
    fn from(r: &InputRequest) -> Self {
        Self {
            key: r.key.clone(),
            mode: r.mode.as_str().to_owned(),
            message: r.message.clone(),
            schema_json: if r.schema.is_null() {
                String::new()
            } else {
                r.schema.to_string()
            },
            url: r.url.clone(),
        }
    }
}

/// A question as a runner (or a stored record) gives it; `None` for a mode this version does
/// not know.
pub(crate) fn input_request(
    key: String,
    mode: &str,
    message: String,
    schema_json: &str,
    url: String,
) -> Option<InputRequest> {
    Some(InputRequest {
        key,
        mode: InputMode::named(mode)?,
        message,
        schema: serde_json::from_str(schema_json).unwrap_or(serde_json::Value::Null),
        url,
    })
}

fn input_request_of(r: pb::ToolInputRequest) -> Option<InputRequest> {
    input_request(r.key, &r.mode, r.message, &r.schema_json, r.url)
}

impl TryFrom<pb::ApprovalDecision> for ApprovalDecision {
    type Error = Error;

    fn try_from(d: pb::ApprovalDecision) -> Result<Self, Error> {
        Ok(Self {
            outcome: ApprovalOutcome::from_wire(d.outcome)?,
            principal: d.principal,
            decided_at_unix_ms: d.decided_at_unix_ms,
            message: d.message,
            original_arguments_json: d.original_arguments_json,
            edited_arguments_json: d.edited_arguments_json,
            answers: d
                .answers
                .into_iter()
                .filter_map(|a| InputAnswer::try_from(a).ok())
                .collect(),
        })
    }
}

impl From<&PendingApproval> for pb::PendingApproval {
    fn from(p: &PendingApproval) -> Self {
        Self {
            run_id: p.run_id.clone(),
            call_id: p.call_id.clone(),
            name: p.name.clone(),
            arguments_json: p.arguments_json.clone(),
            turn: p.turn,
            requested_at_unix_ms: p.requested_at_unix_ms,
            expires_at_unix_ms: p.expires_at_unix_ms,
            principal: p.principal.clone(),
            decision: p.decision.as_ref().map(pb::ApprovalDecision::from),
            // The questions' state is the tool's, opaque: it is not shown, only its round.
            input_requests: p
                .questions
                .iter()
                .flat_map(|q| q.requests.iter().map(pb::ToolInputRequest::from))
                .collect(),
            input_round: p.questions.as_ref().map(Questions::round).unwrap_or_default(),
            in_doubt: p.in_doubt,
            prompt: p.context.prompt.clone(),
            labels: p.context.labels.clone().into_iter().collect(),
            said_before: p.context.said_before.clone(),
        }
    }
}

impl TryFrom<pb::PendingApproval> for PendingApproval {
    type Error = Error;

    fn try_from(p: pb::PendingApproval) -> Result<Self, Error> {
        let requests: Vec<InputRequest> = p.input_requests.into_iter().filter_map(input_request_of).collect();
        Ok(Self {
            questions: (!requests.is_empty()).then(|| Questions {
                request_state: String::new(),
                requests,
            }),
            decision: p.decision.map(ApprovalDecision::try_from).transpose()?,
            run_id: p.run_id,
            call_id: p.call_id,
            name: p.name,
            arguments_json: p.arguments_json,
            turn: p.turn,
            requested_at_unix_ms: p.requested_at_unix_ms,
            expires_at_unix_ms: p.expires_at_unix_ms,
            principal: p.principal,
            in_doubt: p.in_doubt,
            context: crate::domain::approval::CallContext {
                prompt: p.prompt,
                labels: p.labels.into_iter().collect(),
                said_before: p.said_before,
            },
        })
    }
}

impl TryFrom<pb::RunResult> for RunResult {
    type Error = Error;

    /// Reads a stored result back (the run store keeps the proto form).
    fn try_from(r: pb::RunResult) -> Result<Self, Error> {
        let usage = r.usage.unwrap_or_default();
        Ok(Self {
            status: RunStatus::from_wire(r.status)?,
            failure_reason: reason_from_wire(r.failure_reason)?,
            run_id: r.run_id,
            failure_detail: r.failure_detail,
            text: r.text,
            signals: r.signals.into_iter().map(Signal::try_from).collect::<Result<_, _>>()?,
            turns: r.turns,
            tool_calls: r
                .tool_calls
                .into_iter()
                .map(|c| {
                    Ok(crate::domain::ToolCallRecord {
                        approval: c.approval.map(ApprovalDecision::try_from).transpose()?,
                        call_id: c.call_id,
                        name: c.name,
                        arguments_json: c.arguments_json,
                        ok: c.ok,
                        error: c.error.map(|e| ToolCallError {
                            code: e.code,
                            message: e.message,
                        }),
                        duration_ms: c.duration_ms,
                        turn: c.turn,
                    })
                })
                .collect::<Result<_, Error>>()?,
            failed_turns: r.failed_turns,
            usage: usage_of(usage),
            finish_reason: r.finish_reason,
            principal: r.principal,
            reasoning: r.reasoning,
            reasoning_truncated: r.reasoning_truncated,
            pending_approvals: r
                .pending_approvals
                .into_iter()
                .map(PendingApproval::try_from)
                .collect::<Result<_, _>>()?,
            thread_id: r.thread_id,
            labels: r.labels.into_iter().collect(),
            created_at_ms: u64::try_from(r.created_at_ms).unwrap_or(0),
            updated_at_ms: u64::try_from(r.updated_at_ms).unwrap_or(0),
            queued_ms: r.queued_ms,
            // Not on the wire: the run's record keeps it beside the result.
            ends_after_turn: None,
            agent: agent_from_wire(r.agent, r.agent_version),
            request_digests: r.request_digests.into_iter().collect(),
            prompt: r.prompt,
        })
    }
}

impl From<&RunResult> for pb::RunResult {
    fn from(r: &RunResult) -> Self {
        Self {
            run_id: r.run_id.clone(),
            status: pb::RunStatus::from(r.status).into(),
            failure_reason: reason_to_wire(r.failure_reason),
            failure_detail: r.failure_detail.clone(),
            text: r.text.clone(),
            signals: r.signals.iter().map(pb::Signal::from).collect(),
            turns: r.turns,
            tool_calls: r
                .tool_calls
                .iter()
                .map(|c| pb::ToolCallRecord {
                    call_id: c.call_id.clone(),
                    name: c.name.clone(),
                    arguments_json: c.arguments_json.clone(),
                    ok: c.ok,
                    error: c.error.as_ref().map(error_pb),
                    duration_ms: c.duration_ms,
                    turn: c.turn,
                    approval: c.approval.as_ref().map(pb::ApprovalDecision::from),
                    in_doubt: c.error.as_ref().is_some_and(ToolCallError::in_doubt),
                })
                .collect(),
            failed_turns: r.failed_turns,
            usage: Some(usage_pb(r.usage)),
            finish_reason: r.finish_reason.clone(),
            principal: r.principal.clone(),
            reasoning: r.reasoning.clone(),
            reasoning_truncated: r.reasoning_truncated,
            pending_approvals: r.pending_approvals.iter().map(pb::PendingApproval::from).collect(),
            thread_id: r.thread_id.clone(),
            labels: r.labels.clone().into_iter().collect(),
            created_at_ms: unix_ms_pb(r.created_at_ms),
            updated_at_ms: unix_ms_pb(r.updated_at_ms),
            queued_ms: r.queued_ms,
            agent: r.agent.as_ref().map(|a| a.name.clone()).unwrap_or_default(),
            agent_version: r.agent.as_ref().map(|a| a.version.clone()).unwrap_or_default(),
            request_digests: r.request_digests.clone().into_iter().collect(),
            prompt: r.prompt.clone(),
        }
    }
}

/// A run's agent as the proto carries it: its name, empty for none.
fn agent_from_wire(name: String, version: String) -> Option<crate::domain::agent::AgentRef> {
    (!name.is_empty()).then_some(crate::domain::agent::AgentRef { name, version })
}

/// A time in Unix ms as the proto carries it (int64).
fn unix_ms_pb(ms: u64) -> i64 {
    i64::try_from(ms).unwrap_or(i64::MAX)
}

impl From<&crate::domain::listing::RunSummary> for pb::RunSummary {
    fn from(r: &crate::domain::listing::RunSummary) -> Self {
        use crate::domain::listing::WaitingFor;
        let waiting_for = match r.waiting_for {
            WaitingFor::Nothing => pb::WaitingFor::Unspecified,
            WaitingFor::Approval => pb::WaitingFor::Approval,
            WaitingFor::Input => pb::WaitingFor::Input,
            WaitingFor::Thread => pb::WaitingFor::Thread,
            WaitingFor::Task => pb::WaitingFor::Task,
        };
        Self {
            run_id: r.run_id.clone(),
            status: pb::RunStatus::from(r.status).into(),
            failure_reason: reason_to_wire(r.failure_reason),
            principal: r.principal.clone(),
            thread_id: r.thread_id.clone(),
            labels: r.labels.clone().into_iter().collect(),
            created_at_ms: unix_ms_pb(r.created_at_ms),
            updated_at_ms: unix_ms_pb(r.updated_at_ms),
            turns: r.turns,
            usage: Some(usage_pb(r.usage)),
            tool_calls: r.tool_calls,
            waiting_for: waiting_for.into(),
            agent: r.agent.as_ref().map(|a| a.name.clone()).unwrap_or_default(),
            agent_version: r.agent.as_ref().map(|a| a.version.clone()).unwrap_or_default(),
            prompt: r.prompt.clone(),
        }
    }
}

/// A numbered domain event as a proto event of `run_id`.
pub(crate) fn event_pb(run_id: &str, seq: u64, event: Event) -> pb::OrchestrateEvent {
    pb::OrchestrateEvent {
        run_id: run_id.to_owned(),
        seq,
        event: Some(event_kind_pb(event)),
    }
}

/// A domain event as the proto event's payload.
fn event_kind_pb(event: Event) -> pb::orchestrate_event::Event {
    use pb::orchestrate_event::Event as E;
    match event {
        Event::RunStarted {
            model,
            normal_tools,
            exit_tools,
            limits,
            thread,
            queued_ms,
        } => E::RunStarted(pb::RunStarted {
            queued_ms,
            model,
            normal_tools,
            exit_tools,
            limits: Some(limits_pb(&limits)),
            ..thread_start_pb(thread.as_ref())
        }),
        Event::TextDelta { text, turn } => E::TextDelta(pb::TextDelta { text, turn }),
        Event::ReasoningDelta { text, turn } => E::ReasoningDelta(pb::ReasoningDelta { text, turn }),
        Event::ToolCallStarted {
            call_id,
            name,
            arguments_json,
            turn,
            arguments_truncated,
        } => E::ToolCallStarted(pb::ToolCallStarted {
            call_id,
            name,
            arguments_json,
            turn,
            arguments_truncated,
        }),
        Event::ToolCallFinished {
            call_id,
            name,
            content_json,
            content_truncated,
            error,
            duration_ms,
        } => E::ToolCallFinished(pb::ToolCallFinished {
            call_id,
            name,
            ok: error.is_none(),
            content_json: content_json.unwrap_or_default(),
            in_doubt: error.as_ref().is_some_and(ToolCallError::in_doubt),
            error: error.as_ref().map(error_pb),
            duration_ms,
            content_truncated,
        }),
        Event::Signal(signal) => E::Signal(pb::Signal::from(&signal)),
        Event::TurnFinished {
            turn,
            usage,
            tool_call_budget_remaining,
            failed_turns,
        } => E::TurnFinished(pb::TurnFinished {
            turn,
            usage: Some(usage_pb(usage)),
            tool_call_budget_remaining,
            failed_turns,
        }),
        Event::TurnRestarted { turn, attempt, reason } => E::TurnRestarted(pb::TurnRestarted { turn, attempt, reason }),
        waiting @ (Event::ApprovalRequested { .. } | Event::ToolInputRequested { .. } | Event::CallDecided { .. }) => {
            person_event_pb(waiting)
        }
        Event::ToolCallProgress {
            call_id,
            name,
            turn,
            progress,
            total,
            message,
        } => E::ToolCallProgress(pb::ToolCallProgress {
            call_id,
            name,
            turn,
            progress,
            total,
            message,
        }),
        Event::MessageAdded { turn, content, name } => E::MessageAdded(pb::MessageAdded {
            turn,
            message: Some(user_message_pb(content, name)),
        }),
        Event::RunFinished(result) => E::RunFinished(pb::RunFinished {
            result: Some(pb::RunResult::from(&*result)),
        }),
    }
}

/// The events of a call waiting for a person, and of its decision, as proto payloads.
fn person_event_pb(event: Event) -> pb::orchestrate_event::Event {
    use pb::orchestrate_event::Event as E;
    match event {
        Event::ApprovalRequested {
            call_id,
            name,
            arguments_json,
            turn,
            expires_at_unix_ms,
            arguments_truncated,
            in_doubt,
        } => E::ApprovalRequested(pb::ApprovalRequested {
            call_id,
            name,
            arguments_json,
            turn,
            expires_at_unix_ms,
            arguments_truncated,
            in_doubt,
        }),
        Event::ToolInputRequested {
            call_id,
            name,
            turn,
            expires_at_unix_ms,
            requests,
            round,
        } => E::ToolInputRequested(pb::ToolInputRequested {
            call_id,
            requests: requests.iter().map(pb::ToolInputRequest::from).collect(),
            name,
            turn,
            expires_at_unix_ms,
            round,
        }),
        Event::CallDecided {
            call_id,
            name,
            turn,
            decision,
            waited_ms,
        } => E::CallDecided(pb::CallDecided {
            call_id,
            name,
            turn,
            decision: Some(pb::ApprovalDecision::from(&decision)),
            waited_ms,
        }),
        other => event_kind_pb(other),
    }
}

/// The thread a run continues (none: empty), as `RunStarted` shows it.
fn thread_start_pb(thread: Option<&crate::domain::thread::ThreadStart>) -> pb::RunStarted {
    pb::RunStarted {
        thread_id: thread.map(|t| t.thread_id.clone()).unwrap_or_default(),
        thread_turns: thread.map_or(0, |t| t.turns),
        thread_turns_left_out: thread.map_or(0, |t| t.turns_left_out),
        ..Default::default()
    }
}

/// The limits a run started with, as `RunStarted` shows them.
fn limits_pb(limits: &Limits) -> pb::EffectiveLimits {
    pb::EffectiveLimits {
        max_turns: limits.max_turns,
        tool_call_budget: limits.tool_call_budget,
        max_tool_failures: limits.max_tool_failures,
        tool_timeout_ms: millis(limits.tool_timeout),
        run_timeout_ms: millis(limits.run_timeout),
        approval_timeout_ms: millis(limits.approval_timeout),
        max_total_tokens: limits.max_total_tokens,
        input_timeout_ms: millis(limits.input_timeout),
    }
}

/// A user message sent to a live run (`SendMessage`), as `MessageAdded` shows it.
fn user_message_pb(content: String, name: Option<String>) -> pb::ChatMessage {
    pb::ChatMessage {
        role: "user".to_owned(),
        content,
        name: name.unwrap_or_default(),
        ..Default::default()
    }
}

/// A proto event read back (from a run's event log) as a numbered domain event.
impl TryFrom<pb::OrchestrateEvent> for NumberedEvent {
    type Error = Error;

    fn try_from(event: pb::OrchestrateEvent) -> Result<Self, Error> {
        use pb::orchestrate_event::Event as E;
        let empty = || Error::InvalidArgument(format!("event {} carries nothing", event.seq));
        let event_seq = event.seq;
        let domain = match event.event.ok_or_else(empty)? {
            E::RunStarted(e) => {
                let limits = e.limits.unwrap_or_default();
                Event::RunStarted {
                    model: e.model,
                    normal_tools: e.normal_tools,
                    exit_tools: e.exit_tools,
                    limits: Limits {
                        max_turns: limits.max_turns,
                        tool_call_budget: limits.tool_call_budget,
                        max_tool_failures: limits.max_tool_failures,
                        tool_timeout: Duration::from_millis(limits.tool_timeout_ms.into()),
                        run_timeout: Duration::from_millis(limits.run_timeout_ms.into()),
                        approval_timeout: Duration::from_millis(limits.approval_timeout_ms.into()),
                        max_total_tokens: limits.max_total_tokens,
                        input_timeout: Duration::from_millis(limits.input_timeout_ms.into()),
                    },
                    thread: (!e.thread_id.is_empty()).then_some(crate::domain::thread::ThreadStart {
                        thread_id: e.thread_id,
                        turns: e.thread_turns,
                        turns_left_out: e.thread_turns_left_out,
                    }),
                    queued_ms: e.queued_ms,
                }
            }
            E::TextDelta(e) => Event::TextDelta {
                text: e.text,
                turn: e.turn,
            },
            E::ReasoningDelta(e) => Event::ReasoningDelta {
                text: e.text,
                turn: e.turn,
            },
            E::ToolCallStarted(e) => Event::ToolCallStarted {
                call_id: e.call_id,
                name: e.name,
                arguments_json: e.arguments_json,
                turn: e.turn,
                arguments_truncated: e.arguments_truncated,
            },
            E::ToolCallFinished(e) => Event::ToolCallFinished {
                call_id: e.call_id,
                name: e.name,
                content_json: e.ok.then_some(e.content_json),
                content_truncated: e.content_truncated,
                error: e.error.map(|e| ToolCallError::new(&e.code, e.message)),
                duration_ms: e.duration_ms,
            },
            E::Signal(signal) => Event::Signal(Signal::try_from(signal)?),
            E::CallDecided(e) => Event::CallDecided {
                call_id: e.call_id,
                name: e.name,
                turn: e.turn,
                decision: ApprovalDecision::try_from(e.decision.unwrap_or_default())?,
                waited_ms: e.waited_ms,
            },
            E::TurnFinished(e) => {
                let usage = e.usage.unwrap_or_default();
                Event::TurnFinished {
                    turn: e.turn,
                    usage: usage_of(usage),
                    tool_call_budget_remaining: e.tool_call_budget_remaining,
                    failed_turns: e.failed_turns,
                }
            }
            E::TurnRestarted(e) => Event::TurnRestarted {
                turn: e.turn,
                attempt: e.attempt,
                reason: e.reason,
            },
            E::ApprovalRequested(e) => Event::ApprovalRequested {
                call_id: e.call_id,
                name: e.name,
                arguments_json: e.arguments_json,
                turn: e.turn,
                expires_at_unix_ms: e.expires_at_unix_ms,
                arguments_truncated: e.arguments_truncated,
                in_doubt: e.in_doubt,
            },
            E::ToolInputRequested(e) => Event::ToolInputRequested {
                call_id: e.call_id,
                name: e.name,
                turn: e.turn,
                expires_at_unix_ms: e.expires_at_unix_ms,
                requests: e.requests.into_iter().filter_map(input_request_of).collect(),
                round: e.round,
            },
            E::ToolCallProgress(e) => Event::ToolCallProgress {
                call_id: e.call_id,
                name: e.name,
                turn: e.turn,
                progress: e.progress,
                total: e.total,
                message: e.message,
            },
            E::MessageAdded(e) => {
                let message = e.message.unwrap_or_default();
                Event::MessageAdded {
                    turn: e.turn,
                    content: message.content,
                    name: Some(message.name).filter(|n| !n.is_empty()),
                }
            }
            E::RunFinished(e) => Event::RunFinished(Box::new(RunResult::try_from(e.result.unwrap_or_default())?)),
        };
        Ok(NumberedEvent {
            seq: event_seq,
            event: domain,
        })
    }
}

/// A conversation message as the contract's `ChatMessage` (reasoning is the model's, not the
/// conversation's, and stays out).
pub(crate) fn message_pb(message: &crate::domain::chat::Message) -> pb::ChatMessage {
    use crate::domain::chat::Message;
    match message {
        Message::System(content) => pb::ChatMessage {
            role: "system".to_owned(),
            content: content.clone(),
            ..Default::default()
        },
        Message::User { content, name } => pb::ChatMessage {
            role: "user".to_owned(),
            content: content.clone(),
            name: name.clone().unwrap_or_default(),
            ..Default::default()
        },
        Message::Assistant {
            content, tool_calls, ..
        } => pb::ChatMessage {
            role: "assistant".to_owned(),
            content: content.clone(),
            tool_calls: tool_calls
                .iter()
                .map(|c| pb::ToolCall {
                    id: c.id.clone(),
                    name: c.name.clone(),
                    arguments_json: c.arguments.clone(),
                })
                .collect(),
            ..Default::default()
        },
        Message::Tool { tool_call_id, content } => pb::ChatMessage {
            role: "tool".to_owned(),
            content: content.clone(),
            tool_call_id: tool_call_id.clone(),
            ..Default::default()
        },
    }
}

impl From<crate::domain::thread::BusyPolicy> for pb::ThreadBusyPolicy {
    fn from(policy: crate::domain::thread::BusyPolicy) -> Self {
        use crate::domain::thread::BusyPolicy;
        match policy {
            BusyPolicy::Reject => Self::Reject,
            BusyPolicy::Enqueue => Self::Enqueue,
            BusyPolicy::Interrupt => Self::Interrupt,
            BusyPolicy::Rollback => Self::Rollback,
        }
    }
}

impl From<&crate::domain::thread::Thread> for pb::Thread {
    fn from(t: &crate::domain::thread::Thread) -> Self {
        Self {
            thread_id: t.thread_id.clone(),
            principal: t.principal.clone(),
            messages: t.messages().map(message_pb).collect(),
            runs: t
                .runs
                .iter()
                .map(|r| pb::ThreadRun {
                    run_id: r.run_id.clone(),
                    status: pb::RunStatus::from(r.status).into(),
                    messages: u32::try_from(r.messages.len()).unwrap_or(u32::MAX),
                    ended_at_unix_ms: r.ended_at_unix_ms,
                })
                .collect(),
            live_run_id: t.live.clone().unwrap_or_default(),
            waiting_run_ids: t.queue.iter().map(|w| w.run_id.clone()).collect(),
            dropped_turns: t.dropped_turns,
            bytes: t.bytes() as u64,
            created_at_unix_ms: t.created_at_unix_ms,
            updated_at_unix_ms: t.updated_at_unix_ms,
        }
    }
}
