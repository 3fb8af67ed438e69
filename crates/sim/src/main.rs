//! `sim`: runs the fencing simulation over many seeds, or replays one.
//!
//! ```sh
//! cargo run --release -p sim -- --seeds 5000            # seeds 0..5000, every fix on
//! cargo run --release -p sim -- --seed 41 --trace       # one seed, its whole history
//! cargo run --release -p sim -- --seeds 500 --without receiver-fence   # what breaks without it
//! cargo run --release -p sim -- --ports --seeds 200   # the services' own code, real adapters
//! cargo run --release -p sim -- --ports --seed 7 --trace
//! cargo run --release -p sim -- --ports --quiet --runs 2000 --seeds 3   # a crash among quiet runs
//! ```
//!
//! A failing seed prints itself with what it broke; it replays the same history with `--seed`.

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use sim::plan::{Rules, Settings};

#[derive(Parser)]
#[command(
    name = "sim",
    about = "Seeded simulation of the run fencing protocol under Kubernetes faults"
)]
struct Args {
    /// How many seeds to run, from --from.
    #[arg(long, default_value_t = 200)]
    seeds: u64,
    /// The first seed.
    #[arg(long, default_value_t = 0)]
    from: u64,
    /// Replays this one seed (overrides --seeds and --from).
    #[arg(long)]
    seed: Option<u64>,
    /// Prints the seed's every event (with --seed).
    #[arg(long)]
    trace: bool,
    /// Switches a fix off (repeatable): receiver-fence, fence-grace, end-after-log, recheck-retries
    /// (with --ports: receiver-fence, fleet-slots, task-handles, parked-claims,
    /// answer-rounds, outcome-records, self-expiry).
    #[arg(long = "without")]
    without: Vec<String>,
    /// Faults drawn per seed (the protocol model: 6; with --ports: 8, as CI draws them).
    #[arg(long)]
    faults: Option<usize>,
    /// Runs per seed (the protocol model: 6; with --ports: 4, as CI runs them).
    #[arg(long)]
    runs: Option<usize>,
    /// Simulates the services' own code (the orchestrator's `Core` on the real NATS adapters
    /// over the simulated JetStream, the runners with the tool-runner's fence reader) instead
    /// of the protocol model.
    #[arg(long)]
    ports: bool,
    /// With --ports: cancels a caller asks for per seed (of random runs, on random replicas, at
    /// once or after the turn).
    #[arg(long, requires = "ports", default_value_t = 0)]
    cancels: usize,
    /// With --ports: messages a caller sends to runs per seed (`SendMessage`, to random runs on
    /// random replicas; default as CI sends them).
    #[arg(long, requires = "ports")]
    messages: Option<usize>,
    /// With --ports: the run store spread over this many shards (1–64).
    #[arg(long, requires = "ports", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    shards: u64,
    /// With --ports: quiet runs (each waits on one long call, then ends) and one replica killed
    /// while they wait; with --runs in the thousands, what a crash costs at scale.
    #[arg(long, requires = "ports")]
    quiet: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    // `SIM_LOG=info` (an env filter) prints the services' own log lines of a replayed seed.
    if let Ok(filter) = std::env::var("SIM_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .without_time()
            .init();
    }
    if args.ports {
        return match ports_settings(&args) {
            Ok(settings) => over_ports(&args, &settings),
            Err(e) => {
                eprintln!("sim: {e}");
                ExitCode::from(2)
            }
        };
    }
    let mut rules = Rules::current();
    for fix in &args.without {
        match Rules::without(fix) {
            Ok(without) => rules = merge(rules, without),
            Err(e) => {
                eprintln!("sim: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let settings = Settings {
        faults: args.faults.unwrap_or(Settings::default().faults),
        runs: args.runs.unwrap_or(Settings::default().runs),
        ..Settings::default()
    };
    let trace = args.trace && args.seed.is_some();
    let replay = |seed| model_replay(&args, settings.runs, settings.faults, seed);
    let report = run_seeds(&args, replay, |seed| {
        let outcome = sim::simulate(seed, &settings, rules, trace);
        let mut seen = Seen::new(outcome.violations, outcome.starts, None);
        seen.trace = outcome.trace.unwrap_or_default();
        seen
    });
    println!("{report}; rules: {rules:?}");
    exit_code(&report)
}

/// The settings `args` asks of the simulation over the services' own code.
fn ports_settings(args: &Args) -> Result<sim::ports::Settings, String> {
    let defaults = sim::ports::Settings::default();
    let settings = sim::ports::Settings {
        faults: args.faults.unwrap_or(defaults.faults),
        runs: args.runs.unwrap_or(defaults.runs),
        cancels: args.cancels,
        messages: args.messages.unwrap_or(defaults.messages),
        shards: usize::try_from(args.shards).map_err(|e| e.to_string())?,
        quiet: args.quiet,
        ..defaults
    };
    args.without
        .iter()
        .try_fold(settings, |settings, fix| settings.without(fix))
}

/// The seeds of `args` over the services' own code.
fn over_ports(args: &Args, settings: &sim::ports::Settings) -> ExitCode {
    let trace = args.trace && args.seed.is_some();
    let report = run_seeds(
        args,
        |seed| settings.replay(seed),
        |seed| {
            let outcome = sim::ports::simulate(seed, settings);
            let mut seen = Seen::new(outcome.violations, outcome.starts, Some(outcome.takeovers));
            seen.died = (outcome.died, outcome.in_doubt);
            if trace {
                seen.trace = outcome.history;
            }
            seen
        },
    );
    println!("over the ports: {report}");
    exit_code(&report)
}

/// What one seed showed.
struct Seen {
    violations: Vec<String>,
    starts: usize,
    /// Takeovers, where the simulation counts them.
    takeovers: Option<u64>,
    /// Its history, when asked for.
    trace: Vec<String>,
    /// Calls that died with their runner, and calls found in doubt.
    died: (usize, usize),
}

impl Seen {
    fn new(violations: Vec<String>, starts: usize, takeovers: Option<u64>) -> Self {
        Self {
            violations,
            starts,
            takeovers,
            trace: Vec::new(),
            died: (0, 0),
        }
    }
}

/// What the seeds of a run showed, as its last line says.
struct Report {
    total: u64,
    failed: Vec<u64>,
    starts: usize,
    takeovers: Option<u64>,
    /// Calls that died with their runner, and calls found in doubt.
    died: (usize, usize),
    took: std::time::Duration,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} passed, {} failed ({} seeds, {} tool calls started",
            self.total - self.failed.len() as u64,
            self.failed.len(),
            self.total,
            self.starts,
        )?;
        if let Some(takeovers) = self.takeovers {
            write!(f, ", {takeovers} takeovers")?;
        }
        if self.died != (0, 0) {
            write!(
                f,
                ", {} calls died with their runner, {} found in doubt",
                self.died.0, self.died.1
            )?;
        }
        write!(f, ", {:.1?})", self.took)
    }
}

/// The command that replays `seed` of the protocol model as `args` ran it: its runs and faults,
/// and every fix switched off.
fn model_replay(args: &Args, runs: usize, faults: usize, seed: u64) -> String {
    let mut command = format!("cargo run --release -p sim -- --runs {runs} --faults {faults} ");
    for fix in &args.without {
        command.push_str(&format!("--without {fix} "));
    }
    command.push_str(&format!("--seed {seed} --trace"));
    command
}

/// Runs the seeds `args` names through `simulate`, printing each failing seed (and a seed's
/// history when asked for) and progress every 500 seeds.
fn run_seeds(args: &Args, replay: impl Fn(u64) -> String, simulate: impl Fn(u64) -> Seen) -> Report {
    let seeds = match args.seed {
        Some(seed) => seed..seed + 1,
        None => args.from..args.from.saturating_add(args.seeds),
    };
    let started = Instant::now();
    let mut report = Report {
        total: seeds.end - seeds.start,
        failed: Vec::new(),
        starts: 0,
        takeovers: None,
        died: (0, 0),
        took: std::time::Duration::ZERO,
    };
    for (n, seed) in seeds.enumerate() {
        let seen = simulate(seed);
        report.starts += seen.starts;
        report.died = (report.died.0 + seen.died.0, report.died.1 + seen.died.1);
        if let Some(takeovers) = seen.takeovers {
            report.takeovers = Some(report.takeovers.unwrap_or(0) + takeovers);
        }
        for line in &seen.trace {
            println!("{line}");
        }
        if !seen.violations.is_empty() {
            println!("seed {seed} FAILED (replay: {}):", replay(seed));
            for violation in seen.violations.iter().take(5) {
                println!("  {violation}");
            }
            report.failed.push(seed);
        }
        if (n + 1) % 500 == 0 {
            eprintln!(
                "… {} seeds, {} failed, {:.1?}",
                n + 1,
                report.failed.len(),
                started.elapsed()
            );
        }
    }
    report.took = started.elapsed();
    report
}

fn exit_code(report: &Report) -> ExitCode {
    if report.failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The rules with every fix off that either has off.
fn merge(a: Rules, b: Rules) -> Rules {
    Rules {
        receiver_fence: a.receiver_fence && b.receiver_fence,
        fence_grace: a.fence_grace && b.fence_grace,
        end_after_log: a.end_after_log && b.end_after_log,
        recheck_retries: a.recheck_retries && b.recheck_retries,
    }
}
