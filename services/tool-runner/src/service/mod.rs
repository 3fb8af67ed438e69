//! The gRPC adapter: `toolrunner.v1.ToolRunner` requests become catalog calls, catalog answers
//! become responses. No tool logic lives here. `recorded.rs`: a durable call's record (what it
//! says to do with a call, and the run of a recorded call).

mod recorded;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use proto::toolrunner::v1 as pb;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::Error;
use crate::admission::{CallPermit, REFUSED_HEADER};
use crate::catalog::Catalog;
use crate::fence::{Refusal, RunFence};
use crate::record::CallRecords;
use shared::metrics::InFlight;
use shared::telemetry::truncate;
use tonic::metadata::MetadataValue;

use crate::telemetry::metric;
use crate::tools::input::{InputAnswers, InputRequired, Output};
use crate::tools::progress::{Progress, ProgressSink};
use crate::tools::task::{TaskRef, TaskState};
use crate::tools::{CallContext, ErrorCode, ToolError, ToolSpec};

/// Response metadata of a refused replaced owner's call: the run's epoch, as its fence holds it.
pub const CURRENT_EPOCH_HEADER: &str = "x-run-epoch-current";

/// Progress reports a streamed call buffers for its caller; past them, reports are dropped.
const PROGRESS_BUFFER: usize = 16;

/// Serves `ListTools`, `RunTool` and `RunToolStream` from a [`Catalog`].
#[derive(Clone)]
pub struct ToolRunnerService {
    catalog: Arc<Catalog>,
    /// Record arguments and results on spans, truncated to this many bytes (`None`: off).
    trace_payloads: Option<usize>,
    /// Refuses a replaced orchestrator replica's calls (`None`: calls are not checked).
    fence: Option<Arc<RunFence>>,
    /// Keeps durable calls' outcomes, so that a call sent again runs once (`None`: not kept).
    records: Option<Arc<CallRecords>>,
}

impl ToolRunnerService {
    /// A service over `catalog`.
    pub fn new(catalog: Arc<Catalog>, trace_payloads: Option<usize>) -> Self {
        Self {
            catalog,
            trace_payloads,
            fence: None,
            records: None,
        }
    }

    /// The service, checking every durable call against `fence` before its tool runs.
    #[must_use]
    pub fn with_fence(mut self, fence: Option<Arc<RunFence>>) -> Self {
        self.fence = fence;
        self
    }

    /// The service, keeping durable calls' outcomes in `records`.
    #[must_use]
    pub fn with_records(mut self, records: Option<Arc<CallRecords>>) -> Self {
        self.records = records;
        self
    }

    /// Refuses the call when the run fence says it comes from a replaced owner, or cannot say.
    async fn admit(&self, call: &ToolCall) -> Result<(), Status> {
        let Some(fence) = &self.fence else { return Ok(()) };
        match fence.admit(&call.run_id, &call.call_id, call.epoch).await {
            Ok(()) => Ok(()),
            Err(refusal) => Err(self.refuse(refusal)),
        }
    }

    /// A call refused before it ran, as its status: logged, counted, and recorded on the span.
    fn refuse(&self, refusal: Refusal) -> Status {
        let span = tracing::Span::current();
        span.record("otel.status_code", "ERROR");
        let mut status = match &refusal {
            Refusal::Stale { current, .. } | Refusal::NoEpoch { current, .. } => {
                span.record("error.type", "stale_epoch");
                tracing::warn!("{refusal}");
                let mut status = Status::failed_precondition(refusal.to_string());
                status
                    .metadata_mut()
                    .insert(CURRENT_EPOCH_HEADER, MetadataValue::from(*current));
                status
            }
            Refusal::Unknown { .. } => {
                span.record("error.type", "unknown_run");
                tracing::warn!("{refusal}");
                Status::failed_precondition(refusal.to_string())
            }
            Refusal::Unreadable { .. } => {
                span.record("error.type", "run_store");
                tracing::warn!("{refusal}");
                Status::unavailable(refusal.to_string())
            }
        };
        let reason = match refusal {
            Refusal::Stale { .. } => "stale-epoch",
            Refusal::NoEpoch { .. } => "no-epoch",
            Refusal::Unknown { .. } => "unknown-run",
            Refusal::Unreadable { .. } => "run-store",
        };
        status
            .metadata_mut()
            .insert(REFUSED_HEADER, MetadataValue::from_static(reason));
        metrics::counter!(metric::REJECTED, "reason" => reason.replace('-', "_")).increment(1);
        status
    }
}

