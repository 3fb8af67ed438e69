//! A run: the tool loop and everything it is made of. Nothing here knows about gRPC or HTTP; the
//! loop talks to the model, the tool-runners and the signal topic through traits, so it is
//! unit-tested without a network.
//!
//! * [`tool_loop`]: the loop, one method per rule;
//! * [`live`]: a live run's shared state, cancel handle and event emitter;
//! * [`turn`]: one streamed completion → visible text + tool calls;
//! * [`fallback`]: tool calls written in the text (`<tool_call>` blocks, standalone JSON);
//! * [`hold_back`]: what of a turn's text may be shown now, so streamed text equals final text;
//! * [`loop_detector`]: the repeated-line detector;
//! * [`bios`]: the system message the orchestrator writes before every turn.

pub mod bios;
pub mod fallback;
pub mod hold_back;
pub mod live;
pub mod loop_detector;
pub mod tool_loop;
pub mod turn;

use std::collections::BTreeMap;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::llm::{Message, SamplingParams, ToolDefinition, Usage};

/// Hard limit on turns, whatever the configuration says.
pub const HARD_MAX_TURNS: u32 = 128;

/// What to do with a call naming an unknown tool or with non-object arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ParsePolicy {
    /// End the run `TOOL_PARSE_ERROR`.
    #[default]
    Fail,
    /// Answer each bad call with an error tool message; it counts as a failed call of the turn.
    FeedBack,
}

/// The limits a run runs with (defaults applied, maxima checked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
}

/// Everything one run needs, validated.
#[derive(Debug, Clone)]
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
    /// Bad-call policy.
    pub parse_policy: ParsePolicy,
    /// When the run must end.
    pub deadline: Deadline,
    /// The caller the run belongs to (empty without authentication).
    pub principal: String,
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

impl Deadline {
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

/// Status of a run. Its metric label is its name in snake case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum RunStatus {
    /// Live.
    Running,
    /// The model stopped calling normal tools.
    Completed,
    /// A limit or an error ended it.
    Failed,
    /// Canceled.
    Canceled,
}

/// Why a run failed. Its metric label (and `error.type` on spans) is its name in snake case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum FailureReason {
    /// Unknown tool / non-object arguments (policy FAIL), or a malformed fallback directive.
    ToolParseError,
    /// A tool call could not be executed at all (reserved; failed calls are fed back).
    ToolExecutionError,
    /// The budget ran out.
    ToolBudgetExhausted,
    /// Too many failing turns.
    ToolFailureLimit,
    /// The model repeated a line too often.
    RepeatedLineLoop,
    /// `max_turns` used up.
    MaxTurnsExceeded,
    /// The LLM server failed.
    LlmError,
    /// The LLM stream went silent.
    LlmStreamStalled,
    /// The run deadline passed.
    DeadlineExceeded,
    /// Anything else.
    UnknownError,
    /// The replica running the run stopped renewing its lease in the shared store.
    OrchestratorLost,
    /// The model's output went over a size limit (calls in one turn, or the run's output).
    OutputLimit,
}

/// A tool call's failure, as fed back to the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallError {
    /// Machine-readable code (`NOT_FOUND`, `INVALID_ARGUMENTS`, `TIMEOUT`, `FAILED`, `UNAVAILABLE` …).
    pub code: String,
    /// Explanation.
    pub message: String,
}

impl ToolCallError {
    /// An error with `code` and `message`.
    pub fn new(code: &str, message: impl Into<String>) -> Self {
        Self {
            code: code.to_owned(),
            message: message.into(),
        }
    }

    /// The tool message the model sees: `{"error": {"code", "message"}}`.
    pub fn to_tool_message(&self) -> String {
        serde_json::json!({"error": {"code": self.code, "message": self.message}}).to_string()
    }
}

/// One executed (or attempted) normal tool call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallRecord {
    /// Call id.
    pub call_id: String,
    /// Tool name.
    pub name: String,
    /// Arguments as written by the model.
    pub arguments_json: String,
    /// Whether it returned a result.
    pub ok: bool,
    /// Why not, when not ok.
    pub error: Option<ToolCallError>,
    /// Wall time.
    pub duration_ms: u64,
    /// Turn (1-based).
    pub turn: u32,
}

/// An exit-tool call, published on the signal topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signal {
    /// Run.
    pub run_id: String,
    /// Call id.
    pub call_id: String,
    /// Exit tool.
    pub tool_name: String,
    /// Arguments (kept as written when not valid JSON).
    pub arguments_json: String,
    /// Whether the arguments are a valid JSON object.
    pub arguments_valid: bool,
    /// Turn (1-based).
    pub turn: u32,
    /// Unix ms.
    pub emitted_at_unix_ms: u64,
    /// Run metadata.
    pub metadata: BTreeMap<String, String>,
    /// Whether the signal topic confirmed it.
    pub delivery: Delivery,
    /// The caller whose run emitted it (subscribers with authentication see only their own).
    pub principal: String,
}

