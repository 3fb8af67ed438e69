//! The server's shared state ([`Core`]) and the operations the gRPC handlers adapt: start a run
//! ([`Core::orchestrate`]), go on with one here ([`Core::resume`], the one path for runs taken
//! over and runs whose approvals were decided), follow one (`attach`), read, cancel, and decide
//! its calls waiting for approval. Everything here speaks the domain's types and [`Error`];
//! the proto is the gRPC adapter's business. Beside it, a file per concern: `approvals.rs` (a
//! person's decisions and answers, a refusal said with what the run does now), `threads.rs` (the
//! thread operations, by the rules in `threads/`), `usage.rs` (the hourly token budget at
//! admission, and `GetUsage`), `streams.rs` (the event streams of a run's caller and of callers
//! that attach).

mod approvals;
pub(crate) mod streams;
mod threads;
mod usage;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::StreamExt;
use shared::auth::Principal;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

use self::streams::{Replayed, RunEvents, StreamDeps, attach_error, no_run};
use crate::Error;
use crate::config::Config;
use crate::domain::listing::{Cursor, ListRequest, RunPage, RunQuery, check_labels};
use crate::domain::ports::SignalTopic;
use crate::domain::steering::{Closed, Refused, UserMessage};
use crate::domain::{CancelMode, EventBatch, RunResult, RunSpec, RunStatus};
use crate::registry::{Admitted, CancelOutcome, Queuing, Refusal, Runs, SteeringOutcome};
use crate::run::live::{EmitSettings, Emitter, gated};
use crate::run::tool_loop::{LoopDeps, Resumed};
use crate::telemetry::metric;
use crate::tool_runners::ToolRunners;

/// What the requests and the background tasks share.
pub(crate) struct Core {
    /// Configuration.
    pub config: Config,
    /// The loop's dependencies.
    pub deps: LoopDeps,
    /// Live runs and results.
    pub runs: Arc<Runs>,
    /// Tool-runner connection (for the catalog; `None` in a simulation, whose runs are given
    /// their tools).
    pub runners: Option<ToolRunners>,
    /// The signal topic.
    pub signals: Arc<dyn SignalTopic>,
    /// Threads (conversations across runs).
    pub threads: Arc<crate::threads::Keeper>,
    /// Set when the drain starts: new runs are refused.
    pub draining: AtomicBool,
    /// Cancelled when the drain starts: open SubscribeSignals streams end, so the server can stop.
    pub stopping: tokio_util::sync::CancellationToken,
    /// Cancelled once the drain handed every durable run over: the incarnation's keeper stops
    /// renewing (it kept the runs held while they went to their safe points), and the drain
    /// retires it.
    pub drained: tokio_util::sync::CancellationToken,
    /// Console sessions people ended (the console's, when it is on).
    pub sign_outs: Arc<dyn crate::domain::ports::SignOuts>,
    /// The named agents requests may name (`--agents`).
    pub agents: Arc<crate::agents::Agents>,
    /// Where callers are told of their runs.
    pub webhooks: Arc<crate::webhooks::Webhooks>,
}

/// Why a run goes on here without a caller of its own.
#[derive(Clone, Copy)]
pub(crate) enum Resumption {
    /// Taken over from a replica that stopped or handed it over.
    TakenOver,
    /// Its calls waiting for approval were decided (or it woke: a timeout, its deadline, a cancel).
    Decided,
}

/// Why a live run takes no message now.
fn not_taking(run_id: &str, refused: Refused) -> String {
    match refused {
        Refused::Closed(Closed::Answered) => {
            format!("run {run_id:?} has answered and is completing; start a new run to go on")
        }
        Refused::Closed(Closed::LastTurn) => {
            format!("run {run_id:?} is in its last turn (max_turns): no turn is left to take a message")
        }
        Refused::AwaitingApproval => {
            format!(
                "run {run_id:?} waits for approvals; decide its calls (DecideToolCalls, `orchestrator decide`), then send the message"
            )
        }
        Refused::Full(max) => format!("run {run_id:?} was sent its limit of {max} messages"),
    }
}

/// What admission made of a run: let in (its spec as admitted), or the run that had ended under
/// its id.
enum Admission {
    Let(Box<(Admitted, RunSpec)>),
    Ended(Box<RunResult>),
}

/// Rows of a `ListRuns` page that asks for no size.
const DEFAULT_PAGE_SIZE: usize = 50;

impl Core {
    /// `Err(Draining)` once the drain started: new runs and new followers go to other replicas.
    pub(crate) fn refuse_when_draining(&self) -> Result<(), Error> {
        match self.draining.load(Ordering::Acquire) {
            true => Err(Error::Draining),
            false => Ok(()),
        }
    }

