//! What the store holds, as the checks read it: what the real NATS adapters wrote to the
//! simulated JetStream ([`crate::jetstream`]), read in the adapters' own format
//! (`orchestrator::store::nats::inspect`) and watched write by write (the takeovers, the
//! principals' share, each spend added).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use orchestrator::domain::thread::Thread;
use orchestrator::domain::usage::Tally;
use orchestrator::domain::{NumberedEvent, RunResult, RunStatus};
use orchestrator::store::nats::inspect::{self, Names};
use shared::jetstream::Message;

use crate::jetstream::{Cluster, Observer, Peek};

/// A run's record as the checks read it.
#[derive(Debug, Clone)]
pub struct RunView {
    /// Its result.
    pub result: RunResult,
    /// The replica that owns (or owned) it.
    pub owner: String,
    /// The incarnation of that replica holding it.
    pub incarnation: String,
    /// Its epoch.
    pub epoch: u64,
}

/// What the store holds.
#[derive(Debug, Clone, Default)]
pub struct View {
    /// Runs' records, by run id.
    pub records: BTreeMap<String, RunView>,
    /// Runs' logs, by run id: each message's events.
    pub logs: BTreeMap<String, Vec<Vec<NumberedEvent>>>,
    /// Every takeover, in order.
    pub takeovers: Vec<Takeover>,
    /// Threads, by id, with their revision.
    pub threads: BTreeMap<String, (Thread, u64)>,
    /// Run slots: the value naming the run that holds each.
    pub slots: BTreeMap<String, String>,
    /// Spend by principal and window.
    pub usage: BTreeMap<(String, u64), Tally>,
    /// Calls still waiting for a person, by run id.
    pub waits: BTreeMap<String, Vec<String>>,
    /// Moments a principal had more runs running than its `max_runs`.
    pub quota_breaches: Vec<String>,
    /// Where each run is in the run index: its shard, and its place in the shard's order (oldest
    /// first). `ListRuns` walks each shard down.
    pub index_order: HashMap<String, (usize, usize)>,
    /// Lines for the history: each spend added, heard or not.
    pub spend: Vec<String>,
    /// The signal stream's messages: the run and exit call each names, in stream order.
    pub signals: Vec<(String, String)>,
}

