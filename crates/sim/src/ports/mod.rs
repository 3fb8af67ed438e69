//! The simulation over the services' own code: several replicas, each the orchestrator's `Core`
//! (admission, takeover, the loop, the persister, the registry) built over the domain ports
//! (`orchestrator::server::harness`), on the real NATS adapters (`orchestrator::store::nats`)
//! over the simulated JetStream ([`crate::jetstream`], [`adapters`]), with a model and
//! tool-runners that admit calls through the tool-runner's own admission (a busy runner refuses
//! one) and read the run's fence with its own reader ([`actors`]; now and then a tool asks a
//! question, which the [`person`] answers from any replica), each process in the [`condition`]
//! its faults set (a replica's tasks are its simulated process's: `shared::tasks`), in one
//! tokio runtime whose clock is virtual and whose every random draw comes from the seed. The
//! fault plan, drawn from the seed too, pauses replicas (SIGSTOP), cuts them off from the store,
//! kills them (SIGKILL) or drains them (SIGTERM: their runs handed over), starting a new replica
//! in their place, slows the store down, leaves
//! the event stream or the checkpoint store without a leader for a while (the buckets
//! answering), lets a follower of a key-value bucket lag, loses answers to requests that were applied and loses tool-runners; at the
//! end every fault heals and the runs must end. The history is checked against the invariants
//! of [`check`]; the [`without`] switches turn fixes off to show what breaks.
//!
//! The protocol model (`crate::world`) draws its interleavings one event at a time; here the
//! tokio scheduler does, on one thread and virtual time, so a seed replays its faults and its
//! history (a test checks it; `--ports --seed N --trace` prints it) — in the same build: a debug
//! and a release build of one seed may differ.

pub mod actors;
pub mod adapters;
pub mod check;
pub mod condition;
pub mod person;
pub mod view;
pub mod without;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use orchestrator::domain::chat::{Message, ToolDefinition};
use orchestrator::domain::listing::ListRequest;
use orchestrator::domain::spec::{Deadline, Limits, ParsePolicy};
use orchestrator::domain::{LeaseTerms, RunSpec};
use orchestrator::server::harness::{Ports, Replica};
use tokio::time::Instant;

use actors::{Client, Model, Runners};
use condition::{Condition, Mode};
use orchestrator::store::nats::inspect::Names;
use view::Watched;

/// What a seed simulates.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Replicas alive at once.
    pub replicas: usize,
    /// Tool-runners.
    pub runners: usize,
    /// Runs started.
    pub runs: usize,
    /// Faults drawn.
    pub faults: usize,
    /// Faults fall within this long from the start.
    pub horizon: Duration,
    /// After the faults healed, how long the runs have to end.
    pub settle: Duration,
    /// The runners refuse a replaced owner's call (off: what breaks without it).
    pub receiver_fence: bool,
    /// The store keeps the principal's run slots across the fleet (off: each replica counts
    /// only its own runs against `max_runs`, what breaks without them).
    pub fleet_slots: bool,
    /// Checkpoints keep the tasks their calls became (off: the store drops them, what breaks
    /// without them).
    pub task_handles: bool,
    /// A takeover tells that the run it claimed read parked, which takes a slot again (off: it
    /// never does, what breaks without it).
    pub parked_claims: bool,
    /// Cancels a caller asks for, each of a random run, on a random replica, at once or after
    /// the run's turn, within the fault horizon (the sweeps ask for 3 in every other seed).
    pub cancels: usize,
    /// Messages a caller sends to runs (`SendMessage`), each to a random run on a random replica
    /// at a random moment of the fault horizon.
    pub messages: usize,
    /// A person's answer names the round of questions it answers (off: only the call, so an
    /// answer to questions asked before a takeover may be taken for the round asked after it,
    /// what breaks without it).
    pub answer_rounds: bool,
    /// The runners record each durable call where it runs, and answer a call sent again from
    /// the record (off: a call in flight when its run moved runs again, what breaks without it).
    pub outcome_records: bool,
    /// Shards the run store is spread over (`--run-store-shards`).
    pub shards: usize,
    /// A replica stops acting for every run of its incarnation once that incarnation's lease
    /// ran out (off: its runs never find out, what breaks without it).
    pub self_expiry: bool,
    /// Every run waits on one long tool call ([`actors::QUIET_WORK`]: quiet, nothing of it
    /// written while it waits), then ends; the one fault kills a replica while they wait (its
    /// runs move to the others); no thread, no cap on a caller's runs, and the followers, the
    /// replays and the listings' pages take a sample: thousands of runs in seconds.
    pub quiet: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            replicas: 3,
            runners: 2,
            runs: 4,
            faults: 8,
            horizon: Duration::from_secs(30),
            settle: Duration::from_secs(240),
            receiver_fence: true,
            fleet_slots: true,
            task_handles: true,
            parked_claims: true,
            answer_rounds: true,
            outcome_records: true,
            cancels: 0,
            messages: 3,
            shards: 1,
            self_expiry: true,
            quiet: false,
        }
    }
}

/// The fixes a `--without` switch turns off, by the name the command line gives them.
pub const FIXES: [&str; 7] = [
    "receiver-fence",
    "fleet-slots",
    "task-handles",
    "parked-claims",
    "answer-rounds",
    "outcome-records",
    "self-expiry",
];

