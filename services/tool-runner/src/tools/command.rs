//! Command tools: run a program (no shell) with the JSON arguments on stdin and take its stdout as
//! the result.
//!
//! * The child starts in a process group of its own with a cleared environment (plus the tool's
//!   allowlist) in the tool's working directory.
//! * stdout is capped: more output than `max_stdout_bytes` fails the call; stderr keeps its last
//!   `max_stderr_bytes`, whose tail explains a non-zero exit.
//! * Dropping the call (timeout, caller canceled, runner shutting down) kills the whole process
//!   group, so grandchildren do not outlive the call. After a normal exit, stragglers left in the
//!   group are killed as well. A process that moves itself to another group or session escapes
//!   this; run the runner in a container (one per pod) to contain such tools.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde::Deserialize;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use super::limits::ResourceLimits;
use super::{Args, CallContext, ErrorCode, Tool, ToolError, ToolResult};

/// How stdout becomes the result.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputMode {
    /// JSON when stdout parses as JSON, otherwise the text as a JSON string (empty → `null`).
    #[default]
    Auto,
    /// stdout must be JSON; anything else fails the call.
    Json,
    /// stdout is text, returned as a JSON string.
    Text,
}

/// The call's context as environment variables: `TOOL_RUN_ID`, `TOOL_CALL_ID`, `TOOL_RUN_EPOCH`, `TOOL_PRINCIPAL`, and each metadata
/// entry as `TOOL_META_<KEY>` (key upper-cased, characters other than letters and digits as `_`).
/// Values with NUL bytes are skipped (they cannot be passed in an environment).
pub fn context_env(ctx: &CallContext) -> Vec<(String, String)> {
    let mut env = vec![
        ("TOOL_RUN_ID".to_owned(), ctx.run_id.clone()),
        ("TOOL_CALL_ID".to_owned(), ctx.call_id.clone()),
        ("TOOL_RUN_EPOCH".to_owned(), ctx.epoch.to_string()),
        ("TOOL_PRINCIPAL".to_owned(), ctx.principal.clone()),
    ];
    for (key, value) in &ctx.metadata {
        let key: String = key
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_uppercase()
                } else {
                    '_'
                }
            })
            .collect();
        env.push((format!("TOOL_META_{key}"), value.clone()));
    }
    env.retain(|(_, v)| !v.contains('\0'));
    env
}

/// How many bytes of stderr an error message quotes.
const STDERR_QUOTE: usize = 2000;

/// A tool backed by a program.
#[derive(Clone)]
pub struct CommandTool(Arc<CommandConfig>);

/// How a command tool runs; the manifest loader has checked every value.
#[derive(Debug, Clone)]
pub struct CommandConfig {
    /// `prlimit`, which sets the limits and then executes the program.
    pub prlimit: PathBuf,
    /// The program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Its whole environment (besides the call's context).
    pub env: Vec<(String, String)>,
    /// Where it runs.
    pub working_dir: PathBuf,
    /// More stdout fails the call.
    pub max_stdout: u64,
    /// The tail of stderr kept.
    pub max_stderr: u64,
    /// How stdout becomes the result.
    pub output: OutputMode,
    /// Resource limits.
    pub limits: ResourceLimits,
    /// Whether error messages (which reach the model) quote stderr; otherwise it is only logged.
    pub stderr_to_model: bool,
}

impl CommandTool {
    /// A command tool.
    pub fn new(config: CommandConfig) -> Self {
        Self(Arc::new(config))
    }
}

impl Tool for CommandTool {
    fn call(&self, args: Args, ctx: &CallContext) -> BoxFuture<'static, ToolResult> {
        let inner = Arc::clone(&self.0);
        let env = context_env(ctx);
        async move { inner.run(args, env).await }.boxed()
    }
}

/// Kills the child's whole process group when dropped.
pub(crate) struct GroupKiller(Option<nix::unistd::Pid>);

impl GroupKiller {
    /// The group of `child`, started with `process_group(0)`.
    pub(crate) fn of(child: &tokio::process::Child) -> Self {
        Self(
            child
                .id()
                .and_then(|id| i32::try_from(id).ok())
                .map(nix::unistd::Pid::from_raw),
        )
    }
}

impl Drop for GroupKiller {
    fn drop(&mut self) {
        if let Some(pgid) = self.0 {
            // ESRCH (the group is already gone) is the normal case after a clean exit.
            let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        }
    }
}

