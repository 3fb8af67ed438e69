//! Callers following a run (`AttachRun`, and the caller of a run that parked): a bounded number of
//! followers reading the run's event log, and the signals that a run left this replica.

use std::sync::Arc;
use std::time::Duration;

use shared::auth::Principal;

use super::Runs;
use crate::domain::ports::{EventFeed, LogError, StoreError};

/// Why a caller cannot re-attach to a run.
#[derive(Debug)]
pub(crate) enum AttachError {
    /// No run the caller may see has this id (or its log expired).
    NotFound,
    /// The store cannot say.
    Store(StoreError),
    /// The log cannot serve it.
    Log(LogError),
    /// As many callers as allowed are attached already.
    Full(usize),
}

impl Runs {
    /// The events of a run `caller` may see (the runs `GetRun` shows it), after `after_seq`, then
    /// the live ones up to `run_finished`. With a shared store the run may live on another
    /// replica: a feed that brings nothing for a lease renewal period asks the store and the log,
    /// and ends with [`LogError::Lost`] when the run ended without its last event reaching the log.
    pub(crate) async fn attach(
        self: &Arc<Self>,
        run_id: &str,
        after_seq: u64,
        caller: &Principal,
    ) -> Result<EventFeed, AttachError> {
        if self.get(run_id, caller).await.map_err(AttachError::Store)?.is_none() {
            return Err(AttachError::NotFound);
        }
        self.follow(run_id, after_seq, caller).await
    }

    /// [`Runs::attach`] without asking whether `caller` may see the run: for the caller that
    /// started it, whose run parked and goes on from its log (between the approval store and its
    /// next slot a run is in neither place for a moment, but its log is there throughout).
    pub(crate) async fn follow(
        self: &Arc<Self>,
        run_id: &str,
        after_seq: u64,
        caller: &Principal,
    ) -> Result<EventFeed, AttachError> {
        let permit = Arc::clone(&self.attach_slots)
            .try_acquire_owned()
            .map_err(|_| AttachError::Full(self.attach_permits))?;
        let feed = self
            .log
            .follow(run_id, after_seq)
            .await
            .map_err(AttachError::Log)?
            .ok_or(AttachError::NotFound)?;
        metrics::counter!(crate::telemetry::metric::ATTACHES).increment(1);
        let feed = match self.store.lease() {
            Some(terms) => self.watched(feed, run_id, after_seq, caller, terms),
            None => feed,
        };
        // The caller's permit is held as long as its feed.
        Ok(futures::StreamExt::boxed(futures::StreamExt::map(feed, move |item| {
            let _held = &permit;
            item
        })))
    }

    /// `feed`, ended with [`LogError::Lost`] when, quiet for a renewal period of the lease, the
    /// store and the log say the run's end will never come ([`Runs::lost_end`]). Its
    /// `run_finished` is handed out once the store holds the end too ([`Runs::stored_end`]).
    fn watched(
        self: &Arc<Self>,
        feed: EventFeed,
        run_id: &str,
        after_seq: u64,
        caller: &Principal,
        terms: crate::domain::LeaseTerms,
    ) -> EventFeed {
        use futures::StreamExt;
        struct Watch {
            feed: EventFeed,
            runs: Arc<Runs>,
            run_id: String,
            caller: Principal,
            last_seq: u64,
        }
        let watch = Watch {
            feed,
            runs: Arc::clone(self),
            run_id: run_id.to_owned(),
            caller: caller.clone(),
            last_seq: after_seq,
        };
        futures::stream::unfold(watch, move |mut w| async move {
            loop {
                match tokio::time::timeout(terms.renew_every(), w.feed.next()).await {
                    Ok(Some(item)) => {
                        if let Ok(event) = &item {
                            if event.is_last() && !w.runs.stored_end(&w.run_id, &w.caller, terms.length * 2).await {
                                let unkept = LogError::Unavailable {
                                    run_id: w.run_id.clone(),
                                    reason: format!(
                                        "the run's log holds its end, the store does not yet; attach again after seq {}",
                                        w.last_seq
                                    ),
                                };
                                let mut ended = w;
                                ended.feed = futures::stream::empty().boxed();
                                return Some((Err(unkept), ended));
                            }
                            w.last_seq = event.seq;
                        }
                        return Some((item, w));
                    }
                    Ok(None) => return None,
                    Err(_quiet) => {
                        if let Some(lost) = w.runs.lost_end(&w.run_id, &w.caller, w.last_seq).await {
                            let mut ended = w;
                            ended.feed = futures::stream::empty().boxed();
                            return Some((Err(lost), ended));
                        }
                    }
                }
            }
        })
        .boxed()
    }

