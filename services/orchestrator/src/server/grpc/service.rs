//! The handlers of `orchestrator.v1.Orchestrator`: each turns its request into domain values,
//! calls one operation of the server's [`Core`], and turns the answer into proto. The rules live
//! in the server (`crate::server`), the registry and the loop (`crate::run`).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use proto::orchestrator::v1 as pb;
use shared::auth::caller;
use tonic::{Request, Response, Status};

use super::convert::{
    CancelRequest, DecideRequest, RunRequest, SteeringRequest, agent_pb, delivery_pb, event_pb, named_id,
    parse_grpc_timeout, resolve, webhook_pb, with_agent,
};
use crate::domain::listing::ListRequest;
use crate::domain::ports::{SignalFilter, SignalItem};
use crate::server::{Core, RunEvents};

/// How long a request waits for the tool catalog when it is still empty.
const CATALOG_WAIT: Duration = Duration::from_secs(5);

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::OrchestrateEvent, Status>> + Send>>;
type SignalStream = Pin<Box<dyn Stream<Item = Result<pb::SignalEvent, Status>> + Send>>;

/// The `Orchestrator` gRPC service.
pub(crate) struct OrchestratorService {
    core: Arc<Core>,
}

impl OrchestratorService {
    /// A service over `core`.
    pub(crate) fn new(core: Arc<Core>) -> Self {
        Self { core }
    }
}

impl OrchestratorService {
    /// The run `request` of `caller` asks for, with its agent's definition filled in (see
    /// `with_agent`), checked, and resolved against the tool catalog (waited for while it is
    /// still empty) and the server's settings; and whether it is detached (`detach` makes it
    /// so). The caller's gRPC deadline (`grpc_timeout`) shortens a run that is not detached.
    async fn spec(
        &self,
        request: pb::OrchestrateRequest,
        caller: &shared::auth::Principal,
        grpc_timeout: Option<Duration>,
        detach: bool,
        received_at: tokio::time::Instant,
    ) -> Result<(crate::domain::RunSpec, bool), Status> {
        let (request, agent) = with_agent(request, &self.core.agents, caller)?;
        let mut run_request = RunRequest::try_from(request)?;
        run_request.detached |= detach;
        let detached = run_request.detached;
        // A detached run is bounded by its own timeout only: the call that started it may end.
        let caller_deadline = grpc_timeout.filter(|_| !detached);
        let catalog = match &self.core.runners {
            Some(runners) => runners.answering_catalog(CATALOG_WAIT).await?,
            None => Arc::default(),
        };
        let mut spec = resolve(
            run_request,
            &catalog,
            &self.core.config,
            caller,
            caller_deadline,
            received_at,
        )?;
        spec.agent = agent;
        Ok((spec, detached))
    }
}

/// A run's events as proto events.
fn events_pb(run_id: String, events: RunEvents) -> EventStream {
    events
        .map(move |item| match item {
            Ok(e) => Ok(event_pb(&run_id, e.seq, e.event)),
            Err(e) => Err(Status::from(e)),
        })
        .boxed()
}

#[tonic::async_trait]
impl pb::orchestrator_server::Orchestrator for OrchestratorService {
    type OrchestrateStream = EventStream;
    type AttachRunStream = EventStream;
    type SubscribeSignalsStream = SignalStream;