impl CommandConfig {
    async fn run(&self, args: Args, context: Vec<(String, String)>) -> ToolResult {
        let input = serde_json::to_vec(&Value::Object(args))
            .map_err(|e| ToolError::invalid(format!("arguments cannot be serialized: {e}")))?;
        let program = self.program.display();
        let mut child = self
            .limits
            .command(&self.prlimit, &self.program, &self.args, &self.env, &self.working_dir)
            .envs(context)
            .spawn()
            .map_err(|e| ToolError::new(ErrorCode::Unavailable, format!("cannot start {program}: {e}")))?;
        let killer = GroupKiller::of(&child);
        let pgid = killer.0;

        let (stdin, stdout, stderr) = (child.stdin.take(), child.stdout.take(), child.stderr.take());
        let write_stdin = async {
            if let Some(mut stdin) = stdin {
                // A program that does not read its input closes the pipe: not an error.
                let _ = stdin.write_all(&input).await;
            }
        };
        let read_stdout = async {
            let result = read_capped(stdout, self.max_stdout).await;
            if result.is_err() {
                // Over the cap: stop the producer now instead of draining it.
                drop(GroupKiller(pgid));
            }
            result
        };
        let (_, stdout, stderr) = tokio::join!(write_stdin, read_stdout, read_tail(stderr, self.max_stderr));
        let status = child
            .wait()
            .await
            .map_err(|e| ToolError::failed(format!("waiting for {program}: {e}")))?;
        drop(killer);

        let stdout = stdout.map_err(|e| match e {
            ReadError::OverCap => ToolError::failed(format!(
                "the tool wrote more than {} bytes to stdout (its max_stdout_bytes) and was stopped",
                self.max_stdout
            )),
            ReadError::Io(e) => ToolError::failed(format!("reading the tool's stdout: {e}")),
        })?;
        if !status.success() {
            return Err(ToolError::failed(self.exit_message(status, &stderr)));
        }
        self.parse_output(stdout)
    }

    fn parse_output(&self, stdout: Vec<u8>) -> ToolResult {
        let text = String::from_utf8(stdout).map_err(|_| ToolError::failed("the tool's stdout is not UTF-8 text"))?;
        let trimmed = text.trim();
        match self.output {
            OutputMode::Text => Ok(Value::String(text.trim_end_matches(['\n', '\r']).to_owned())),
            OutputMode::Json => serde_json::from_str(trimmed).map_err(|e| {
                ToolError::failed(format!(
                    "the tool's stdout is not valid JSON ({e}): {}",
                    shared::text::tail(trimmed, STDERR_QUOTE)
                ))
            }),
            OutputMode::Auto if trimmed.is_empty() => Ok(Value::Null),
            OutputMode::Auto => Ok(serde_json::from_str(trimmed)
                .unwrap_or_else(|_| Value::String(text.trim_end_matches(['\n', '\r']).to_owned()))),
        }
    }
}

impl CommandConfig {
    /// Why the tool failed, for the model: how it ended, what its limits were, and its stderr
    /// only when the manifest says so (stderr may hold paths, hosts or secrets; it is logged).
    fn exit_message(&self, status: ExitStatus, stderr: &[u8]) -> String {
        use std::os::unix::process::ExitStatusExt;
        let how = match (status.code(), status.signal()) {
            // A shell reports a child it started that died of signal n as status 128 + n.
            (Some(code), _) => match code.checked_sub(128).and_then(|n| self.limits.signal_meaning(n)) {
                Some(meaning) => format!(
                    "exited with status {code} (a process it started got signal {}: {meaning})",
                    code - 128
                ),
                None => format!("exited with status {code}"),
            },
            (None, Some(signal)) => match self.limits.signal_meaning(signal) {
                Some(meaning) => format!("was stopped by signal {signal}: {meaning}"),
                None => format!("was killed by signal {signal}"),
            },
            (None, None) => "failed".to_owned(),
        };
        let stderr = String::from_utf8_lossy(stderr);
        let stderr = shared::text::tail(stderr.trim(), STDERR_QUOTE);
        if !stderr.is_empty() {
            tracing::info!(stderr, "the tool's stderr");
        }
        let limits = &self.limits;
        match (stderr.is_empty(), self.stderr_to_model) {
            (false, true) => format!("the tool {how} (limits: {limits}): {stderr}"),
            (false, false) => format!("the tool {how} (limits: {limits}); its stderr is in the runner's log"),
            (true, _) => format!("the tool {how} (limits: {limits})"),
        }
    }
}

enum ReadError {
    OverCap,
    Io(std::io::Error),
}

/// Reads everything, failing as soon as more than `cap` bytes arrive.
async fn read_capped(reader: Option<impl AsyncRead + Unpin>, cap: u64) -> Result<Vec<u8>, ReadError> {
    let Some(reader) = reader else { return Ok(Vec::new()) };
    let mut buf = Vec::new();
    reader
        .take(cap + 1)
        .read_to_end(&mut buf)
        .await
        .map_err(ReadError::Io)?;
    if buf.len() as u64 > cap {
        return Err(ReadError::OverCap);
    }
    Ok(buf)
}

/// Reads everything, keeping only the last `cap` bytes.
async fn read_tail(reader: Option<impl AsyncRead + Unpin>, cap: u64) -> Vec<u8> {
    let Some(mut reader) = reader else { return Vec::new() };
    let cap = usize::try_from(cap).unwrap_or(usize::MAX);
    let mut tail = Vec::new();
    let mut chunk = vec![0u8; 8192];
    while let Ok(n) = reader.read(&mut chunk).await {
        if n == 0 {
            break;
        }
        tail.extend_from_slice(&chunk[..n]);
        if tail.len() > cap.saturating_mul(2) {
            tail.drain(..tail.len() - cap);
        }
    }
    if tail.len() > cap {
        tail.drain(..tail.len() - cap);
    }
    tail
}
