//! Proto ↔ domain. Requests become a [`RunRequest`] (`TryFrom`, checks that need nothing else)
//! and then a [`RunSpec`] ([`resolve`], checks against the tool catalog and the server's limits);
//! every failure is an `INVALID_ARGUMENT` naming the field and what to do. Domain results and
//! events become proto messages.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use proto::orchestrator::v1 as pb;

use shared::auth::{LimitCeilings, Principal};

use crate::Error;
use crate::config::{Config, RequestBounds};
use crate::domain::params::parse_extra_body;
use crate::domain::{
    Deadline, Delivery, Event, FailureReason, Limits, ParsePolicy, RunResult, RunSpec, RunStatus, Signal, ToolCallError,
};
use crate::llm::{Message, SamplingParams, ToolCall, ToolChoice, ToolDefinition};
use crate::tool_runners::RemoteTool;

/// Longest caller-supplied run id.
pub(crate) const MAX_RUN_ID_LEN: usize = 128;

/// Limits as the caller asked (unset = server default).
#[derive(Debug, Clone, Default)]
pub(crate) struct RequestedLimits {
    max_turns: Option<u32>,
    tool_call_budget: Option<u32>,
    max_tool_failures: Option<u32>,
    tool_timeout_ms: Option<u32>,
    run_timeout_ms: Option<u32>,
}

/// An `OrchestrateRequest` that passed the checks needing nothing but itself.
#[derive(Debug, Clone)]
pub(crate) struct RunRequest {
    run_id: Option<String>,
    system: String,
    messages: Vec<Message>,
    model: Option<String>,
    params: SamplingParams,
    allowlist: Vec<String>,
    exit_tools: Vec<ToolDefinition>,
    limits: RequestedLimits,
    metadata: BTreeMap<String, String>,
    /// Keep running if the caller goes away.
    pub detached: bool,
    parse_policy: ParsePolicy,
}

fn invalid(message: impl Into<String>) -> Error {
    Error::InvalidArgument(message.into())
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
        Ok(Self {
            run_id: caller_run_id(r.run_id)?,
            system: r.system,
            messages,
            model: Some(r.model).filter(|m| !m.is_empty()),
            params: model_params(r.params.unwrap_or_default())?,
            allowlist: tools.normal,
            exit_tools,
            limits: RequestedLimits {
                max_turns: limits.max_turns,
                tool_call_budget: limits.tool_call_budget,
                max_tool_failures: limits.max_tool_failures,
                tool_timeout_ms: limits.tool_timeout_ms,
                run_timeout_ms: limits.run_timeout_ms,
            },
            metadata: r.metadata.into_iter().collect(),
            detached: r.detached,
            parse_policy: parse_policy(r.parse_policy)?,
        })
    }
}

/// A caller's run id: empty gets a generated one; otherwise short printable ASCII, because it
/// travels in request headers and logs.
fn caller_run_id(id: String) -> Result<Option<String>, Error> {
    if id.is_empty() {
        return Ok(None);
    }
    if id.len() > MAX_RUN_ID_LEN || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(invalid(format!(
            "run_id must be 1-{MAX_RUN_ID_LEN} printable ASCII characters without spaces (or empty to get a generated one)"
        )));
    }
    Ok(Some(id))
}

/// One conversation message by its role; a tool answer must say which call it answers.
fn message(i: usize, m: pb::ChatMessage) -> Result<Message, Error> {
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
fn exit_tool(i: usize, tool: pb::ExitToolSpec) -> Result<ToolDefinition, Error> {
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
        parameters,
    })
}

