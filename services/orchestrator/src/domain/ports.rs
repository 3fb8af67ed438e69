//! The ports of the loop: what it needs from the outside world, as traits. Adapters implement
//! them (tool-runners over gRPC, the result store in memory or NATS, the signal topic in memory or
//! NATS); tests implement them in-process.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;

use super::approval::{DecideError, Decider, Decision, PendingApproval};
use super::event::NumberedEvent;
use super::ownership::{LeaseTerms, Ownership};
use super::result::{Delivery, RunResult, Signal, ToolCallError};

/// A normal tool call to execute.
#[derive(Debug, Clone)]
pub struct ToolInvocation {
    /// Run.
    pub run_id: String,
    /// Call id.
    pub call_id: String,
    /// Tool.
    pub name: String,
    /// Arguments (a JSON object).
    pub arguments_json: String,
    /// Run metadata.
    pub metadata: BTreeMap<String, String>,
    /// The caller the run belongs to.
    pub principal: String,
    /// The epoch of this replica's claim of the run (0: not durable): a runner given the run
    /// store refuses a call whose epoch is older than the run's fence, and a tool with side
    /// effects may refuse an older one than it has seen.
    pub epoch: u64,
    /// This replica's ownership of the run (`None`: a run no other replica reads): every
    /// attempt, retries included, is sent only while it holds the run, and a runner's answer
    /// that the run is in a newer epoch stops it.
    pub owner: Option<Ownership>,
    /// Deadline of this call.
    pub timeout: Duration,
    /// The answers to the questions this call asked in its last attempt (it is tried again
    /// with them).
    pub answers: Option<super::input::Answers>,
    /// The task this call became (its server runs it in the background): this attempt goes on
    /// with it instead of starting the tool again.
    pub task: Option<super::task::ToolTask>,
    /// With `task`: ask the server to cancel it first.
    pub cancel_task: bool,
    /// A person chose to run the call again although it is in doubt (an earlier attempt started
    /// on a runner that went away before its outcome was kept).
    pub rerun_in_doubt: bool,
    /// Where the call's progress reports go while it runs (`None`: nobody follows them).
    pub progress: Option<ProgressFn>,
}

/// How a call still running gets on, as its tool says it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolProgress {
    /// How far it got, in the tool's units.
    pub progress: f64,
    /// How far it has to go in all (0: not known).
    pub total: f64,
    /// What the tool says, for a person.
    pub message: String,
}

/// Takes a call's progress reports (it must not block: reports come from the call's transport).
#[derive(Clone)]
pub struct ProgressFn(pub std::sync::Arc<dyn Fn(ToolProgress) + Send + Sync>);

impl ProgressFn {
    /// Hands `progress` over.
    pub fn report(&self, progress: ToolProgress) {
        (self.0)(progress);
    }
}

impl std::fmt::Debug for ProgressFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProgressFn")
    }
}

/// What a call gave back when it did not fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolOutput {
    /// Its result, as JSON text.
    Result(String),
    /// It asks a person these questions before it can finish.
    Asked(super::input::Questions),
    /// Its server runs it as a task still working: the call's next attempts follow it.
    Task(super::task::ToolTask),
}

/// Executes normal tool calls (on tool-runners, or scripted in tests). Dropping the future
/// cancels the call.
pub trait ToolExecutor: Send + Sync + 'static {
    /// Runs one call: its result (as JSON text) or its questions.
    fn execute(&self, call: ToolInvocation) -> BoxFuture<'static, Result<ToolOutput, ToolCallError>>;
}

