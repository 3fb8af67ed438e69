//! Request checks that need nothing but the request: an `OrchestrateRequest` becomes a
//! [`RunRequest`] or an `INVALID_ARGUMENT` naming the field and what to do.

use std::collections::BTreeMap;

use proto::orchestrator::v1 as pb;

use super::invalid;
use crate::Error;
use crate::config::RequestBounds;
use crate::domain::ParsePolicy;
use crate::domain::chat::{Message, ToolCall, ToolDefinition};
use crate::domain::ids;
use crate::domain::params::parse_extra_body;
use crate::domain::params::{SamplingParams, ToolChoice};
use crate::domain::thread::{BusyPolicy, RunThread};

/// Limits as the caller asked (unset = server default).
#[derive(Debug, Clone, Default)]
pub(crate) struct RequestedLimits {
    pub(super) max_turns: Option<u32>,
    pub(super) tool_call_budget: Option<u32>,
    pub(super) max_tool_failures: Option<u32>,
    pub(super) tool_timeout_ms: Option<u32>,
    pub(super) run_timeout_ms: Option<u32>,
    pub(super) approval_timeout_ms: Option<u32>,
    pub(super) max_total_tokens: Option<u64>,
    pub(super) input_timeout_ms: Option<u32>,
}

/// The request's approval policy as asked (checked against the run's tools later).
#[derive(Debug, Clone, Default)]
pub(crate) struct RequestedApproval {
    pub(super) all_normal: bool,
    pub(super) tools: Vec<String>,
    pub(super) on_timeout: crate::domain::approval::OnTimeout,
    pub(super) pause_deadline: bool,
}

/// An `OrchestrateRequest` that passed the checks needing nothing but itself.
#[derive(Debug, Clone)]
pub(crate) struct RunRequest {
    pub(super) run_id: Option<String>,
    pub(super) system: String,
    pub(super) messages: Vec<Message>,
    pub(super) model: Option<String>,
    pub(super) params: SamplingParams,
    pub(super) stream_interval_ms: Option<u32>,
    pub(super) allowlist: Vec<String>,
    pub(super) exit_tools: Vec<ToolDefinition>,
    pub(super) approval: RequestedApproval,
    pub(super) limits: RequestedLimits,
    pub(super) metadata: BTreeMap<String, String>,
    pub(super) labels: BTreeMap<String, String>,
    /// Keep running if the caller goes away.
    pub detached: bool,
    pub(super) parse_policy: ParsePolicy,
    pub(super) affinity_key: Option<String>,
    pub(super) eager_tool_dispatch: Option<bool>,
    pub(super) thread: Option<RunThread>,
}

impl TryFrom<pb::OrchestrateRequest> for RunRequest {
    type Error = Error;

    fn try_from(r: pb::OrchestrateRequest) -> Result<Self, Error> {
        let messages = r
            .messages
            .into_iter()
            .enumerate()
            .map(|(i, m)| message(i, m))
            .collect::<Result<Vec<_>, _>>()?;
        if !messages.iter().any(|m| matches!(m, Message::User { .. })) {
            return Err(invalid("messages must contain at least one message with role \"user\""));
        }
        let tools = r.tools.unwrap_or_default();
        let exit_tools = tools
            .exit
            .into_iter()
            .enumerate()
            .map(|(i, tool)| exit_tool(i, tool))
            .collect::<Result<Vec<_>, _>>()?;
        let limits = r.limits.unwrap_or_default();
        let params = r.params.unwrap_or_default();
        let approval = approval(tools.approval.unwrap_or_default())?;
        Ok(Self {
            run_id: caller_run_id(r.run_id)?,
            system: r.system,
            messages,
            model: Some(r.model).filter(|m| !m.is_empty()),
            stream_interval_ms: params.stream_interval_ms,
            params: model_params(params)?,
            allowlist: tools.normal,
            exit_tools,
            approval,
            limits: RequestedLimits {
                max_turns: limits.max_turns,
                tool_call_budget: limits.tool_call_budget,
                max_tool_failures: limits.max_tool_failures,
                tool_timeout_ms: limits.tool_timeout_ms,
                run_timeout_ms: limits.run_timeout_ms,
                approval_timeout_ms: limits.approval_timeout_ms,
                max_total_tokens: limits.max_total_tokens,
                input_timeout_ms: limits.input_timeout_ms,
            },
            metadata: r.metadata.into_iter().collect(),
            labels: r.labels.into_iter().collect(),
            detached: r.detached,
            parse_policy: parse_policy(r.parse_policy)?,
            affinity_key: affinity_key(r.affinity_key)?,
            eager_tool_dispatch: r.eager_tool_dispatch,
            thread: thread(r.thread_id, r.on_busy, r.thread_history)?,
        })
    }
}

