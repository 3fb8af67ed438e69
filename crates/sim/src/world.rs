//! The simulated fleet: replicas acting for runs, tool-runners, a store, a network between them,
//! and a clock, driven one event at a time in the order (time, then scheduling) so a seed always
//! gives the same history. A replica's run follows the services' rules: it claims its id with
//! its start checkpoint, saves a checkpoint before a call leaves and before a result is logged,
//! checks its lease before every attempt, logs after the subject's last position, renews its
//! lease, and ends by logging `run_finished`, then adding itself to its thread, then storing its
//! end. Every replica looks for runs whose record stood still for a lease, raises their fence,
//! claims them in the next epoch and resumes them from their checkpoint and their log's end.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use orchestrator::domain::RunStatus;

use crate::check::{History, Read, Start};
use crate::lease::Lease;
use crate::plan::{Fault, Rules, Settings};
use crate::store::{Checkpoint, Entry, Kind, Op, Record, Reply, Rev, Status, Store};

/// How long a caller waits for its run to exist before it asks again.
const CALLER_RETRY: u64 = 1000;

/// What a store answer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    AdmitThread,
    AdmitCheckpoint,
    AdmitRecord,
    SaveObject(Then),
    SaveRecord(Then),
    Renew,
    Log,
    EndThread,
    EndRecord,
    Scan,
    TakeRaise,
    TakeClaim,
    TakeCheckpoint,
    TakeLast,
    TakeEnd,
}

/// What a run does once its checkpoint is saved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    Call,
    Log,
}

/// Who asked the store.
#[derive(Debug, Clone)]
enum Asker {
    Replica {
        replica: usize,
        inc: u64,
        run: String,
        step: Step,
    },
    Runner {
        call: Call,
    },
}

/// A tool call on its way: the sender's run, call id and epoch.
#[derive(Debug, Clone)]
struct Call {
    replica: usize,
    inc: u64,
    run: String,
    id: u32,
    epoch: u64,
    attempt: u32,
    runner: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallOutcome {
    Ran,
    Stale,
    Unavailable,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    Model,
    Call(u32),
    Renew,
    /// The end's write, again.
    StoreEnd,
}

/// How often a final result the store did not take is written again.
const BACKLOG_RETRY: u64 = 1000;

#[derive(Debug, Clone)]
enum Ev {
    StoreArrive {
        req: u64,
        run: String,
        op: Op,
    },
    Answer {
        req: u64,
        reply: Reply,
    },
    Timeout {
        req: u64,
    },
    CallArrive(Call),
    CallDone(Call, CallOutcome),
    Wake {
        replica: usize,
        inc: u64,
        run: String,
        epoch: u64,
        what: Wake,
    },
    Scan {
        replica: usize,
        inc: u64,
    },
    Admit(String),
    Read,
    Fault(Fault),
    Resume(usize),
    Restart(usize),
}

/// A replica's run as it acts for it.
#[derive(Debug)]
struct Task {
    lease: Lease,
    rev: Rev,
    cp: Checkpoint,
    logged_seq: u64,
    log_position: u64,
    /// Readers asking this replica see the run ended.
    shows_end: bool,
    /// A record write (renewal or save) is on its way: writes are one at a time, as the
    /// persister's lock makes them.
    record_busy: bool,
    /// A save that waits for a renewal's answer.
    waiting_save: Option<Then>,
    /// When the record write on its way was sent.
    write_sent: u64,
    /// The epoch whose checkpoint object the record names: this run's own once it saved one.
    checkpoint_epoch: u64,
    /// The log keeps the run's end: only the end's writes are left.
    ending: bool,
}

/// A takeover in progress.
#[derive(Debug)]
struct Taking {
    seen: Record,
    rev: Rev,
    claim_sent: u64,
    checkpoint: Option<Checkpoint>,
}

#[derive(Debug, Default)]
struct Replica {
    inc: u64,
    crashed: bool,
    paused_until: Option<u64>,
    cut_off_until: u64,
    holding_sends: Option<(u64, u64)>,
    tasks: BTreeMap<String, Task>,
    taking: BTreeMap<String, Taking>,
    /// Records of runs seen running elsewhere: revision, and when first seen so.
    sightings: BTreeMap<String, (Rev, u64)>,
    /// Events that came while it was paused, handled once it runs again.
    deferred: Vec<Ev>,
}

impl Replica {
    fn name(&self, index: usize) -> String {
        format!("r{index}.{}", self.inc)
    }

    fn paused(&self) -> bool {
        self.paused_until.is_some()
    }

    fn serving(&self) -> bool {
        !self.crashed && !self.paused()
    }
}

struct Pending {
    asker: Asker,
    sent: u64,
}

struct Scheduled {
    at: u64,
    order: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.order) == (other.at, other.order)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.order).cmp(&(other.at, other.order))
    }
}

