//! Every mapping round-trips, and what the wire does not know is an error, never a default.

use std::time::Duration;

use proto::orchestrator::v1 as pb;

use super::*;
use crate::domain::approval::ApprovalOutcome;
use crate::domain::{Delivery, FailureReason, RunResult, RunStatus, Signal};

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