impl Settings {
    /// The same settings with the fix named `fix` (one of [`FIXES`]) switched off.
    pub fn without(mut self, fix: &str) -> Result<Self, String> {
        let switch = match fix {
            "receiver-fence" => &mut self.receiver_fence,
            "fleet-slots" => &mut self.fleet_slots,
            "task-handles" => &mut self.task_handles,
            "parked-claims" => &mut self.parked_claims,
            "answer-rounds" => &mut self.answer_rounds,
            "outcome-records" => &mut self.outcome_records,
            "self-expiry" => &mut self.self_expiry,
            other => return Err(format!("--ports switches off one of {}, not {other}", FIXES.join(", "))),
        };
        *switch = false;
        Ok(self)
    }

    /// The fixes switched off, by name.
    fn switched_off(&self) -> Vec<&'static str> {
        let on = [
            self.receiver_fence,
            self.fleet_slots,
            self.task_handles,
            self.parked_claims,
            self.answer_rounds,
            self.outcome_records,
            self.self_expiry,
        ];
        FIXES
            .iter()
            .zip(on)
            .filter(|(_, on)| !on)
            .map(|(fix, _)| *fix)
            .collect()
    }

    /// The command that replays `seed` of these settings exactly: this build's profile, the
    /// same runs, faults, cancels and switches, and its whole history.
    pub fn replay(&self, seed: u64) -> String {
        let profile = if cfg!(debug_assertions) { "" } else { " --release" };
        let mut command = format!(
            "cargo run{profile} -p sim -- --ports --runs {} --faults {}",
            self.runs, self.faults
        );
        if self.cancels > 0 {
            command.push_str(&format!(" --cancels {}", self.cancels));
        }
        if self.shards > 1 {
            command.push_str(&format!(" --shards {}", self.shards));
        }
        if self.quiet {
            command.push_str(" --quiet");
        }
        if self.messages != Self::default().messages {
            command.push_str(&format!(" --messages {}", self.messages));
        }
        for fix in self.switched_off() {
            command.push_str(&format!(" --without {fix}"));
        }
        command.push_str(&format!(" --seed {seed} --trace"));
        command
    }
}

/// What one seed did.
#[derive(Debug)]
pub struct Outcome {
    /// The seed.
    pub seed: u64,
    /// The invariants broken, each with its evidence.
    pub violations: Vec<String>,
    /// Tool calls started.
    pub starts: usize,
    /// Runs taken over (epochs past 1).
    pub takeovers: u64,
    /// Tool attempts that carried a person's answers.
    pub answered: usize,
    /// Messages sent to runs that a run took.
    pub messages_taken: usize,
    /// Signals the signal stream holds.
    pub signals: usize,
    /// Calls a busy runner's admission refused (each tried again, elsewhere or later).
    pub refused: usize,
    /// Calls whose runner died while they ran (their answers lost).
    pub died: usize,
    /// Calls a runner answered in doubt (started by a runner that died before keeping their
    /// outcome; never run again here, the tool not being idempotent).
    pub in_doubt: usize,
    /// The history in a line each: faults, tool starts, and each run's log and record.
    pub history: Vec<String>,
}

/// Attempts a caller makes to start a run before it gives up (far past the faults' healing).
const STARTS: usize = 200;

/// The lease every replica holds its runs with (short, so that faults move runs).
const LEASE: Duration = Duration::from_secs(3);
/// How long a store request may take.
const STORE_TIMEOUT: Duration = Duration::from_secs(1);
/// Reads of the listings at the end, two store timeouts apart, before one that disagrees with
/// the store counts (see `World::settled_listings`).
const LISTING_READS: usize = 3;
/// How long a draining replica gives its runs to hand over at a safe point (then it hands the
/// rest over from their last checkpoint).
const HAND_OVER_GRACE: Duration = Duration::from_secs(5);

fn terms() -> LeaseTerms {
    LeaseTerms {
        length: LEASE,
        margin: Duration::from_secs(1),
        fence_grace: Duration::from_millis(500),
    }
}

fn config(settings: &Settings) -> orchestrator::Config {
    let mut config = orchestrator::Config::default();
    config.store.shards = settings.shards;
    // Room on every replica for every run (quiet runs by the thousand).
    config.runs.max_runs = config.runs.max_runs.max(settings.runs);
    config.store.lease = LEASE;
    config.store.lease_margin = Some(terms().margin);
    config.store.fence_grace = terms().fence_grace;
    config.store.timeout = STORE_TIMEOUT;
    config
}

/// Runs one seed.
pub fn simulate(seed: u64, settings: &Settings) -> Outcome {
    // The seed starts somewhere in an hour: one seed in ten or so sees the hour turn (the
    // spend's windows).
    let start = START_OF_AN_HOUR + fastrand::Rng::with_seed(seed ^ 0x40c1).u64(..3_600_000);
    let outcome = on_virtual_clock(start, || World::new(seed, settings.clone()).run());
    outcome.unwrap_or_else(|e| Outcome {
        seed,
        violations: vec![format!("no runtime: {e}")],
        starts: 0,
        takeovers: 0,
        answered: 0,
        messages_taken: 0,
        signals: 0,
        refused: 0,
        died: 0,
        in_doubt: 0,
        history: Vec::new(),
    })
}

