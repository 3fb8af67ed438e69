//! A call of a turn that waits for a person's decision, as the turn's calls (and so its
//! checkpoint) hold it; what the loop does with it is in `approvals.rs`.

use serde::{Deserialize, Serialize};

use crate::domain::approval::ApprovalDecision;

/// A call of the turn that waits for a decision.
#[derive(Clone, Serialize, Deserialize)]
pub(super) struct Approval {
    /// Position in the turn's calls.
    pub(super) index: usize,
    /// Unix ms: the wait ends then.
    pub(super) expires_at_unix_ms: u64,
    /// Set once decided.
    pub(super) decision: Option<ApprovalDecision>,
    /// The decision was acted on: the call announced (approved) or failed (not).
    pub(super) applied: bool,
}

impl Approval {
    /// Whether the call may run now: approved, and announced as such.
    pub(super) fn cleared(&self) -> bool {
        self.applied && self.decision.as_ref().is_some_and(ApprovalDecision::runs)
    }
}