impl View {
    /// The events of `run_id`'s log, in order.
    pub fn events(&self, run_id: &str) -> Vec<&NumberedEvent> {
        self.logs
            .get(run_id)
            .map(|log| log.iter().flatten().collect())
            .unwrap_or_default()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A takeover: the run, the epoch it began, and the calls whose outcome the checkpoint it
/// resumed from held (none of them may run again).
#[derive(Debug, Clone)]
pub struct Takeover {
    /// The run.
    pub run_id: String,
    /// The new owner's epoch.
    pub epoch: u64,
    /// The calls the checkpoint held the outcome of.
    pub checkpointed_calls: BTreeSet<String>,
    /// When the store took the claim.
    pub at: tokio::time::Instant,
}

/// The calls whose task a checkpoint follows, read from its JSON (`calls.tasks[].index`, a
/// position in `calls.partition.calls`, the checkpoint's name for the sorted calls), or would
/// follow had the store not forgotten them (`--without task-handles`).
fn followed_tasks(checkpoint: &[u8]) -> Vec<String> {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(checkpoint) else {
        return Vec::new();
    };
    let calls = &json["calls"];
    let kept = calls["tasks"].as_array().into_iter().flatten();
    kept.chain(calls[super::without::FORGOTTEN_TASKS].as_array().into_iter().flatten())
        .filter_map(|following| {
            let index = usize::try_from(following["index"].as_u64()?).ok()?;
            calls["partition"]["calls"][index]["id"].as_str().map(str::to_owned)
        })
        .collect()
}

/// What is learned only by watching the writes as they land.
#[derive(Debug, Default)]
struct Seen {
    /// Each spend added, as a history line.
    spend: Vec<String>,
    takeovers: Vec<Takeover>,
    quota_breaches: Vec<String>,
}

/// The simulated JetStream with the real adapters' writes watched.
pub struct Watched {
    cluster: Cluster,
    names: Names,
    /// The signal stream.
    signals: String,
    /// The runs' ids (`run-0..`).
    runs: Vec<String>,
    /// Each principal's `max_runs`.
    max_runs: BTreeMap<String, usize>,
    seen: Arc<Mutex<Seen>>,
}

impl Watched {
    /// `cluster` as the adapters named `names` write it, for runs `runs`; its writes watched.
    pub fn new(
        cluster: Cluster,
        names: Names,
        signals: String,
        runs: Vec<String>,
        max_runs: BTreeMap<String, usize>,
    ) -> Arc<Self> {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let watcher = Watcher {
            names: names.clone(),
            runs: runs
                .iter()
                .map(|run_id| (inspect::run_key(run_id), run_id.clone()))
                .collect(),
            max_runs: max_runs.clone(),
            running: BTreeMap::new(),
            seen: Arc::clone(&seen),
        };
        cluster.observe(Box::new(watcher));
        Arc::new(Self {
            cluster,
            names,
            signals,
            runs,
            max_runs,
            seen,
        })
    }

    /// The cluster.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// The names of the store's buckets and streams.
    pub fn names(&self) -> &Names {
        &self.names
    }

    /// The fence of `run_id` as the leader holds it now: the higher of its fence key and its
    /// record's epoch.
    pub fn fence(&self, run_id: &str) -> u64 {
        let bucket = self.names.runs_of(run_id);
        let value = |key: &str| self.cluster.entry(&bucket, key).map(|e| e.value);
        let fence = value(&shared::fence::key(run_id)).and_then(|v| shared::fence::decode(&v).ok());
        let record = value(&shared::fence::record_key(run_id)).and_then(|v| shared::fence::record_epoch(&v).ok());
        fence.max(record).unwrap_or(0)
    }

    /// The store as [`Watched::view`] reads it, of run `run_id` alone: its record, log and
    /// waits (what a check of one run's end reads, without reading every run's).
    pub fn run_view(&self, run_id: &str) -> View {
        let mut view = View::default();
        self.add_run(&mut view, run_id);
        view
    }

    /// Run `run_id`'s record, log and waits into `view`.
    fn add_run(&self, view: &mut View, run_id: &str) {
        let names = &self.names;
        let key = inspect::run_key(run_id);
        if let Some(run) = self.record(run_id) {
            view.records.insert(run_id.to_owned(), run);
        }
        let log: Vec<Vec<NumberedEvent>> = self
            .cluster
            .messages(
                &names.events_of(run_id),
                &inspect::log_subject(&names.events_of(run_id), run_id),
            )
            .iter()
            .filter_map(|m| inspect::log_events(&m.payload).ok())
            .collect();
        if !log.is_empty() {
            view.logs.insert(run_id.to_owned(), log);
        }
        if let Some(entry) = self.cluster.entry(&names.approvals, &key) {
            let undecided = inspect::undecided(&entry.value).unwrap_or_default();
            view.waits.insert(run_id.to_owned(), undecided);
        }
    }

    /// What the store holds of the runs' ends: their records and the thread (what the wait for
    /// every run's end reads, again and again, without every run's log).
    pub fn ends(&self) -> View {
        let mut view = View::default();
        for run_id in &self.runs {
            if let Some(run) = self.record(run_id) {
                view.records.insert(run_id.clone(), run);
            }
        }
        self.add_thread(&mut view);
        view
    }

    /// Run `run_id`'s record, as the leader holds it.
    fn record(&self, run_id: &str) -> Option<RunView> {
        let key = inspect::run_key(run_id);
        let entry = self.cluster.entry(&self.names.runs_of(run_id), &key)?;
        let run = inspect::run(&key, &entry.value).ok()?;
        Some(RunView {
            result: run.result,
            owner: run.owner,
            incarnation: run.incarnation,
            epoch: run.epoch,
        })
    }

    /// The thread, into `view`.
    fn add_thread(&self, view: &mut View) {
        let thread_key = inspect::thread_key(super::THREAD);
        if let Some(entry) = self.cluster.entry(&self.names.threads, &thread_key)
            && let Ok(thread) = inspect::thread(&entry.value)
        {
            view.threads.insert(super::THREAD.to_owned(), (thread, entry.revision));
        }
    }

    /// What the store holds now.
    pub fn view(&self) -> View {
        let names = &self.names;
        let mut view = View::default();
        for run_id in &self.runs {
            self.add_run(&mut view, run_id);
        }
        self.add_thread(&mut view);
        for key in self.cluster.keys(&names.slots, ">") {
            if let Some(entry) = self.cluster.entry(&names.slots, &key) {
                view.slots
                    .insert(key, String::from_utf8_lossy(&entry.value).into_owned());
            }
        }
        for key in self.cluster.keys(&names.usage, ">") {
            let window = key.rsplit_once('.').and_then(|(_, w)| w.parse().ok()).unwrap_or(0);
            if let Some(entry) = self.cluster.entry(&names.usage, &key)
                && let Ok(tally) = inspect::tally(&entry.value)
            {
                let principal = self.principal_of(&key);
                view.usage.insert((principal, window), tally);
            }
        }
        view.index_order = self.index_order(&view.records);
        view.signals = self
            .cluster
            .messages(&self.signals, ">")
            .iter()
            .map(|m| {
                let header = |name| m.header(name).unwrap_or_default().to_owned();
                (header("Orchestrator-Run-Id"), header("Orchestrator-Call-Id"))
            })
            .collect();
        let seen = lock(&self.seen);
        view.takeovers = seen.takeovers.clone();
        view.spend = seen.spend.clone();
        view.quota_breaches = seen.quota_breaches.clone();
        view
    }

    /// The runs whose index entry agrees with their record: each one's shard and place there.
    fn index_order(&self, records: &BTreeMap<String, RunView>) -> HashMap<String, (usize, usize)> {
        let mut order = HashMap::new();
        for (shard, stream) in self.names.every_index().iter().enumerate() {
            let agreeing = self
                .cluster
                .messages(stream, ">")
                .iter()
                .filter_map(|m| inspect::index_entry(&m.payload).ok())
                .filter(|(run_id, created)| records.get(run_id).is_some_and(|r| r.result.created_at_ms == *created))
                .map(|(run_id, _)| run_id)
                .collect::<Vec<_>>();
            order.extend(
                agreeing
                    .into_iter()
                    .enumerate()
                    .map(|(place, run_id)| (run_id, (shard, place))),
            );
        }
        order
    }

    /// The principal a usage key names (by the tokens of the principals known).
    fn principal_of(&self, key: &str) -> String {
        self.max_runs
            .keys()
            .find(|p| key.starts_with(&format!("{}.", orchestrator::store::nats::inspect::token(p))))
            .cloned()
            .unwrap_or_else(|| key.to_owned())
    }
}

/// Watches the writes as they land.
struct Watcher {
    names: Names,
    /// The runs, by their record's key.
    runs: std::collections::HashMap<String, String>,
    max_runs: BTreeMap<String, usize>,
    /// The runs each principal has running as their records now stand (kept write by write:
    /// thousands of quiet runs would make a count over every record per write quadratic).
    running: BTreeMap<String, BTreeSet<String>>,
    seen: Arc<Mutex<Seen>>,
}

impl Watcher {
    fn kv(&self, bucket: &str) -> String {
        format!("KV_{bucket}")
    }

    /// A record written: a takeover (the epoch moved on), and the principals' share after it.
    fn record_written(&mut self, message: &Message, before: Option<&Message>, peek: &Peek<'_>) {
        let mut keys = (self.names.every_runs().into_iter()).filter_map(|bucket| {
            message
                .subject
                .strip_prefix(&format!("$KV.{bucket}."))
                .map(str::to_owned)
        });
        let Some(key) = keys.next() else {
            return;
        };
        let key = key.as_str();
        if !key.starts_with("run.") {
            return;
        }
        let Ok(now) = inspect::run(key, &message.payload) else {
            // Gone (or not a record): running no more.
            if let Some(run_id) = self.runs.get(key) {
                self.running.values_mut().for_each(|runs| {
                    runs.remove(run_id);
                });
            }
            return;
        };
        let was = before.and_then(|b| inspect::run(key, &b.payload).ok());
        if let Some(was) = was
            && now.epoch > was.epoch
        {
            let checkpoint = peek.object(&self.names.checkpoints_of(&now.result.run_id), &now.checkpoint);
            let mut calls: BTreeSet<String> = now.result.tool_calls.iter().map(|c| c.call_id.clone()).collect();
            calls.extend(checkpoint.map(followed_tasks).unwrap_or_default());
            lock(&self.seen).takeovers.push(Takeover {
                run_id: now.result.run_id.clone(),
                epoch: now.epoch,
                checkpointed_calls: calls,
                at: tokio::time::Instant::now(),
            });
        }
        let runs = self.running.entry(now.result.principal.clone()).or_default();
        match now.result.status == RunStatus::Running {
            true => runs.insert(now.result.run_id.clone()),
            false => runs.remove(&now.result.run_id),
        };
        self.check_share(peek, &now.result.principal);
    }

    /// Notes when `principal` has more runs running than its `max_runs`.
    fn check_share(&self, peek: &Peek<'_>, principal: &str) {
        if let Some(max) = self.max_runs.get(principal) {
            let live: Vec<&String> = self.running.get(principal).into_iter().flatten().collect();
            let mut seen = lock(&self.seen);
            let again = seen
                .quota_breaches
                .last()
                .is_some_and(|last| last.ends_with(&format!("{live:?}")));
            if live.len() > *max && !again {
                let slots: Vec<String> = peek
                    .keys(&self.names.slots, ">")
                    .into_iter()
                    .filter_map(|key| {
                        let holder = peek.entry(&self.names.slots, &key)?;
                        Some(format!("{key}={}", String::from_utf8_lossy(&holder.value)))
                    })
                    .collect();
                let breach = format!(
                    "{principal} has {} runs live after a write, its max_runs {max}: {live:?} (slots {slots:?})",
                    live.len()
                );
                seen.quota_breaches.push(breach);
            }
        }
    }
}

/// How far a spend window booked each of its runs.
fn booked_runs(message: &Message) -> String {
    let window: Result<orchestrator::domain::usage::Window, _> = serde_json::from_slice(&message.payload);
    window.map_or_else(
        |e| e.to_string(),
        |w| {
            let runs: Vec<String> = w
                .booked
                .iter()
                .map(|b| format!("{} {}", b.run_id, b.through.prompt_tokens + b.through.completion_tokens))
                .collect();
            runs.join(", ")
        },
    )
}

/// The tokens a spend window holds.
fn tokens(message: Option<&Message>) -> u64 {
    message
        .and_then(|m| inspect::tally(&m.payload).ok())
        .map_or(0, |t| t.prompt_tokens + t.completion_tokens)
}

impl Observer for Watcher {
    fn stored(&mut self, stream: &str, message: &Message, before: Option<&Message>, peek: &Peek<'_>) {
        if self.names.every_runs().iter().any(|bucket| stream == self.kv(bucket)) {
            self.record_written(message, before, peek);
        }
        if stream == self.kv(&self.names.usage) {
            let added = tokens(Some(message)).saturating_sub(tokens(before));
            let runs = booked_runs(message);
            lock(&self.seen).spend.push(format!(
                "spend +{added} tokens at seq {} into {} (booked: {runs})",
                message.sequence, message.subject
            ));
        }
    }
}
