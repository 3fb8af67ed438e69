//! Serving: [`serve`] builds the catalog, serves gRPC (tool runner, health, reflection) on the
//! given listener, and drains when `shutdown` resolves.
//!
//! Drain sequence: the service's health turns NOT_SERVING (readiness fails, so Kubernetes stops
//! routing here; the overall status "" stays SERVING so liveness does not restart the pod), new `RunTool`
//! calls are refused with `UNAVAILABLE`, calls in flight get up to `shutdown_grace` to finish,
//! then the server stops. Calls still running after the grace period are abandoned (logged).

use std::future::Future;
use std::sync::Arc;

use proto::toolrunner::v1::tool_runner_server::ToolRunnerServer;
use tokio::net::TcpListener;
use tonic_health::ServingStatus;

use crate::admission::Admission;
use crate::catalog::Catalog;
use crate::record::CallRecords;
use crate::service::ToolRunnerService;
use crate::tools::mcp::McpServers;
use crate::tools::{Tool, builtin, manifest};
use crate::{Config, Error};

/// The gRPC service name reported by health checks.
pub const SERVICE_NAME: &str = "toolrunner.v1.ToolRunner";

/// Builds the catalog from the configuration: built-ins plus the manifest's command tools, and
/// starts the supervisors of its MCP servers (their tools join as they are listed).
pub fn build_catalog(config: &Config) -> Result<Catalog, Error> {
    let builtins = builtin::all(&config.builtins)?;
    let manifest = match &config.tools_manifest {
        Some(path) => manifest::load(path)?,
        None => manifest::Manifest::default(),
    };
    let commands = manifest
        .commands
        .into_iter()
        .map(|(spec, tool)| (spec, Arc::new(tool) as Arc<dyn Tool>))
        .collect();
    let catalog = Catalog::new(builtins, commands, config.arg_limits)?;
    if manifest.mcp_servers.is_empty() {
        return Ok(catalog);
    }
    let own = catalog.own_names();
    Ok(catalog.with_mcp(McpServers::start(manifest.mcp_servers, own)))
}

/// Keeps the service's health in step with its `required` MCP servers: NOT_SERVING while one is
/// down, until the drain (which sets NOT_SERVING for good) ends it.
#[allow(
    clippy::manual_async_fn,
    reason = "as an async fn, spawning it inside `serve` cannot prove the future Send (E0283)"
)]
fn follow_mcp_health(
    catalog: Arc<Catalog>,
    health: tonic_health::server::HealthReporter,
) -> impl Future<Output = ()> + Send + 'static {
    async move {
        let Some(mcp) = catalog.mcp() else { return };
        let mut changed = mcp.watch();
        let mut was_down = Vec::new();
        loop {
            let down = mcp.required_down();
            if down != was_down {
                if down.is_empty() {
                    tracing::info!("every required MCP server is up: SERVING");
                    health.set_service_status(SERVICE_NAME, ServingStatus::Serving).await;
                } else {
                    tracing::warn!(servers = %down.join(","), "a required MCP server is down: NOT_SERVING");
                    health.set_service_status(SERVICE_NAME, ServingStatus::NotServing).await;
                }
                was_down = down;
            }
            if changed.changed().await.is_err() {
                return;
            }
        }
    }
}

/// The drain (see the module docs): waits for `shutdown`, turns NOT_SERVING, refuses new calls
/// and gives those in flight `grace` to finish; if they do not, tells `grace_over` how many are
/// abandoned.
async fn drain(
    shutdown: impl Future<Output = ()>,
    admission: Admission,
    health: tonic_health::server::HealthReporter,
    mcp_health: tokio::task::JoinHandle<()>,
    grace: std::time::Duration,
    grace_over: tokio::sync::oneshot::Sender<usize>,
) {
    shutdown.await;
    mcp_health.abort();
    tracing::info!(in_flight = admission.in_flight(), grace = %humantime::format_duration(grace), "draining");
    health.set_service_status(SERVICE_NAME, ServingStatus::NotServing).await;
    admission.start_draining();
    match tokio::time::timeout(grace, admission.wait_idle()).await {
        Ok(()) => tracing::info!("drained: no call in flight"),
        Err(_) => {
            let _ = grace_over.send(admission.in_flight());
        }
    }
}