    /// What a caller's stream needs of the server.
    fn stream_deps(&self) -> StreamDeps {
        StreamDeps {
            runs: Arc::clone(&self.runs),
            stopping: self.stopping.clone(),
        }
    }

    /// Who a run's emitter tells of the run's happenings: the webhooks.
    fn notices(&self) -> Arc<dyn crate::domain::ports::Notices> {
        Arc::new(Arc::clone(&self.webhooks))
    }

    /// How a run's emitter sends to its caller.
    fn emit_settings(&self) -> EmitSettings {
        EmitSettings {
            send_timeout: self.config.runs.event_send_timeout,
            max_event_bytes: self.config.runs.max_caller_event_bytes,
        }
    }

    /// Admits and starts the run `spec` of `caller` (in the trace `trace_context` carries), or
    /// replays the finished run with its id (saying how); its events for the caller.
    pub(crate) async fn orchestrate(
        self: &Arc<Self>,
        spec: RunSpec,
        detached: bool,
        trace_context: &tonic::metadata::MetadataMap,
        caller: Arc<Principal>,
    ) -> Result<(RunEvents, Option<Replayed>), Error> {
        match self.admit(spec, &caller).await? {
            Admission::Let(let_in) => {
                let (admitted, spec) = *let_in;
                Ok((self.start(admitted, spec, detached, trace_context, caller), None))
            }
            Admission::Ended(result) => {
                let (events, replayed) = self.replay(*result, &caller).await;
                Ok((events, Some(replayed)))
            }
        }
    }

    /// Admits the run `spec` of `caller` and starts it in the background, detached, with no
    /// caller following it (`StartRun`): its status then (`Running`, or the final status of the
    /// run that had ended under its id, which is not started again) and how long it waited for
    /// a slot.
    pub(crate) async fn start_in_background(
        self: &Arc<Self>,
        spec: RunSpec,
        trace_context: &tonic::metadata::MetadataMap,
        caller: Arc<Principal>,
    ) -> Result<(RunStatus, u64), Error> {
        match self.admit(spec, &caller).await? {
            Admission::Let(let_in) => {
                let (mut admitted, spec) = *let_in;
                let queued_ms = spec.queued_ms;
                let emitter = Emitter::new(None, Arc::clone(&admitted.state), self.emit_settings(), None)
                    .with_log(admitted.log.take())
                    .with_notices(self.notices());
                self.spawn_run(admitted, spec, emitter, None, trace_context);
                Ok((RunStatus::Running, queued_ms))
            }
            Admission::Ended(result) => Ok((result.status, 0)),
        }
    }

