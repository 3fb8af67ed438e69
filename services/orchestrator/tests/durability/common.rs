//! What the durability tests share: runs read until they end, replicas' stores on one bucket,
//! and the events a log suite writes.

use std::time::Duration;

use async_nats::jetstream;
use orchestrator::domain::{Event, NumberedEvent, RunResult, RunStatus};
use orchestrator::store::LogBounds;
use orchestrator::store::nats::KvStore;
use proto::orchestrator::v1 as pb;
use testkit::get_run;

type TestResult = anyhow::Result<()>;

/// Run `run_id` as `url` reads it once it is no longer RUNNING (within 30 s).
pub(crate) async fn ended(url: &str, run_id: &str) -> anyhow::Result<pb::RunResult> {
    testkit::wait::until(
        &format!("{run_id} to end on {url}"),
        Duration::from_secs(30),
        || async {
            let run = get_run(url, run_id).await.ok()?;
            (run.status() != pb::RunStatus::Running).then_some(run)
        },
    )
    .await
}

/// Keeps `store`'s incarnation alive, as a serving replica's keeper does, until dropped (a store
/// without one is a replica that died: its runs lapse after a lease, and it claims nothing more).
pub(crate) fn keep(store: &KvStore) -> shared::runtime::AbortOnDrop {
    use orchestrator::domain::ports::RunJournal;
    shared::runtime::AbortOnDrop(tokio::spawn(store.keep_alive()))
}

pub(crate) async fn replica_store(
    js: &jetstream::Context,
    bucket: &str,
    owner: &str,
    lease: Duration,
) -> anyhow::Result<KvStore> {
    KvStore::open(js, bucket, Duration::from_secs(60), owner.into(), lease, 1)
        .await
        .map_err(anyhow::Error::msg)
}

/// Waits (within 10 s) until `store` lists exactly `expected` as orphans: it sees records
/// unchanged for a lease on its own clock, so the first look sees none lapsed.
pub(crate) async fn orphans_once_lapsed(store: &KvStore, expected: &[&str]) -> TestResult {
    use orchestrator::domain::ports::RunJournal;
    testkit::wait::until(&format!("orphans {expected:?}"), Duration::from_secs(10), || async {
        // Each look bounded: one stuck is given up and looked again.
        let mut orphans = tokio::time::timeout(Duration::from_secs(5), store.orphans())
            .await
            .ok()?
            .ok()?;
        orphans.sort();
        (orphans == expected).then_some(())
    })
    .await
}

pub(crate) fn log_bounds(per_run_bytes: usize) -> LogBounds {
    LogBounds {
        per_run_bytes,
        total_bytes: 64 << 20,
        keep: 100,
        keep_for: Duration::from_secs(600),
    }
}

pub(crate) fn text_event(seq: u64, text: &str) -> NumberedEvent {
    NumberedEvent {
        seq,
        event: Event::TextDelta {
            text: text.into(),
            turn: 1,
        },
    }
}

pub(crate) fn finished_event(seq: u64) -> NumberedEvent {
    NumberedEvent {
        seq,
        event: Event::RunFinished(Box::new(RunResult {
            status: RunStatus::Completed,
            text: "abc".into(),
            ..RunResult::running("logged")
        })),
    }
}
