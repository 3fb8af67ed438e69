//! The model and the tool-runners the simulated replicas call through their ports. The model
//! answers each run the same way whichever replica asks (the same conversation gives the same
//! call ids, as a turn replayed after a takeover does); a tool-runner reads the run's fence
//! from the store before it starts a tool, as the real one does, and the start it records is
//! what the tools saw, and it records each call (`tool_runner::record`) so that a call sent again
//! runs once. A lost runner dies (its calls' answers lost, their outcomes never kept, its liveness
//! no longer renewed) and comes back as a new process: a call it ran is sent again and found in
//! doubt. Now and then a tool asks a person first (an MCP `input_required`): it
//! starts only once its call comes back with the answers, and records what they were; the
//! [`Person`] answers from any replica.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use orchestrator::domain::ToolCallError;
use orchestrator::domain::chat::Message;
use orchestrator::domain::input::{Answers, InputMode, InputRequest, Questions};
use orchestrator::domain::model::{ChatModel, ChatRequest, LlmError, LlmEvent};
use orchestrator::domain::ports::{ToolExecutor, ToolInvocation, ToolOutput};
use orchestrator::domain::task::ToolTask;
use orchestrator::tool_runners::sender::{self, Attempt, Retries};
use tokio::time::Instant;

use super::condition::Condition;
use super::view::Watched;

/// The turns every run plays: two calls a turn (one in every third), then the answer.
pub const TURNS: usize = 8;

/// How long a quiet run's one call works (its run waits, writing nothing, meanwhile).
pub const QUIET_WORK: Duration = Duration::from_secs(40);

/// The model, as one replica reaches it (a paused replica hears nothing).
pub struct Model {
    condition: Condition,
    rng: Mutex<fastrand::Rng>,
    /// What every replica's model served so far.
    served: Arc<Served>,
    /// Every run plays two turns: one call, then the answer.
    quiet: bool,
}

impl Model {
    /// The model for the replica behind `condition`, counting what it serves into `served`.
    pub fn new(condition: Condition, seed: u64, served: Arc<Served>, quiet: bool) -> Self {
        Self {
            condition,
            served,
            quiet,
            rng: Mutex::new(fastrand::Rng::with_seed(seed)),
        }
    }
}

/// The tokens the models served: each turn of a run counted once, however often it was served
/// (a turn served again after its run moved is the same turn, with the same usage: the book
/// must hold it once).
/// It also keeps every request the models were asked, in order: the run, its turn, and when.
#[derive(Default)]
pub struct Served {
    turns: Mutex<std::collections::BTreeMap<(String, usize), u64>>,
    asked: Mutex<Vec<(String, usize, Instant)>>,
}

impl Served {
    fn ask(&self, run_id: &str, turn: usize) {
        lock(&self.asked).push((run_id.to_owned(), turn, Instant::now()));
    }

    fn serve(&self, run_id: &str, turn: usize, tokens: u64) {
        lock(&self.turns).insert((run_id.to_owned(), turn), tokens);
    }

    /// The tokens of every turn served, each once.
    pub fn tokens(&self) -> u64 {
        lock(&self.turns).values().sum()
    }

    /// Every request the models were asked: the run, its turn, and when.
    pub fn asked(&self) -> Vec<(String, usize, Instant)> {
        lock(&self.asked).clone()
    }
}

/// The turn the model answers: how many messages it wrote since the run's request (a run on a
/// thread is sent the thread's earlier runs first; the loop's status notes are user messages too).
fn turn_of(request: &ChatRequest) -> usize {
    let asked = request
        .messages
        .iter()
        .rposition(|m| matches!(m, Message::User { content, .. } if content == super::ASK))
        .map_or(0, |i| i + 1);
    request.messages[asked..]
        .iter()
        .filter(|m| matches!(m, Message::Assistant { .. }))
        .count()
}

