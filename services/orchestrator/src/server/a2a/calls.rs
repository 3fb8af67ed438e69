//! The A2A operations both bindings call (`jsonrpc.rs`, `grpc.rs`), in A2A's messages: each goes
//! through the gRPC service in process as the caller. `SendMessage` starts the run in the
//! background (`StartRun`) and, unless asked to return at once, follows it (`AttachRun`) until
//! it ends or waits for its caller; a message naming a task is a reply to it
//! ([`Call::reply`]); a task's stream reads its run from the first event.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use proto::lf::a2a::v1 as a2a;
use proto::orchestrator::v1 as pb;
use proto::orchestrator::v1::orchestrator_server::Orchestrator;
use shared::auth::Principal;
use tonic::{Request, Status};

use super::error::RpcError;
use super::{A2a, tasks};

/// How long `CancelTask` waits for the run it canceled to read ended before it answers.
const CANCEL_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// What the caller replied to (see `tasks::asked`).
type Answered = std::collections::HashSet<String>;

type Events = Pin<Box<dyn Stream<Item = Result<pb::OrchestrateEvent, Status>> + Send>>;

/// A task's stream: its items, or the refusal that broke it.
pub(super) type TaskStream = Pin<Box<dyn Stream<Item = Result<a2a::StreamResponse, RpcError>> + Send>>;

/// One call's caller and endpoint.
pub(super) struct Call<'a> {
    pub server: &'a A2a,
    /// The named agent the endpoint (or the request's tenant) names.
    pub agent: Option<String>,
    pub principal: Arc<Principal>,
}

