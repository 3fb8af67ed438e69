//! A2A's JSON-RPC 2.0 binding: one `POST` per call, its `params` a message of A2A's contract in
//! its JSON mapping; `SendStreamingMessage` and `SubscribeToTask` answer with server-sent events,
//! each a JSON-RPC answer carrying a `StreamResponse`. The operations are `calls.rs`'s; refusals
//! carry A2A's codes (a task not found, another principal's too, is -32001).

use std::sync::Arc;

use axum::http::{StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{Value, json};
use shared::auth::Principal;

use super::A2a;
use super::calls::{Call, TaskStream};
use super::error::{RpcError, error_body};

fn result_body(id: Value, result: Value) -> String {
    json!({ "jsonrpc": "2.0", "id": id, "result": result }).to_string()
}

fn json_answer(body: String) -> Response {
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// One call `body` to the endpoint of `agent` (`None`: the server's), as `principal`.
pub(super) async fn answer(server: &A2a, agent: Option<String>, principal: Arc<Principal>, body: &[u8]) -> Response {
    let call: Value = match serde_json::from_slice(body) {
        Ok(call) => call,
        Err(e) => return json_answer(error_body(Value::Null, RpcError::new(-32700, format!("not JSON: {e}")))),
    };
    let id = call.get("id").cloned().unwrap_or(Value::Null);
    let (Some("2.0"), Some(method)) = (
        call.get("jsonrpc").and_then(Value::as_str),
        call.get("method").and_then(Value::as_str),
    ) else {
        let refused = RpcError::new(-32600, "a JSON-RPC 2.0 request needs \"jsonrpc\": \"2.0\" and a method");
        return json_answer(error_body(id, refused));
    };
    let params = call.get("params").cloned().unwrap_or_else(|| json!({}));
    // A request's tenant names a named agent too (as the gRPC binding's does).
    let tenant = params.get("tenant").and_then(Value::as_str).filter(|t| !t.is_empty());
    let call = Call {
        server,
        agent: agent.or_else(|| tenant.map(str::to_owned)),
        principal,
    };
    match method {
        "SendStreamingMessage" => {
            stream(id, async {
                call.stream_new(self::params(params, "SendMessageRequest")?).await
            })
            .await
        }
        "SubscribeToTask" => {
            stream(id, async {
                call.subscribe(self::params(params, "SubscribeToTaskRequest")?).await
            })
            .await
        }
        "SendMessage" => {
            unary(id, "SendMessageResponse", async {
                call.send_message(self::params(params, "SendMessageRequest")?).await
            })
            .await
        }
        "GetTask" => {
            unary(id, "Task", async {
                call.get_task(self::params(params, "GetTaskRequest")?).await
            })
            .await
        }
        "ListTasks" => {
            unary(id, "ListTasksResponse", async {
                call.list_tasks(self::params(params, "ListTasksRequest")?).await
            })
            .await
        }
        "CancelTask" => {
            unary(id, "Task", async {
                call.cancel_task(self::params(params, "CancelTaskRequest")?).await
            })
            .await
        }
        "CreateTaskPushNotificationConfig" => {
            unary(id, "TaskPushNotificationConfig", async {
                call.create_push(self::params(params, "TaskPushNotificationConfig")?)
                    .await
            })
            .await
        }
        "GetTaskPushNotificationConfig" => {
            unary(id, "TaskPushNotificationConfig", async {
                call.get_push(self::params(params, "GetTaskPushNotificationConfigRequest")?)
                    .await
            })
            .await
        }
        "ListTaskPushNotificationConfigs" => {
            unary(id, "ListTaskPushNotificationConfigsResponse", async {
                call.list_pushes(self::params(params, "ListTaskPushNotificationConfigsRequest")?)
                    .await
            })
            .await
        }
        "DeleteTaskPushNotificationConfig" => {
            let deleted = async {
                call.delete_push(self::params(params, "DeleteTaskPushNotificationConfigRequest")?)
                    .await
            };
            json_answer(match deleted.await {
                Ok(()) => result_body(id, json!({})),
                Err(error) => error_body(id, error),
            })
        }
        other => json_answer(error_body(id, refused(other))),
    }
}

/// What a method this server does not serve is told.
pub(super) fn refused(method: &str) -> RpcError {
    match method {
        "GetExtendedAgentCard" => RpcError::new(-32007, "this agent has no extended card"),
        other => RpcError::new(-32601, format!("no method {other:?}")),
    }
}

/// The answer to call `id`: what `answered` gives, as A2A's message `name`, or its refusal.
async fn unary<M: prost::Message>(
    id: Value,
    name: &str,
    answered: impl std::future::Future<Output = Result<M, RpcError>>,
) -> Response {
    json_answer(match answered.await.and_then(|m| out(&m, name)) {
        Ok(result) => result_body(id, result),
        Err(error) => error_body(id, error),
    })
}

/// The stream `opened` gives, as server-sent events, or its refusal.
async fn stream(id: Value, opened: impl std::future::Future<Output = Result<TaskStream, RpcError>>) -> Response {
    match opened.await {
        Ok(stream) => sse(id, stream),
        Err(error) => json_answer(error_body(id, error)),
    }
}

/// `params` as the A2A message `name`.
fn params<M: prost::Message + Default>(params: Value, name: &str) -> Result<M, RpcError> {
    crate::wire::json::from_json_lenient(params, &format!("lf.a2a.v1.{name}")).map_err(RpcError::invalid_params)
}

/// `message` as JSON, of A2A's type `name`.
fn out<M: prost::Message>(message: &M, name: &str) -> Result<Value, RpcError> {
    crate::wire::json::to_sparse_json(message, &format!("lf.a2a.v1.{name}")).map_err(RpcError::internal)
}

/// `stream` as server-sent events, each a JSON-RPC answer to call `id` carrying one item.
fn sse(id: Value, stream: TaskStream) -> Response {
    let events = stream.map(move |item| {
        let body = match item.and_then(|item| out(&item, "StreamResponse")) {
            Ok(result) => result_body(id.clone(), result),
            Err(error) => error_body(id.clone(), error),
        };
        Ok::<_, std::convert::Infallible>(Event::default().data(body))
    });
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}
