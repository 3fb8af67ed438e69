//! Cancels asked on other replicas (NATS store): `CancelRun` may reach any replica, and one that
//! does not run the run asks the replica that does (see `Runs::cancel`). Each replica answers the
//! asks for the runs live on it, and keeps quiet about the others; a run that is moving between
//! replicas is answered by none, and the asking replica tells its caller to try again.

use std::sync::Arc;

use futures::StreamExt;
use shared::auth::Principal;

use super::Core;
use crate::domain::ports::RemoteCancel;
use crate::registry::CancelOutcome;

/// Answers the cancels asked of this replica until the server stops.
pub(crate) async fn answer(core: Arc<Core>) {
    let Some(journal) = core.runs.durable() else { return };
    let mut asks = journal.cancel_asks().await;
    while let Some(ask) = asks.next().await {
        // The asking replica checked the caller against the run's owner; this one acts as the
        // server does.
        let answer = match core
            .runs
            .cancel_here(&ask.run_id, &Principal::default(), &ask.reason, ask.mode)
        {
            Some(CancelOutcome::Canceled) => RemoteCancel::Canceled,
            Some(CancelOutcome::EndsAfterTurn) => RemoteCancel::EndsAfterTurn,
            Some(CancelOutcome::AlreadyFinished(status)) => RemoteCancel::Finished(status),
            Some(CancelOutcome::NotFound | CancelOutcome::Unanswered) | None => continue,
        };
        tracing::info!(run_id = %ask.run_id, ?answer, "a cancel asked on another replica");
        tokio::spawn((ask.answer)(answer));
    }
}
