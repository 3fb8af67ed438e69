//! Building the server's shared state from the configuration: the signal topic, the store's
//! backend (results, journal, event log, approval store, threads), one NATS connection per URL, the
//! registry.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use super::Core;
use crate::agents::Agents;
use crate::config::{Backend, NatsSettings};
use crate::domain::ports::{
    ApprovalStore, EventLog, Quotas, ResultStore, RunIndex, RunJournal, SignOuts, SignalTopic, ThreadStore, UsageBook,
};
use crate::llm::Fleet;
use crate::registry::Runs;
use crate::run::tool_loop::LoopDeps;
use crate::signals::memory::MemoryTopic;
use crate::signals::nats::{NatsTopic, TopicOptions};
use crate::store::LogBounds;
use crate::store::memory::{MemoryApprovals, MemoryLog, MemorySignOuts, MemoryStore, MemoryThreads, MemoryUsage};
use crate::store::nats::{
    KvStore, NatsApprovals, NatsIndex, NatsLog, NatsLogOptions, NatsQuotas, NatsSignOuts, NatsThreads, NatsUsage, Shape,
};
use crate::threads::Keeper;
use crate::tool_runners::ToolRunners;
use crate::{Config, Error};
use shared::jetstream::JetStream;
use shared::jetstream::nats::context;
use shared::secrets::NatsUrl;

/// What every run shares: the model client, the tool-runners, the signal topic and the runs
/// registry with its result store.
pub(super) async fn core(config: &Config, model: Arc<Fleet>, runners: ToolRunners) -> Result<Arc<Core>, Error> {
    let agents = Agents::load(config.runs.agents.as_deref()).map_err(Error::Config)?;
    let ports = Ports::open(config, model, Arc::new(runners.clone())).await?;
    Ok(assemble(config, ports, Some(runners), agents))
}

/// The ports a replica's runs go through: where results, checkpoints, events, approvals and
/// threads are kept, where signals go, the model, and where tool calls run.
pub struct Ports {
    /// Results (and, shared, the runs' records and leases).
    pub store: Arc<dyn ResultStore>,
    /// Where runs are found (`ListRuns`).
    pub index: Arc<dyn RunIndex>,
    /// Each principal's `max_runs` across the fleet (a shared store only).
    pub quotas: Option<Arc<dyn Quotas>>,
    /// Each principal's spend per hour.
    pub usage: Arc<dyn UsageBook>,
    /// Checkpoints and takeover: runs outlive the replica (a shared store only).
    pub journal: Option<Arc<dyn RunJournal>>,
    /// The runs' events.
    pub log: Arc<dyn EventLog>,
    /// Calls waiting for a person.
    pub approvals: Arc<dyn ApprovalStore>,
    /// Conversations across runs.
    pub threads: Arc<dyn ThreadStore>,
    /// Console sessions people ended.
    pub sign_outs: Arc<dyn SignOuts>,
    /// Where webhooks and their deliveries are kept.
    pub webhooks: crate::webhooks::Buckets,
    /// Where exit calls go.
    pub signals: Arc<dyn SignalTopic>,
    /// The model.
    pub model: Arc<dyn crate::domain::model::ChatModel>,
    /// Where normal calls run.
    pub tools: Arc<dyn crate::domain::ports::ToolExecutor>,
}

impl Ports {
    /// The stores and the signal topic `config` names (in this process, or on NATS: one
    /// connection per URL), with `model` and `tools`.
    pub async fn open(
        config: &Config,
        model: Arc<dyn crate::domain::model::ChatModel>,
        tools: Arc<dyn crate::domain::ports::ToolExecutor>,
    ) -> Result<Self, Error> {
        let mut connections = NatsConnections::default();
        let signals = open_signal_topic(config, &mut connections).await?;
        let Stored {
            store,
            journal,
            approvals,
            index,
            quotas,
            usage,
            sign_outs,
        } = open_store(config, &mut connections).await?;
        Ok(Self {
            store,
            index,
            quotas,
            usage,
            journal,
            log: open_event_log(config, &mut connections).await?,
            approvals,
            threads: open_threads(config, &mut connections).await?,
            sign_outs,
            webhooks: open_webhooks(config, &mut connections).await?,
            signals,
            model,
            tools,
        })
    }
}