/// A caller's run id: empty gets a generated one; otherwise short printable ASCII, because it
/// travels in request headers and logs.
pub(super) fn caller_run_id(id: String) -> Result<Option<String>, Error> {
    if id.is_empty() {
        return Ok(None);
    }
    ids::check("run_id", &id).map_err(|e| invalid(format!("{e} (or empty to get a generated one)")))?;
    Ok(Some(id))
}

/// The thread a request continues: its id checked as a run id is, its busy policy known.
fn thread(thread_id: String, on_busy: i32, window: Option<u32>) -> Result<Option<RunThread>, Error> {
    let on_busy = pb::ThreadBusyPolicy::try_from(on_busy)
        .map(BusyPolicy::from)
        .map_err(|_| {
            let known: Vec<String> = BusyPolicy::ALL.iter().map(|p| p.name().to_uppercase()).collect();
            invalid(format!(
                "on_busy = {on_busy} is not a ThreadBusyPolicy ({})",
                known.join(", ")
            ))
        })?;
    if thread_id.is_empty() {
        if on_busy != BusyPolicy::Reject || window.is_some() {
            return Err(invalid("on_busy and thread_history need a thread_id"));
        }
        return Ok(None);
    }
    ids::check("thread_id", &thread_id).map_err(|e| invalid(format!("{e} (or empty for no thread)")))?;
    Ok(Some(RunThread {
        thread_id,
        on_busy,
        window,
        ..RunThread::default()
    }))
}

/// A caller's affinity key: empty means the run id; otherwise as short and printable as a run id.
fn affinity_key(key: String) -> Result<Option<String>, Error> {
    if key.is_empty() {
        return Ok(None);
    }
    ids::check("affinity_key", &key).map_err(|e| invalid(format!("{e} (or empty for the run id)")))?;
    Ok(Some(key))
}

/// One conversation message by its role; a tool answer must say which call it answers.
pub(super) fn message(i: usize, m: pb::ChatMessage) -> Result<Message, Error> {
    Ok(match m.role.as_str() {
        "system" => Message::System(m.content),
        "user" => Message::User {
            content: m.content,
            name: Some(m.name).filter(|n| !n.is_empty()),
        },
        "assistant" => Message::Assistant {
            content: m.content,
            tool_calls: m
                .tool_calls
                .into_iter()
                .map(|c| ToolCall {
                    id: c.id,
                    name: c.name,
                    arguments: c.arguments_json,
                })
                .collect(),
            reasoning: None,
        },
        "tool" if !m.tool_call_id.is_empty() => Message::Tool {
            tool_call_id: m.tool_call_id,
            content: m.content,
        },
        "tool" => return Err(invalid(format!("messages[{i}] has role \"tool\" but no tool_call_id"))),
        other => {
            return Err(invalid(format!(
                "messages[{i}] has role {other:?}; use \"system\", \"user\", \"assistant\" or \"tool\""
            )));
        }
    })
}

/// An exit tool the caller declares: a valid name, a usable JSON Schema (an empty one means any
/// object) and a description the model sees (a default one says it is a one-way signal).
pub(super) fn exit_tool(i: usize, tool: pb::ExitToolSpec) -> Result<ToolDefinition, Error> {
    if !shared::tools::valid_tool_name(&tool.name) {
        return Err(invalid(format!(
            "tools.exit[{i}].name {:?} must be 1-64 letters, digits, '_' or '-'",
            tool.name
        )));
    }
    let parameters = if tool.parameters_json_schema.trim().is_empty() {
        serde_json::json!({"type": "object"})
    } else {
        serde_json::from_str(&tool.parameters_json_schema).map_err(|e| {
            invalid(format!(
                "tools.exit[{i}] ({}): parameters_json_schema is not valid JSON: {e}",
                tool.name
            ))
        })?
    };
    shared::tools::check_schema(&parameters).map_err(|e| invalid(format!("tools.exit[{i}] ({}): {e}", tool.name)))?;
    let description = if tool.description.trim().is_empty() {
        format!("Signal {} (one-way; nothing comes back).", tool.name)
    } else {
        tool.description
    };
    Ok(ToolDefinition {
        name: tool.name,
        description,
        parameters: parameters.into(),
    })
}

