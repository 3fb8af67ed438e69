//! A call of an MCP tool: `tools/call` on the server's live session, under a `mcp_call` span
//! whose trace context also travels in the request's `_meta.traceparent`; a call dropped before
//! its answer (the caller canceled, the timeout passed) sends `notifications/cancelled`.
//!
//! A server may answer `input_required` (a 2026-07-28 multi-round-trip call): its elicitations
//! become the call's questions ([`Output::InputRequired`]), and the call's next attempt carries
//! the answers and the server's `requestState` back (`inputResponses`), on whichever runner
//! takes it. A question the runner cannot put to a person (sampling, roots) fails the call.
//!
//! The request's `_meta` also carries the orchestrator's ids: `orchestrator/call_id`, the
//! idempotency key (a call re-sent after its orchestrator replica died keeps its id, so a server
//! with side effects can answer the second delivery from the first), `orchestrator/run_id`, and
//! `orchestrator/epoch` (one more each time another orchestrator replica took the run over: a
//! server refuses an epoch older than one it has seen for the run).
//!
//! How the answer becomes the tool's result (`content_json`):
//!
//! | the server answers | the result |
//! | --- | --- |
//! | `isError: true` | a `FAILED` tool error carrying the text of its content |
//! | `structuredContent` | that JSON value |
//! | one `text` block | the text's JSON value when it parses as JSON, else the text as a string |
//! | no content | `null` |
//! | several blocks, or one that is not text | an array with one object per block (below) |
//!
//! Blocks: `text` → `{"type": "text", "text"}`; `image` / `audio` → `{"type", "mimeType", "bytes",
//! "note"}` (described: the data is not passed to the model); embedded `resource` →
//! `{"type": "resource", "uri", "mimeType", "text"}` for text, or its size and a note for a blob;
//! `resource_link` → `{"type", "uri", "name", "title", "description", "mimeType"}`; any other type
//! → its type and a note.
//!
//! A JSON-RPC error is a tool error: `INVALID_ARGUMENTS` for invalid params, `FAILED` otherwise,
//! with the server's message; a session that closes during the call is `UNAVAILABLE` (retryable).
//! An answer the transport drops while the session stays open (over `max_message_bytes`: a stdio
//! line is answered with an error in its place, see `bounded`; an HTTP response or SSE event
//! fails its stream) is `FAILED` at once, naming the bound.

use std::sync::RwLock;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use rmcp::RoleClient;
use rmcp::handler::client::progress::{ProgressDispatcher, ProgressSubscriber};
use rmcp::model::{
    CallToolRequestParams, CancelTaskParams, CancelledNotificationParam, ClientRequest, ErrorCode as JsonRpcCode,
    GetTaskParams, Request, RequestId, RequestMetaObject, ServerResult, UpdateTaskParams,
};
use rmcp::service::{Peer, PeerRequestOptions, ServiceError};
use serde_json::{Value, json};
use tracing::Instrument;

use crate::tools::input::{InputAnswers, InputRequest, InputRequired, Output};
use crate::tools::progress::{Progress, ProgressSink};
use crate::tools::task::{TaskRef, TaskState};
use crate::tools::{Args, CallContext, ErrorCode, Tool, ToolError, ToolResult};

/// How much of an error's text reaches the model.
const ERROR_TEXT_BYTES: usize = 4000;
/// The `_meta` key of the call id: the same for every delivery of one call.
const META_CALL_ID: &str = "orchestrator/call_id";
/// The `_meta` key of the run id.
const META_RUN_ID: &str = "orchestrator/run_id";
const META_EPOCH: &str = "orchestrator/epoch";
/// How long sending `notifications/cancelled` may take.
const CANCEL_SEND_LIMIT: Duration = Duration::from_secs(2);

/// A server's live session, shared by its tools; `None` while it is down.
pub(crate) struct Link {
    server: String,
    peer: RwLock<Option<Peer<RoleClient>>>,
    /// Named in the error of a call whose answer the transport dropped.
    max_message_bytes: usize,
    /// A stdio server: its tasks live in this runner's child process.
    pinned: bool,
    /// Hands the server's `notifications/progress` to the calls that wait (shared with each
    /// session's handler).
    pub(super) progress: ProgressDispatcher,
}