/// See the module docs.
pub struct World {
    /// The fleet's settings.
    pub settings: Settings,
    rules: Rules,
    rng: fastrand::Rng,
    now: u64,
    order: u64,
    queue: BinaryHeap<Reverse<Scheduled>>,
    /// The shared store.
    pub store: Store,
    store_down_until: u64,
    store_slow: Option<(u64, u64)>,
    replicas: Vec<Replica>,
    runners_lost_until: Vec<u64>,
    /// Per runner: until when, and how much later, the answers to its reads come.
    runner_links: Vec<(u64, u64)>,
    pending: BTreeMap<u64, Pending>,
    next_req: u64,
    /// What the invariants look at.
    pub history: History,
    /// One line per event, when tracing.
    pub trace: Option<Vec<String>>,
}

impl World {
    /// A fleet under `rules`, its randomness (and fault plan) from `seed`.
    pub fn new(seed: u64, settings: Settings, rules: Rules, trace: bool) -> Self {
        let mut rng = fastrand::Rng::with_seed(seed);
        let faults = crate::plan::draw(&mut rng, &settings);
        let mut world = Self {
            rules,
            rng,
            now: 0,
            order: 0,
            queue: BinaryHeap::new(),
            store: Store::default(),
            store_down_until: 0,
            store_slow: None,
            replicas: (0..settings.replicas).map(|_| Replica::default()).collect(),
            runners_lost_until: vec![0; settings.runners],
            runner_links: vec![(0, 0); settings.runners],
            pending: BTreeMap::new(),
            next_req: 0,
            history: History::default(),
            trace: trace.then(Vec::new),
            settings,
        };
        for (at, fault) in faults {
            world.at(at, Ev::Fault(fault));
        }
        for run in 0..world.settings.runs {
            let at = world.rng.u64(0..world.settings.horizon / 3);
            world.at(at, Ev::Admit(format!("run{run}")));
        }
        for replica in 0..world.settings.replicas {
            let first = world.rng.u64(0..world.settings.scan_every);
            world.at(first, Ev::Scan { replica, inc: 0 });
        }
        world.at(world.settings.read_every, Ev::Read);
        world
    }

    /// Runs until every run ended and the faults are over, or until the give-up time.
    pub fn run(&mut self) {
        while let Some(Reverse(next)) = self.queue.pop() {
            self.now = next.at;
            if self.now > self.settings.give_up || self.settled() {
                break;
            }
            if let Some(trace) = &mut self.trace {
                trace.push(format!("{:>7} {:?}", self.now, next.ev));
            }
            self.handle(next.ev);
        }
    }

    /// Whether every run was admitted and ended, past the horizon.
    fn settled(&self) -> bool {
        self.now > self.settings.horizon
            && self.history.admitted.len() == self.settings.runs
            && self.history.admitted.keys().all(|run| self.store.stored_end(run))
    }

    fn at(&mut self, at: u64, ev: Ev) {
        self.order += 1;
        self.queue.push(Reverse(Scheduled {
            at,
            order: self.order,
            ev,
        }));
    }

    fn after(&mut self, delay: u64, ev: Ev) {
        self.at(self.now + delay, ev);
    }

    fn latency(&mut self) -> u64 {
        let (low, high) = self.settings.latency;
        self.rng.u64(low..=high)
    }

    fn thread_of(&self, run: &str) -> String {
        self.history.admitted.get(run).cloned().unwrap_or_default()
    }

    // ---- the event loop ------------------------------------------------------------------

    fn handle(&mut self, ev: Ev) {
        if let Some(replica) = self.target(&ev) {
            let r = &mut self.replicas[replica];
            if r.paused() {
                r.deferred.push(ev);
                return;
            }
        }
        match ev {
            Ev::StoreArrive { req, run, op } => self.store_arrive(req, &run, op),
            Ev::Answer { req, reply } => self.answer(req, Some(reply)),
            Ev::Timeout { req } => self.answer(req, None),
            Ev::CallArrive(call) => self.call_arrive(call),
            Ev::CallDone(call, outcome) => self.call_done(call, outcome),
            Ev::Wake {
                replica,
                inc,
                run,
                epoch,
                what,
            } => self.wake(replica, inc, &run, epoch, what),
            Ev::Scan { replica, inc } => self.scan(replica, inc),
            Ev::Admit(run) => self.admit(run),
            Ev::Read => self.read(),
            Ev::Fault(fault) => self.fault(fault),
            Ev::Resume(replica) => self.resume(replica),
            Ev::Restart(replica) => self.restart(replica),
        }
    }

    /// The replica an event is handled by, if it is handled by one (paused, it waits).
    fn target(&self, ev: &Ev) -> Option<usize> {
        match ev {
            Ev::Answer { req, .. } | Ev::Timeout { req } => match self.pending.get(req).map(|p| &p.asker) {
                Some(Asker::Replica { replica, .. }) => Some(*replica),
                _ => None,
            },
            Ev::CallDone(call, _) => Some(call.replica),
            Ev::Wake { replica, .. } | Ev::Scan { replica, .. } => Some(*replica),
            _ => None,
        }
    }

