//! A2A's JSON-RPC 2.0 binding: one `POST` per call, its `params` a message of A2A's contract in
//! its JSON mapping; `SendStreamingMessage` and `SubscribeToTask` answer with server-sent events,
//! each a JSON-RPC answer carrying a `StreamResponse`. Each method calls the gRPC service in
//! process as the caller: `SendMessage` starts the run in the background (`StartRun`) and, unless
//! asked to return at once, follows it (`AttachRun`) until it ends or waits for a person; a
//! message naming a live task joins its run (`SendMessage` of the orchestrator: steering).
//! Refusals map onto A2A's codes: a task not found (another principal's too) is -32001.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::http::{StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use proto::lf::a2a::v1 as a2a;
use proto::orchestrator::v1 as pb;
use proto::orchestrator::v1::orchestrator_server::Orchestrator;
use serde_json::{Value, json};
use shared::auth::Principal;
use tonic::{Request, Status};

use super::error::{RpcError, error_body};
use super::{A2a, tasks};

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
    let call = Call {
        server,
        agent: agent.as_deref(),
        principal,
    };
    let answered = match method {
        "SendStreamingMessage" => return call.stream_new(id, params).await,
        "SubscribeToTask" => return call.subscribe(id, params).await,
        "SendMessage" => call.send_message(params).await,
        "GetTask" => call.get_task(params).await,
        "ListTasks" => call.list_tasks(params).await,
        "CancelTask" => call.cancel_task(params).await,
        "GetExtendedAgentCard" => Err(RpcError::new(-32007, "this agent has no extended card")),
        "CreateTaskPushNotificationConfig"
        | "GetTaskPushNotificationConfig"
        | "ListTaskPushNotificationConfigs"
        | "DeleteTaskPushNotificationConfig" => Err(RpcError::new(-32003, "push notifications are not served here")),
        other => Err(RpcError::new(-32601, format!("no method {other:?}"))),
    };
    json_answer(match answered {
        Ok(result) => result_body(id, result),
        Err(error) => error_body(id, error),
    })
}

/// `params` as the A2A message `name`.
fn params<M: prost::Message + Default>(params: Value, name: &str) -> Result<M, RpcError> {
    crate::json::from_json_lenient(params, &format!("lf.a2a.v1.{name}")).map_err(RpcError::invalid_params)
}

/// `message` as JSON, of A2A's type `name`.
fn out<M: prost::Message>(message: &M, name: &str) -> Result<Value, RpcError> {
    crate::json::to_sparse_json(message, &format!("lf.a2a.v1.{name}")).map_err(RpcError::internal)
}

/// How long `CancelTask` waits for the run it canceled to read ended before it answers.
const CANCEL_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// What the caller replied to (see `tasks::asked`).
type Answered = std::collections::HashSet<String>;

type Events = Pin<Box<dyn Stream<Item = Result<pb::OrchestrateEvent, Status>> + Send>>;

/// One call's caller and endpoint.
struct Call<'a> {
    server: &'a A2a,
    agent: Option<&'a str>,
    principal: Arc<Principal>,
}