/// A place for run results.
pub trait ResultStore: Send + Sync + 'static {
    /// Stores (or replaces) a run's result.
    fn put(&self, result: RunResult) -> BoxFuture<'static, Result<(), StoreError>>;
    /// Stores a new run's first state unless its id is taken (by a run on another replica, live
    /// or finished), atomically.
    fn claim(&self, result: RunResult) -> BoxFuture<'static, Result<Claim, StoreError>>;
    /// A run's result, if kept.
    fn get(&self, run_id: &str) -> BoxFuture<'static, Result<Option<RunResult>, StoreError>>;
    /// `Some` when other replicas read this store: live runs are then written at turn
    /// boundaries and at least every [`LeaseTerms::renew_every`], which renews their lease, and
    /// their owner stops acting once its lease runs out unrenewed (a local store already sees
    /// them through the registry).
    fn lease(&self) -> Option<LeaseTerms>;
    /// The epoch of this replica's claim of `run_id` (0: not claimed here, or a local store).
    fn epoch(&self, _run_id: &str) -> u64 {
        0
    }
    /// The lease of this process's incarnation, when the store holds runs under one (their
    /// records are then not rewritten to stay held: see [`Liveness`]).
    ///
    /// [`Liveness`]: super::ownership::Liveness
    fn liveness(&self) -> Option<super::ownership::Liveness> {
        None
    }
    /// The generation of the incarnation the record of `run_id` names, as this replica wrote it
    /// (0: not claimed here).
    fn generation(&self, _run_id: &str) -> u64 {
        0
    }
}

/// Where runs are found (`ListRuns`): the stored runs of every replica that shares the store,
/// through an index rather than a scan of every result.
pub trait RunIndex: Send + Sync + 'static {
    /// A page of the runs `query` asks for, newest first. `here` are the runs live on this
    /// replica as it sees them now: a store that does not keep live runs lists them from there;
    /// one that does shows them as they are here (fresher than their last record).
    fn list(
        &self,
        query: super::listing::RunQuery,
        here: Vec<super::listing::RunSummary>,
    ) -> BoxFuture<'static, Result<super::listing::RunPage, StoreError>>;
}

/// A principal's runs in flight across the fleet (its `max_runs` counted on every replica that
/// shares the store): a slot per run, taken before the run is let in and given back once it
/// ends or parks. A slot is the run's, not its replica's: a run taken over keeps it, and a slot
/// whose run has ended (its replica stopped before giving it back) is free to take.
pub trait Quotas: Send + Sync + 'static {
    /// Takes one of `principal`'s `max` slots for the admission `admission` of `run_id`: the
    /// slot taken; `Ok(None)` when live runs hold them all.
    fn take(
        &self,
        principal: &str,
        max: usize,
        run_id: &str,
        admission: &str,
    ) -> BoxFuture<'static, Result<Option<TakenSlot>, StoreError>>;
    /// Gives back the slot `run_id` holds: the one `taken` names (while it still holds it), or
    /// (`None`: a run taken over, whose admission was another replica's) any of its own;
    /// nothing when it holds none.
    fn give_back(
        &self,
        principal: &str,
        run_id: &str,
        taken: Option<TakenSlot>,
    ) -> BoxFuture<'static, Result<(), StoreError>>;
}

/// A slot an admission took ([`Quotas::take`]): which one, and the admission that holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakenSlot {
    /// The slot.
    pub slot: String,
    /// The admission.
    pub admission: String,
}

/// Where each principal's spend adds up, per hour window (in memory, or shared by the replicas
/// in the store). Adding is atomic: concurrent runs of a principal on several replicas never
/// lose each other's spend.
pub trait UsageBook: Send + Sync + 'static {
    /// Applies `add` to `principal`'s window starting `window` ([`super::usage::Window::apply`]:
    /// what the window already had of the add's run is not added again); the window's total
    /// after it.
    fn add(
        &self,
        principal: &str,
        window: u64,
        add: super::usage::Add,
    ) -> BoxFuture<'static, Result<super::usage::Tally, StoreError>>;
    /// `principal`'s windows from `from` to `to` (window starts, both included) that spent
    /// anything, oldest first.
    fn read(
        &self,
        principal: &str,
        from: u64,
        to: u64,
    ) -> BoxFuture<'static, Result<Vec<(u64, super::usage::Tally)>, StoreError>>;
}

/// Console sessions people ended (signed out), kept until they would have expired anyway, so
/// that every replica refuses them: in this process (the memory store, one replica) or in a NATS
/// bucket the replicas share.
pub trait SignOuts: Send + Sync + 'static {
    /// Ends session `id`, which would otherwise be good until `until_unix_s`.
    fn end(&self, id: &str, until_unix_s: u64) -> BoxFuture<'static, Result<(), StoreError>>;
    /// Whether session `id` was ended.
    fn ended(&self, id: &str) -> BoxFuture<'static, Result<bool, StoreError>>;
}

