//! The store ports of one replica: the real NATS adapters (`orchestrator::store::nats`) and
//! signal topic (`orchestrator::signals::nats`) opened over the replica's connection to the
//! simulated JetStream, as the orchestrator's own start opens them.

use std::sync::Arc;
use std::time::Duration;

use orchestrator::domain::ports::{
    ApprovalStore, EventLog, Quotas, ResultStore, RunIndex, RunJournal, SignalTopic, ThreadStore, UsageBook,
};
use orchestrator::server::harness::{nats_log_options, nats_signal_options, open_nats_runs};
use orchestrator::signals::nats::NatsTopic;
use orchestrator::store::nats::{NatsLog, NatsThreads};
use shared::jetstream::JetStream;

use crate::jetstream::Connection;

/// A replica's store ports.
pub struct Stores {
    /// Results.
    pub store: Arc<dyn ResultStore>,
    /// `ListRuns`.
    pub index: Arc<dyn RunIndex>,
    /// The fleet's run slots.
    pub quotas: Option<Arc<dyn Quotas>>,
    /// Spend.
    pub usage: Arc<dyn UsageBook>,
    /// Durable runs.
    pub journal: Arc<dyn RunJournal>,
    /// Event logs.
    pub log: Arc<dyn EventLog>,
    /// Runs waiting for a person or a task.
    pub approvals: Arc<dyn ApprovalStore>,
    /// Threads.
    pub threads: Arc<dyn ThreadStore>,
    /// Signals.
    pub signals: Arc<dyn SignalTopic>,
}

/// Pause between two attempts to open the store (a slow cluster times the first out).
const RETRY: Duration = Duration::from_millis(500);

/// The real adapters over `connection`, for replica `owner`, as `config` sets them and as the
/// orchestrator's start opens them ([`open_nats_runs`]); tried again until the cluster answers
/// (every fault heals).
pub async fn open(connection: &Connection, owner: &str, config: &orchestrator::Config) -> Stores {
    loop {
        match try_open(connection, owner, config).await {
            Ok(stores) => return stores,
            Err(e) => {
                tracing::debug!(%owner, "opening the store failed, trying again: {e}");
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

async fn try_open(js: &dyn JetStream, owner: &str, config: &orchestrator::Config) -> Result<Stores, String> {
    let runs = open_nats_runs(js, owner.to_owned(), config)
        .await
        .map_err(|e| e.to_string())?;
    let threads = NatsThreads::open(js, &config.store.bucket, config.threads.thread_max_age, 1);
    let threads = threads.await.map_err(|e| e.to_string())?;
    let log = NatsLog::open(js, &config.store.event_log_stream, nats_log_options(config));
    let log = log.await.map_err(|e| e.to_string())?;
    let signals = NatsTopic::open(js, nats_signal_options(config))
        .await
        .map_err(|e| e.to_string())?;
    Ok(Stores {
        store: Arc::clone(&runs.store) as Arc<dyn ResultStore>,
        index: Arc::new(runs.index),
        quotas: Some(Arc::new(Arc::new(runs.quotas))),
        usage: Arc::new(runs.usage),
        journal: runs.store,
        log: Arc::new(log),
        approvals: Arc::new(runs.approvals),
        threads: Arc::new(threads),
        signals: Arc::new(signals),
    })
}
