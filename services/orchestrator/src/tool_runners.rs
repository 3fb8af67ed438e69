//! The client side of the tool-runners: one balanced gRPC channel over every configured
//! endpoint, the tool catalog (discovered with `ListTools` at start and refreshed periodically),
//! and [`ToolExecutor`] for the run loop.
//!
//! Each `RunTool` carries the run id and call id as request metadata (`x-run-id`, `x-call-id`),
//! the run's metadata in the request body, and a gRPC deadline (the call's timeout). Dropping a
//! call resets its HTTP/2 stream, which cancels the tool on the runner.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use shared::proto::toolrunner::v1 as pb;
use tonic::transport::{Channel, Endpoint};

use crate::Error;
use crate::llm::ToolDefinition;
use crate::run::{ToolCallError, ToolExecutor, ToolInvocation};

/// A tool the runners offer.
#[derive(Debug, Clone)]
pub struct RemoteTool {
    /// Name, description and schema for the model.
    pub definition: ToolDefinition,
    /// The runner's own timeout for it.
    pub timeout: Duration,
}

/// Connection to the tool-runners.
#[derive(Clone)]
pub struct ToolRunners {
    client: pb::tool_runner_client::ToolRunnerClient<Channel>,
    catalog: Arc<RwLock<BTreeMap<String, RemoteTool>>>,
    endpoints: Arc<Vec<String>>,
}

impl ToolRunners {
    /// A balanced channel over `endpoints` (`http://host:port`); connects lazily.
    pub fn new(endpoints: &[String], connect_timeout: Duration) -> Result<Self, Error> {
        if endpoints.is_empty() {
            return Err(Error::Config("at least one --tool-runner endpoint is needed".into()));
        }
        let mut list = Vec::with_capacity(endpoints.len());
        for endpoint in endpoints {
            let parsed = Endpoint::from_shared(endpoint.clone())
                .map_err(|e| Error::Config(format!("--tool-runner {endpoint:?}: {e}")))?
                .connect_timeout(connect_timeout)
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(30))
                .keep_alive_while_idle(true);
            list.push(parsed);
        }
        let channel = Channel::balance_list(list.into_iter());
        Ok(Self {
            client: pb::tool_runner_client::ToolRunnerClient::new(channel).max_decoding_message_size(64 * 1024 * 1024),
            catalog: Arc::default(),
            endpoints: Arc::new(endpoints.to_vec()),
        })
    }

    /// Fetches the tool list; on failure the previous catalog stays in use.
    pub async fn refresh(&self, timeout: Duration) -> Result<usize, String> {
        let mut request = tonic::Request::new(pb::ListToolsRequest {});
        request.set_timeout(timeout);
        let response = tokio::time::timeout(timeout, self.client.clone().list_tools(request))
            .await
            .map_err(|_| format!("ListTools on {} timed out", self.endpoints.join(", ")))?
            .map_err(|s| format!("ListTools on {} failed: {}", self.endpoints.join(", "), s.message()))?;
        let mut catalog = BTreeMap::new();
        for spec in response.into_inner().tools {
            let parameters = serde_json::from_str(&spec.parameters_json_schema)
                .unwrap_or_else(|_| serde_json::json!({"type": "object"}));
            catalog.insert(
                spec.name.clone(),
                RemoteTool {
                    definition: ToolDefinition {
                        name: spec.name,
                        description: spec.description,
                        parameters,
                    },
                    timeout: Duration::from_millis(u64::from(spec.timeout_ms)),
                },
            );
        }
        let count = catalog.len();
        *self.catalog.write().unwrap_or_else(std::sync::PoisonError::into_inner) = catalog;
        Ok(count)
    }

    /// The tools known now, by name.
    pub fn catalog(&self) -> BTreeMap<String, RemoteTool> {
        self.catalog
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Refreshes the catalog every `interval` until the returned task is aborted.
    pub fn spawn_refresher(&self, interval: Duration, timeout: Duration) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                ticker.tick().await;
                match this.refresh(timeout).await {
                    Ok(count) => tracing::debug!(tools = count, "tool catalog refreshed"),
                    Err(e) => tracing::warn!("tool catalog refresh failed (keeping the previous one): {e}"),
                }
            }
        })
    }
}

fn ascii_header(value: &str) -> Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>> {
    value.parse().ok()
}

impl ToolExecutor for ToolRunners {
    fn execute(&self, call: ToolInvocation) -> BoxFuture<'static, Result<String, ToolCallError>> {
        let mut client = self.client.clone();
        async move {
            let mut request = tonic::Request::new(pb::RunToolRequest {
                run_id: call.run_id.clone(),
                call_id: call.call_id.clone(),
                tool_name: call.name.clone(),
                arguments_json: call.arguments_json,
                metadata: call.metadata.into_iter().collect(),
            });
            request.set_timeout(call.timeout);
            shared::telemetry::inject_current(request.metadata_mut());
            if let Some(v) = ascii_header(&call.run_id) {
                request.metadata_mut().insert("x-run-id", v);
            }
            if let Some(v) = ascii_header(&call.call_id) {
                request.metadata_mut().insert("x-call-id", v);
            }
            let response = client.run_tool(request).await.map_err(|status| {
                let code = match status.code() {
                    tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => "TIMEOUT",
                    tonic::Code::ResourceExhausted | tonic::Code::Unavailable => "UNAVAILABLE",
                    tonic::Code::InvalidArgument => "INVALID_ARGUMENTS",
                    _ => "FAILED",
                };
                ToolCallError::new(code, format!("tool-runner: {:?}: {}", status.code(), status.message()))
            })?;
            match response.into_inner().outcome {
                Some(pb::run_tool_response::Outcome::ContentJson(json)) => Ok(json),
                Some(pb::run_tool_response::Outcome::Error(e)) => {
                    let code = pb::ToolErrorCode::try_from(e.code).unwrap_or(pb::ToolErrorCode::Unspecified);
                    let name = code.as_str_name().trim_start_matches("TOOL_ERROR_CODE_");
                    Err(ToolCallError::new(
                        if name == "UNSPECIFIED" { "FAILED" } else { name },
                        e.message,
                    ))
                }
                None => Err(ToolCallError::new(
                    "FAILED",
                    "the tool-runner answered with neither a result nor an error",
                )),
            }
        }
        .boxed()
    }
}