    // ---- the network and the store -------------------------------------------------------

    /// Sends `op` of `run` to the store; its answer (or its timeout) goes to `asker`.
    fn ask(&mut self, asker: Asker, run: &str, op: Op) {
        self.next_req += 1;
        let req = self.next_req;
        let timeout = match asker {
            Asker::Replica { .. } => self.settings.store_timeout,
            Asker::Runner { .. } => self.settings.runner_timeout,
        };
        self.pending.insert(req, Pending { asker, sent: self.now });
        let delay = self.latency();
        self.after(
            delay,
            Ev::StoreArrive {
                req,
                run: run.to_owned(),
                op,
            },
        );
        self.after(timeout, Ev::Timeout { req });
    }

    fn cut_off(&self, asker: &Asker) -> bool {
        matches!(asker, Asker::Replica { replica, .. } if self.replicas[*replica].cut_off_until > self.now)
    }

    /// A request reaches the store: applied unless the store is down or the sender cut off; the
    /// answer goes back (later while the store is slow).
    fn store_arrive(&mut self, req: u64, run: &str, op: Op) {
        let Some(pending) = self.pending.get(&req) else {
            // Its sender timed out, but the request still lands.
            return self.apply_late(run, op);
        };
        if self.store_down_until > self.now || self.cut_off(&pending.asker) {
            return;
        }
        let thread = self.thread_of(run);
        let reply = self.store.apply(run, &thread, op, self.now);
        let mut slow = match self.store_slow {
            Some((until, extra)) if until > self.now => extra,
            _ => 0,
        };
        if let Asker::Runner { call } = &pending.asker
            && let (until, extra) = self.runner_links[call.runner]
            && until > self.now
        {
            slow += extra;
        }
        let delay = self.latency() + slow;
        self.after(delay, Ev::Answer { req, reply });
    }

    /// A request whose sender gave up lands all the same (its answer is lost): a write that
    /// timed out may have been made.
    fn apply_late(&mut self, run: &str, op: Op) {
        if self.store_down_until > self.now {
            return;
        }
        let thread = self.thread_of(run);
        self.store.apply(run, &thread, op, self.now);
    }

    /// An answer (`None`: the timeout) reaches its asker, unless it is gone or cut off.
    fn answer(&mut self, req: u64, reply: Option<Reply>) {
        let Some(pending) = self.pending.get(&req) else { return };
        if reply.is_some() && self.cut_off(&pending.asker) {
            return;
        }
        let Some(Pending { asker, sent }) = self.pending.remove(&req) else {
            return;
        };
        match asker {
            Asker::Runner { call } => self.fence_read(call, reply),
            Asker::Replica {
                replica,
                inc,
                run,
                step,
            } => {
                if self.replicas[replica].crashed || self.replicas[replica].inc != inc {
                    return;
                }
                self.replica_answer(replica, &run, step, reply, sent);
            }
        }
    }

    // ---- runners -------------------------------------------------------------------------

    fn call_arrive(&mut self, call: Call) {
        if self.runners_lost_until[call.runner] > self.now {
            let delay = self.latency();
            return self.after(delay, Ev::CallDone(call, CallOutcome::Unavailable));
        }
        if self.rules.receiver_fence {
            let run = call.run.clone();
            self.ask(Asker::Runner { call }, &run, Op::ReadFence);
        } else {
            self.start_tool(call);
        }
    }

    /// The runner's fence read answered (`None`: not in time).
    fn fence_read(&mut self, call: Call, reply: Option<Reply>) {
        match reply {
            Some(Reply::Fence(current)) if shared::fence::stale(call.epoch, current) => {
                let delay = self.latency();
                self.after(delay, Ev::CallDone(call, CallOutcome::Stale));
            }
            Some(Reply::Fence(_)) => self.start_tool(call),
            _ => {
                let delay = self.latency();
                self.after(delay, Ev::CallDone(call, CallOutcome::Unavailable));
            }
        }
    }

    fn start_tool(&mut self, call: Call) {
        self.history.starts.push(Start {
            at: self.now,
            run: call.run.clone(),
            call: call.id,
            epoch: call.epoch,
            runner: call.runner,
        });
        let (low, high) = self.settings.tool;
        let took = self.rng.u64(low..=high) + self.latency();
        self.after(took, Ev::CallDone(call, CallOutcome::Ran));
    }

    // ---- faults --------------------------------------------------------------------------