impl Link {
    pub(super) fn new(server: String, max_message_bytes: usize, pinned: bool) -> Self {
        Self {
            server,
            peer: RwLock::new(None),
            max_message_bytes,
            pinned,
            progress: ProgressDispatcher::new(),
        }
    }

    pub(super) fn set_peer(&self, peer: Option<Peer<RoleClient>>) {
        *shared::sync::write(&self.peer) = peer;
    }

    fn peer(&self) -> Option<Peer<RoleClient>> {
        shared::sync::read(&self.peer).clone()
    }

    pub(super) fn is_up(&self) -> bool {
        self.peer().is_some_and(|p| !p.is_transport_closed())
    }
}

/// One tool of an MCP server.
pub(crate) struct McpTool {
    link: std::sync::Arc<Link>,
    /// Its name on the server (the offered name carries the prefix).
    name: String,
}

impl McpTool {
    pub(super) fn new(link: std::sync::Arc<Link>, name: String) -> Self {
        Self { link, name }
    }
}

impl Tool for McpTool {
    fn call(&self, args: Args, ctx: &CallContext) -> BoxFuture<'static, ToolResult> {
        self.run(args, ctx)
            .map(|output| match output? {
                Output::Done(value) => Ok(value),
                Output::InputRequired(_) => Err(ToolError::failed("the MCP tool asked for input nobody can give here")),
                Output::Task(_) => Err(ToolError::failed(
                    "the MCP server ran the call as a task nobody follows here",
                )),
            })
            .boxed()
    }

    fn run(&self, args: Args, ctx: &CallContext) -> BoxFuture<'static, Result<Output, ToolError>> {
        let (link, name) = (std::sync::Arc::clone(&self.link), self.name.clone());
        let (input, task, progress) = (ctx.input.clone(), ctx.task.clone(), ctx.progress.clone());
        let ids = [(META_CALL_ID, ctx.call_id.clone()), (META_RUN_ID, ctx.run_id.clone())];
        let epoch = ctx.epoch;
        let method = if task.is_some() { "tasks/get" } else { "tools/call" };
        let span = tracing::info_span!(
            "mcp_call",
            otel.name = %format!("{method} {name}"),
            otel.kind = "client",
            rpc.system = "jsonrpc",
            rpc.method = method,
            mcp.server = %link.server,
            mcp.tool = %name,
        );
        async move {
            let peer = link.peer().ok_or_else(|| {
                ToolError::retryable(
                    ErrorCode::Unavailable,
                    format!(
                        "MCP server {} is not connected; the runner is reconnecting to it",
                        link.server
                    ),
                )
            })?;
            let mut meta = RequestMetaObject::new();
            if let Some(traceparent) = shared::telemetry::current_traceparent() {
                meta.0.set_traceparent(traceparent);
            }
            for (key, id) in ids.into_iter().filter(|(_, id)| !id.is_empty()) {
                meta.0.insert(key.to_owned(), Value::String(id));
            }
            if epoch > 0 {
                meta.0.insert(META_EPOCH.to_owned(), Value::from(epoch));
            }
            match task {
                Some(task) => go_on_with_task(&link, &peer, task, input, meta).await,
                None => call_tool(&link, &peer, (name, args), input, meta, progress).await,
            }
        }
        .instrument(span)
        .boxed()
    }
}

