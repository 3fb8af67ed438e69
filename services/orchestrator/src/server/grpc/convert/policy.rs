//! Policy resolution: a [`RunRequest`] checked against the tool catalog, the server's limits and
//! what the caller may do becomes the run's [`RunSpec`] (defaults applied, ceilings enforced).

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use shared::auth::{LimitCeilings, Principal};

use super::request::{RequestedApproval, RequestedLimits, RunRequest};
use super::{invalid, millis};
use crate::Error;
use crate::config::Config;
use crate::domain::approval::ApprovalRules;
use crate::domain::chat::ToolDefinition;
use crate::domain::params::{SamplingParams, ToolChoice};
use crate::domain::{Deadline, Limits, RunSpec};
use crate::tool_runners::RemoteTool;

pub(super) fn run_params(
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
pub(super) fn pick<T: PartialOrd + std::fmt::Display + Copy>(
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

/// The normal tools of a run: those the request lists (each must exist and be allowed to the
/// caller), or every tool the caller may use.
pub(super) fn normal_tools(
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
pub(super) fn caller_ceilings(server: Limits, caller: &LimitCeilings) -> Limits {
    fn lower<T: Ord + Copy>(server: T, caller: Option<T>) -> T {
        caller.map_or(server, |c| c.min(server))
    }
    Limits {
        max_turns: lower(server.max_turns, caller.max_turns),
        tool_call_budget: lower(server.tool_call_budget, caller.tool_call_budget),
        max_tool_failures: lower(server.max_tool_failures, caller.max_tool_failures),
        tool_timeout: lower(server.tool_timeout, caller.tool_timeout),
        run_timeout: lower(server.run_timeout, caller.run_timeout),
        approval_timeout: server.approval_timeout,
        input_timeout: server.input_timeout,
        max_total_tokens: lower(server.max_total_tokens, caller.max_total_tokens),
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
    let stream_interval = stream_interval(request.stream_interval_ms, config)?;
    let approval = approval_rules(
        &request.approval,
        &normal_tools,
        catalog,
        config,
        limits.approval_timeout,
    )?;
    let run_id = request.run_id.unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
    Ok(RunSpec {
        // A thread's runs share its transcript, so they go to one endpoint by default too.
        affinity_key: request
            .affinity_key
            .or_else(|| request.thread.as_ref().map(|t| t.thread_id.clone()))
            .unwrap_or_else(|| run_id.clone()),
        eager_dispatch: request.eager_tool_dispatch.unwrap_or(config.runs.eager_tool_dispatch),
        run_id,
        system: request.system,
        messages: request.messages,
        model,
        params,
        normal_tools,
        exit_tools,
        limits,
        metadata: request.metadata,
        labels: request.labels,
        hourly_budget: caller
            .tokens_per_hour
            .map(|tokens_per_hour| crate::domain::usage::HourlyBudget { tokens_per_hour }),
        queued_ms: 0,
        parse_policy: request.parse_policy,
        deadline: Deadline::new(
            received_at,
            asked_run_timeout,
            caller_deadline,
            config.runs.deadline_headroom,
        ),
        principal: caller.name.clone(),
        max_runs: None,
        stream_interval,
        approval,
        thread: request.thread.map(Box::new),
        // The gRPC handler records the agent the request named (see `with_agent`).
        agent: None,
        // `Core::admit` records them, as the request is when it comes in.
        request_digests: std::collections::BTreeMap::new(),
    })
}

/// Which of the run's normal tools wait for approval: those the runners mark, those the server
/// names (`--approval-tool`, globs) and those the request adds; a request names only tools of
/// the run, and removes none.
fn approval_rules(
    asked: &RequestedApproval,
    normal_tools: &[ToolDefinition],
    catalog: &BTreeMap<String, RemoteTool>,
    config: &Config,
    timeout: Duration,
) -> Result<ApprovalRules, Error> {
    for name in &asked.tools {
        if !normal_tools.iter().any(|t| &t.name == name) {
            return Err(invalid(format!(
                "tools.approval.tools names {name:?}, which is not a normal tool of this run"
            )));
        }
    }
    let server = &config.runs.approval_tools;
    let tools = normal_tools
        .iter()
        .map(|t| t.name.as_str())
        .filter(|name| {
            asked.all_normal
                || asked.tools.iter().any(|t| t == name)
                || catalog.get(*name).is_some_and(|t| t.needs_approval)
                || server.iter().any(|pattern| shared::auth::glob_match(pattern, name))
        })
        .map(str::to_owned)
        .collect();
    Ok(ApprovalRules {
        tools,
        timeout,
        on_timeout: asked.on_timeout,
        pause_deadline: asked.pause_deadline,
    })
}

/// The run's stream interval: as asked, else the server's, never over the ceiling.
fn stream_interval(asked_ms: Option<u32>, config: &Config) -> Result<Duration, Error> {
    let runs = &config.runs;
    let Some(ms) = asked_ms else {
        return Ok(runs.stream_interval);
    };
    let asked = Duration::from_millis(u64::from(ms));
    if asked > runs.stream_interval_ceiling {
        return Err(invalid(format!(
            "params.stream_interval_ms = {ms} is above this server's maximum of {}",
            millis(runs.stream_interval_ceiling)
        )));
    }
    Ok(asked)
}

/// The run's exit tools: the server's, then the request's; a name may be defined once, and never
/// be the name of a normal tool the run offers (the model could not tell them apart).
pub(super) fn run_exit_tools(
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
pub(super) fn run_limits(
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
        approval_timeout: ms(
            "approval_timeout_ms",
            asked.approval_timeout_ms,
            d.approval_timeout,
            c.approval_timeout,
        )?,
        input_timeout: ms(
            "input_timeout_ms",
            asked.input_timeout_ms,
            d.input_timeout,
            c.input_timeout,
        )?,
        max_total_tokens: pick(
            "max_total_tokens",
            asked.max_total_tokens,
            d.max_total_tokens,
            c.max_total_tokens,
            1,
        )?,
    };
    Ok((limits, asked_run_timeout))
}