    fn fault(&mut self, fault: Fault) {
        match fault {
            Fault::Partition { replica, lasts } => {
                self.replicas[replica].cut_off_until = self.now + lasts;
            }
            Fault::Pause { replica, lasts } => {
                if self.replicas[replica].serving() {
                    self.replicas[replica].paused_until = Some(self.now + lasts);
                    self.after(lasts, Ev::Resume(replica));
                }
            }
            Fault::Crash { replica, restart_after } => {
                if !self.replicas[replica].crashed {
                    let r = &mut self.replicas[replica];
                    r.crashed = true;
                    r.paused_until = None;
                    r.tasks.clear();
                    r.taking.clear();
                    r.sightings.clear();
                    r.deferred.clear();
                    self.after(restart_after, Ev::Restart(replica));
                }
            }
            Fault::SlowStore { extra, lasts } => self.store_slow = Some((self.now + lasts, extra)),
            Fault::StoreDown { lasts } => self.store_down_until = self.now + lasts,
            Fault::RunnerLost { runner, lasts } => self.runners_lost_until[runner] = self.now + lasts,
            Fault::SlowRunnerLink { runner, extra, lasts } => self.runner_links[runner] = (self.now + lasts, extra),
            Fault::DelayedSends { replica, hold, lasts } => {
                self.replicas[replica].holding_sends = Some((self.now + lasts, hold));
            }
        }
    }

    fn resume(&mut self, replica: usize) {
        let r = &mut self.replicas[replica];
        if r.paused_until.is_none() {
            return;
        }
        r.paused_until = None;
        for ev in std::mem::take(&mut r.deferred) {
            self.after(0, ev);
        }
    }

    fn restart(&mut self, replica: usize) {
        let r = &mut self.replicas[replica];
        r.crashed = false;
        r.inc += 1;
        let inc = r.inc;
        self.after(0, Ev::Scan { replica, inc });
    }

    // ---- callers and readers -------------------------------------------------------------

    /// A caller starts `run` on a replica that serves, in its thread (one run holds a thread at
    /// a time: a busy one is asked again later).
    fn admit(&mut self, run: String) {
        if self.store.records.contains_key(&run) {
            return;
        }
        let thread = format!(
            "thread{}",
            run.trim_start_matches("run").parse::<usize>().unwrap_or(0) % self.settings.threads
        );
        self.history.admitted.entry(run.clone()).or_insert(thread);
        // The caller asks again until the run exists, whatever happened to this try (refused,
        // unanswered, or its replica gone).
        self.after(CALLER_RETRY, Ev::Admit(run.clone()));
        let serving: Vec<usize> = (0..self.replicas.len())
            .filter(|&r| self.replicas[r].serving())
            .collect();
        if serving.is_empty() {
            return;
        }
        let replica = serving[self.rng.usize(..serving.len())];
        self.ask_for(replica, &run, Step::AdmitThread, Op::ThreadBegin(run.clone()));
    }

    /// A reader asks a serving replica about a run: the run's state when it acts for it, else
    /// the store's record.
    fn read(&mut self) {
        let every = self.settings.read_every;
        self.after(every, Ev::Read);
        let runs: Vec<String> = self.history.admitted.keys().cloned().collect();
        if runs.is_empty() {
            return;
        }
        let run = runs[self.rng.usize(..runs.len())].clone();
        let replica = self.rng.usize(..self.replicas.len());
        if !self.replicas[replica].serving() {
            return;
        }
        let saw_end = match self.replicas[replica].tasks.get(&run) {
            Some(task) => task.shows_end,
            None => self.store.stored_end(&run),
        };
        self.history.reads.push(Read {
            at: self.now,
            saw_end,
            logged: self.store.logged_end(&run),
            stored: self.store.stored_end(&run),
            run,
        });
    }

    // ---- a replica acting for its runs ---------------------------------------------------

    fn ask_for(&mut self, replica: usize, run: &str, step: Step, op: Op) {
        let inc = self.replicas[replica].inc;
        self.ask(
            Asker::Replica {
                replica,
                inc,
                run: run.to_owned(),
                step,
            },
            run,
            op,
        );
    }

    fn wake_in(&mut self, delay: u64, replica: usize, run: &str, epoch: u64, what: Wake) {
        let inc = self.replicas[replica].inc;
        self.after(
            delay,
            Ev::Wake {
                replica,
                inc,
                run: run.to_owned(),
                epoch,
                what,
            },
        );
    }

    fn task(&mut self, replica: usize, run: &str) -> Option<&mut Task> {
        self.replicas[replica].tasks.get_mut(run)
    }

    /// The replica stops acting for the run (its lease ran out, a write or a call was refused):
    /// another replica takes it over once its record stands still for a lease.
    fn stop(&mut self, replica: usize, run: &str) {
        if let Some(mut task) = self.replicas[replica].tasks.remove(run) {
            task.lease.stop();
        }
    }

    /// Whether the replica still acts for the run in `epoch`, stopping it when its lease ran out.
    fn acting(&mut self, replica: usize, run: &str, epoch: u64) -> bool {
        let now = self.now;
        let holds = match self.task(replica, run) {
            Some(task) if task.lease.epoch == epoch => task.lease.holds(now),
            _ => return false,
        };
        if !holds {
            self.stop(replica, run);
        }
        holds
    }

