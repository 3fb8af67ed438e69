//! Named agents as a run knows them: which agent's definition a run took, at which version, and
//! what a request naming an agent may set besides its own messages ([`Override`]).

/// The agent a run took its definition from, and that definition's version (a digest of it)
/// when the run was admitted: a run keeps telling what it ran as after the agent changed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AgentRef {
    /// The agent's name.
    pub name: String,
    /// A digest of its definition (16 hexadecimal digits).
    pub version: String,
}

/// What a request naming an agent may set, when the agent lets it: each replaces (or, for the
/// system message, adds to) the agent's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Override {
    /// The model name.
    Model,
    /// A system message, added after the agent's.
    System,
    /// The normal tools.
    Tools,
    /// The exit tools.
    ExitTools,
    /// Which calls wait for a person's approval, and how long.
    Approval,
    /// Sampling parameters, field by field.
    Params,
    /// Run limits, field by field.
    Limits,
    /// What the run does when its thread is held.
    OnBusy,
}

impl Override {
    /// Every override, in the order the contract lists them.
    pub const ALL: [Self; 8] = [
        Self::Model,
        Self::System,
        Self::Tools,
        Self::ExitTools,
        Self::Approval,
        Self::Params,
        Self::Limits,
        Self::OnBusy,
    ];

    /// Its name in the agents file and the contract.
    pub fn name(self) -> &'static str {
        match self {
            Self::Model => "model",
            Self::System => "system",
            Self::Tools => "tools",
            Self::ExitTools => "exit_tools",
            Self::Approval => "approval",
            Self::Params => "params",
            Self::Limits => "limits",
            Self::OnBusy => "on_busy",
        }
    }
}