    async fn orchestrate(&self, request: Request<pb::OrchestrateRequest>) -> Result<Response<EventStream>, Status> {
        let core = &self.core;
        core.refuse_when_draining()?;
        let received_at = tokio::time::Instant::now();
        let caller = caller(&request);
        let trace_context = request.metadata().clone();
        let grpc_timeout = request
            .metadata()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout);
        let (spec, detached) = self
            .spec(request.into_inner(), &caller, grpc_timeout, false, received_at)
            .await?;
        let run_id = spec.run_id.clone();
        let (events, replayed) = core.orchestrate(spec, detached, &trace_context, caller).await?;
        let mut response = Response::new(events_pb(run_id, events));
        if let Some(replayed) = replayed {
            response.metadata_mut().insert(
                proto::REPLAY_HEADER,
                tonic::metadata::MetadataValue::from_static(replayed.as_str()),
            );
        }
        Ok(response)
    }

    async fn start_run(
        &self,
        request: Request<pb::OrchestrateRequest>,
    ) -> Result<Response<pb::StartRunResponse>, Status> {
        self.core.refuse_when_draining()?;
        let received_at = tokio::time::Instant::now();
        let caller = caller(&request);
        let trace_context = request.metadata().clone();
        // A run started in the background is detached: no call follows it, none bounds it.
        let (spec, _) = self
            .spec(request.into_inner(), &caller, None, true, received_at)
            .await?;
        let run_id = spec.run_id.clone();
        let (status, queued_ms) = self.core.start_in_background(spec, &trace_context, caller).await?;
        Ok(Response::new(pb::StartRunResponse {
            run_id,
            status: pb::RunStatus::from(status).into(),
            queued_ms,
        }))
    }

    async fn attach_run(&self, request: Request<pb::AttachRunRequest>) -> Result<Response<EventStream>, Status> {
        self.core.refuse_when_draining()?;
        let caller = caller(&request);
        let pb::AttachRunRequest { run_id, after_seq } = request.into_inner();
        let run_id = named_id("run_id", run_id)?;
        let events = self.core.attach(&run_id, after_seq, &caller).await?;
        Ok(Response::new(events_pb(run_id, events)))
    }

    async fn get_run(&self, request: Request<pb::GetRunRequest>) -> Result<Response<pb::RunResult>, Status> {
        let caller = caller(&request);
        let run_id = named_id("run_id", request.into_inner().run_id)?;
        let run = self.core.get(&run_id, &caller).await?;
        Ok(Response::new(pb::RunResult::from(&run)))
    }

    async fn list_runs(&self, request: Request<pb::ListRunsRequest>) -> Result<Response<pb::ListRunsResponse>, Status> {
        let caller = caller(&request);
        let asked = ListRequest::try_from(request.into_inner())?;
        let (page, next) = self.core.list_runs(asked, &caller).await?;
        Ok(Response::new(pb::ListRunsResponse {
            runs: page.runs.iter().map(pb::RunSummary::from).collect(),
            next_page_token: next.unwrap_or_default(),
        }))
    }

    async fn get_usage(&self, request: Request<pb::GetUsageRequest>) -> Result<Response<pb::GetUsageResponse>, Status> {
        let caller = caller(&request);
        let asked = request.into_inner();
        let time = |field: &str, ms: i64| {
            u64::try_from(ms)
                .map_err(|_| Status::invalid_argument(format!("{field} must be a Unix time in ms, not {ms}")))
        };
        let span = (time("from_ms", asked.from_ms)?, time("to_ms", asked.to_ms)?);
        let principal = Some(asked.principal).filter(|p| !p.is_empty());
        let spent = self.core.usage(&caller, principal, span).await?;
        let window = |start: u64, t: &crate::domain::usage::Tally| pb::UsageWindow {
            start_ms: i64::try_from(start).unwrap_or(i64::MAX),
            prompt_tokens: t.prompt_tokens,
            cached_prompt_tokens: t.cached_prompt_tokens,
            completion_tokens: t.completion_tokens,
            tool_calls: t.tool_calls,
            runs: t.runs,
            run_ms: t.run_ms,
        };
        let first = spent.windows.first().map_or(0, |(start, _)| *start);
        Ok(Response::new(pb::GetUsageResponse {
            windows: spent.windows.iter().map(|(start, t)| window(*start, t)).collect(),
            total: Some(window(first, &spent.total)),
            principal: spent.principal,
            tokens_per_hour: spent.tokens_per_hour,
        }))
    }

    async fn cancel_run(
        &self,
        request: Request<pb::CancelRunRequest>,
    ) -> Result<Response<pb::CancelRunResponse>, Status> {
        let caller = caller(&request);
        let CancelRequest { run_id, mode } = CancelRequest::try_from(request.into_inner())?;
        let (canceled, status) = self.core.cancel(&run_id, &caller, mode).await?;
        Ok(Response::new(pb::CancelRunResponse {
            canceled,
            status: pb::RunStatus::from(status).into(),
        }))
    }

    async fn send_message(
        &self,
        request: Request<pb::SendMessageRequest>,
    ) -> Result<Response<pb::SendMessageResponse>, Status> {
        let caller = caller(&request);
        let SteeringRequest { run_id, message } = SteeringRequest::try_from(request.into_inner())?
            .within(self.core.config.threads.max_steering_message_bytes)?;
        let waiting = self.core.send_message(&run_id, &caller, message).await?;
        Ok(Response::new(pb::SendMessageResponse { waiting }))
    }

    async fn get_thread(&self, request: Request<pb::GetThreadRequest>) -> Result<Response<pb::Thread>, Status> {
        let caller = caller(&request);
        let thread_id = named_id("thread_id", request.into_inner().thread_id)?;
        let thread = self.core.get_thread(&thread_id, &caller).await?;
        Ok(Response::new(pb::Thread::from(&thread)))
    }

    async fn delete_thread(
        &self,
        request: Request<pb::DeleteThreadRequest>,
    ) -> Result<Response<pb::DeleteThreadResponse>, Status> {
        let caller = caller(&request);
        let thread_id = named_id("thread_id", request.into_inner().thread_id)?;
        let deleted = self.core.delete_thread(&thread_id, &caller).await?;
        Ok(Response::new(pb::DeleteThreadResponse { deleted }))
    }

    async fn decide_tool_calls(
        &self,
        request: Request<pb::DecideToolCallsRequest>,
    ) -> Result<Response<pb::DecideToolCallsResponse>, Status> {
        let caller = caller(&request);
        let DecideRequest { run_id, decisions } = DecideRequest::try_from(request.into_inner())?;
        let (status, still_pending) = self.core.decide(&run_id, &decisions, &caller).await?;
        Ok(Response::new(pb::DecideToolCallsResponse {
            status: pb::RunStatus::from(status).into(),
            still_pending: still_pending.iter().map(pb::PendingApproval::from).collect(),
        }))
    }

    async fn answer_tool_input(
        &self,
        request: Request<pb::AnswerToolInputRequest>,
    ) -> Result<Response<pb::AnswerToolInputResponse>, Status> {
        let caller = caller(&request);
        let DecideRequest { run_id, decisions } = DecideRequest::try_from(request.into_inner())?;
        let (status, still_pending) = self.core.decide(&run_id, &decisions, &caller).await?;
        Ok(Response::new(pb::AnswerToolInputResponse {
            status: pb::RunStatus::from(status).into(),
            still_pending: still_pending.iter().map(pb::PendingApproval::from).collect(),
        }))
    }

    async fn list_pending_approvals(
        &self,
        request: Request<pb::ListPendingApprovalsRequest>,
    ) -> Result<Response<pb::ListPendingApprovalsResponse>, Status> {
        let caller = caller(&request);
        let request = request.into_inner();
        let run_id = Some(request.run_id.as_str()).filter(|r| !r.is_empty());
        let limit = usize::try_from(request.limit).unwrap_or(usize::MAX);
        let (approvals, truncated) = self.core.pending(&caller, run_id, limit).await?;
        Ok(Response::new(pb::ListPendingApprovalsResponse {
            approvals: approvals.iter().map(pb::PendingApproval::from).collect(),
            truncated,
        }))
    }

    async fn list_agents(
        &self,
        request: Request<pb::ListAgentsRequest>,
    ) -> Result<Response<pb::ListAgentsResponse>, Status> {
        let caller = caller(&request);
        let agents = self.core.agents.open_to(&caller);
        Ok(Response::new(pb::ListAgentsResponse {
            agents: agents.iter().map(|agent| agent_pb(agent)).collect(),
        }))
    }

    async fn create_webhook(
        &self,
        request: Request<pb::CreateWebhookRequest>,
    ) -> Result<Response<pb::Webhook>, Status> {
        let caller = caller(&request);
        let registration = crate::webhooks::Registration::try_from(request.into_inner())?;
        let hook = self.core.webhooks.register(&caller.name, registration).await?;
        Ok(Response::new(webhook_pb(hook, true)))
    }

    async fn list_webhooks(
        &self,
        request: Request<pb::ListWebhooksRequest>,
    ) -> Result<Response<pb::ListWebhooksResponse>, Status> {
        let caller = caller(&request);
        let hooks = self.core.webhooks.list(&caller.name).await?;
        Ok(Response::new(pb::ListWebhooksResponse {
            webhooks: hooks.into_iter().map(|hook| webhook_pb(hook, false)).collect(),
        }))
    }

    async fn delete_webhook(
        &self,
        request: Request<pb::DeleteWebhookRequest>,
    ) -> Result<Response<pb::DeleteWebhookResponse>, Status> {
        let caller = caller(&request);
        self.core
            .webhooks
            .remove(&caller.name, &request.into_inner().webhook_id)
            .await?;
        Ok(Response::new(pb::DeleteWebhookResponse {}))
    }

    async fn list_webhook_deliveries(
        &self,
        request: Request<pb::ListWebhookDeliveriesRequest>,
    ) -> Result<Response<pb::ListWebhookDeliveriesResponse>, Status> {
        let caller = caller(&request);
        let request = request.into_inner();
        let limit = match usize::try_from(request.limit).unwrap_or(usize::MAX) {
            0 => 50,
            n if n > crate::webhooks::MAX_LISTED => {
                let max = crate::webhooks::MAX_LISTED;
                return Err(Status::invalid_argument(format!(
                    "limit {n} is more than {max}; page by webhook or run"
                )));
            }
            n => n,
        };
        let narrowing = crate::webhooks::Narrowing::try_from(request)?;
        let deliveries = self.core.webhooks.deliveries(&caller.name, &narrowing, limit).await?;
        Ok(Response::new(pb::ListWebhookDeliveriesResponse {
            deliveries: deliveries.into_iter().map(delivery_pb).collect(),
        }))
    }

    async fn subscribe_signals(
        &self,
        request: Request<pb::SubscribeSignalsRequest>,
    ) -> Result<Response<SignalStream>, Status> {
        let caller = caller(&request);
        let request = request.into_inner();
        let filter = SignalFilter {
            run_id: Some(request.run_id).filter(|r| !r.is_empty()),
            tool_names: request.tool_names,
            principal: Some(caller.name.clone()).filter(|name| !name.is_empty()),
        };
        let stopping = self.core.stopping.clone().cancelled_owned();
        let stream = self
            .core
            .signals
            .subscribe(filter)
            .await
            .take_until(stopping)
            .map(|item| {
                let event = match item {
                    SignalItem::Signal(signal) => pb::signal_event::Event::Signal(pb::Signal::from(&signal)),
                    SignalItem::Missed(n) => pb::signal_event::Event::Missed(n),
                };
                Ok(pb::SignalEvent { event: Some(event) })
            });
        Ok(Response::new(stream.boxed()))
    }
}
