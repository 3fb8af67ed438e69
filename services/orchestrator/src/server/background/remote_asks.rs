//! What other replicas ask of this one (NATS store): `CancelRun` and `SendMessage` may reach any
//! replica, and one that does not run the run asks the replica that does (see `Runs::cancel`
//! and `Runs::send_message`). Each replica answers the asks for the runs live on it, and keeps
//! quiet about the others; a run that is moving between replicas is answered by none, and the
//! asking replica tells its caller to try again.

use std::sync::Arc;

use futures::StreamExt;
use shared::auth::Principal;

use crate::domain::ports::{CancelAsk, RemoteCancel, RemoteSteer, SteeringAsk};
use crate::registry::{CancelOutcome, SteeringOutcome};
use crate::server::Core;

/// Answers the cancels and messages asked of this replica until the server stops.
pub(crate) async fn answer(core: Arc<Core>) {
    let Some(journal) = core.runs.durable() else { return };
    let (cancels, messages) = (journal.cancel_asks(), journal.steering_asks());
    let (mut cancels, mut messages) = tokio::join!(cancels, messages);
    loop {
        tokio::select! {
            biased;
            Some(ask) = cancels.next() => answer_cancel(&core, ask),
            Some(ask) = messages.next() => answer_message(&core, ask),
            else => return,
        }
    }
}

/// The asking replica checked the caller against the run's owner; this one acts as the server
/// does.
fn answer_cancel(core: &Arc<Core>, ask: CancelAsk) {
    let core = Arc::clone(core);
    shared::tasks::spawn(async move {
        let answer = match core
            .runs
            .cancel_here(&ask.run_id, &Principal::anonymous(), &ask.reason, ask.mode)
            .await
        {
            Some(CancelOutcome::Canceled) => RemoteCancel::Canceled,
            Some(CancelOutcome::EndsAfterTurn) => RemoteCancel::EndsAfterTurn,
            Some(CancelOutcome::AlreadyFinished(status)) => RemoteCancel::Finished(status),
            Some(CancelOutcome::NotFound | CancelOutcome::Unanswered) | None => return,
        };
        tracing::info!(run_id = %ask.run_id, ?answer, "a cancel asked on another replica");
        (ask.answer)(answer).await;
    });
}

/// As [`answer_cancel`], for a message sent to the run.
fn answer_message(core: &Core, ask: SteeringAsk) {
    let answer = match core.runs.steer_here(&ask.run_id, &Principal::anonymous(), &ask.message) {
        Some(SteeringOutcome::Accepted(waiting)) => RemoteSteer::Accepted(waiting),
        Some(SteeringOutcome::Refused(refused)) => RemoteSteer::Refused(refused),
        Some(SteeringOutcome::Finished(status)) => RemoteSteer::Finished(status),
        Some(SteeringOutcome::NotFound | SteeringOutcome::Unanswered) | None => return,
    };
    tracing::info!(run_id = %ask.run_id, ?answer, "a message sent on another replica");
    shared::tasks::spawn((ask.answer)(answer));
}
