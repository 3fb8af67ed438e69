//! Tool sources and the types every tool shares.
//!
//! A [`Tool`] takes a JSON object (already validated against its schema by the
//! [`Catalog`](crate::catalog::Catalog)) and returns a JSON value or a [`ToolError`]. Tools are
//! plain futures: dropping the future (caller canceled, timeout) stops the tool, and tools that
//! own outside resources (child processes) release them on drop.
//!
//! * [`builtin`]: small useful tools compiled into the runner;
//! * [`command`]: tools that run a program, declared in a TOML manifest ([`manifest`]);
//! * [`mcp`]: the tools of MCP servers declared in the same manifest;
//! * [`input`]: questions a call asks a person before it can finish (MCP's `input_required`);
//! * [`task`]: calls an MCP server runs as tasks, and how a call's next attempt goes on with one;
//! * [`progress`]: how a call still running says how it gets on;
//! * `entry.rs`: a tool as the catalog keeps it (spec, compiled schema, implementation);
//!   `fields.rs`: the checks of a manifest table's fields; `limits.rs`: the resource limits of
//!   command tools (set with `prlimit`).

pub mod builtin;
pub mod command;
pub mod entry;
mod fields;
pub mod input;
pub mod limits;
pub mod manifest;
pub mod mcp;
pub mod progress;
pub mod task;

use std::fmt;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::{Map, Value};

/// The arguments a tool receives: always a JSON object.
pub type Args = Map<String, Value>;

/// What a tool call returns: a JSON result or a tool-level failure.
pub type ToolResult = Result<Value, ToolError>;

/// Who is calling: the orchestrator run and call, and the run's metadata.
#[derive(Debug, Clone, Default)]
pub struct CallContext {
    /// The orchestrator run.
    pub run_id: String,
    /// The model's call id.
    pub call_id: String,
    /// The run's metadata (tenant, ticket …).
    pub metadata: std::collections::HashMap<String, String>,
    /// The orchestrator's caller the run belongs to (empty without authentication there).
    pub principal: String,
    /// The epoch of the orchestrator's claim of the run (0: not durable): a tool with side
    /// effects refuses an older one than it has seen for the run.
    pub epoch: u64,
    /// The answers to the questions the call's last attempt asked (it is tried again with them).
    pub input: Option<input::InputAnswers>,
    /// The task the call became in an earlier attempt: this attempt goes on with it.
    pub task: Option<task::TaskRef>,
    /// Where the call's progress reports go, when its caller reads them.
    pub progress: Option<progress::ProgressSink>,
}

/// A tool the runner can execute.
pub trait Tool: Send + Sync + 'static {
    /// Runs the tool. The returned future must stop the tool's work when dropped.
    fn call(&self, args: Args, ctx: &CallContext) -> BoxFuture<'static, ToolResult>;

    /// Runs the tool, which may ask questions before it can finish (an MCP server's tools);
    /// every other tool's output is its [`Tool::call`]'s result.
    fn run(&self, args: Args, ctx: &CallContext) -> BoxFuture<'static, Result<input::Output, ToolError>> {
        use futures::FutureExt as _;
        self.call(args, ctx)
            .map(|result| result.map(input::Output::Done))
            .boxed()
    }
}

/// Describes a tool to callers (served by `ListTools`).
#[derive(Debug, Clone)]
pub struct ToolSpec {
    /// Unique name the model calls.
    pub name: String,
    /// What the tool does, written for the model.
    pub description: String,
    /// JSON Schema of the arguments object; arguments are validated against it before the call.
    pub parameters: Value,
    /// The runner's timeout for one call; the call is stopped and answered `TIMEOUT` beyond it.
    pub timeout: Duration,
    /// Where the tool comes from (`builtin`, `command`, `mcp`), so operators can tell tools apart.
    pub source: &'static str,
    /// Calls with side effects a person must see first: the orchestrator asks for a decision
    /// before it sends the call here.
    pub needs_approval: bool,
    /// The MCP protocol its server speaks (empty for other tools).
    pub mcp_protocol: String,
    /// Running a call again has no further effect: a durable call found in doubt runs again
    /// instead of being answered in doubt.
    pub idempotent: bool,
}

/// Kinds of tool-level failure; mirrors `toolrunner.v1.ToolErrorCode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// No tool has this name.
    NotFound,
    /// The arguments are malformed, too large, too deep or violate the schema.
    InvalidArguments,
    /// The tool ran past its timeout and was stopped.
    Timeout,
    /// The tool ran and failed.
    Failed,
    /// Refused by policy (sandbox, allowlist).
    PermissionDenied,
    /// Disabled on this runner, or a resource it needs is unavailable.
    Unavailable,
    /// Canceled before it finished.
    Canceled,
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NotFound => "NOT_FOUND",
            Self::InvalidArguments => "INVALID_ARGUMENTS",
            Self::Timeout => "TIMEOUT",
            Self::Failed => "FAILED",
            Self::PermissionDenied => "PERMISSION_DENIED",
            Self::Unavailable => "UNAVAILABLE",
            Self::Canceled => "CANCELED",
        })
    }
}

/// A tool-level failure: an answer to the caller, not a transport error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolError {
    /// What kind of failure.
    pub code: ErrorCode,
    /// Explanation a model or a person can act on.
    pub message: String,
    /// Whether the same call may succeed when tried again.
    pub retryable: bool,
}

impl ToolError {
    /// A failure that retrying will not fix.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            retryable: false,
        }
    }

    /// A failure that may go away on a retry (timeouts, transient upstream errors).
    pub fn retryable(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            retryable: true,
        }
    }

    /// `INVALID_ARGUMENTS`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArguments, message)
    }

    /// `FAILED`.
    pub fn failed(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Failed, message)
    }

    /// `PERMISSION_DENIED`.
    pub fn denied(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::PermissionDenied, message)
    }
}

impl fmt::Display for ToolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

/// Reads an optional string argument (the schema already checked its type).
pub(crate) fn str_arg<'a>(args: &'a Args, key: &str) -> Option<&'a str> {
    args.get(key).and_then(Value::as_str)
}

/// Reads an optional unsigned integer argument (the schema already checked its type).
pub(crate) fn u64_arg(args: &Args, key: &str) -> Option<u64> {
    args.get(key).and_then(Value::as_u64)
}