/// The server's shared state over `ports`; `runners` gives the tool catalog (`None`: the runs
/// are given their tools, as in a simulation), `agents` the named agents requests may name.
pub(super) fn assemble(config: &Config, ports: Ports, runners: Option<ToolRunners>, agents: Agents) -> Arc<Core> {
    let threads = Arc::new(Keeper::new(
        ports.threads,
        config.threads.thread_limits(),
        config.store.timeout,
    ));
    let keeping = crate::registry::Keeping {
        store: ports.store,
        log: ports.log,
        journal: ports.journal,
        approvals: Arc::clone(&ports.approvals),
        index: ports.index,
        quotas: ports.quotas,
    };
    let runs = Runs::new(
        (
            config.runs.max_runs,
            config.runs.max_attached,
            config.threads.max_steering_messages,
            config.runs.max_queued_runs,
        ),
        keeping,
        config.store.timeout,
        config.store.backlog,
    );
    Arc::new(Core {
        deps: LoopDeps {
            model: ports.model,
            tools: ports.tools,
            signals: Arc::clone(&ports.signals),
            detector: (&config.runs.loop_detector).into(),
            trace_payloads: config.telemetry.trace_payloads(),
            max_tool_result_bytes: config.runs.max_tool_result_bytes,
            output: (&config.runs.output).into(),
            send_reasoning: config.llm.send_reasoning,
            log_settle_timeout: config.store.timeout,
            approvals: ports.approvals,
            max_turn_restarts: config.llm.max_retries,
            max_input_rounds: config.runs.max_input_rounds,
            tasks: crate::run::tool_loop::TaskSettings {
                poll: crate::domain::task::PollBounds {
                    min: config.runs.task_poll_min,
                    max: config.runs.task_poll_max,
                },
                park_after: config.runs.task_park_after,
                max_follow: config.runs.task_max_follow,
            },
            threads: Some(Arc::clone(&threads)),
            usage: ports.usage,
            store_timeout: config.store.timeout,
        },
        threads,
        runs,
        runners,
        signals: ports.signals,
        draining: AtomicBool::new(false),
        stopping: tokio_util::sync::CancellationToken::new(),
        drained: tokio_util::sync::CancellationToken::new(),
        sign_outs: ports.sign_outs,
        webhooks: Arc::new(crate::webhooks::Webhooks::new(
            ports.webhooks,
            config.webhooks.clone(),
            config.store.timeout,
        )),
        agents: Arc::new(agents),
        config: config.clone(),
    })
}

/// Where threads are kept: in memory (bounded by `--max-threads`, this replica only) or a NATS
/// key-value bucket shared by the replicas, beside the runs.
async fn open_threads(config: &Config, connections: &mut NatsConnections) -> Result<Arc<dyn ThreadStore>, Error> {
    let threads = &config.threads;
    Ok(match &config.store.backend {
        Backend::Memory => Arc::new(MemoryThreads::new(threads.max_threads, threads.thread_max_age)),
        Backend::Nats(url) => {
            let js = context(connections.get(url, &config.nats).await?, None);
            let threads =
                NatsThreads::open(&js, &config.store.bucket, threads.thread_max_age, config.nats.replicas).await?;
            Arc::new(threads)
        }
    })
}

/// Where webhooks are kept: in this process with the memory store, in two NATS key-value
/// buckets beside the runs with the NATS store (deliveries then outlive the replica).
async fn open_webhooks(config: &Config, connections: &mut NatsConnections) -> Result<crate::webhooks::Buckets, Error> {
    Ok(match &config.store.backend {
        Backend::Memory => crate::webhooks::Buckets::in_memory(&config.webhooks),
        Backend::Nats(url) => {
            let js = context(connections.get(url, &config.nats).await?, None);
            let (bucket, keep, replicas) = (&config.store.bucket, config.webhooks.webhook_keep, config.nats.replicas);
            let (registrations, outbox) = crate::store::nats::webhooks::open(&js, bucket, keep, replicas).await?;
            crate::webhooks::Buckets { registrations, outbox }
        }
    })
}