/// Where a run's emitter tells of what happened to the run (its start, a call waiting for a
/// person, its end) before its caller sees it: the webhooks.
pub trait Notices: Send + Sync + 'static {
    /// Takes note of what `batch` holds for the run whose state is `run`; done once the
    /// deliveries are written (or given up on, said in the log).
    fn notice(&self, run: &std::sync::Mutex<RunResult>, batch: &[NumberedEvent]) -> BoxFuture<'static, ()>;
}

/// Durable runs (the NATS store): a live run's checkpoints, and the takeover of runs whose
/// replica stopped. Checkpoints are opaque bytes here (the loop writes and reads them). The owner
/// of a run is fenced: once another replica took the run over, the old owner's writes of it are
/// refused with [`StoreError::Fenced`].
pub trait RunJournal: Send + Sync + 'static {
    /// Saves the run's checkpoint (replacing the last one) and renews its lease with its state
    /// `result`; `deadline_unix_ms` says until when another replica may still resume it.
    fn save(
        &self,
        result: RunResult,
        deadline_unix_ms: u64,
        checkpoint: Vec<u8>,
    ) -> BoxFuture<'static, Result<(), StoreError>>;
    /// Claims a new run's id as [`ResultStore::claim`] does, with `checkpoint` (the run's start)
    /// in place first: a run is resumable from the moment its id is claimed, so a replica that
    /// stops before the run's first turn ends loses nothing.
    fn claim_resumable(
        &self,
        result: RunResult,
        deadline_unix_ms: u64,
        checkpoint: Vec<u8>,
    ) -> BoxFuture<'static, Result<Claim, StoreError>>;
    /// Whether [`Self::keep_segment`] keeps segments (a journal that does not is never asked).
    fn keeps_segments(&self) -> bool {
        false
    }
    /// Keeps `segment` (a run of the transcript's messages, JSON, never changed once kept) for
    /// the run's checkpoints to name instead of holding it: what a checkpoint writes is then what
    /// changed since the last one, not the whole transcript again. Its position; `None` from a
    /// journal that keeps no segments (its checkpoints hold the whole transcript).
    fn keep_segment(&self, run_id: &str, segment: Vec<u8>) -> BoxFuture<'static, Result<Option<u64>, StoreError>> {
        let _ = (run_id, segment);
        futures::future::ready(Ok(None)).boxed()
    }
    /// The run's segments kept at `positions`, in that order (an error when one is missing).
    fn segments(&self, run_id: &str, positions: Vec<u64>) -> BoxFuture<'static, Result<Vec<Vec<u8>>, StoreError>> {
        let missing = match positions.first() {
            Some(position) => Err(StoreError::Corrupt {
                key: format!("segment {position} of run {run_id}"),
                reason: "this journal keeps no segments".to_owned(),
            }),
            None => Ok(Vec::new()),
        };
        futures::future::ready(missing).boxed()
    }
    /// Forgets the run's checkpoint and segments (it ended, or moved for good).
    fn forget(&self, run_id: &str) -> BoxFuture<'static, Result<(), StoreError>>;
    /// Runs with a checkpoint whose owner is gone: lease lapsed, or handed over.
    fn orphans(&self) -> BoxFuture<'static, Result<Vec<String>, StoreError>>;
    /// Claims an orphan for this replica (compare-and-set on the record, one winner) and returns
    /// its checkpoint; `None` when it is no orphan any more (another replica won). A parked run
    /// claimed keeps reading parked until its new owner writes it.
    fn take_over(&self, run_id: &str) -> BoxFuture<'static, Result<Option<Claimed>, StoreError>>;
    /// Releases this replica's run marked as handed over (its last checkpoint stands), so another
    /// replica takes it at once.
    fn hand_over(&self, run_id: &str) -> BoxFuture<'static, Result<(), StoreError>>;
    /// Tells of runs handed over by any replica, as they are (the takeover looks at once instead
    /// of at its next round); an item per hand-over, best effort.
    fn hand_overs(&self) -> BoxFuture<'static, BoxStream<'static, ()>>;
    /// Keeps this replica's incarnation (the lease every run held here reads) alive until the
    /// future is dropped: renewed every third of the lease, and the runs held in the store but
    /// not run here any more handed over. A store without incarnations never resolves it.
    fn keep_alive(&self) -> BoxFuture<'static, ()> {
        futures::future::pending().boxed()
    }
    /// Ends this replica's incarnation at a clean stop, once its runs were handed over: what
    /// still runs under it stops here, then its record is marked over, so what it still holds
    /// moves at once.
    fn retire(&self) -> BoxFuture<'static, ()> {
        futures::future::ready(()).boxed()
    }
    /// Asks the replica running `run_id` to cancel it `mode`'s way with `reason`, and returns
    /// its answer; `None` when no replica answered (none runs it now: it is moving between
    /// replicas).
    fn cancel_elsewhere(
        &self,
        run_id: &str,
        reason: &str,
        mode: super::CancelMode,
    ) -> BoxFuture<'static, Result<Option<RemoteCancel>, StoreError>>;
    /// The cancels other replicas were asked for, as they come; only the replica running the run
    /// answers one.
    fn cancel_asks(&self) -> BoxFuture<'static, BoxStream<'static, CancelAsk>>;
    /// Sends `message` to the replica running `run_id` (`SendMessage` reached another one), and
    /// returns its answer; `None` when no replica answered (always, for a journal whose
    /// replicas cannot ask each other).
    fn steer_elsewhere(
        &self,
        _run_id: &str,
        _message: super::steering::UserMessage,
    ) -> BoxFuture<'static, Result<Option<RemoteSteer>, StoreError>> {
        Box::pin(async { Ok(None) })
    }
    /// The messages other replicas were sent for runs, as they come; only the replica running
    /// the run answers one (none, for a journal whose replicas cannot ask each other).
    fn steering_asks(&self) -> BoxFuture<'static, BoxStream<'static, SteeringAsk>> {
        Box::pin(async { Box::pin(futures::stream::pending()) as BoxStream<'static, SteeringAsk> })
    }
}

/// An orphan a takeover claimed ([`RunJournal::take_over`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimed {
    /// Its checkpoint (opaque here).
    pub checkpoint: Vec<u8>,
    /// It reads parked (waiting for a person or a task; ready to go on, or claimed since and
    /// waiting for a slot): it holds no slot among its principal's `max_runs`, and must take
    /// one again.
    pub parked: bool,
    /// Why a caller asked it to end after its turn under way, kept in its record: it ends
    /// there here too.
    pub ends_after_turn: Option<String>,
}