/// `tools/call`: the tool's result, its questions, or the task the server made of the call; the
/// server's progress reports meanwhile go to `progress`.
async fn call_tool(
    link: &Link,
    peer: &Peer<RoleClient>,
    (name, args): (String, Args),
    input: Option<InputAnswers>,
    meta: RequestMetaObject,
    progress: Option<ProgressSink>,
) -> Result<Output, ToolError> {
    let server = &link.server;
    let mut params = CallToolRequestParams::new(name).with_arguments(args);
    if let Some(input) = input {
        params = params.with_input_responses(input.responses);
        params.request_state = Some(input.request_state).filter(|state| !state.is_empty());
    }
    let request = ClientRequest::CallToolRequest(Request::new(params));
    let handle = peer
        .send_cancellable_request(request, PeerRequestOptions::no_options().with_meta(meta))
        .await
        .map_err(|e| service_error(server, e))?;
    let mut cancel = CancelOnDrop(Some((handle.peer.clone(), handle.id.clone())));
    let answer = match progress {
        Some(sink) => {
            let reports = link.progress.subscribe(handle.progress_token.clone()).await;
            answer_reporting(handle.await_response(), reports, &sink).await
        }
        None => handle.await_response().await,
    };
    cancel.0 = None;
    match answer {
        Ok(ServerResult::CallToolResult(result)) => {
            content_json(&serde_json::to_value(&result).unwrap_or_default()).map(Output::Done)
        }
        Ok(ServerResult::InputRequiredResult(asked)) => {
            questions(server, &serde_json::to_value(&asked).unwrap_or_default())
        }
        Ok(ServerResult::CreateTaskResult(created)) => {
            let task = TaskState::of_mcp(&serde_json::to_value(&created).unwrap_or_default(), link.pinned);
            tracing::info!(mcp.task.id = %task.id, ttl_ms = ?task.ttl_ms, poll_interval_ms = ?task.poll_interval_ms, "the server runs the call as a task");
            Ok(Output::Task(task))
        }
        Ok(_) => Err(ToolError::failed(format!(
            "MCP server {server} answered tools/call with something other than a tool result, questions or a task"
        ))),
        Err(ServiceError::TransportClosed) if !peer.is_transport_closed() => Err(ToolError::failed(format!(
            "MCP server {server}: the transport dropped this call's answer while the session stays open \
             (an answer over max_message_bytes = {} bytes, or a broken response stream)",
            link.max_message_bytes
        ))),
        Err(e) => Err(service_error(server, e)),
    }
}

/// Waits for `answer`, handing each of the server's progress `reports` meanwhile to `sink`.
async fn answer_reporting<T>(
    answer: impl Future<Output = T>,
    mut reports: ProgressSubscriber,
    sink: &ProgressSink,
) -> T {
    use futures::{FutureExt as _, StreamExt as _};
    let pass_on = |report: rmcp::model::ProgressNotificationParam| {
        sink.report(Progress {
            progress: report.progress,
            total: report.total,
            message: report.message.unwrap_or_default(),
        });
    };
    tokio::pin!(answer);
    loop {
        tokio::select! {
            // Reports first: the server sent them before its answer.
            biased;
            Some(report) = reports.next() => pass_on(report),
            answer = &mut answer => {
                // The session hands reports over before the answer that follows them.
                while let Some(Some(report)) = reports.next().now_or_never() {
                    pass_on(report);
                }
                return answer;
            }
        }
    }
}

/// An attempt of a call that became a task: the answers to its questions go with
/// `tasks/update` (or the task is canceled with `tasks/cancel`), then `tasks/get` says where it
/// is. An error the server answers to the update or the cancel is logged, not fatal: the task's
/// state (`tasks/get`) says what came of it.
async fn go_on_with_task(
    link: &Link,
    peer: &Peer<RoleClient>,
    task: TaskRef,
    input: Option<InputAnswers>,
    meta: RequestMetaObject,
) -> Result<Output, ToolError> {
    let server = &link.server;
    let sent = if task.cancel {
        let mut params = CancelTaskParams::new(task.id.clone());
        params.meta = Some(meta.clone());
        Some(("tasks/cancel", peer.cancel_task(params).await))
    } else if let Some(input) = input {
        let mut params = UpdateTaskParams::new(task.id.clone(), input.responses);
        params.meta = Some(meta.clone());
        Some(("tasks/update", peer.update_task(params).await))
    } else {
        None
    };
    match sent {
        Some((method, Err(ServiceError::McpError(e)))) => {
            tracing::warn!(mcp.task.id = %task.id, "MCP server {server} answered {method} with error {}: {}", e.code.0, e.message);
        }
        Some((_, Err(e))) => return Err(service_error(server, e)),
        _ => {}
    }
    let mut params = GetTaskParams::new(task.id.clone());
    params.meta = Some(meta);
    match peer.get_task(params).await {
        Ok(got) => task_output(server, &serde_json::to_value(&got).unwrap_or_default(), link.pinned),
        Err(ServiceError::McpError(e)) => Err(ToolError::failed(format!(
            "MCP server {server} no longer knows task {} (past its ttl, or the server lost it): error {}: {}",
            task.id,
            e.code.0,
            shared::text::truncate(&e.message, ERROR_TEXT_BYTES)
        ))),
        Err(e) => Err(service_error(server, e)),
    }
}

