//! What a run produced: its status, output, tool-call records and signals (the same value live,
//! for `GetRun`, and final, in `run_finished`).

use std::collections::BTreeMap;

use super::chat::Usage;

/// Status of a run. Its metric label is its name in snake case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr, serde::Serialize, serde::Deserialize)]
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
    /// Parked until its pending approvals are decided (it holds no slot meanwhile).
    AwaitingApproval,
    /// Parked until the questions of its pending calls are answered, and for nothing else.
    AwaitingInput,
    /// Parked until the next poll of a task one of its calls became (its tool's server runs
    /// the call in the background).
    AwaitingTask,
}

impl RunStatus {
    /// Whether the run has not ended (it runs, or waits for a person).
    pub fn is_live(self) -> bool {
        matches!(
            self,
            Self::Running | Self::AwaitingApproval | Self::AwaitingInput | Self::AwaitingTask
        )
    }

    /// Its name as the contract spells it, without the prefix: `COMPLETED`, `AWAITING_INPUT` …
    pub fn name(self) -> String {
        <&str>::from(self).to_uppercase()
    }

    /// Whether the run is parked, waiting for a person or a task (it holds no slot).
    pub fn is_parked(self) -> bool {
        matches!(self, Self::AwaitingApproval | Self::AwaitingInput | Self::AwaitingTask)
    }

    /// The status of a run parked with `pending` calls: waiting for input when every one waits
    /// for answers, else for approval.
    pub fn parked_for(pending: &[super::approval::PendingApproval]) -> Self {
        let undecided = pending.iter().filter(|p| p.decision.is_none());
        if !pending.is_empty() && undecided.clone().all(|p| p.questions.is_some()) {
            Self::AwaitingInput
        } else {
            Self::AwaitingApproval
        }
    }
}

/// Why a run failed. Its metric label (and `error.type` on spans) is its name in snake case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr, serde::Serialize, serde::Deserialize)]
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
    /// Calls were not decided within the approval timeout, and the run was asked to end then.
    ApprovalTimeout,
    /// The run's tokens went over its `max_total_tokens`, or its caller's over its
    /// `tokens_per_hour`.
    TokenBudget,
}

/// A tool call's failure, as fed back to the model.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ToolCallError {
    /// Machine-readable code (`NOT_FOUND`, `INVALID_ARGUMENTS`, `TIMEOUT`, `FAILED`, `UNAVAILABLE` …).
    pub code: String,
    /// Explanation.
    pub message: String,
}

impl ToolCallError {
    /// The code of a call in doubt: it started on a tool-runner that went away before its
    /// outcome was kept, so it may or may not have taken effect, and it was not run again.
    pub const IN_DOUBT: &'static str = "IN_DOUBT";

    /// Whether the call is in doubt (see [`Self::IN_DOUBT`]).
    pub fn in_doubt(&self) -> bool {
        self.code == Self::IN_DOUBT
    }

    /// An error with `code` and `message`.
    pub fn new(code: &str, message: impl Into<String>) -> Self {
        Self {
            code: code.to_owned(),
            message: message.into(),
        }
    }

    /// The error fed back to the model for a call a person (or the approval timeout) did not let run.
    pub fn refused(decision: &super::approval::ApprovalDecision) -> Self {
        let code = match decision.outcome {
            super::approval::ApprovalOutcome::TimedOut => "APPROVAL_TIMEOUT",
            _ => "REJECTED",
        };
        Self::new(code, decision.message.clone())
    }

    /// A person's refusal to run again a call that is in doubt: it stays in doubt.
    #[must_use]
    pub fn left_in_doubt(self) -> Self {
        Self::new(
            Self::IN_DOUBT,
            format!(
                "this call may or may not have taken effect: its tool-runner went away before its outcome was kept, and a person chose not to run it again ({}: {})",
                self.code, self.message
            ),
        )
    }

    /// The tool message the model sees: `{"error": {"code", "message"}}`.
    pub fn to_tool_message(&self) -> String {
        serde_json::json!({"error": {"code": self.code, "message": self.message}}).to_string()
    }
}

/// One executed (or attempted) normal tool call.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
    /// The person's decision, for a call that needed approval.
    #[serde(default)]
    pub approval: Option<super::approval::ApprovalDecision>,
}

/// An exit-tool call, published on the signal topic.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Delivery {
    /// Not confirmed yet.
    Pending,
    /// Confirmed by the topic.
    Delivered,
    /// Every attempt failed.
    Undelivered,
}

/// The state of a run: live (status `Running`, output so far) or final.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
    /// The current turn's calls that wait for a decision.
    #[serde(default)]
    pub pending_approvals: Vec<super::approval::PendingApproval>,
    /// The thread the run continues (empty: none).
    #[serde(default)]
    pub thread_id: String,
    /// The caller's labels: what `ListRuns` finds the run by.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// When the run was admitted (Unix ms): listings are newest first.
    #[serde(default)]
    pub created_at_ms: u64,
    /// When its state was last written (Unix ms): a listing shows how fresh a row is.
    #[serde(default)]
    pub updated_at_ms: u64,
    /// How long it waited for a run slot before it started.
    #[serde(default)]
    pub queued_ms: u64,
    /// Why a caller asked the run to end once its turn under way ends (`CANCEL_MODE_AFTER_TURN`),
    /// kept in its record before the caller is answered: a replica that takes the run over
    /// ends it there too, rather than let it go on from its checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ends_after_turn: Option<String>,
    /// The named agent the run took its definition from: a listing finds runs by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<super::agent::AgentRef>,
    /// The digests of the request it was started with (`RunSpec::request_digests`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub request_digests: BTreeMap<String, String>,
    /// What the run was asked (`RunSpec::prompt`): a listing and a person deciding its calls
    /// tell runs apart by it, not by ids alike.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub prompt: String,
}

impl RunResult {
    /// The result as a reader outside the run sees it while the run's end is not kept yet (its
    /// log and its store do not hold it): still running, its output so far.
    pub fn unended(mut self) -> Self {
        if !self.status.is_live() {
            self.status = RunStatus::Running;
            self.failure_reason = None;
            self.failure_detail.clear();
        }
        self
    }

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
            pending_approvals: Vec::new(),
            thread_id: String::new(),
            labels: BTreeMap::new(),
            created_at_ms: 0,
            updated_at_ms: 0,
            queued_ms: 0,
            ends_after_turn: None,
            agent: None,
            request_digests: BTreeMap::new(),
            prompt: String::new(),
        }
    }
}
