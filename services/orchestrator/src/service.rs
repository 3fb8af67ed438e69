//! The gRPC adapter: `orchestrator.v1.Orchestrator` requests become runs, run events and results
//! become proto messages. The loop itself lives in [`crate::run`].

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::{Stream, StreamExt};
use proto::orchestrator::v1 as pb;
use shared::auth::caller;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::Error;
use crate::config::Config;
use crate::convert::{DecideRequest, RunRequest, event_pb, parse_grpc_timeout, resolve};
use crate::domain::ports::{Decider, EventFeed};
use crate::domain::ports::{SignalFilter, SignalItem, SignalTopic};
use crate::domain::{Event, EventBatch, NumberedEvent, RunResult, RunSpec};
use crate::run::live::{EmitSettings, Emitter, gated};
use crate::run::tool_loop::LoopDeps;
use crate::runs::{Admitted, AttachError, CancelOutcome, Refusal, Runs};
use crate::tool_runners::ToolRunners;
use shared::auth::Principal;

/// How long a request waits for the tool catalog when it is still empty.
const CATALOG_WAIT: Duration = Duration::from_secs(5);

/// What the service shares with the server (and the drain).
pub(crate) struct Core {
    /// Configuration.
    pub config: Config,
    /// The loop's dependencies.
    pub deps: LoopDeps,
    /// Live runs and results.
    pub runs: Arc<Runs>,
    /// Tool-runner connection (for the catalog).
    pub runners: ToolRunners,
    /// The signal topic.
    pub signals: Arc<dyn SignalTopic>,
    /// Set when the drain starts: new runs are refused.
    pub draining: AtomicBool,
    /// Cancelled when the drain starts: open SubscribeSignals streams end, so the server can stop.
    pub stopping: tokio_util::sync::CancellationToken,
}

/// The `Orchestrator` gRPC service.
pub(crate) struct OrchestratorService {
    core: Arc<Core>,
}

impl OrchestratorService {
    /// A service over `core`.
    pub(crate) fn new(core: Arc<Core>) -> Self {
        Self { core }
    }

    /// Starts an admitted run as its own task, in the caller's trace, and returns its event
    /// stream. A run that is not `detached` is canceled when the caller goes away or stops
    /// reading.
    fn start(
        &self,
        mut admitted: Admitted,
        spec: RunSpec,
        detached: bool,
        trace_context: &tonic::metadata::MetadataMap,
        caller: Arc<Principal>,
    ) -> EventStream {
        let core = &self.core;
        let run_id = spec.run_id.clone();
        let (caller_tx, rx) = mpsc::channel::<EventBatch>(core.config.runs.event_buffer);
        let caller_gone = (!detached).then(|| caller_tx.clone());
        let settings = EmitSettings {
            send_timeout: core.config.runs.event_send_timeout,
            max_event_bytes: core.config.runs.max_caller_event_bytes,
        };
        let on_stall = (!detached).then(|| admitted.cancel.clone());
        let log = admitted.log.take();
        // A durable run's caller is sent only what its log holds (see `gated`).
        let tx = match log.as_ref().and_then(|log| log.settled()) {
            Some(settled) if admitted.persister.durable() => gated(caller_tx, settled, settings.send_timeout),
            _ => caller_tx,
        };
        let emitter = Emitter::new(Some(tx), Arc::clone(&admitted.state), settings, on_stall).with_log(log);
        let span = crate::telemetry::invoke_agent_span(&spec.model, &run_id, &spec.principal);
        shared::telemetry::continue_trace(&span, trace_context);
        let run = admitted.into_run(spec, emitter, caller_gone);
        let deps = core.deps.clone();
        tokio::spawn(crate::run::tool_loop::run(run, deps).instrument(span));
        // A batch's events are all ready at once, so tonic encodes them into one HTTP/2 frame.
        let events = ReceiverStream::new(rx).flat_map(futures::stream::iter);
        caller_stream(Arc::clone(core), run_id, caller, events)
    }
}