    /// Lets the run `spec` of `caller` in: within the caller's hourly budget, holding its thread
    /// (see `take_thread`, let go again when the run is not let in), then a run slot, waiting in
    /// the queue for one when they are all taken. A run id whose run has ended is answered with
    /// that run's result.
    async fn admit(&self, mut spec: RunSpec, caller: &Arc<Principal>) -> Result<Admission, Error> {
        self.within_hourly_budget(caller).await?;
        spec.request_digests = spec.request_digests();
        let (mut spec, took_thread) = self.take_thread(spec, caller).await?;
        spec.max_runs = caller.max_runs;
        let run_id = spec.run_id.clone();
        let admitted = self
            .runs
            .admit_queued(&run_id, caller, Some(&spec), spec.deadline.at)
            .await;
        if admitted.is_err() && took_thread {
            self.leave_thread(&spec).await;
        }
        match admitted {
            Ok(Queuing { admitted, waited }) => {
                spec.queued_ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX);
                shared::sync::lock(&admitted.state).queued_ms = spec.queued_ms;
                Ok(Admission::Let(Box::new((admitted, spec))))
            }
            Err(Refusal::Finished(result)) => {
                let differ = crate::domain::spec::differing_parts(&spec.request_digests, &result.request_digests);
                match differ.is_empty() {
                    true => Ok(Admission::Ended(result)),
                    false => Err(Error::RunIdReused { run_id, parts: differ }),
                }
            }
            Err(Refusal::Duplicate) => Err(Error::AlreadyRunning(run_id)),
            Err(Refusal::Full(slots)) => Err(Error::Busy(slots)),
            Err(Refusal::CallerFull(limit)) => Err(Error::CallerBusy {
                principal: caller.name.clone(),
                limit,
            }),
            // Another caller's run is answered as not found, so run ids cannot be probed.
            Err(Refusal::Foreign) => Err(no_run(&run_id)),
            Err(Refusal::Unclaimed(e)) => Err(Error::Store(e)),
            Err(Refusal::QueueFull(full)) => Err(Error::QueueFull {
                principal: caller.name.clone(),
                full,
            }),
            Err(Refusal::Waited(waited)) => Err(Error::SlotWait(waited)),
        }
    }

    /// Starts an admitted run as its own task, in the caller's trace, and returns its event
    /// stream. A run that is not `detached` is canceled when the caller goes away or stops
    /// reading.
    fn start(
        self: &Arc<Self>,
        mut admitted: Admitted,
        spec: RunSpec,
        detached: bool,
        trace_context: &tonic::metadata::MetadataMap,
        caller: Arc<Principal>,
    ) -> RunEvents {
        let run_id = spec.run_id.clone();
        let (caller_tx, rx) = mpsc::channel::<EventBatch>(self.config.runs.event_buffer);
        let caller_gone = (!detached).then(|| caller_tx.clone());
        let settings = self.emit_settings();
        let on_stall = (!detached).then(|| admitted.cancel.clone());
        let log = admitted.log.take();
        // A durable run's caller is sent only what its log holds (see `gated`).
        let tx = match log.as_ref().and_then(|log| log.settled()) {
            Some(settled) if admitted.persister.durable() => gated(caller_tx, settled, settings.send_timeout),
            _ => caller_tx,
        };
        let state = Arc::clone(&admitted.state);
        let emitter = Emitter::new(Some(tx), Arc::clone(&state), settings, on_stall)
            .with_log(log)
            .with_notices(self.notices());
        self.spawn_run(admitted, spec, emitter, caller_gone, trace_context);
        // A batch's events are all ready at once, so tonic encodes them into one HTTP/2 frame.
        let events = ReceiverStream::new(rx).flat_map(futures::stream::iter);
        streams::caller_stream(self.stream_deps(), run_id, caller, state, events)
    }

    /// Runs the admitted run `spec` as its own task, in the trace `trace_context` carries.
    fn spawn_run(
        &self,
        admitted: Admitted,
        spec: RunSpec,
        emitter: Emitter,
        caller_gone: Option<mpsc::Sender<EventBatch>>,
        trace_context: &tonic::metadata::MetadataMap,
    ) {
        let span = crate::telemetry::invoke_agent_span(&spec.model, &spec.run_id, &spec.principal);
        shared::telemetry::continue_trace(&span, trace_context);
        let run = admitted.into_run(spec, emitter, caller_gone);
        shared::tasks::spawn(crate::run::tool_loop::run(run, self.deps.clone()).instrument(span));
    }

    /// Goes on with a run taken over or unparked here, as its own task with no caller of its own
    /// (callers follow it with `AttachRun`).
    pub(crate) fn resume(&self, mut admitted: Admitted, resumed: Resumed, why: Resumption) {
        let spec = resumed.checkpoint.spec.clone();
        let emitter = Emitter::new(None, Arc::clone(&admitted.state), self.emit_settings(), None)
            .with_log(admitted.log.take())
            .with_notices(self.notices());
        let span = crate::telemetry::invoke_agent_span(&spec.model, &spec.run_id, &spec.principal);
        match why {
            Resumption::TakenOver => {
                tracing::info!(parent: &span, run_id = %spec.run_id, turns_done = resumed.checkpoint.progress.turns_done, logged = resumed.logged, "took the run over");
                metrics::counter!(metric::RUNS_MOVED, "how" => "taken_over").increment(1);
            }
            Resumption::Decided => {
                tracing::info!(parent: &span, run_id = %spec.run_id, turns_done = resumed.checkpoint.progress.turns_done, "the run goes on after its approvals");
            }
        }
        let deps = self.deps.clone();
        shared::tasks::spawn(
            async move {
                // A run that parked gave its slot among its caller's `max_runs` back.
                if !admitted.retake_quota(spec.deadline.at).await {
                    tracing::info!(run_id = %spec.run_id, "the run moved to another replica while it waited for a slot");
                    return;
                }
                let run = admitted.into_run(spec, emitter, None);
                crate::run::tool_loop::resume(run, resumed, deps).await;
            }
            .instrument(span),
        );
    }

    /// `caller` follows run `run_id` from after `after_seq` (`AttachRun`).
    pub(crate) async fn attach(
        self: &Arc<Self>,
        run_id: &str,
        after_seq: u64,
        caller: &Principal,
    ) -> Result<RunEvents, Error> {
        let feed = self
            .runs
            .attach(run_id, after_seq, caller)
            .await
            .map_err(|e| attach_error(run_id, e))?;
        Ok(streams::attached(
            &self.stream_deps(),
            run_id.to_owned(),
            after_seq,
            feed,
        ))
    }

    /// A finished run's events, for a retry of its `Orchestrate`: its log from the first event,
    /// as its caller saw them; its result as one delta each only when the log no longer holds
    /// the run whole (the memory store's log past its bounds, or its age).
    async fn replay(&self, result: RunResult, caller: &Principal) -> (RunEvents, Replayed) {
        let Ok(mut feed) = self.runs.follow(&result.run_id, 0, caller).await else {
            return (streams::replay(result), Replayed::Result);
        };
        match feed.next().await {
            Some(Ok(first)) if first.seq == 1 => {
                let events = futures::stream::once(async move { Ok(first) })
                    .chain(feed.map(|item| item.map_err(Error::Log)))
                    .boxed();
                (events, Replayed::Log)
            }
            _ => (streams::replay(result), Replayed::Result),
        }
    }

    /// The run as `caller` may see it: live state so far, or its stored result.
    pub(crate) async fn get(&self, run_id: &str, caller: &Principal) -> Result<RunResult, Error> {
        self.runs.get(run_id, caller).await?.ok_or_else(|| no_run(run_id))
    }

    /// Cancels the run: whether this call canceled it, and its status.
    pub(crate) async fn cancel(
        &self,
        run_id: &str,
        caller: &Principal,
        mode: CancelMode,
    ) -> Result<(bool, RunStatus), Error> {
        let reason = match mode {
            CancelMode::Immediate => "canceled by CancelRun",
            CancelMode::AfterTurn => "canceled by CancelRun after its turn",
        };
        match self.runs.cancel(run_id, caller, reason, mode).await? {
            CancelOutcome::Canceled => Ok((true, RunStatus::Canceled)),
            CancelOutcome::EndsAfterTurn => Ok((true, RunStatus::Running)),
            CancelOutcome::AlreadyFinished(status) => Ok((false, status)),
            CancelOutcome::NotFound => Err(no_run(run_id)),
            CancelOutcome::Unanswered => Err(Error::RunElsewhere(run_id.to_owned())),
        }
    }

    /// Sends `message` to a live run of `caller`: how many messages wait for its next turn
    /// boundary, this one included.
    pub(crate) async fn send_message(
        &self,
        run_id: &str,
        caller: &Principal,
        message: UserMessage,
    ) -> Result<u32, Error> {
        match self.runs.send_message(run_id, caller, message).await? {
            SteeringOutcome::Accepted(waiting) => {
                tracing::info!(run_id = %run_id, principal = %caller.name, waiting, "a message for the run's next turn");
                Ok(waiting)
            }
            SteeringOutcome::Refused(Refused::Full(max)) => Err(Error::InboxFull {
                run_id: run_id.to_owned(),
                max,
            }),
            SteeringOutcome::Refused(refused) => Err(Error::NotNow(not_taking(run_id, refused))),
            SteeringOutcome::Finished(status) => Err(Error::NotNow(format!(
                "run {run_id:?} has ended ({}); start a new run to go on",
                status.name()
            ))),
            SteeringOutcome::NotFound => Err(no_run(run_id)),
            SteeringOutcome::Unanswered => Err(Error::RunElsewhere(run_id.to_owned())),
        }
    }

    /// A page of the runs `caller` may see that `request` asks for: its own, or any
    /// principal's for an operator (and for the anonymous caller of a server without
    /// authentication).
    pub(crate) async fn list_runs(
        &self,
        request: ListRequest,
        caller: &Principal,
    ) -> Result<(RunPage, Option<String>), Error> {
        let query = self.run_query(request, caller)?;
        let page = self.runs.list(query.clone()).await?;
        let token = page.next.as_ref().map(|cursor| cursor.token(&query));
        Ok((page, token))
    }

    /// The query `request` asks, within what `caller` may see and this server's bounds.
    fn run_query(&self, request: ListRequest, caller: &Principal) -> Result<RunQuery, Error> {
        let everyone = caller.is_anonymous() || caller.has_role(shared::auth::OPERATOR);
        let principal = match request.principal {
            Some(other) if !everyone && other != caller.name => {
                return Err(Error::PermissionDenied(format!(
                    "listing the runs of {other:?} needs the \"{}\" role in the tokens file; leave principal empty for your own runs",
                    shared::auth::OPERATOR
                )));
            }
            Some(principal) => Some(principal),
            None if everyone => None,
            None => Some(caller.name.clone()),
        };
        let bounds = &self.config.runs.request;
        check_labels(&request.labels, bounds.max_labels, bounds.max_label_bytes)
            .map_err(|e| Error::InvalidArgument(format!("labels: {e}")))?;
        let page_max = self.config.store.list_page_max;
        let mut query = RunQuery {
            statuses: request.statuses,
            thread_id: request.thread_id,
            principal,
            labels: request.labels,
            created_after_ms: request.created_after_ms,
            created_before_ms: request.created_before_ms,
            agent: request.agent,
            page_size: match request.page_size {
                0 => DEFAULT_PAGE_SIZE.min(page_max),
                asked => asked.min(page_max),
            },
            after: None,
        };
        if let Some(token) = &request.page_token {
            let cursor = Cursor::parse(token, &query).map_err(|e| Error::InvalidArgument(e.to_string()))?;
            query.after = Some(cursor);
        }
        Ok(query)
    }
}