/// A `RunTool` request, checked.
struct ToolCall {
    run_id: String,
    call_id: String,
    tool_name: String,
    arguments_json: String,
    metadata: HashMap<String, String>,
    principal: String,
    epoch: u64,
    input: Option<InputAnswers>,
    task: Option<TaskRef>,
    rerun_in_doubt: bool,
}

/// The answers a request carries, each parsed as JSON.
fn input_answers(input: Option<pb::ToolInputAnswers>) -> Result<Option<InputAnswers>, Error> {
    let Some(input) = input else { return Ok(None) };
    let mut responses = std::collections::BTreeMap::new();
    for (key, json) in input.responses_json {
        let response = serde_json::from_str(&json)
            .map_err(|e| Error::InvalidRequest(format!("input.responses_json[{key:?}] is not JSON: {e}")))?;
        responses.insert(key, response);
    }
    Ok(Some(InputAnswers {
        request_state: input.request_state,
        responses,
    }))
}

impl TryFrom<pb::RunToolRequest> for ToolCall {
    type Error = Error;
    fn try_from(r: pb::RunToolRequest) -> Result<Self, Error> {
        if r.tool_name.trim().is_empty() {
            return Err(Error::InvalidRequest("tool_name is empty".into()));
        }
        Ok(Self {
            run_id: r.run_id,
            call_id: r.call_id,
            tool_name: r.tool_name,
            arguments_json: r.arguments_json,
            metadata: r.metadata,
            principal: r.principal,
            epoch: r.epoch,
            input: input_answers(r.input)?,
            task: match r.task {
                Some(task) if task.task_id.is_empty() => {
                    return Err(Error::InvalidRequest("task.task_id is empty".into()));
                }
                Some(task) => Some(TaskRef {
                    id: task.task_id,
                    cancel: task.cancel,
                }),
                None => None,
            },
            rerun_in_doubt: r.rerun_in_doubt,
        })
    }
}

impl From<&ToolSpec> for pb::ToolSpec {
    fn from(spec: &ToolSpec) -> Self {
        Self {
            name: spec.name.clone(),
            description: spec.description.clone(),
            parameters_json_schema: spec.parameters.to_string(),
            timeout_ms: u32::try_from(spec.timeout.as_millis()).unwrap_or(u32::MAX),
            source: spec.source.to_owned(),
            needs_approval: spec.needs_approval,
            mcp_protocol: spec.mcp_protocol.clone(),
            idempotent: spec.idempotent,
        }
    }
}

impl From<InputRequired> for pb::ToolInputRequired {
    fn from(asked: InputRequired) -> Self {
        Self {
            request_state: asked.request_state,
            requests: asked
                .requests
                .into_iter()
                .map(|r| pb::ToolInputRequest {
                    key: r.key,
                    mode: r.mode.as_str().to_owned(),
                    message: r.message,
                    schema_json: if r.schema.is_null() {
                        String::new()
                    } else {
                        r.schema.to_string()
                    },
                    url: r.url,
                })
                .collect(),
        }
    }
}

impl From<TaskState> for pb::ToolTask {
    fn from(task: TaskState) -> Self {
        Self {
            task_id: task.id,
            status: task.status,
            message: task.message,
            ttl_ms: task.ttl_ms.unwrap_or(0),
            poll_interval_ms: task.poll_interval_ms.unwrap_or(0),
            pinned: task.pinned,
        }
    }
}

impl From<ErrorCode> for pb::ToolErrorCode {
    fn from(code: ErrorCode) -> Self {
        match code {
            ErrorCode::NotFound => Self::NotFound,
            ErrorCode::InvalidArguments => Self::InvalidArguments,
            ErrorCode::Timeout => Self::Timeout,
            ErrorCode::Failed => Self::Failed,
            ErrorCode::PermissionDenied => Self::PermissionDenied,
            ErrorCode::Unavailable => Self::Unavailable,
            ErrorCode::Canceled => Self::Canceled,
        }
    }
}

