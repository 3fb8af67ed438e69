//! What a run is asked to do, validated: its conversation, tools, limits and deadline, and the
//! plain limits the loop applies to what the model produces.

use std::collections::BTreeMap;
use std::time::Duration;

use super::chat::{Message, ToolDefinition};
use super::params::SamplingParams;

/// Hard limit on turns, whatever the configuration says.
pub const HARD_MAX_TURNS: u32 = 128;

/// What to do with a call naming an unknown tool or with non-object arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum ParsePolicy {
    /// End the run `TOOL_PARSE_ERROR`.
    #[default]
    Fail,
    /// Answer each bad call with an error tool message; it counts as a failed call of the turn.
    FeedBack,
}

/// The limits a run runs with (defaults applied, maxima checked).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Limits {
    /// Most turns.
    pub max_turns: u32,
    /// Normal tool calls the run may execute.
    pub tool_call_budget: u32,
    /// Failing turns tolerated; one more ends the run.
    pub max_tool_failures: u32,
    /// Timeout of one tool call.
    pub tool_timeout: Duration,
    /// Deadline of the whole run.
    pub run_timeout: Duration,
    /// How long a call may wait for approval.
    #[serde(default)]
    pub approval_timeout: Duration,
    /// Tokens (prompt and completion, over every turn) the run may spend; the turn that goes
    /// over it is its last.
    #[serde(default = "no_token_budget")]
    pub max_total_tokens: u64,
    /// How long a tool's questions wait for answers (each is answered `cancel` past it).
    #[serde(default = "an_hour")]
    pub input_timeout: Duration,
}

/// The answer wait of a run checkpointed before it had one.
fn an_hour() -> Duration {
    Duration::from_secs(3600)
}

/// The token budget of a run checkpointed before budgets existed: none.
fn no_token_budget() -> u64 {
    u64::MAX
}

impl Limits {
    /// The tokens the run may still spend after spending `used` (0: none, the run is over it).
    pub fn tokens_left(&self, used: &super::chat::Usage) -> u64 {
        self.max_total_tokens
            .saturating_sub(used.prompt_tokens.saturating_add(used.completion_tokens))
    }
}

/// Everything one run needs, validated.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RunSpec {
    /// The run's id.
    pub run_id: String,
    /// The caller's system message (after the BIOS).
    pub system: String,
    /// The caller's conversation.
    pub messages: Vec<Message>,
    /// Model name.
    pub model: String,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// Normal tools offered (executed on tool-runners).
    pub normal_tools: Vec<ToolDefinition>,
    /// Exit tools offered (signals).
    pub exit_tools: Vec<ToolDefinition>,
    /// Limits.
    pub limits: Limits,
    /// Caller metadata, passed to tool-runners and signals.
    pub metadata: BTreeMap<String, String>,
    /// The caller's tokens per hour, held across its runs (tokens file; `None`: none).
    #[serde(default)]
    pub hourly_budget: Option<super::usage::HourlyBudget>,
    /// How long the run waited for a slot before it started (its share of the fleet was held,
    /// or its replica was full).
    #[serde(default)]
    pub queued_ms: u64,
    /// The caller's labels, what `ListRuns` finds the run by (kept with its result, never sent
    /// to a tool or the model).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Bad-call policy.
    pub parse_policy: ParsePolicy,
    /// When the run must end.
    pub deadline: Deadline,
    /// The caller the run belongs to (empty without authentication).
    pub principal: String,
    /// Its caller's `max_runs` when it was let in: a parked run that goes on (on any replica)
    /// takes one of those slots again, since it gave its own back when it parked.
    #[serde(default)]
    pub max_runs: Option<usize>,
    /// How long the run gathers the model's text into one event (zero: each read's at once).
    #[serde(default)]
    pub stream_interval: std::time::Duration,
    /// Which calls wait for a person's decision.
    #[serde(default)]
    pub approval: super::approval::ApprovalRules,
    /// Keeps the run's turns on one model endpoint (the run id unless the caller chose one).
    #[serde(default)]
    pub affinity_key: String,
    /// Normal calls start as soon as they are complete in the model's stream.
    #[serde(default)]
    pub eager_dispatch: bool,
    /// The thread the run continues, and what the model sees of it (boxed: most runs have
    /// none, and a held run's future holds its spec).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread: Option<Box<super::thread::RunThread>>,
    /// The named agent whose definition the run took (recorded with its result).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<super::agent::AgentRef>,
    /// [`RunSpec::request_digests`] of the request as it was asked, before its thread was read
    /// (recorded with its result, so a request naming its id again is told apart from a retry).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub request_digests: BTreeMap<String, String>,
}

impl RunSpec {
    /// What the run was asked, in brief: its request's last user message (the one it was
    /// started for), cut to an excerpt.
    pub fn prompt(&self) -> String {
        let asked = self.messages.iter().rev().find_map(|m| match m {
            Message::User { content, .. } => Some(content.as_str()),
            _ => None,
        });
        shared::text::excerpt(asked.unwrap_or_default())
    }

