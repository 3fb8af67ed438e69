//! Runs: how many at once, the exit tools every run offers, how a run's stream is fed.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use shared::config::{Bound, Bounded, bound, parse_duration};

use super::{KIB, LoopDetectorSettings, MIB, OutputSettings, RequestBounds, ms, secs};
use crate::domain::chat::ToolDefinition;

/// Runs: how many at once, what every run offers, how its stream and output are watched.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Runs")]
pub struct RunSettings {
    /// Runs live at once; more get RESOURCE_EXHAUSTED (cap 100000).
    #[arg(long, env = "ORCHESTRATOR_MAX_RUNS", default_value_t = 256)]
    pub max_runs: usize,
    /// Runs that wait for a slot at once, all callers together (and each caller's, unless its
    /// max_queued in the tokens file says otherwise): a run that finds its replica full or its
    /// caller at its max_runs waits in its caller's queue until its deadline, slots going to
    /// callers by their weights; past this it gets RESOURCE_EXHAUSTED (0: none waits) (cap
    /// 1000000).
    #[arg(long, env = "ORCHESTRATOR_MAX_QUEUED_RUNS", default_value_t = 1024)]
    pub max_queued_runs: usize,
    /// Callers attached to runs at once (AttachRun streams); more get RESOURCE_EXHAUSTED (cap
    /// 100000).
    #[arg(long, env = "ORCHESTRATOR_MAX_ATTACHED", default_value_t = 1024)]
    pub max_attached: usize,
    /// Exit tool offered to every run: NAME or NAME=SCHEMA_FILE (a JSON Schema; its
    /// "description" describes the tool). Repeatable; comma-separated in the environment. Blank
    /// entries are ignored.
    #[arg(long = "exit-tool", env = "ORCHESTRATOR_EXIT_TOOLS", value_delimiter = ',', value_parser = exit_tool)]
    pub exit_tools: Vec<ToolDefinition>,
    /// Start a normal tool call as soon as its arguments are complete in the model's stream (the
    /// next call began), not at the stream's end; a request may turn it off
    /// (`eager_tool_dispatch: false`). A durable run checkpoints each such call before it leaves.
    #[arg(
        long = "eager-tool-dispatch",
        env = "ORCHESTRATOR_EAGER_TOOL_DISPATCH",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub eager_tool_dispatch: bool,
    /// Times one tool call may ask a person questions before it fails (a tool that keeps asking
    /// would hold its run forever) (cap 100).
    #[arg(long, env = "ORCHESTRATOR_MAX_INPUT_ROUNDS", default_value_t = 10)]
    pub max_input_rounds: u32,
    /// Shortest wait between two polls of a tool's task (a call its MCP server runs in the
    /// background), whatever interval the server asks for (cap 60s).
    #[arg(long, env = "ORCHESTRATOR_TASK_POLL_MIN", default_value = "500ms", value_parser = parse_duration)]
    pub task_poll_min: Duration,
    /// Longest wait between two polls of a tool's task, whatever interval the server asks for
    /// (cap 1h).
    #[arg(long, env = "ORCHESTRATOR_TASK_POLL_MAX", default_value = "30s", value_parser = parse_duration)]
    pub task_poll_max: Duration,
    /// How long a run follows its tools' tasks in place, holding its slot; past this it parks
    /// like a run waiting for approval (no slot, its checkpoint kept) and is woken for each
    /// poll on whichever replica takes it (0: parks at once) (cap 1h).
    #[arg(long, env = "ORCHESTRATOR_TASK_PARK_AFTER", default_value = "30s", value_parser = parse_duration)]
    pub task_park_after: Duration,
    /// Longest a run follows one tool's task: past it the call fails and the task is canceled,
    /// whatever the server says of it (a task `working` forever would hold the run past every
    /// deadline otherwise; the run's own deadline bounds it too) (cap 7d).
    #[arg(long, env = "ORCHESTRATOR_TASK_MAX_FOLLOW", default_value = "24h", value_parser = parse_duration)]
    pub task_max_follow: Duration,
    /// Event batches (events the loop produces together) buffered per run stream before the run
    /// waits for a slow reader (cap 65536).
    #[arg(long, env = "ORCHESTRATOR_EVENT_BUFFER", default_value_t = 64)]
    pub event_buffer: usize,
    /// Longest wait for a caller to take an event: a caller that reads nothing for this long has
    /// its stream dropped (its run is canceled unless detached), so it cannot hold a run slot
    /// (cap 10m).
    #[arg(long, env = "ORCHESTRATOR_EVENT_SEND_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub event_send_timeout: Duration,
    /// Largest text or tool result in one event sent to a caller, in bytes: longer text is split,
    /// a longer result is cut in its event and flagged (cap 3 MiB, under gRPC's usual 4 MiB
    /// receive limit).
    #[arg(long = "max-event-bytes", env = "ORCHESTRATOR_MAX_EVENT_BYTES", default_value_t = MIB)]
    pub max_caller_event_bytes: usize,
    /// Largest tool result fed back to the model, in bytes; a longer one is cut and says how much
    /// was cut (cap 16 MiB).
    #[arg(long, env = "ORCHESTRATOR_MAX_TOOL_RESULT_BYTES", default_value_t = 64 * KIB)]
    pub max_tool_result_bytes: usize,
    /// How long before the caller's gRPC deadline a run ends DEADLINE_EXCEEDED, so the caller
    /// still receives its result (cap 10s).
    #[arg(long, env = "ORCHESTRATOR_DEADLINE_HEADROOM", default_value = "200ms", value_parser = parse_duration)]
    pub deadline_headroom: Duration,
    /// How long a run gathers the model's text and reasoning into one event, reading the model's
    /// stream once per interval (0: each read's text goes at once; a model slower than the
    /// interval is read as it comes). The first delta of each turn, tool-call events and
    /// run_finished always go at once; a request may ask for its own (params.stream_interval_ms)
    /// up to --stream-interval-ceiling (cap: the ceiling).
    #[arg(long, env = "ORCHESTRATOR_STREAM_INTERVAL", default_value = "0ms", value_parser = parse_duration)]
    pub stream_interval: Duration,
    /// Longest stream interval a request may ask for (cap 1s).
    #[arg(long, env = "ORCHESTRATOR_STREAM_INTERVAL_CEILING", default_value = "200ms", value_parser = parse_duration)]
    pub stream_interval_ceiling: Duration,
    /// Normal tools whose calls wait for a person's approval in every run, besides those the
    /// tool-runners mark (`*` globs; repeatable, comma-separated in the environment). A request
    /// may add tools, never remove one.
    #[arg(long = "approval-tool", env = "ORCHESTRATOR_APPROVAL_TOOLS", value_delimiter = ',')]
    pub approval_tools: Vec<String>,
    /// TOML file of named agents that requests name (`agent`): each `[[agent]]` a model, system
    /// message, tools, exit tools, approval rules, parameters, limits and busy policy, who may
    /// use it and what a request may override. Read again when it changes (every
    /// --tls-reload-interval); a file that does not read keeps the agents (docs/agents.md).
    #[arg(long = "agents", env = "ORCHESTRATOR_AGENTS", value_name = "FILE")]
    pub agents: Option<PathBuf>,
    /// Only principals with the approver role (`roles = ["approver"]` in the tokens file) decide
    /// tool calls, so a run's owner cannot approve its own calls (four eyes). Needs
    /// --auth-tokens.
    #[arg(
        long,
        env = "ORCHESTRATOR_APPROVALS_NEED_APPROVER",
        default_value_t = false,
        action = clap::ArgAction::Set,
        num_args = 0..=1,
        default_missing_value = "true"
    )]
    pub approvals_need_approver: bool,
    /// Parked runs at once, with the in-memory store (a parked run holds no run slot, only its
    /// checkpoint in memory); a turn that would park one more has its pending approvals rejected
    /// with APPROVAL_UNAVAILABLE (cap 1000000). Formerly --max-awaiting-runs.
    #[arg(long, env = "ORCHESTRATOR_MAX_PARKED_RUNS", default_value_t = 10_000)]
    pub max_parked_runs: usize,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub output: OutputSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub request: RequestBounds,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub loop_detector: LoopDetectorSettings,
}

