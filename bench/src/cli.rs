//! The command line: the grid by default, or the one measurement a flag asks for.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// Benchmark of the orchestrator.
#[derive(Parser)]
#[command(name = "bench", about)]
pub(crate) struct Cli {
    /// A small grid that runs in seconds (CI); the full grid otherwise.
    #[arg(long)]
    pub(crate) quick: bool,
    /// The orchestrator binary (default: next to this binary).
    #[arg(long)]
    pub(crate) orchestrator_bin: Option<PathBuf>,
    /// Where the report goes.
    #[arg(long, default_value = "bench/results")]
    pub(crate) out: PathBuf,
    /// Only these workloads (comma-separated names, the real-server row's among them); the report
    /// is then written as `partial.*`.
    #[arg(long, value_delimiter = ',')]
    pub(crate) only: Vec<String>,
    /// The real-server row (`llama_server_text`: the same prompt through the orchestrator and
    /// directly to llama-server): `auto` runs it when `./scripts/model-servers` has installed
    /// llama-server and says why not otherwise, `require` fails without it, `skip` never runs it.
    #[arg(long, value_enum, default_value_t = RealServerMode::Auto)]
    pub(crate) real_server: RealServerMode,
    /// Skip the tracing comparison (the same workloads with OTLP export off and on).
    #[arg(long)]
    pub(crate) no_tracing: bool,
    /// Skip the durability comparison (the same workloads with the memory and the NATS store).
    #[arg(long)]
    pub(crate) no_durability: bool,
    /// Run each workload this many times (1–9) and report the run with the median CPU per turn,
    /// with the range seen: on a shared machine one run can be 30 % off.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=9))]
    pub(crate) repeat: u32,
    /// Instead of the grid: a soak of this many runs (1–10000000) with faults injected, checked
    /// run by run (see `--soak-fault-rate`); writes `soak.md` / `soak.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub(crate) soak: Option<u64>,
    /// Share of the soak's runs that get a fault (0–1).
    #[arg(long, default_value_t = 0.05)]
    pub(crate) soak_fault_rate: f64,
    /// The soak's result store: `memory`, or `nats` (a `nats-server -js` the benchmark starts; the
    /// results in its key-value bucket and every run's events in its JetStream event log).
    #[arg(long, value_parser = ["memory", "nats"], default_value = "memory")]
    pub(crate) soak_store: String,
    /// With `--soak-store nats`: the run store spread over this many shards
    /// (`--run-store-shards`, 1–64).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub(crate) soak_shards: u64,
    /// Soak runs at once (1–10000).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub(crate) soak_concurrency: u64,
    /// With `--soak-store nats`: run the soak on three replicas and, every this long (e.g. `3s`),
    /// one of them in turn is killed, drained, cut off from NATS or paused (SIGSTOP) for three
    /// seconds, in that order (a killed or drained one is replaced), while callers follow their
    /// runs across replicas.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub(crate) soak_replica_faults: Option<Duration>,
    /// Instead of the grid: the paced relay (one turn of streamed text at each stream interval;
    /// CPU and wake-ups per token, time to first token); writes `paced.md` / `paced.json`.
    #[arg(long)]
    pub(crate) paced: bool,
    /// The paced relay with its peers on the same stand-in model in the same run (so far the
    /// LiteLLM proxy, from the test cache), each figure as a ratio to theirs.
    #[arg(long)]
    pub(crate) peers: bool,
    /// Instead of the grid: the model's time on two real llama-servers, sticky against round
    /// robin, and the transcript's prefix replayed with and without the per-turn BIOS line;
    /// writes `fleet.md` / `fleet.json` (needs `./scripts/model-servers`).
    #[arg(long)]
    pub(crate) fleet: bool,
    /// Instead of the grid: this many runs (1–100000) parked waiting for approvals at once on 16
    /// run slots, with the memory and the NATS store: RSS per parked run, then every call
    /// approved; writes `approvals.md` / `approvals.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub(crate) approvals: Option<u64>,
    /// Instead of the grid: this many runs (1–10000) each waiting on a task its MCP server runs
    /// (the tests' FastMCP server, installed by ./scripts/mcp-servers), parked on 16 run slots:
    /// RSS per parked run, then every run completed; writes `tasks.md` / `tasks.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub(crate) tasks: Option<u64>,
    /// Instead of the grid: this many `RunTool` calls (100–1000000) to a runner without and with
    /// the run fence (a NATS on loopback, `nats-server` on the PATH), beside one bare key-value
    /// read; writes `fence.md` / `fence.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(100..=1_000_000))]
    pub(crate) fence: Option<u64>,
    /// Instead of the grid: this many ended runs (100–1000000) stored in a NATS (`nats-server`
    /// on the PATH), then the latency of `ListRuns` pages of 50 for several queries beside one
    /// `GetRun`; writes `list_runs.md` / `list_runs.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(100..=1_000_000))]
    pub(crate) list_runs: Option<u64>,
    /// Instead of the grid: this many one-turn runs (10–100000) one after the other with the
    /// memory and the NATS store, by a caller without and with a max_runs: admission time and
    /// CPU per run; writes `admission.md` / `admission.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(10..=100_000))]
    pub(crate) admission: Option<u64>,
    /// Instead of the grid: this many waits of other principals (10–100000) parked in a NATS
    /// (`nats-server` on the PATH) beside one of alice's, then the store messages and time of
    /// her `ListPendingApprovals` beside an approver's; writes `pending_approvals.md` / `.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(10..=100_000))]
    pub(crate) pending_approvals: Option<u64>,
    /// Instead of the grid: for each of these counts of durable runs (1–100000 each), every run
    /// waiting on a long tool call on one replica and one nats-server (on the PATH): the store's
    /// messages, the orchestrator's CPU and RSS per quiet run per second over `--idle-window`;
    /// fails above 0.01 store requests per quiet run per second. Writes `idle_cost.md` / `.json`.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub(crate) idle_cost: Vec<u64>,
    /// The quiet window `--idle-cost` measures (1s–10m).
    #[arg(long, default_value = "20s", value_parser = one_second_to_ten_minutes)]
    pub(crate) idle_window: Duration,
    /// Instead of the grid: this many durable runs (10–100000) waiting on a long tool call on
    /// one replica of two sharing one nats-server (on the PATH); that replica SIGKILLed, the
    /// time until the other runs every one again and the store requests per run taken over.
    /// Writes `takeover.md` / `.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(10..=100_000))]
    pub(crate) takeover_quiet: Option<u64>,
    /// Instead of the grid: one run of this many turns (13–128), each reading a page of
    /// `--long-run-page` bytes, on the memory store and on NATS (nats-server on the PATH): the
    /// orchestrator's CPU and the store's bytes per turn, early against late. Writes
    /// `long_run.md` / `.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(13..=128))]
    pub(crate) long_run: Option<u64>,
    /// The page `--long-run` reads each turn, in bytes (1–1048576).
    #[arg(long, default_value_t = 16_384, value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    pub(crate) long_run_page: u64,
    /// The run-store lease of `--takeover-quiet`'s replicas (1s–10m; the orchestrator's default).
    #[arg(long, default_value = "15s", value_parser = one_second_to_ten_minutes)]
    pub(crate) takeover_lease: Duration,
    /// Instead of the grid: the same durable workload with the run store in each of these
    /// numbers of shards (1–64, e.g. `1,4`), each on fresh JetStream clusters of three and six
    /// nodes (nats-server on the PATH): turns per second and every node's CPU per turn. Writes
    /// `shards.md` / `.json`.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..=64))]
    pub(crate) shards: Vec<u64>,
    /// Runs of each `--shards` count (8 turns each; 10–100000).
    #[arg(long, default_value_t = 400, value_parser = clap::value_parser!(u64).range(10..=100_000))]
    pub(crate) shard_runs: u64,
}

/// A duration of 1s to 10m (a window or a lease of the bench).
pub(crate) fn one_second_to_ten_minutes(s: &str) -> Result<Duration, String> {
    let window = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    match (Duration::from_secs(1)..=Duration::from_secs(600)).contains(&window) {
        true => Ok(window),
        false => Err(format!("{s}: between 1s and 10m")),
    }
}

/// Whether the real-server row runs.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum RealServerMode {
    Auto,
    Require,
    Skip,
}
