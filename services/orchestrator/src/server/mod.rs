//! The server: [`serve`] wires the LLM client, the tool-runners, the signal topic, the store and
//! the runs registry (`build.rs`) into the shared state every request and background task uses,
//! serves gRPC (orchestrator, health, reflection) on the given listener, and drains when
//! `shutdown` resolves. A folder per role:
//!
//! * `core/`: the application core, [`Core`] and its operations in the domain's words (starting,
//!   resuming, reading, cancelling and steering runs; a person's decisions; threads; usage; the
//!   event streams of callers);
//! * `background/`: the tasks beside the requests (takeover, unparking, other replicas' asks);
//! * `grpc/`: the gRPC face, which only turns requests into calls of `Core` and answers into proto;
//! * `console/`: the pages for people, served on `--console-listen`, which call the gRPC face in
//!   process;
//! * `a2a/`: A2A 1.0 for other agents, served on `--a2a-listen` (JSON-RPC, agent cards), which
//!   calls the gRPC face in process too;
//! * `build.rs`: the wiring; `harness.rs`: a replica over given ports, with no network (the
//!   simulation's).
//!
//! Drain: the service's health turns NOT_SERVING (the overall status "" stays SERVING, for
//! liveness), new runs get `UNAVAILABLE`, runs in flight get the grace
//! period to finish; shortly before it ends the remaining runs are canceled, so every run ends
//! with a stored result (and its stream's `run_finished`) within the grace period.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use proto::orchestrator::v1::orchestrator_server::OrchestratorServer;
use shared::runtime::AbortOnDrop;
use tokio::net::TcpListener;
use tonic_health::ServingStatus;

use crate::llm::Fleet;
use crate::tool_runners::{Resolve, SystemResolver, ToolRunners};
use crate::{Config, Error};

mod a2a;
mod background;
mod build;
mod console;
mod core;
pub(crate) mod grpc;
pub mod harness;

pub(crate) use self::core::streams::RunEvents;
pub(crate) use self::core::{Core, Resumption};
use grpc::OrchestratorService;

/// The gRPC service name reported by health checks.
pub const SERVICE_NAME: &str = "orchestrator.v1.Orchestrator";
/// Timeout of one `ListTools`.
const LIST_TOOLS_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves on `listener` until `shutdown` resolves, then drains (see the module docs).
pub async fn serve(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    serve_with_resolver(listener, config, Arc::new(SystemResolver), shutdown).await
}

/// [`serve`] with another DNS resolver for `dns:///` tool-runner and model targets (tests script
/// answers).
pub async fn serve_with_resolver(
    listener: TcpListener,
    config: Config,
    resolver: Arc<dyn Resolve>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let config = config.without_blanks();
    config.validate()?;
    crate::telemetry::describe();
    let options = config.security.options().map_err(Error::Config)?;
    let mut security = shared::serving::Security::start(&options, "orchestrator").await?;
    let runners = ToolRunners::connect(
        &config.tool_runners,
        Arc::clone(&resolver),
        config.security.tls_reload_interval,
    )
    .await?;
    load_catalog(&runners).await;
    let refresher = AbortOnDrop(runners.spawn_refresher(config.tool_runners.refresh_interval, LIST_TOOLS_TIMEOUT));
    let model = Arc::new(
        Fleet::start(config.llm.clone(), Arc::clone(&resolver))
            .await
            .map_err(Error::Config)?,
    );
    let llm = model.shown().join(",");
    let core = build::core(&config, model, runners).await?;
    let _console = console::start(&config.console, &security, Arc::clone(&core)).await?;
    let address = listener
        .local_addr()
        .map_err(|e| Error::Config(format!("listener has no address: {e}")))?;
    let _a2a = a2a::start(&config.a2a, &security, Arc::clone(&core)).await?;
    tracing::info!(%address, %llm, model = %config.llm.model, max_runs = config.runs.max_runs, "orchestrator serving");

    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_service_status(SERVICE_NAME, ServingStatus::Serving).await;
    let _health = security.serve_health(health_service.clone());
    let reflection = shared::grpc::reflection_service(SERVICE_NAME)
        .map_err(|e| Error::Config(format!("reflection descriptors: {e}")))?;
    let reflection_v1alpha = shared::grpc::reflection_service_v1alpha(SERVICE_NAME)
        .map_err(|e| Error::Config(format!("reflection descriptors: {e}")))?;
    let service = OrchestratorServer::new(OrchestratorService::new(Arc::clone(&core)))
        .max_decoding_message_size(config.server.max_request_bytes);

    let _takeover = core
        .runs
        .durable()
        .map(|_| AbortOnDrop(shared::tasks::spawn(background::takeover::watch(Arc::clone(&core)))));
    let _cancels = core
        .runs
        .durable()
        .map(|_| AbortOnDrop(shared::tasks::spawn(background::remote_asks::answer(Arc::clone(&core)))));
    let _approvals = AbortOnDrop(shared::tasks::spawn(background::unpark::watch(Arc::clone(&core))));
    let _agents = core.agents.watch(config.security.tls_reload_interval);
    let _webhooks = AbortOnDrop(shared::tasks::spawn(
        Arc::clone(&core.webhooks).sweep(core.stopping.clone()),
    ));
    let drain = drain(Arc::clone(&core), health, &config.server, shutdown);
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .layer(security.auth_layer(crate::telemetry::metric::AUTH_REFUSED))
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(service)
        .serve_with_incoming_shutdown(security.incoming(listener), drain)
        .await?;
    drop(refresher);
    tracing::info!("orchestrator stopped");
    Ok(())
}