impl Call<'_> {
    /// `message` as the orchestrator's request of the caller.
    fn request<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        request.extensions_mut().insert(Arc::clone(&self.principal));
        request
    }

    pub(super) async fn unary<Q, A, Fut>(
        &self,
        message: Q,
        handler: impl FnOnce(Request<Q>) -> Fut,
    ) -> Result<A, RpcError>
    where
        Fut: Future<Output = Result<tonic::Response<A>, Status>>,
    {
        Ok(handler(self.request(message)).await?.into_inner())
    }

    pub(super) async fn get_run(&self, run_id: &str) -> Result<pb::RunResult, RpcError> {
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
        let request = tasks::run_request(message, self.agent.as_deref())?;
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
    pub(super) async fn send_message(
        &self,
        asked: a2a::SendMessageRequest,
    ) -> Result<a2a::SendMessageResponse, RpcError> {
        let message = asked
            .message
            .ok_or_else(|| RpcError::invalid_params("params.message is required"))?;
        let (task_id, answered) = self.begin(&message).await?;
        self.push_asked(&message, asked.configuration.as_ref(), &task_id)
            .await?;
        let at_once = asked.configuration.is_some_and(|c| c.return_immediately);
        if !at_once {
            self.until_it_stops(&task_id, answered).await?;
        }
        let run = self.get_run(&task_id).await?;
        Ok(a2a::SendMessageResponse {
            payload: Some(a2a::send_message_response::Payload::Task(tasks::task(&run, true))),
        })
    }

    pub(super) async fn get_task(&self, asked: a2a::GetTaskRequest) -> Result<a2a::Task, RpcError> {
        let run = self.get_run(&asked.id).await?;
        Ok(tasks::task(&run, true))
    }

    /// `ListTasks`: the caller's runs (every principal's for an operator), newest first.
    pub(super) async fn list_tasks(&self, asked: a2a::ListTasksRequest) -> Result<a2a::ListTasksResponse, RpcError> {
        let statuses = match a2a::TaskState::try_from(asked.status).unwrap_or(a2a::TaskState::Unspecified) {
            a2a::TaskState::Unspecified => Vec::new(),
            state => statuses_in(state),
        };
        let listing = pb::ListRunsRequest {
            statuses,
            thread_id: asked.context_id,
            page_size: asked.page_size.and_then(|n| u32::try_from(n).ok()).unwrap_or(0),
            page_token: asked.page_token,
            agent: self.agent.clone().unwrap_or_default(),
            ..Default::default()
        };
        let service = &self.server.service;
        let page = self.unary(listing, |r| service.list_runs(r)).await?;
        let tasks: Vec<a2a::Task> = page.runs.iter().map(tasks::listed).collect();
        let count = i32::try_from(tasks.len()).unwrap_or(i32::MAX);
        Ok(a2a::ListTasksResponse {
            tasks,
            next_page_token: page.next_page_token,
            page_size: count,
            total_size: count,
        })
    }

    /// `CancelTask`: the run canceled at once; a task that had ended is not cancelable.
    pub(super) async fn cancel_task(&self, asked: a2a::CancelTaskRequest) -> Result<a2a::Task, RpcError> {
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
        Ok(tasks::task(&run, true))
    }

    /// `SendStreamingMessage`: the task, then its stream from its run's first event.
    pub(super) async fn stream_new(&self, asked: a2a::SendMessageRequest) -> Result<TaskStream, RpcError> {
        let message = asked
            .message
            .ok_or_else(|| RpcError::invalid_params("params.message is required"))?;
        let (task_id, answered) = self.begin(&message).await?;
        self.push_asked(&message, asked.configuration.as_ref(), &task_id)
            .await?;
        self.stream(&task_id, answered).await
    }

    /// Registers the push-notification config a message that started task `task_id` carries.
    async fn push_asked(
        &self,
        message: &a2a::Message,
        configuration: Option<&a2a::SendMessageConfiguration>,
        task_id: &str,
    ) -> Result<(), RpcError> {
        let asked = configuration.and_then(|c| c.task_push_notification_config.clone());
        if let (Some(config), true) = (asked, message.task_id.is_empty()) {
            self.create_push(a2a::TaskPushNotificationConfig {
                task_id: task_id.to_owned(),
                ..config
            })
            .await?;
        }
        Ok(())
    }

    /// `SubscribeToTask`: a live task's stream, from its run's first event (so nothing is
    /// missed, whichever replica answers); an ended task has none.
    pub(super) async fn subscribe(&self, asked: a2a::SubscribeToTaskRequest) -> Result<TaskStream, RpcError> {
        self.stream(&asked.id, Answered::new()).await
    }

    /// Task `task_id` as it is (without its text, which the stream brings), then its stream
    /// (past the asks the caller `answered`); it ends when the task ends or waits for its caller.
    async fn stream(&self, task_id: &str, answered: Answered) -> Result<TaskStream, RpcError> {
        let run = self.get_run(task_id).await?;
        if !run_is_live(&run) {
            return Err(RpcError::unsupported(format!(
                "task {task_id:?} has ended: it has no stream"
            )));
        }
        let events = self.attach(task_id).await?;
        let first = a2a::StreamResponse {
            payload: Some(a2a::stream_response::Payload::Task(tasks::task(&run, false))),
        };
        let streamer = tasks::Streamer::new(task_id, &tasks::context(&run)).after(answered);
        Ok(task_stream(first, events, streamer))
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

/// `first`, then what the run's `events` say, until the task ends or waits for its caller.
fn task_stream(first: a2a::StreamResponse, events: Events, streamer: tasks::Streamer) -> TaskStream {
    let rest = futures::stream::unfold(
        (events, streamer, false),
        |(mut events, mut streamer, ended)| async move {
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
                        let items: Vec<_> = items.into_iter().map(Ok).collect();
                        return Some((futures::stream::iter(items), (events, streamer, ends)));
                    }
                    Some(Err(status)) => {
                        let broke = vec![Err(RpcError::from(status))];
                        return Some((futures::stream::iter(broke), (events, streamer, true)));
                    }
                    None => return None,
                }
            }
        },
    )
    .flatten();
    futures::stream::once(async move { Ok(first) }).chain(rest).boxed()
}
