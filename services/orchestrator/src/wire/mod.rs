//! The wire: every mapping between the contract's proto messages and the domain, in one room.
//! What the services send and store is mapped here and nowhere else: results and their records
//! as the run store keeps them ([`records`]), a run's events as callers and the event log see
//! them ([`events`]), pending approvals, decisions and a tool's questions ([`approvals`]), a
//! call as the tool-runners' `RunTool` and their answers ([`runners`]), the requests that need
//! nothing but themselves to be read ([`requests`]), the contract's JSON form for the command
//! line and the console ([`json`]); and here the enums both ways, durations and the
//! `grpc-timeout` header. A request checked against the server's settings (the catalog, the
//! agents, the limits) is read where it is served (`server/grpc/convert/`), from these.

pub(crate) mod approvals;
pub(crate) mod events;
pub(crate) mod json;
pub(crate) mod records;
pub(crate) mod requests;
pub(crate) mod runners;
#[cfg(test)]
mod tests;

use std::time::Duration;

use proto::orchestrator::v1 as pb;

use crate::Error;
use crate::domain::approval::ApprovalOutcome;
use crate::domain::thread::BusyPolicy;
use crate::domain::{Delivery, FailureReason, RunStatus, ToolCallError};

pub(crate) use approvals::input_request;
pub(crate) use events::event_pb;

/// A duration in whole milliseconds, as the wire's `u32` limits carry it (saturating).
pub(crate) fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
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

one_to_one!(RunStatus <=> RunStatus, unspecified: Unspecified, [Running, Completed, Failed, Canceled, AwaitingApproval, AwaitingInput, AwaitingTask]);
one_to_one!(ApprovalOutcome <=> ApprovalOutcome, unspecified: Unspecified, [Approved, Edited, Rejected, TimedOut, Answered]);
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
    ApprovalTimeout,
    TokenBudget,
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

fn usage_pb(u: crate::domain::chat::Usage) -> pb::Usage {
    pb::Usage {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        cached_prompt_tokens: u.cached_prompt_tokens,
    }
}

fn usage_of(u: pb::Usage) -> crate::domain::chat::Usage {
    crate::domain::chat::Usage {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        cached_prompt_tokens: u.cached_prompt_tokens,
    }
}

impl From<BusyPolicy> for pb::ThreadBusyPolicy {
    fn from(policy: BusyPolicy) -> Self {
        match policy {
            BusyPolicy::Reject => Self::Reject,
            BusyPolicy::Enqueue => Self::Enqueue,
            BusyPolicy::Interrupt => Self::Interrupt,
            BusyPolicy::Rollback => Self::Rollback,
        }
    }
}

/// A request's busy policy: `UNSPECIFIED` is the default, `REJECT`.
impl From<pb::ThreadBusyPolicy> for BusyPolicy {
    fn from(policy: pb::ThreadBusyPolicy) -> Self {
        match policy {
            pb::ThreadBusyPolicy::Unspecified | pb::ThreadBusyPolicy::Reject => Self::Reject,
            pb::ThreadBusyPolicy::Enqueue => Self::Enqueue,
            pb::ThreadBusyPolicy::Interrupt => Self::Interrupt,
            pb::ThreadBusyPolicy::Rollback => Self::Rollback,
        }
    }
}