/// Serves on `listener` until `shutdown` resolves, then drains (see the module docs).
pub async fn serve(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    config.validate()?;
    let catalog = Arc::new(build_catalog(&config)?);
    if let Some(mcp) = catalog.mcp() {
        mcp.first_attempts().await;
    }
    let tool_names: Vec<String> = catalog.specs().into_iter().map(|s| s.name).collect();
    let address = listener
        .local_addr()
        .map_err(|e| Error::Config(format!("listener has no address: {e}")))?;
    tracing::info!(%address, tools = %tool_names.join(","), max_concurrency = config.server.max_concurrency, "tool-runner serving");

    crate::telemetry::describe();
    let options = config.security.options().map_err(Error::Config)?;
    let mut security = shared::serving::Security::start(&options, "tool-runner").await?;
    let (health, health_service) = tonic_health::server::health_reporter();
    let _health = security.serve_health(health_service.clone());
    health.set_service_status(SERVICE_NAME, ServingStatus::Serving).await;
    let mcp_health = tokio::spawn(follow_mcp_health(Arc::clone(&catalog), health.clone()));
    let reflection = shared::grpc::reflection_service(SERVICE_NAME)
        .map_err(|e| Error::Config(format!("reflection descriptors: {e}")))?;
    let reflection_v1alpha = shared::grpc::reflection_service_v1alpha(SERVICE_NAME)
        .map_err(|e| Error::Config(format!("reflection descriptors: {e}")))?;
    let fence = crate::fence::RunFence::connect(&config.fence).await?.map(Arc::new);
    let records = fence.clone().filter(|_| config.fence.records).map(|fence| {
        let id = incarnation();
        tracing::info!(incarnation = %id, "durable calls are recorded in the run store: a call sent again runs once");
        Arc::new(CallRecords::new(
            fence,
            &id,
            config.fence.runner_lease,
            config.fence.record_max_bytes,
        ))
    });
    let _liveness = records
        .clone()
        .map(|records| shared::runtime::AbortOnDrop(tokio::spawn(records.keep_alive())));
    let runner = ToolRunnerServer::new(
        ToolRunnerService::new(Arc::clone(&catalog), config.telemetry.trace_payloads())
            .with_fence(fence)
            .with_records(records.clone()),
    )
    .max_decoding_message_size(config.arg_limits.max_bytes.saturating_mul(2).saturating_add(64 * 1024));

    let admission = Admission::new(config.server.max_concurrency);
    let (grace_over_tx, grace_over_rx) = tokio::sync::oneshot::channel::<usize>();
    let drain = drain(
        shutdown,
        admission.clone(),
        health,
        mcp_health,
        config.server.shutdown_grace,
        grace_over_tx,
    );
    let grace_over = async move {
        match grace_over_rx.await {
            Ok(abandoned) => abandoned,
            // The drain finished in time; only the server future may end the select.
            Err(_) => std::future::pending().await,
        }
    };

    let server = tonic::transport::Server::builder()
        .layer(security.auth_layer(crate::telemetry::metric::AUTH_REFUSED))
        .layer(shared::grpc::GateLayer(admission))
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(runner)
        .serve_with_incoming_shutdown(security.incoming(listener), drain);
    tokio::select! {
        result = server => result?,
        abandoned = grace_over => {
            tracing::warn!(abandoned, "grace period over; stopping with calls still in flight");
        }
    }
    if let Some(records) = records {
        drop(_liveness);
        records.leave().await;
    }
    tracing::info!("tool-runner stopped");
    Ok(())
}

/// This process's incarnation: the pod's name (its host name) when it has one, and a random part
/// (a restarted pod is another incarnation).
fn incarnation() -> String {
    let random = uuid::Uuid::now_v7().simple().to_string();
    match std::env::var("HOSTNAME") {
        Ok(host) if !host.trim().is_empty() => format!("{}-{}", host.trim(), &random[20..]),
        _ => random,
    }
}