    fn record_of(&self, replica: usize, task: &Task, status: Status) -> Record {
        Record {
            owner: self.replicas[replica].name(replica),
            epoch: task.lease.epoch,
            status,
            checkpoint_epoch: task.checkpoint_epoch,
            turns: task.cp.turns,
        }
    }

    /// What the run does next from where its checkpoint stands.
    fn go_on(&mut self, replica: usize, run: &str) {
        let Some(task) = self.task(replica, run) else { return };
        let epoch = task.lease.epoch;
        if task.cp.call_in_flight {
            let wait = task.lease.calls_from.saturating_sub(self.now);
            return self.wake_in(wait, replica, run, epoch, Wake::Call(0));
        }
        if task.cp.turns == self.settings.turns {
            return self.end(replica, run);
        }
        let (low, high) = self.settings.model;
        let thinking = self.rng.u64(low..=high);
        self.wake_in(thinking, replica, run, epoch, Wake::Model);
    }

    fn wake(&mut self, replica: usize, inc: u64, run: &str, epoch: u64, what: Wake) {
        if self.replicas[replica].crashed || self.replicas[replica].inc != inc {
            return;
        }
        match what {
            Wake::Model => {
                // The model's turn asked for a call: the checkpoint holding it is saved first.
                if !self.acting(replica, run, epoch) {
                    return;
                }
                if let Some(task) = self.task(replica, run) {
                    task.cp.call_in_flight = true;
                }
                self.save(replica, run, Then::Call);
            }
            Wake::Call(attempt) => self.send_call(replica, run, epoch, attempt),
            Wake::Renew => self.renew(replica, run, epoch),
            Wake::StoreEnd => {
                if self.task(replica, run).is_some_and(|t| t.lease.epoch == epoch) {
                    self.store_end(replica, run);
                }
            }
        }
    }

    /// Saves the run's checkpoint (its object, then its record by compare-and-set), then `then`.
    fn save(&mut self, replica: usize, run: &str, then: Then) {
        let Some(task) = self.task(replica, run) else { return };
        let (epoch, cp) = (task.lease.epoch, task.cp.clone());
        self.ask_for(replica, run, Step::SaveObject(then), Op::PutCheckpoint(epoch, cp));
    }

    fn save_record(&mut self, replica: usize, run: &str, then: Then) {
        let Some(task) = self.task(replica, run) else { return };
        if task.record_busy {
            task.waiting_save = Some(then);
            return;
        }
        self.write_record(replica, run, Step::SaveRecord(then), Status::Running);
    }

    /// Sends the run's record as it stands (with `status`), by compare-and-set on the revision
    /// written last; one write at a time.
    fn write_record(&mut self, replica: usize, run: &str, step: Step, status: Status) {
        let now = self.now;
        let Some(task) = self.task(replica, run) else { return };
        task.record_busy = true;
        task.write_sent = now;
        let rev = task.rev;
        let Some(task) = self.replicas[replica].tasks.get(run) else {
            return;
        };
        let record = self.record_of(replica, task, status);
        self.ask_for(replica, run, step, Op::UpdateRecord(record, rev));
    }

    /// A lease renewal: the record written again, unless a write of it is on its way.
    fn renew(&mut self, replica: usize, run: &str, epoch: u64) {
        if !self.acting(replica, run, epoch) {
            return;
        }
        let every = self.settings.lease / 3;
        self.wake_in(every, replica, run, epoch, Wake::Renew);
        match self.task(replica, run) {
            Some(task) if !task.record_busy && !task.ending => {
                self.write_record(replica, run, Step::Renew, Status::Running);
            }
            _ => {}
        }
    }

    /// A record write answered: the lease runs from its send; refused, the run moved.
    fn record_written(&mut self, replica: usize, run: &str, reply: Option<Reply>) -> bool {
        let Some(task) = self.task(replica, run) else {
            return false;
        };
        task.record_busy = false;
        match reply {
            Some(Reply::Written(Some(rev))) => {
                task.rev = rev;
                let sent = task.write_sent;
                task.lease.confirmed(sent);
                true
            }
            Some(Reply::Written(None)) => {
                self.stop(replica, run);
                false
            }
            _ => false,
        }
    }

    /// Sends the turn's call, after the fence grace, while the lease holds (checked before every
    /// attempt unless the rules say otherwise); a replica holding its sends lets the call leave
    /// only later, whatever happened meanwhile.
    fn send_call(&mut self, replica: usize, run: &str, epoch: u64, attempt: u32) {
        let now = self.now;
        let (calls_from, id) = match self.task(replica, run) {
            Some(task) if task.lease.epoch == epoch => (task.lease.calls_from, task.cp.turns + 1),
            _ => return,
        };
        if self.rules.fence_grace && calls_from > now {
            return self.wake_in(calls_from - now, replica, run, epoch, Wake::Call(attempt));
        }
        if (attempt == 0 || self.rules.recheck_retries) && !self.acting(replica, run, epoch) {
            return;
        }
        let runner = self.rng.usize(..self.settings.runners);
        let call = Call {
            replica,
            inc: self.replicas[replica].inc,
            run: run.to_owned(),
            id,
            epoch,
            attempt,
            runner,
        };
        let held = match self.replicas[replica].holding_sends {
            Some((until, hold)) if until > now => self.rng.u64(0..=hold),
            _ => 0,
        };
        let delay = self.latency() + held;
        self.after(delay, Ev::CallArrive(call));
    }

