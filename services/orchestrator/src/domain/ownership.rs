//! One replica's ownership of a durable run: the lease it holds in a shared store, measured on
//! this process's monotonic clock from the last write the store confirmed, and the stop that ends
//! its acting for the run.
//!
//! The owner never compares its clock with another machine's. A write is stamped with the
//! instant it was *sent*; once the store confirms it, the lease runs from that instant. Another
//! replica may claim the run only after it has itself seen the record unchanged for a whole lease
//! (on its own monotonic clock), and it saw that record after the write landed, so after it was
//! sent: the owner's lease, less a margin, always ends first. A paused process (SIGSTOP, a
//! throttled cgroup) finds its lease gone the moment it runs again, because the monotonic clock
//! kept going while it was stopped.
//!
//! Once stopped (expired, fenced by a refused write, a checkpoint the store did not take, or
//! handed over) the ownership stays stopped: the run acts again only through a fresh claim, which
//! makes a new ownership.
//!
//! With a store whose replicas hold their runs under an *incarnation* (one lease record per
//! process start, renewed by one keeper for all its runs), the lease is the incarnation's: every
//! run's ownership reads the same [`Liveness`], so a quiet run writes nothing to stay held, and
//! the moment the incarnation's lease runs out every run under it stops at once. The process then
//! goes on under a new incarnation (a new generation); a run claimed under an older one never
//! acts again, however the clock moves.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The lease of a shared store: how long a confirmed write holds a run, and how much of it the
/// owner leaves unused so it stops before anyone may take over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTerms {
    /// How long a write the store confirmed holds the run for its owner.
    pub length: Duration,
    /// How long before that the owner stops acting: room for a slow clock and a write in flight.
    pub margin: Duration,
    /// How long an owner in a later epoch waits, after its claim raised the run's fence, before
    /// its first tool call: a runner's fence read answered before the raise may still start its
    /// tool until the runner's read timeout is over, and this outlasts it.
    pub fence_grace: Duration,
}

impl LeaseTerms {
    /// How often an owner renews: a third of the lease, so two renewals may fail before the
    /// margin is reached with the default margin.
    pub fn renew_every(&self) -> Duration {
        self.length / 3
    }

    /// How long a confirmed write lets the owner act.
    fn acting(&self) -> Duration {
        self.length.saturating_sub(self.margin)
    }
}

/// The lease of this process's incarnation (see the module docs), shared by the ownership of
/// every run claimed under it. Cloned handles share one liveness.
#[derive(Clone, Debug)]
pub struct Liveness {
    inner: Arc<Mutex<Incarnated>>,
    /// Whether a lapse stops the runs reading this handle: always, but in the handle
    /// [`Liveness::never_lapsing`] gives.
    lapses: bool,
}

/// The incarnation the process is in now.
#[derive(Debug)]
struct Incarnated {
    /// 1 for the process's first incarnation, one more at each one after a lapse.
    generation: u64,
    /// When the renewal the store confirmed last was sent (or the incarnation began).
    confirmed: Instant,
    /// Cancelled once this generation is over: every run under it stops.
    over: CancellationToken,
}

