//! Proto ↔ domain, for the gRPC handlers. Requests become a [`RunRequest`] (`TryFrom`, checks
//! that need nothing else, in [`request`]) and then a [`RunSpec`] ([`resolve`], checks against
//! the tool catalog and the server's limits, in [`policy`]); every failure is an
//! `INVALID_ARGUMENT` naming the field and what to do. Domain results and events become proto
//! messages in `crate::wire`; `DecideToolCalls` requests become decisions in [`approvals`], and
//! `CancelRun` requests a run id and a mode in [`cancel`], `SendMessage` requests a run id and a
//! user message in [`steering`], `ListRuns` requests checked filters in [`listing`]. A request
//! naming an agent takes the agent's definition first ([`agent`]). Webhooks and their
//! deliveries are mapped in [`webhook`].
//!
//! [`RunSpec`]: crate::domain::RunSpec

mod agent;
mod approvals;
mod cancel;
mod listing;
mod policy;
mod request;
mod steering;
mod webhook;

pub(crate) use crate::wire::{event_pb, parse_grpc_timeout};
pub(crate) use agent::{agent_pb, with_agent};
pub(crate) use approvals::DecideRequest;
pub(crate) use cancel::CancelRequest;
pub(crate) use policy::resolve;
pub(crate) use request::RunRequest;
pub(crate) use steering::SteeringRequest;
pub(crate) use webhook::{delivery_pb, webhook_pb};

use crate::Error;

fn invalid(message: impl Into<String>) -> Error {
    Error::InvalidArgument(message.into())
}

/// An id a request names (`what`: `run_id`, `thread_id` …), by the one rule of ids
/// (`domain::ids`): a malformed one is `INVALID_ARGUMENT` saying the rule, never `NOT_FOUND`.
pub(crate) fn named_id(what: &str, id: String) -> Result<String, Error> {
    crate::domain::ids::check(what, &id).map_err(invalid)?;
    Ok(id)
}

use crate::wire::millis;

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use proto::orchestrator::v1 as pb;
    use shared::auth::{LimitCeilings, Principal};

    use super::policy::*;

    use crate::wire::*;

    use crate::domain::approval::ApprovalOutcome;
    use crate::domain::chat::ToolDefinition;
    use crate::domain::{Delivery, FailureReason, Limits, RunResult, RunStatus, Signal};
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
            assert_eq!(
                ApprovalOutcome::from_wire(wire).is_ok(),
                pb::ApprovalOutcome::try_from(wire).is_ok()
            );
        }
        for &outcome in ApprovalOutcome::ALL {
            assert_eq!(
                ApprovalOutcome::try_from(pb::ApprovalOutcome::from(outcome)).ok(),
                Some(outcome)
            );
        }
        assert_eq!(
            (
                RunStatus::ALL.len(),
                Delivery::ALL.len(),
                FailureReason::ALL.len(),
                ApprovalOutcome::ALL.len()
            ),
            (7, 3, 14, 5),
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