impl Bounded for RunSettings {
    fn bounds(&self) -> Vec<Bound> {
        let mut rows = vec![
            bound("max_runs", self.max_runs, 1usize, 100_000usize),
            bound("max_attached", self.max_attached, 1usize, 100_000usize),
            bound("max_queued_runs", self.max_queued_runs, 0usize, 1_000_000usize),
            bound("max_parked_runs", self.max_parked_runs, 1usize, 1_000_000usize),
            bound("event_buffer", self.event_buffer, 1usize, 65_536usize),
            bound("max_input_rounds", self.max_input_rounds, 1u32, 100u32),
            bound("task_poll_min", self.task_poll_min, ms(50), secs(60)),
            bound("task_poll_max", self.task_poll_max, secs(1), secs(3600)),
            bound("task_park_after", self.task_park_after, Duration::ZERO, secs(3600)),
            bound("task_max_follow", self.task_max_follow, secs(1), secs(7 * 24 * 3600)),
            bound("event_send_timeout", self.event_send_timeout, ms(10), secs(600)),
            bound("max_caller_event_bytes", self.max_caller_event_bytes, KIB, 3 * MIB),
            bound("max_tool_result_bytes", self.max_tool_result_bytes, 256usize, 16 * MIB),
            bound("deadline_headroom", self.deadline_headroom, Duration::ZERO, secs(10)),
            bound(
                "stream_interval_ceiling",
                self.stream_interval_ceiling,
                Duration::ZERO,
                secs(1),
            ),
            bound(
                "stream_interval",
                self.stream_interval,
                Duration::ZERO,
                self.stream_interval_ceiling,
            ),
        ];
        rows.extend(self.output.bounds());
        rows.extend(self.request.bounds());
        rows.extend(self.loop_detector.bounds());
        rows
    }
}

/// Parses `--exit-tool NAME[=SCHEMA_FILE]`: the schema file's `description` describes the tool.
pub(super) fn exit_tool(spec: &str) -> Result<ToolDefinition, String> {
    let (name, file) = match spec.split_once('=') {
        Some((name, file)) => (name.trim(), Some(PathBuf::from(file.trim()))),
        None => (spec.trim(), None),
    };
    let default_description = || format!("Signal {name} (one-way; nothing comes back).");
    let (description, parameters) = match file {
        None => (default_description(), serde_json::json!({"type": "object"})),
        Some(path) => {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| format!("--exit-tool {name}: cannot read {}: {e}", path.display()))?;
            let schema: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| format!("--exit-tool {name}: {} is not JSON: {e}", path.display()))?;
            let description = schema
                .get("description")
                .and_then(|d| d.as_str())
                .map_or_else(default_description, str::to_owned);
            (description, schema)
        }
    };
    Ok(ToolDefinition {
        name: name.to_owned(),
        description,
        parameters: parameters.into(),
    })
}
