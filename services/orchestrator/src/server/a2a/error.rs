//! A2A's refusals: JSON-RPC errors with A2A's codes (a task not found is -32001, whoever asks),
//! from the gRPC service's statuses, each message naming the gRPC code; on the gRPC binding the
//! binding's status codes. Both carry a `google.rpc.ErrorInfo` of domain `a2a-protocol.org`
//! naming A2A's reason (`TASK_NOT_FOUND` …), which clients map onto their error types.

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
            Code::InvalidArgument | Code::OutOfRange | Code::PermissionDenied => -32602,
            Code::FailedPrecondition | Code::Aborted | Code::AlreadyExists => -32004,
            _ => -32603,
        };
        let name = orchestrator_client::code_name(status.code());
        Self::new(code, format!("{} ({name})", status.message()))
    }
}

/// The domain of A2A's reasons.
const DOMAIN: &str = "a2a-protocol.org";
const ERROR_INFO: &str = "type.googleapis.com/google.rpc.ErrorInfo";

impl RpcError {
    /// A2A's reason for this error, and its gRPC code.
    fn reason(&self) -> (&'static str, Code) {
        match self.code {
            -32001 => ("TASK_NOT_FOUND", Code::NotFound),
            -32002 => ("TASK_NOT_CANCELABLE", Code::FailedPrecondition),
            -32003 => ("PUSH_NOTIFICATION_NOT_SUPPORTED", Code::FailedPrecondition),
            -32004 => ("UNSUPPORTED_OPERATION", Code::FailedPrecondition),
            -32005 => ("CONTENT_TYPE_NOT_SUPPORTED", Code::InvalidArgument),
            -32007 => ("EXTENDED_AGENT_CARD_NOT_CONFIGURED", Code::FailedPrecondition),
            -32600 => ("INVALID_REQUEST", Code::InvalidArgument),
            -32601 => ("METHOD_NOT_FOUND", Code::NotFound),
            -32602 | -32700 => ("INVALID_PARAMS", Code::InvalidArgument),
            _ => ("INTERNAL_ERROR", Code::Internal),
        }
    }
}

/// A JSON-RPC error answer to call `id`.
pub(super) fn error_body(id: Value, error: RpcError) -> String {
    let (reason, _) = error.reason();
    let info = json!({ "@type": ERROR_INFO, "reason": reason, "domain": DOMAIN });
    json!({ "jsonrpc": "2.0", "id": id, "error": { "code": error.code, "message": error.message, "data": [info] } })
        .to_string()
}

/// `google.rpc.Status`, as a gRPC status's details carry it.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<prost_types::Any>,
}

/// `google.rpc.ErrorInfo`.
#[derive(Clone, PartialEq, prost::Message)]
struct ErrorInfo {
    #[prost(string, tag = "1")]
    reason: String,
    #[prost(string, tag = "2")]
    domain: String,
}

impl From<RpcError> for Status {
    /// A2A's gRPC codes for its errors (the binding's table), with the reason's `ErrorInfo`.
    fn from(error: RpcError) -> Self {
        use prost::Message as _;
        let (reason, code) = error.reason();
        let info = ErrorInfo {
            reason: reason.into(),
            domain: DOMAIN.into(),
        };
        let details = RpcStatus {
            code: code as i32,
            message: error.message.clone(),
            details: vec![prost_types::Any {
                type_url: ERROR_INFO.into(),
                value: info.encode_to_vec(),
            }],
        };
        Status::with_details(code, error.message, details.encode_to_vec().into())
    }
}