/// A Unix time (ms) at the start of an hour: the histories do not depend on the day they run.
const START_OF_AN_HOUR: u64 = 1_800_000_000_000;

/// Runs `work` on a runtime of its own whose clock is virtual (it moves on to the next timer
/// whenever every task waits), the services' Unix clock reading it from `start_ms`.
fn on_virtual_clock<F: std::future::Future>(start_ms: u64, work: impl FnOnce() -> F) -> std::io::Result<F::Output> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?;
    let output = runtime.block_on(async {
        let _unix_clock = shared::sync::UnixClockOnTokio::starting_at(start_ms);
        work().await
    });
    runtime.shutdown_background();
    Ok(output)
}

/// A replica process: its condition and, while it lives, its `Core`.
struct Process {
    name: String,
    condition: Condition,
    replica: Option<Arc<Replica>>,
}

struct World {
    seed: u64,
    settings: Settings,
    rng: fastrand::Rng,
    store: Arc<Watched>,
    runners: Arc<Runners>,
    processes: Vec<Process>,
    /// The replicas alive, for callers and readers.
    living: Arc<std::sync::Mutex<Vec<Arc<Replica>>>>,
    begun: Instant,
    history: Vec<String>,
    observations: Arc<std::sync::Mutex<Vec<String>>>,
    /// Lines for the history from the callers (a start refused, and why).
    notes: Arc<std::sync::Mutex<Vec<String>>>,
    /// The runs a cancel was answered `CANCELED` for: each must end canceled.
    canceled: Arc<std::sync::Mutex<Vec<String>>>,
    /// The runs a cancel was answered would end after their turn, and when.
    after_turn: Arc<std::sync::Mutex<Vec<(String, Instant)>>>,
    /// The messages sent to runs: the run, the text, and whether the run took it.
    sent: Arc<std::sync::Mutex<Vec<check::Sent>>>,
    /// The person who answers the tools' questions.
    person: person::Person,
    /// The tokens the model served, over every replica (the spend's upper bound).
    served: Arc<actors::Served>,
}

/// A fault of the plan.
#[derive(Debug, Clone, Copy)]
enum Fault {
    Pause(usize, Duration),
    CutOff(usize, Duration),
    Kill(usize, Duration),
    /// SIGTERM: the replica drains (hands its runs over within the grace), exits, and a new
    /// one starts in its place after a while.
    Drain(usize, Duration),
    SlowStore(Duration),
    LogDown(Duration),
    LoseRunner(usize, Duration),
    /// A follower of a key-value bucket lags (direct reads see old entries): the runs', the
    /// approvals', the slots', the spend's or the threads' (by [`World::buckets`]' order).
    Lag(usize, Duration),
    /// One answer in three is lost after its request was applied.
    LoseAnswers(Duration),
    /// The checkpoint object store has no leader for a while (the buckets answer).
    CheckpointsDown(Duration),
}

impl World {
    fn new(seed: u64, settings: Settings) -> Self {
        let config = config(&settings);
        let names = Names::of(&config.store.bucket, &config.store.event_log_stream).sharded(config.store.shards);
        let runs = (0..settings.runs).map(|run| format!("run-{run}")).collect();
        let max_runs = principals(settings.quiet);
        let signals = orchestrator::server::harness::nats_signal_options(&config).stream;
        let store = Watched::new(crate::jetstream::Cluster::new(seed), names, signals, runs, max_runs);
        let runners = Runners::new(
            Arc::clone(&store),
            settings.runners,
            seed,
            (settings.receiver_fence, settings.outcome_records),
            settings.quiet.then_some(settings.runs),
        );
        Self {
            seed,
            rng: fastrand::Rng::with_seed(seed),
            store,
            runners,
            processes: Vec::new(),
            living: Arc::default(),
            begun: Instant::now(),
            history: Vec::new(),
            observations: Arc::default(),
            notes: Arc::default(),
            canceled: Arc::default(),
            after_turn: Arc::default(),
            sent: Arc::default(),
            person: Arc::default(),
            served: Arc::default(),
            settings,
        }
    }

