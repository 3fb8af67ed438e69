//! Admission control for `RunTool` and `RunToolStream`, as a [`Gate`] in front of the gRPC
//! routes. A streamed call's place is held until its last update, not its response head: the
//! gate hands it to the call ([`StreamPermit`], in the request's extensions).
//!
//! * Concurrency limit: beyond `max` calls in flight a call is refused at once with
//!   `RESOURCE_EXHAUSTED` (never queued), so the orchestrator can send it to another replica.
//! * Drain: once draining starts, new calls are refused with `UNAVAILABLE`, while the calls in
//!   flight finish; [`Admission::wait_idle`] resolves when the last one is done.
//!
//! Other methods (ListTools, health, reflection) are never limited.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use shared::grpc::Gate;
use tokio::sync::Notify;
use tonic::codegen::http;

/// The gRPC path of the limited method.
pub const RUN_TOOL_PATH: &str = "/toolrunner.v1.ToolRunner/RunTool";
/// The gRPC path of the streamed variant, limited alike.
pub const RUN_TOOL_STREAM_PATH: &str = "/toolrunner.v1.ToolRunner/RunToolStream";

/// Response metadata on a refusal: the tool did not start, so the caller may safely retry the
/// call on another runner. Its value says why (`concurrency-limit`, `draining`).
pub const REFUSED_HEADER: &str = "x-tool-runner-refused";

fn refused(mut status: tonic::Status, why: &'static str) -> tonic::Status {
    status
        .metadata_mut()
        .insert(REFUSED_HEADER, tonic::metadata::MetadataValue::from_static(why));
    status
}

/// Shared admission state; clones share it.
#[derive(Clone, Debug)]
pub struct Admission(Arc<State>);

#[derive(Debug)]
struct State {
    max: usize,
    in_flight: AtomicUsize,
    draining: AtomicBool,
    idle: Notify,
}

/// Holds one admitted call's place; releasing it may wake the drain.
pub struct Permit(Arc<State>);

/// A call's place, which the call keeps until it is done.
#[derive(Clone)]
pub struct CallPermit {
    _held: Arc<Permit>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Admission {
    /// Admission with at most `max` concurrent calls.
    pub fn new(max: usize) -> Self {
        Self(Arc::new(State {
            max,
            in_flight: AtomicUsize::new(0),
            draining: AtomicBool::new(false),
            idle: Notify::new(),
        }))
    }

    /// Calls currently admitted.
    pub fn in_flight(&self) -> usize {
        self.0.in_flight.load(Ordering::Acquire)
    }

    /// Refuses every new call from now on.
    pub fn start_draining(&self) {
        self.0.draining.store(true, Ordering::Release);
    }

    /// Resolves when no admitted call is in flight.
    pub async fn wait_idle(&self) {
        loop {
            let notified = self.0.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.in_flight() == 0 {
                return;
            }
            notified.await;
        }
    }

    fn try_admit(&self) -> Result<Permit, tonic::Status> {
        if self.0.draining.load(Ordering::Acquire) {
            return Err(refused(
                tonic::Status::unavailable("tool-runner is draining (shutting down); retry on another runner"),
                "draining",
            ));
        }
        let admitted = self.0.in_flight.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < self.0.max).then_some(n + 1)
        });
        match admitted {
            Ok(_) => Ok(Permit(Arc::clone(&self.0))),
            Err(_) => Err(refused(
                tonic::Status::resource_exhausted(format!(
                    "tool-runner is at its concurrency limit of {} calls; retry later or on another runner",
                    self.0.max
                )),
                "concurrency-limit",
            )),
        }
    }
}

/// `Admission` applied to `RunTool` (as a tower layer: `GateLayer(admission)`); other methods
/// pass freely.
impl Gate for Admission {
    type Pass = Option<Permit>;

    fn admit<B>(&self, request: &mut http::Request<B>) -> Result<Option<Permit>, tonic::Status> {
        let path = request.uri().path();
        if path != RUN_TOOL_PATH && path != RUN_TOOL_STREAM_PATH {
            return Ok(None);
        }
        let admitted = self.try_admit().inspect_err(|status| {
            let reason = if status.code() == tonic::Code::Unavailable {
                "draining"
            } else {
                "concurrency_limit"
            };
            metrics::counter!(crate::telemetry::metric::REJECTED, "reason" => reason).increment(1);
            tracing::debug!(code = ?status.code(), "RunTool refused: {}", status.message());
        })?;
        request.extensions_mut().insert(CallPermit {
            _held: Arc::new(admitted),
        });
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn limit_on_both_sides_and_drain() {
        let admission = Admission::new(2);
        let a = admission.try_admit().unwrap();
        let b = admission.try_admit().unwrap();
        assert_eq!(
            admission.try_admit().err().unwrap().code(),
            tonic::Code::ResourceExhausted
        );
        drop(a);
        let c = admission.try_admit().unwrap();
        admission.start_draining();
        assert_eq!(admission.try_admit().err().unwrap().code(), tonic::Code::Unavailable);
        let idle = tokio::spawn({
            let admission = admission.clone();
            async move { admission.wait_idle().await }
        });
        drop(b);
        tokio::task::yield_now().await;
        assert!(!idle.is_finished());
        drop(c);
        tokio::time::timeout(std::time::Duration::from_secs(5), idle)
            .await
            .unwrap()
            .unwrap();
    }
}
