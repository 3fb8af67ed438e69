use std::io::Write;

use super::*;

const AGENTS: &str = r#"
[[agent]]
name = "refunds"
model = "refund-model"
system = "You handle refunds."
tools = ["lookup_order", "refund"]
needs_approval = ["refund"]
on_busy = "enqueue"
overridable = ["params", "system"]
exit_tools = [{ name = "submit_report", description = "File the report" }]
[agent.params]
temperature = 0.2
max_tokens = 300
[agent.limits]
max_turns = 4
run_timeout_ms = 60000

[[agent]]
name = "careful"
needs_approval = ["*"]
overridable = ["model", "system", "tools", "exit_tools", "approval", "params", "limits", "on_busy"]
"#;

fn agents() -> (tempfile::NamedTempFile, Agents) {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(AGENTS.as_bytes()).unwrap();
    let agents = Agents::load(Some(file.path())).unwrap();
    (file, agents)
}

fn naming(agent: &str) -> pb::OrchestrateRequest {
    pb::OrchestrateRequest {
        agent: agent.into(),
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "refund order 7".into(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

#[test]
fn the_agents_definition_fills_the_request() {
    let (_file, agents) = agents();
    let (request, agent) = with_agent(naming("refunds"), &agents, &Principal::anonymous()).unwrap();
    let agent = agent.unwrap();
    assert_eq!(agent.name, "refunds");
    assert_eq!(request.model, "refund-model");
    assert_eq!(request.system, "You handle refunds.");
    let tools = request.tools.unwrap();
    assert_eq!(tools.normal, ["lookup_order", "refund"]);
    assert_eq!(tools.exit[0].name, "submit_report");
    assert_eq!(tools.approval.unwrap().tools, ["refund"]);
    let (params, limits) = (request.params.unwrap(), request.limits.unwrap());
    assert_eq!((params.temperature, params.max_tokens), (Some(0.2), Some(300)));
    assert_eq!(
        (limits.max_turns, limits.run_timeout_ms, limits.tool_call_budget),
        (Some(4), Some(60_000), None)
    );
    assert_eq!(request.on_busy, pb::ThreadBusyPolicy::Enqueue as i32);
    assert_eq!(
        request.messages[0].content, "refund order 7",
        "the request's messages stay"
    );
}

#[test]
fn a_request_overrides_only_what_the_agent_allows() {
    let (_file, agents) = agents();
    let anyone = Principal::anonymous();
    let own = pb::OrchestrateRequest {
        system: "Be brief.".into(),
        params: Some(pb::ModelParams {
            max_tokens: Some(50),
            ..Default::default()
        }),
        ..naming("refunds")
    };
    let (request, _) = with_agent(own, &agents, &anyone).unwrap();
    assert_eq!(
        request.system, "You handle refunds.\n\nBe brief.",
        "added after the agent's"
    );
    let params = request.params.unwrap();
    assert_eq!(
        (params.temperature, params.max_tokens),
        (Some(0.2), Some(50)),
        "field by field"
    );

    for (what, request) in [
        (
            "model",
            pb::OrchestrateRequest {
                model: "other".into(),
                ..naming("refunds")
            },
        ),
        (
            "tools",
            pb::OrchestrateRequest {
                tools: Some(pb::ToolSelection {
                    normal: vec!["http_get".into()],
                    ..Default::default()
                }),
                ..naming("refunds")
            },
        ),
        (
            "approval",
            pb::OrchestrateRequest {
                tools: Some(pb::ToolSelection {
                    approval: Some(pb::ApprovalPolicy {
                        pause_deadline: true,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..naming("refunds")
            },
        ),
        (
            "limits",
            pb::OrchestrateRequest {
                limits: Some(pb::RunLimits {
                    max_turns: Some(40),
                    ..Default::default()
                }),
                ..naming("refunds")
            },
        ),
        (
            "on_busy",
            pb::OrchestrateRequest {
                on_busy: pb::ThreadBusyPolicy::Rollback.into(),
                thread_id: "t-1".into(),
                ..naming("refunds")
            },
        ),
    ] {
        let refused = with_agent(request, &agents, &anyone)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            refused.contains(&format!("agent \"refunds\" does not let a request set {what}")),
            "{what}: {refused}"
        );
    }
    // A busy policy without a thread, or the agent's own, sets nothing.
    for (on_busy, thread) in [
        (pb::ThreadBusyPolicy::Rollback, ""),
        (pb::ThreadBusyPolicy::Enqueue, "t-1"),
    ] {
        let same = pb::OrchestrateRequest {
            on_busy: on_busy.into(),
            thread_id: thread.into(),
            ..naming("refunds")
        };
        assert!(with_agent(same, &agents, &anyone).is_ok(), "{on_busy:?} {thread:?}");
    }
    let (request, _) = with_agent(
        pb::OrchestrateRequest {
            model: "other".into(),
            ..naming("careful")
        },
        &agents,
        &anyone,
    )
    .unwrap();
    assert_eq!(request.model, "other");
    assert!(
        request.tools.unwrap().approval.unwrap().all_normal,
        "needs_approval = [\"*\"]"
    );
}

#[test]
fn an_unknown_agent_is_not_found_and_a_request_naming_none_stays_as_it_is() {
    let (_file, agents) = agents();
    let unknown = with_agent(naming("nobody"), &agents, &Principal::anonymous()).err();
    assert!(matches!(unknown, Some(Error::NotFound(_))), "{unknown:?}");
    let (request, agent) = with_agent(pb::OrchestrateRequest::default(), &agents, &Principal::anonymous()).unwrap();
    assert_eq!(
        (request, agent),
        (pb::OrchestrateRequest::default(), None),
        "no agent: the request as it is"
    );
}