/// The exit tool the model calls once a run, in [`REPORT_TURN`] (a signal, never run).
pub const REPORT: &str = "report";
/// The turn (0-based) whose calls include the exit call `r<turn>`.
pub const REPORT_TURN: usize = 3;

/// A call of tool `name`'s piece of the stream.
fn call_of(name: &str, index: u32, id: String) -> Result<LlmEvent, LlmError> {
    Ok(LlmEvent::ToolCallFragment {
        index: Some(index),
        id: Some(id),
        name: Some(name.to_owned()),
        arguments: Some("{}".to_owned()),
    })
}

/// A `work` call's piece of the stream.
fn call(index: u32, id: String) -> Result<LlmEvent, LlmError> {
    call_of("work", index, id)
}

impl ChatModel for Model {
    fn stream(
        &self,
        request: ChatRequest,
    ) -> BoxFuture<'static, Result<BoxStream<'static, Result<LlmEvent, LlmError>>, LlmError>> {
        let turn = turn_of(&request);
        // The request's affinity is its run's id (the runs set no affinity key).
        let request_run = request.affinity.clone();
        self.served.ask(&request_run, turn);
        let think = Duration::from_millis(lock(&self.rng).u64(20..1500));
        let (condition, served) = (self.condition.clone(), Arc::clone(&self.served));
        let turns = if self.quiet { 2 } else { TURNS };
        let report = !self.quiet && turn == REPORT_TURN;
        async move {
            tokio::time::sleep(think).await;
            condition.running().await;
            let mut events = vec![Ok(LlmEvent::TextDelta(format!("turn {}. ", turn + 1)))];
            // A turn taken for a message sent to the run after it answered ends it as well.
            match turn {
                t if t + 1 >= turns => events.push(Ok(LlmEvent::TextDelta("done.".to_owned()))),
                _ if turns < TURNS => events.push(call(0, format!("t{turn}a"))),
                t if t % 3 == 2 => events.push(call(0, format!("t{turn}a"))),
                _ => events.extend([call(0, format!("t{turn}a")), call(1, format!("t{turn}b"))]),
            }
            if report {
                events.push(call_of(REPORT, 2, format!("r{turn}")));
            }
            let finish = if turn + 1 < turns { "tool_calls" } else { "stop" };
            // Each turn spends tokens (the usage invariant counts them): a prompt that grows
            // with the turns, and a completion.
            let usage = orchestrator::domain::chat::Usage {
                prompt_tokens: 100 + 10 * turn as u64,
                completion_tokens: 7,
                cached_prompt_tokens: 0,
            };
            served.serve(&request_run, turn, usage.prompt_tokens + usage.completion_tokens);
            events.extend([
                Ok(LlmEvent::Finish(finish.to_owned())),
                Ok(LlmEvent::Usage(usage)),
                Ok(LlmEvent::Done),
            ]);
            Ok(futures::stream::iter(events).boxed())
        }
        .boxed()
    }
}

/// A tool call as a tool-runner started it.
#[derive(Debug, Clone)]
pub struct Start {
    /// The run.
    pub run_id: String,
    /// The call.
    pub call_id: String,
    /// The epoch the call carried.
    pub epoch: u64,
    /// The run's fence as the store held it when the runner's read of it began.
    pub fence: u64,
    /// The run's fence at the instant the tool started (it may have been raised since the read).
    pub fence_at_start: u64,
    /// When the tool started.
    pub at: Instant,
}

/// A call as its replica sent it, at the moment the sender's rules let it go (it may reach a
/// runner much later, or never).
#[derive(Debug, Clone)]
pub struct SentCall {
    /// The replica that sent it.
    pub replica: String,
    /// The run.
    pub run_id: String,
    /// The call.
    pub call_id: String,
    /// The epoch the call carried.
    pub epoch: u64,
    /// When it was sent.
    pub at: Instant,
}