impl Call<'_> {
    /// `message` as the orchestrator's request of the caller.
    fn request<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        request.extensions_mut().insert(Arc::clone(&self.principal));
        request
    }

    async fn unary<Q, A, Fut>(&self, message: Q, handler: impl FnOnce(Request<Q>) -> Fut) -> Result<A, RpcError>
    where
        Fut: Future<Output = Result<tonic::Response<A>, Status>>,
    {
        Ok(handler(self.request(message)).await?.into_inner())
    }

    async fn get_run(&self, run_id: &str) -> Result<pb::RunResult, RpcError> {
        let service = &self.server.service;
        self.unary(pb::GetRunRequest { run_id: run_id.into() }, |r| service.get_run(r))
            .await
    }

    async fn attach(&self, run_id: &str) -> Result<Events, RpcError> {
        let service = &self.server.service;
        let asked = pb::AttachRunRequest {
            run_id: run_id.into(),
            after_seq: 0,
        };
        self.unary(asked, |r| service.attach_run(r)).await
    }

    /// Follows task `task_id`'s run until it ends or waits for its caller (the stream ends
    /// there too).
    async fn until_it_stops(&self, task_id: &str, answered: Answered) -> Result<(), RpcError> {
        let mut events = self.attach(task_id).await?;
        let mut streamer = tasks::Streamer::new(task_id, "").after(answered);
        while let Some(event) = events.next().await {
            if streamer.items(&event?).1 {
                break;
            }
        }
        Ok(())
    }

    /// Starts the task `message` begins (a run in the background), or takes `message` as a
    /// reply to the task it names (see [`Self::reply`]); the task's id, and what the caller
    /// replied to.
    async fn begin(&self, message: &a2a::Message) -> Result<(String, Answered), RpcError> {
        let service = &self.server.service;
        if !message.task_id.is_empty() {
            let answered = self.reply(message).await?;
            return Ok((message.task_id.clone(), answered));
        }
        let request = tasks::run_request(message, self.agent)?;
        let started = self.unary(request, |r| service.start_run(r)).await?;
        Ok((started.run_id, Answered::new()))
    }

    /// A message on a live task: for one waiting for its caller, the decisions or answers it
    /// says (`DecideToolCalls`, `AnswerToolInput`); for another, a message that joins its run
    /// at its next turn (`SendMessage`). A task that has ended takes none.
    async fn reply(&self, message: &a2a::Message) -> Result<Answered, RpcError> {
        let service = &self.server.service;
        let run = self.get_run(&message.task_id).await?;
        match tasks::run_state(&run) {
            a2a::TaskState::InputRequired => {
                let answered = tasks::asked(&run);
                match tasks::reply(&run, message)? {
                    tasks::Reply::Decide(decisions) => {
                        let decide = pb::DecideToolCallsRequest {
                            run_id: run.run_id.clone(),
                            decisions,
                        };
                        self.unary(decide, |r| service.decide_tool_calls(r)).await?;
                    }
                    tasks::Reply::Answer(requests) => {
                        for answer in requests {
                            self.unary(answer, |r| service.answer_tool_input(r)).await?;
                        }
                    }
                }
                return Ok(answered);
            }
            a2a::TaskState::Working => {}
            _ => {
                return Err(RpcError::unsupported(format!(
                    "task {:?} has ended: send a message without its taskId (in its context) to go on",
                    run.run_id
                )));
            }
        }
        {
            let content = tasks::user_text(message)?;
            let steer = pb::SendMessageRequest {
                run_id: message.task_id.clone(),
                message: Some(pb::ChatMessage {
                    role: "user".into(),
                    content,
                    ..Default::default()
                }),
            };
            self.unary(steer, |r| service.send_message(r)).await?;
        }
        Ok(Answered::new())
    }

    /// `SendMessage`: the task, once its run ended or waits for its caller (at once with
    /// `returnImmediately`).
    async fn send_message(&self, params: Value) -> Result<Value, RpcError> {
        let asked: a2a::SendMessageRequest = self::params(params, "SendMessageRequest")?;
        let message = asked
            .message
            .ok_or_else(|| RpcError::invalid_params("params.message is required"))?;
        let (task_id, answered) = self.begin(&message).await?;
        let at_once = asked.configuration.is_some_and(|c| c.return_immediately);
        if !at_once {
            self.until_it_stops(&task_id, answered).await?;
        }
        let run = self.get_run(&task_id).await?;
        let answer = a2a::SendMessageResponse {
            payload: Some(a2a::send_message_response::Payload::Task(tasks::task(&run, true))),
        };
        out(&answer, "SendMessageResponse")
    }

    async fn get_task(&self, params: Value) -> Result<Value, RpcError> {
        let asked: a2a::GetTaskRequest = self::params(params, "GetTaskRequest")?;
        let run = self.get_run(&asked.id).await?;
        out(&tasks::task(&run, true), "Task")
    }

    /// `ListTasks`: the caller's runs (every principal's for an operator), newest first.
    async fn list_tasks(&self, params: Value) -> Result<Value, RpcError> {
        let asked: a2a::ListTasksRequest = self::params(params, "ListTasksRequest")?;
        let statuses = match a2a::TaskState::try_from(asked.status).unwrap_or(a2a::TaskState::Unspecified) {
            a2a::TaskState::Unspecified => Vec::new(),
            state => statuses_in(state),
        };
        let listing = pb::ListRunsRequest {
            statuses,
            thread_id: asked.context_id,
            page_size: asked.page_size.and_then(|n| u32::try_from(n).ok()).unwrap_or(0),
            page_token: asked.page_token,
            agent: self.agent.unwrap_or_default().to_owned(),
            ..Default::default()
        };
        let service = &self.server.service;
        let page = self.unary(listing, |r| service.list_runs(r)).await?;
        let tasks: Vec<a2a::Task> = page.runs.iter().map(tasks::listed).collect();
        let count = i32::try_from(tasks.len()).unwrap_or(i32::MAX);
        let answer = a2a::ListTasksResponse {
            tasks,
            next_page_token: page.next_page_token,
            page_size: count,
            total_size: count,
        };
        out(&answer, "ListTasksResponse")
    }

    /// `CancelTask`: the run canceled at once; a task that had ended is not cancelable.
    async fn cancel_task(&self, params: Value) -> Result<Value, RpcError> {
        let asked: a2a::CancelTaskRequest = self::params(params, "CancelTaskRequest")?;
        let service = &self.server.service;
        let cancel = pb::CancelRunRequest {
            run_id: asked.id.clone(),
            ..Default::default()
        };
        let answer = self.unary(cancel, |r| service.cancel_run(r)).await?;
        if !answer.canceled {
            return Err(RpcError::new(
                -32002,
                format!("task {:?} has ended: it cannot be canceled", asked.id),
            ));
        }
        // The task as canceled: once its run has ended (at once, or at the end of the call it
        // was making), within the wait a cancel takes.
        let _ = tokio::time::timeout(CANCEL_WAIT, self.until_it_stops(&asked.id, Answered::new())).await;
        let run = self.get_run(&asked.id).await?;
        out(&tasks::task(&run, true), "Task")
    }

    /// `SendStreamingMessage`: the task, then its stream from its run's first event.
    async fn stream_new(&self, id: Value, params: Value) -> Response {
        let begun = async {
            let asked: a2a::SendMessageRequest = self::params(params, "SendMessageRequest")?;
            let message = asked
                .message
                .ok_or_else(|| RpcError::invalid_params("params.message is required"))?;
            self.begin(&message).await
        };
        match begun.await {
            Ok((task_id, answered)) => self.stream(id, &task_id, answered).await,
            Err(error) => json_answer(error_body(id, error)),
        }
    }

    /// `SubscribeToTask`: a live task's stream, from its run's first event (so nothing is
    /// missed, whichever replica answers); an ended task has none.
    async fn subscribe(&self, id: Value, params: Value) -> Response {
        let asked = match self::params::<a2a::SubscribeToTaskRequest>(params, "SubscribeToTaskRequest") {
            Ok(asked) => asked,
            Err(error) => return json_answer(error_body(id, error)),
        };
        self.stream(id, &asked.id, Answered::new()).await
    }

    /// Task `task_id` as it is (without its text, which the stream brings), then its stream
    /// (past the asks the caller `answered`).
    async fn stream(&self, id: Value, task_id: &str, answered: Answered) -> Response {
        let opened = async {
            let run = self.get_run(task_id).await?;
            if !run_is_live(&run) {
                return Err(RpcError::unsupported(format!(
                    "task {task_id:?} has ended: it has no stream"
                )));
            }
            let events = self.attach(task_id).await?;
            Ok((run, events))
        };
        let (run, events) = match opened.await {
            Ok(opened) => opened,
            Err(error) => return json_answer(error_body(id, error)),
        };
        let first = a2a::StreamResponse {
            payload: Some(a2a::stream_response::Payload::Task(tasks::task(&run, false))),
        };
        let streamer = tasks::Streamer::new(task_id, &tasks::context(&run)).after(answered);
        Sse::new(sse(id, first, events, streamer))
            .keep_alive(KeepAlive::default())
            .into_response()
    }
}

