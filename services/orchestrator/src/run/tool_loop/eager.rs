//! Tools started while the model still writes (docs/architecture.md, "Eager dispatch").
//!
//! A structured call is complete in the stream once the next call began. When it is one the
//! turn would run anyway — a normal tool, arguments a JSON object within their bound, no
//! approval needed, and within the budget counted in call order — it is started at once, under
//! the same rules and with the same outcome as at the turn's end: its `tool_call_started` goes
//! out now, its result is taken when the turn dispatches its calls, failures still count once
//! per turn at the turn's end, and a turn that ends the run before its calls ran (a bad call
//! under the FAIL policy, too many calls) still records what ran. A run canceled mid-stream
//! cancels its started calls on the runners. A turn with started calls is not restarted on
//! another model endpoint (its calls ran).
//!
//! A durable run starts early only a prefix of the turn's calls (the first call it cannot start
//! ends early starts for the turn), and saves a checkpoint of the calls started so far, with the
//! turn's text so far, before each one leaves. A replica that resumes from it finishes the turn
//! as those calls ([`Driver::restore`]); a call that finished before the turn's own checkpoint
//! counts as in flight then, and runs again with the same call id.

use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::durable::{TurnCalls, TurnStart};
use super::rules::{is_json_object, started_event};
use super::{CallOutcome, Driver, ModelCall, SortedCalls, Spend, Turn};
use crate::domain::ToolCallError;
use crate::domain::assembly::AssembledCall;

/// The calls of the current turn started early.
#[derive(Default)]
pub(super) struct Eager {
    started: Vec<Started>,
    /// Structured calls of the turn looked at so far.
    seen: usize,
    /// Of them, those naming a normal tool: the budget is spent in call order.
    normal_seen: usize,
    /// A durable run's turn started no call early after one it could not: it starts a prefix.
    stopped: bool,
    /// How long the run's text and reasoning were when the turn began (for its checkpoints).
    turn_start: TurnStart,
}

/// A call started early, by its position in the turn's structured calls.
struct Started {
    index: usize,
    call: ModelCall,
    task: Option<Task>,
}

/// The call's task, aborted (the call canceled on its runner) if the run drops it.
struct Task(JoinHandle<CallOutcome>);

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Eager {
    /// Whether any call of the turn was started early.
    pub(super) fn any(&self) -> bool {
        !self.started.is_empty()
    }

    /// Calls of the turn started early.
    pub(super) fn count(&self) -> usize {
        self.started.len()
    }

    /// The call started early at `index`, if any (its id and arguments are the turn's).
    pub(super) fn call(&self, index: usize) -> Option<&ModelCall> {
        self.started.iter().find(|s| s.index == index).map(|s| &s.call)
    }

    /// The outcome of the call started early at `index` (to wait for), if there is one.
    pub(super) fn outcome(&mut self, index: usize) -> Option<impl Future<Output = CallOutcome> + use<>> {
        let started = self.started.iter_mut().find(|s| s.index == index)?;
        let task = started.task.take()?;
        Some(joined(index, task))
    }
}

/// A started call's outcome; a task that panicked or was aborted is a failed call.
async fn joined(index: usize, mut task: Task) -> CallOutcome {
    let started = Instant::now();
    match (&mut task.0).await {
        Ok(outcome) => outcome,
        Err(e) => CallOutcome {
            index,
            result: Err(ToolCallError::new("INTERNAL", format!("the call's task ended: {e}"))),
            elapsed: started.elapsed(),
            rejected: false,
            reported: false,
            asked: None,
            task: None,
        },
    }
}