/// The request's approval policy; an unknown timeout action is refused rather than read as the
/// default.
fn approval(a: pb::ApprovalPolicy) -> Result<RequestedApproval, Error> {
    use crate::domain::approval::OnTimeout;
    let on_timeout = match pb::ApprovalTimeoutAction::try_from(a.on_timeout) {
        Ok(pb::ApprovalTimeoutAction::FailRun) => OnTimeout::FailRun,
        Ok(_) => OnTimeout::Reject,
        Err(_) => {
            return Err(invalid(format!(
                "tools.approval.on_timeout {} is not a known ApprovalTimeoutAction value",
                a.on_timeout
            )));
        }
    };
    Ok(RequestedApproval {
        all_normal: a.all_normal,
        tools: a.tools,
        on_timeout,
        pause_deadline: a.pause_deadline,
    })
}

/// What to do with tool-call arguments that are not valid JSON; an unknown value is refused
/// rather than read as the default.
pub(super) fn parse_policy(value: i32) -> Result<ParsePolicy, Error> {
    match pb::ParsePolicy::try_from(value) {
        Ok(pb::ParsePolicy::FeedBack) => Ok(ParsePolicy::FeedBack),
        Ok(_) => Ok(ParsePolicy::Fail),
        Err(_) => Err(invalid(format!(
            "parse_policy {value} is not a known ParsePolicy value"
        ))),
    }
}

/// The run's model parameters: the request's, then the server's defaults (`--llm-*`), checked
/// together; a `tool_choice` naming a tool must name one the run offers.
pub(super) fn model_params(p: pb::ModelParams) -> Result<SamplingParams, Error> {
    let text = |s: String| Some(s).filter(|s| !s.trim().is_empty());
    let params = SamplingParams {
        temperature: p.temperature,
        top_p: p.top_p,
        max_tokens: p.max_tokens,
        stop: p.stop,
        seed: p.seed,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        tool_choice: text(p.tool_choice)
            .map(|c| c.parse::<ToolChoice>())
            .transpose()
            .map_err(|e| invalid(format!("params.{e}")))?,
        parallel_tool_calls: p.parallel_tool_calls,
        reasoning_effort: text(p.reasoning_effort),
        extra_body: parse_extra_body(&p.extra_body_json).map_err(|e| invalid(format!("params.extra_body_json {e}")))?,
    };
    params.check().map_err(|e| invalid(format!("params: {e}")))?;
    Ok(params)
}

impl RunRequest {
    /// The counts this server accepts (the byte size was checked by the gRPC server).
    pub(super) fn check_bounds(&self, bounds: &RequestBounds) -> Result<(), Error> {
        let over = |field: &str, count: usize, max: usize, unit: &str| {
            invalid(format!("{field} has {count} {unit}; this server accepts at most {max}"))
        };
        if self.messages.len() > bounds.max_messages {
            return Err(over("messages", self.messages.len(), bounds.max_messages, "entries"));
        }
        if self.exit_tools.len() > bounds.max_request_exit_tools {
            let count = self.exit_tools.len();
            return Err(over("tools.exit", count, bounds.max_request_exit_tools, "entries"));
        }
        if self.metadata.len() > bounds.max_metadata_entries {
            let count = self.metadata.len();
            return Err(over("metadata", count, bounds.max_metadata_entries, "entries"));
        }
        let bytes: usize = self.metadata.iter().map(|(k, v)| k.len() + v.len()).sum();
        if bytes > bounds.max_metadata_bytes {
            return Err(over(
                "metadata",
                bytes,
                bounds.max_metadata_bytes,
                "bytes of keys and values",
            ));
        }
        crate::domain::listing::check_labels(&self.labels, bounds.max_labels, bounds.max_label_bytes)
            .map_err(|e| invalid(format!("labels: {e}")))
    }
}