/// A task's state (`tasks/get`, as JSON) as the attempt's output: still working, questions,
/// the tool's result, or the task's end as an error.
fn task_output(server: &str, task: &Value, pinned: bool) -> Result<Output, ToolError> {
    match task["status"].as_str().unwrap_or_default() {
        "working" => Ok(Output::Task(TaskState::of_mcp(task, pinned))),
        "input_required" => questions(server, task),
        "completed" => content_json(&task["result"]).map(Output::Done),
        "failed" => Err(ToolError::failed(format!(
            "the MCP server's task failed: {}",
            shared::text::truncate(
                task["error"]["message"].as_str().unwrap_or("no message"),
                ERROR_TEXT_BYTES
            )
        ))),
        "cancelled" => Err(ToolError::new(
            ErrorCode::Canceled,
            format!("MCP server {server} canceled the task"),
        )),
        other => Err(ToolError::failed(format!(
            "MCP server {server} says its task is {other:?}, a status this runner does not know"
        ))),
    }
}

/// An `input_required` answer (as JSON) as the call's questions.
fn questions(server: &str, asked: &Value) -> Result<Output, ToolError> {
    let requests = asked["inputRequests"].as_object().cloned().unwrap_or_default();
    if requests.is_empty() {
        return Err(ToolError::failed(format!(
            "MCP server {server} answered input_required with no input requests"
        )));
    }
    let requests = requests
        .iter()
        .map(|(key, request)| InputRequest::of_mcp(key, request))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ToolError::failed(format!("MCP server {server}: {e}")))?;
    Ok(Output::InputRequired(InputRequired {
        request_state: asked["requestState"].as_str().unwrap_or_default().to_owned(),
        requests,
    }))
}

/// Sends `notifications/cancelled` for a request whose answer nobody waits for any more.
struct CancelOnDrop(Option<(Peer<RoleClient>, RequestId)>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some((peer, id)) = self.0.take() {
            tracing::info!("MCP call abandoned; sending notifications/cancelled");
            let param =
                CancelledNotificationParam::new(Some(id), Some("the caller canceled or the call timed out".into()));
            tokio::spawn(async move {
                let _ = tokio::time::timeout(CANCEL_SEND_LIMIT, peer.notify_cancelled(param)).await;
            });
        }
    }
}

fn service_error(server: &str, error: ServiceError) -> ToolError {
    match error {
        ServiceError::McpError(e) if e.code == JsonRpcCode::INVALID_PARAMS => ToolError::invalid(format!(
            "MCP server {server}: {}",
            shared::text::truncate(&e.message, ERROR_TEXT_BYTES)
        )),
        ServiceError::McpError(e) => ToolError::failed(format!(
            "MCP server {server} answered error {}: {}",
            e.code.0,
            shared::text::truncate(&e.message, ERROR_TEXT_BYTES)
        )),
        ServiceError::TransportClosed | ServiceError::TransportSend(_) => ToolError::retryable(
            ErrorCode::Unavailable,
            format!("MCP server {server} closed the connection during the call; the runner is reconnecting to it"),
        ),
        ServiceError::Timeout { timeout } => ToolError::retryable(
            ErrorCode::Timeout,
            format!("MCP server {server} did not answer within {timeout:?}"),
        ),
        ServiceError::Cancelled { .. } => {
            ToolError::new(ErrorCode::Canceled, format!("MCP server {server} canceled the call"))
        }
        other => ToolError::failed(format!(
            "MCP server {server}: {}",
            shared::text::truncate(&other.to_string(), ERROR_TEXT_BYTES)
        )),
    }
}