    fn call_done(&mut self, call: Call, outcome: CallOutcome) {
        let replica = call.replica;
        if self.replicas[replica].crashed || self.replicas[replica].inc != call.inc {
            return;
        }
        let current = self
            .task(replica, &call.run)
            .is_some_and(|t| t.lease.epoch == call.epoch && t.cp.call_in_flight && t.cp.turns + 1 == call.id);
        if !current {
            return;
        }
        match outcome {
            CallOutcome::Ran => self.call_finished(replica, &call.run),
            CallOutcome::Stale => self.stop(replica, &call.run),
            CallOutcome::Unavailable => {
                let backoff = 50 << call.attempt.min(5);
                self.wake_in(backoff, replica, &call.run, call.epoch, Wake::Call(call.attempt + 1));
            }
        }
    }

    /// The call's result: the turn's events are numbered into the outbox, saved, then logged.
    fn call_finished(&mut self, replica: usize, run: &str) {
        let Some(task) = self.task(replica, run) else { return };
        let turn = task.cp.turns + 1;
        for kind in [Kind::ToolFinished(turn), Kind::TurnEnded(turn)] {
            task.cp.seq += 1;
            let seq = task.cp.seq;
            task.cp.outbox.push(Entry { seq, kind });
        }
        task.cp.turns = turn;
        task.cp.call_in_flight = false;
        self.save(replica, run, Then::Log);
    }

    /// Appends the outbox's events the log lacks, after the log's last position as known here.
    fn log(&mut self, replica: usize, run: &str) {
        let now = self.now;
        let Some(task) = self.task(replica, run) else { return };
        if !task.lease.may_log(now) {
            return self.stop(replica, run);
        }
        let logged = task.logged_seq;
        let entries: Vec<Entry> = task.cp.outbox.iter().filter(|e| e.seq > logged).copied().collect();
        if entries.is_empty() {
            return self.go_on(replica, run);
        }
        let position = task.log_position;
        self.ask_for(replica, run, Step::Log, Op::Append(entries, position));
    }

    fn logged(&mut self, replica: usize, run: &str, reply: Option<Reply>) {
        let Some(task) = self.task(replica, run) else { return };
        match reply {
            Some(Reply::Appended(Some(position))) => {
                let finished = task.cp.outbox.iter().any(|e| matches!(e.kind, Kind::RunFinished(_)));
                task.log_position = position;
                task.logged_seq = task.cp.outbox.last().map_or(task.logged_seq, |e| e.seq);
                task.cp.outbox.clear();
                if finished {
                    // The log keeps the end: the thread takes the run, then the record its end;
                    // its lease matters no more (a replica taking it over stores the end).
                    task.ending = true;
                    return self.ask_for(
                        replica,
                        run,
                        Step::EndThread,
                        Op::ThreadEnd(run.to_owned(), RunStatus::Completed),
                    );
                }
                self.go_on(replica, run);
            }
            // Refused (another owner logged), or unanswered (it may have landed): the run stops
            // here and resumes from the log's true end elsewhere.
            _ => self.stop(replica, run),
        }
    }

    /// The run's end: `run_finished` numbered and logged, then the thread, then the record.
    fn end(&mut self, replica: usize, run: &str) {
        let end_after_log = self.rules.end_after_log;
        let turns = self.settings.turns;
        let Some(task) = self.task(replica, run) else { return };
        task.cp.seq += 1;
        let seq = task.cp.seq;
        task.cp.outbox.push(Entry {
            seq,
            kind: Kind::RunFinished(turns),
        });
        if !end_after_log {
            // The old order: the end shows in the run's state as soon as it is settled.
            task.shows_end = true;
        }
        self.log(replica, run);
    }

    /// The end's write answered: stored, the run is over here; unanswered, it is written again
    /// a second later (the result backlog); refused, the run is another replica's, which stores
    /// the end it finds in the log.
    fn stored_end(&mut self, replica: usize, run: &str, reply: Option<Reply>) {
        let answered = reply.is_some();
        if self.record_written(replica, run, reply) {
            if let Some(task) = self.task(replica, run) {
                task.lease.end();
                task.shows_end = true;
            }
            self.replicas[replica].tasks.remove(run);
        } else if !answered {
            let epoch = self.task(replica, run).map_or(0, |t| t.lease.epoch);
            self.wake_in(BACKLOG_RETRY, replica, run, epoch, Wake::StoreEnd);
        }
    }

