//! Unparking: runs waiting for approvals, from the server's side: parked runs go on once their calls are
//! decided, a timeout or their deadline passed, or they were canceled, each on a free run slot
//! (docs/architecture.md, "Approvals"). The oldest ready run goes first; with no slot free it
//! waits in the approval store, holding nothing but its checkpoint.

use std::sync::Arc;
use std::time::Duration;

use crate::registry::Unparked;
use crate::server::{Core, Resumption};

/// How often timeouts and deadlines of parked runs are looked at (and ready runs that found no
/// slot tried again).
const TICK: Duration = Duration::from_millis(250);

/// Resumes ready runs until the server stops (with an approval store of this process: a shared
/// one's parked runs are woken by the takeover).
pub(crate) async fn watch(core: Arc<Core>) {
    let approvals = Arc::clone(&core.deps.approvals);
    let Some(local) = approvals.local() else { return };
    loop {
        tokio::select! {
            biased;
            () = core.stopping.cancelled() => return,
            () = local.changed() => {}
            () = core.runs.slot_freed() => {}
            () = tokio::time::sleep(TICK) => {}
        }
        local.expire(shared::sync::unix_ms());
        resume_ready(&core).await;
    }
}

/// Resumes the ready runs while slots are free.
async fn resume_ready(core: &Arc<Core>) {
    while core.runs.free_slots() > 0 {
        match core.runs.resume_parked().await {
            Unparked::Resumed(run) => {
                let (admitted, resumed) = *run;
                core.resume(admitted, resumed, Resumption::Decided);
            }
            Unparked::Dropped => {}
            Unparked::Nothing => return,
        }
    }
}