/// What the replica running a run answered to a message sent on another replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RemoteSteer {
    /// The run took it: this many messages wait for its next turn boundary.
    Accepted(u32),
    /// The run refused it.
    Refused(super::steering::Refused),
    /// The run had already ended there, with this status.
    Finished(super::RunStatus),
}

/// A message for a run, sent on another replica.
pub struct SteeringAsk {
    /// The run.
    pub run_id: String,
    /// The message.
    pub message: super::steering::UserMessage,
    /// Sends the answer to the replica that asked.
    pub answer: Box<dyn FnOnce(RemoteSteer) -> BoxFuture<'static, ()> + Send>,
}

/// What the replica running a run answered to a cancel asked on another replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RemoteCancel {
    /// The run was live there, and is canceled.
    Canceled,
    /// The run was live there, and ends once its turn in progress has ended.
    EndsAfterTurn,
    /// The run had already ended there, with this status.
    Finished(super::RunStatus),
}

/// A cancel asked on another replica (`CancelRun` reached a replica that does not run the run).
pub struct CancelAsk {
    /// The run.
    pub run_id: String,
    /// Why (the run's failure detail).
    pub reason: String,
    /// At once, or after the run's turn in progress.
    pub mode: super::CancelMode,
    /// Sends the answer to the replica that asked.
    pub answer: Box<dyn FnOnce(RemoteCancel) -> BoxFuture<'static, ()> + Send>,
}

