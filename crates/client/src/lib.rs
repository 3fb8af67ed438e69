//! A Rust client of the Orchestrator service, on the contract crate (`proto`) and tonic alone.
//!
//! * [`ClientBuilder`] connects: plaintext or TLS (a CA, optionally a client certificate for
//!   mTLS), a bearer token sent with every call, a connect timeout, and a [`Retry`] policy for
//!   calls refused with `UNAVAILABLE` or `RESOURCE_EXHAUSTED` before they started.
//! * [`RunRequest`] builds an `OrchestrateRequest`: the prompt or conversation, tools, exit tools,
//!   limits, model parameters, metadata.
//! * [`Client::orchestrate`] returns a [`RunStream`] of typed [`Event`]s; [`RunStream::result`]
//!   reads it to the run's [`RunResult`](pb::RunResult), and [`Client::run`] does both. Dropping a
//!   stream before the run finished cancels the run (`CancelRun`), detached runs included.
//! * A stream follows its run across replicas: drained (`UNAVAILABLE`) or broken off, it
//!   re-attaches (`AttachRun`) from the last seq it saw, so the caller sees one stream without
//!   gaps or duplicates. [`Client::attach`] joins a run from any seq, e.g. after a restart.
//! * [`Client::start`] starts a run in the background and returns its id at once; the run is
//!   bounded by its own timeout, and anyone allowed follows it with [`Client::attach`].
//!
//! ```no_run
//! use orchestrator_client::{ClientBuilder, Event, RunRequest};
//!
//! # async fn demo() -> Result<(), orchestrator_client::Error> {
//! let client = ClientBuilder::new("http://127.0.0.1:50051").token("s3cret").connect().await?;
//! let request = RunRequest::prompt("What is 6 * 7?")
//!     .tool("calculate")
//!     .exit_tool("submit_report", "File the answer");
//! let mut run = client.orchestrate(request).await?;
//! while let Some(event) = run.next_event().await? {
//!     match event {
//!         Event::Text { text, .. } => print!("{text}"),
//!         Event::Signal(signal) => println!("\nsignal {} {}", signal.tool_name, signal.arguments_json),
//!         Event::Finished(result) => println!("\n{:?}", result.status()),
//!         _ => {}
//!     }
//! }
//! # Ok(())
//! # }
//! ```

mod builder;
mod error;
mod request;
mod retry;
mod stream;

use std::time::Duration;

use futures::Stream;
use proto::orchestrator::v1 as pb;
use tonic::transport::Channel;

pub use builder::{ClientBuilder, DEFAULT_MAX_MESSAGE_BYTES};
pub use error::{Error, code_name};
pub use proto::orchestrator::v1;
pub use request::RunRequest;
pub use retry::Retry;
pub use stream::{Event, Replay, RunStream, Transcript};

/// Decisions on calls waiting for approval, for [`Client::decide`].
pub mod decision {
    use super::pb;

    /// Run the call as the model wrote it.
    pub fn approve(call_id: impl Into<String>) -> pb::ToolCallDecision {
        pb::ToolCallDecision {
            call_id: call_id.into(),
            kind: pb::DecisionKind::Approve.into(),
            ..Default::default()
        }
    }

    /// Do not run it; `message` is fed back to the model as the call's error.
    pub fn reject(call_id: impl Into<String>, message: impl Into<String>) -> pb::ToolCallDecision {
        pb::ToolCallDecision {
            call_id: call_id.into(),
            kind: pb::DecisionKind::Reject.into(),
            message: message.into(),
            ..Default::default()
        }
    }

    /// Run it with `arguments_json` instead (a JSON object the tool's schema accepts).
    pub fn edit(call_id: impl Into<String>, arguments_json: impl Into<String>) -> pb::ToolCallDecision {
        pb::ToolCallDecision {
            call_id: call_id.into(),
            kind: pb::DecisionKind::ApproveEdited.into(),
            arguments_json: arguments_json.into(),
            ..Default::default()
        }
    }

