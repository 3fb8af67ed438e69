//! The repeated-line detector's window and threshold (the loop gets them as [`crate::domain::LoopDetection`]).

use clap::Args;
use shared::config::{Bound, Bounded, bound};

/// The repeated-line detector: a line seen `threshold` times among the last `window` complete
/// lines of a run's output ends it `REPEATED_LINE_LOOP`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args)]
pub struct LoopDetectorSettings {
    /// Repeated-line detector: complete lines remembered (cap 100000).
    #[arg(long = "loop-window", env = "ORCHESTRATOR_LOOP_WINDOW", default_value_t = 128)]
    pub window: usize,
    /// Repeated-line detector: occurrences of one line in the window that end the run (2..=window).
    #[arg(long = "loop-threshold", env = "ORCHESTRATOR_LOOP_THRESHOLD", default_value_t = 12)]
    pub threshold: usize,
}

impl Bounded for LoopDetectorSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("window", self.window, 1usize, 100_000usize),
            bound("threshold", self.threshold, 2usize, self.window.max(2)),
        ]
    }
}

impl From<&LoopDetectorSettings> for crate::domain::LoopDetection {
    fn from(s: &LoopDetectorSettings) -> Self {
        Self {
            window: s.window,
            threshold: s.threshold,
        }
    }
}