/// An attempt of a call that carried a person's answers, as a tool-runner received it.
#[derive(Debug, Clone)]
pub struct Answered {
    /// The run.
    pub run_id: String,
    /// The call.
    pub call_id: String,
    /// The questions' state the answers came back with (it names one round of questions).
    pub request_state: String,
    /// The answer to the one question, as the tool reads it.
    pub response: serde_json::Value,
}

/// Calls a runner takes at once (`--max-concurrent-calls`): low, so that a busy runner refuses
/// some calls and the sender tries them elsewhere.
const RUNNER_SLOTS: usize = 2;

/// How long a runner's fence read waits (within the orchestrators' fence grace).
const FENCE_READ: Duration = Duration::from_millis(400);

/// How long a runner's liveness may go unrenewed before the calls it started are in doubt.
const RUNNER_LEASE: Duration = Duration::from_secs(3);

/// The longest a tool's work takes here (drawn per attempt), bounding a wait for its outcome.
const LONGEST_WORK: Duration = Duration::from_secs(2);

/// The tool-runners, shared by the replicas: what they started.
pub struct Runners {
    /// Where the fences are: the run store in the simulated JetStream (read through the
    /// tool-runner's own reader).
    store: Arc<Watched>,
    /// Each runner's fence reader, over the simulated JetStream.
    readers: Vec<Arc<tool_runner::fence::RunFence>>,
    /// Each runner's process now: its records of the durable calls it runs (none: the runners
    /// keep no record, what breaks without them), replaced when a lost runner's pod is.
    records: Vec<Mutex<Incarnation>>,
    /// Each runner's lives so far: one more each time it is lost (a call it ran across a loss
    /// died with it).
    lives: Vec<std::sync::atomic::AtomicU64>,
    /// Every tool start, in order.
    pub starts: Mutex<Vec<Start>>,
    /// Every attempt a replica sent, in order.
    pub sent: Mutex<Vec<SentCall>>,
    /// Every attempt that carried answers, in order.
    pub answered: Mutex<Vec<Answered>>,
    /// Rounds of questions asked so far (each gets its own state).
    asked: Mutex<u64>,
    /// The runners' conditions (one lost: a call to it is refused before it runs).
    pub conditions: Vec<Condition>,
    /// Each runner's admission (`tool_runner::admission`): at most [`RUNNER_SLOTS`] calls in
    /// flight, the next refused before it runs with the refusal header the service sends.
    admissions: Vec<tool_runner::admission::Admission>,
    /// Calls a busy runner's admission refused.
    pub refused: std::sync::atomic::AtomicUsize,
    /// Calls a runner answered in doubt: the run, the call.
    pub in_doubt: Mutex<Vec<(String, String)>>,
    /// Calls whose runner died while they ran: the run, the call.
    pub died: Mutex<Vec<(String, String)>>,
    /// The runners refuse a replaced owner's call (off: to show what breaks without it).
    pub fence: bool,
    /// Every call works [`QUIET_WORK`], while it waits (no task, no question).
    quiet: bool,
    /// The tasks the runners' server runs in the background, by task id: when each is done.
    tasks: Mutex<std::collections::HashMap<String, Instant>>,
    rng: Mutex<fastrand::Rng>,
}

