//! The client's errors.

/// What went wrong with a call.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The builder was given something unusable (an endpoint, a certificate, a token).
    #[error("invalid client setting: {0}")]
    Config(String),
    /// The orchestrator could not be reached.
    #[error("cannot connect to the orchestrator: {}", chain(.0))]
    Connect(#[from] tonic::transport::Error),
    /// The orchestrator answered with an error status (refused the call, or the stream broke off):
    /// its message, then its code's name (`NOT_FOUND` …).
    #[error("{}", status_text(.0))]
    Status(#[from] tonic::Status),
    /// The event stream broke the contract (a gap in `seq`).
    #[error("the event stream broke the contract: {0}")]
    Protocol(String),
    /// The stream ended before `run_finished` and could not be followed again: an attach after
    /// the run's last event, or a call cut off for good.
    #[error("the event stream ended before run_finished")]
    Unfinished,
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

/// An error and its sources, as one line (a transport error alone says only "transport error").
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// A status as a person reads it: the orchestrator's message and the code's name, without
/// gRPC's generic description of the code ("Some requested entity was not found").
pub(crate) fn status_text(status: &tonic::Status) -> String {
    let code = code_name(status.code());
    match status.message().trim() {
        "" => format!("{} ({code})", status.code().description()),
        message => format!("{message} ({code})"),
    }
}

/// The canonical name of a gRPC code (`NOT_FOUND`, `FAILED_PRECONDITION` …).
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code as C;
    match code {
        C::Ok => "OK",
        C::Cancelled => "CANCELLED",
        C::Unknown => "UNKNOWN",
        C::InvalidArgument => "INVALID_ARGUMENT",
        C::DeadlineExceeded => "DEADLINE_EXCEEDED",
        C::NotFound => "NOT_FOUND",
        C::AlreadyExists => "ALREADY_EXISTS",
        C::PermissionDenied => "PERMISSION_DENIED",
        C::ResourceExhausted => "RESOURCE_EXHAUSTED",
        C::FailedPrecondition => "FAILED_PRECONDITION",
        C::Aborted => "ABORTED",
        C::OutOfRange => "OUT_OF_RANGE",
        C::Unimplemented => "UNIMPLEMENTED",
        C::Internal => "INTERNAL",
        C::Unavailable => "UNAVAILABLE",
        C::DataLoss => "DATA_LOSS",
        C::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_reads_as_its_message_and_code_name() {
        let refused = Error::Status(tonic::Status::not_found("no run \"r-1\""));
        assert_eq!(refused.to_string(), "no run \"r-1\" (NOT_FOUND)");
        let bare = Error::Status(tonic::Status::unavailable(""));
        assert!(bare.to_string().ends_with("(UNAVAILABLE)"), "{bare}");
    }
}
