//! `sim`: runs the fencing simulation over many seeds, or replays one.
//!
//! ```sh
//! cargo run --release -p sim -- --seeds 5000            # seeds 0..5000, every fix on
//! cargo run --release -p sim -- --seed 41 --trace       # one seed, its whole history
//! cargo run --release -p sim -- --seeds 500 --without receiver-fence   # what breaks without it
//! cargo run --release -p sim -- --ports --seeds 200   # the services' own code over the ports
//! cargo run --release -p sim -- --ports --seed 7 --trace
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
    /// Switches a fix off (repeatable): receiver-fence, fence-grace, end-after-log, recheck-retries.
    #[arg(long = "without")]
    without: Vec<String>,
    /// Faults drawn per seed.
    #[arg(long, default_value_t = Settings::default().faults)]
    faults: usize,
    /// Runs per seed.
    #[arg(long, default_value_t = Settings::default().runs)]
    runs: usize,
    /// Simulates the services' own code (the orchestrator's `Core` over the domain ports)
    /// instead of the protocol model.
    #[arg(long)]
    ports: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.ports {
        return over_ports(&args);
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
        faults: args.faults,
        runs: args.runs,
        ..Settings::default()
    };
    let seeds = match args.seed {
        Some(seed) => seed..seed + 1,
        None => args.from..args.from.saturating_add(args.seeds),
    };
    let started = Instant::now();
    let (mut failed, mut starts) = (Vec::new(), 0usize);
    for (n, seed) in seeds.clone().enumerate() {
        let outcome = sim::simulate(seed, &settings, rules, args.trace && args.seed.is_some());
        starts += outcome.starts;
        if let Some(trace) = &outcome.trace {
            for line in trace {
                println!("{line}");
            }
        }
        if !outcome.violations.is_empty() {
            println!("seed {seed} FAILED (replay: --seed {seed}):");
            for violation in outcome.violations.iter().take(5) {
                println!("  {violation}");
            }
            failed.push(seed);
        }
        if (n + 1) % 500 == 0 {
            eprintln!("… {} seeds, {} failed, {:.1?}", n + 1, failed.len(), started.elapsed());
        }
    }
    let total = seeds.end - seeds.start;
    println!(
        "{} passed, {} failed ({total} seeds, {starts} tool calls started, {:.1?}; rules: {rules:?})",
        total - failed.len() as u64,
        failed.len(),
        started.elapsed()
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The seeds of `args` over the services' own code.
fn over_ports(args: &Args) -> ExitCode {
    let settings = sim::ports::Settings {
        faults: args.faults,
        runs: args.runs,
        ..sim::ports::Settings::default()
    };
    let seeds = match args.seed {
        Some(seed) => seed..seed + 1,
        None => args.from..args.from.saturating_add(args.seeds),
    };
    let started = Instant::now();
    let (mut failed, mut starts, mut takeovers) = (Vec::new(), 0usize, 0u64);
    for (n, seed) in seeds.clone().enumerate() {
        let outcome = sim::ports::simulate(seed, &settings);
        starts += outcome.starts;
        takeovers += outcome.takeovers;
        if args.trace && args.seed.is_some() {
            for line in &outcome.history {
                println!("{line}");
            }
        }
        if !outcome.violations.is_empty() {
            println!("seed {seed} FAILED (replay: --ports --seed {seed}):");
            for violation in outcome.violations.iter().take(5) {
                println!("  {violation}");
            }
            failed.push(seed);
        }
        if (n + 1) % 50 == 0 {
            eprintln!("… {} seeds, {} failed, {:.1?}", n + 1, failed.len(), started.elapsed());
        }
    }
    let total = seeds.end - seeds.start;
    println!(
        "over the ports: {} passed, {} failed ({total} seeds, {starts} tool calls started, {takeovers} takeovers, {:.1?})",
        total - failed.len() as u64,
        failed.len(),
        started.elapsed()
    );
    if failed.is_empty() {
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