/// The signal topic: in memory (this replica's subscribers only) or a NATS JetStream stream.
async fn open_signal_topic(config: &Config, connections: &mut NatsConnections) -> Result<Arc<dyn SignalTopic>, Error> {
    Ok(match &config.signals.topic {
        Backend::Memory => Arc::new(MemoryTopic::new(config.signals.buffer)),
        Backend::Nats(url) => {
            let client = connections.get(url, &config.nats).await?;
            let options = nats_signal_options(config);
            let js = context(client, Some(options.ack_timeout));
            let topic = NatsTopic::open(&js, options).await?;
            tracing::info!(nats = %url, prefix = %config.signals.subject_prefix, stream = %config.signals.stream, "signal topic on NATS JetStream");
            Arc::new(topic)
        }
    })
}

/// What the store's backend opens: results, the journal (a shared store), the approval store and
/// the run index.
struct Stored {
    store: Arc<dyn ResultStore>,
    journal: Option<Arc<dyn RunJournal>>,
    approvals: Arc<dyn ApprovalStore>,
    index: Arc<dyn RunIndex>,
    quotas: Option<Arc<dyn Quotas>>,
    usage: Arc<dyn UsageBook>,
    sign_outs: Arc<dyn SignOuts>,
}

/// The result store: in memory (bounded, this replica only) or a NATS key-value bucket shared
/// by the replicas, with this replica's lease on the runs it owns and their checkpoints (the
/// journal that lets runs outlive their replica); where runs wait for approvals, beside it; and
/// the index `ListRuns` reads.
async fn open_store(config: &Config, connections: &mut NatsConnections) -> Result<Stored, Error> {
    Ok(match &config.store.backend {
        Backend::Memory => {
            let store = Arc::new(MemoryStore::new(
                config.store.keep_results,
                config.store.keep_results_for,
            ));
            Stored {
                store: Arc::clone(&store) as Arc<dyn ResultStore>,
                journal: None,
                approvals: Arc::new(MemoryApprovals::new(config.runs.max_parked_runs)),
                index: store,
                quotas: None,
                usage: Arc::new(MemoryUsage::new(config.store.usage_keep_for)),
                sign_outs: Arc::new(MemorySignOuts::default()),
            }
        }
        Backend::Nats(url) => {
            let js = context(connections.get(url, &config.nats).await?, None);
            let owner = replica_name();
            let runs = open_nats_runs(&js, owner.clone(), config).await?;
            tracing::info!(nats = %url, bucket = %config.store.bucket, replica = %owner, "run results in NATS key-value; runs are durable");
            Stored {
                store: Arc::clone(&runs.store) as Arc<dyn ResultStore>,
                journal: Some(runs.store as Arc<dyn RunJournal>),
                approvals: Arc::new(runs.approvals),
                index: Arc::new(runs.index),
                quotas: Some(Arc::new(Arc::new(runs.quotas))),
                usage: Arc::new(runs.usage),
                sign_outs: open_sign_outs(config, &js).await?,
            }
        }
    })
}

/// What a replica keeps of its runs in NATS: the runs' records and checkpoints (with this
/// replica's lease on those it owns), their waits, the index `ListRuns` reads, the fleet's run
/// slots and the principals' spend.
pub struct NatsRuns {
    /// Records, checkpoints and fences.
    pub store: Arc<KvStore>,
    /// Runs waiting for a person or a task.
    pub approvals: NatsApprovals,
    /// `ListRuns`.
    pub index: NatsIndex,
    /// The fleet's run slots.
    pub quotas: NatsQuotas,
    /// Spend per hour.
    pub usage: NatsUsage,
}

