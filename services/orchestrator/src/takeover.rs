//! Takeover (durable runs, NATS store): every replica looks for runs whose replica is gone
//! (their lease lapsed) or that a draining replica handed over, every third of the lease and at
//! once when a hand-over is announced, and
//! resumes those it wins the claim of, within its free slots. A resumed run has no caller of its
//! own: callers follow it with `AttachRun`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::StreamExt;
use tracing::Instrument;

use crate::run::live::{EmitSettings, Emitter};
use crate::service::Core;
use crate::telemetry::metric;

/// Looks for orphans until the replica drains.
pub(crate) async fn watch(core: Arc<Core>) {
    let every = core.config.store.lease / 3;
    let mut handovers = match core.runs.durable() {
        Some(journal) => journal.handovers().await,
        None => return,
    };
    loop {
        tokio::select! {
            () = core.stopping.cancelled() => return,
            () = tokio::time::sleep(every) => {}
            Some(()) = handovers.next() => {}
        }
        if core.draining.load(Ordering::Acquire) {
            return;
        }
        take_over_orphans(&core).await;
    }
}

/// One look: claims and resumes orphans while slots are free.
async fn take_over_orphans(core: &Arc<Core>) {
    let Some(journal) = core.runs.durable() else { return };
    let orphans = match tokio::time::timeout(core.config.store.timeout, journal.orphans()).await {
        Ok(Ok(orphans)) => orphans,
        Ok(Err(e)) => return tracing::warn!("looking for runs to take over failed: {e}"),
        Err(_) => return tracing::warn!("looking for runs to take over timed out"),
    };
    for run_id in orphans {
        if core.runs.free_slots() == 0 || core.draining.load(Ordering::Acquire) {
            return;
        }
        match core.runs.take_over(&run_id).await {
            Ok(Some((admitted, resumed))) => resume(core, admitted, resumed, Resumption::TakenOver),
            Ok(None) => {}
            Err(e) => tracing::warn!(run_id = %run_id, "taking the run over failed: {e}"),
        }
    }
}

/// Why a run resumes here.
#[derive(Clone, Copy)]
pub(crate) enum Resumption {
    /// Taken over from a replica that stopped or handed it over.
    TakenOver,
    /// Its calls waiting for approval were decided (or it woke: a timeout, its deadline, a cancel).
    Decided,
}

/// Resumes a run taken over or unparked here, as its own task.
pub(crate) fn resume(
    core: &Arc<Core>,
    mut admitted: crate::runs::Admitted,
    resumed: crate::run::tool_loop::Resumed,
    why: Resumption,
) {
    let spec = resumed.checkpoint.spec.clone();
    let settings = EmitSettings {
        send_timeout: core.config.runs.event_send_timeout,
        max_event_bytes: core.config.runs.max_caller_event_bytes,
    };
    let emitter = Emitter::new(None, Arc::clone(&admitted.state), settings, None).with_log(admitted.log.take());
    let span = crate::telemetry::invoke_agent_span(&spec.model, &spec.run_id, &spec.principal);
    match why {
        Resumption::TakenOver => {
            tracing::info!(parent: &span, run_id = %spec.run_id, turns_done = resumed.checkpoint.turns_done, logged = resumed.logged, "took the run over");
            metrics::counter!(metric::RUNS_MOVED, "how" => "taken_over").increment(1);
        }
        Resumption::Decided => {
            tracing::info!(parent: &span, run_id = %spec.run_id, turns_done = resumed.checkpoint.turns_done, "the run goes on after its approvals");
        }
    }
    let run = admitted.into_run(spec, emitter, None);
    let deps = core.deps.clone();
    tokio::spawn(crate::run::tool_loop::resume(run, resumed, deps).instrument(span));
}
