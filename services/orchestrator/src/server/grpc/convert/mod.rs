//! The requests read against the server's settings, for the gRPC handlers. An `Orchestrate`
//! request becomes a [`RunRequest`] (`TryFrom`, checks that need nothing else, in [`request`])
//! and then a [`RunSpec`] ([`resolve`], checks against the tool catalog and the server's limits,
//! in [`policy`]); a request naming an agent takes the agent's definition first ([`agent`]);
//! webhooks and their deliveries are mapped in [`webhook`]. Every failure is an
//! `INVALID_ARGUMENT` naming the field and what to do. Every other mapping (requests that need
//! nothing but themselves, results, events, approvals, the enums both ways) is the wire's
//! (`crate::wire`), re-exported here for the handlers.
//!
//! [`RunSpec`]: crate::domain::RunSpec

mod agent;
mod policy;
mod request;
mod webhook;

use crate::wire::requests::invalid;
pub(crate) use crate::wire::requests::{CancelRequest, DecideRequest, SteeringRequest, named_id};
pub(crate) use crate::wire::{event_pb, parse_grpc_timeout};
pub(crate) use agent::{agent_pb, with_agent};
pub(crate) use policy::resolve;
pub(crate) use request::RunRequest;
pub(crate) use webhook::{delivery_pb, webhook_pb};

use crate::wire::millis;

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use shared::auth::{LimitCeilings, Principal};

    use super::policy::*;

    use crate::domain::Limits;
    use crate::domain::chat::ToolDefinition;
    use crate::tool_runners::RemoteTool;

    fn catalog(names: &[&str]) -> BTreeMap<String, RemoteTool> {
        names
            .iter()
            .map(|n| {
                let definition = ToolDefinition {
                    name: (*n).to_owned(),
                    description: String::new(),
                    parameters: serde_json::json!({"type": "object"}).into(),
                };
                (
                    (*n).to_owned(),
                    RemoteTool {
                        definition,
                        timeout: Duration::from_secs(1),
                        needs_approval: false,
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
            approval_timeout: Duration::from_secs(3600),
            input_timeout: Duration::from_secs(3600),
            max_total_tokens: 1_000_000,
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
}