impl Liveness {
    /// The first incarnation, its lease running from `since`.
    pub fn new(since: Instant) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Incarnated {
                generation: 1,
                confirmed: since,
                over: CancellationToken::new(),
            })),
            lapses: true,
        }
    }

    /// A handle to the same incarnation whose runs never find its lease run out nor its
    /// generation over: what a replica without self-expiry would do. No service builds one; the
    /// simulation's `--without self-expiry` does, to show what breaks.
    pub fn never_lapsing(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            lapses: false,
        }
    }

    /// The generation the process is in now.
    pub fn generation(&self) -> u64 {
        shared::sync::lock(&self.inner).generation
    }

    /// The store confirmed a renewal of `generation` sent at `sent`: its lease runs from then
    /// (never backwards; nothing once the generation is over).
    pub fn confirmed(&self, generation: u64, sent: Instant) {
        let mut now = shared::sync::lock(&self.inner);
        if now.generation == generation {
            now.confirmed = now.confirmed.max(sent);
        }
    }

    /// [`Liveness::confirmed`] for a renewal that may come back late: taken only while
    /// `generation` still acts (within `acting` of its last confirmed renewal, as
    /// [`Liveness::acts_now`] reads it). `false` when its lease ran out first: a run under it may
    /// have stopped acting then, and a lease extended now would hold that run with nothing
    /// running it, so the generation must end instead.
    pub fn confirmed_in_time(&self, generation: u64, sent: Instant, acting: Duration) -> bool {
        let mut now = shared::sync::lock(&self.inner);
        if now.generation != generation || Instant::now() >= now.confirmed + acting {
            return false;
        }
        now.confirmed = now.confirmed.max(sent);
        true
    }

    /// Whether a run of `generation` may act now, given `acting` of each lease: read under the
    /// same lock as [`Liveness::confirmed_in_time`], so a run that finds the lease run out and
    /// a renewal that comes back after it agree.
    pub fn acts_now(&self, generation: u64, acting: Duration) -> bool {
        let now = shared::sync::lock(&self.inner);
        !self.lapses || (now.generation == generation && Instant::now() < now.confirmed + acting)
    }

    /// Until when a run of `generation` may act, given `acting` of each lease: at once when the
    /// generation is over.
    pub fn acts_until(&self, generation: u64, acting: Duration) -> Instant {
        let now = shared::sync::lock(&self.inner);
        if !self.lapses {
            return Instant::now() + NEVER;
        }
        match now.generation == generation {
            true => now.confirmed + acting,
            false => Instant::now(),
        }
    }

    /// Ends the current generation (every run under it stops) and begins the next, its lease
    /// running from `since`; the new generation.
    pub fn reincarnate(&self, since: Instant) -> u64 {
        let mut now = shared::sync::lock(&self.inner);
        now.over.cancel();
        now.generation += 1;
        now.confirmed = since;
        now.over = CancellationToken::new();
        now.generation
    }

    /// Resolves once `generation` is over.
    pub async fn over(&self, generation: u64) {
        if !self.lapses {
            return std::future::pending().await;
        }
        let over = {
            let now = shared::sync::lock(&self.inner);
            match now.generation == generation {
                true => now.over.clone(),
                false => return,
            }
        };
        over.cancelled().await;
    }
}

/// How far off a lease that never lapses ends: later than any run lasts.
const NEVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// Why an owner stopped acting for a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// Less than the margin was left of its lease.
    Expired,
    /// The store refused a write, or a tool-runner a call: another replica holds the run.
    Fenced(String),
    /// A checkpoint the store did not take: the run resumes from the last good one.
    Unsaved(String),
    /// Released at a drain.
    HandedOver,
}

impl Stop {
    /// The label of the stop in the `runs_moved` metric.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Expired => "expired",
            Self::Fenced(_) => "fenced",
            Self::Unsaved(_) => "unsaved",
            Self::HandedOver => "handed_over",
        }
    }
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Expired => f.write_str("its lease ran out before the store confirmed a renewal"),
            Self::Fenced(why) => write!(f, "another replica holds the run ({why})"),
            Self::Unsaved(why) => write!(f, "the store did not take its checkpoint ({why})"),
            Self::HandedOver => f.write_str("it was handed over at a drain"),
        }
    }
}

/// See the module docs. Cloned handles share one ownership.
#[derive(Clone)]
pub struct Ownership {
    inner: Arc<Inner>,
}

struct Inner {
    /// `None`: a store no other replica reads; the run is never taken from this replica.
    terms: Option<LeaseTerms>,
    /// The incarnation whose lease holds the run (`None`: the run's own writes renew it).
    liveness: Option<Liveness>,
    /// The generation of the incarnation the run's record names (set with its claim).
    generation: AtomicU64,
    /// When the write the store confirmed last was sent (or the claim, before any answer).
    confirmed: Mutex<Instant>,
    stop: CancellationToken,
    why: OnceLock<Stop>,
    /// The claim's number: a tool with side effects refuses an older one.
    epoch: AtomicU64,
    /// No tool call leaves before then (a claim in a later epoch: see [`LeaseTerms::fence_grace`]).
    calls_from: Mutex<Option<Instant>>,
    /// The run's final result is stored: no replica takes the run over any more, so what is
    /// left of its event log may still go out once the lease ran out.
    ended: std::sync::atomic::AtomicBool,
    /// The run is leaving its slot for the approval store (parking, or parked): a cancel then
    /// waits for the park instead of cutting it short, which would leave the run's record and
    /// its log apart.
    parking: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Ownership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ownership")
            .field("terms", &self.inner.terms)
            .field("epoch", &self.epoch())
            .field("stopped", &self.inner.why.get())
            .finish()
    }
}

impl Ownership {
    /// An ownership whose lease runs from `since` (the instant its claim was sent); `None` terms:
    /// a store of this replica only.
    pub fn new(terms: Option<LeaseTerms>, since: Instant) -> Self {
        Self::held_by(terms, None, since)
    }

