//! How a run is asked to stop: at once, or once the turn in progress has ended.

use serde::{Deserialize, Serialize};

/// When a canceled run stops.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum CancelMode {
    /// At once: the model stream in progress is cut, calls in flight are abandoned.
    #[default]
    Immediate,
    /// Once the turn in progress has ended: its calls run and are recorded, no new model request
    /// is made. An immediate cancel may follow and wins.
    AfterTurn,
}