fn run_is_live(run: &pb::RunResult) -> bool {
    let state = tasks::run_state(run);
    !tasks::stops_stream(state) || state == a2a::TaskState::InputRequired
}

/// The runs statuses a task state stands for.
fn statuses_in(state: a2a::TaskState) -> Vec<i32> {
    use pb::RunStatus as S;
    let statuses: &[S] = match state {
        a2a::TaskState::Working | a2a::TaskState::Submitted => &[S::Running, S::AwaitingTask],
        a2a::TaskState::InputRequired => &[S::AwaitingApproval, S::AwaitingInput],
        a2a::TaskState::Completed => &[S::Completed],
        a2a::TaskState::Failed => &[S::Failed],
        a2a::TaskState::Canceled => &[S::Canceled],
        _ => &[],
    };
    statuses.iter().map(|s| *s as i32).collect()
}

/// The server-sent events of a task's stream: `first`, then what the run's `events` say, each a
/// JSON-RPC answer to call `id`; it ends when the task ends or waits for its caller.
fn sse(
    id: Value,
    first: a2a::StreamResponse,
    events: Events,
    streamer: tasks::Streamer,
) -> impl Stream<Item = Result<Event, std::convert::Infallible>> + Send {
    let frame = move |item: &a2a::StreamResponse, id: &Value| {
        let body = match out(item, "StreamResponse") {
            Ok(result) => result_body(id.clone(), result),
            Err(error) => error_body(id.clone(), error),
        };
        Ok(Event::default().data(body))
    };
    let opening = frame(&first, &id);
    let rest = futures::stream::unfold((events, streamer, false), move |(mut events, mut streamer, ended)| {
        let id = id.clone();
        async move {
            if ended {
                return None;
            }
            loop {
                match events.next().await {
                    Some(Ok(event)) => {
                        let (items, ends) = streamer.items(&event);
                        if items.is_empty() && !ends {
                            continue;
                        }
                        let frames: Vec<_> = items.iter().map(|item| frame(item, &id)).collect();
                        return Some((futures::stream::iter(frames), (events, streamer, ends)));
                    }
                    Some(Err(status)) => {
                        let broke = Ok(Event::default().data(error_body(id.clone(), status.into())));
                        return Some((futures::stream::iter(vec![broke]), (events, streamer, true)));
                    }
                    None => return None,
                }
            }
        }
    })
    .flatten();
    futures::stream::once(async move { opening }).chain(rest)
}