/// A `tools/call` result (as JSON) as the tool's result; see the module docs.
pub(crate) fn content_json(result: &Value) -> ToolResult {
    let blocks = result["content"].as_array().map(Vec::as_slice).unwrap_or_default();
    if result["isError"] == Value::Bool(true) {
        let text: Vec<&str> = blocks.iter().filter_map(|b| b["text"].as_str()).collect();
        let text = text.join("\n");
        return Err(ToolError::failed(if text.is_empty() {
            "the MCP tool reported an error without a message".to_owned()
        } else {
            format!(
                "the MCP tool reported an error: {}",
                shared::text::truncate(&text, ERROR_TEXT_BYTES)
            )
        }));
    }
    if let Some(structured) = result.get("structuredContent").filter(|v| !v.is_null()) {
        return Ok(structured.clone());
    }
    match blocks {
        [] => Ok(Value::Null),
        [only] if only["type"] == "text" => {
            let text = only["text"].as_str().unwrap_or_default();
            Ok(serde_json::from_str(text.trim()).unwrap_or_else(|_| Value::String(text.to_owned())))
        }
        blocks => Ok(Value::Array(blocks.iter().map(describe).collect())),
    }
}

/// One content block as the model sees it.
fn describe(block: &Value) -> Value {
    let kind = block["type"].as_str().unwrap_or("unknown");
    let decoded_len = |data: &Value| data.as_str().map_or(0, |d| d.len() / 4 * 3);
    match kind {
        "text" => json!({"type": "text", "text": block["text"]}),
        "image" | "audio" => json!({
            "type": kind,
            "mimeType": block["mimeType"],
            "bytes": decoded_len(&block["data"]),
            "note": format!("{kind} data is not passed to the model"),
        }),
        "resource" => {
            let resource = &block["resource"];
            if resource.get("text").is_some() {
                json!({"type": "resource", "uri": resource["uri"], "mimeType": resource["mimeType"], "text": resource["text"]})
            } else {
                json!({
                    "type": "resource",
                    "uri": resource["uri"],
                    "mimeType": resource["mimeType"],
                    "bytes": decoded_len(&resource["blob"]),
                    "note": "binary resource data is not passed to the model",
                })
            }
        }
        "resource_link" => {
            let mut link = serde_json::Map::new();
            link.insert("type".into(), json!("resource_link"));
            for field in ["uri", "name", "title", "description", "mimeType"] {
                if let Some(value) = block.get(field).filter(|v| !v.is_null()) {
                    link.insert(field.into(), value.clone());
                }
            }
            Value::Object(link)
        }
        other => json!({"type": other, "note": "content of this type is not passed to the model"}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_mapping() {
        let text = |t: &str| json!({"content": [{"type": "text", "text": t}]});
        assert_eq!(content_json(&text("plain words")), Ok(json!("plain words")));
        assert_eq!(content_json(&text(r#"{"sum": 3}"#)), Ok(json!({"sum": 3})));
        assert_eq!(content_json(&json!({"content": []})), Ok(Value::Null));
        assert_eq!(
            content_json(&json!({"content": [{"type": "text", "text": "x"}], "structuredContent": {"t": 22.5}})),
            Ok(json!({"t": 22.5}))
        );
        let error =
            content_json(&json!({"content": [{"type": "text", "text": "no such city"}], "isError": true})).unwrap_err();
        assert_eq!(error.code, ErrorCode::Failed);
        assert!(error.message.contains("no such city"), "{error}");

        let mixed = json!({"content": [
            {"type": "text", "text": "here"},
            {"type": "image", "data": "AAAA", "mimeType": "image/png"},
            {"type": "resource", "resource": {"uri": "file:///a.txt", "mimeType": "text/plain", "text": "hello"}},
            {"type": "resource", "resource": {"uri": "file:///b.bin", "blob": "AAAAAAAA"}},
            {"type": "resource_link", "uri": "file:///c", "name": "c"},
            {"type": "video"},
        ]});
        let described = content_json(&mixed).unwrap();
        assert_eq!(described[0], json!({"type": "text", "text": "here"}));
        assert_eq!(described[1]["bytes"], 3);
        assert_eq!(described[1]["mimeType"], "image/png");
        assert_eq!(described[2]["text"], "hello");
        assert_eq!(described[3]["bytes"], 6);
        assert_eq!(
            described[4],
            json!({"type": "resource_link", "uri": "file:///c", "name": "c"})
        );
        assert_eq!(described[5]["type"], "video");
    }

    #[test]
    fn long_error_texts_are_cut() {
        let long = "é".repeat(ERROR_TEXT_BYTES);
        let error = content_json(&json!({"content": [{"type": "text", "text": long}], "isError": true})).unwrap_err();
        assert!(error.message.len() < ERROR_TEXT_BYTES + 100);
    }
}