    /// Starts replica process number `n` (a new name each time).
    async fn spawn_replica(&mut self) -> usize {
        let n = self.processes.len();
        let name = format!("replica-{n}");
        let condition = Condition::default();
        let connection = self.store.cluster().connect(condition.clone(), STORE_TIMEOUT);
        let connection = match self.settings.quiet {
            true => connection.pipelined(),
            false => connection,
        };
        let connection = match self.settings.task_handles {
            true => connection,
            false => connection.filtering_objects(without::without_tasks),
        };
        // The adapters' tasks (the log's publisher) are the replica process's, as all it spawns.
        let stores = shared::tasks::owning_async(
            condition.process(),
            adapters::open(&connection, &name, &config(&self.settings)),
        )
        .await;
        let ports = Ports {
            store: without::Store::over(stores.store, self.settings.self_expiry),
            index: stores.index,
            quotas: stores.quotas.filter(|_| self.settings.fleet_slots),
            usage: stores.usage,
            journal: Some(without::Journal::over(stores.journal, self.settings.parked_claims)),
            log: stores.log,
            approvals: stores.approvals,
            threads: stores.threads,
            sign_outs: Arc::new(orchestrator::store::memory::MemorySignOuts::default()),
            webhooks: orchestrator::webhooks::Buckets::in_memory(&config(&self.settings).webhooks),
            signals: stores.signals,
            model: Arc::new(Model::new(
                condition.clone(),
                self.seed.wrapping_add(n as u64 * 7919),
                Arc::clone(&self.served),
                self.settings.quiet,
            )),
            tools: Arc::new(Client {
                replica: name.clone(),
                condition: condition.clone(),
                runners: Arc::clone(&self.runners),
            }),
        };
        let replica = Replica::in_process(&config(&self.settings), ports, condition.process());
        // As the server does with a journal: it answers the cancels and messages other
        // replicas ask of it for the runs live here.
        let replica = Arc::new(replica.answering_asks());
        lock(&self.living).push(Arc::clone(&replica));
        self.processes.push(Process {
            name,
            condition,
            replica: Some(replica),
        });
        n
    }

    /// The processes alive now.
    fn alive(&self) -> Vec<usize> {
        (0..self.processes.len())
            .filter(|&i| self.processes[i].replica.is_some())
            .collect()
    }

    async fn run(mut self) -> Outcome {
        for _ in 0..self.settings.replicas {
            self.spawn_replica().await;
        }
        self.begun = Instant::now();
        let begun = self.begun;
        for i in 0..self.settings.runs {
            let after = Duration::from_millis(self.rng.u64(..self.settings.horizon.as_millis() as u64 / 2));
            self.start_run(format!("run-{i}"), after);
        }
        let reader = self.spawn_reader();
        self.spawn_cancels();
        self.spawn_messages();
        let followers = self.spawn_followers();
        let rounds = self.settings.answer_rounds;
        let person = person::spawn(Arc::clone(&self.living), Arc::clone(&self.person), self.seed, rounds);
        for (at, fault) in self.plan() {
            tokio::time::sleep_until(begun + at).await;
            self.apply(fault).await;
        }
        tokio::time::sleep_until(begun + self.settings.horizon).await;
        self.heal().await;
        let ended = self.wait_for_ends().await;
        reader.abort();
        person.abort();
        let followed = self.followed(followers).await;
        let served = self.served.tokens();
        let view = self.store.view();
        let mut violations = check::violations(
            &view,
            &self.runners,
            &self.person,
            (self.settings.runs, self.settings.quiet),
            served,
        );
        if ended.is_ok() {
            violations.extend(self.settled_listings().await);
            violations.extend(check::streams_whole(&view, &followed));
            violations.extend(self.replays().await);
        }
        violations.extend(lock(&self.observations).drain(..));
        violations.extend(check::cancels_kept(&view, &lock(&self.canceled)));
        violations.extend(check::after_turn_kept(&lock(&self.after_turn), &self.served.asked()));
        let fault_free = self.settings.faults == 0;
        violations.extend(check::messages_once(&view, &lock(&self.sent), fault_free));
        if let Err(unended) = ended {
            violations.push(unended);
        }
        let starts = lock(&self.runners.starts).len();
        let answered = lock(&self.runners.answered).len();
        let messages_taken = lock(&self.sent).iter().filter(|s| s.taken).count();
        let mut history = std::mem::take(&mut self.history);
        history.extend(lock(&self.notes).drain(..));
        history.extend(check::history(&view, &self.runners, self.begun));
        Outcome {
            seed: self.seed,
            violations,
            starts,
            takeovers: check::takeovers(&view),
            answered,
            messages_taken,
            signals: view.signals.len(),
            refused: self.runners.refused.load(std::sync::atomic::Ordering::Relaxed),
            died: lock(&self.runners.died).len(),
            in_doubt: lock(&self.runners.in_doubt).len(),
            history,
        }
    }

    /// The faults, each at a moment within the horizon, in time order (quiet runs: one kill,
    /// once every run waits).
    fn plan(&mut self) -> Vec<(Duration, Fault)> {
        if self.settings.quiet {
            return vec![(self.settings.horizon * 2 / 3, Fault::Kill(0, Duration::from_secs(2)))];
        }
        let horizon = self.settings.horizon.as_millis() as u64;
        let mut plan: Vec<(Duration, Fault)> = (0..self.settings.faults)
            .map(|_| {
                let at = Duration::from_millis(self.rng.u64(100..horizon.max(101)));
                let lasting = Duration::from_millis(self.rng.u64(200..8000));
                let who = self.rng.usize(..self.settings.replicas.max(1));
                let fault = match self.rng.u8(..10) {
                    0 => Fault::Pause(who, lasting),
                    1 => Fault::CutOff(who, lasting),
                    2 => Fault::Kill(who, lasting),
                    3 => Fault::SlowStore(lasting),
                    4 => Fault::LogDown(lasting),
                    5 => Fault::LoseRunner(self.rng.usize(..self.settings.runners.max(1)), lasting),
                    6 => Fault::Lag(self.rng.usize(..5), lasting),
                    7 => Fault::Drain(who, lasting),
                    8 => Fault::CheckpointsDown(lasting),
                    _ => Fault::LoseAnswers(lasting),
                };
                (at, fault)
            })
            .collect();
        plan.sort_by_key(|(at, _)| *at);
        plan
    }

