//! The rules every attempt of a tool call follows, whatever carries it to a runner: the call
//! waits out its owner's fence grace, is sent only while this replica holds its run (checked
//! before every attempt, retries included), stops this replica acting for the run when a runner
//! says the run is in a newer epoch, and is tried again (with backoff, a bounded number of
//! times) only when it certainly did not run, or when its answer was lost on the way from
//! runners that record durable calls (a call sent again is answered from its record, or in
//! doubt: it does not run twice). The gRPC client (`super::ToolRunners`) and the
//! simulation's runners both send through [`send`].

use std::future::Future;
use std::time::Duration;

use crate::domain::ToolCallError;
use crate::domain::ports::{ToolInvocation, ToolOutput};

/// What one attempt came to.
#[derive(Debug)]
pub enum Attempt {
    /// A runner answered: the tool's result, or its error (the tool may have run).
    Answered(Result<ToolOutput, ToolCallError>),
    /// A runner refused the call as a replaced owner's: the run is in epoch `current`.
    Superseded {
        /// The run's epoch as the runner read it.
        current: u64,
        /// The runner.
        runner: String,
    },
    /// The call of a durable run went to a runner that records it, and the answer was lost (the
    /// runner went away mid-call): sent again, it is answered from its record, or in doubt.
    Lost {
        /// The error the call ends with when it is not tried again.
        error: ToolCallError,
    },
    /// The call certainly did not run: a runner refused it before it ran, or none was reached.
    Unrun {
        /// Why, as the retries metric counts it.
        reason: &'static str,
        /// The error the call ends with when it is not tried again.
        error: ToolCallError,
    },
}

/// How often, and how far apart, a call no runner ran is tried again.
#[derive(Debug, Clone, Copy)]
pub struct Retries {
    /// Attempts after the first.
    pub retries: u32,
    /// The first wait; each next one doubles.
    pub backoff: Duration,
}

/// Sends `call` by `attempt` under the rules of the module docs; the call's outcome.
pub async fn send<F, Fut>(call: &ToolInvocation, retries: Retries, mut attempt: F) -> Result<ToolOutput, ToolCallError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Attempt>,
{
    if let Some(owner) = &call.owner {
        owner.calls_allowed().await;
    }
    let mut tried = 0u32;
    loop {
        if let Some(moved) = moved_away(call) {
            return Err(moved);
        }
        match attempt().await {
            Attempt::Answered(outcome) => return outcome,
            Attempt::Superseded { current, runner } => return Err(stop_superseded(call, current, &runner)),
            Attempt::Unrun { error, .. } | Attempt::Lost { error } if tried >= retries.retries => return Err(error),
            Attempt::Unrun { reason, error } => {
                metrics::counter!(crate::telemetry::metric::TOOL_CALL_RETRIES, "reason" => reason).increment(1);
                tracing::debug!(
                    attempt = tried,
                    reason,
                    "retrying a tool call no runner ran: {}",
                    error.message
                );
                tokio::time::sleep(retries.backoff.saturating_mul(1 << tried.min(16))).await;
                tried += 1;
            }
            Attempt::Lost { error } => {
                metrics::counter!(crate::telemetry::metric::TOOL_CALL_RETRIES, "reason" => "lost_answer").increment(1);
                tracing::info!(
                    attempt = tried,
                    "sending a durable call again, its answer lost: it is answered from its record: {}",
                    error.message
                );
                tokio::time::sleep(retries.backoff.saturating_mul(1 << tried.min(16))).await;
                tried += 1;
            }
        }
    }
}

/// Why the call must not be sent (again): this replica no longer acts for its run, or the call
/// of a durable run carries no epoch (runners would refuse it: its owner lost track of its claim,
/// and stops).
pub(super) fn moved_away(call: &ToolInvocation) -> Option<ToolCallError> {
    let owner = call.owner.as_ref()?;
    if call.epoch == 0 {
        let why = format!("call {} of a durable run carries no epoch", call.call_id);
        owner.stop(crate::domain::Stop::Fenced(why.clone()));
        return Some(ToolCallError::new("UNAVAILABLE", format!("not sent: {why}")));
    }
    (!owner.holds()).then(|| {
        let why = owner
            .why()
            .map_or_else(|| "its ownership stopped".to_owned(), ToString::to_string);
        ToolCallError::new(
            "UNAVAILABLE",
            format!("not sent: this replica no longer acts for the run ({why})"),
        )
    })
}

/// A runner refused the call as a replaced owner's: the run is another replica's now, so this
/// one stops acting for it (the call's outcome is never reported from here).
pub(super) fn stop_superseded(call: &ToolInvocation, current: u64, runner: &str) -> ToolCallError {
    let why = format!(
        "tool-runner {runner} refused call {} of epoch {}: the run is in epoch {current}",
        call.call_id, call.epoch
    );
    metrics::counter!(crate::telemetry::metric::TOOL_CALLS_SUPERSEDED).increment(1);
    if let Some(owner) = &call.owner {
        owner.stop(crate::domain::Stop::Fenced(why.clone()));
    }
    ToolCallError::new("UNAVAILABLE", why)
}