/// What to do with tool-call arguments that are not valid JSON; an unknown value is refused
/// rather than read as the default.
fn parse_policy(value: i32) -> Result<ParsePolicy, Error> {
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
fn run_params(
    asked: SamplingParams,
    config: &Config,
    normal_tools: &[ToolDefinition],
    exit_tools: &[ToolDefinition],
) -> Result<SamplingParams, Error> {
    let params = asked.or(&config.llm.run_defaults());
    params.check().map_err(|e| invalid(format!("params: {e}")))?;
    if let Some(name) = params.tool_choice.as_ref().and_then(ToolChoice::tool) {
        let offered = normal_tools.iter().chain(exit_tools).any(|t| t.name == name);
        if !offered {
            return Err(invalid(format!(
                "params.tool_choice names {name:?}, which this run does not offer"
            )));
        }
    }
    Ok(params)
}

/// The model parameters of a request, each checked (the error names the field).
fn model_params(p: pb::ModelParams) -> Result<SamplingParams, Error> {
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
    fn check_bounds(&self, bounds: &RequestBounds) -> Result<(), Error> {
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
        Ok(())
    }
}

fn pick<T: PartialOrd + std::fmt::Display + Copy>(
    field: &str,
    asked: Option<T>,
    default: T,
    ceiling: T,
    min: T,
) -> Result<T, Error> {
    let Some(value) = asked else { return Ok(default) };
    if value > ceiling {
        return Err(invalid(format!(
            "limits.{field} = {value} is above this server's maximum of {ceiling}"
        )));
    }
    if value < min {
        return Err(invalid(format!(
            "limits.{field} = {value} is below the minimum of {min}"
        )));
    }
    Ok(value)
}

fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

/// The normal tools of a run: those the request lists (each must exist and be allowed to the
/// caller), or every tool the caller may use.
fn normal_tools(
    allowlist: &[String],
    catalog: &BTreeMap<String, RemoteTool>,
    caller: &Principal,
) -> Result<Vec<ToolDefinition>, Error> {
    let allowed = || catalog.values().filter(|t| caller.may_use(&t.definition.name));
    if allowlist.is_empty() {
        return Ok(allowed().map(|t| t.definition.clone()).collect());
    }
    let mut tools = Vec::with_capacity(allowlist.len());
    for name in allowlist {
        if !caller.may_use(name) {
            return Err(Error::PermissionDenied(format!(
                "tools.normal names {name:?}, which principal {:?} may not use",
                caller.name
            )));
        }
        let tool = catalog.get(name).ok_or_else(|| {
            let known: Vec<&str> = allowed().map(|t| t.definition.name.as_str()).collect();
            invalid(format!(
                "tools.normal names {name:?}, which no tool-runner offers (available: {})",
                if known.is_empty() {
                    "none yet".to_owned()
                } else {
                    known.join(", ")
                }
            ))
        })?;
        tools.push(tool.definition.clone());
    }
    Ok(tools)
}

/// The limits a caller's requests may ask for: the server's ceilings, lowered by the caller's.
fn caller_ceilings(server: Limits, caller: &LimitCeilings) -> Limits {
    fn lower<T: Ord + Copy>(server: T, caller: Option<T>) -> T {
        caller.map_or(server, |c| c.min(server))
    }
    Limits {
        max_turns: lower(server.max_turns, caller.max_turns),
        tool_call_budget: lower(server.tool_call_budget, caller.tool_call_budget),
        max_tool_failures: lower(server.max_tool_failures, caller.max_tool_failures),
        tool_timeout: lower(server.tool_timeout, caller.tool_timeout),
        run_timeout: lower(server.run_timeout, caller.run_timeout),
    }
}

/// Checks the request against the tool catalog, the server's limits and what the caller may do,
/// giving the run's spec. `caller_deadline` is the caller's gRPC deadline, which shortens the
/// run's own.
pub(crate) fn resolve(
    request: RunRequest,
    catalog: &BTreeMap<String, RemoteTool>,
    config: &Config,
    caller: &Principal,
    caller_deadline: Option<Duration>,
    received_at: tokio::time::Instant,
) -> Result<RunSpec, Error> {
    request.check_bounds(&config.runs.request)?;
    let normal_tools = normal_tools(&request.allowlist, catalog, caller)?;
    let exit_tools = run_exit_tools(&config.runs.exit_tools, request.exit_tools, &normal_tools)?;
    let model = request.model.unwrap_or_else(|| config.llm.model.clone());
    if model.is_empty() {
        return Err(invalid(
            "model is empty and the server has no default model (--llm-model)",
        ));
    }
    let params = run_params(request.params, config, &normal_tools, &exit_tools)?;
    let (limits, asked_run_timeout) = run_limits(&request.limits, config, caller, caller_deadline)?;
    Ok(RunSpec {
        run_id: request.run_id.unwrap_or_else(|| uuid::Uuid::now_v7().to_string()),
        system: request.system,
        messages: request.messages,
        model,
        params,
        normal_tools,
        exit_tools,
        limits,
        metadata: request.metadata,
        parse_policy: request.parse_policy,
        deadline: Deadline::new(
            received_at,
            asked_run_timeout,
            caller_deadline,
            config.runs.deadline_headroom,
        ),
        principal: caller.name.clone(),
    })
}

/// The run's exit tools: the server's, then the request's; a name may be defined once, and never
/// be the name of a normal tool the run offers (the model could not tell them apart).
fn run_exit_tools(
    server: &[ToolDefinition],
    requested: Vec<ToolDefinition>,
    normal_tools: &[ToolDefinition],
) -> Result<Vec<ToolDefinition>, Error> {
    let mut exit_tools = server.to_vec();
    for tool in requested {
        if exit_tools.iter().any(|t| t.name == tool.name) {
            return Err(invalid(format!(
                "exit tool {:?} is defined twice (in the request or already by the server)",
                tool.name
            )));
        }
        exit_tools.push(tool);
    }
    let normal_names: HashSet<&str> = normal_tools.iter().map(|t| t.name.as_str()).collect();
    if let Some(clash) = exit_tools.iter().find(|t| normal_names.contains(t.name.as_str())) {
        return Err(invalid(format!(
            "exit tool {:?} has the name of a normal tool; rename it, or leave the normal tool out of tools.normal",
            clash.name
        )));
    }
    Ok(exit_tools)
}

/// The run's limits: each as asked, else the default, never over the ceiling (the server's,
/// lowered by the caller's own); the run timeout is also cut to the caller's gRPC deadline.
/// Returns the limits and the run timeout as asked (before that cut).
fn run_limits(
    asked: &RequestedLimits,
    config: &Config,
    caller: &Principal,
    caller_deadline: Option<Duration>,
) -> Result<(Limits, Duration), Error> {
    let c = &caller_ceilings(config.limits.ceilings(), &caller.limits);
    let d = &caller_ceilings(config.limits.defaults(), &caller.limits);
    let ms = |name, asked, default, ceiling| {
        pick(name, asked, millis(default), millis(ceiling), 1).map(|ms| Duration::from_millis(u64::from(ms)))
    };
    let tool_timeout = ms("tool_timeout_ms", asked.tool_timeout_ms, d.tool_timeout, c.tool_timeout)?;
    let asked_run_timeout = ms("run_timeout_ms", asked.run_timeout_ms, d.run_timeout, c.run_timeout)?;
    let run_timeout = caller_deadline.map_or(asked_run_timeout, |deadline| asked_run_timeout.min(deadline));
    let limits = Limits {
        max_turns: pick("max_turns", asked.max_turns, d.max_turns, c.max_turns, 1)?,
        tool_call_budget: pick(
            "tool_call_budget",
            asked.tool_call_budget,
            d.tool_call_budget,
            c.tool_call_budget,
            0,
        )?,
        max_tool_failures: pick(
            "max_tool_failures",
            asked.max_tool_failures,
            d.max_tool_failures,
            c.max_tool_failures,
            0,
        )?,
        tool_timeout,
        run_timeout,
    };
    Ok((limits, asked_run_timeout))
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

one_to_one!(RunStatus <=> RunStatus, unspecified: Unspecified, [Running, Completed, Failed, Canceled]);
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
]);

