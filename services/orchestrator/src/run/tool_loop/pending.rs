//! A call of a turn that waits: for a person's decision before it runs, for the answers to the
//! questions it asked, or for the task its server made of it; as the turn's calls (and so its
//! checkpoint) hold it. What the loop does with it is in `approvals.rs` and `tasks.rs`.

use serde::{Deserialize, Serialize};

use crate::domain::approval::ApprovalDecision;
use crate::domain::input::{Answers, Questions};

/// A call of the turn that waits for a decision.
#[derive(Clone, Serialize, Deserialize)]
pub(super) struct TurnApproval {
    /// Position in the turn's calls.
    pub(super) index: usize,
    /// Unix ms: the wait ends then.
    pub(super) expires_at_unix_ms: u64,
    /// Unix ms: the call began to wait then (0: a checkpoint from before this was kept).
    #[serde(default)]
    pub(super) asked_at_unix_ms: u64,
    /// Set once decided.
    pub(super) decision: Option<ApprovalDecision>,
    /// The decision was acted on: the call announced (approved) or failed (not).
    pub(super) applied: bool,
    /// The questions the call asked (its answers are its decision); `None` for an approval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) questions: Option<Questions>,
    /// Times the call asked (bounded by `--max-input-rounds`).
    #[serde(default)]
    pub(super) rounds: u32,
    /// The call was approved, ran, and came back in doubt: this decision is whether it runs
    /// again (once approved, it is sent saying a person chose to rerun it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) in_doubt: bool,
}

impl TurnApproval {
    /// Call `index` waiting for a person's approval until `expires_at_unix_ms`, undecided.
    pub(super) fn new(index: usize, expires_at_unix_ms: u64) -> Self {
        Self {
            index,
            expires_at_unix_ms,
            asked_at_unix_ms: shared::sync::unix_ms(),
            decision: None,
            applied: false,
            questions: None,
            rounds: 0,
            in_doubt: false,
        }
    }

    /// Whether the call may run now: approved, and announced as such.
    pub(super) fn cleared(&self) -> bool {
        self.applied && self.decision.as_ref().is_some_and(ApprovalDecision::runs)
    }

    /// What the call's next attempt carries: the answers to its questions, once answered.
    pub(super) fn answers(&self) -> Option<Answers> {
        let questions = self.questions.as_ref()?;
        let decision = self.decision.as_ref()?;
        Some(questions.answered(&decision.answers))
    }

    /// Decides the call as expired when its wait is over undecided at `now_unix_ms` (the
    /// domain's rule, [`crate::domain::approval::expire`]).
    pub(super) fn expire(&mut self, now_unix_ms: u64) -> bool {
        let questions = self.questions.as_ref();
        crate::domain::approval::expire(&mut self.decision, self.expires_at_unix_ms, questions, now_unix_ms)
    }
}

/// A task one of the turn's calls became, followed until it ends.
#[derive(Clone, Serialize, Deserialize)]
pub(super) struct Following {
    /// Position in the turn's calls.
    pub(super) index: usize,
    pub(super) task: crate::domain::task::ToolTask,
    /// Unix ms the run first heard of the task (its ttl counts from then).
    pub(super) seen_at_unix_ms: u64,
    /// Unix ms of its next poll.
    pub(super) poll_at_unix_ms: u64,
}