    /// A store answer for one of the replica's steps.
    fn replica_answer(&mut self, replica: usize, run: &str, step: Step, reply: Option<Reply>, sent: u64) {
        match step {
            Step::AdmitThread | Step::AdmitCheckpoint | Step::AdmitRecord => {
                self.admission_step(replica, run, step, reply, sent);
            }
            Step::SaveObject(then) => self.object_saved(replica, run, then, reply),
            Step::SaveRecord(then) => {
                let waiting = self.task(replica, run).and_then(|t| t.waiting_save.take());
                if !self.record_written(replica, run, reply) {
                    return self.stop(replica, run);
                }
                match then {
                    Then::Call => self.go_on(replica, run),
                    Then::Log => self.log(replica, run),
                }
                if let Some(then) = waiting {
                    self.save_record(replica, run, then);
                }
            }
            Step::Renew => {
                let waiting = self.task(replica, run).and_then(|t| t.waiting_save.take());
                self.record_written(replica, run, reply);
                if let Some(then) = waiting {
                    self.save_record(replica, run, then);
                }
            }
            Step::Log => self.logged(replica, run, reply),
            Step::EndThread => match reply {
                Some(Reply::Done) => self.store_end(replica, run),
                _ => self.stop(replica, run),
            },
            Step::EndRecord => self.stored_end(replica, run, reply),
            Step::Scan => self.scanned(replica, reply),
            Step::TakeRaise | Step::TakeClaim | Step::TakeCheckpoint | Step::TakeLast | Step::TakeEnd => {
                self.take_step(replica, run, step, reply);
            }
        }
    }

    /// The admission's steps: the thread, the start checkpoint, then the record (create-if-absent).
    fn admission_step(&mut self, replica: usize, run: &str, step: Step, reply: Option<Reply>, sent: u64) {
        match (step, reply) {
            (Step::AdmitThread, Some(Reply::Began(true))) => {
                let start = Checkpoint {
                    turns: 0,
                    call_in_flight: false,
                    seq: 0,
                    outbox: Vec::new(),
                };
                self.ask_for(replica, run, Step::AdmitCheckpoint, Op::PutCheckpoint(1, start));
            }
            (Step::AdmitCheckpoint, Some(Reply::Done)) => {
                let record = Record {
                    owner: self.replicas[replica].name(replica),
                    epoch: 1,
                    status: Status::Running,
                    checkpoint_epoch: 1,
                    turns: 0,
                };
                self.ask_for(replica, run, Step::AdmitRecord, Op::CreateRecord(record));
            }
            (Step::AdmitRecord, reply) => self.admitted(replica, run, reply, sent),
            // Refused or unanswered: the caller asks again.
            _ => {}
        }
    }

    /// The checkpoint object is stored: the record names it next.
    fn object_saved(&mut self, replica: usize, run: &str, then: Then, reply: Option<Reply>) {
        if !matches!(reply, Some(Reply::Done)) {
            return self.stop(replica, run);
        }
        if let Some(task) = self.task(replica, run) {
            task.checkpoint_epoch = task.lease.epoch;
        }
        self.save_record(replica, run, then);
    }

    fn store_end(&mut self, replica: usize, run: &str) {
        let Some(task) = self.task(replica, run) else { return };
        if task.record_busy {
            // A renewal is on its way: the end goes once it is answered.
            return self.ask_for(
                replica,
                run,
                Step::EndThread,
                Op::ThreadEnd(run.to_owned(), RunStatus::Completed),
            );
        }
        self.write_record(replica, run, Step::EndRecord, Status::Ended);
    }

    fn admitted(&mut self, replica: usize, run: &str, reply: Option<Reply>, sent: u64) {
        match reply {
            Some(Reply::Written(Some(rev))) => {
                let s = &self.settings;
                let task = Task {
                    lease: Lease::new(s.lease, s.margin, sent, 1),
                    rev,
                    cp: Checkpoint {
                        turns: 0,
                        call_in_flight: false,
                        seq: 0,
                        outbox: Vec::new(),
                    },
                    logged_seq: 0,
                    log_position: 0,
                    shows_end: false,
                    record_busy: false,
                    waiting_save: None,
                    write_sent: sent,
                    checkpoint_epoch: 1,
                    ending: false,
                };
                self.replicas[replica].tasks.insert(run.to_owned(), task);
                let every = self.settings.lease / 3;
                self.wake_in(every, replica, run, 1, Wake::Renew);
                self.go_on(replica, run);
            }
            // The id is taken: an earlier try of this admission landed (its run goes on, from
            // its record, wherever it is taken over).
            Some(Reply::Written(None)) => {}
            // Unanswered: the run does not start here; the caller tries again.
            _ => {}
        }
    }

    // ---- takeover ------------------------------------------------------------------------

    fn scan(&mut self, replica: usize, inc: u64) {
        if self.replicas[replica].crashed || self.replicas[replica].inc != inc {
            return;
        }
        let every = self.settings.scan_every;
        self.after(every, Ev::Scan { replica, inc });
        self.ask_for(replica, "", Step::Scan, Op::ListRecords);
    }