    /// Applies `fault` to the `n`-th replica alive (by its place among the living).
    async fn apply(&mut self, fault: Fault) {
        let alive = self.alive();
        let pick = |n: usize| alive.get(n % alive.len().max(1)).copied();
        let line = format!("{:>8.3}s {fault:?}", self.begun.elapsed().as_secs_f64());
        match fault {
            Fault::Pause(n, lasting) | Fault::CutOff(n, lasting) => {
                let Some(i) = pick(n) else { return };
                let mode = if matches!(fault, Fault::Pause(..)) {
                    Mode::Paused
                } else {
                    Mode::CutOff
                };
                let condition = self.processes[i].condition.clone();
                condition.set(mode);
                tokio::spawn(async move {
                    tokio::time::sleep(lasting).await;
                    condition.set(Mode::Up);
                });
                self.history.push(format!("{line} on {}", self.processes[i].name));
            }
            Fault::Kill(n, after) | Fault::Drain(n, after) => {
                let Some(i) = pick(n) else { return };
                self.history.push(format!("{line} on {}", self.processes[i].name));
                if let (Fault::Drain(..), Some(replica)) = (fault, &self.processes[i].replica) {
                    replica.drain(HAND_OVER_GRACE).await;
                    let at = self.begun.elapsed().as_secs_f64();
                    self.history
                        .push(format!("{at:>8.3}s   {} drained, exits", self.processes[i].name));
                }
                self.processes[i].condition.set(Mode::Dead);
                if let Some(dead) = self.processes[i].replica.take() {
                    lock(&self.living).retain(|r| !Arc::ptr_eq(r, &dead));
                }
                tokio::time::sleep(after).await;
                let new = self.spawn_replica().await;
                self.history.push(format!("  {} starts", self.processes[new].name));
            }
            Fault::SlowStore(lasting) => {
                self.slow_store(Instant::now() + lasting);
                self.history.push(line);
            }
            Fault::LogDown(lasting) => {
                self.take_log_down(Instant::now() + lasting);
                self.history.push(line);
            }
            Fault::Lag(bucket, lasting) => {
                let buckets = self.buckets();
                let bucket = &buckets[bucket % buckets.len()];
                self.store.cluster().lag(bucket, Instant::now() + lasting);
                self.history.push(format!("{line} of {bucket}"));
            }
            Fault::CheckpointsDown(lasting) => {
                for checkpoints in self.store.names().every_checkpoints() {
                    self.store.cluster().lose_leader(&checkpoints, Instant::now() + lasting);
                }
                self.history.push(line);
            }
            Fault::LoseAnswers(lasting) => {
                self.store.cluster().lose_answers(Instant::now() + lasting);
                self.history.push(line);
            }
            Fault::LoseRunner(r, lasting) => {
                self.runners.lose(r);
                self.history.push(line);
                // A lost runner's pod is replaced: a new one answers after a while.
                self.runners_replace(r, lasting);
            }
        }
    }

