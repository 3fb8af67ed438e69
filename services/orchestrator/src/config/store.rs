//! The result store: its backend, what it keeps and for how long, leases and timeouts.

use std::time::Duration;

use clap::Args;
use shared::config::{Bound, Bounded, bound, parse_duration};

use super::{Backend, DAY, MIB, ms, secs};

/// Where run results are kept for `GetRun`.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Result store")]
pub struct StoreSettings {
    /// Result store: memory (bounded by --keep-results / --keep-results-for), or nats://host:4222
    /// (a JetStream key-value bucket shared by replicas, kept across restarts).
    #[arg(long = "run-store", env = "ORCHESTRATOR_RUN_STORE", default_value = "memory")]
    pub backend: Backend,
    /// Finished results kept for GetRun (cap 1000000).
    #[arg(long, env = "ORCHESTRATOR_KEEP_RESULTS", default_value_t = 10_000)]
    pub keep_results: usize,
    /// How long finished results are kept (cap 7 days).
    #[arg(long, env = "ORCHESTRATOR_KEEP_RESULTS_FOR", default_value = "1h", value_parser = parse_duration)]
    pub keep_results_for: Duration,
    /// Key-value bucket of the NATS result store (created when missing).
    #[arg(
        long = "run-store-bucket",
        env = "ORCHESTRATOR_RUN_STORE_BUCKET",
        default_value = "orchestrator-runs"
    )]
    pub bucket: String,
    /// With the NATS store: how many shards the run store is spread over (1..=64). Each run's
    /// record, checkpoint, fence, orphan-index entries and events go to the shard a stable hash
    /// of its id picks (`<bucket>-shard-<i>`, `<event-log-stream>-shard-<i>` beside the first), so
    /// on a cluster each shard's leader may sit on another node. Fixed when the store is made and
    /// recorded in it: a replica started with another number refuses to start, naming both.
    #[arg(
        long = "run-store-shards",
        env = "ORCHESTRATOR_RUN_STORE_SHARDS",
        default_value_t = 1
    )]
    pub shards: usize,
    /// Lease of a replica's live runs in the NATS result store: the replica renews one record
    /// (its incarnation) every third of this for all its runs, so a quiet run costs the store
    /// nothing; the runs of a replica that stops renewing (crashed, partitioned) are taken over by
    /// the other replicas from their last checkpoints once it expires, or read FAILED
    /// ORCHESTRATOR_LOST when none resumes them before their deadline (1s..=10m).
    #[arg(long = "run-store-lease", env = "ORCHESTRATOR_RUN_STORE_LEASE", default_value = "15s", value_parser = parse_duration)]
    pub lease: Duration,
    /// With the NATS store: how much of its lease a replica leaves unused. It measures the lease
    /// on its own clock from the last renewal the store confirmed and, with less than this left,
    /// stops acting for the run (no tool call, signal, event or save; attached callers are told
    /// UNAVAILABLE and re-attach), so a replica cut off from NATS or paused has stopped before any
    /// other may take the run over (default a third of the lease; 100ms..=half the lease).
    #[arg(long = "run-store-lease-margin", env = "ORCHESTRATOR_RUN_STORE_LEASE_MARGIN", value_parser = parse_duration)]
    pub lease_margin: Option<Duration>,
    /// With the NATS store: how long a replica that took a run over waits, once its claim
    /// raised the run's fence, before its first tool call. A tool-runner's fence read answered
    /// just before the raise may start its tool until the runner's --run-store-timeout is over,
    /// so this must be longer (0..=1m): kept in the store at start, and each runner checks its
    /// timeout against it, refusing durable calls (naming both settings) when it does not fit.
    #[arg(long = "run-fence-grace", env = "ORCHESTRATOR_RUN_FENCE_GRACE", default_value = "2s", value_parser = parse_duration)]
    pub fence_grace: Duration,
    /// How long the NATS result store keeps a result (cap 365d; with NATS at least
    /// --run-timeout-ceiling: a live run's entries are written once).
    #[arg(long = "run-store-ttl", env = "ORCHESTRATOR_RUN_STORE_TTL", default_value = "24h", value_parser = parse_duration)]
    pub ttl: Duration,
    /// How long one read or write of the result store may take (cap 1m).
    #[arg(long = "store-timeout", env = "ORCHESTRATOR_STORE_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Finished results kept in memory while the store cannot take them (NATS down), written
    /// again when it is back (GetRun reads such a run as running, with its output, until then);
    /// the oldest is dropped past this (1..=1000000).
    #[arg(
        long = "run-store-backlog",
        env = "ORCHESTRATOR_RUN_STORE_BACKLOG",
        default_value_t = 10_000
    )]
    pub backlog: usize,
    /// Bytes of one run's events kept for AttachRun; past them its oldest events are dropped (a
    /// re-attach from a recent seq still works, a replay from the start is refused OUT_OF_RANGE)
    /// (64 KiB..=1 GiB).
    #[arg(long, env = "ORCHESTRATOR_EVENT_LOG_MAX_BYTES", default_value_t = 8 * MIB)]
    pub event_log_max_bytes: usize,
    /// Bytes of all runs' event logs together: the oldest finished runs' logs are dropped first
    /// (in memory, or the JetStream stream's max bytes with the NATS store) (1 MiB..=1 TiB).
    #[arg(long, env = "ORCHESTRATOR_EVENT_LOG_TOTAL_BYTES", default_value_t = 256 * MIB)]
    pub event_log_total_bytes: usize,
    /// With the NATS store: how long a run's events are gathered into one message of its event
    /// log (run_finished goes at once), so the log is never written once per token (1ms..=5s).
    #[arg(long, env = "ORCHESTRATOR_EVENT_LOG_FLUSH_INTERVAL", default_value = "50ms", value_parser = parse_duration)]
    pub event_log_flush_interval: Duration,
    /// With the NATS store: the JetStream stream of the runs' event logs (created when missing;
    /// subjects `<stream>.run.>`).
    #[arg(long, env = "ORCHESTRATOR_EVENT_LOG_STREAM", default_value = "ORCHESTRATOR_EVENTS")]
    pub event_log_stream: String,
    /// How long each principal's spend per hour is kept (GetUsage; in memory, or in the NATS
    /// store's `<bucket>-usage`) (1h..=365d).
    #[arg(long, env = "ORCHESTRATOR_USAGE_KEEP_FOR", default_value = "7d", value_parser = parse_duration)]
    pub usage_keep_for: Duration,
    /// The longest span one GetUsage call reads, an hour a window (1h..=31d).
    #[arg(long, env = "ORCHESTRATOR_USAGE_MAX_RANGE", default_value = "7d", value_parser = parse_duration)]
    pub usage_max_range: Duration,
    /// The most rows of one ListRuns page (1..=5000).
    #[arg(long, env = "ORCHESTRATOR_LIST_PAGE_MAX", default_value_t = 500)]
    pub list_page_max: usize,
    /// With the NATS store: the most positions of the run index one ListRuns call walks; a
    /// listing whose filters match few runs goes on from its next_page_token (100..=10000000).
    #[arg(long, env = "ORCHESTRATOR_LIST_SCAN_MAX", default_value_t = 200_000)]
    pub list_scan_max: u64,
    /// With the NATS store: the most run records one ListRuns call reads (one per run its
    /// index entry and time filters let through) (10..=100000).
    #[arg(long, env = "ORCHESTRATOR_LIST_READ_MAX", default_value_t = 2_000)]
    pub list_read_max: usize,
}