    /// The answer to question `key` of a call that asks (`AnswerToolInput`): accepted with
    /// `content_json` (a JSON object its schema takes; empty for a URL question, whose page the
    /// person visited).
    pub fn accept(key: impl Into<String>, content_json: impl Into<String>) -> pb::ToolInputAnswer {
        answer(key, pb::InputAction::Accept, content_json)
    }

    /// Question `key` declined.
    pub fn decline(key: impl Into<String>) -> pb::ToolInputAnswer {
        answer(key, pb::InputAction::Decline, "")
    }

    /// Question `key` dismissed without a choice.
    pub fn cancel(key: impl Into<String>) -> pb::ToolInputAnswer {
        answer(key, pb::InputAction::Cancel, "")
    }

    fn answer(key: impl Into<String>, action: pb::InputAction, content_json: impl Into<String>) -> pb::ToolInputAnswer {
        pb::ToolInputAnswer {
            key: key.into(),
            action: action.into(),
            content_json: content_json.into(),
        }
    }
}

/// A connected client; cheap to clone (clones share the connection).
#[derive(Clone, Debug)]
pub struct Client {
    inner: pb::orchestrator_client::OrchestratorClient<Channel>,
    /// `Bearer <token>`, checked when the client was built.
    authorization: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    retry: Retry,
    /// Deadline of each call (a whole run for `orchestrate`).
    timeout: Duration,
}

impl Client {
    /// Starts a run and returns its event stream. A call refused before it started
    /// (`UNAVAILABLE`, `RESOURCE_EXHAUSTED`) is tried again under the [`Retry`] policy.
    pub async fn orchestrate(&self, request: RunRequest) -> Result<RunStream, Error> {
        let response = self
            .retried_response(request.into_proto(), |mut client, request| async move {
                client.orchestrate(request).await
            })
            .await?;
        let replay = Replay::of(response.metadata());
        Ok(RunStream::new(response.into_inner(), self.clone()).replaying(replay))
    }

    /// Starts a run in the background (`StartRun`) and returns as soon as it is let in, with
    /// its id (`run_id`), `RUN_STATUS_RUNNING` and how long it waited for a run slot. The run is
    /// detached and bounded by its own run timeout, never by this call's deadline; follow it with
    /// [`attach`](Self::attach), [`get_run`](Self::get_run) or [`cancel_run`](Self::cancel_run).
    /// A run id whose run had ended starts nothing: the answer carries that run's final status.
    /// Refusals before the run started (`UNAVAILABLE`, `RESOURCE_EXHAUSTED`) are tried again
    /// under the [`Retry`] policy.
    pub async fn start(&self, request: RunRequest) -> Result<pb::StartRunResponse, Error> {
        Ok(self
            .retried(request.into_proto(), |mut client, request| async move {
                client.start_run(request).await
            })
            .await?)
    }

    /// The named agents this caller may use (`ListAgents`), by name.
    pub async fn list_agents(&self) -> Result<Vec<pb::Agent>, Error> {
        let answer = self
            .retried(pb::ListAgentsRequest {}, |mut client, request| async move {
                client.list_agents(request).await
            })
            .await?;
        Ok(answer.agents)
    }

    /// Registers a webhook (`CreateWebhook`): the answer holds its secret, shown this once.
    pub async fn create_webhook(&self, request: pb::CreateWebhookRequest) -> Result<pb::Webhook, Error> {
        Ok(self
            .retried(request, |mut client, request| async move {
                client.create_webhook(request).await
            })
            .await?)
    }

    /// This caller's webhooks (`ListWebhooks`), without their secrets.
    pub async fn list_webhooks(&self) -> Result<Vec<pb::Webhook>, Error> {
        let answer = self
            .retried(pb::ListWebhooksRequest {}, |mut client, request| async move {
                client.list_webhooks(request).await
            })
            .await?;
        Ok(answer.webhooks)
    }