impl Runners {
    /// `count` runners reading fences from `store` (and refusing a replaced owner's call unless
    /// `fence` is off), and recording the calls they run there unless `records` is off (each
    /// renews its liveness in the background); with `quiet` runs, each takes that many calls at
    /// once and works [`QUIET_WORK`] on every one.
    pub fn new(
        store: Arc<Watched>,
        count: usize,
        seed: u64,
        (fence, records): (bool, bool),
        quiet: Option<usize>,
    ) -> Arc<Self> {
        let conditions: Vec<Condition> = (0..count).map(|_| Condition::default()).collect();
        let readers: Vec<_> = conditions
            .iter()
            .map(|condition| {
                let connection = store.cluster().connect(condition.clone(), FENCE_READ);
                // Thousands of quiet runs' calls: pipelined, as the replicas' are then.
                let connection = match quiet {
                    Some(_) => connection.pipelined(),
                    None => connection,
                };
                Arc::new(tool_runner::fence::RunFence::over(
                    shared::jetstream::JetStream::handle(&connection),
                    &store.names().runs,
                    FENCE_READ,
                ))
            })
            .collect();
        let records: Vec<_> = match records {
            true => readers
                .iter()
                .enumerate()
                .map(|(r, reader)| Mutex::new(Incarnation::start(reader, r, 0)))
                .collect(),
            false => Vec::new(),
        };
        Arc::new(Self {
            store,
            readers,
            records,
            lives: (0..count).map(|_| std::sync::atomic::AtomicU64::new(0)).collect(),
            fence,
            quiet: quiet.is_some(),
            starts: Mutex::default(),
            sent: Mutex::default(),
            answered: Mutex::default(),
            asked: Mutex::default(),
            tasks: Mutex::default(),
            admissions: conditions
                .iter()
                .map(|_| tool_runner::admission::Admission::new(quiet.unwrap_or(RUNNER_SLOTS)))
                .collect(),
            refused: std::sync::atomic::AtomicUsize::new(0),
            in_doubt: Mutex::default(),
            died: Mutex::default(),
            conditions,
            rng: Mutex::new(fastrand::Rng::with_seed(seed ^ 0x7001)),
        })
    }

    /// Runner `r` answers again (a new pod in the lost one's place).
    pub fn revive(&self, r: usize) {
        if let (Some(incarnation), Some(reader)) = (self.records.get(r), self.readers.get(r)) {
            let mut incarnation = lock(incarnation);
            if incarnation.life != self.life(r) {
                *incarnation = Incarnation::start(reader, r, self.life(r));
            }
        }
        if let Some(condition) = self.conditions.get(r) {
            condition.set(super::condition::Mode::Up);
        }
    }

