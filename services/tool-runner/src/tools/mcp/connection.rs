//! One connection to an MCP server: start the stdio child (under `prlimit`, in its own process
//! group, with a cleared environment) or open the streamable-HTTP transport, agree on the
//! protocol (`server/discover` for 2026-07-28, falling back to the `initialize` handshake of
//! older servers; or the one version the manifest names), and hear
//! `notifications/tools/list_changed`.
//!
//! The runner offers elicitation (form and URL): a 2026-07-28 server asks its questions in its
//! answer to `tools/call` (`input_required`), which goes back to the orchestrator, where the run
//! waits for a person without holding anything here. An older server asks in the middle of the
//! call (`elicitation/create` on the session); nobody can answer within one call held open on
//! one runner, so the runner answers `cancel` (nobody answered) and logs it, never `decline` on
//! a person's behalf.

use std::sync::Arc;

use futures::StreamExt;
use rmcp::handler::client::progress::ProgressDispatcher;
use rmcp::model::ProgressNotificationParam;
use rmcp::model::{
    ClientCapabilities, ClientConfig, ElicitRequestParams, ElicitResult, ElicitationAction, ElicitationCapability,
    ErrorData, ExtensionCapabilities, FormElicitationCapability, Implementation, ProtocolVersion, TASKS_EXTENSION_ID,
    UrlElicitationCapability,
};
use rmcp::service::{ClientLifecycleMode, ClientServiceExt as _, NotificationContext, RequestContext, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::async_rw::AsyncRwTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{ClientHandler, RoleClient};
use tokio::sync::Notify;

use super::bounded;
use super::config::{McpServerConfig, Protocol, Transport};
use crate::tools::command::GroupKiller;

/// Longest stderr line of a stdio server that is logged whole.
const STDERR_LINE_BYTES: usize = 4096;

/// What the runner tells a server about itself: it offers elicitation (see the module docs) and
/// the tasks extension, not sampling or roots.
#[derive(Clone)]
pub(super) struct Handler {
    /// Woken by `notifications/tools/list_changed`.
    pub list_changed: Arc<Notify>,
    /// The server's name, for the log.
    pub server: String,
    /// The version the `initialize` handshake offers (`None`: the newest it can).
    pub handshake: Option<ProtocolVersion>,
    /// Hands each `notifications/progress` to the call that waits for it (by its token).
    pub progress: ProgressDispatcher,
}

impl Handler {
    /// The handler of a connection to the server `config` describes.
    pub(super) fn new(config: &McpServerConfig, progress: ProgressDispatcher) -> Self {
        let handshake = match &config.protocol {
            Protocol::Only(version) => serde_json::from_value(serde_json::Value::String(version.clone())).ok(),
            Protocol::Auto => None,
        };
        Self {
            list_changed: Arc::new(Notify::new()),
            server: config.name.clone(),
            handshake,
            progress,
        }
    }
}

impl ClientHandler for Handler {
    fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) -> impl Future<Output = ()> + Send + '_ {
        self.list_changed.notify_one();
        std::future::ready(())
    }

    fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) -> impl Future<Output = ()> + Send + '_ {
        self.progress.handle_notification(params)
    }

    fn get_info(&self) -> ClientConfig {
        let mut capabilities = ClientCapabilities::default();
        let mut elicitation = ElicitationCapability::new();
        elicitation.form = Some(FormElicitationCapability::new());
        elicitation.url = Some(UrlElicitationCapability::new());
        capabilities.elicitation = Some(elicitation);
        // Tasks (2026-07-28 only): a call the server makes a task goes back to the
        // orchestrator, which follows it durably (`tools/task.rs`).
        let mut extensions = ExtensionCapabilities::new();
        extensions.insert(TASKS_EXTENSION_ID.to_owned(), serde_json::Map::new());
        capabilities.extensions = Some(extensions);
        let mut config = ClientConfig::new(
            capabilities,
            Implementation::new("tool-runner", env!("CARGO_PKG_VERSION")),
        );
        if let Some(version) = &self.handshake {
            config.protocol_version = version.clone();
        }
        config
    }

    fn create_elicitation(
        &self,
        request: ElicitRequestParams,
        _context: RequestContext<RoleClient>,
    ) -> impl Future<Output = Result<ElicitResult, ErrorData>> + Send + '_ {
        let message = match &request {
            ElicitRequestParams::FormElicitationParams { message, .. }
            | ElicitRequestParams::UrlElicitationParams { message, .. } => message.clone(),
            _ => String::new(),
        };
        tracing::warn!(
            mcp.server = %self.server,
            "the server asked within a call ({message:?}), as servers older than 2026-07-28 do; nobody can answer a call held open on one runner, so the answer is cancel"
        );
        std::future::ready(Ok(ElicitResult::new(ElicitationAction::Cancel)))
    }
}