impl From<ToolError> for pb::ToolError {
    fn from(e: ToolError) -> Self {
        Self {
            code: pb::ToolErrorCode::from(e.code).into(),
            message: e.message,
            retryable: e.retryable,
        }
    }
}

/// Logs a call the caller abandoned (its future is dropped before it finished).
struct CancelWatch {
    finished: bool,
}

impl Drop for CancelWatch {
    fn drop(&mut self) {
        if !self.finished {
            tracing::info!("call canceled by the caller; tool stopped");
        }
    }
}

#[tonic::async_trait]
impl pb::tool_runner_server::ToolRunner for ToolRunnerService {
    async fn list_tools(
        &self,
        request: Request<pb::ListToolsRequest>,
    ) -> Result<Response<pb::ListToolsResponse>, Status> {
        let caller = shared::auth::caller(&request);
        let tools = self
            .catalog
            .specs()
            .iter()
            .filter(|spec| caller.may_use(&spec.name))
            .map(pb::ToolSpec::from)
            .collect();
        Ok(Response::new(pb::ListToolsResponse {
            tools,
            records_calls: self.records.is_some(),
        }))
    }

    async fn run_tool(&self, request: Request<pb::RunToolRequest>) -> Result<Response<pb::RunToolResponse>, Status> {
        let permit = request.extensions().get::<CallPermit>().cloned();
        let (call, span) = self.admitted(request).await?;
        let plan = self.plan(&call).instrument(span.clone()).await?;
        let running = span.in_scope(|| self.run(call, None, plan, permit));
        let response = running.instrument(span).await;
        Ok(Response::new(response))
    }

    type RunToolStreamStream = futures::stream::BoxStream<'static, Result<pb::RunToolUpdate, Status>>;

    async fn run_tool_stream(
        &self,
        request: Request<pb::RunToolStreamRequest>,
    ) -> Result<Response<Self::RunToolStreamStream>, Status> {
        use futures::StreamExt as _;
        let permit = request.extensions().get::<CallPermit>().cloned();
        let (metadata, extensions, streamed) = request.into_parts();
        let call = streamed
            .call
            .ok_or_else(|| Status::invalid_argument("call is required"))?;
        let (call, span) = self.admitted(Request::from_parts(metadata, extensions, call)).await?;
        let plan = self.plan(&call).instrument(span.clone()).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(PROGRESS_BUFFER);
        let reports = tx.clone();
        let sink = ProgressSink::new(move |progress: Progress| {
            // A caller that lags misses reports, never the outcome.
            let _ = reports.try_send(Ok(pb::RunToolUpdate {
                update: Some(pb::run_tool_update::Update::Progress(pb::ToolProgress {
                    progress: progress.progress,
                    total: progress.total.unwrap_or(0.0),
                    message: progress.message,
                })),
            }));
        });
        let held = permit.clone();
        let running = span.in_scope(|| self.run(call, Some(sink), plan, permit));
        tokio::spawn(
            async move {
                tokio::select! {
                    // The caller went away: dropping the call stops the tool (a recorded call
                    // goes on to its end, holding its place).
                    () = tx.closed() => {}
                    response = running => {
                        let done = pb::RunToolUpdate {
                            update: Some(pb::run_tool_update::Update::Done(response)),
                        };
                        let _ = tx.send(Ok(done)).await;
                    }
                }
                drop(held);
            }
            .instrument(span),
        );
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(rx).boxed()))
    }
}

impl ToolRunnerService {
    /// A request checked and let in: its call, and the call's span (continuing the caller's
    /// trace). A call refused (arguments, permission, the run fence) is the RPC's error.
    async fn admitted(&self, request: Request<pb::RunToolRequest>) -> Result<(ToolCall, tracing::Span), Status> {
        let trace_context = request.metadata().clone();
        let caller = shared::auth::caller(&request);
        let call = ToolCall::try_from(request.into_inner())?;
        if !caller.may_use(&call.tool_name) {
            return Err(Status::permission_denied(format!(
                "principal {:?} may not run tool {:?} on this runner",
                caller.name, call.tool_name
            )));
        }
        let span = execute_tool_span(&call);
        shared::telemetry::continue_trace(&span, &trace_context);
        if let Some(max) = self.trace_payloads {
            span.record("gen_ai.tool.call.arguments", truncate(&call.arguments_json, max));
        }
        self.admit(&call).instrument(span.clone()).await?;
        Ok((call, span))
    }