/// Opens [`NatsRuns`] over `js` for replica `owner` as `config` sets them (its lease, margin and
/// fence grace, the buckets' replicas): every replica opens them so, the simulation's too.
pub async fn open_nats_runs(
    js: &dyn JetStream,
    owner: String,
    config: &Config,
) -> Result<NatsRuns, crate::domain::ports::StoreError> {
    let (store, replicas) = (&config.store, config.nats.replicas);
    let shape = Shape {
        bucket: &store.bucket,
        ttl: store.ttl,
        replicas,
        shards: store.shards,
    };
    let kv = KvStore::open_sharded(js, shape, owner, store.lease)
        .await?
        .with_lease_margin(store.lease_margin())
        .with_fence_grace(store.fence_grace);
    kv.announce_fence_grace().await?;
    let kv = Arc::new(kv);
    Ok(NatsRuns {
        approvals: NatsApprovals::open(js, &store.bucket, store.ttl, Arc::clone(&kv)).await?,
        index: NatsIndex::new(Arc::clone(&kv), store.list_scan_max, store.list_read_max),
        quotas: NatsQuotas::open(js, &store.bucket, store.ttl, Arc::clone(&kv)).await?,
        usage: NatsUsage::open(js, &store.bucket, store.usage_keep_for, replicas).await?,
        store: kv,
    })
}

/// The signal topic's options on NATS, as `config` sets them.
pub fn nats_signal_options(config: &Config) -> TopicOptions {
    TopicOptions {
        replicas: config.nats.replicas,
        ..(&config.signals).into()
    }
}

/// The event log's options on NATS, as `config` sets them.
pub fn nats_log_options(config: &Config) -> NatsLogOptions {
    let store = &config.store;
    NatsLogOptions {
        bounds: log_bounds(config, store.ttl),
        flush_interval: store.event_log_flush_interval,
        timeout: store.timeout,
        retry_for: store.lease,
        replicas: config.nats.replicas,
        shards: store.shards,
    }
}

/// The event log's bounds, its events kept `keep_for`.
fn log_bounds(config: &Config, keep_for: Duration) -> LogBounds {
    let store = &config.store;
    LogBounds {
        per_run_bytes: store.event_log_max_bytes,
        total_bytes: store.event_log_total_bytes,
        keep: store.keep_results,
        keep_for,
    }
}

/// Where the console's ended sessions are kept with the NATS store: a bucket every replica reads
/// when the console is on (none is made for a replica without it).
async fn open_sign_outs(config: &Config, js: &dyn JetStream) -> Result<Arc<dyn SignOuts>, Error> {
    if config.console.console_listen.is_none() {
        return Ok(Arc::new(MemorySignOuts::default()));
    }
    let (bucket, keep_for) = (&config.store.bucket, crate::config::MAX_SESSION_TTL);
    Ok(Arc::new(
        NatsSignOuts::open(js, bucket, keep_for, config.nats.replicas).await?,
    ))
}

/// The runs' event logs (`AttachRun`), beside the results: in memory with the memory store, in a
/// JetStream stream with the NATS store.
async fn open_event_log(config: &Config, connections: &mut NatsConnections) -> Result<Arc<dyn EventLog>, Error> {
    let store = &config.store;
    Ok(match &store.backend {
        Backend::Memory => Arc::new(MemoryLog::new(log_bounds(config, store.keep_results_for))),
        Backend::Nats(url) => {
            let client = connections.get(url, &config.nats).await?;
            let js = context(client, Some(store.timeout));
            let log = NatsLog::open(&js, &store.event_log_stream, nats_log_options(config)).await?;
            tracing::info!(nats = %url, stream = %store.event_log_stream, "run event logs in NATS JetStream");
            Arc::new(log)
        }
    })
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
        let access = shared::nats::Access {
            tls_required: options.tls_required,
            credentials: options.credentials.as_deref(),
            ca_file: options.ca_file.as_deref(),
        };
        let connect = shared::nats::options(url, "orchestrator", access)
            .await
            .map_err(Error::Config)?
            .connection_timeout(Duration::from_secs(5));
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
