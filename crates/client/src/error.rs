//! The client's errors.

/// What went wrong with a call.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The builder was given something unusable (an endpoint, a certificate, a token).
    #[error("invalid client setting: {0}")]
    Config(String),
    /// The orchestrator could not be reached.
    #[error("cannot connect to the orchestrator: {0}")]
    Connect(#[from] tonic::transport::Error),
    /// The orchestrator answered with an error status (refused the call, or the stream broke off).
    #[error("{}: {}", .0.code(), .0.message())]
    Status(#[from] tonic::Status),
    /// The event stream broke the contract (a gap in `seq`, no `run_finished`).
    #[error("the event stream broke the contract: {0}")]
    Protocol(String),
}

impl Error {
    /// The gRPC code, when the orchestrator answered with one.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            Self::Status(status) => Some(status.code()),
            _ => None,
        }
    }
}