/// The first tool catalog. The orchestrator serves without one (runners may start later): the
/// catalog is retried on every refresh and on demand.
async fn load_catalog(runners: &ToolRunners) {
    match runners.refresh(LIST_TOOLS_TIMEOUT).await {
        Ok(count) => tracing::info!(tools = count, endpoints = %runners.endpoints().join(","), "tool catalog loaded"),
        Err(e) => tracing::warn!("{e}; serving anyway, the catalog is retried on every refresh and on demand"),
    }
}

/// The drain (see the module docs): waits for `shutdown`, then hands durable runs over to other
/// replicas, or gives the runs in flight the grace period to finish and cancels the rest shortly
/// before it ends.
async fn drain(
    core: Arc<Core>,
    health: tonic_health::server::HealthReporter,
    settings: &crate::config::ServerSettings,
    shutdown: impl Future<Output = ()>,
) {
    let (grace, hand_over_grace) = (
        settings.shutdown_grace,
        settings.hand_over_grace.min(settings.shutdown_grace),
    );
    shutdown.await;
    tracing::info!(live_runs = core.runs.live(), grace = %humantime::format_duration(grace), "draining");
    health.set_service_status(SERVICE_NAME, ServingStatus::NotServing).await;
    stop_taking_runs(&core);
    let margin = drain_margin(grace);
    if core.runs.durable().is_some() {
        hand_over(&core, hand_over_grace, margin).await;
    } else if tokio::time::timeout(grace - margin, core.runs.wait_idle())
        .await
        .is_err()
    {
        let canceled = core.runs.cancel_all("the orchestrator is shutting down");
        tracing::warn!(canceled, "grace period ending; canceled the runs still in flight");
        let _ = tokio::time::timeout(margin, core.runs.wait_idle()).await;
    }
    match core.runs.unstored() {
        0 => tracing::info!("drained"),
        n => tracing::error!(
            unstored = n,
            "drained, but the result store never took these finished results; GetRun will not find them"
        ),
    }
}

/// A draining replica refuses new runs and stops its background work (takeovers, refreshes).
fn stop_taking_runs(core: &Core) {
    core.draining.store(true, Ordering::Release);
    core.stopping.cancel();
}

/// The margin kept at the end of a drain's `grace` for canceled runs to store their result.
fn drain_margin(grace: Duration) -> Duration {
    (grace / 10).min(Duration::from_secs(1))
}

/// Durable runs move instead of being canceled: each hands over at its next safe point within
/// `hand_over_grace`, and the rest from their last checkpoint after it.
async fn hand_over(core: &Core, hand_over_grace: Duration, margin: Duration) {
    let asked = core.runs.hand_over_all(false);
    tracing::info!(
        runs = asked,
        "handing the runs over to other replicas at their next safe point"
    );
    if tokio::time::timeout(hand_over_grace, core.runs.wait_idle())
        .await
        .is_err()
    {
        let forced = core.runs.hand_over_all(true);
        tracing::warn!(
            forced,
            "hand_over grace over; handing the remaining runs over from their last checkpoint"
        );
        let _ = tokio::time::timeout(margin.max(Duration::from_secs(1)), core.runs.wait_idle()).await;
    }
    retire(core).await;
}

/// Ends this replica's incarnation once its runs were handed over: the keeper stops renewing,
/// every run still under it stops here, and its record is marked over, so what is left moves
/// at once. Until then the incarnation held the runs on their way to their safe points: marked
/// over earlier, another replica could claim a run while it still acted here.
async fn retire(core: &Core) {
    core.drained.cancel();
    if let Some(journal) = core.runs.durable() {
        let retired = tokio::time::timeout(core.config.store.timeout, journal.retire()).await;
        if retired.is_err() {
            tracing::warn!("marking the replica's incarnation over timed out: it lapses instead");
        }
    }
}