    /// Deletes one of this caller's webhooks (`DeleteWebhook`).
    pub async fn delete_webhook(&self, webhook_id: &str) -> Result<(), Error> {
        let request = pb::DeleteWebhookRequest {
            webhook_id: webhook_id.to_owned(),
        };
        self.retried(request, |mut client, request| async move {
            client.delete_webhook(request).await
        })
        .await?;
        Ok(())
    }

    /// This caller's webhook deliveries, newest first (`ListWebhookDeliveries`).
    pub async fn list_webhook_deliveries(
        &self,
        request: pb::ListWebhookDeliveriesRequest,
    ) -> Result<Vec<pb::WebhookDelivery>, Error> {
        let answer = self
            .retried(request, |mut client, request| async move {
                client.list_webhook_deliveries(request).await
            })
            .await?;
        Ok(answer.deliveries)
    }

    /// Attaches to a live or finished run (`AttachRun`): its events after `after_seq` (0: from the
    /// start), then the live ones up to `run_finished`, from any replica. The stream re-attaches
    /// by itself as [`orchestrate`](Self::orchestrate)'s does; dropping it does not cancel the
    /// run. `NOT_FOUND` when the run is unknown or expired, `OUT_OF_RANGE` when the run's log no
    /// longer keeps the events after `after_seq`.
    pub async fn attach(&self, run_id: &str, after_seq: u64) -> Result<RunStream, Error> {
        let events = self.attach_call(run_id, after_seq).await?;
        Ok(RunStream::attached(events, self.clone(), run_id, after_seq))
    }

    /// One `AttachRun` call under the retry policy.
    pub(crate) async fn attach_call(
        &self,
        run_id: &str,
        after_seq: u64,
    ) -> Result<tonic::Streaming<pb::OrchestrateEvent>, tonic::Status> {
        let request = pb::AttachRunRequest {
            run_id: run_id.into(),
            after_seq,
        };
        self.retried(request, |mut client, request| async move {
            client.attach_run(request).await
        })
        .await
    }

    /// Runs `request` to its end and returns its result (whatever the status).
    pub async fn run(&self, request: RunRequest) -> Result<pb::RunResult, Error> {
        self.orchestrate(request).await?.result().await
    }

    /// The result of a live or finished run (`NOT_FOUND` when unknown or expired).
    pub async fn get_run(&self, run_id: &str) -> Result<pb::RunResult, Error> {
        let request = pb::GetRunRequest { run_id: run_id.into() };
        Ok(self
            .retried(
                request,
                |mut client, request| async move { client.get_run(request).await },
            )
            .await?)
    }

    /// A thread: its messages, the runs they came from, the run holding it (`NOT_FOUND` for an
    /// unknown thread, or another caller's).
    pub async fn thread(&self, thread_id: &str) -> Result<pb::Thread, Error> {
        let request = pb::GetThreadRequest {
            thread_id: thread_id.into(),
        };
        Ok(self
            .retried(request, |mut client, request| async move {
                client.get_thread(request).await
            })
            .await?)
    }

    /// Deletes a thread; `FAILED_PRECONDITION` while a run holds it or waits for it.
    pub async fn delete_thread(&self, thread_id: &str) -> Result<bool, Error> {
        let request = pb::DeleteThreadRequest {
            thread_id: thread_id.into(),
        };
        let answer = self
            .retried(request, |mut client, request| async move {
                client.delete_thread(request).await
            })
            .await?;
        Ok(answer.deleted)
    }

    /// Cancels a live run at once; `true` when it was live (it ends `CANCELED`, keeping its
    /// output).
    pub async fn cancel_run(&self, run_id: &str) -> Result<bool, Error> {
        self.cancel(run_id, pb::CancelMode::Immediate).await
    }

    /// Cancels a live run once its turn in progress has ended: the turn's tool calls run and
    /// are recorded, no new model request is made, and the run ends `CANCELED` with everything
    /// kept (a turn that ends the run by itself ends it as it would have). `true` when it was
    /// live. A [`cancel_run`](Self::cancel_run) may follow and wins.
    pub async fn cancel_after_turn(&self, run_id: &str) -> Result<bool, Error> {
        self.cancel(run_id, pb::CancelMode::AfterTurn).await
    }