    /// What a quiet feed of a follower at `cursor` means, read from the store and the log, never
    /// from silence. The stored result is final and the log's last event is neither
    /// `run_finished` nor past the cursor: the end never reached the log (`Lost`). The run ended
    /// and the log holds what the feed did not bring: the feed stalled (its consumer was on a
    /// lost node), and the follower is told to attach again after its cursor (`Unavailable`),
    /// which reads the log anew. A run that goes on, or a store or log that cannot answer:
    /// nothing, the follower waits on.
    async fn lost_end(&self, run_id: &str, caller: &Principal, cursor: u64) -> Option<LogError> {
        let ended = matches!(self.get(run_id, caller).await, Ok(Some(r)) if !r.status.is_live());
        if !ended {
            return None;
        }
        let logged = self.log.last(run_id).await.ok()?;
        let replica = std::env::var("HOSTNAME").unwrap_or_else(|_| "this replica".to_owned());
        if logged.finished.is_some() || logged.seq > cursor {
            return Some(LogError::Unavailable {
                run_id: run_id.to_owned(),
                reason: format!(
                    "the run has ended and its log holds seq {} that this stream did not bring (read by {replica}); attach again after seq {cursor}",
                    logged.seq
                ),
            });
        }
        Some(LogError::Lost {
            run_id: run_id.to_owned(),
            after_seq: cursor,
            reason: format!(
                "the run has ended, and its log ends at seq {} without its end (read by {replica})",
                logged.seq
            ),
        })
    }

    /// Waits (at most `limit`) until the store says the run ended; whether it did. A durable
    /// run's log holds its end a moment before its record does (and should its owner die in
    /// between, the replica that takes the run over stores the end it finds in the log, within
    /// two leases): a follower is handed `run_finished` only once both hold it, so the result
    /// `GetRun` reads next is the end it was shown.
    async fn stored_end(&self, run_id: &str, caller: &Principal, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if matches!(self.get(run_id, caller).await, Ok(Some(r)) if !r.status.is_live()) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Resolves once the run is not live on this replica and did not end here: at once for a
    /// run that lives elsewhere, when it moves for one live here. A run that ends here never
    /// resolves it (its last events reach its followers through the log).
    pub(crate) fn moved_away(&self, run_id: &str) -> impl Future<Output = ()> + Send + 'static {
        self.left_live(run_id, true)
    }

    /// Resolves once the run, live here now, left this replica without ending (handed over, or
    /// this replica stopped acting for it); never when it is not live here, and never for a run
    /// that left its slot to wait for approvals (its log goes on wherever it resumes).
    pub(crate) fn moved_from_here(&self, run_id: &str) -> impl Future<Output = ()> + Send + 'static {
        self.left_live(run_id, false)
    }

    /// See [`Runs::moved_away`]; `elsewhere`: whether a run not live here counts as moved.
    fn left_live(&self, run_id: &str, elsewhere: bool) -> impl Future<Output = ()> + Send + 'static {
        let live = self
            .lock()
            .get(run_id)
            .map(|run| (run.gone.clone(), Arc::clone(&run.state), run.ownership().clone()));
        async move {
            let Some((gone, state, ownership)) = live else {
                if !elsewhere {
                    std::future::pending::<()>().await;
                }
                return;
            };
            gone.cancelled().await;
            // Ended here means its end was kept: one settled but never logged moved on.
            let status = shared::sync::lock(&state).status;
            if ownership.ended() || status.is_parked() {
                std::future::pending::<()>().await;
            }
        }
    }
}