/// A run's failure reason on the wire: `UNSPECIFIED` is "did not fail".
fn reason_from_wire(value: i32) -> Result<Option<FailureReason>, Error> {
    if value == pb::FailureReason::Unspecified as i32 {
        return Ok(None);
    }
    FailureReason::from_wire(value).map(Some)
}

fn reason_to_wire(reason: Option<FailureReason>) -> i32 {
    reason
        .map_or(pb::FailureReason::Unspecified, pb::FailureReason::from)
        .into()
}

fn error_pb(e: &ToolCallError) -> pb::ToolCallError {
    pb::ToolCallError {
        code: e.code.clone(),
        message: e.message.clone(),
    }
}

fn usage_pb(u: crate::llm::Usage) -> pb::Usage {
    pb::Usage {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
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
                .map(|c| crate::domain::ToolCallRecord {
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
                .collect(),
            failed_turns: r.failed_turns,
            usage: crate::llm::Usage {
                prompt_tokens: usage.prompt_tokens,
                completion_tokens: usage.completion_tokens,
            },
            finish_reason: r.finish_reason,
            principal: r.principal,
            reasoning: r.reasoning,
            reasoning_truncated: r.reasoning_truncated,
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
                })
                .collect(),
            failed_turns: r.failed_turns,
            usage: Some(usage_pb(r.usage)),
            finish_reason: r.finish_reason.clone(),
            principal: r.principal.clone(),
            reasoning: r.reasoning.clone(),
            reasoning_truncated: r.reasoning_truncated,
        }
    }
}