    /// Runner `r`'s pod is lost (SIGKILL): it answers nothing, renews nothing, and the calls it
    /// runs die with it (their answers lost, their outcomes never kept).
    pub fn lose(&self, r: usize) {
        if let Some(condition) = self.conditions.get(r) {
            condition.set(super::condition::Mode::Paused);
        }
        if let Some(lives) = self.lives.get(r) {
            lives.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if let Some(incarnation) = self.records.get(r) {
            lock(incarnation).renewing = None;
        }
    }

    /// Runner `r`'s lives so far.
    fn life(&self, r: usize) -> u64 {
        self.lives
            .get(r)
            .map_or(0, |l| l.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Runner `r`'s records now (none when the runners keep none).
    fn records_of(&self, r: usize) -> Option<Arc<tool_runner::record::CallRecords>> {
        self.records.get(r).map(|i| Arc::clone(&lock(i).records))
    }

    /// The run's fence as the store's leader holds it now (0: none).
    fn fence(&self, run_id: &str) -> u64 {
        self.store.fence(run_id)
    }

    /// What runner `runner`'s record of `call` says: run it (and keep its outcome, when the
    /// runners record calls), or the answer it gives instead, as the service maps it.
    async fn begin(
        &self,
        runner: usize,
        call: &ToolInvocation,
    ) -> Result<Option<tool_runner::record::Started>, Attempt> {
        use tool_runner::record::{Begun, Call};
        let Some(records) = self.records_of(runner) else {
            return Ok(None);
        };
        let begun = records
            .begin(&Call {
                run_id: &call.run_id,
                call_id: &call.call_id,
                round: call.answers.as_ref().map(|a| a.request_state.as_str()),
                epoch: call.epoch,
                idempotent: false,
                rerun_in_doubt: call.rerun_in_doubt,
                wait: if self.quiet { QUIET_WORK } else { LONGEST_WORK } + RUNNER_LEASE,
            })
            .await;
        match begun {
            Begun::Run(started) => Ok(Some(started)),
            Begun::Done(kept) => {
                let kept = serde_json::from_slice::<Kept>(&kept)
                    .map_err(|e| ToolCallError::new("FAILED", format!("the call's record cannot be read: {e}")));
                Err(Attempt::Answered(kept.and_then(Result::from)))
            }
            Begun::InDoubt { runner } => {
                lock(&self.in_doubt).push((call.run_id.clone(), call.call_id.clone()));
                Err(Attempt::Answered(Err(ToolCallError::new(
                    ToolCallError::IN_DOUBT,
                    format!("started on {runner}, which went away before its outcome was kept"),
                ))))
            }
            Begun::Stale { current } => Err(Attempt::Superseded {
                current,
                runner: format!("runner-{runner}"),
            }),
            Begun::Unavailable(why) => Err(Attempt::Unrun {
                reason: "run_store",
                error: ToolCallError::new("UNAVAILABLE", why),
            }),
        }
    }

    /// Whether runner `runner` refuses `call` as its run's fence says, read by the tool-runner's
    /// own fence reader (`tool_runner::fence`) over the simulated JetStream.
    async fn refusal(&self, runner: usize, call: &ToolInvocation) -> Option<Attempt> {
        if !self.fence {
            return None;
        }
        let reader = self.readers.get(runner)?;
        use tool_runner::fence::Refusal;
        match reader.admit(&call.run_id, &call.call_id, call.epoch).await {
            Ok(()) => None,
            Err(Refusal::Stale { current, .. } | Refusal::NoEpoch { current, .. }) => Some(Attempt::Superseded {
                current,
                runner: format!("runner-{runner}"),
            }),
            Err(refusal @ Refusal::Unknown { .. }) => Some(Attempt::Answered(Err(ToolCallError::new(
                "FAILED_PRECONDITION",
                refusal.to_string(),
            )))),
            Err(refusal @ Refusal::Unreadable { .. }) => Some(Attempt::Unrun {
                reason: "run-store",
                error: ToolCallError::new("UNAVAILABLE", refusal.to_string()),
            }),
        }
    }
}

/// A replica's client of the runners: it sends through the service's own sender rules
/// (`orchestrator::tool_runners::sender`: the lease checked before every attempt, a stale
/// refusal stopping the owner, retries of calls no runner ran), and a paused replica may be
/// paused between that check and the send.
pub struct Client {
    /// The replica's name.
    pub replica: String,
    /// The replica's condition.
    pub condition: Condition,
    /// The runners.
    pub runners: Arc<Runners>,
}

/// Retries of a call no runner ran.
const RETRIES: Retries = Retries {
    retries: 2,
    backoff: Duration::from_millis(50),
};

impl ToolExecutor for Client {
    fn execute(&self, call: ToolInvocation) -> BoxFuture<'static, Result<ToolOutput, ToolCallError>> {
        let (condition, runners, replica) = (self.condition.clone(), Arc::clone(&self.runners), self.replica.clone());
        async move {
            sender::send(&call, RETRIES, || {
                attempt(condition.clone(), Arc::clone(&runners), call.clone(), replica.clone())
            })
            .await
        }
        .boxed()
    }
}

/// One attempt: the replica (maybe paused since its check) writes the request to the network,
/// which carries it to a runner however the sender fares from then on (a paused or dead
/// process's kernel still sends what it was given, and a congested link may hold it for
/// seconds); the runner reads the run's fence and refuses a replaced owner's call, or starts
/// the tool and answers.
async fn attempt(condition: Condition, runners: Arc<Runners>, call: ToolInvocation, replica: String) -> Attempt {
    lock(&runners.sent).push(SentCall {
        replica,
        run_id: call.run_id.clone(),
        call_id: call.call_id.clone(),
        epoch: call.epoch,
        at: Instant::now(),
    });
    let (runner, out, link, (work, as_task, asks)) = {
        let mut rng = lock(&runners.rng);
        let runner = rng.usize(..runners.conditions.len());
        let out = Duration::from_micros(rng.u64(100..20_000));
        // Now and then the link is congested and holds the request a while.
        let link = match rng.u8(..50) {
            0 => Duration::from_millis(rng.u64(1000..8000)),
            _ => Duration::from_micros(rng.u64(100..5000)),
        };
        // One call in three is run by its server as a task (answered with a handle at once);
        // one of the others in five asks a person first.
        let as_task = rng.u8(..3) == 0;
        (
            runner,
            out,
            link,
            (
                Duration::from_millis(rng.u64(10..2000)),
                as_task,
                !as_task && rng.u8(..5) == 0,
            ),
        )
    };
    let (work, as_task, asks) = match runners.quiet {
        true => (QUIET_WORK, false, false),
        false => (work, as_task, asks),
    };
    // Checked, then on its way out of the process (a client's buffer, a connection being
    // made): a replica paused now writes it when it resumes.
    tokio::time::sleep(out).await;
    condition.running().await;
    let (answer, heard) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        tokio::time::sleep(link).await;
        let _ = answer.send(run_on(&runners, runner, &call, Work { work, as_task, asks }).await);
    });
    let answered = heard
        .await
        .unwrap_or_else(|_| Attempt::Answered(Err(ToolCallError::new("UNAVAILABLE", "no answer"))));
    condition.running().await;
    answered
}

