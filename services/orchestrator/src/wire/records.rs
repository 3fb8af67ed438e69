//! Results and what the stores keep as the contract's messages, both ways: a run's result (the
//! run store keeps its proto form), its signals, a run's summary for `ListRuns`, a thread and
//! its messages.

use proto::orchestrator::v1 as pb;

use super::{error_pb, reason_from_wire, reason_to_wire, usage_of, usage_pb};
use crate::Error;
use crate::domain::approval::{ApprovalDecision, PendingApproval};
use crate::domain::{Delivery, RunResult, RunStatus, Signal, ToolCallError};

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

/// A conversation message as the contract's `ChatMessage` (reasoning is the model's, not the
/// conversation's, and stays out).
fn message_pb(message: &crate::domain::chat::Message) -> pb::ChatMessage {
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

/// A time in Unix ms as the proto carries it (int64).
fn unix_ms_pb(ms: u64) -> i64 {
    i64::try_from(ms).unwrap_or(i64::MAX)
}