/// A run's events as proto events, for the caller that started it. When they end before
/// `run_finished`, either the run parked waiting for approvals (the stream goes on from the run's
/// log, as `AttachRun` would, until the run ends) or it moved to another replica (the stream ends
/// with `UNAVAILABLE` naming the run and the last seq sent, so the caller attaches again).
fn caller_stream(
    core: Arc<Core>,
    run_id: String,
    caller: Arc<Principal>,
    events: impl Stream<Item = NumberedEvent> + Send + 'static,
) -> EventStream {
    enum Phase {
        Direct(Pin<Box<dyn Stream<Item = NumberedEvent> + Send>>),
        Following(EventStream),
        Done,
    }
    struct Tail {
        phase: Phase,
        core: Arc<Core>,
        caller: Arc<Principal>,
        run_id: String,
        last_seq: u64,
        /// The run asked for an approval: when its events end, it may be parked.
        asked: bool,
    }
    let tail = Tail {
        phase: Phase::Direct(Box::pin(events)),
        core,
        caller,
        run_id,
        last_seq: 0,
        asked: false,
    };
    futures::stream::unfold(tail, |mut t| async move {
        loop {
            let direct = match &mut t.phase {
                Phase::Done => return None,
                Phase::Following(feed) => return feed.next().await.map(|item| (item, t)),
                Phase::Direct(events) => events.next().await,
            };
            match direct {
                Some(e) => {
                    t.last_seq = e.seq;
                    t.asked |= matches!(e.event, crate::domain::Event::ApprovalRequested { .. });
                    if e.is_last() {
                        t.phase = Phase::Done;
                    }
                    return Some((Ok(event_pb(&t.run_id, e.seq, e.event)), t));
                }
                None if t.asked && waited_for_approval(&t.core, &t.run_id).await => {
                    match t.core.runs.attach(&t.run_id, t.last_seq, &t.caller).await {
                        Ok(feed) => t.phase = Phase::Following(attached(&t.core, t.run_id.clone(), t.last_seq, feed)),
                        Err(e) => {
                            t.phase = Phase::Done;
                            return Some((Err(attach_status(&t.run_id, e)), t));
                        }
                    }
                }
                None => {
                    t.phase = Phase::Done;
                    let message = format!(
                        "run {:?} moved to another orchestrator replica (or its event log could not keep its events); attach to it again after seq {}",
                        t.run_id, t.last_seq
                    );
                    return Some((Err(Status::unavailable(message)), t));
                }
            }
        }
    })
    .boxed()
}

