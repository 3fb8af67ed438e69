//! MCP servers as a tool source. Each `[[mcp_servers]]` of the manifest ([`config`]) gets a
//! supervisor task that connects ([`connection`]), lists the server's tools, lists them again on
//! `notifications/tools/list_changed`, pings the server every `ping_interval`, and when the
//! session ends (a stdio server crashed; a ping went unanswered, as when an HTTP server went
//! away) reconnects with exponential backoff. The catalog reads the current tools of
//! every server from here; their calls ([`call`]) go to the live session, and fail `UNAVAILABLE`
//! (retryable) while there is none. A stdio server's lines are bounded before the client reads
//! them (`bounded.rs`).
//!
//! A server's tools are offered as `<prefix><name>` (prefix `<server>__` unless set; characters a
//! tool name may not hold become `_`), filtered by its allow / deny lists, with their own JSON
//! Schemas, validated like every tool's. While a server is down its last tool list stays
//! listed, so the orchestrator's catalog does not flap; its calls fail cleanly meanwhile.

mod bounded;
pub(crate) mod call;
pub(crate) mod config;
mod connection;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rmcp::RoleClient;
use rmcp::model::{ClientRequest, PaginatedRequestParams, PingRequest};
use rmcp::service::Peer;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::tools::ToolSpec;
use crate::tools::entry::Entry;
use call::{Link, McpTool};
use config::McpServerConfig;
use connection::{Connection, Handler};

/// First wait before reconnecting; doubled after each failure up to `restart_backoff_max`.
const FIRST_BACKOFF: Duration = Duration::from_millis(200);

/// Tools by their offered name.
type Tools = Arc<BTreeMap<String, Arc<Entry>>>;

/// One server: its configuration, live session and current tools.
struct McpServer {
    config: McpServerConfig,
    link: Arc<Link>,
    tools: RwLock<Tools>,
    /// Names of the runner's own tools, which an MCP tool may not take.
    reserved: Arc<BTreeSet<String>>,
}

/// Every MCP server of the runner; dropping it stops the supervisors (and stdio servers).
pub struct McpServers {
    servers: Vec<Arc<McpServer>>,
    /// Bumped whenever a server goes up or down (for health).
    changed: watch::Sender<()>,
    /// Set once every server's first connection attempt has ended.
    first_attempts: Vec<watch::Receiver<bool>>,
    shutdown: CancellationToken,
}

impl McpServers {
    /// Starts a supervisor per server; `reserved` are the runner's own tool names.
    pub(crate) fn start(configs: Vec<McpServerConfig>, reserved: BTreeSet<String>) -> Self {
        let reserved = Arc::new(reserved);
        let (changed, _) = watch::channel(());
        let shutdown = CancellationToken::new();
        let mut servers = Vec::new();
        let mut first_attempts = Vec::new();
        for config in configs {
            let server = Arc::new(McpServer {
                link: Arc::new(Link::new(
                    config.name.clone(),
                    config.max_message_bytes,
                    matches!(config.transport, config::Transport::Stdio { .. }),
                )),
                config,
                tools: RwLock::new(Arc::default()),
                reserved: Arc::clone(&reserved),
            });
            let (attempted, attempted_rx) = watch::channel(false);
            first_attempts.push(attempted_rx);
            tokio::spawn(Arc::clone(&server).supervise(changed.clone(), attempted, shutdown.clone()));
            servers.push(server);
        }
        Self {
            servers,
            changed,
            first_attempts,
            shutdown,
        }
    }

    /// Waits until every server has been tried once (each attempt is bounded by its
    /// `connect_timeout`), so the first `ListTools` already holds the tools of those that answered.
    pub async fn first_attempts(&self) {
        for attempted in &self.first_attempts {
            let mut attempted = attempted.clone();
            let _ = attempted.wait_for(|done| *done).await;
        }
    }

    /// The tool offered as `name`, if a server offers it.
    pub(crate) fn lookup(&self, name: &str) -> Option<Arc<Entry>> {
        self.servers.iter().find_map(|s| s.current_tools().get(name).cloned())
    }

    /// Every server's tools.
    pub fn specs(&self) -> Vec<ToolSpec> {
        self.servers
            .iter()
            .flat_map(|s| s.current_tools().values().map(|e| e.spec.clone()).collect::<Vec<_>>())
            .collect()
    }

    /// The `required` servers that are down now.
    pub fn required_down(&self) -> Vec<String> {
        self.servers
            .iter()
            .filter(|s| s.config.required && !s.link.is_up())
            .map(|s| s.config.name.clone())
            .collect()
    }

    /// Changes whenever a server goes up or down.
    pub fn watch(&self) -> watch::Receiver<()> {
        self.changed.subscribe()
    }
}