    /// An ownership held by `liveness` (an incarnation's lease) when there is one, by its own
    /// writes from `since` otherwise.
    pub fn held_by(terms: Option<LeaseTerms>, liveness: Option<Liveness>, since: Instant) -> Self {
        let generation = liveness.as_ref().map_or(0, Liveness::generation);
        Self {
            inner: Arc::new(Inner {
                terms,
                liveness,
                generation: AtomicU64::new(generation),
                confirmed: Mutex::new(since),
                stop: CancellationToken::new(),
                why: OnceLock::new(),
                epoch: AtomicU64::new(0),
                calls_from: Mutex::new(None),
                ended: std::sync::atomic::AtomicBool::new(false),
                parking: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    /// An ownership that never lapses (a store no other replica reads).
    pub fn local() -> Self {
        Self::new(None, Instant::now())
    }

    /// The store granted the claim sent at `since`: the lease runs from then.
    pub fn begin(&self, since: Instant) {
        *shared::sync::lock(&self.inner.confirmed) = since;
    }

    /// The store confirmed a write sent at `sent`: the lease runs from then (never backwards).
    pub fn confirmed(&self, sent: Instant) {
        let mut confirmed = shared::sync::lock(&self.inner.confirmed);
        *confirmed = (*confirmed).max(sent);
    }

    /// The run's record names the incarnation of `generation` (its claim's).
    pub fn set_generation(&self, generation: u64) {
        self.inner.generation.store(generation, Ordering::Release);
    }

    /// Until when the owner may act, on this process's clock (`None`: always).
    pub fn acts_until(&self) -> Option<Instant> {
        let terms = self.inner.terms?;
        if let Some(liveness) = &self.inner.liveness {
            let generation = self.inner.generation.load(Ordering::Acquire);
            return Some(liveness.acts_until(generation, terms.acting()));
        }
        Some(*shared::sync::lock(&self.inner.confirmed) + terms.acting())
    }

    /// Whether this replica may act for the run now: not stopped and within its lease less the
    /// margin. A lease found run out stops the ownership here.
    pub fn holds(&self) -> bool {
        if self.stopped() {
            return false;
        }
        if let (Some(terms), Some(liveness)) = (self.inner.terms, &self.inner.liveness) {
            let generation = self.inner.generation.load(Ordering::Acquire);
            if liveness.acts_now(generation, terms.acting()) {
                return true;
            }
            self.stop(Stop::Expired);
            return false;
        }
        match self.acts_until() {
            Some(until) if Instant::now() >= until => {
                self.stop(Stop::Expired);
                false
            }
            _ => true,
        }
    }

    /// The run's final result is stored (see [`Ownership::may_log`]).
    pub fn end(&self) {
        self.inner.ended.store(true, Ordering::Release);
    }

    /// Whether the run's final result is stored (see [`Ownership::end`]).
    pub fn ended(&self) -> bool {
        self.inner.ended.load(Ordering::Acquire)
    }

    /// The run starts leaving its slot for the approval store (`true`), or stays after all
    /// (`false`: the park did not take).
    pub fn set_parking(&self, parking: bool) {
        self.inner.parking.store(parking, Ordering::Release);
    }

    /// Whether the run is parking, or parked (see [`Ownership::set_parking`]).
    pub fn parking(&self) -> bool {
        self.inner.parking.load(Ordering::Acquire)
    }

    /// Whether the run's events (and writes) may still leave from here: while this replica
    /// acts for the run, and after the run ended here (its final result stored: nobody takes it
    /// over, so its last events, `run_finished` among them, must reach the log however late;
    /// the log's own fence still refuses them out of turn).
    pub fn may_log(&self) -> bool {
        self.ended() || self.holds()
    }

    /// Stops acting for the run (the first reason given is kept).
    pub fn stop(&self, why: Stop) {
        if self.inner.why.set(why).is_ok()
            && let Some(why) = self.inner.why.get()
        {
            tracing::warn!("this replica stops acting for the run: {why}");
        }
        self.inner.stop.cancel();
    }

    /// Whether the ownership stopped.
    pub fn stopped(&self) -> bool {
        self.inner.stop.is_cancelled()
    }

    /// Why it stopped, once it did.
    pub fn why(&self) -> Option<&Stop> {
        self.inner.why.get()
    }

    /// Resolves once the ownership stopped.
    pub async fn lost(&self) {
        self.inner.stop.cancelled().await;
    }

    /// Stops the ownership when its lease runs out unrenewed: resolves once it stopped, for
    /// whatever reason. The timer is looked at again after each wake, so a process paused past
    /// its lease stops as soon as it runs.
    pub async fn expire(&self) {
        if let Some(liveness) = self.inner.liveness.as_ref().filter(|_| self.inner.terms.is_some()) {
            // The keeper ends the generation when its lease ran out; nothing wakes meanwhile.
            let generation = self.inner.generation.load(Ordering::Acquire);
            tokio::select! {
                biased;
                () = self.lost() => return,
                () = liveness.over(generation) => {}
            }
            self.stop(Stop::Expired);
            return;
        }
        loop {
            let Some(until) = self.acts_until() else {
                return self.lost().await;
            };
            tokio::select! {
                biased;
                () = self.lost() => return,
                () = tokio::time::sleep_until(until) => {
                    if !self.holds() {
                        return;
                    }
                }
            }
        }
    }

    /// The claim's number (0 before the store gave one).
    pub fn epoch(&self) -> u64 {
        self.inner.epoch.load(Ordering::Acquire)
    }

    /// Sets the claim's number the store gave. A claim after the first (a takeover) raised the
    /// run's fence just now: this owner's tool calls wait out the fence grace from here.
    pub fn set_epoch(&self, epoch: u64) {
        self.inner.epoch.store(epoch, Ordering::Release);
        if let Some(terms) = self.inner.terms.filter(|_| epoch > 1) {
            *shared::sync::lock(&self.inner.calls_from) = Some(Instant::now() + terms.fence_grace);
        }
    }

    /// Waits until this owner may send tool calls (at once, unless its claim raised the fence
    /// less than the fence grace ago).
    pub async fn calls_allowed(&self) {
        let from = *shared::sync::lock(&self.inner.calls_from);
        if let Some(from) = from {
            tokio::time::sleep_until(from).await;
        }
    }
}

/// What a durable run's record says of who acts for it, as the orphan rule reads it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Holding {
    /// A replica holds the run (live, not parked).
    pub held: bool,
    /// A checkpoint lets another replica go on with it.
    pub resumable: bool,
    /// Its replica drained and let it go.
    pub handed_over: bool,
    /// It is parked in the approval store.
    pub parked: bool,
    /// Parked, and decided or canceled: it goes on now.
    pub ready: bool,
    /// Parked: when it goes on undecided (an expiry, a task's poll, its deadline).
    pub wake_at_unix_ms: u64,
}

impl Holding {
    /// Whether any replica may take the run over at `now_unix_ms`: its owner is gone (its
    /// record `lapsed`, seen unchanged for a lease; or handed over) while it may be resumed, or
    /// it is parked and due (ready, or its wake time passed).
    pub fn orphaned(&self, now_unix_ms: u64, lapsed: bool) -> bool {
        let lost_owner = self.held && self.resumable && (self.handed_over || lapsed);
        lost_owner || (self.parked && (self.ready || self.wake_at_unix_ms <= now_unix_ms))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{LeaseTerms, Ownership, Stop};

    fn terms() -> Option<LeaseTerms> {
        Some(LeaseTerms {
            length: Duration::from_secs(3),
            margin: Duration::from_secs(1),
            fence_grace: Duration::from_secs(2),
        })
    }

    /// The owner acts for the lease less the margin after the send of its last confirmed write,
    /// and not a moment longer; a later confirmation moves the end on, an older one does not.
    #[tokio::test(start_paused = true)]
    async fn an_owner_acts_until_its_lease_less_the_margin_from_its_last_confirmed_send() {
        let start = Instant::now();
        let owner = Ownership::new(terms(), start);
        tokio::time::advance(Duration::from_millis(1900)).await;
        assert!(owner.holds());
        owner.confirmed(start + Duration::from_millis(1500));
        owner.confirmed(start);
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert!(owner.holds(), "3.4 s in, the lease runs from 1.5 s");
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(!owner.holds(), "3.5 s: 1.5 + 3 - 1");
        assert_eq!(owner.why(), Some(&Stop::Expired));
        owner.confirmed(Instant::now());
        assert!(!owner.holds(), "stopped stays stopped");
    }

    /// A renewal of an incarnation that comes back after its lease ran out is not taken: a run
    /// under it that found the lease run out has stopped, and the generation must end rather
    /// than hold that run with nothing running it. One back in time is taken.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_back_after_the_lease_ran_out_is_not_taken() {
        let acting = Duration::from_secs(2);
        let start = Instant::now();
        let liveness = super::Liveness::new(start);
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert!(liveness.confirmed_in_time(1, start + Duration::from_secs(1), acting));
        assert!(liveness.acts_now(1, acting), "2.5 s in, the lease runs from 1 s");
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert!(!liveness.acts_now(1, acting), "3 s: 1 + 2");
        let late = liveness.confirmed_in_time(1, start + Duration::from_millis(2500), acting);
        assert!(!late, "sent in time, back too late");
        assert!(!liveness.acts_now(1, acting), "the lease stays run out");
        assert!(
            !liveness.confirmed_in_time(7, Instant::now(), acting),
            "another generation"
        );
    }

    /// The expiry resolves when the lease runs out without a renewal, even when the process
    /// slept through it, and not while renewals come.
    #[tokio::test(start_paused = true)]
    async fn expiry_fires_once_renewals_stop() {
        let owner = Ownership::new(terms(), Instant::now());
        let watch = shared::tasks::spawn({
            let owner = owner.clone();
            async move { owner.expire().await }
        });
        for _ in 0..5 {
            tokio::time::advance(Duration::from_secs(1)).await;
            owner.confirmed(Instant::now());
            tokio::task::yield_now().await;
            assert!(!watch.is_finished());
        }
        tokio::time::advance(Duration::from_millis(2100)).await;
        tokio::time::timeout(Duration::from_secs(1), watch)
            .await
            .unwrap()
            .unwrap();
        assert!(owner.stopped());
    }

    /// A run that ended here may still append its last events to its log after the lease ran
    /// out (nobody takes an ended run over); one that did not end may not.
    #[tokio::test(start_paused = true)]
    async fn an_ended_run_may_still_log_past_its_lease() {
        let (ended, live) = (
            Ownership::new(terms(), Instant::now()),
            Ownership::new(terms(), Instant::now()),
        );
        ended.end();
        assert!(ended.may_log() && live.may_log());
        tokio::time::advance(std::time::Duration::from_secs(5)).await;
        assert!(!live.may_log() && !live.holds());
        assert!(ended.may_log() && !ended.holds());
    }

    /// An owner whose claim is a takeover (epoch 2 on) sends no call before the fence grace is
    /// over; the first owner, and a local one, send at once.
    #[tokio::test(start_paused = true)]
    async fn a_takeovers_calls_wait_out_the_fence_grace() {
        let first = Ownership::new(terms(), Instant::now());
        first.set_epoch(1);
        let taker = Ownership::new(terms(), Instant::now());
        taker.set_epoch(2);
        let start = Instant::now();
        first.calls_allowed().await;
        Ownership::local().calls_allowed().await;
        assert_eq!(start.elapsed(), Duration::ZERO);
        taker.calls_allowed().await;
        assert_eq!(start.elapsed(), Duration::from_secs(2));
    }

    /// The first reason is kept; a local ownership never lapses.
    #[tokio::test(start_paused = true)]
    async fn the_first_stop_is_kept_and_a_local_ownership_never_lapses() {
        let owner = Ownership::new(terms(), Instant::now());
        owner.stop(Stop::Fenced("taken".into()));
        owner.stop(Stop::Expired);
        assert_eq!(owner.why().map(Stop::label), Some("fenced"));
        let local = Ownership::local();
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(local.holds());
    }

    /// Runs held by an incarnation act as long as its renewals land (their own writes count for
    /// nothing), and all of them stop at once when the incarnation is over; one claimed under
    /// the next generation acts on, and one whose record names an older one never acts again.
    #[tokio::test(start_paused = true)]
    async fn every_run_of_an_incarnation_stops_with_it_and_none_of_an_older_one_acts() {
        let liveness = super::Liveness::new(Instant::now());
        let held = |generation| {
            let owner = Ownership::held_by(terms(), Some(liveness.clone()), Instant::now());
            owner.set_generation(generation);
            owner
        };
        let (a, b) = (held(1), held(1));
        tokio::time::advance(Duration::from_millis(1900)).await;
        liveness.confirmed(1, Instant::now());
        a.confirmed(Instant::now());
        tokio::time::advance(Duration::from_millis(1900)).await;
        assert!(a.holds() && b.holds(), "the incarnation's renewal holds both");
        let expired = shared::tasks::spawn({
            let b = b.clone();
            async move { b.expire().await }
        });
        let next = liveness.reincarnate(Instant::now());
        assert_eq!(next, 2);
        let _ = expired.await;
        assert_eq!(b.why().map(Stop::label), Some("expired"));
        assert!(!a.holds(), "a run of the generation over never acts again");
        let c = held(next);
        assert!(c.holds());
        liveness.confirmed(1, Instant::now() + Duration::from_secs(60));
        assert!(!held(1).holds(), "a renewal of an older generation moves nothing");
        tokio::time::advance(Duration::from_millis(2100)).await;
        assert!(!c.holds(), "unrenewed, the new generation lapses too");
    }
}
