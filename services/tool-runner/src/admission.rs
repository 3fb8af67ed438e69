//! Admission control for `RunTool`, as a tower layer in front of the gRPC routes.
//!
//! * Concurrency limit: beyond `max` calls in flight a call is refused at once with
//!   `RESOURCE_EXHAUSTED` (never queued), so the orchestrator can send it to another replica.
//! * Drain: once draining starts, new calls are refused with `UNAVAILABLE`, while the calls in
//!   flight finish; [`Admission::wait_idle`] resolves when the last one is done.
//!
//! Other methods (ListTools, health, reflection) are never limited.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use tokio::sync::Notify;
use tonic::codegen::http;
use tower::{Layer, Service};

/// The gRPC path of the limited method.
pub const RUN_TOOL_PATH: &str = "/toolrunner.v1.ToolRunner/RunTool";

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
struct Permit(Arc<State>);

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

/// The tower layer applying [`Admission`] to `RunTool`.
#[derive(Clone, Debug)]
pub struct AdmissionLayer(pub Admission);

impl<S> Layer<S> for AdmissionLayer {
    type Service = AdmissionService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AdmissionService {
            inner,
            admission: self.0.clone(),
        }
    }
}

/// See [`AdmissionLayer`].
#[derive(Clone, Debug)]
pub struct AdmissionService<S> {
    inner: S,
    admission: Admission,
}

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for AdmissionService<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        // Take the service that was polled ready, leave a fresh clone behind (tower's idiom).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        if request.uri().path() != RUN_TOOL_PATH {
            return Box::pin(inner.call(request));
        }
        match self.admission.try_admit() {
            Err(status) => {
                let reason = if status.code() == tonic::Code::Unavailable {
                    "draining"
                } else {
                    "concurrency_limit"
                };
                metrics::counter!(crate::telemetry::metric::REJECTED, "reason" => reason).increment(1);
                tracing::debug!(code = ?status.code(), "RunTool refused: {}", status.message());
                Box::pin(futures::future::ready(Ok(status.into_http())))
            }
            Ok(permit) => Box::pin(async move {
                let response = inner.call(request).await;
                drop(permit);
                response
            }),
        }
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