/// What a call's tool does, as drawn for one attempt.
struct Work {
    /// How long its work takes.
    work: Duration,
    /// Its server runs it as a task.
    as_task: bool,
    /// It asks a person first (when the attempt carries no answers).
    asks: bool,
}

/// What runner `runner` does with `call` once it arrives, as the service does: its admission, the
/// run's fence, then (a poll of the task the call became starts nothing) the call's record, which
/// answers a call that ran before, or one in doubt, instead of the tool; the tool's outcome is
/// kept in the record before the answer.
async fn run_on(runners: &Runners, runner: usize, call: &ToolInvocation, drawn: Work) -> Attempt {
    if runners.conditions[runner].mode() != super::condition::Mode::Up {
        let error = ToolCallError::new("UNAVAILABLE", format!("runner {runner} cannot be reached"));
        return Attempt::Unrun {
            reason: "connect",
            error,
        };
    }
    // Held while the call runs: a streamed call's place is in its request's extensions.
    let mut request = tonic::codegen::http::Request::new(());
    if let Some(refused) = runners.admit(runner, &mut request) {
        return refused;
    }
    // The fence as the leader held it when the call arrived, and the runner's own read of it.
    let fence = runners.fence(&call.run_id);
    if let Some(refused) = runners.refusal(runner, call).await {
        return refused;
    }
    if let Some(task) = &call.task {
        return Attempt::Answered(poll(runners, call, task));
    }
    let (life, records) = (runners.life(runner), runners.records_of(runner));
    let started = match runners.begin(runner, call).await {
        Ok(started) => started,
        Err(answered) => return answered,
    };
    let outcome = work_on(runners, call, drawn, fence).await;
    if runners.life(runner) != life {
        return runners.died_with(runner, call);
    }
    if let (Some(started), Some(records)) = (started, records) {
        if let Ok(ToolOutput::Asked(_)) = &outcome {
            records.release(started).await;
            return Attempt::Answered(outcome);
        }
        let kept = serde_json::to_vec(&Kept::from(&outcome)).unwrap_or_default();
        // Not kept (the store did not take it): a call sent again waits, then finds it in doubt.
        let _ = records.finish(started, kept.into(), |_, _| bytes::Bytes::new()).await;
    }
    Attempt::Answered(outcome)
}