    /// The records listed: a running one seen unchanged for a whole lease (on this replica's
    /// clock) is taken over.
    fn scanned(&mut self, replica: usize, reply: Option<Reply>) {
        let Some(Reply::Records(records)) = reply else { return };
        let (now, lease) = (self.now, self.settings.lease);
        for (run, record, rev) in records {
            let r = &mut self.replicas[replica];
            if record.status != Status::Running || r.tasks.contains_key(&run) || r.taking.contains_key(&run) {
                continue;
            }
            let lapsed = match r.sightings.get(&run) {
                Some((seen, since)) if *seen == rev => now - since >= lease,
                _ => {
                    r.sightings.insert(run.clone(), (rev, now));
                    false
                }
            };
            if !lapsed {
                continue;
            }
            r.taking.insert(
                run.clone(),
                Taking {
                    seen: record.clone(),
                    rev,
                    claim_sent: now,
                    checkpoint: None,
                },
            );
            if self.rules.receiver_fence {
                self.ask_for(replica, &run, Step::TakeRaise, Op::RaiseFence(record.epoch + 1));
            } else {
                self.take_step(replica, &run, Step::TakeRaise, Some(Reply::Done));
            }
        }
    }

    fn take_step(&mut self, replica: usize, run: &str, step: Step, reply: Option<Reply>) {
        let name = self.replicas[replica].name(replica);
        let now = self.now;
        let Some(taking) = self.replicas[replica].taking.get_mut(run) else {
            return;
        };
        match (step, reply) {
            (Step::TakeRaise, Some(Reply::Done)) => {
                let claimed = Record {
                    owner: name,
                    epoch: taking.seen.epoch + 1,
                    ..taking.seen.clone()
                };
                taking.claim_sent = now;
                let rev = taking.rev;
                self.ask_for(replica, run, Step::TakeClaim, Op::UpdateRecord(claimed, rev));
            }
            (Step::TakeClaim, Some(Reply::Written(Some(rev)))) => {
                taking.rev = rev;
                let epoch = taking.seen.checkpoint_epoch;
                self.ask_for(replica, run, Step::TakeCheckpoint, Op::GetCheckpoint(epoch));
            }
            (Step::TakeCheckpoint, Some(Reply::Checkpoint(Some(cp)))) => {
                taking.checkpoint = Some(cp);
                self.ask_for(replica, run, Step::TakeLast, Op::LogLast);
            }
            (Step::TakeLast, Some(Reply::Last(last))) => self.resume_taken(replica, run, last),
            (Step::TakeEnd, Some(Reply::Written(Some(_)))) => {
                self.replicas[replica].taking.remove(run);
                self.ask_for(
                    replica,
                    run,
                    Step::TakeEnd,
                    Op::ThreadEnd(run.to_owned(), RunStatus::Completed),
                );
            }
            (Step::TakeEnd, Some(Reply::Done)) => {}
            _ => {
                self.replicas[replica].taking.remove(run);
            }
        }
    }

    /// The claimed run goes on here from its checkpoint, continuing its log from the log's true
    /// end; one whose log holds its end is stored ended.
    fn resume_taken(&mut self, replica: usize, run: &str, last: Option<(Entry, u64)>) {
        let name = self.replicas[replica].name(replica);
        let Some(taking) = self.replicas[replica].taking.remove(run) else {
            return;
        };
        let Some(cp) = taking.checkpoint.clone() else { return };
        let epoch = taking.seen.epoch + 1;
        if let Some((
            Entry {
                kind: Kind::RunFinished(turns),
                ..
            },
            _,
        )) = last
        {
            // It ended before its record said so: its end is stored, and its thread takes it.
            let ended = Record {
                owner: name,
                epoch,
                status: Status::Ended,
                checkpoint_epoch: taking.seen.checkpoint_epoch,
                turns,
            };
            let rev = taking.rev;
            self.replicas[replica].taking.insert(run.to_owned(), taking);
            return self.ask_for(replica, run, Step::TakeEnd, Op::UpdateRecord(ended, rev));
        }
        let s = &self.settings;
        let mut lease = Lease::new(s.lease, s.margin, taking.claim_sent, epoch);
        if self.rules.fence_grace {
            lease.calls_from = self.now + s.fence_grace;
        }
        let (logged_seq, log_position) = last.map_or((0, 0), |(e, position)| (e.seq, position));
        let task = Task {
            lease,
            rev: taking.rev,
            cp,
            logged_seq,
            log_position,
            shows_end: false,
            record_busy: false,
            waiting_save: None,
            write_sent: taking.claim_sent,
            checkpoint_epoch: taking.seen.checkpoint_epoch,
            ending: false,
        };
        self.replicas[replica].tasks.insert(run.to_owned(), task);
        let every = self.settings.lease / 3;
        self.wake_in(every, replica, run, epoch, Wake::Renew);
        // What the last owner numbered and saved but did not log goes to the log first.
        self.log(replica, run);
    }
}
