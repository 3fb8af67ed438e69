//! One connection to an MCP server: start the stdio child (under `prlimit`, in its own process
//! group, with a cleared environment) or open the streamable-HTTP session, shake hands, and hear
//! `notifications/tools/list_changed`.

use std::sync::Arc;

use futures::StreamExt;
use rmcp::model::{ClientCapabilities, ClientConfig, Implementation};
use rmcp::service::{NotificationContext, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::async_rw::AsyncRwTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{ClientHandler, RoleClient, ServiceExt};
use tokio::sync::Notify;

use super::bounded;
use super::config::{McpServerConfig, Transport};
use crate::tools::command::GroupKiller;

/// Longest stderr line of a stdio server that is logged whole.
const STDERR_LINE_BYTES: usize = 4096;

/// What the runner tells a server about itself; it offers no client capabilities (no sampling,
/// roots or elicitation: nobody is there to answer them).
#[derive(Clone)]
pub(super) struct Handler {
    /// Woken by `notifications/tools/list_changed`.
    pub list_changed: Arc<Notify>,
}

impl ClientHandler for Handler {
    fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) -> impl Future<Output = ()> + Send + '_ {
        self.list_changed.notify_one();
        std::future::ready(())
    }

    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("tool-runner", env!("CARGO_PKG_VERSION")),
        )
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
    let service = handler.serve(transport).await.map_err(|e| e.to_string())?;
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
    let service = handler.serve(transport).await.map_err(|e| e.to_string())?;
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
