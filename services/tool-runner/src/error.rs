//! The tool-runner's error type: everything that stops it from starting or serving, and requests
//! it cannot take. Tool-level failures are not errors here; they are answers ([`crate::tools::ToolError`]).

use std::path::PathBuf;

/// Why the runner cannot start, or cannot take a request.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A flag or environment value is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A limit is outside its allowed range.
    #[error("invalid configuration: {0}")]
    Limit(#[from] shared::config::ConfigError),
    /// The tools manifest cannot be used.
    #[error("tools manifest {}: {}{message}", file.display(), tool.as_ref().map(|t| format!("tool {t:?}: ")).unwrap_or_default())]
    Manifest {
        /// The manifest file.
        file: PathBuf,
        /// The tool the problem is in, if it is in one.
        tool: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// A request is malformed (not a tool-level problem: e.g. no tool name at all).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The listen address cannot be bound.
    #[error("cannot listen on {address} ({flag}): {source}")]
    Listen {
        /// The address.
        address: std::net::SocketAddr,
        /// The flag that sets it, and what to do.
        flag: &'static str,
        /// Why.
        source: std::io::Error,
    },
    /// TLS, the tokens file or the health address cannot be set up.
    #[error(transparent)]
    Security(#[from] shared::serving::SecurityError),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
}

impl From<Error> for tonic::Status {
    fn from(error: Error) -> Self {
        match error {
            Error::InvalidRequest(_) => tonic::Status::invalid_argument(error.to_string()),
            // Configuration problems surface at startup; seen by a caller they mean the runner
            // is not usable, which retrying elsewhere may fix.
            Error::Config(_) | Error::Limit(_) | Error::Manifest { .. } => {
                tonic::Status::failed_precondition(error.to_string())
            }
            Error::Listen { .. } | Error::Serve(_) | Error::Security(_) => {
                tonic::Status::unavailable(error.to_string())
            }
        }
    }
}

impl shared::runtime::Failure for Error {
    fn is_usage(&self) -> bool {
        use shared::serving::SecurityError;
        matches!(
            self,
            Error::Config(_)
                | Error::Limit(_)
                | Error::Manifest { .. }
                | Error::Security(SecurityError::Tls(_) | SecurityError::Tokens(_))
        )
    }
}

impl From<shared::telemetry::TelemetryError> for Error {
    fn from(error: shared::telemetry::TelemetryError) -> Self {
        Error::Config(error.to_string())
    }
}

impl From<shared::shutdown::StartupError> for Error {
    fn from(error: shared::shutdown::StartupError) -> Self {
        match error {
            shared::shutdown::StartupError::Signals(_) => Error::Config(error.to_string()),
            shared::shutdown::StartupError::Listen { address, flag, source } => Error::Listen { address, flag, source },
        }
    }
}
