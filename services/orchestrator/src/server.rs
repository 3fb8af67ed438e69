//! Serving: [`serve`] wires the LLM client, the tool-runners, the signal topic and the runs
//! registry, serves gRPC (orchestrator, health, reflection) on the given listener, and drains
//! when `shutdown` resolves.
//!
//! Drain: the service's health turns NOT_SERVING (the overall status "" stays SERVING, for
//! liveness), new runs get `UNAVAILABLE`, runs in flight get the grace
//! period to finish; shortly before it ends the remaining runs are canceled, so every run ends
//! with a stored result (and its stream's `run_finished`) within the grace period.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use proto::orchestrator::v1::orchestrator_server::OrchestratorServer;
use shared::runtime::AbortOnDrop;
use tokio::net::TcpListener;
use tonic_health::ServingStatus;

use crate::config::{Backend, NatsSettings};
use crate::domain::ports::{ApprovalLot, EventLog, ResultStore, RunJournal, SignalTopic};
use crate::llm::Fleet;
use crate::run::tool_loop::LoopDeps;
use crate::runs::Runs;
use crate::secrets::{NatsAuth, NatsUrl};
use crate::service::{Core, OrchestratorService};
use crate::signals::memory::MemoryTopic;
use crate::signals::nats::{NatsTopic, TopicOptions};
use crate::store::LogBounds;
use crate::store::memory::MemoryStore;
use crate::store::memory_approvals::MemoryLot;
use crate::store::memory_log::MemoryLog;
use crate::store::nats::KvStore;
use crate::store::nats_approvals::NatsLot;
use crate::store::nats_log::{NatsLog, NatsLogOptions};
use crate::tool_runners::{Resolve, SystemResolver, ToolRunners};
use crate::{Config, Error};

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
    let core = build_core(&config, model, runners).await?;
    let address = listener
        .local_addr()
        .map_err(|e| Error::Config(format!("listener has no address: {e}")))?;
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
        .map(|_| AbortOnDrop(tokio::spawn(crate::takeover::watch(Arc::clone(&core)))));
    let _cancels = core
        .runs
        .durable()
        .map(|_| AbortOnDrop(tokio::spawn(crate::cancels::answer(Arc::clone(&core)))));
    let _approvals = AbortOnDrop(tokio::spawn(crate::approvals::watch(Arc::clone(&core))));
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

/// What every run shares: the model client, the tool-runners, the signal topic and the runs
/// registry with its result store.
async fn build_core(config: &Config, model: Arc<Fleet>, runners: ToolRunners) -> Result<Arc<Core>, Error> {
    let mut connections = NatsConnections::default();
    let signals = open_signal_topic(config, &mut connections).await?;
    let (store, journal, approvals) = open_store(config, &mut connections).await?;
    let log = open_event_log(config, &mut connections).await?;
    let keeping = crate::runs::Keeping {
        store,
        log,
        journal,
        approvals: Arc::clone(&approvals),
    };
    let runs = Runs::new(
        config.runs.max_runs,
        config.runs.max_attached,
        keeping,
        config.store.timeout,
        config.store.backlog,
    );
    Ok(Arc::new(Core {
        deps: LoopDeps {
            model,
            tools: Arc::new(runners.clone()),
            signals: Arc::clone(&signals),
            detector: (&config.runs.loop_detector).into(),
            trace_payloads: config.telemetry.trace_payloads(),
            max_tool_result_bytes: config.runs.max_tool_result_bytes,
            output: (&config.runs.output).into(),
            send_reasoning: config.llm.send_reasoning,
            log_settle_timeout: config.store.timeout,
            approvals,
            max_turn_restarts: config.llm.max_retries,
        },
        runs,
        runners,
        signals,
        draining: AtomicBool::new(false),
        stopping: tokio_util::sync::CancellationToken::new(),
        config: config.clone(),
    }))
}

/// The signal topic: in memory (this replica's subscribers only) or a NATS JetStream stream.
async fn open_signal_topic(config: &Config, connections: &mut NatsConnections) -> Result<Arc<dyn SignalTopic>, Error> {
    Ok(match &config.signals.topic {
        Backend::Memory => Arc::new(MemoryTopic::new(config.signals.buffer)),
        Backend::Nats(url) => {
            let client = connections.get(url, &config.nats).await?;
            let options = TopicOptions {
                replicas: config.nats.replicas,
                ..(&config.signals).into()
            };
            let topic = NatsTopic::open(client, options).await?;
            tracing::info!(nats = %url, prefix = %config.signals.subject_prefix, stream = %config.signals.stream, "signal topic on NATS JetStream");
            Arc::new(topic)
        }
    })
}