/// The outcome of [`ResultStore::claim`].
#[derive(Debug)]
pub enum Claim {
    /// The id is this run's now.
    Claimed,
    /// The id was taken; here is that run as it reads now.
    Taken(Box<RunResult>),
}

/// Why the result store did not do what was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The store refused the operation or could not be reached.
    #[error("{operation} {key}: {reason}")]
    Unavailable {
        /// What was asked (`KV put`, `KV get` …).
        operation: &'static str,
        /// The key (or bucket) it was asked of.
        key: String,
        /// The store's answer.
        reason: String,
    },
    /// A stored value cannot be read as a run.
    #[error("the value of {key} is not a run record: {reason}")]
    Corrupt {
        /// Its key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No answer within the store timeout.
    #[error("no answer within {}", humantime::format_duration(*.0))]
    Timeout(Duration),
    /// Another replica owns the run now (it took the run over): this replica must stop it
    /// without writing anything more of it.
    #[error("run {run_id} was taken over by {owner}")]
    Fenced {
        /// The run.
        run_id: String,
        /// Its owner now.
        owner: String,
    },
    /// A value could not be encoded: nothing was written (never empty bytes in its place).
    #[error("{what} could not be encoded, so nothing was written: {reason}")]
    Unencodable {
        /// What was to be written.
        what: &'static str,
        /// The encoder's error.
        reason: String,
    },
}

/// `value` as JSON, for a write: an encoding failure is an error, never empty bytes written in
/// its place.
pub fn json<T: serde::Serialize + ?Sized>(what: &'static str, value: &T) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(value).map_err(|e| StoreError::Unencodable {
        what,
        reason: e.to_string(),
    })
}

/// One store operation, given at most `timeout`: every caller of the store bounds its waits so.
pub async fn within<T>(
    timeout: Duration,
    operation: BoxFuture<'static, Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(timeout, operation)
        .await
        .unwrap_or(Err(StoreError::Timeout(timeout)))
}

/// Where each run's events are kept, numbered, so a caller can re-attach (`AttachRun`) from the
/// last `seq` it saw, on any replica that shares the log, for as long as results are kept.
pub trait EventLog: Send + Sync + 'static {
    /// The writer of a run's events, appending after `logged`: 0 for a new run, whose log starts
    /// empty (a run id is claimed once); the log's last seq for a run taken over from another
    /// replica (only a shared log has one).
    fn writer(&self, run_id: &str, logged: u64) -> Box<dyn LogWriter>;
    /// The writer of the run's events for its owner, continuing the log that ends at `from`: a
    /// log shared by replicas refuses an append that does not follow `from` and what this writer
    /// appended since (another owner wrote in between), and stops `owner` then; nothing is
    /// appended once `owner` stopped. A log of one replica is [`EventLog::writer`].
    fn owned_writer(&self, run_id: &str, from: &Logged, _owner: &Ownership) -> Box<dyn LogWriter> {
        self.writer(run_id, from.seq)
    }
    /// The run's events with `seq > after_seq`, then those appended later, up to and including
    /// `run_finished`. `Ok(None)`: this log has nothing of the run (unknown or expired).
    fn follow(&self, run_id: &str, after_seq: u64) -> BoxFuture<'static, Result<Option<EventFeed>, LogError>>;
    /// The last event the log keeps of the run: where a replica taking the run over continues,
    /// or the run's end when it finished before its record said so.
    fn last(&self, run_id: &str) -> BoxFuture<'static, Result<Logged, LogError>>;
}

/// The end of a run's log.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Logged {
    /// The seq of the last event kept (0 when none).
    pub seq: u64,
    /// Where the log's backend has the run's last message (a shared log's position, which a
    /// new owner's first append must follow; 0 when none).
    pub position: u64,
    /// The run's result when that event is `run_finished`: the run ended, though its replica
    /// may have stopped before storing the result.
    pub finished: Option<crate::domain::RunResult>,
}

/// How far a log written in the background has come with a run's events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settled {
    /// Every event through this seq is in the log.
    pub kept_through: u64,
    /// The log lost events after `kept_through` (the backend refused them for too long, or the
    /// writer's buffer was full): later events never settle.
    pub broken: bool,
}

