//! The store ports of one replica: the port-level model's, or the real NATS adapters
//! (`orchestrator::store::nats`) opened over the replica's connection to the simulated
//! JetStream, as the orchestrator's own start opens them.

use std::sync::Arc;
use std::time::Duration;

use orchestrator::domain::LeaseTerms;
use orchestrator::domain::ports::{
    ApprovalStore, EventLog, Quotas, ResultStore, RunIndex, RunJournal, ThreadStore, UsageBook,
};
use orchestrator::store::LogBounds;
use orchestrator::store::nats::{
    KvStore, NatsApprovals, NatsIndex, NatsLog, NatsLogOptions, NatsQuotas, NatsThreads, NatsUsage,
};
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
}

/// Pause between two attempts to open the store (a slow cluster times the first out).
const RETRY: Duration = Duration::from_millis(500);

/// The real adapters over `connection`, for replica `owner`, as `config` sets them; tried again
/// until the cluster answers (every fault heals).
pub async fn open(connection: &Connection, owner: &str, config: &orchestrator::Config, terms: LeaseTerms) -> Stores {
    loop {
        match try_open(connection, owner, config, terms).await {
            Ok(stores) => return stores,
            Err(e) => {
                tracing::debug!(%owner, "opening the store failed, trying again: {e}");
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

async fn try_open(
    js: &dyn JetStream,
    owner: &str,
    config: &orchestrator::Config,
    terms: LeaseTerms,
) -> Result<Stores, orchestrator::domain::ports::StoreError> {
    let store = &config.store;
    let kv = KvStore::open(js, &store.bucket, store.ttl, owner.to_owned(), terms.length, 1)
        .await?
        .with_lease_margin(terms.margin)
        .with_fence_grace(terms.fence_grace);
    kv.announce_fence_grace().await?;
    let kv = Arc::new(kv);
    let approvals = NatsApprovals::open(js, &store.bucket, store.ttl, Arc::clone(&kv)).await?;
    let quotas = NatsQuotas::open(js, &store.bucket, store.ttl, Arc::clone(&kv)).await?;
    let usage = NatsUsage::open(js, &store.bucket, store.usage_keep_for, 1).await?;
    let threads = NatsThreads::open(js, &store.bucket, config.threads.thread_max_age, 1).await?;
    let options = NatsLogOptions {
        bounds: LogBounds {
            per_run_bytes: store.event_log_max_bytes,
            total_bytes: store.event_log_total_bytes,
            keep: store.keep_results,
            keep_for: store.ttl,
        },
        flush_interval: store.event_log_flush_interval,
        timeout: store.timeout,
        retry_for: terms.length,
        replicas: 1,
    };
    let log = NatsLog::open(js, &store.event_log_stream, options).await?;
    let index = NatsIndex::new(Arc::clone(&kv), store.list_scan_max, store.list_read_max);
    Ok(Stores {
        store: Arc::clone(&kv) as Arc<dyn ResultStore>,
        index: Arc::new(index),
        quotas: Some(Arc::new(Arc::new(quotas))),
        usage: Arc::new(usage),
        journal: kv,
        log: Arc::new(log),
        approvals: Arc::new(approvals),
        threads: Arc::new(threads),
    })
}