/// What the tool does with a call the runner let in: a call that asks a person starts nothing
/// until it comes back with the answers, and then only when the person said go; a call starts
/// its work, in the background as a task or while the call waits.
async fn work_on(
    runners: &Runners,
    call: &ToolInvocation,
    drawn: Work,
    fence: u64,
) -> Result<ToolOutput, ToolCallError> {
    let Work { work, as_task, asks } = drawn;
    match &call.answers {
        None if asks => return Ok(ToolOutput::Asked(runners.questions(call))),
        Some(answers) if !runners.told_to_go(call, answers) => {
            return Ok(ToolOutput::Result(format!("{{\"not done\": \"{}\"}}", call.call_id)));
        }
        _ => {}
    }
    lock(&runners.starts).push(Start {
        run_id: call.run_id.clone(),
        call_id: call.call_id.clone(),
        epoch: call.epoch,
        fence,
        fence_at_start: runners.fence(&call.run_id),
        at: Instant::now(),
    });
    if as_task {
        let id = format!("{}/{}/{}", call.run_id, call.call_id, call.epoch);
        lock(&runners.tasks).insert(id.clone(), Instant::now() + work);
        return Ok(ToolOutput::Task(task_handle(id)));
    }
    tokio::time::sleep(work).await;
    Ok(ToolOutput::Result(done(&call.call_id)))
}

