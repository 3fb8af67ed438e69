//! Progress of the calls still running (an MCP server's `notifications/progress`, streamed by
//! the tool-runner): each call keeps only its latest report, and while the turn's calls run the
//! loop sends what came in as `tool_call_progress` once per interval (the run's stream interval,
//! at least [`EVERY`]): at most one event per call per interval, never part of the conversation.

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
pub(super) struct CallProgress(Arc<Mutex<BTreeMap<usize, ToolProgress>>>);

impl CallProgress {
    /// Where the reports of the call at `index` go.
    pub(super) fn of_call(&self, index: usize) -> ProgressFn {
        let latest = Arc::clone(&self.0);
        ProgressFn(Arc::new(move |report| {
            shared::sync::lock(&latest).insert(index, report);
        }))
    }

    fn take(&self) -> BTreeMap<usize, ToolProgress> {
        std::mem::take(&mut *shared::sync::lock(&self.0))
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
        loop {
            tokio::select! {
                biased;
                outcomes = &mut calls_running => {
                    // Reports of calls that have finished say nothing any more.
                    self.call_progress.take();
                    return outcomes;
                }
                () = tokio::time::sleep(every) => {
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
            let Some(call) = calls.partition.calls.get(index) else {
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