    async fn cancel(&self, run_id: &str, mode: pb::CancelMode) -> Result<bool, Error> {
        Ok(self.cancel_with(run_id, mode).await?.canceled)
    }

    /// Cancels a live run `mode`'s way; the whole answer (the run's status after it, too).
    pub async fn cancel_with(&self, run_id: &str, mode: pb::CancelMode) -> Result<pb::CancelRunResponse, Error> {
        let request = pb::CancelRunRequest {
            run_id: run_id.into(),
            mode: mode.into(),
        };
        Ok(self
            .retried(request, |mut client, request| async move {
                client.cancel_run(request).await
            })
            .await?)
    }

    /// Sends a user message to a live run: it joins the conversation at the run's next turn
    /// boundary (announced by [`Event::MessageAdded`]); returns how many messages wait for that
    /// boundary. Not retried, so a message never joins twice: on `UNAVAILABLE` (the run is
    /// moving between replicas) send it again once the run has not announced it.
    pub async fn send_message(&self, run_id: &str, text: &str) -> Result<u32, Error> {
        let request = pb::SendMessageRequest {
            run_id: run_id.into(),
            message: Some(pb::ChatMessage {
                role: "user".into(),
                content: text.into(),
                ..Default::default()
            }),
        };
        let answer = self.inner.clone().send_message(self.request(request)).await?;
        Ok(answer.into_inner().waiting)
    }

    /// The tool calls waiting for approval that this caller may decide (of `run_id` only, when
    /// given): its own runs', or every run's for an approver.
    pub async fn pending_approvals(&self, run_id: Option<&str>) -> Result<Vec<pb::PendingApproval>, Error> {
        let request = pb::ListPendingApprovalsRequest {
            run_id: run_id.unwrap_or_default().into(),
            limit: 0,
        };
        Ok(self.list_pending_approvals(request).await?.approvals)
    }

    /// `ListPendingApprovals` as asked, its whole answer (whether more calls wait than listed).
    pub async fn list_pending_approvals(
        &self,
        request: pb::ListPendingApprovalsRequest,
    ) -> Result<pb::ListPendingApprovalsResponse, Error> {
        Ok(self
            .retried(request, |mut client, request| async move {
                client.list_pending_approvals(request).await
            })
            .await?)
    }

    /// A page of the runs this caller may see that `request` asks for (its own; every
    /// principal's with the operator role), newest first; send the answer's `next_page_token`
    /// as the next request's `page_token` (with the same filters) for the next page.
    pub async fn list_runs(&self, request: pb::ListRunsRequest) -> Result<pb::ListRunsResponse, Error> {
        Ok(self
            .retried(
                request,
                |mut client, request| async move { client.list_runs(request).await },
            )
            .await?)
    }

    /// What `principal` (empty: this caller; another's needs the operator role) spent from
    /// `from_ms` to `to_ms` (Unix ms; 0 and 0: the last 24 hours), an hour a window.
    pub async fn usage(&self, principal: &str, from_ms: i64, to_ms: i64) -> Result<pb::GetUsageResponse, Error> {
        let request = pb::GetUsageRequest {
            principal: principal.into(),
            from_ms,
            to_ms,
        };
        Ok(self
            .retried(
                request,
                |mut client, request| async move { client.get_usage(request).await },
            )
            .await?)
    }

    /// Every run `request` asks for, page after page (at most `max` rows: a listing of a busy
    /// service is long).
    pub async fn list_all_runs(
        &self,
        mut request: pb::ListRunsRequest,
        max: usize,
    ) -> Result<Vec<pb::RunSummary>, Error> {
        let mut runs = Vec::new();
        loop {
            let page = self.list_runs(request.clone()).await?;
            runs.extend(page.runs);
            if page.next_page_token.is_empty() || runs.len() >= max {
                runs.truncate(max);
                return Ok(runs);
            }
            request.page_token = page.next_page_token;
        }
    }

