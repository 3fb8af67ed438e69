//! A durable call's record, as the gRPC adapter uses it (see [`crate::record`]): what the record
//! says to do with an admitted call, and the run of a recorded call, which goes on to its end
//! when its caller leaves (its outcome is kept for the call sent again) and keeps the outcome
//! before it answers.

use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;

use proto::toolrunner::v1 as pb;
use tonic::Status;
use tracing::Instrument;

use super::{ToolCall, ToolRunnerService};
use crate::admission::CallPermit;
use crate::fence::Refusal;
use crate::record::{Begun, Call, CallRecords, NotKept, Started};
use crate::tools::progress::ProgressSink;

/// What the record says to do with an admitted call.
pub(super) enum Plan {
    /// Run it; its outcome is kept in the record when `Some`.
    Run(Option<Started>),
    /// Answer it without running anything: the call's outcome, as kept or in doubt.
    Answer(pb::RunToolResponse),
}

impl ToolRunnerService {
    /// What the record says of `call`: a durable call's first attempt, or one carrying answers,
    /// is recorded; a task's follow-up is not (it goes on with what the task's handle names).
    pub(super) async fn plan(&self, call: &ToolCall) -> Result<Plan, Status> {
        let Some(records) = self.records.as_ref().filter(|_| call.epoch > 0 && call.task.is_none()) else {
            return Ok(Plan::Run(None));
        };
        // An unknown tool runs nothing: its answer says so.
        let Some(spec) = self.catalog.spec(&call.tool_name) else {
            return Ok(Plan::Run(None));
        };
        let recorded = Call {
            run_id: &call.run_id,
            call_id: &call.call_id,
            round: call.input.as_ref().map(|i| i.request_state.as_str()),
            epoch: call.epoch,
            idempotent: spec.idempotent,
            rerun_in_doubt: call.rerun_in_doubt,
            wait: spec.timeout.saturating_add(records.lease()),
        };
        match records.begin(&recorded).await {
            Begun::Run(started) => Ok(Plan::Run(Some(started))),
            Begun::Done(outcome) => {
                tracing::info!("answered from the call's record: it ran before, and does not run again");
                Ok(Plan::Answer(kept(&outcome)))
            }
            Begun::InDoubt { runner } => {
                tracing::warn!(%runner, "the call is in doubt: its runner went away before its outcome was kept");
                Ok(Plan::Answer(in_doubt(&runner)))
            }
            Begun::Stale { current } => Err(self.refuse(Refusal::Stale {
                run_id: call.run_id.clone(),
                call_id: call.call_id.clone(),
                epoch: call.epoch,
                current,
            })),
            Begun::Unavailable(why) => Err(self.refuse(Refusal::Unreadable {
                run_id: call.run_id.clone(),
                why,
            })),
        }
    }

    /// Runs `call` as `plan` says; a recorded call runs in a task of its own, spawned when this
    /// is called (not when awaited: a caller that leaves at once does not leave a record of a
    /// start that never ran), so that it goes on if its caller leaves, holding its place
    /// (`permit`: the drain waits for it) until its outcome is kept.
    pub(super) fn run(
        &self,
        call: ToolCall,
        progress: Option<ProgressSink>,
        plan: Plan,
        permit: Option<CallPermit>,
    ) -> BoxFuture<'static, pb::RunToolResponse> {
        let (started, records) = match (plan, &self.records) {
            (Plan::Answer(response), _) => return futures::future::ready(response).boxed(),
            (Plan::Run(Some(started)), Some(records)) => (started, Arc::clone(records)),
            (Plan::Run(_), _) => {
                let this = self.clone();
                return async move {
                    let _permit = permit;
                    this.execute(call, progress).await
                }
                .boxed();
            }
        };
        let this = self.clone();
        let recorded = async move {
            let _permit = permit;
            let response = this.execute(call, progress).await;
            keep(&records, started, &response).await;
            response
        };
        let task = tokio::spawn(recorded.instrument(tracing::Span::current()));
        async move {
            task.await
                .unwrap_or_else(|e| failed(&format!("the call's task ended without an outcome: {e}")))
        }
        .boxed()
    }
}

/// Keeps `response` in the call's record (questions asked before the tool did anything are not
/// an outcome: the record goes); what was not kept is logged (the caller still gets it).
async fn keep(records: &CallRecords, started: Started, response: &pb::RunToolResponse) {
    if let Some(pb::run_tool_response::Outcome::InputRequired(_)) = &response.outcome {
        return records.release(started).await;
    }
    let outcome = prost::Message::encode_to_vec(response).into();
    let too_large = |size: usize, max: usize| {
        let error = failed(&format!(
            "the call ran, and its outcome ({size} bytes) was larger than the tool-runner's --call-record-max-bytes ({max}), so it was not kept: it is not run again"
        ));
        prost::Message::encode_to_vec(&error).into()
    };
    match records.finish(started, outcome, too_large).await {
        Ok(()) => {}
        Err(e @ NotKept::TooLarge { .. }) => tracing::warn!("the call's outcome: {e}"),
        Err(e) => tracing::warn!("the call's outcome was not kept: {e}"),
    }
}

/// An outcome as the record kept it.
fn kept(outcome: &[u8]) -> pb::RunToolResponse {
    <pb::RunToolResponse as prost::Message>::decode(outcome).unwrap_or_else(|e| {
        failed(&format!(
            "the call ran before, and its kept outcome cannot be read ({e}); it is not run again"
        ))
    })
}

/// The answer of a call in doubt.
fn in_doubt(runner: &str) -> pb::RunToolResponse {
    let message = format!(
        "this call may or may not have taken effect: it started on tool-runner {runner}, which went away before its outcome was kept, and the tool is not declared idempotent, so it was not run again"
    );
    response(pb::run_tool_response::Outcome::InDoubt(pb::ToolInDoubt {
        runner: runner.to_owned(),
        message,
    }))
}

/// A `FAILED` answer saying `why`.
fn failed(why: &str) -> pb::RunToolResponse {
    response(pb::run_tool_response::Outcome::Error(pb::ToolError {
        code: pb::ToolErrorCode::Failed.into(),
        message: why.to_owned(),
        retryable: false,
    }))
}

fn response(outcome: pb::run_tool_response::Outcome) -> pb::RunToolResponse {
    pb::RunToolResponse {
        outcome: Some(outcome),
        duration_ms: 0,
    }
}
