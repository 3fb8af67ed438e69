//! The settings of a simulated fleet, the rules it follows (each fix can be switched off, to show
//! the history that breaks without it), and the faults a seed draws for it.

/// The fleet and its timings, in virtual milliseconds.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Orchestrator replicas.
    pub replicas: usize,
    /// Tool-runners.
    pub runners: usize,
    /// Runs admitted per seed.
    pub runs: usize,
    /// Runs share threads round-robin (one run holds a thread at a time).
    pub threads: usize,
    /// Turns per run, each with one tool call.
    pub turns: u32,
    /// `--run-store-lease`.
    pub lease: u64,
    /// `--run-store-lease-margin`.
    pub margin: u64,
    /// One store operation's timeout on a replica.
    pub store_timeout: u64,
    /// A runner's fence read timeout (`--run-store-timeout`).
    pub runner_timeout: u64,
    /// A takeover's wait before its first call (`--run-fence-grace`).
    pub fence_grace: u64,
    /// One way, store or runner: drawn from this range.
    pub latency: (u64, u64),
    /// A model turn takes this long.
    pub model: (u64, u64),
    /// A tool call takes this long.
    pub tool: (u64, u64),
    /// How often each replica looks for orphans.
    pub scan_every: u64,
    /// How often someone reads a run (GetRun).
    pub read_every: u64,
    /// Faults drawn per seed.
    pub faults: usize,
    /// Faults start before this; runs are admitted before a third of it.
    pub horizon: u64,
    /// A run not ended by then never ends.
    pub give_up: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            replicas: 3,
            runners: 2,
            runs: 6,
            threads: 3,
            turns: 4,
            lease: 3000,
            margin: 1000,
            store_timeout: 500,
            runner_timeout: 500,
            fence_grace: 600,
            latency: (1, 15),
            model: (50, 500),
            tool: (10, 400),
            scan_every: 700,
            read_every: 50,
            faults: 6,
            horizon: 40_000,
            give_up: 300_000,
        }
    }
}

/// The rules the fleet follows; [`Rules::current`] is what the services do now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// A runner reads the run's fence and refuses an older epoch's call.
    pub receiver_fence: bool,
    /// A takeover's calls wait out the fence grace.
    pub fence_grace: bool,
    /// An end shows only once logged and stored.
    pub end_after_log: bool,
    /// A call's retry is sent only while the sender still holds the run.
    pub recheck_retries: bool,
}

impl Rules {
    /// Every fix on.
    pub const fn current() -> Self {
        Self {
            receiver_fence: true,
            fence_grace: true,
            end_after_log: true,
            recheck_retries: true,
        }
    }

    /// The rules without the fix named `fix` (see [`Rules::FIXES`]).
    pub fn without(fix: &str) -> Result<Self, String> {
        let mut rules = Self::current();
        match fix {
            "receiver-fence" => rules.receiver_fence = false,
            "fence-grace" => rules.fence_grace = false,
            "end-after-log" => rules.end_after_log = false,
            "recheck-retries" => rules.recheck_retries = false,
            other => return Err(format!("no fix {other:?}; the fixes are {}", Self::FIXES.join(", "))),
        }
        Ok(rules)
    }

    /// The fixes [`Rules::without`] can switch off.
    pub const FIXES: [&str; 4] = ["receiver-fence", "fence-grace", "end-after-log", "recheck-retries"];
}

/// A fault Kubernetes produces, against one replica, the store or a runner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs, reason = "each variant's doc says what its fields are")]
pub enum Fault {
    /// Cut off from the store (not from the runners) for this long.
    Partition { replica: usize, lasts: u64 },
    /// SIGSTOP for this long: nothing of it runs while its clock does.
    Pause { replica: usize, lasts: u64 },
    /// SIGKILL, and a new process this much later.
    Crash { replica: usize, restart_after: u64 },
    /// Every answer of the store this much later, for this long.
    SlowStore { extra: u64, lasts: u64 },
    /// The store takes nothing for this long (a restart).
    StoreDown { lasts: u64 },
    /// A runner refuses connections for this long.
    RunnerLost { runner: usize, lasts: u64 },
    /// For this long, the answers to a runner's reads come this much later (a congested link).
    SlowRunnerLink { runner: usize, extra: u64, lasts: u64 },
    /// For this long, a replica's calls are held this much between its lease check and the send.
    DelayedSends { replica: usize, hold: u64, lasts: u64 },
}

/// The faults of a seed, each with when it starts.
pub fn draw(rng: &mut fastrand::Rng, settings: &Settings) -> Vec<(u64, Fault)> {
    let lease = settings.lease;
    let mut faults: Vec<(u64, Fault)> = (0..settings.faults)
        .map(|_| {
            let at = rng.u64(500..settings.horizon * 2 / 3);
            let replica = rng.usize(..settings.replicas);
            let fault = match rng.u8(..8) {
                0 => Fault::Partition {
                    replica,
                    lasts: rng.u64(lease / 2..lease * 3),
                },
                1 => Fault::Pause {
                    replica,
                    lasts: rng.u64(lease / 2..lease * 3),
                },
                2 => Fault::Crash {
                    replica,
                    restart_after: rng.u64(100..lease * 2),
                },
                3 => Fault::SlowStore {
                    extra: rng.u64(settings.store_timeout / 2..settings.store_timeout * 2),
                    lasts: rng.u64(200..lease * 2),
                },
                4 => Fault::StoreDown {
                    lasts: rng.u64(200..lease * 2),
                },
                5 => Fault::RunnerLost {
                    runner: rng.usize(..settings.runners),
                    lasts: rng.u64(200..lease * 2),
                },
                6 => Fault::SlowRunnerLink {
                    runner: rng.usize(..settings.runners),
                    extra: rng.u64(..settings.runner_timeout),
                    lasts: rng.u64(lease..lease * 4),
                },
                _ => Fault::DelayedSends {
                    replica,
                    hold: rng.u64(lease / 2..lease * 2),
                    lasts: rng.u64(lease..lease * 4),
                },
            };
            (at, fault)
        })
        .collect();
    faults.sort_by_key(|(at, _)| *at);
    faults
}