    /// Runs an admitted call (its progress reports to `progress`), recorded and measured.
    async fn execute(&self, call: ToolCall, progress: Option<ProgressSink>) -> pb::RunToolResponse {
        let started = Instant::now();
        let _in_flight = InFlight::new(metric::IN_FLIGHT);
        let mut watch = CancelWatch { finished: false };
        let ctx = CallContext {
            run_id: call.run_id.clone(),
            call_id: call.call_id.clone(),
            metadata: call.metadata.clone(),
            principal: call.principal.clone(),
            epoch: call.epoch,
            input: call.input.clone(),
            task: call.task.clone(),
            progress,
        };
        let result = self.catalog.run(&call.tool_name, &call.arguments_json, &ctx).await;
        watch.finished = true;
        let elapsed = started.elapsed();
        let (outcome, label) = self.record(result, elapsed);
        // Unknown names share one label, so callers cannot grow the metrics without bound.
        let tool = if self.catalog.has(&call.tool_name) {
            call.tool_name
        } else {
            "_unknown".to_owned()
        };
        metrics::counter!(metric::EXECUTIONS, "tool" => tool.clone(), "outcome" => label).increment(1);
        metrics::histogram!(metric::EXECUTION_DURATION, "tool" => tool).record(elapsed.as_secs_f64());
        pb::RunToolResponse {
            outcome: Some(outcome),
            duration_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

impl ToolRunnerService {
    /// A call's result as the response outcome, logged and recorded on the current span (the
    /// result itself only when payloads are traced); returns the outcome and its metric label.
    fn record(
        &self,
        result: Result<Output, ToolError>,
        elapsed: std::time::Duration,
    ) -> (pb::run_tool_response::Outcome, String) {
        let duration_ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
        let span = tracing::Span::current();
        match result {
            Ok(Output::InputRequired(asked)) => {
                let keys: Vec<&str> = asked.requests.iter().map(|r| r.key.as_str()).collect();
                tracing::info!(duration_ms, ?keys, "the tool asks for input before it can finish");
                (
                    pb::run_tool_response::Outcome::InputRequired(asked.into()),
                    "input_required".to_owned(),
                )
            }
            Ok(Output::Task(task)) => {
                tracing::info!(duration_ms, mcp.task.id = %task.id, status = %task.status, "the call runs as a task");
                (pb::run_tool_response::Outcome::Task(task.into()), "task".to_owned())
            }
            Ok(Output::Done(value)) => {
                let json = value.to_string();
                if let Some(max) = self.trace_payloads {
                    span.record("gen_ai.tool.call.result", truncate(&json, max));
                }
                tracing::info!(duration_ms, "tool call succeeded");
                (pb::run_tool_response::Outcome::ContentJson(json), "ok".to_owned())
            }
            Err(error) => {
                let code = error.code.to_string();
                span.record("error.type", code.as_str());
                span.record("otel.status_code", "ERROR");
                tracing::info!(duration_ms, code = %error.code, "tool call failed: {}", error.message);
                (pb::run_tool_response::Outcome::Error(error.into()), code)
            }
        }
    }
}

/// The call's span, named and attributed by the OpenTelemetry GenAI conventions; arguments,
/// result and error are recorded on it as they become known.
fn execute_tool_span(call: &ToolCall) -> tracing::Span {
    tracing::info_span!(
        "execute_tool",
        otel.name = %format!("execute_tool {}", call.tool_name),
        otel.kind = "server",
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = %call.tool_name,
        gen_ai.tool.call.id = %call.call_id,
        gen_ai.tool.type = "function",
        gen_ai.conversation.id = %call.run_id,
        enduser.id = %call.principal,
        gen_ai.tool.call.arguments = tracing::field::Empty,
        gen_ai.tool.call.result = tracing::field::Empty,
        error.type = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        metadata = ?call.metadata,
    )
}