/// Delivery of a signal to the signal topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Not confirmed yet.
    Pending,
    /// Confirmed by the topic.
    Delivered,
    /// Every attempt failed.
    Undelivered,
}

/// The state of a run: live (status `Running`, output so far) or final.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunResult {
    /// Run id.
    pub run_id: String,
    /// Status.
    pub status: RunStatus,
    /// Why it failed.
    pub failure_reason: Option<FailureReason>,
    /// Failure detail.
    pub failure_detail: String,
    /// All user-visible output so far.
    pub text: String,
    /// Signals, in order.
    pub signals: Vec<Signal>,
    /// Turns started.
    pub turns: u32,
    /// Executed normal calls, in order.
    pub tool_calls: Vec<ToolCallRecord>,
    /// Turns with a failed call.
    pub failed_turns: u32,
    /// Usage summed over turns.
    pub usage: Usage,
    /// Last finish_reason from the model.
    pub finish_reason: String,
    /// The caller the run belongs to (empty without authentication): only it may read, cancel
    /// or replay the run.
    pub principal: String,
    /// The model's reasoning, up to the server's cap: callers debugging a run want to see why the
    /// model chose its calls, but it is not output.
    pub reasoning: String,
    /// The model reasoned past the cap; `reasoning` is its beginning.
    pub reasoning_truncated: bool,
}

impl RunResult {
    /// A live run with no output yet.
    pub fn running(run_id: &str) -> Self {
        Self {
            run_id: run_id.to_owned(),
            status: RunStatus::Running,
            failure_reason: None,
            failure_detail: String::new(),
            text: String::new(),
            signals: Vec::new(),
            turns: 0,
            tool_calls: Vec::new(),
            failed_turns: 0,
            usage: Usage::default(),
            finish_reason: String::new(),
            principal: String::new(),
            reasoning: String::new(),
            reasoning_truncated: false,
        }
    }
}

/// One event of a run's stream (numbered by the emitter).
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The run started.
    RunStarted {
        /// Model.
        model: String,
        /// Normal tool names.
        normal_tools: Vec<String>,
        /// Exit tool names.
        exit_tools: Vec<String>,
        /// Limits in force.
        limits: Limits,
    },
    /// Visible text.
    TextDelta {
        /// Text.
        text: String,
        /// Turn.
        turn: u32,
    },
    /// Reasoning text, kept apart from the output.
    ReasoningDelta {
        /// Reasoning.
        text: String,
        /// Turn.
        turn: u32,
    },
    /// A normal call was dispatched.
    ToolCallStarted {
        /// Call id.
        call_id: String,
        /// Tool.
        name: String,
        /// Arguments.
        arguments_json: String,
        /// Turn.
        turn: u32,
        /// The arguments were cut to fit one event.
        arguments_truncated: bool,
    },
    /// A normal call finished.
    ToolCallFinished {
        /// Call id.
        call_id: String,
        /// Tool.
        name: String,
        /// Result JSON when ok.
        content_json: Option<String>,
        /// The result was longer than one event may carry and is cut here.
        content_truncated: bool,
        /// Error when not ok.
        error: Option<ToolCallError>,
        /// Wall time.
        duration_ms: u64,
    },
    /// An exit call.
    Signal(Signal),
    /// A turn ended.
    TurnFinished {
        /// Turn.
        turn: u32,
        /// Usage of this turn.
        usage: Usage,
        /// Budget left.
        tool_call_budget_remaining: u32,
        /// Failing turns so far.
        failed_turns: u32,
    },
    /// The run ended (always last).
    RunFinished(RunResult),
}

/// An event with its position in the stream.
#[derive(Debug, Clone, PartialEq)]
pub struct NumberedEvent {
    /// 1, 2, 3 … without gaps.
    pub seq: u64,
    /// The event.
    pub event: Event,
}

/// Events sent to the caller's stream together (they leave in one write).
pub type EventBatch = Vec<NumberedEvent>;

/// A normal tool call to execute.
#[derive(Debug, Clone)]
pub struct ToolInvocation {
    /// Run.
    pub run_id: String,
    /// Call id.
    pub call_id: String,
    /// Tool.
    pub name: String,
    /// Arguments (a JSON object).
    pub arguments_json: String,
    /// Run metadata.
    pub metadata: BTreeMap<String, String>,
    /// The caller the run belongs to.
    pub principal: String,
    /// Deadline of this call.
    pub timeout: Duration,
}

/// Executes normal tool calls (on tool-runners, or scripted in tests). Dropping the future
/// cancels the call.
pub trait ToolExecutor: Send + Sync + 'static {
    /// Runs one call; the `Ok` value is the result as JSON text.
    fn execute(&self, call: ToolInvocation) -> BoxFuture<'static, Result<String, ToolCallError>>;
}
