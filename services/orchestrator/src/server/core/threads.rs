//! Core's thread operations, by the rules of `threads/`: a run takes the thread it names before
//! it is let in (its busy policy acting on the run holding it through the registry), lets it go
//! when it is not let in after all, and `GetThread` / `DeleteThread`.

use futures::FutureExt;
use futures::future::BoxFuture;
use shared::auth::Principal;

use super::Core;
use crate::Error;
use crate::domain::thread::Thread;
use crate::domain::{CancelMode, RunSpec, RunStatus};
use crate::registry::Runs;
use crate::threads::{Holders, busy};

impl Holders for Runs {
    fn status<'a>(&'a self, run_id: &'a str, caller: &'a Principal) -> BoxFuture<'a, Result<Option<RunStatus>, Error>> {
        async move { Ok(self.get(run_id, caller).await?.map(|run| run.status)) }.boxed()
    }

    fn stop<'a>(&'a self, run_id: &'a str, reason: &'a str, mode: CancelMode) -> BoxFuture<'a, Result<String, Error>> {
        async move {
            let outcome = self.cancel(run_id, &Principal::anonymous(), reason, mode).await?;
            Ok(format!("{outcome:?}"))
        }
        .boxed()
    }
}

impl Core {
    /// The run of `spec` takes the thread it names (see [`busy::take`]).
    pub(crate) async fn take_thread(&self, spec: RunSpec, caller: &Principal) -> Result<(RunSpec, bool), Error> {
        busy::take(&self.threads, &*self.runs, spec, caller).await
    }

    /// A run taken over whose log held its end joins its thread, as its own replica would have
    /// had it not stopped between logging the end and adding the run (the thread joins a run
    /// once, whoever adds it).
    pub(crate) async fn end_on_thread(&self, ended: crate::registry::EndedElsewhere) {
        if let Some(thread) = &ended.spec.thread {
            self.threads
                .end_run(&ended.spec, thread, ended.conversation, ended.status)
                .await;
        }
    }

    /// The run of `spec` took its thread and was not let in: it lets the thread go.
    pub(crate) async fn leave_thread(&self, spec: &RunSpec) {
        if let Some(thread) = &spec.thread {
            self.threads.leave(&thread.thread_id, &spec.run_id).await;
        }
    }

    /// The thread, when `caller` may see it.
    pub(crate) async fn get_thread(&self, thread_id: &str, caller: &Principal) -> Result<Thread, Error> {
        self.threads.get(thread_id, caller).await
    }

    /// Deletes the thread of `caller`, unless a run holds it or waits for it.
    pub(crate) async fn delete_thread(&self, thread_id: &str, caller: &Principal) -> Result<bool, Error> {
        self.threads.delete(thread_id, caller).await
    }
}
