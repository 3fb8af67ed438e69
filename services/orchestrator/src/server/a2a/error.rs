//! A2A's refusals as JSON-RPC errors: A2A's codes (a task not found is -32001, whoever asks),
//! from the gRPC service's statuses, each message naming the gRPC code.

use serde_json::{Value, json};
use tonic::{Code, Status};

/// A JSON-RPC error: A2A's code and a message for the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RpcError {
    pub code: i64,
    pub message: String,
}

impl RpcError {
    pub(super) fn new(code: i64, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
    pub(super) fn invalid_params(message: impl Into<String>) -> Self {
        Self::new(-32602, message)
    }
    pub(super) fn internal(message: impl Into<String>) -> Self {
        Self::new(-32603, message)
    }
    pub(super) fn content_type(message: impl Into<String>) -> Self {
        Self::new(-32005, message)
    }
    pub(super) fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(-32600, message)
    }
    pub(super) fn unsupported(message: impl Into<String>) -> Self {
        Self::new(-32004, message)
    }
}

impl From<Status> for RpcError {
    fn from(status: Status) -> Self {
        let code = match status.code() {
            Code::NotFound => -32001,
            Code::InvalidArgument | Code::OutOfRange => -32602,
            Code::FailedPrecondition | Code::Aborted | Code::AlreadyExists => -32004,
            _ => -32603,
        };
        let name = orchestrator_client::code_name(status.code());
        Self::new(code, format!("{} ({name})", status.message()))
    }
}

/// A JSON-RPC error answer to call `id`.
pub(super) fn error_body(id: Value, error: RpcError) -> String {
    json!({ "jsonrpc": "2.0", "id": id, "error": { "code": error.code, "message": error.message } }).to_string()
}

impl From<RpcError> for Status {
    /// A2A's gRPC codes for its errors (the binding's table).
    fn from(error: RpcError) -> Self {
        let code = match error.code {
            -32001 => Code::NotFound,
            -32602 | -32005 | -32700 | -32600 => Code::InvalidArgument,
            -32002 | -32003 | -32004 | -32007 | -32008 | -32009 => Code::FailedPrecondition,
            -32601 => Code::Unimplemented,
            _ => Code::Internal,
        };
        Status::new(code, error.message)
    }
}