    fn runners_replace(&self, r: usize, after: Duration) {
        let runners = Arc::clone(&self.runners);
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            runners.revive(r);
        });
    }

    /// Every fault heals: paused and cut-off replicas run again, as many replicas live as at the
    /// start, every runner answers, the store is quick.
    async fn heal(&mut self) {
        for process in &self.processes {
            if process.replica.is_some() {
                process.condition.set(Mode::Up);
            }
        }
        while self.alive().len() < self.settings.replicas {
            self.spawn_replica().await;
        }
        for r in 0..self.runners.conditions.len() {
            self.runners.revive(r);
        }
        let now = Instant::now();
        self.slow_store(now);
        self.take_log_down(now);
        self.store.cluster().lose_answers(now);
        for checkpoints in self.store.names().every_checkpoints() {
            self.store.cluster().lose_leader(&checkpoints, now);
        }
        for bucket in self.buckets() {
            self.store.cluster().lag(&bucket, now);
        }
    }

    /// The streams of the key-value buckets a follower of may lag: the runs', the approvals',
    /// the slots', the spend's and the threads', then the runs' other shards.
    fn buckets(&self) -> Vec<String> {
        let names = self.store.names();
        let runs = names.every_runs();
        [
            &names.runs,
            &names.approvals,
            &names.slots,
            &names.usage,
            &names.threads,
        ]
        .into_iter()
        .chain(runs.iter().skip(1))
        .map(|b| format!("KV_{b}"))
        .collect()
    }

    /// Every store request is slow until `until`.
    fn slow_store(&self, until: Instant) {
        self.store.cluster().slow_down(until);
    }

    /// The event stream has no leader until `until` (the buckets answer).
    fn take_log_down(&self, until: Instant) {
        for events in self.store.names().every_events() {
            self.store.cluster().lose_leader(&events, until);
        }
    }

    /// Starts run `run_id` as a caller would: on some replica, trying another one while none
    /// admits it (a replica that is paused or cut off, or a store losing answers, refuses it).
    fn start_run(&mut self, run_id: String, after: Duration) {
        let first = self.rng.usize(..self.processes.len());
        let quiet = self.settings.quiet;
        let (living, notes, begun) = (Arc::clone(&self.living), Arc::clone(&self.notes), self.begun);
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            // As a caller does: again on another replica until one admits it (faults heal).
            for attempt in 0..STARTS {
                let Some(replica) = pick(&living, first + attempt) else {
                    return;
                };
                let why = match tokio::time::timeout(
                    Duration::from_secs(120),
                    replica.start(spec(&run_id, quiet), caller(&run_id, quiet)),
                )
                .await
                {
                    Ok(Ok(())) | Ok(Err(orchestrator::Error::AlreadyRunning(_))) => return,
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => "no answer in 120s".to_owned(),
                };
                let at = begun.elapsed().as_secs_f64();
                lock(&notes).push(format!("{at:>8.3}s {run_id} not started (attempt {attempt}): {why}"));
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
    }

    /// Asks for the settings' cancels, each of a random run on a random replica alive, at a
    /// random moment of the horizon, at once or after its turn; each outcome goes to the history.
    fn spawn_cancels(&mut self) {
        for _ in 0..self.settings.cancels {
            let at = Duration::from_millis(self.rng.u64(..self.settings.horizon.as_millis() as u64));
            let run_id = format!("run-{}", self.rng.usize(..self.settings.runs.max(1)));
            let (replica_at, after_turn) = (self.rng.usize(..64), self.rng.bool());
            let (living, notes, begun) = (Arc::clone(&self.living), Arc::clone(&self.notes), self.begun);
            let (canceled, ends_after) = (Arc::clone(&self.canceled), Arc::clone(&self.after_turn));
            tokio::spawn(async move {
                tokio::time::sleep_until(begun + at).await;
                let Some(replica) = pick(&living, replica_at) else {
                    return;
                };
                let outcome = tokio::time::timeout(Duration::from_secs(10), replica.cancel(&run_id, after_turn)).await;
                match outcome {
                    Ok(Ok((true, orchestrator::domain::RunStatus::Canceled))) => lock(&canceled).push(run_id.clone()),
                    Ok(Ok((true, _))) if after_turn => lock(&ends_after).push((run_id.clone(), Instant::now())),
                    _ => {}
                }
                let at = begun.elapsed().as_secs_f64();
                let mode = if after_turn { "after its turn" } else { "at once" };
                lock(&notes).push(format!("{at:>8.3}s cancel {run_id} {mode}: {outcome:?}"));
            });
        }
    }

    /// Sends the settings' messages, each to a random run on a random replica alive at a random
    /// moment of the horizon; each outcome goes to the history.
    fn spawn_messages(&mut self) {
        for n in 0..self.settings.messages {
            let at = Duration::from_millis(self.rng.u64(..self.settings.horizon.as_millis() as u64));
            let run_id = format!("run-{}", self.rng.usize(..self.settings.runs.max(1)));
            let replica_at = self.rng.usize(..64);
            let quiet = self.settings.quiet;
            let (living, notes, begun, sent) = (
                Arc::clone(&self.living),
                Arc::clone(&self.notes),
                self.begun,
                Arc::clone(&self.sent),
            );
            tokio::spawn(async move {
                tokio::time::sleep_until(begun + at).await;
                let Some(replica) = pick(&living, replica_at) else {
                    return;
                };
                let content = format!("message-{n}");
                let outcome = tokio::time::timeout(
                    Duration::from_secs(10),
                    replica.send_message(&run_id, &content, &caller(&run_id, quiet)),
                )
                .await;
                let taken = matches!(outcome, Ok(Ok(_)));
                let at = begun.elapsed().as_secs_f64();
                lock(&notes).push(format!("{at:>8.3}s {content} to {run_id}: {outcome:?}"));
                lock(&sent).push(check::Sent { run_id, content, taken });
            });
        }
    }

    /// Reads runs on random replicas all along (`GetRun`): an end it is shown must be in the
    /// log and the store already.
    fn spawn_reader(&mut self) -> tokio::task::JoinHandle<()> {
        let living = Arc::clone(&self.living);
        let (store, observations, runs) = (
            Arc::clone(&self.store),
            Arc::clone(&self.observations),
            self.settings.runs,
        );
        let mut rng = fastrand::Rng::with_seed(self.seed ^ 0x4ead);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(rng.u64(50..500))).await;
                let Some(replica) = pick(&living, rng.usize(..64)) else {
                    continue;
                };
                let run_id = format!("run-{}", rng.usize(..runs.max(1)));
                let Ok(Ok(seen)) = tokio::time::timeout(Duration::from_secs(2), replica.get(&run_id)).await else {
                    continue;
                };
                if !seen.status.is_live()
                    && let Some(broken) = check::end_not_kept(&store.run_view(&run_id), &seen)
                {
                    lock(&observations).push(broken);
                }
            }
        })
    }

    /// A caller per run following it with `AttachRun` from whichever replica is alive, attaching
    /// again after its last seq whenever its stream breaks off (a replica paused, killed, or
    /// handing the run over), until `run_finished`: what each was sent, in order.
    fn spawn_followers(&mut self) -> Vec<(String, tokio::task::JoinHandle<check::Followed>)> {
        self.sample()
            .map(|run| {
                let living = Arc::clone(&self.living);
                let mut rng = fastrand::Rng::with_seed(self.seed ^ (0xf011 + run as u64));
                let run_id = format!("run-{run}");
                let id = run_id.clone();
                let task = tokio::spawn(async move {
                    let mut followed = check::Followed {
                        run_id: run_id.clone(),
                        events: Vec::new(),
                    };
                    loop {
                        tokio::time::sleep(Duration::from_millis(rng.u64(20..400))).await;
                        let Some(replica) = pick(&living, rng.usize(..64)) else {
                            continue;
                        };
                        let after = followed.events.last().map_or(0, |e| e.seq);
                        let Ok(Ok(mut stream)) =
                            tokio::time::timeout(Duration::from_secs(2), replica.attach(&run_id, after)).await
                        else {
                            continue;
                        };
                        // A stream quiet for long (its replica paused) is left for another.
                        while let Ok(Some(Ok(event))) =
                            tokio::time::timeout(Duration::from_secs(20), futures::StreamExt::next(&mut stream)).await
                        {
                            let last = event.is_last();
                            followed.events.push(event);
                            if last {
                                return followed;
                            }
                        }
                    }
                });
                (id, task)
            })
            .collect()
    }

    /// Each run off the thread started again once all ended (a caller's retry of `Orchestrate`
    /// with the same id) on a replica alive: what it replays, checked against the log.
    async fn replays(&self) -> Vec<String> {
        let mut replays = Vec::new();
        for run in self.sample().step_by(2) {
            let run_id = format!("run-{run}");
            let Some(replica) = pick(&self.living, run) else {
                continue;
            };
            match tokio::time::timeout(
                Duration::from_secs(30),
                replica.retry(spec(&run_id, self.settings.quiet), caller(&run_id, self.settings.quiet)),
            )
            .await
            {
                Ok(Ok(events)) => replays.push(check::Followed { run_id, events }),
                Ok(Err(e)) => return vec![format!("the replay: retrying {run_id} failed: {e}")],
                Err(_) => return vec![format!("the replay: retrying {run_id} did not end")],
            }
        }
        check::streams_whole(&self.store.view(), &replays)
            .into_iter()
            .map(|broken| broken.replacen("the stream:", "the replay:", 1))
            .collect()
    }

    /// What the followers were sent; one that did not get `run_finished` in time is stopped
    /// with what it had.
    async fn followed(
        &self,
        followers: Vec<(String, tokio::task::JoinHandle<check::Followed>)>,
    ) -> Vec<check::Followed> {
        let mut all = Vec::new();
        for (run_id, mut follower) in followers {
            match tokio::time::timeout(Duration::from_secs(60), &mut follower).await {
                Ok(Ok(followed)) => all.push(followed),
                _ => {
                    follower.abort();
                    all.push(check::Followed {
                        run_id,
                        events: Vec::new(),
                    });
                }
            }
        }
        all
    }

    /// The listing's invariant once it has settled: a run's end can land in the store before
    /// its owner hears that it did (the answer's way back), and until then the owner lists it
    /// as running; so a listing that disagrees is read again, up to [`LISTING_READS`] times a
    /// store timeout apart.
    async fn settled_listings(&self) -> Vec<String> {
        let mut broken = self.listings().await;
        for _ in 1..LISTING_READS {
            if broken.is_empty() {
                break;
            }
            tokio::time::sleep(STORE_TIMEOUT * 2).await;
            broken = self.listings().await;
        }
        broken
    }

    /// The listing's invariant on every replica alive: its pages of `ListRuns`, a few rows at a
    /// time (runs carry the label `kind=sim`, which the listing asks for).
    async fn listings(&self) -> Vec<String> {
        let living: Vec<Arc<Replica>> = lock(&self.living).clone();
        let view = self.store.view();
        let mut broken = Vec::new();
        for (n, replica) in living.iter().enumerate() {
            let mut request = ListRequest {
                labels: [("kind".to_owned(), "sim".to_owned())].into(),
                page_size: if self.settings.quiet { 50 } else { 3 },
                ..ListRequest::default()
            };
            let mut rows = Vec::new();
            for _ in 0..=self.settings.runs {
                match list_page(replica, &request).await {
                    Ok((page, next)) => {
                        rows.extend(page.runs);
                        let Some(next) = next else { break };
                        request.page_token = Some(next);
                    }
                    Err(failed) => {
                        broken.push(format!("ListRuns on replica {n} failed: {failed}"));
                        break;
                    }
                }
            }
            broken.extend(check::listing_whole(&view, &format!("replica {n}"), &rows));
        }
        broken
    }

    /// The runs whose callers follow them and whose retries are replayed: every run, or one in
    /// [`SAMPLED`]'s share of quiet runs.
    fn sample(&self) -> std::iter::StepBy<std::ops::Range<usize>> {
        let runs = self.settings.runs;
        let step = match self.settings.quiet {
            true => (runs / SAMPLED).max(1),
            false => 1,
        };
        (0..runs).step_by(step)
    }

    /// Waits (at most the settle time) until every run claimed has its end in the store.
    async fn wait_for_ends(&self) -> Result<(), String> {
        let deadline = Instant::now() + self.settings.settle;
        loop {
            let view = self.store.ends();
            let mut unended = check::unended(&view, self.settings.runs);
            unended.extend(check::held_threads(&view));
            if unended.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "runs never ended within {:?} after every fault healed: {unended:?}",
                    self.settings.settle
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// The `n`-th replica alive (modulo their number).
pub(crate) fn pick(living: &std::sync::Mutex<Vec<Arc<Replica>>>, n: usize) -> Option<Arc<Replica>> {
    let living = lock(living);
    (!living.is_empty()).then(|| Arc::clone(&living[n % living.len()]))
}

/// One page of `ListRuns` on `replica`, tried again (up to three times) when the store did not
/// answer in time: a request drawn slow before the faults healed may still hold the replica's
/// link, and a caller tries a timed-out listing again.
async fn list_page(
    replica: &Replica,
    request: &ListRequest,
) -> Result<(orchestrator::domain::listing::RunPage, Option<String>), String> {
    let mut failed = String::new();
    for _ in 0..3 {
        match tokio::time::timeout(Duration::from_secs(10), replica.list(request.clone())).await {
            Ok(Ok(page)) => return Ok(page),
            other => failed = format!("{other:?}"),
        }
    }
    Err(failed)
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Quiet runs followed and replayed (about as many).
const SAMPLED: usize = 32;

/// The spec of every run: turns of `work` calls (quiet: one).
fn spec(run_id: &str, quiet: bool) -> RunSpec {
    // Every other run continues the one thread, queueing while another run holds it.
    let on_thread = !quiet && run_id.ends_with(['1', '3', '5', '7', '9']);
    let thread = on_thread.then(|| {
        Box::new(orchestrator::domain::thread::RunThread {
            thread_id: THREAD.to_owned(),
            on_busy: orchestrator::domain::thread::BusyPolicy::Enqueue,
            window: None,
            history: Vec::new(),
            turns_left_out: 0,
        })
    });
    let limits = Limits {
        max_turns: 12,
        tool_call_budget: 40,
        max_tool_failures: 4,
        tool_timeout: Duration::from_secs(if quiet { 120 } else { 10 }),
        run_timeout: Duration::from_secs(3600),
        approval_timeout: Duration::from_secs(60),
        input_timeout: Duration::from_secs(8),
        max_total_tokens: u64::MAX,
    };
    RunSpec {
        run_id: run_id.to_owned(),
        system: String::new(),
        messages: vec![Message::User {
            content: ASK.to_owned(),
            name: None,
        }],
        model: "sim".to_owned(),
        params: Default::default(),
        normal_tools: vec![ToolDefinition {
            name: "work".to_owned(),
            description: "works".to_owned(),
            parameters: serde_json::json!({"type": "object"}).into(),
        }],
        exit_tools: vec![ToolDefinition {
            name: actors::REPORT.to_owned(),
            description: "reports".to_owned(),
            parameters: serde_json::json!({"type": "object"}).into(),
        }],
        limits,
        metadata: Default::default(),
        labels: [("kind".to_owned(), "sim".to_owned())].into(),
        hourly_budget: None,
        queued_ms: 0,
        parse_policy: ParsePolicy::Fail,
        deadline: Deadline::new(Instant::now(), limits.run_timeout, None, Duration::ZERO),
        principal: principal_of(run_id, quiet),
        max_runs: None,
        stream_interval: Duration::ZERO,
        approval: Default::default(),
        affinity_key: String::new(),
        eager_dispatch: false,
        thread,
        agent: None,
        request_digests: Default::default(),
    }
}

/// The principal every run belongs to.
pub const TENANT: &str = "team";
/// Its runs live at once across the fleet.
pub const TENANT_MAX_RUNS: usize = 2;
/// The principals quiet runs belong to, a run each in turn (about 20 runs each of 2,000: one
/// principal's spend window remembers the last 32 runs that booked into it, and its one key
/// takes every add of its runs).
const QUIET_TENANTS: usize = 100;

/// The principal run `run_id` belongs to: [`TENANT`], or for quiet runs one of
/// [`QUIET_TENANTS`].
fn principal_of(run_id: &str, quiet: bool) -> String {
    let n: usize = run_id.trim_start_matches("run-").parse().unwrap_or(0);
    match quiet {
        true => format!("{TENANT}-{}", n % QUIET_TENANTS),
        false => TENANT.to_owned(),
    }
}

/// The principals runs belong to, with the runs each may have live at once.
fn principals(quiet: bool) -> std::collections::BTreeMap<String, usize> {
    match quiet {
        true => (0..QUIET_TENANTS)
            .map(|n| (format!("{TENANT}-{n}"), usize::MAX))
            .collect(),
        false => [(TENANT.to_owned(), TENANT_MAX_RUNS)].into(),
    }
}

/// The caller of run `run_id`: its principal, held to [`TENANT_MAX_RUNS`] (quiet runs: to none).
fn caller(run_id: &str, quiet: bool) -> shared::auth::Principal {
    shared::auth::Principal {
        max_runs: (!quiet).then_some(TENANT_MAX_RUNS),
        ..shared::auth::Principal::unrestricted(principal_of(run_id, quiet))
    }
}

/// What every run is asked.
pub const ASK: &str = "work";

/// The thread the odd runs continue.
pub const THREAD: &str = "thread-0";
