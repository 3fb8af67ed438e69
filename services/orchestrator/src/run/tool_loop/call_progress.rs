//! Progress of the calls still running (an MCP server's `notifications/progress`, streamed by
//! the tool-runner): each call keeps only its latest report, and while the turn's calls run the
//! loop sends what came in as `tool_call_progress` once per interval (the run's stream interval,
//! at least [`EVERY`]): at most one event per call per interval, never part of the conversation.
//! A turn whose calls report nothing wakes for nothing: the loop waits for a report, then for the
//! rest of the interval (a quiet run costs no CPU while its calls run).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::Driver;
use super::durable::TurnCalls;
use crate::domain::event::Event;
use crate::domain::ports::{ProgressFn, ToolProgress};

/// The shortest interval between two progress events of one call.
const EVERY: Duration = Duration::from_millis(200);

/// The latest report of each call of the turn not sent yet, by its position in the turn.
#[derive(Clone, Default)]
pub(super) struct CallProgress {
    latest: Arc<Mutex<BTreeMap<usize, ToolProgress>>>,
    /// Wakes the loop when a report comes in.
    reported: Arc<tokio::sync::Notify>,
}

impl CallProgress {
    /// Where the reports of the call at `index` go.
    pub(super) fn of_call(&self, index: usize) -> ProgressFn {
        let (latest, reported) = (Arc::clone(&self.latest), Arc::clone(&self.reported));
        ProgressFn(Arc::new(move |report| {
            shared::sync::lock(&latest).insert(index, report);
            reported.notify_one();
        }))
    }

    fn take(&self) -> BTreeMap<usize, ToolProgress> {
        std::mem::take(&mut *shared::sync::lock(&self.latest))
    }

    /// Resolves once a report came in, and `every` has passed since the last batch was sent
    /// (`last`): a call that reports nothing never wakes the loop.
    async fn next_batch(&self, last: tokio::time::Instant, every: Duration) {
        self.reported.notified().await;
        tokio::time::sleep_until(last + every).await;
    }
}

impl Driver<'_> {
    /// Awaits `calls_running` (the turn's calls), sending their progress meanwhile.
    pub(super) async fn reporting_progress<T>(
        &mut self,
        calls_running: impl Future<Output = T>,
        calls: &TurnCalls,
    ) -> T {
        tokio::pin!(calls_running);
        let every = self.spec.stream_interval.max(EVERY);
        let mut last = tokio::time::Instant::now();
        loop {
            let progress = self.call_progress.clone();
            tokio::select! {
                biased;
                outcomes = &mut calls_running => {
                    // Reports of calls that have finished say nothing any more.
                    self.call_progress.take();
                    return outcomes;
                }
                () = progress.next_batch(last, every) => {
                    last = tokio::time::Instant::now();
                    if self.queue_progress(calls) {
                        self.emitter.flush().await;
                    }
                }
            }
        }
    }

    /// Queues `tool_call_progress` for each call that reported since the last time; whether any.
    fn queue_progress(&mut self, calls: &TurnCalls) -> bool {
        let reports = self.call_progress.take();
        let any = !reports.is_empty();
        for (index, report) in reports {
            let Some(call) = calls.sorted.calls.get(index) else {
                continue;
            };
            self.emitter.queue(Event::ToolCallProgress {
                call_id: call.id.clone(),
                name: call.name.clone(),
                turn: calls.turn.number,
                progress: report.progress,
                total: report.total,
                message: report.message,
            });
        }
        any
    }
}