impl Drop for McpServers {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl McpServer {
    fn current_tools(&self) -> Tools {
        Arc::clone(&shared::sync::read(&self.tools))
    }

    /// Connects, serves the session until it ends, and reconnects with backoff, until shutdown.
    async fn supervise(
        self: Arc<Self>,
        changed: watch::Sender<()>,
        attempted: watch::Sender<bool>,
        shutdown: CancellationToken,
    ) {
        let name = self.config.name.clone();
        let mut backoff = FIRST_BACKOFF;
        loop {
            let handler = Handler::new(&self.config, self.link.progress.clone());
            let attempt = tokio::select! {
                attempt = tokio::time::timeout(self.config.connect_timeout, self.open(handler.clone())) => attempt,
                () = shutdown.cancelled() => return,
            };
            let attempt =
                attempt.unwrap_or_else(|_| Err(format!("no answer within {:?}", self.config.connect_timeout)));
            match attempt {
                Ok((connection, tools)) => {
                    let protocol = protocol_of(connection.service.peer());
                    tracing::info!(mcp.server = %name, mcp.protocol = %protocol, tools = tools.len(), "MCP server connected");
                    self.set_tools(tools);
                    self.link.set_peer(Some(connection.service.peer().clone()));
                    changed.send_replace(());
                    attempted.send_replace(true);
                    backoff = FIRST_BACKOFF;
                    let why = self.serve(connection, &handler, &shutdown).await;
                    self.link.set_peer(None);
                    changed.send_replace(());
                    if shutdown.is_cancelled() {
                        return;
                    }
                    tracing::warn!(mcp.server = %name, "MCP server session ended ({why}); reconnecting in {backoff:?}");
                }
                Err(e) => {
                    attempted.send_replace(true);
                    tracing::warn!(mcp.server = %name, "MCP server unavailable: {e}; retrying in {backoff:?}");
                }
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = shutdown.cancelled() => return,
            }
            backoff = (backoff * 2).min(self.config.restart_backoff_max);
        }
    }

    /// Connects and lists the tools.
    async fn open(&self, handler: Handler) -> Result<(Connection, BTreeMap<String, Arc<Entry>>), String> {
        let connection = connection::connect(&self.config, handler).await?;
        let tools = self.list(connection.service.peer()).await?;
        Ok((connection, tools))
    }

