//! The console's calls go through the gRPC service itself, in process: a page posts a request
//! message in the contract's JSON mapping, the gateway hands it to the same handler a gRPC caller
//! reaches, as the signed-in principal, and answers with the handler's answer in JSON. So the
//! console has no rules of its own: what a person may see and do is what their principal may
//! through the API. A run's events come the same way, from `AttachRun`, as server-sent events.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use futures::{Stream, StreamExt};
use proto::orchestrator::v1 as pb;
use proto::orchestrator::v1::orchestrator_server::Orchestrator;
use shared::auth::Principal;
use tonic::{Request, Response, Status};

use crate::server::grpc::OrchestratorService;

/// How long one call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// A call the gateway refuses, or the service refused: an HTTP status and the gRPC code's name
/// and message, which the page shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Refused {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl Refused {
    pub(super) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    /// The body of the answer: `{"code": …, "message": …}`.
    pub(super) fn body(&self) -> String {
        serde_json::json!({ "code": self.code, "message": self.message }).to_string()
    }
}

impl From<Status> for Refused {
    fn from(status: Status) -> Self {
        use tonic::Code as C;
        let http = match status.code() {
            C::InvalidArgument | C::OutOfRange => StatusCode::BAD_REQUEST,
            C::Unauthenticated => StatusCode::UNAUTHORIZED,
            C::PermissionDenied => StatusCode::FORBIDDEN,
            C::NotFound => StatusCode::NOT_FOUND,
            C::AlreadyExists | C::Aborted | C::FailedPrecondition => StatusCode::CONFLICT,
            C::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            C::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            C::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let code = orchestrator_client::code_name(status.code());
        Self::new(http, code, status.message())
    }
}

/// The methods a page may call, by name; the others (starting runs, deleting threads, the
/// signal topic) are for services.
pub(super) const METHODS: [&str; 11] = [
    "GetRun",
    "ListRuns",
    "CancelRun",
    "SendMessage",
    "ListPendingApprovals",
    "DecideToolCalls",
    "AnswerToolInput",
    "GetThread",
    "GetUsage",
    "ListWebhooks",
    "ListWebhookDeliveries",
];

/// Calls `method` with the JSON request `body` as `principal`; the answer as JSON.
pub(super) async fn call(
    service: &OrchestratorService,
    method: &str,
    principal: Arc<Principal>,
    body: &[u8],
) -> Result<String, Refused> {
    let s = service;
    let p = principal;
    match method {
        "GetRun" => unary(body, "GetRunRequest", "RunResult", p, |r| s.get_run(r)).await,
        "ListRuns" => unary(body, "ListRunsRequest", "ListRunsResponse", p, |r| s.list_runs(r)).await,
        "CancelRun" => unary(body, "CancelRunRequest", "CancelRunResponse", p, |r| s.cancel_run(r)).await,
        "SendMessage" => {
            unary(body, "SendMessageRequest", "SendMessageResponse", p, |r| {
                s.send_message(r)
            })
            .await
        }
        "ListPendingApprovals" => {
            let answer = "ListPendingApprovalsResponse";
            unary(body, "ListPendingApprovalsRequest", answer, p, |r| {
                s.list_pending_approvals(r)
            })
            .await
        }
        "DecideToolCalls" => {
            let answer = "DecideToolCallsResponse";
            unary(body, "DecideToolCallsRequest", answer, p, |r| s.decide_tool_calls(r)).await
        }
        "AnswerToolInput" => {
            let answer = "AnswerToolInputResponse";
            unary(body, "AnswerToolInputRequest", answer, p, |r| s.answer_tool_input(r)).await
        }
        "GetThread" => unary(body, "GetThreadRequest", "Thread", p, |r| s.get_thread(r)).await,
        "GetUsage" => unary(body, "GetUsageRequest", "GetUsageResponse", p, |r| s.get_usage(r)).await,
        "ListWebhooks" => {
            unary(body, "ListWebhooksRequest", "ListWebhooksResponse", p, |r| {
                s.list_webhooks(r)
            })
            .await
        }
        "ListWebhookDeliveries" => {
            let answer = "ListWebhookDeliveriesResponse";
            unary(body, "ListWebhookDeliveriesRequest", answer, p, |r| {
                s.list_webhook_deliveries(r)
            })
            .await
        }
        other => Err(Refused::new(
            StatusCode::NOT_FOUND,
            "NOT_FOUND",
            format!(
                "{other:?} is not a method the console calls (it calls {})",
                METHODS.join(", ")
            ),
        )),
    }
}

/// One unary call: the request message `asked` read from `body`, `handler` called with it as
/// `principal`, the answer message `answer` written back.
async fn unary<Q, A, F, Fut>(
    body: &[u8],
    asked: &str,
    answer: &str,
    principal: Arc<Principal>,
    handler: F,
) -> Result<String, Refused>
where
    Q: prost::Message + Default,
    A: prost::Message,
    F: FnOnce(Request<Q>) -> Fut,
    Fut: Future<Output = Result<Response<A>, Status>>,
{
    let message: Q = crate::wire::json::from_json(body, &format!("orchestrator.v1.{asked}"))
        .map_err(|e| Refused::new(StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", e))?;
    let mut request = Request::new(message);
    request.extensions_mut().insert(principal);
    let answered = tokio::time::timeout(CALL_TIMEOUT, handler(request))
        .await
        .map_err(|_| {
            Refused::new(
                StatusCode::GATEWAY_TIMEOUT,
                "DEADLINE_EXCEEDED",
                "the call took too long",
            )
        })??;
    crate::wire::json::to_json(answered.get_ref(), &format!("orchestrator.v1.{answer}"))
        .map_err(|e| Refused::new(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL", e))
}

/// One item of a run's event stream as a page reads it.
pub(super) enum Item {
    /// An event: its seq and its JSON.
    Event(u64, String),
    /// The stream ended early (the replica drains, the run's log broke): the page attaches again
    /// from the last seq it saw.
    Broke(Refused),
}

/// The events of `run_id` after `after_seq`, as `principal` may read them (`AttachRun`).
pub(super) async fn events(
    service: &OrchestratorService,
    run_id: String,
    after_seq: u64,
    principal: Arc<Principal>,
) -> Result<impl Stream<Item = Item> + Send + use<>, Refused> {
    let mut request = Request::new(pb::AttachRunRequest { run_id, after_seq });
    request.extensions_mut().insert(principal);
    let stream = tokio::time::timeout(CALL_TIMEOUT, service.attach_run(request))
        .await
        .map_err(|_| {
            Refused::new(
                StatusCode::GATEWAY_TIMEOUT,
                "DEADLINE_EXCEEDED",
                "attaching took too long",
            )
        })??
        .into_inner();
    Ok(stream.map(|item| match item {
        Ok(event) => match crate::wire::json::to_json(&event, "orchestrator.v1.OrchestrateEvent") {
            Ok(json) => Item::Event(event.seq, json),
            Err(e) => Item::Broke(Refused::new(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL", e)),
        },
        Err(status) => Item::Broke(status.into()),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_keeps_the_services_code_and_words() {
        let refused = Refused::from(Status::not_found("no run \"r\""));
        assert_eq!(
            (refused.status, refused.code, refused.message.as_str()),
            (StatusCode::NOT_FOUND, "NOT_FOUND", "no run \"r\"")
        );
        let body: serde_json::Value = serde_json::from_str(&refused.body()).unwrap();
        assert_eq!(body["code"], "NOT_FOUND");
        assert_eq!(
            Refused::from(Status::failed_precondition("x")).status,
            StatusCode::CONFLICT
        );
    }
}