impl Settled {
    /// Whether waiting for `seq` is over: it is kept, or it never will be.
    pub fn resolved(&self, seq: u64) -> bool {
        self.broken || self.kept_through >= seq
    }
}

/// A run's events as a log hands them out: in `seq` order, without gaps, or an error that ends
/// the feed.
pub type EventFeed = BoxStream<'static, Result<NumberedEvent, LogError>>;

/// Appends one run's events to its log. Appending never waits for the log's backend: what
/// cannot be kept is reported by the log (a gap that a follower sees as an error), never by
/// slowing the run.
pub trait LogWriter: Send {
    /// Appends events numbered by the run's emitter, in order.
    fn append(&mut self, events: &[NumberedEvent]);
    /// How far the log has kept the events appended, for a log written in the background;
    /// `None` when appending is settled at once.
    fn settled(&self) -> Option<tokio::sync::watch::Receiver<Settled>> {
        None
    }
}

/// Why a run's log cannot serve what was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogError {
    /// The log no longer keeps the events after `after_seq`: a run's log is bounded, and its
    /// oldest events were dropped.
    #[error(
        "the event log of run {run_id} keeps its events from seq {first_kept} on (it is bounded); after_seq {after_seq} is older; GetRun has the whole result"
    )]
    Trimmed {
        /// The run.
        run_id: String,
        /// What the caller asked for.
        after_seq: u64,
        /// The oldest event kept.
        first_kept: u64,
    },
    /// Events are missing from the log (the backend did not take them, or the run's writer
    /// went away without `run_finished`).
    #[error("the event log of run {run_id} lost events after seq {after_seq}: {reason}; GetRun has the result")]
    Lost {
        /// The run.
        run_id: String,
        /// The last event that was read.
        after_seq: u64,
        /// What happened.
        reason: String,
    },
    /// The log's backend cannot be read.
    #[error("the event log of run {run_id}: {reason}")]
    Unavailable {
        /// The run.
        run_id: String,
        /// The backend's answer.
        reason: String,
    },
}

/// Told once whether a published signal was delivered.
pub type OnDelivery = Box<dyn FnOnce(Delivery) + Send>;

/// Which signals a subscriber wants; empty fields match everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SignalFilter {
    /// Only this run's signals.
    pub run_id: Option<String>,
    /// Only these exit tools.
    pub tool_names: Vec<String>,
    /// Only the runs of this caller (set when the server authenticates callers).
    pub principal: Option<String>,
}

impl SignalFilter {
    /// Whether `signal` passes the filter.
    pub fn matches(&self, signal: &Signal) -> bool {
        self.run_id.as_ref().is_none_or(|id| *id == signal.run_id)
            && self.principal.as_ref().is_none_or(|p| *p == signal.principal)
            && (self.tool_names.is_empty() || self.tool_names.contains(&signal.tool_name))
    }
}

/// One item of a subscription.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SignalItem {
    /// A signal.
    Signal(Signal),
    /// The subscriber fell behind and this many signals were skipped.
    Missed(u64),
}

/// A topic signals are published to and subscribed from.
pub trait SignalTopic: Send + Sync + 'static {
    /// Publishes a signal and returns at once; `on_delivery` is called once with the outcome.
    /// With `owner` (a durable run's ownership) each attempt goes out only while this replica
    /// may still act for the run; a replaced owner's retries stop unreported.
    fn publish(&self, signal: &Signal, owner: Option<Ownership>, on_delivery: OnDelivery);
    /// Signals published from the moment the returned future resolves that pass `filter`.
    fn subscribe(&self, filter: SignalFilter) -> BoxFuture<'static, BoxStream<'static, SignalItem>>;
}

/// A run's wait for decisions, opened when its turn announces the calls that wait.
pub struct Wait {
    /// The run.
    pub run_id: String,
    /// Its owner (who may decide, besides approvers).
    pub principal: String,
    /// The calls that wait, each with its tool's argument schema (an edit must pass it).
    pub calls: Vec<(PendingApproval, serde_json::Value)>,
    /// The epoch of the claim that opens it (0: a run of this replica only): a shared approval store keeps
    /// a newer owner's wait from an older owner's writes.
    pub epoch: u64,
}