/// A numbered domain event as a proto event of `run_id`.
pub(crate) fn event_pb(run_id: &str, seq: u64, event: Event) -> pb::OrchestrateEvent {
    use pb::orchestrate_event::Event as E;
    let event = match event {
        Event::RunStarted {
            model,
            normal_tools,
            exit_tools,
            limits,
        } => E::RunStarted(pb::RunStarted {
            model,
            normal_tools,
            exit_tools,
            limits: Some(pb::EffectiveLimits {
                max_turns: limits.max_turns,
                tool_call_budget: limits.tool_call_budget,
                max_tool_failures: limits.max_tool_failures,
                tool_timeout_ms: millis(limits.tool_timeout),
                run_timeout_ms: millis(limits.run_timeout),
            }),
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
        Event::RunFinished(result) => E::RunFinished(pb::RunFinished {
            result: Some(pb::RunResult::from(&result)),
        }),
    };
    pb::OrchestrateEvent {
        run_id: run_id.to_owned(),
        seq,
        event: Some(event),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog(names: &[&str]) -> BTreeMap<String, RemoteTool> {
        names
            .iter()
            .map(|n| {
                let definition = ToolDefinition {
                    name: (*n).to_owned(),
                    description: String::new(),
                    parameters: serde_json::json!({"type": "object"}),
                };
                (
                    (*n).to_owned(),
                    RemoteTool {
                        definition,
                        timeout: Duration::from_secs(1),
                    },
                )
            })
            .collect()
    }

    #[test]
    fn a_principal_gets_only_its_tools_and_its_ceilings() {
        let catalog = catalog(&["calculate", "sleep", "time_now"]);
        let alice = Principal {
            tools: Some(vec!["calc*".into(), "time_*".into()]),
            limits: LimitCeilings {
                max_turns: Some(4),
                run_timeout: Some(Duration::from_secs(10)),
                ..LimitCeilings::default()
            },
            ..Principal::unrestricted("alice")
        };
        let names = |tools: Vec<ToolDefinition>| tools.into_iter().map(|t| t.name).collect::<Vec<_>>();
        assert_eq!(
            names(normal_tools(&[], &catalog, &alice).unwrap()),
            ["calculate", "time_now"]
        );
        assert_eq!(
            names(normal_tools(&["calculate".into()], &catalog, &alice).unwrap()),
            ["calculate"]
        );
        let denied = normal_tools(&["sleep".into()], &catalog, &alice).unwrap_err();
        assert_eq!(tonic::Status::from(denied).code(), tonic::Code::PermissionDenied);
        // An unknown tool the principal may not use is denied too: the catalog is not revealed.
        let unknown = normal_tools(&["secret_tool".into()], &catalog, &alice).unwrap_err();
        assert_eq!(tonic::Status::from(unknown).code(), tonic::Code::PermissionDenied);
        let missing = normal_tools(&["calcx".into()], &catalog, &alice)
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("calculate, time_now") && !missing.contains("sleep"),
            "{missing}"
        );

        let server = Limits {
            max_turns: 16,
            tool_call_budget: 64,
            max_tool_failures: 3,
            tool_timeout: Duration::from_secs(30),
            run_timeout: Duration::from_secs(600),
        };
        let lowered = caller_ceilings(server, &alice.limits);
        assert_eq!((lowered.max_turns, lowered.run_timeout), (4, Duration::from_secs(10)));
        assert_eq!(
            (lowered.tool_call_budget, lowered.tool_timeout),
            (64, Duration::from_secs(30))
        );
        // A principal's ceiling above the server's does not raise it.
        let generous = LimitCeilings {
            max_turns: Some(1000),
            ..LimitCeilings::default()
        };
        assert_eq!(caller_ceilings(server, &generous).max_turns, 16);
    }

    /// Every value of every enum the store persists survives the trip through proto, and every
    /// proto value but UNSPECIFIED has a domain value.
    #[test]
    fn every_enum_value_round_trips() {
        for &status in RunStatus::ALL {
            assert_eq!(
                RunStatus::from_wire(pb::RunStatus::from(status) as i32).ok(),
                Some(status)
            );
        }
        for &delivery in Delivery::ALL {
            assert_eq!(
                Delivery::from_wire(pb::SignalDelivery::from(delivery) as i32).ok(),
                Some(delivery)
            );
        }
        for &reason in FailureReason::ALL {
            assert_eq!(reason_from_wire(reason_to_wire(Some(reason))).ok(), Some(Some(reason)));
        }
        assert_eq!(reason_from_wire(reason_to_wire(None)).ok(), Some(None));
        for wire in 1..=64 {
            assert_eq!(
                RunStatus::from_wire(wire).is_ok(),
                pb::RunStatus::try_from(wire).is_ok()
            );
            assert_eq!(
                Delivery::from_wire(wire).is_ok(),
                pb::SignalDelivery::try_from(wire).is_ok()
            );
            assert_eq!(
                FailureReason::from_wire(wire).is_ok(),
                pb::FailureReason::try_from(wire).is_ok()
            );
        }
        assert_eq!(
            (RunStatus::ALL.len(), Delivery::ALL.len(), FailureReason::ALL.len()),
            (4, 3, 12),
            "the lists are the enums"
        );
    }

    #[test]
    fn unknown_and_unspecified_values_are_errors_not_defaults() {
        let error = RunStatus::from_wire(0).unwrap_err().to_string();
        assert!(error.contains("RunStatus") && error.contains('0'), "{error}");
        assert!(Delivery::from_wire(99).is_err());
        assert!(reason_from_wire(99).is_err());
        let mut stored = pb::RunResult::from(&RunResult::running("r"));
        stored.signals.push(pb::Signal {
            delivery: 42,
            ..Default::default()
        });
        assert!(RunResult::try_from(stored).is_err());
    }

    #[test]
    fn a_result_round_trips_with_every_status_and_reason() {
        for &status in RunStatus::ALL {
            for reason in FailureReason::ALL.iter().copied().map(Some).chain([None]) {
                let mut result = RunResult::running("r");
                result.status = status;
                result.failure_reason = reason;
                result.signals.push(Signal {
                    run_id: "r".into(),
                    call_id: "c".into(),
                    tool_name: "done".into(),
                    arguments_json: "{}".into(),
                    arguments_valid: true,
                    turn: 1,
                    emitted_at_unix_ms: 1,
                    metadata: Default::default(),
                    delivery: Delivery::Undelivered,
                    principal: "billing".into(),
                });
                let back = RunResult::try_from(pb::RunResult::from(&result)).ok();
                assert_eq!(back.as_ref(), Some(&result));
            }
        }
    }

    #[test]
    fn grpc_timeouts() {
        assert_eq!(parse_grpc_timeout("100m"), Some(Duration::from_millis(100)));
        assert_eq!(parse_grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_grpc_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse_grpc_timeout("x"), None);
        assert_eq!(parse_grpc_timeout(""), None);
    }
}