    /// A digest of each part of the request a retry under the run's id must repeat: what the
    /// model is asked and with what (not the deadline, which each call sets anew).
    pub fn request_digests(&self) -> BTreeMap<String, String> {
        let thread = self.thread.as_ref().map(|t| t.thread_id.as_str());
        let agent = self.agent.as_ref().map(|a| a.name.as_str());
        // The run timeout is the sooner of the asked one and the caller's deadline, which each
        // call (a retry too) sets anew.
        let limits = Limits {
            run_timeout: Duration::ZERO,
            ..self.limits
        };
        let parts: [(&str, serde_json::Result<Vec<u8>>); 11] = [
            ("messages", serde_json::to_vec(&self.messages)),
            ("system", serde_json::to_vec(&self.system)),
            ("model", serde_json::to_vec(&self.model)),
            ("params", serde_json::to_vec(&self.params)),
            ("tools", serde_json::to_vec(&self.normal_tools)),
            ("exit_tools", serde_json::to_vec(&self.exit_tools)),
            ("limits", serde_json::to_vec(&limits)),
            ("labels", serde_json::to_vec(&self.labels)),
            ("approval", serde_json::to_vec(&self.approval)),
            ("thread", serde_json::to_vec(&thread)),
            ("agent", serde_json::to_vec(&agent)),
        ];
        parts
            .into_iter()
            .map(|(name, bytes)| {
                use sha2::Digest as _;
                let digest = sha2::Sha256::digest(bytes.unwrap_or_default());
                let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
                (name.to_owned(), hex)
            })
            .collect()
    }
}

/// The parts whose digests differ between a request (`asked`) and the one a run was started
/// with (`kept`; a run recorded before digests were kept differs in none).
pub fn differing_parts(asked: &BTreeMap<String, String>, kept: &BTreeMap<String, String>) -> Vec<String> {
    asked
        .iter()
        .filter(|(part, digest)| kept.get(*part).is_some_and(|k| k != *digest))
        .map(|(part, _)| part.clone())
        .collect()
}

/// When a run must end: its own timeout from when the request arrived, or sooner, shortly before
/// the caller's gRPC deadline, so the caller still receives `run_finished`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    /// The moment.
    pub at: tokio::time::Instant,
    /// The caller's deadline set it (else the run's timeout).
    pub set_by_caller: bool,
}

/// A deadline is kept (in a checkpoint, read by another replica) as a Unix time in ms: an
/// `Instant` means nothing outside its process.
#[derive(serde::Serialize, serde::Deserialize)]
struct StoredDeadline {
    unix_ms: u64,
    set_by_caller: bool,
}

impl serde::Serialize for Deadline {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        StoredDeadline {
            unix_ms: self.unix_ms(),
            set_by_caller: self.set_by_caller,
        }
        .serialize(serializer)
    }
}

impl<'de> serde::Deserialize<'de> for Deadline {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let stored = StoredDeadline::deserialize(deserializer)?;
        let left = Duration::from_millis(stored.unix_ms.saturating_sub(shared::sync::unix_ms()));
        Ok(Self {
            at: tokio::time::Instant::now() + left,
            set_by_caller: stored.set_by_caller,
        })
    }
}

impl Deadline {
    /// The moment as a Unix time in ms.
    pub fn unix_ms(&self) -> u64 {
        let left = self.at.saturating_duration_since(tokio::time::Instant::now());
        shared::sync::unix_ms().saturating_add(u64::try_from(left.as_millis()).unwrap_or(u64::MAX))
    }

    /// `run_timeout` from `received_at`, or `caller` (less `headroom`) when that is sooner.
    pub fn new(
        received_at: tokio::time::Instant,
        run_timeout: Duration,
        caller: Option<Duration>,
        headroom: Duration,
    ) -> Self {
        let own = received_at + run_timeout;
        match caller.map(|c| received_at + c.saturating_sub(headroom)) {
            Some(at) if at < own => Self {
                at,
                set_by_caller: true,
            },
            _ => Self {
                at: own,
                set_by_caller: false,
            },
        }
    }
}

/// What the model may produce in one run (the values of `--max-calls-per-turn` and the other
/// output settings): past these, a run ends `OUTPUT_LIMIT` or the call fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputBounds {
    /// Tool calls in one turn; more end the run and none of them run.
    pub max_calls_per_turn: usize,
    /// Largest arguments of one tool call; a longer call fails `INVALID_ARGUMENTS`.
    pub max_argument_bytes: usize,
    /// Largest output of one run (text, arguments and errors of calls and signals).
    pub max_output_bytes: usize,
    /// Reasoning kept of one run.
    pub max_reasoning_bytes: usize,
}

/// The repeated-line rule: a line seen `threshold` times among the last `window` complete lines
/// of a run's output ends it `REPEATED_LINE_LOOP`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopDetection {
    /// Complete lines remembered.
    pub window: usize,
    /// Occurrences of one line in the window that end the run.
    pub threshold: usize,
}