impl Wait {
    /// The calls, and their tools' schemas by call id.
    pub fn into_calls(self) -> (Vec<PendingApproval>, BTreeMap<String, serde_json::Value>) {
        self.calls
            .into_iter()
            .map(|(call, schema)| {
                let id = call.call_id.clone();
                (call, (id, schema))
            })
            .unzip()
    }
}

/// A run parked until its calls are decided: what resumes it, and what `GetRun` shows meanwhile.
pub struct Parked {
    /// The loop's checkpoint (opaque here).
    pub checkpoint: Vec<u8>,
    /// The run's state (status `AWAITING_APPROVAL`).
    pub result: RunResult,
    /// When the run wakes even undecided (Unix ms): the first expiry, or its deadline sooner.
    pub wake_at_unix_ms: u64,
    /// When it parked (Unix ms): a run whose deadline pauses while it waits moves it by as much.
    pub parked_at_unix_ms: u64,
    /// Until when it may be resumed (its deadline, Unix ms).
    pub deadline_unix_ms: u64,
    /// Its event-log writer, kept for the run's resumption when the log is this process's.
    pub log: Option<Box<dyn LogWriter>>,
}

/// What parking a run came to.
pub enum ParkOutcome {
    /// Parked: the run leaves its slot.
    Parked,
    /// Every call was decided before the run parked: it goes on at once with these (the parked
    /// state is handed back).
    Decided(Vec<PendingApproval>, Box<Parked>),
}

/// A run's wait as a replica resuming it reads it.
#[derive(Debug, Clone, Default)]
pub struct ParkedCalls {
    /// Its calls with their decisions (undecided ones when it woke for its deadline or a cancel).
    pub calls: Vec<PendingApproval>,
    /// Set when `CancelRun` canceled it while it was parked.
    pub canceled: Option<String>,
    /// When it parked (Unix ms; 0 when it did not).
    pub parked_at_unix_ms: u64,
}

/// A parked run of this process to resume: decided, expired, past its deadline, or canceled.
pub struct Ready {
    /// The run.
    pub run_id: String,
    /// Its parked state.
    pub parked: Parked,
    /// Its calls and their decisions.
    pub calls: ParkedCalls,
}

/// Runs waiting for decisions on their calls (docs/architecture.md, "Approvals"). A run opens its
/// wait when it announces the calls; decisions may come from then on, while the turn's other
/// calls still run; the run then parks (leaving its slot) unless every call was decided already.
/// An approval store of this process hands a parked run out ([`ApprovalStore::take_ready`]) once decided,
/// expired, past its deadline or canceled; a shared approval store (NATS) marks it so in the run store,
/// where any replica takes it over.
pub trait ApprovalStore: Send + Sync + 'static {
    /// Opens the wait of a run's turn (keeping the decisions of its calls already made, when a
    /// resumed run opens the same wait again); `Err` with the reason when no more runs may wait,
    /// or a newer owner's wait stands.
    fn open(&self, wait: Wait) -> BoxFuture<'static, Result<(), String>>;
    /// Parks the run with an open wait.
    fn park(&self, run_id: &str, parked: Parked) -> BoxFuture<'static, Result<ParkOutcome, StoreError>>;
    /// Records `decisions` of `decider` (all or none: a refused one leaves every call as it
    /// was); returns the run's calls after them.
    fn decide(
        &self,
        run_id: &str,
        decider: &Decider,
        decisions: &[Decision],
    ) -> BoxFuture<'static, Result<Vec<PendingApproval>, DecideError>>;
    /// The calls waiting that `decider` may decide (of `run_id` only, when given), oldest first,
    /// at most `limit`; and whether more wait.
    fn pending(
        &self,
        decider: &Decider,
        run_id: Option<&str>,
        limit: usize,
    ) -> BoxFuture<'static, Result<(Vec<PendingApproval>, bool), StoreError>>;
    /// A run's wait, with the decisions so far (`None`: it waits for nothing).
    fn parked_calls(&self, run_id: &str) -> BoxFuture<'static, Result<Option<ParkedCalls>, StoreError>>;
    /// The wait of a parked run that goes on now (`now_unix_ms`): a shared approval store first decides its
    /// calls past their expiry so in the store (compare-and-set), so that a person's late
    /// answer and the expiry never both land — each call is decided once, by whichever came
    /// first. An approval store of this process has applied expiries already ([`LocalApprovals::expire`]).
    fn wake(&self, run_id: &str, _now_unix_ms: u64) -> BoxFuture<'static, Result<Option<ParkedCalls>, StoreError>> {
        self.parked_calls(run_id)
    }
    /// Cancels a parked run (it goes on only to end); whether one was parked.
    fn cancel(&self, run_id: &str, reason: &str) -> BoxFuture<'static, Result<bool, StoreError>>;
    /// Forgets a run's wait (it ended, or its calls were decided and taken), unless a newer
    /// owner than `epoch`'s opened it.
    fn close(&self, run_id: &str, epoch: u64) -> BoxFuture<'static, ()>;
    /// As [`ApprovalStore::close`], once the run took its wait's decisions — unless a cancel
    /// reached the wait after the run was taken from it: then the wait stays, so that whichever
    /// replica takes the run over next reads the cancel too, and the cancel is returned (the
    /// run ends canceled).
    fn close_decided(&self, run_id: &str, epoch: u64) -> BoxFuture<'static, Option<String>>;
    /// The part only an approval store of this process answers (`None` for a shared one: the
    /// run store shows and lists its parked runs, and the takeover wakes them).
    fn local(&self) -> Option<&dyn LocalApprovals> {
        None
    }
}

