//! A request that names an agent (`OrchestrateRequest.agent`): the agent's definition fills the
//! request, and what the request sets besides its messages (and its run id, thread, labels,
//! metadata) must be what the agent lets it override: `INVALID_ARGUMENT` naming the field
//! otherwise. A system message is added after the agent's; parameters and limits replace the
//! agent's field by field; the rest replaces the agent's whole. `ListAgents` answers are made here too.

use proto::orchestrator::v1 as pb;
use shared::auth::Principal;

use super::invalid;
use crate::Error;
use crate::agents::{Agent, Agents, Definition, file};
use crate::domain::agent::{AgentRef, Override};

/// `request` with the definition of the agent it names filled in, and that agent; `request`
/// itself when it names none. `NOT_FOUND` for an agent unknown or not open to `caller`.
pub(crate) fn with_agent(
    mut request: pb::OrchestrateRequest,
    agents: &Agents,
    caller: &Principal,
) -> Result<(pb::OrchestrateRequest, Option<AgentRef>), Error> {
    if request.agent.is_empty() {
        return Ok((request, None));
    }
    let agent = agents.for_caller(&request.agent, caller).ok_or_else(|| {
        Error::NotFound(format!(
            "no agent {:?} that you may use; ListAgents (`orchestrator agents`) lists them",
            request.agent
        ))
    })?;
    let definition = &agent.definition;
    refuse_what_the_agent_keeps(&request, definition)?;
    take_model_and_system(&mut request, definition);
    take_tools(&mut request, definition);
    request.params = Some(params_over(definition, request.params.take().unwrap_or_default()));
    request.limits = Some(limits_over(definition, request.limits.take().unwrap_or_default()));
    if request.on_busy == pb::ThreadBusyPolicy::Unspecified as i32 {
        request.on_busy = definition
            .on_busy
            .map_or(pb::ThreadBusyPolicy::Unspecified, Into::into)
            .into();
    }
    Ok((request, Some(agent.reference())))
}

/// What the request sets that the agent keeps for itself, refused naming the first such field.
fn refuse_what_the_agent_keeps(request: &pb::OrchestrateRequest, definition: &Definition) -> Result<(), Error> {
    let tools = request.tools.clone().unwrap_or_default();
    let set = |what: Override| match what {
        Override::Model => !request.model.is_empty(),
        Override::System => !request.system.is_empty(),
        Override::Tools => !tools.normal.is_empty(),
        Override::ExitTools => !tools.exit.is_empty(),
        Override::Approval => tools
            .approval
            .as_ref()
            .is_some_and(|a| *a != pb::ApprovalPolicy::default()),
        Override::Params => request
            .params
            .as_ref()
            .is_some_and(|p| *p != pb::ModelParams::default()),
        Override::Limits => request.limits.as_ref().is_some_and(|l| *l != pb::RunLimits::default()),
        // A busy policy matters for a run on a thread only, and one the same as the agent's
        // (clients send "reject" by default) takes nothing from it.
        Override::OnBusy => {
            let agents = definition.on_busy.map_or(pb::ThreadBusyPolicy::Reject, Into::into) as i32;
            !request.thread_id.is_empty()
                && request.on_busy != pb::ThreadBusyPolicy::Unspecified as i32
                && request.on_busy != agents
        }
    };
    match Override::ALL
        .into_iter()
        .find(|what| set(*what) && !definition.allows(*what))
    {
        None => Ok(()),
        Some(what) => Err(invalid(format!(
            "agent {:?} does not let a request set {}: leave it out (the agent's is used), or ask for it in the agent's overridable",
            definition.name,
            what.name()
        ))),
    }
}

/// The agent's model unless the request names one; the agent's system message, then the
/// request's.
fn take_model_and_system(request: &mut pb::OrchestrateRequest, definition: &Definition) {
    if request.model.is_empty() {
        request.model = definition.model.clone().unwrap_or_default();
    }
    request.system = match (definition.system.as_str(), request.system.as_str()) {
        (agent, "") => agent.to_owned(),
        ("", own) => own.to_owned(),
        (agent, own) => format!("{agent}\n\n{own}"),
    };
}

/// The agent's normal tools, exit tools and approval rules, each unless the request sets it.
fn take_tools(request: &mut pb::OrchestrateRequest, definition: &Definition) {
    let mut tools = request.tools.take().unwrap_or_default();
    if tools.normal.is_empty() {
        tools.normal = definition.tools.clone().unwrap_or_default();
    }
    if tools.exit.is_empty() {
        tools.exit = definition.exit_tools.iter().map(exit_tool_pb).collect();
    }
    if tools
        .approval
        .as_ref()
        .is_none_or(|a| *a == pb::ApprovalPolicy::default())
    {
        let every = definition.needs_approval.iter().any(|t| t == "*");
        tools.approval = Some(pb::ApprovalPolicy {
            all_normal: every,
            tools: match every {
                true => Vec::new(),
                false => definition.needs_approval.clone(),
            },
            ..Default::default()
        });
    }
    request.tools = Some(tools);
}

fn exit_tool_pb(tool: &file::ExitTool) -> pb::ExitToolSpec {
    pb::ExitToolSpec {
        name: tool.name.clone(),
        description: tool.description.clone(),
        parameters_json_schema: tool.parameters_json_schema.clone(),
    }
}

/// The agent's parameters with the request's set fields over them.
fn params_over(definition: &Definition, own: pb::ModelParams) -> pb::ModelParams {
    let agent = &definition.params;
    pb::ModelParams {
        temperature: own.temperature.or(agent.temperature),
        top_p: own.top_p.or(agent.top_p),
        max_tokens: own.max_tokens.or(agent.max_tokens),
        tool_choice: match own.tool_choice.is_empty() {
            true => agent.tool_choice.clone().unwrap_or_default(),
            false => own.tool_choice.clone(),
        },
        ..own
    }
}

/// The agent's limits with the request's set fields over them.
fn limits_over(definition: &Definition, own: pb::RunLimits) -> pb::RunLimits {
    let agent = &definition.limits;
    pb::RunLimits {
        max_turns: own.max_turns.or(agent.max_turns),
        tool_call_budget: own.tool_call_budget.or(agent.tool_call_budget),
        max_tool_failures: own.max_tool_failures.or(agent.max_tool_failures),
        tool_timeout_ms: own.tool_timeout_ms.or(agent.tool_timeout_ms),
        run_timeout_ms: own.run_timeout_ms.or(agent.run_timeout_ms),
        approval_timeout_ms: own.approval_timeout_ms.or(agent.approval_timeout_ms),
        max_total_tokens: own.max_total_tokens.or(agent.max_total_tokens),
        input_timeout_ms: own.input_timeout_ms.or(agent.input_timeout_ms),
    }
}

/// An agent as `ListAgents` shows it.
pub(crate) fn agent_pb(agent: &Agent) -> pb::Agent {
    let definition = &agent.definition;
    pb::Agent {
        name: definition.name.clone(),
        description: definition.description.clone(),
        version: agent.version.clone(),
        model: definition.model.clone().unwrap_or_default(),
        tools: definition.tools.clone().unwrap_or_default(),
        exit_tools: definition.exit_tools.iter().map(|t| t.name.clone()).collect(),
        needs_approval: definition.needs_approval.clone(),
        overridable: definition.overridable.iter().map(|o| o.name().to_owned()).collect(),
        system: definition.system.clone(),
    }
}

#[cfg(test)]
mod tests;
