//! A run's events as the contract's `OrchestrateEvent`, both ways: what an attached caller is
//! sent, and what the event log keeps and reads back. A rule per group of events: the run's
//! start and end, a tool call's, and a call waiting for a person.

use std::time::Duration;

use proto::orchestrator::v1 as pb;
use proto::orchestrator::v1::orchestrate_event::Event as E;

use super::approvals::input_request_of;
use super::{error_pb, millis, usage_of, usage_pb};
use crate::Error;
use crate::domain::approval::ApprovalDecision;
use crate::domain::thread::ThreadStart;
use crate::domain::{Event, Limits, NumberedEvent, RunResult, Signal, ToolCallError};

/// A numbered domain event as a proto event of `run_id`.
pub(crate) fn event_pb(run_id: &str, seq: u64, event: Event) -> pb::OrchestrateEvent {
    pb::OrchestrateEvent {
        run_id: run_id.to_owned(),
        seq,
        event: Some(event_kind_pb(event)),
    }
}

/// A domain event as the proto event's payload.
fn event_kind_pb(event: Event) -> E {
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
        call @ (Event::ToolCallStarted { .. } | Event::ToolCallFinished { .. } | Event::ToolCallProgress { .. }) => {
            call_event_pb(call)
        }
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
        Event::MessageAdded { turn, content, name } => E::MessageAdded(pb::MessageAdded {
            turn,
            message: Some(user_message_pb(content, name)),
        }),
        Event::RunFinished(result) => E::RunFinished(pb::RunFinished {
            result: Some(pb::RunResult::from(&*result)),
        }),
    }
}

/// A tool call's events (started, its progress, finished) as proto payloads.
fn call_event_pb(event: Event) -> E {
    match event {
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
        other => event_kind_pb(other),
    }
}

/// The events of a call waiting for a person, and of its decision, as proto payloads.
fn person_event_pb(event: Event) -> E {
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
fn thread_start_pb(thread: Option<&ThreadStart>) -> pb::RunStarted {
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
        let seq = event.seq;
        let payload = event
            .event
            .ok_or_else(|| Error::InvalidArgument(format!("event {seq} carries nothing")))?;
        Ok(NumberedEvent {
            seq,
            event: event_of(payload)?,
        })
    }
}

/// A proto event's payload as a domain event.
fn event_of(payload: E) -> Result<Event, Error> {
    Ok(match payload {
        E::RunStarted(e) => run_started_of(e),
        E::TextDelta(e) => Event::TextDelta {
            text: e.text,
            turn: e.turn,
        },
        E::ReasoningDelta(e) => Event::ReasoningDelta {
            text: e.text,
            turn: e.turn,
        },
        call @ (E::ToolCallStarted(_) | E::ToolCallFinished(_) | E::ToolCallProgress(_)) => call_event_of(call)?,
        E::Signal(signal) => Event::Signal(Signal::try_from(signal)?),
        E::TurnFinished(e) => Event::TurnFinished {
            turn: e.turn,
            usage: usage_of(e.usage.unwrap_or_default()),
            tool_call_budget_remaining: e.tool_call_budget_remaining,
            failed_turns: e.failed_turns,
        },
        E::TurnRestarted(e) => Event::TurnRestarted {
            turn: e.turn,
            attempt: e.attempt,
            reason: e.reason,
        },
        person @ (E::ApprovalRequested(_) | E::ToolInputRequested(_) | E::CallDecided(_)) => person_event_of(person)?,
        E::MessageAdded(e) => {
            let message = e.message.unwrap_or_default();
            Event::MessageAdded {
                turn: e.turn,
                content: message.content,
                name: Some(message.name).filter(|n| !n.is_empty()),
            }
        }
        E::RunFinished(e) => Event::RunFinished(Box::new(RunResult::try_from(e.result.unwrap_or_default())?)),
    })
}

/// `RunStarted` read back: the run's model, tools, limits and thread.
fn run_started_of(e: pb::RunStarted) -> Event {
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
        thread: (!e.thread_id.is_empty()).then_some(ThreadStart {
            thread_id: e.thread_id,
            turns: e.thread_turns,
            turns_left_out: e.thread_turns_left_out,
        }),
        queued_ms: e.queued_ms,
    }
}

/// A tool call's events read back.
fn call_event_of(payload: E) -> Result<Event, Error> {
    Ok(match payload {
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
        E::ToolCallProgress(e) => Event::ToolCallProgress {
            call_id: e.call_id,
            name: e.name,
            turn: e.turn,
            progress: e.progress,
            total: e.total,
            message: e.message,
        },
        other => return event_of(other),
    })
}

/// The events of a call waiting for a person, and of its decision, read back.
fn person_event_of(payload: E) -> Result<Event, Error> {
    Ok(match payload {
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
        E::CallDecided(e) => Event::CallDecided {
            call_id: e.call_id,
            name: e.name,
            turn: e.turn,
            decision: ApprovalDecision::try_from(e.decision.unwrap_or_default())?,
            waited_ms: e.waited_ms,
        },
        other => return event_of(other),
    })
}