/// Whether a run whose caller's stream ended early (after it asked for an approval) waits for
/// approvals, or went on after its wait. Asked again for up to two seconds: a run being taken out
/// of the approval lot to go on is in neither place for a moment.
async fn waited_for_approval(core: &Core, run_id: &str) -> bool {
    // A run that parked and is ready at once (its wait expired as it parked) is out of the lot
    // and not yet live again for a moment: looked at again for a while, on a loaded machine too.
    const LOOKS: usize = 40;
    // Ended already (it went on at once and finished): its log has the rest.
    let parked = || async {
        core.runs.waited_for_approval(run_id)
            || matches!(core.runs.get(run_id, &Principal::default()).await,
                Ok(Some(run)) if run.status == crate::domain::RunStatus::AwaitingApproval || !run.status.is_live())
    };
    for _ in 0..LOOKS {
        if parked().await {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    false
}

/// Why a caller cannot follow a run's log, as a status.
fn attach_status(run_id: &str, error: AttachError) -> Status {
    match error {
        AttachError::NotFound => no_run(run_id),
        AttachError::Store(e) => Error::Store(e).into(),
        AttachError::Log(e) => Error::Log(e).into(),
        AttachError::Full(max) => Error::AttachBusy(max).into(),
    }
}

/// Idempotent replay: the run with this id already finished. Its whole text (and reasoning) comes
/// as one delta each, so the replayed stream keeps the stream invariants.
fn replay(run_id: &str, result: RunResult) -> EventStream {
    let mut events = Vec::with_capacity(3);
    if !result.reasoning.is_empty() {
        events.push(Event::ReasoningDelta {
            text: result.reasoning.clone(),
            turn: result.turns,
        });
    }
    if !result.text.is_empty() {
        events.push(Event::TextDelta {
            text: result.text.clone(),
            turn: result.turns,
        });
    }
    events.push(Event::RunFinished(result));
    let events: Vec<_> = events
        .into_iter()
        .zip(1..)
        .map(|(event, seq)| Ok(event_pb(run_id, seq, event)))
        .collect();
    futures::stream::iter(events).boxed()
}

/// The answer for a run the caller cannot see, whether or not it exists.
fn no_run(run_id: &str) -> Status {
    Error::NotFound(format!("no run {run_id:?} (unknown, or its result has expired)")).into()
}

/// An attached caller's stream: the run's logged events as proto events. A run that moves away
/// from here (a durable run handed over, or one this replica stopped acting for), or that runs
/// elsewhere while this replica drains, ends its attached streams with `UNAVAILABLE` naming the
/// run and the last seq sent, so the caller attaches again elsewhere; a run that ends here keeps its followers until its end,
/// within the drain's grace.
fn attached(core: &Arc<Core>, run_id: String, after_seq: u64, feed: EventFeed) -> EventStream {
    struct Follow {
        feed: EventFeed,
        /// Resolves once the stream must end for the caller to attach elsewhere: looked up once
        /// per stream, not per event.
        left: futures::future::BoxFuture<'static, ()>,
        run_id: String,
        last_seq: u64,
        done: bool,
    }
    let (stopping, runs) = (core.stopping.clone(), Arc::clone(&core.runs));
    let moved = core.runs.moved_from_here(&run_id);
    let left = {
        let run_id = run_id.clone();
        async move {
            tokio::select! {
                () = moved => {}
                () = async {
                    stopping.cancelled().await;
                    runs.moved_away(&run_id).await;
                } => {}
            }
        }
    };
    let follow = Follow {
        feed,
        left: Box::pin(left),
        run_id,
        last_seq: after_seq,
        done: false,
    };
    futures::stream::unfold(follow, |mut f| async move {
        if f.done {
            return None;
        }
        let item = tokio::select! {
            biased;
            item = f.feed.next() => item?,
            () = &mut f.left => {
                f.done = true;
                let message = format!(
                    "this orchestrator replica is draining, or stopped acting for the run; attach to run {:?} again after seq {}",
                    f.run_id, f.last_seq
                );
                return Some((Err(Status::unavailable(message)), f));
            }
        };
        let item = match item {
            Ok(event) => {
                f.last_seq = event.seq;
                Ok(event_pb(&f.run_id, event.seq, event.event))
            }
            Err(e) => {
                f.done = true;
                Err(Status::from(Error::Log(e)))
            }
        };
        Some((item, f))
    })
    .boxed()
}

/// Most pending approvals listed at once.
const MAX_LISTED_APPROVALS: usize = 1000;

/// The caller as the approval lot checks it.
fn decider(caller: &Principal, config: &crate::config::Config) -> Decider {
    Decider {
        name: caller.name.clone(),
        approver: caller.has_role(shared::auth::APPROVER),
        approver_required: config.runs.approvals_need_approver,
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::OrchestrateEvent, Status>> + Send>>;
type SignalStream = Pin<Box<dyn Stream<Item = Result<pb::SignalEvent, Status>> + Send>>;

#[tonic::async_trait]
impl pb::orchestrator_server::Orchestrator for OrchestratorService {
    type OrchestrateStream = EventStream;
    type AttachRunStream = EventStream;
    type SubscribeSignalsStream = SignalStream;

    async fn attach_run(&self, request: Request<pb::AttachRunRequest>) -> Result<Response<EventStream>, Status> {
        if self.core.draining.load(Ordering::Acquire) {
            return Err(Error::Draining.into());
        }
        let caller = caller(&request);
        let pb::AttachRunRequest { run_id, after_seq } = request.into_inner();
        match self.core.runs.attach(&run_id, after_seq, &caller).await {
            Ok(feed) => Ok(Response::new(attached(&self.core, run_id, after_seq, feed))),
            Err(e) => Err(attach_status(&run_id, e)),
        }
    }

    async fn orchestrate(&self, request: Request<pb::OrchestrateRequest>) -> Result<Response<EventStream>, Status> {
        let core = &self.core;
        if core.draining.load(Ordering::Acquire) {
            return Err(Error::Draining.into());
        }
        let received_at = tokio::time::Instant::now();
        let caller = caller(&request);
        let trace_context = request.metadata().clone();
        let caller_deadline = request
            .metadata()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout);
        let run_request = RunRequest::try_from(request.into_inner())?;
        let detached = run_request.detached;
        let catalog = core.runners.answering_catalog(CATALOG_WAIT).await?;
        let spec = resolve(
            run_request,
            &catalog,
            &core.config,
            &caller,
            caller_deadline,
            received_at,
        )?;
        let run_id = spec.run_id.clone();
        match core.runs.admit(&run_id, &caller, Some(&spec)).await {
            Ok(admitted) => Ok(Response::new(self.start(
                admitted,
                spec,
                detached,
                &trace_context,
                caller,
            ))),
            Err(Refusal::Finished(result)) => Ok(Response::new(replay(&run_id, *result))),
            Err(Refusal::Duplicate) => Err(Error::AlreadyRunning(run_id).into()),
            Err(Refusal::Full(slots)) => Err(Error::Busy(slots).into()),
            Err(Refusal::CallerFull(limit)) => Err(Error::CallerBusy {
                principal: caller.name.clone(),
                limit,
            }
            .into()),
            // Another caller's run is answered as not found, so run ids cannot be probed.
            Err(Refusal::Foreign) => Err(no_run(&run_id)),
        }
    }

    async fn get_run(&self, request: Request<pb::GetRunRequest>) -> Result<Response<pb::RunResult>, Status> {
        let caller = caller(&request);
        let run_id = request.into_inner().run_id;
        match self.core.runs.get(&run_id, &caller).await.map_err(Error::Store)? {
            Some(result) => Ok(Response::new(pb::RunResult::from(&result))),
            None => Err(no_run(&run_id)),
        }
    }

    async fn cancel_run(
        &self,
        request: Request<pb::CancelRunRequest>,
    ) -> Result<Response<pb::CancelRunResponse>, Status> {
        let caller = caller(&request);
        let run_id = request.into_inner().run_id;
        let outcome = self.core.runs.cancel(&run_id, &caller, "canceled by CancelRun").await;
        let (canceled, status) = match outcome.map_err(Error::Store)? {
            CancelOutcome::Canceled => (true, pb::RunStatus::Canceled),
            CancelOutcome::AlreadyFinished(status) => (false, status.into()),
            CancelOutcome::NotFound => return Err(no_run(&run_id)),
            CancelOutcome::Unanswered => return Err(Error::RunElsewhere(run_id).into()),
        };
        Ok(Response::new(pb::CancelRunResponse {
            canceled,
            status: status.into(),
        }))
    }

    async fn decide_tool_calls(
        &self,
        request: Request<pb::DecideToolCallsRequest>,
    ) -> Result<Response<pb::DecideToolCallsResponse>, Status> {
        let caller = caller(&request);
        let DecideRequest { run_id, decisions } = DecideRequest::try_from(request.into_inner())?;
        let decider = decider(&caller, &self.core.config);
        let calls = self
            .core
            .deps
            .approvals
            .decide(&run_id, &decider, &decisions)
            .await
            .map_err(Error::from)?;
        for decision in &decisions {
            tracing::info!(run_id = %run_id, gen_ai.tool.call.id = %decision.call_id, principal = %caller.name, kind = ?decision.kind, "tool call decided");
        }
        let still_pending: Vec<pb::PendingApproval> = calls
            .iter()
            .filter(|c| c.decision.is_none())
            .map(pb::PendingApproval::from)
            .collect();
        // Read as the server: an approver may decide runs it may not read.
        let status = match self.core.runs.get(&run_id, &Principal::default()).await {
            Ok(Some(run)) if !still_pending.is_empty() && run.status == crate::domain::RunStatus::AwaitingApproval => {
                pb::RunStatus::AwaitingApproval
            }
            _ => pb::RunStatus::Running,
        };
        Ok(Response::new(pb::DecideToolCallsResponse {
            status: status.into(),
            still_pending,
        }))
    }

    async fn list_pending_approvals(
        &self,
        request: Request<pb::ListPendingApprovalsRequest>,
    ) -> Result<Response<pb::ListPendingApprovalsResponse>, Status> {
        let caller = caller(&request);
        let request = request.into_inner();
        let limit = match request.limit {
            0 => MAX_LISTED_APPROVALS,
            n => usize::try_from(n).unwrap_or(usize::MAX).min(MAX_LISTED_APPROVALS),
        };
        let run_id = Some(request.run_id.as_str()).filter(|r| !r.is_empty());
        let (approvals, truncated) = self
            .core
            .deps
            .approvals
            .pending(&decider(&caller, &self.core.config), run_id, limit)
            .await
            .map_err(Error::Store)?;
        Ok(Response::new(pb::ListPendingApprovalsResponse {
            approvals: approvals.iter().map(pb::PendingApproval::from).collect(),
            truncated,
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