/// How the connection agrees on the protocol.
fn lifecycle(protocol: &Protocol) -> ClientLifecycleMode {
    match protocol {
        Protocol::Auto => ClientLifecycleMode::Auto {
            preferred_versions: vec![ProtocolVersion::LATEST],
            legacy_version: None,
        },
        Protocol::Only(version) if *version == ProtocolVersion::V_2026_07_28.to_string() => {
            ClientLifecycleMode::Discover {
                preferred_versions: vec![ProtocolVersion::V_2026_07_28],
            }
        }
        Protocol::Only(_) => ClientLifecycleMode::Initialize,
    }
}

/// A live session; dropping it ends the session and kills a stdio server's process group.
pub(super) struct Connection {
    pub service: RunningService<RoleClient, Handler>,
    /// The stdio child's group, killed on drop.
    pub _group: Option<GroupKiller>,
    /// The stdio child itself (reaped when dropped).
    pub _child: Option<tokio::process::Child>,
}

/// Connects and shakes hands (the caller bounds the time).
pub(super) async fn connect(config: &McpServerConfig, handler: Handler) -> Result<Connection, String> {
    match &config.transport {
        Transport::Stdio {
            prlimit,
            program,
            args,
            env,
            cwd,
            limits,
        } => {
            let child = limits.command(prlimit, program, args, env, cwd).spawn();
            let child = child.map_err(|e| format!("cannot start {}: {e}", program.display()))?;
            connect_stdio(config, child, handler)
                .await
                .map_err(|e| format!("handshake with {}: {e}", program.display()))
        }
        Transport::Http { url, headers } => connect_http(config, url, headers.clone(), handler)
            .await
            .map_err(|e| format!("handshake with {url}: {e}")),
    }
}

async fn connect_http(
    config: &McpServerConfig,
    url: &str,
    headers: std::collections::HashMap<reqwest::header::HeaderName, reqwest::header::HeaderValue>,
    handler: Handler,
) -> Result<Connection, String> {
    let mut transport_config = StreamableHttpClientTransportConfig::with_uri(url)
        .custom_headers(headers)
        .max_sse_event_size(config.max_message_bytes);
    transport_config.max_json_response_size = config.max_message_bytes;
    let client = reqwest::Client::builder()
        .connect_timeout(config.connect_timeout)
        .build()
        .map_err(|e| format!("HTTP client: {e}"))?;
    let transport = StreamableHttpClientTransport::with_client(client, transport_config);
    let service = handler
        .serve_with_lifecycle(transport, lifecycle(&config.protocol))
        .await
        .map_err(|e| e.to_string())?;
    Ok(Connection {
        service,
        _group: None,
        _child: None,
    })
}

/// Speaks MCP with the started stdio `child`, its stderr going to the log.
async fn connect_stdio(
    config: &McpServerConfig,
    mut child: tokio::process::Child,
    handler: Handler,
) -> Result<Connection, String> {
    let group = GroupKiller::of(&child);
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        return Err("the child has no stdin or stdout".into());
    };
    if let Some(stderr) = child.stderr.take() {
        log_stderr(config.name.clone(), stderr);
    }
    let (checked, stdout_lines) = tokio::io::duplex(bounded::PIPE_BYTES);
    tokio::spawn(bounded::copy_lines(
        config.name.clone(),
        stdout,
        checked,
        config.max_message_bytes,
    ));
    let transport = AsyncRwTransport::new_client(stdout_lines, stdin).with_max_line_length(config.max_message_bytes);
    let service = handler
        .serve_with_lifecycle(transport, lifecycle(&config.protocol))
        .await
        .map_err(|e| e.to_string())?;
    Ok(Connection {
        service,
        _group: Some(group),
        _child: Some(child),
    })
}

/// Logs a stdio server's stderr line by line (lines cut at [`STDERR_LINE_BYTES`]).
fn log_stderr(server: String, stderr: tokio::process::ChildStderr) {
    use tokio_util::codec::{FramedRead, LinesCodec, LinesCodecError};
    tokio::spawn(async move {
        let mut lines = FramedRead::new(stderr, LinesCodec::new_with_max_length(STDERR_LINE_BYTES));
        while let Some(line) = lines.next().await {
            match line {
                Ok(line) => tracing::info!(mcp.server = %server, "stderr: {line}"),
                Err(LinesCodecError::MaxLineLengthExceeded) => {
                    tracing::info!(mcp.server = %server, "stderr: (a line over {STDERR_LINE_BYTES} bytes, not logged)");
                }
                Err(LinesCodecError::Io(_)) => break,
            }
        }
    });
}