impl Driver<'_> {
    /// Starts the calls that became complete in the stream since the last look, when the turn
    /// would run them (a durable run: while each before them started too).
    pub(super) async fn start_complete_calls(&mut self, turn: &Turn) {
        if !self.spec.eager_dispatch || self.eager.stopped {
            return;
        }
        let Some(completion) = self.completion.as_ref() else {
            return;
        };
        let complete = completion.collector.complete_calls();
        let calls: Vec<(usize, AssembledCall)> = (self.eager.seen..complete)
            .filter_map(|i| completion.collector.call(i).map(|c| (i, c)))
            .collect();
        self.eager.seen = self.eager.seen.max(complete);
        let durable = self.durable().is_some();
        for (index, call) in calls {
            let runs = self.runs_early(index, &call);
            if self.offer.normal.contains(call.name.as_str()) {
                self.eager.normal_seen += 1;
            }
            if runs {
                self.start_early(index, call, turn).await;
            } else if durable {
                self.eager.stopped = true;
                return;
            }
        }
    }

    /// Whether the turn would run structured call `index` whatever comes after it.
    /// The calls before it were looked at in order: `normal_seen` of them name normal tools.
    fn runs_early(&self, index: usize, call: &AssembledCall) -> bool {
        self.offer.normal.contains(call.name.as_str())
            && call.argument_bytes <= self.deps.output.max_argument_bytes
            && is_json_object(&call.arguments)
            && !self.spec.approval.needs(&call.name)
            && index < self.deps.output.max_calls_per_turn
            && self.eager.normal_seen < self.budget_left() as usize
    }

    async fn start_early(&mut self, index: usize, call: AssembledCall, turn: &Turn) {
        let call = ModelCall {
            id: self.ids.take(call.id),
            argument_bytes: call.argument_bytes,
            name: call.name,
            arguments: call.arguments,
        };
        self.emitter.queue(started_event(&call, turn.number));
        self.eager.started.push(Started {
            index,
            call: call.clone(),
            task: None,
        });
        if self.durable().is_some() {
            self.save_started_calls(turn).await;
        }
        let task = Task(shared::tasks::spawn(self.execute(
            index,
            &call,
            self.call_timeout(),
            None,
            (None, None),
        )));
        tracing::debug!(call_id = %call.id, tool = %call.name, "tool call started while the model still writes");
        if let Some(started) = self.eager.started.last_mut() {
            started.task = Some(task);
        }
    }

    /// A durable run's checkpoint of the turn so far, its calls those started early (the
    /// newest one's announcement in the outbox), saved before the newest leaves: then its
    /// announcement goes out.
    async fn save_started_calls(&mut self, turn: &Turn) {
        let Some(persister) = self.durable().cloned() else {
            return;
        };
        let started: Vec<ModelCall> = self.eager.started.iter().map(|s| s.call.clone()).collect();
        let count = started.len();
        let calls = TurnCalls {
            turn: Turn {
                number: turn.number,
                text: turn.text.clone(),
                usage: crate::domain::chat::Usage::default(),
                reasoning: turn.reasoning.clone(),
            },
            sorted: SortedCalls {
                calls: started,
                normal: (0..count).collect(),
                exit: Vec::new(),
                bad: Vec::new(),
            },
            spend: Spend {
                executed: (0..count).collect(),
                exhausted: false,
                left: self
                    .budget_left()
                    .saturating_sub(u32::try_from(count).unwrap_or(u32::MAX)),
            },
            finished: Vec::new(),
            approvals: Vec::new(),
            cut_short: Some(self.eager.turn_start),
            tasks: Vec::new(),
        };
        // A checkpoint past what the log keeps would have a replica resuming it number its
        // events past a gap: it is saved only once the log keeps every event sent.
        let kept = self.emitter.settler(self.deps.log_settle_timeout).wait().await;
        let checkpoint = self.checkpoint(Some(&calls));
        if !kept || !persister.save(|| checkpoint.snapshot()).await {
            tracing::warn!("the checkpoint of a call started early was not saved; it starts all the same");
        }
        self.emitter.flush().await;
    }

    /// A turn that ends the run before its calls were dispatched: the calls started early ran
    /// (or run to their end now) and are recorded, their failures counted.
    pub(super) async fn record_early_calls(&mut self, number: u32) {
        let mut outcomes = Vec::new();
        let mut calls = Vec::new();
        for started in &mut self.eager.started {
            if let Some(task) = started.task.take() {
                outcomes.push(joined(started.index, task).await);
                calls.push(started.call.clone());
            }
        }
        if outcomes.is_empty() {
            return;
        }
        self.progress.used_budget += u32::try_from(outcomes.len()).unwrap_or(u32::MAX);
        let any_failed = outcomes.iter().any(|o| o.result.is_err());
        let sorted = super::SortedCalls {
            normal: (0..calls.len()).collect(),
            calls,
            exit: Vec::new(),
            bad: Vec::new(),
        };
        let outcomes = outcomes
            .into_iter()
            .enumerate()
            .map(|(i, outcome)| CallOutcome { index: i, ..outcome })
            .collect();
        self.report_results(&sorted, outcomes, &[], number);
        self.count_recorded_bytes();
        self.count_failures(any_failed);
    }

    /// A new turn starts with no call started.
    pub(super) fn reset_early_calls(&mut self) {
        let state = shared::sync::lock(self.state);
        let turn_start = TurnStart {
            text_len: state.text.len(),
            reasoning_len: state.reasoning.len(),
        };
        drop(state);
        self.eager = Eager {
            turn_start,
            ..Eager::default()
        };
    }
}
