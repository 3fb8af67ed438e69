//! The requests that need nothing but themselves to be read: `DecideToolCalls` and
//! `AnswerToolInput` as decisions ([`approvals`]), `CancelRun` as a run id and a mode
//! ([`cancel`]), `SendMessage` as a run id and a user message ([`steering`]), `ListRuns` as
//! checked filters ([`listing`]). Every failure is an `INVALID_ARGUMENT` naming the field and what
//! to do. A request checked against the server's settings (an `Orchestrate` request against the
//! catalog, the agents and the limits; a webhook) is read where it is served
//! (`server/grpc/convert/`), with these helpers.

mod approvals;
mod cancel;
mod listing;
mod steering;

pub(crate) use approvals::DecideRequest;
pub(crate) use cancel::CancelRequest;
pub(crate) use steering::SteeringRequest;

use crate::Error;

/// A request's refusal: `INVALID_ARGUMENT` with what to do.
pub(crate) fn invalid(message: impl Into<String>) -> Error {
    Error::InvalidArgument(message.into())
}

/// An id a request names (`what`: `run_id`, `thread_id` …), by the one rule of ids
/// (`domain::ids`): a malformed one is `INVALID_ARGUMENT` saying the rule, never `NOT_FOUND`.
pub(crate) fn named_id(what: &str, id: String) -> Result<String, Error> {
    crate::domain::ids::check(what, &id).map_err(invalid)?;
    Ok(id)
}