/// A call's result: long enough that a checkpoint keeps it apart as chunks (two of them and
/// some), its text its own (the call's id, then 1,500 words drawn from it).
fn done(call_id: &str) -> String {
    const WORDS: [&str; 6] = ["alpha", "beta", "gamma", "delta", "kappa", "sigma"];
    let seed = call_id
        .bytes()
        .fold(0_u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
    let mut rng = fastrand::Rng::with_seed(seed);
    let page: Vec<&str> = std::iter::repeat_with(|| WORDS[rng.usize(..WORDS.len())])
        .take(1500)
        .collect();
    serde_json::json!({"done": call_id, "page": page.join(" ")}).to_string()
}

/// A runner process's records of the calls it runs, and its liveness renewed in the background
/// until it is lost.
pub struct Incarnation {
    records: Arc<tool_runner::record::CallRecords>,
    renewing: Option<shared::runtime::AbortOnDrop>,
    /// Which life of its runner it is.
    life: u64,
}

impl Incarnation {
    /// Runner `r`'s process in its life `life`, reading and writing through `reader`'s store.
    fn start(reader: &Arc<tool_runner::fence::RunFence>, r: usize, life: u64) -> Self {
        let records = Arc::new(tool_runner::record::CallRecords::new(
            Arc::clone(reader),
            &format!("runner-{r}.{life}"),
            RUNNER_LEASE,
            64 * 1024,
        ));
        let renewing = shared::runtime::AbortOnDrop(tokio::spawn(Arc::clone(&records).keep_alive()));
        Self {
            records,
            renewing: Some(renewing),
            life,
        }
    }
}

impl Runners {
    /// What the sender hears of a call whose runner died while it ran: nothing (the connection
    /// broke). Runners that record calls say so in their catalog, so the sender sends it again.
    fn died_with(&self, runner: usize, call: &ToolInvocation) -> Attempt {
        lock(&self.died).push((call.run_id.clone(), call.call_id.clone()));
        let error = ToolCallError::new(
            "UNAVAILABLE",
            format!("runner {runner} went away while call {} ran", call.call_id),
        );
        match self.records.is_empty() {
            true => Attempt::Answered(Err(error)),
            false => Attempt::Lost { error },
        }
    }
}

/// A call's outcome as a runner's record keeps it (the service keeps the encoded response).
#[derive(serde::Serialize, serde::Deserialize)]
enum Kept {
    Result(String),
    Asked(Questions),
    Task(ToolTask),
    Error(ToolCallError),
}

impl From<&Result<ToolOutput, ToolCallError>> for Kept {
    fn from(outcome: &Result<ToolOutput, ToolCallError>) -> Self {
        match outcome {
            Ok(ToolOutput::Result(json)) => Self::Result(json.clone()),
            Ok(ToolOutput::Asked(questions)) => Self::Asked(questions.clone()),
            Ok(ToolOutput::Task(task)) => Self::Task(task.clone()),
            Err(error) => Self::Error(error.clone()),
        }
    }
}

impl From<Kept> for Result<ToolOutput, ToolCallError> {
    fn from(kept: Kept) -> Self {
        match kept {
            Kept::Result(json) => Ok(ToolOutput::Result(json)),
            Kept::Asked(questions) => Ok(ToolOutput::Asked(questions)),
            Kept::Task(task) => Ok(ToolOutput::Task(task)),
            Kept::Error(error) => Err(error),
        }
    }
}

/// The one question a tool asks: go on or not (a form whose `go` is a boolean).
pub const QUESTION: &str = "go";

impl Runners {
    /// Runner `runner`'s admission of a call, by the service's own gate in front of
    /// `RunToolStream`; a refusal as the orchestrator's client reads the status it gets.
    fn admit(&self, runner: usize, request: &mut tonic::codegen::http::Request<()>) -> Option<Attempt> {
        use shared::grpc::Gate as _;
        let admission = self.admissions.get(runner)?;
        *request.uri_mut() = tonic::codegen::http::Uri::from_static(tool_runner::admission::RUN_TOOL_STREAM_PATH);
        admission.admit(request).err().map(|status| {
            self.refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let error = ToolCallError::new(status.code().description(), status.message());
            match orchestrator::tool_runners::refused_before_run(&status) {
                Some(reason) => Attempt::Unrun { reason, error },
                None => Attempt::Answered(Err(error)),
            }
        })
    }

    /// A new round of questions for `call`: its state names the round.
    fn questions(&self, call: &ToolInvocation) -> Questions {
        let round = {
            let mut asked = lock(&self.asked);
            *asked += 1;
            *asked
        };
        Questions {
            request_state: format!("{}/{}/{round}", call.run_id, call.call_id),
            requests: vec![InputRequest {
                key: QUESTION.to_owned(),
                mode: InputMode::Form,
                message: "go on?".to_owned(),
                schema: serde_json::json!({
                    "type": "object",
                    "properties": {"go": {"type": "boolean"}},
                    "required": ["go"]
                }),
                url: String::new(),
            }],
        }
    }

    /// Records the answers `call` came back with; whether they say go.
    fn told_to_go(&self, call: &ToolInvocation, answers: &Answers) -> bool {
        let response = answers.responses.get(QUESTION).cloned().unwrap_or_default();
        let go = response["action"] == "accept" && response["content"]["go"] == true;
        lock(&self.answered).push(Answered {
            run_id: call.run_id.clone(),
            call_id: call.call_id.clone(),
            request_state: answers.request_state.clone(),
            response,
        });
        go
    }
}

/// A task as the server describes it while it works.
fn task_handle(id: String) -> ToolTask {
    ToolTask {
        id,
        status: "working".into(),
        message: String::new(),
        ttl_ms: None,
        poll_interval_ms: Some(200),
        runner: None,
    }
}

/// The task's state: still working, done (the call's result), or canceled when asked.
fn poll(runners: &Runners, call: &ToolInvocation, task: &ToolTask) -> Result<ToolOutput, ToolCallError> {
    let Some(done_at) = lock(&runners.tasks).get(&task.id).copied() else {
        return Err(ToolCallError::new("FAILED", format!("no task {}", task.id)));
    };
    if call.cancel_task {
        return Err(ToolCallError::new("CANCELED", "the server canceled the task"));
    }
    if Instant::now() < done_at {
        return Ok(ToolOutput::Task(task_handle(task.id.clone())));
    }
    Ok(ToolOutput::Result(done(&call.call_id)))
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