/// What only an approval store of this process answers: its parked runs as readers see them, and
/// waking them (timeouts and deadlines, then the ready ones resumed on free slots by the unpark
/// task). A shared store leaves the first to the run store and the second to the takeover.
pub trait LocalApprovals: Send + Sync {
    /// A run parked in this process, as `GetRun` shows it.
    fn parked(&self, run_id: &str) -> Option<RunResult>;
    /// Every run parked in this process, as `ListRuns` shows them.
    fn parked_runs(&self) -> Vec<RunResult>;
    /// Applies timeouts and deadlines as of `now_unix_ms`.
    fn expire(&self, now_unix_ms: u64);
    /// The oldest parked run of this process ready to resume, taken out of the approval store.
    fn take_ready(&self) -> Option<Ready>;
    /// Gives back a ready run that found no slot (it is handed out again later).
    fn put_back(&self, ready: Ready);
    /// Resolves when a run may have become ready.
    fn changed(&self) -> BoxFuture<'static, ()>;
}

/// Where threads are kept (beside the runs: in memory, or in NATS shared by the replicas). Reads
/// and writes are compare-and-set on a revision, so two replicas changing one thread never lose
/// a change: the rules of a change are the thread's ([`super::thread::Thread`]).
pub trait ThreadStore: Send + Sync + 'static {
    /// The thread and its revision; `None` when it is not kept (unknown, deleted or expired).
    fn read(&self, thread_id: &str) -> BoxFuture<'static, Result<Option<(super::thread::Thread, u64)>, StoreError>>;
    /// Writes `thread` over `revision` (0: a thread not kept yet); `Ok(false)` when another write
    /// came first.
    fn write(&self, thread: super::thread::Thread, revision: u64) -> BoxFuture<'static, Result<bool, StoreError>>;
    /// Deletes the thread at `revision`; `Ok(false)` when another write came first.
    fn delete(&self, thread_id: &str, revision: u64) -> BoxFuture<'static, Result<bool, StoreError>>;
}

#[cfg(test)]
mod json_tests {
    /// A value JSON cannot hold (a map keyed by something other than text) is an error naming
    /// what was to be written, never empty bytes to write in its place.
    #[test]
    fn a_value_that_cannot_be_encoded_is_an_error_not_empty_bytes() {
        let unencodable: std::collections::HashMap<(u8, u8), u8> = [((1, 2), 3)].into();
        let refused = super::json("a usage window", &unencodable).expect_err("tuple keys");
        assert!(
            refused.to_string().contains("a usage window could not be encoded"),
            "{refused}"
        );
        assert_eq!(super::json("a thread", &[1, 2]).ok(), Some(b"[1,2]".to_vec()));
    }
}