/// The result store: in memory (bounded, this replica only) or a NATS key-value bucket shared
/// by the replicas, with this replica's lease on the runs it owns and their checkpoints (the
/// journal that lets runs outlive their replica); and where runs wait for approvals, beside it.
async fn open_store(
    config: &Config,
    connections: &mut NatsConnections,
) -> Result<(Arc<dyn ResultStore>, Option<Arc<dyn RunJournal>>, Arc<dyn ApprovalLot>), Error> {
    Ok(match &config.store.backend {
        Backend::Memory => {
            let store = MemoryStore::new(config.store.keep_results, config.store.keep_results_for);
            let lot = MemoryLot::new(config.runs.max_awaiting_runs);
            (Arc::new(store), None, Arc::new(lot))
        }
        Backend::Nats(url) => {
            let client = connections.get(url, &config.nats).await?;
            let js = async_nats::jetstream::new(client);
            let owner = replica_name();
            let store = KvStore::open(
                &js,
                &config.store.bucket,
                config.store.ttl,
                owner.clone(),
                config.store.lease,
                config.nats.replicas,
            )
            .await?
            .with_lease_margin(config.store.lease_margin());
            tracing::info!(nats = %url, bucket = %config.store.bucket, replica = %owner, "run results in NATS key-value; runs are durable");
            let store = Arc::new(store);
            let lot = NatsLot::open(&js, &config.store.bucket, config.store.ttl, Arc::clone(&store)).await?;
            (
                Arc::clone(&store) as Arc<dyn ResultStore>,
                Some(store as Arc<dyn RunJournal>),
                Arc::new(lot),
            )
        }
    })
}

/// The runs' event logs (`AttachRun`), beside the results: in memory with the memory store, in a
/// JetStream stream with the NATS store.
async fn open_event_log(config: &Config, connections: &mut NatsConnections) -> Result<Arc<dyn EventLog>, Error> {
    let store = &config.store;
    let bounds = |keep_for| LogBounds {
        per_run_bytes: store.event_log_max_bytes,
        total_bytes: store.event_log_total_bytes,
        keep: store.keep_results,
        keep_for,
    };
    Ok(match &store.backend {
        Backend::Memory => Arc::new(MemoryLog::new(bounds(store.keep_results_for))),
        Backend::Nats(url) => {
            let client = connections.get(url, &config.nats).await?;
            let options = NatsLogOptions {
                bounds: bounds(store.ttl),
                flush_interval: store.event_log_flush_interval,
                timeout: store.timeout,
                retry_for: store.lease,
                replicas: config.nats.replicas,
            };
            let log = NatsLog::open(client, &store.event_log_stream, options).await?;
            tracing::info!(nats = %url, stream = %store.event_log_stream, "run event logs in NATS JetStream");
            Arc::new(log)
        }
    })
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
    let (grace, handoff_grace) = (
        settings.shutdown_grace,
        settings.handoff_grace.min(settings.shutdown_grace),
    );
    shutdown.await;
    tracing::info!(live_runs = core.runs.live(), grace = %humantime::format_duration(grace), "draining");
    health.set_service_status(SERVICE_NAME, ServingStatus::NotServing).await;
    core.draining.store(true, Ordering::Release);
    core.stopping.cancel();
    // Keep a margin at the end of the grace period for canceled runs to store their result.
    let margin = (grace / 10).min(Duration::from_secs(1));
    if core.runs.durable().is_some() {
        hand_over(&core, handoff_grace, margin).await;
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

/// Durable runs move instead of being canceled: each hands over at its next safe point within
/// `handoff_grace`, and the rest from their last checkpoint after it.
async fn hand_over(core: &Core, handoff_grace: Duration, margin: Duration) {
    let asked = core.runs.hand_over_all(false);
    tracing::info!(
        runs = asked,
        "handing the runs over to other replicas at their next safe point"
    );
    if tokio::time::timeout(handoff_grace, core.runs.wait_idle())
        .await
        .is_err()
    {
        let forced = core.runs.hand_over_all(true);
        tracing::warn!(
            forced,
            "handoff grace over; handing the remaining runs over from their last checkpoint"
        );
        let _ = tokio::time::timeout(margin.max(Duration::from_secs(1)), core.runs.wait_idle()).await;
    }
}

/// One NATS connection per URL, shared by the signal topic and the result store.
#[derive(Default)]
struct NatsConnections(std::collections::HashMap<NatsUrl, async_nats::Client>);

impl NatsConnections {
    /// The connection to `url`, opened on first use. The client gets the address without its
    /// credentials (it logs addresses) and the credentials as options.
    async fn get(&mut self, url: &NatsUrl, options: &NatsSettings) -> Result<async_nats::Client, Error> {
        if let Some(client) = self.0.get(url) {
            return Ok(client.clone());
        }
        let mut connect = async_nats::ConnectOptions::new()
            .name("orchestrator")
            .connection_timeout(Duration::from_secs(5))
            .require_tls(options.tls_required);
        connect = match url.auth() {
            Some(NatsAuth::UserPassword(user, password)) => {
                connect.user_and_password(user.clone(), password.expose().to_owned())
            }
            Some(NatsAuth::Token(token)) => connect.token(token.expose().to_owned()),
            None => connect,
        };
        if let Some(creds) = &options.credentials {
            connect = connect
                .credentials_file(creds)
                .await
                .map_err(|e| Error::Config(format!("--nats-credentials {}: {e}", creds.display())))?;
        }
        if let Some(ca) = &options.ca_file {
            connect = connect.add_root_certificates(ca.clone());
        }
        // Every seed of a list (`nats://a:4222,nats://b:4222`): the client tries them in turn and
        // then follows the servers the cluster announces.
        let client = connect
            .connect(url.seeds())
            .await
            .map_err(|e| Error::Dependency(format!("cannot connect to NATS at {url}: {e}")))?;
        self.0.insert(url.clone(), client.clone());
        Ok(client)
    }
}

/// This replica's name in the records of its runs: the host (the pod, in Kubernetes) and a
/// suffix that differs on every start.
fn replica_name() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "orchestrator".to_owned());
    let id = uuid::Uuid::now_v7().simple().to_string();
    format!("{host}-{}", &id[id.len() - 8..])
}