impl StoreSettings {
    /// See [`StoreSettings::lease_margin`]: a third of the lease unless set.
    pub fn lease_margin(&self) -> Duration {
        self.lease_margin.unwrap_or(self.lease / 3)
    }
}

impl Bounded for StoreSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("keep_results", self.keep_results, 0usize, 1_000_000usize),
            bound("keep_results_for", self.keep_results_for, Duration::ZERO, DAY * 7),
            bound("shards", self.shards, 1usize, shared::jetstream::shards::MAX_SHARDS),
            bound("ttl", self.ttl, secs(1), DAY * 365),
            bound("lease", self.lease, secs(1), secs(600)),
            bound("lease_margin", self.lease_margin(), ms(100), self.lease / 2),
            bound("fence_grace", self.fence_grace, Duration::ZERO, secs(60)),
            bound("timeout", self.timeout, ms(10), secs(60)),
            bound("backlog", self.backlog, 1usize, 1_000_000usize),
            bound("list_page_max", self.list_page_max, 1usize, 5000usize),
            bound("usage_keep_for", self.usage_keep_for, secs(3600), DAY * 365),
            bound("usage_max_range", self.usage_max_range, secs(3600), DAY * 31),
            bound("list_scan_max", self.list_scan_max, 100u64, 10_000_000u64),
            bound("list_read_max", self.list_read_max, 10usize, 100_000usize),
            bound(
                "event_log_max_bytes",
                self.event_log_max_bytes,
                64 * 1024usize,
                1024 * MIB,
            ),
            bound(
                "event_log_total_bytes",
                self.event_log_total_bytes,
                MIB,
                1024 * 1024 * MIB,
            ),
            bound(
                "event_log_flush_interval",
                self.event_log_flush_interval,
                ms(1),
                secs(5),
            ),
        ]
    }
}