    /// Decides calls of `run_id` waiting for approval (see [`decision`]); returns the calls
    /// still waiting. A call decided already is refused `FAILED_PRECONDITION`, an edit its tool's
    /// schema refuses `INVALID_ARGUMENT` (and nothing of the request is applied).
    pub async fn decide(
        &self,
        run_id: &str,
        decisions: Vec<pb::ToolCallDecision>,
    ) -> Result<Vec<pb::PendingApproval>, Error> {
        let request = pb::DecideToolCallsRequest {
            run_id: run_id.into(),
            decisions,
        };
        Ok(self.decide_tool_calls(request).await?.still_pending)
    }

    /// `DecideToolCalls` as asked, its whole answer (the run's status after it, too).
    pub async fn decide_tool_calls(
        &self,
        request: pb::DecideToolCallsRequest,
    ) -> Result<pb::DecideToolCallsResponse, Error> {
        // Not retried: a decision that reached the server before the connection broke would
        // be refused the second time as decided already.
        let answer = self.inner.clone().decide_tool_calls(self.request(request)).await?;
        Ok(answer.into_inner())
    }

    /// Answers the questions of call `call_id` of run `run_id` (one answer per question; see
    /// [`decision::accept`]); the run's calls still waiting after it.
    pub async fn answer(
        &self,
        run_id: &str,
        call_id: &str,
        answers: Vec<pb::ToolInputAnswer>,
    ) -> Result<Vec<pb::PendingApproval>, Error> {
        // Whichever round the call asks now (`answer_tool_input` names one).
        let request = pb::AnswerToolInputRequest {
            run_id: run_id.into(),
            call_id: call_id.into(),
            answers,
            round: String::new(),
        };
        Ok(self.answer_tool_input(request).await?.still_pending)
    }

    /// `AnswerToolInput` as asked, its whole answer (the run's status after it, too).
    pub async fn answer_tool_input(
        &self,
        request: pb::AnswerToolInputRequest,
    ) -> Result<pb::AnswerToolInputResponse, Error> {
        // Not retried, as a decision.
        let answer = self.inner.clone().answer_tool_input(self.request(request)).await?;
        Ok(answer.into_inner())
    }

    /// Signals as runs publish them, from now on; `run_id` and `tool_names` filter (empty: all).
    pub async fn subscribe_signals(
        &self,
        run_id: &str,
        tool_names: &[&str],
    ) -> Result<impl Stream<Item = Result<pb::SignalEvent, Error>> + use<>, Error> {
        use futures::StreamExt;
        let request = pb::SubscribeSignalsRequest {
            run_id: run_id.into(),
            tool_names: tool_names.iter().map(|t| (*t).to_owned()).collect(),
        };
        let mut request = self.request(request);
        // A subscription lasts as long as the caller reads it: no deadline.
        request.metadata_mut().remove("grpc-timeout");
        let stream = self.inner.clone().subscribe_signals(request).await?.into_inner();
        Ok(stream.map(|item| item.map_err(Error::from)))
    }

    /// A call of `message` (unary, or one that answers with a stream) under the retry policy,
    /// each attempt with the token and the deadline.
    async fn retried<Req, Resp, F, Fut>(&self, message: Req, call: F) -> Result<Resp, tonic::Status>
    where
        Req: Clone,
        F: Fn(pb::orchestrator_client::OrchestratorClient<Channel>, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        Ok(self.retried_response(message, call).await?.into_inner())
    }

    /// [`Self::retried`], the answer with its metadata.
    async fn retried_response<Req, Resp, F, Fut>(
        &self,
        message: Req,
        call: F,
    ) -> Result<tonic::Response<Resp>, tonic::Status>
    where
        Req: Clone,
        F: Fn(pb::orchestrator_client::OrchestratorClient<Channel>, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        self.retry
            .run(|| call(self.inner.clone(), self.request(message.clone())))
            .await
    }

    /// `message` with the token and the deadline.
    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.timeout);
        if let Some(authorization) = &self.authorization {
            request.metadata_mut().insert("authorization", authorization.clone());
        }
        request
    }
}