    /// Serves one session: lists the tools again when the server says they changed, pings it
    /// every `ping_interval`; returns why the session ended.
    async fn serve(&self, connection: Connection, handler: &Handler, shutdown: &CancellationToken) -> String {
        let Connection {
            service,
            _group,
            _child,
        } = connection;
        let peer = service.peer().clone();
        let ended = service.waiting();
        tokio::pin!(ended);
        let interval = self.config.ping_interval;
        let mut pings = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        pings.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                quit = &mut ended => return match quit {
                    Ok(reason) => format!("{reason:?}"),
                    Err(e) => format!("its task failed: {e}"),
                },
                () = handler.list_changed.notified() => self.relist(&peer).await,
                _ = pings.tick() => {
                    if let Err(e) = self.ping(&peer).await {
                        return e;
                    }
                }
                () = shutdown.cancelled() => return "the runner is stopping".into(),
            }
        }
    }

    /// Lists the tools again after `notifications/tools/list_changed`; on failure the last list
    /// stays.
    async fn relist(&self, peer: &Peer<RoleClient>) {
        let name = &self.config.name;
        match tokio::time::timeout(self.config.connect_timeout, self.list(peer)).await {
            Ok(Ok(tools)) => {
                tracing::info!(mcp.server = %name, tools = tools.len(), "MCP server's tool list changed");
                self.set_tools(tools);
            }
            Ok(Err(e)) => tracing::warn!(mcp.server = %name, "listing the changed tools failed: {e}"),
            Err(_) => tracing::warn!(mcp.server = %name, "listing the changed tools timed out"),
        }
    }

    /// An MCP `ping`, answered within `ping_interval`, or why the session is taken for dead.
    async fn ping(&self, peer: &Peer<RoleClient>) -> Result<(), String> {
        let ping = ClientRequest::PingRequest(PingRequest {
            method: Default::default(),
            extensions: Default::default(),
        });
        match tokio::time::timeout(self.config.ping_interval, peer.send_request(ping)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("ping failed: {e}")),
            Err(_) => Err(format!("no answer to ping within {:?}", self.config.ping_interval)),
        }
    }

    fn set_tools(&self, tools: BTreeMap<String, Arc<Entry>>) {
        *shared::sync::write(&self.tools) = Arc::new(tools);
    }

    /// `tools/list` (every page, up to `max_tools`), as catalog entries.
    async fn list(&self, peer: &Peer<RoleClient>) -> Result<BTreeMap<String, Arc<Entry>>, String> {
        let config = &self.config;
        let mut listed = Vec::new();
        let mut cursor = None;
        loop {
            let page = peer
                .list_tools(Some(PaginatedRequestParams::default().with_cursor(cursor)))
                .await
                .map_err(|e| format!("tools/list: {e}"))?;
            listed.extend(page.tools);
            if listed.len() > config.max_tools {
                tracing::warn!(mcp.server = %config.name, "the server lists more than {} tools (max_tools); the rest are not offered", config.max_tools);
                listed.truncate(config.max_tools);
                break;
            }
            cursor = page.next_cursor;
            if cursor.is_none() {
                break;
            }
        }
        let protocol = protocol_of(peer);
        let mut tools = BTreeMap::new();
        for tool in listed {
            if !config.offers(&tool.name) {
                continue;
            }
            match self.entry(&tool, &protocol) {
                Ok(entry) if tools.contains_key(&entry.spec.name) => {
                    tracing::warn!(mcp.server = %config.name, tool = %tool.name, "not offered: {} is taken by another of its tools", entry.spec.name);
                }
                Ok(entry) => {
                    tools.insert(entry.spec.name.clone(), Arc::new(entry));
                }
                Err(e) => tracing::warn!(mcp.server = %config.name, tool = %tool.name, "not offered: {e}"),
            }
        }
        Ok(tools)
    }

    /// One listed tool as a catalog entry.
    fn entry(&self, tool: &rmcp::model::Tool, protocol: &str) -> Result<Entry, String> {
        let name = offered_name(&self.config.prefix, &tool.name);
        if !shared::tools::valid_tool_name(&name) {
            return Err(format!("{name:?} is longer than 64 characters"));
        }
        if self.reserved.contains(&name) {
            return Err(format!("{name:?} is the name of one of the runner's own tools"));
        }
        let parameters = serde_json::Value::Object((*tool.input_schema).clone());
        shared::tools::check_schema(&parameters)?;
        let spec = ToolSpec {
            name,
            description: tool
                .description
                .as_deref()
                .or(tool.title.as_deref())
                .unwrap_or_default()
                .to_owned(),
            parameters,
            timeout: self.config.timeout,
            source: "mcp",
            needs_approval: self.config.needs_approval(&tool.name),
            mcp_protocol: protocol.to_owned(),
            idempotent: declared_idempotent(tool),
        };
        let call = McpTool::new(Arc::clone(&self.link), tool.name.to_string());
        Entry::new(spec, Arc::new(call))
    }
}

/// Whether the server declares the tool safe to run again: it only reads (`readOnlyHint`), or
/// a repeat has no further effect (`idempotentHint`). Hints absent read as not (MCP's defaults).
fn declared_idempotent(tool: &rmcp::model::Tool) -> bool {
    tool.annotations
        .as_ref()
        .is_some_and(|a| a.read_only_hint == Some(true) || a.idempotent_hint == Some(true))
}

/// The protocol version negotiated with the server `peer` speaks for.
fn protocol_of(peer: &Peer<RoleClient>) -> String {
    peer.peer_info()
        .map(|info| info.protocol_version.to_string())
        .unwrap_or_default()
}

/// `prefix` + `name`, with every character a tool name may not hold as `_`.
fn offered_name(prefix: &str, name: &str) -> String {
    let name: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{prefix}{name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offered_names_are_prefixed_and_valid() {
        assert_eq!(offered_name("time__", "get_current_time"), "time__get_current_time");
        assert_eq!(offered_name("", "files.read/v2"), "files_read_v2");
        assert!(shared::tools::valid_tool_name(&offered_name("x__", "a.b c")));
    }

    /// A server's tool runs again in doubt when it only reads or says a repeat changes nothing;
    /// hints absent, or a destructive tool, read as not idempotent.
    #[test]
    fn a_tool_is_idempotent_by_its_servers_hints() {
        use rmcp::model::{Tool, ToolAnnotations};
        let tool = |annotations: Option<ToolAnnotations>| {
            let mut tool = Tool::new("t", "", Arc::new(serde_json::Map::new()));
            tool.annotations = annotations;
            tool
        };
        let hints = |read_only: Option<bool>, idempotent: Option<bool>| {
            let mut a = ToolAnnotations::default();
            a.read_only_hint = read_only;
            a.idempotent_hint = idempotent;
            Some(a)
        };
        assert!(declared_idempotent(&tool(hints(Some(true), None))));
        assert!(declared_idempotent(&tool(hints(Some(false), Some(true)))));
        assert!(!declared_idempotent(&tool(hints(Some(false), Some(false)))));
        assert!(!declared_idempotent(&tool(hints(None, None))));
        assert!(!declared_idempotent(&tool(None)));
    }
}
