//! A replica of the service built over given ports, with no network: the server's own `Core`
//! (admission, takeover, the loop, the persister, the registry) as a simulation drives it, with
//! stores, a model and tool-runners of its making. Nothing here is a second set of rules: each
//! method is the `Core` operation the gRPC adapter calls.

use std::sync::Arc;

use shared::auth::Principal;
use shared::runtime::AbortOnDrop;
use shared::tasks::{self, Process};

use super::Core;
pub use super::build::{NatsRuns, Ports, nats_log_options, nats_signal_options, open_nats_runs};
use crate::domain::approval::{Decision, PendingApproval};
use crate::domain::listing::{ListRequest, RunPage};
use crate::domain::{RunResult, RunSpec};
use crate::{Config, Error};

/// One replica: its `Core`, its takeover watcher (durable runs) or its unparking (runs parked in
/// this process) and, when asked for, what answers other replicas' asks.
pub struct Replica {
    core: Arc<Core>,
    _takeover: Option<AbortOnDrop>,
    _unpark: Option<AbortOnDrop>,
    _asks: Option<AbortOnDrop>,
    /// The simulated process the replica's tasks belong to (stopped and killed with it).
    process: Option<Process>,
}

impl Replica {
    /// A replica of `config` over `ports`, looking for orphaned runs when `ports` has a journal,
    /// going on with parked runs when its approval store is of this process.
    pub fn new(config: &Config, ports: Ports) -> Self {
        let core = super::build::assemble(config, ports, None, crate::agents::Agents::none());
        let takeover = core
            .runs
            .durable()
            .is_some()
            .then(|| AbortOnDrop(tasks::spawn(super::background::takeover::watch(Arc::clone(&core)))));
        let unpark = (core.deps.approvals.local().is_some())
            .then(|| AbortOnDrop(tasks::spawn(super::background::unpark::watch(Arc::clone(&core)))));
        Self {
            core,
            _takeover: takeover,
            _unpark: unpark,
            _asks: None,
            process: None,
        }
    }

    /// A replica as [`Replica::new`] makes it, as simulated process `process`: its tasks, and
    /// each call made to it, run only while the process runs (see `shared::tasks`).
    pub fn in_process(config: &Config, ports: Ports, process: Process) -> Self {
        let replica = tasks::owning(process.clone(), || Self::new(config, ports));
        Self {
            process: Some(process),
            ..replica
        }
    }

    /// `work` done by this replica's process: it waits while the process is stopped, and a
    /// killed process's call fails as a broken connection does.
    async fn held<T>(&self, work: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
        let Some(process) = &self.process else {
            return work.await;
        };
        match tasks::within(process.clone(), work).await {
            Some(done) => done,
            None => Err(Error::Call(
                "the replica's process was killed: its connection broke".to_owned(),
            )),
        }
    }

    /// The same replica answering the cancels and messages other replicas ask of it for the
    /// runs live here (as the server does with a journal).
    #[must_use]
    pub fn answering_asks(mut self) -> Self {
        let core = Arc::clone(&self.core);
        let answer = || AbortOnDrop(tasks::spawn(super::background::remote_asks::answer(core)));
        self._asks = Some(match &self.process {
            Some(process) => tasks::owning(process.clone(), answer),
            None => answer(),
        });
        self
    }

    /// Cancels run `run_id` (as `CancelRun` for an unauthenticated caller): at once, or after
    /// its turn; whether this call canceled it, and its status.
    pub async fn cancel(&self, run_id: &str, after_turn: bool) -> Result<(bool, crate::domain::RunStatus), Error> {
        let mode = match after_turn {
            true => crate::domain::CancelMode::AfterTurn,
            false => crate::domain::CancelMode::Immediate,
        };
        self.held(self.core.cancel(run_id, &Principal::anonymous(), mode)).await
    }

    /// Starts `spec` detached (as `Orchestrate` with `detached`), a run of `caller`.
    pub async fn start(&self, spec: RunSpec, caller: Principal) -> Result<(), Error> {
        let caller = Arc::new(caller);
        let metadata = tonic::metadata::MetadataMap::new();
        let (events, _) = self.held(self.core.orchestrate(spec, true, &metadata, caller)).await?;
        drop(events);
        Ok(())
    }

    /// `spec` started again by `caller` (a retry of `Orchestrate` with the same id), its stream
    /// read to its end: a finished run's replay.
    pub async fn retry(&self, spec: RunSpec, caller: Principal) -> Result<Vec<crate::domain::NumberedEvent>, Error> {
        use futures::StreamExt as _;
        let metadata = tonic::metadata::MetadataMap::new();
        self.held(async {
            let (events, _) = self.core.orchestrate(spec, false, &metadata, Arc::new(caller)).await?;
            events.collect::<Vec<_>>().await.into_iter().collect()
        })
        .await
    }

    /// The run as `GetRun` answers it.
    pub async fn get(&self, run_id: &str) -> Result<RunResult, Error> {
        self.held(self.core.get(run_id, &Principal::anonymous())).await
    }

    /// A page of the runs `request` asks for, as `ListRuns` answers it (every run: the caller is
    /// unauthenticated), and the next page's token.
    pub async fn list(&self, request: ListRequest) -> Result<(RunPage, Option<String>), Error> {
        self.held(self.core.list_runs(request, &Principal::anonymous())).await
    }

    /// The calls waiting for a person, oldest first (as `ListPendingApprovals` answers an
    /// unauthenticated caller: every run's), at most `limit`.
    pub async fn pending(&self, limit: usize) -> Result<Vec<PendingApproval>, Error> {
        Ok(self
            .held(self.core.pending(&Principal::anonymous(), None, limit))
            .await?
            .0)
    }

    /// Records `decisions` on the run's pending approvals (as `DecideToolCalls` and
    /// `AnswerToolInput` do, for an unauthenticated caller); the calls still waiting.
    pub async fn decide(&self, run_id: &str, decisions: &[Decision]) -> Result<Vec<PendingApproval>, Error> {
        Ok(self
            .held(self.core.decide(run_id, decisions, &Principal::anonymous()))
            .await?
            .1)
    }

    /// Sends `content` to live run `run_id` for its next turn boundary (as `SendMessage` for
    /// `caller`, here or on the replica that runs it): how many messages wait.
    pub async fn send_message(&self, run_id: &str, content: &str, caller: &Principal) -> Result<u32, Error> {
        let message = crate::domain::steering::UserMessage {
            content: content.to_owned(),
            name: None,
        };
        self.held(self.core.send_message(run_id, caller, message)).await
    }

    /// Follows run `run_id` after `after_seq` (as `AttachRun` answers an unauthenticated
    /// caller): its events, then an error when the stream breaks off (the caller attaches again).
    pub async fn attach(
        &self,
        run_id: &str,
        after_seq: u64,
    ) -> Result<futures::stream::BoxStream<'static, Result<crate::domain::NumberedEvent, Error>>, Error> {
        self.held(self.core.attach(run_id, after_seq, &Principal::anonymous()))
            .await
    }

    /// Drains as a SIGTERM does with a journal: refuses new runs and hands each of its runs
    /// over to other replicas at its next safe point within `grace`, the rest from their last
    /// checkpoint after it.
    pub async fn drain(&self, grace: std::time::Duration) {
        super::stop_taking_runs(&self.core);
        let hand_over = async {
            super::hand_over(&self.core, grace, super::drain_margin(grace)).await;
            Ok(())
        };
        // A killed process hands nothing over; there is nothing to say.
        let _ = self.held(hand_over).await;
    }

    /// Runs live on this replica now.
    pub fn live(&self) -> usize {
        self.core.runs.live()
    }
}
