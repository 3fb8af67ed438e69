//! Takeover (durable runs, NATS store): every replica keeps its incarnation alive (the one lease
//! all its runs read), and looks for runs whose replica is gone (its incarnation lapsed) or that
//! a draining replica handed over, every third of the lease and at once when a hand-over is
//! announced, and
//! resumes those it wins the claim of, within its free slots. A resumed run has no caller of its
//! own: callers follow it with `AttachRun`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::StreamExt;

use crate::registry::TakenOver;
use crate::server::{Core, Resumption};

/// Keeps this replica's incarnation alive until its drain handed its runs over (the drain then
/// retires it), and looks for orphans until it drains.
pub(crate) async fn watch(core: Arc<Core>) {
    let Some(journal) = core.runs.durable() else { return };
    let keeping = async {
        tokio::select! {
            biased;
            () = core.drained.cancelled() => {}
            () = journal.keep_alive() => {}
        }
    };
    futures::join!(keeping, look(Arc::clone(&core)));
}

/// Looks for orphans every third of the lease, and at once when a hand-over is announced,
/// until the replica drains.
async fn look(core: Arc<Core>) {
    let every = core.config.store.lease / 3;
    let mut hand_overs = match core.runs.durable() {
        Some(journal) => journal.hand_overs().await,
        None => return,
    };
    loop {
        tokio::select! {
            biased;
            () = core.stopping.cancelled() => return,
            () = tokio::time::sleep(every) => {}
            Some(()) = hand_overs.next() => {}
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
            Ok(Some(TakenOver::Resumed(taken))) => {
                let (admitted, resumed) = *taken;
                core.resume(admitted, resumed, Resumption::TakenOver);
            }
            Ok(Some(TakenOver::Ended(ended))) => core.end_on_thread(*ended).await,
            Ok(None) => {}
            Err(e) => tracing::warn!(run_id = %run_id, "taking the run over failed: {e}"),
        }
    }
}
