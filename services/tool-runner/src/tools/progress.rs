//! How a call that is still running says how it gets on (an MCP server's
//! `notifications/progress`): each report goes to the caller that reads the call's updates
//! (`RunToolStream`), and is dropped when that caller lags: progress is a hint, and the next
//! report says more.

use std::sync::Arc;

/// One report.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    /// How far the call got, in the tool's units.
    pub progress: f64,
    /// How far it has to go in all (`None`: not known).
    pub total: Option<f64>,
    /// What the tool says, for a person (may be empty).
    pub message: String,
}

/// Where a call's reports go.
#[derive(Clone)]
pub struct ProgressSink(Arc<dyn Fn(Progress) + Send + Sync>);

impl ProgressSink {
    /// A sink that hands each report to `report` (which must not block).
    pub fn new(report: impl Fn(Progress) + Send + Sync + 'static) -> Self {
        Self(Arc::new(report))
    }

    /// Reports `progress`.
    pub fn report(&self, progress: Progress) {
        (self.0)(progress);
    }
}

impl std::fmt::Debug for ProgressSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProgressSink")
    }
}
