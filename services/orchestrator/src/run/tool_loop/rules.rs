//! `Driver::turn` and the rules of a turn, one method each, in the order they apply (see the
//! module docs of the loop).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use shared::sync::lock;
use tokio::time::Instant;
use tracing::Instrument;

use super::*;
use crate::domain::chat::{Message, ToolCall, Usage};
use crate::domain::model::ChatRequest;
use crate::domain::ports::{OnDelivery, ToolInvocation, ToolOutput};
use crate::domain::{Delivery, Event, FailureReason, ParsePolicy, RunStatus, Signal, ToolCallError, ToolCallRecord};
use crate::run::bios::{BiosContext, Status, append_note, render, status_note};
use crate::run::fallback::Resolution;
use crate::run::turn::TurnOutput;
use crate::telemetry::{self, InFlight, metric};

use super::durable::TurnCalls;

impl Driver<'_> {
    /// One turn: every rule in order; `Err` when the run ends with it.
    pub(super) async fn turn(&mut self, number: u32) -> Step<()> {
        // Boxed: the model's half (its stream, the parser) is the larger state by far, and a
        // run spends its quiet time in the tools' half, which then holds only its own.
        let calls = Box::pin(self.model_half(number)).await;
        // Booked before the turn's first checkpoint (safe point (a)) holds what was booked: a
        // run that parks, or is taken over, after it never books the turn again.
        self.account_turn().await;
        self.tools_half(calls?, true).await
    }

    /// The rules up to the turn's calls ([`Driver::calls_of_turn`]); a turn that ends the run
    /// here still records the calls it started while the model wrote.
    async fn model_half(&mut self, number: u32) -> Step<TurnCalls> {
        self.reset_early_calls();
        let calls = self.calls_of_turn(number).await;
        if calls.is_err() && self.eager.any() {
            self.record_early_calls(number).await;
        }
        calls
    }

    /// The rules up to the turn's calls: the model's completion, its calls sorted, signals
    /// published, the parse policy and the budget applied. `Err` when the run ends with them
    /// (the model called no normal tool: the run is complete, unless messages sent to it wait).
    async fn calls_of_turn(&mut self, number: u32) -> Step<TurnCalls> {
        let allowance = self.allow_turn(number).await?;
        lock(self.state).turns = number;
        let mut turn = Turn {
            number,
            text: String::new(),
            usage: Usage::default(),
            reasoning: String::new(),
        };
        let budget_before = self.budget_left();
        let output = self.complete_turn(number, &mut turn, allowance).await?;
        let calls = self.take_calls(output, &mut turn).await?;
        self.within_output_for_calls(&calls)?;
        let sorted = self.sort_calls(calls);
        self.publish_signals(&sorted, number);
        self.count_recorded_bytes();
        self.apply_parse_policy(&sorted, &turn, budget_before)?;
        let spend = self.spend_budget(&sorted);
        if spend.executed.is_empty() && sorted.bad.is_empty() {
            // The model answered: the run ends, unless messages sent to it wait (the turn then
            // ends as one without calls, and the next one takes them).
            let end = self.budget_end(&spend, &sorted);
            if end.is_some() || !self.messages_wait(number) {
                self.finish_turn(&turn, spend.left);
                // The answer ends the conversation (a run on a thread leaves it there).
                self.append_to_conversation(&mut turn, Vec::new());
                return Err(end.unwrap_or(End::Completed));
            }
        }
        let mut calls = TurnCalls {
            turn,
            sorted,
            spend,
            finished: Vec::new(),
            approvals: Vec::new(),
            cut_short: None,
            tasks: Vec::new(),
        };
        calls.approvals = self.calls_needing_approval(&calls);
        Ok(calls)
    }

    /// The rules from the turn's calls on: announced (safe point (a), unless `announce` is false
    /// for a resumed turn whose checkpoint holds the announcement), run concurrently (those
    /// waiting for approval once decided, those that asked questions again once answered; see
    /// [`super::approvals`]), reported, failures counted, the conversation extended. `Err` when a
    /// limit ends the run, or the run parks.
    pub(super) async fn tools_half(&mut self, mut calls: TurnCalls, announce: bool) -> Step<()> {
        if announce {
            self.announce_calls(&calls);
            self.ask_for_approval(&mut calls).await?;
        }
        self.apply_decisions(&mut calls).await?;
        self.safe_point(Some(&calls)).await?;
        // The calls that finished before this replica resumed the turn are not run again, and
        // stay in the checkpoints taken as the others finish.
        self.run_unfinished(&mut calls).await?;
        // Each round a call asks again counts against its bound, and a task ends (or its run's
        // deadline does), so this ends.
        while calls.undecided() || !calls.tasks.is_empty() {
            self.report_while_waiting(&mut calls).await?;
            if calls.undecided() {
                self.await_decisions(&mut calls).await?;
                self.apply_decisions(&mut calls).await?;
                self.safe_point(Some(&calls)).await?;
            } else {
                self.await_tasks(&mut calls).await?;
            }
            self.run_unfinished(&mut calls).await?;
        }
        self.report_turn(calls)
    }

    /// Runs the calls not finished yet (a call that became a task: its next poll); those that
    /// asked questions wait for the answers, those still running as tasks are followed.
    async fn run_unfinished(&mut self, calls: &mut TurnCalls) -> Step<()> {
        let ran = self.dispatch(calls).await;
        let (ran, given_up) = self.take_tasks(calls, ran);
        self.cancel_given_up_tasks(given_up).await;
        let asked = self.take_questions(calls, ran);
        self.ask_for_input(calls, &asked).await?;
        self.ask_again_in_doubt(calls).await
    }

    /// The turn's outcomes reported, failures counted (a call a person rejected is no failure),
    /// the conversation extended.
    fn report_turn(&mut self, mut calls: TurnCalls) -> Step<()> {
        let number = calls.turn.number;
        let outcomes = std::mem::take(&mut calls.finished);
        let approvals = std::mem::take(&mut calls.approvals);
        let TurnCalls {
            mut turn,
            sorted,
            spend,
            ..
        } = calls;
        let any_failed = !sorted.bad.is_empty() || outcomes.iter().any(|o| o.result.is_err() && !o.rejected);
        let fed_back = self.report_results(&sorted, outcomes, &approvals, number);
        self.count_recorded_bytes();
        self.count_failures(any_failed);
        self.append_to_conversation(&mut turn, fed_back);
        self.finish_turn(&turn, spend.left);
        self.check_failure_limit()?;
        if let Some(end) = self.budget_end(&spend, &sorted) {
            return Err(end);
        }
        if number < self.max_turns {
            self.note_status(number);
        }
        Ok(())
    }

    /// The request of a turn: the BIOS (fixed for the run), the caller's system message, the
    /// thread's messages (a run on a thread), the caller's messages, then the turns so far with
    /// their status notes. Nothing before the newest turn
    /// changes, so each request starts with the previous one byte for byte and the model
    /// server's prefix cache holds all but the newest messages.
    pub(super) fn chat_request(&self, turn: u32) -> ChatRequest {
        let (spec, limits) = (self.spec, self.spec.limits);
        let bios = render(&BiosContext {
            max_turns: self.max_turns,
            normal_tools: &spec.normal_tools,
            exit_tools: &spec.exit_tools,
            tool_call_budget: limits.tool_call_budget,
            max_tool_failures: limits.max_tool_failures,
        });
        let history = spec.thread.as_ref().map_or(&[][..], |t| &t.history[..]);
        let mut messages = Vec::with_capacity(2 + history.len() + spec.messages.len() + self.conversation.len());
        messages.push(Message::System(bios));
        if !spec.system.is_empty() {
            messages.push(Message::System(spec.system.clone()));
        }
        messages.extend(history.iter().cloned());
        // A thread whose last run ended before its model answered ends with that run's prompt:
        // the request's first user message joins it (templates refuse two user messages in a row).
        let mut asked = spec.messages.iter().cloned();
        if let (Some(Message::User { .. }), Some(Message::User { content, name })) =
            (messages.last(), spec.messages.first())
        {
            crate::domain::chat::append_user(&mut messages, content, name.clone());
            asked.next();
        }
        messages.extend(asked);
        messages.extend(self.conversation.iter().cloned());
        ChatRequest {
            model: spec.model.clone(),
            messages,
            tools: self.offer.tools.clone(),
            params: spec.params.for_turn(turn),
            pace: crate::domain::model::ReadPace::default(),
            affinity: match spec.affinity_key.as_str() {
                "" => spec.run_id.clone(),
                key => key.to_owned(),
            },
            avoid: None,
            prefix: self.prefix.clone(),
        }
    }

    /// The run goes on after turn `ended`: what changed (the turn, the budget and the failures
    /// left) is noted after the turn's tool messages, where it stays for every later request.
    pub(super) fn note_status(&mut self, ended: u32) {
        let note = status_note(Status {
            turn: ended + 1,
            max_turns: self.max_turns,
            budget_remaining: self.budget_left(),
            failures_remaining: self
                .spec
                .limits
                .max_tool_failures
                .saturating_sub(self.progress.failed_turns),
        });
        append_note(&mut self.conversation, note);
    }

    /// Takes the turn's calls: the structured ones, or else the directives written in the text
    /// (stripped from what is shown). A directive naming an unknown tool, or a malformed one,
    /// ends the run `TOOL_PARSE_ERROR` with the text shown as written.
    pub(super) async fn take_calls(&mut self, output: TurnOutput, turn: &mut Turn) -> Step<Vec<ModelCall>> {
        match output.resolution {
            Resolution::Text(text) => {
                self.show(turn, &text).await?;
                self.within_calls_per_turn(output.too_many_calls)?;
                // A call started while the model wrote keeps the id and arguments it ran with.
                Ok(output
                    .structured
                    .into_iter()
                    .enumerate()
                    .map(|(i, c)| match self.eager.call(i) {
                        Some(started) => started.clone(),
                        None => ModelCall {
                            id: self.ids.take(c.id),
                            name: c.name,
                            arguments: c.arguments,
                            argument_bytes: c.argument_bytes,
                        },
                    })
                    .collect())
            }
            Resolution::Calls { calls, stripped, raw } => {
                if let Some(unknown) = calls.iter().find(|c| !self.offers(&c.name)) {
                    let detail = format!("the text calls an unknown tool {:?}", unknown.name);
                    self.emitter.text(&raw, turn.number).await;
                    return Err(End::Failed(FailureReason::ToolParseError, detail));
                }
                self.show(turn, &stripped).await?;
                self.within_calls_per_turn(calls.len() > self.deps.output.max_calls_per_turn)?;
                Ok(calls
                    .into_iter()
                    .map(|c| ModelCall {
                        id: self.ids.take(None),
                        argument_bytes: c.arguments.len(),
                        name: c.name,
                        arguments: c.arguments,
                    })
                    .collect())
            }
            Resolution::Malformed { detail, raw } => {
                self.emitter.text(&raw, turn.number).await;
                Err(End::Failed(FailureReason::ToolParseError, detail))
            }
        }
    }

    /// More calls in one turn than `--max-calls-per-turn` end the run `OUTPUT_LIMIT`; none of
    /// them runs but those started while the model wrote (recorded as the turn ends).
    pub(super) fn within_calls_per_turn(&self, too_many: bool) -> Step<()> {
        if !too_many {
            return Ok(());
        }
        let max = self.deps.output.max_calls_per_turn;
        let ran = match self.eager.count() {
            0 => "none of them ran".to_owned(),
            n => format!("only the {n} started while the model wrote ran"),
        };
        Err(End::failed(
            FailureReason::OutputLimit,
            format!("the model made more than {max} tool calls in one turn, this server's limit; {ran}"),
        ))
    }

    /// Sorts the calls into normal, exit and bad (an unknown tool, arguments over the size limit,
    /// or arguments that are not a JSON object).
    pub(super) fn sort_calls(&self, calls: Vec<ModelCall>) -> SortedCalls {
        let mut sorted = SortedCalls {
            normal: Vec::new(),
            exit: Vec::new(),
            bad: Vec::new(),
            calls: Vec::new(),
        };
        for (i, call) in calls.iter().enumerate() {
            if self.offer.exit.contains(call.name.as_str()) {
                sorted.exit.push(i);
            } else if !self.offer.normal.contains(call.name.as_str()) {
                let message = format!("there is no tool named {:?} in this run", call.name);
                sorted.bad.push((i, ToolCallError::new("NOT_FOUND", message)));
            } else if call.argument_bytes > self.deps.output.max_argument_bytes {
                let message = format!(
                    "the arguments of {} are {} bytes, over this server's limit of {}; pass less (e.g. a reference instead of the content)",
                    call.name, call.argument_bytes, self.deps.output.max_argument_bytes
                );
                sorted.bad.push((i, ToolCallError::new("INVALID_ARGUMENTS", message)));
            } else if !is_json_object(&call.arguments) {
                let message = format!(
                    "the arguments of {} are not a JSON object: {}",
                    call.name,
                    shared::text::excerpt(&call.arguments)
                );
                sorted.bad.push((i, ToolCallError::new("INVALID_ARGUMENTS", message)));
            } else {
                sorted.normal.push(i);
            }
        }
        sorted.calls = calls;
        sorted
    }

    /// Exit calls become signals at once: recorded in the result, published on the signal topic
    /// and queued as events. They cost nothing and are not fed back to the model.
    pub(super) fn publish_signals(&mut self, sorted: &SortedCalls, turn: u32) {
        for &i in &sorted.exit {
            let call = &sorted.calls[i];
            let signal = Signal {
                run_id: self.spec.run_id.clone(),
                call_id: call.id.clone(),
                tool_name: call.name.clone(),
                arguments_valid: is_json_object(&call.arguments),
                arguments_json: call.arguments.clone(),
                turn,
                emitted_at_unix_ms: shared::sync::unix_ms(),
                metadata: self.spec.metadata.clone(),
                delivery: Delivery::Pending,
                principal: self.spec.principal.clone(),
            };
            lock(self.state).signals.push(signal.clone());
            if !self.acting() {
                // A replaced owner publishes nothing; the run ends here at once.
                continue;
            }
            self.deps
                .signals
                .publish(&signal, self.ownership(), self.on_delivery(&signal.call_id));
            // The event carries the delivery as known now (the in-memory topic confirms at once).
            let signal = lock(self.state)
                .signals
                .iter()
                .find(|s| s.call_id == signal.call_id)
                .cloned()
                .unwrap_or(signal);
            metrics::counter!(metric::SIGNALS_PUBLISHED).increment(1);
            tracing::info!(
                parent: &self.run_span,
                gen_ai.tool.name = %signal.tool_name,
                gen_ai.tool.call.id = %signal.call_id,
                orchestrator.signal.arguments_valid = signal.arguments_valid,
                orchestrator.turn = turn,
                "signal"
            );
            self.emitter.queue(Event::Signal(signal));
        }
    }

    /// What the topic's delivery report does: updates the signal in the run's state, and the
    /// stored result (at once for a finished run; a live one is written at its next checkpoint or
    /// at its end).
    pub(super) fn on_delivery(&self, call_id: &str) -> OnDelivery {
        let (state, persister, call_id) = (Arc::clone(self.state), self.persister.clone(), call_id.to_owned());
        Box::new(move |delivery: Delivery| {
            let finished = {
                let mut state = lock(&state);
                if let Some(s) = state.signals.iter_mut().find(|s| s.call_id == call_id) {
                    s.delivery = delivery;
                }
                state.status != RunStatus::Running
            };
            if let Some(persister) = persister.filter(|_| finished) {
                persister.write_final_soon();
            }
        })
    }

    /// With the parse policy FAIL (the default), a bad call ends the run `TOOL_PARSE_ERROR`; with
    /// FEED_BACK it is answered with an error tool message and counts as a failed call.
    pub(super) fn apply_parse_policy(&mut self, sorted: &SortedCalls, turn: &Turn, budget_left: u32) -> Step<()> {
        match (sorted.bad.first(), self.spec.parse_policy) {
            (Some((_, error)), ParsePolicy::Fail) => {
                self.finish_turn(turn, budget_left);
                Err(End::Failed(FailureReason::ToolParseError, error.message.clone()))
            }
            _ => Ok(()),
        }
    }

    /// Each executed normal call costs 1: when the turn asks for more than is left, the first
    /// ones (model order) run and the run ends after the turn.
    pub(super) fn spend_budget(&mut self, sorted: &SortedCalls) -> Spend {
        let remaining = self.budget_left() as usize;
        let executed: Vec<usize> = sorted.normal.iter().copied().take(remaining).collect();
        self.progress.used_budget += u32::try_from(executed.len()).unwrap_or(u32::MAX);
        Spend {
            exhausted: sorted.normal.len() > remaining,
            executed,
            left: self.budget_left(),
        }
    }

    pub(super) fn budget_left(&self) -> u32 {
        self.spec
            .limits
            .tool_call_budget
            .saturating_sub(self.progress.used_budget)
    }

    /// `TOOL_BUDGET_EXHAUSTED` when the turn asked for more calls than were left.
    pub(super) fn budget_end(&self, spend: &Spend, sorted: &SortedCalls) -> Option<End> {
        spend.exhausted.then(|| {
            End::Failed(
                FailureReason::ToolBudgetExhausted,
                format!(
                    "the tool-call budget of {} ran out (the last turn asked for {} call(s))",
                    self.spec.limits.tool_call_budget,
                    sorted.normal.len()
                ),
            )
        })
    }

    /// Queues `tool_call_started` for the calls that run (and the bad ones, which fail at once);
    /// those waiting for approval are announced when decided.
    pub(super) fn announce_calls(&mut self, calls: &TurnCalls) {
        let (sorted, turn) = (&calls.sorted, calls.turn.number);
        let waits = |i: &usize| calls.approvals.iter().any(|a| a.index == *i);
        let started = |i: &usize| self.eager.call(*i).is_some();
        let executed = calls.spend.executed.iter().filter(|i| !waits(i) && !started(i));
        for &i in executed.chain(sorted.bad.iter().map(|(i, _)| i)) {
            self.emitter.queue(started_event(&sorted.calls[i], turn));
        }
    }

    /// How long a call may take now: the smaller of the run's tool timeout and the time left.
    pub(super) fn call_timeout(&self) -> Duration {
        self.spec
            .limits
            .tool_timeout
            .min(self.spec.deadline.at.saturating_duration_since(Instant::now()))
    }

    /// Runs the calls not finished yet concurrently (`join_all`) on the tool-runners, each within
    /// the smaller of the run's tool timeout and the time left in the run. A failed call does not
    /// fail the run: its error is its outcome. A durable run checkpoints each outcome as it
    /// comes (safe point (b)), so a call that finished is never run again.
    pub(super) async fn dispatch(&mut self, calls: &TurnCalls) -> Vec<CallOutcome> {
        let timeout = self.call_timeout();
        let recorder = self.call_recorder(calls);
        let unfinished = calls.unfinished();
        let early: Vec<_> = unfinished.iter().map(|&i| self.eager.outcome(i)).collect();
        let running = join_all(unfinished.into_iter().zip(early).map(|(i, early)| {
            let approval = calls.approvals.iter().find(|a| a.index == i);
            let call = match early {
                Some(started) => futures::future::Either::Left(started),
                None => futures::future::Either::Right(self.execute(
                    i,
                    &calls.sorted.calls[i],
                    timeout,
                    approval,
                    (
                        approval.and_then(super::pending::TurnApproval::answers),
                        calls.following(i).map(|f| f.task.clone()),
                    ),
                )),
            };
            let recorder = recorder.clone();
            async move {
                let outcome = call.await;
                if let Some(recorder) = recorder {
                    recorder.finished(&outcome).await;
                }
                outcome
            }
        }));
        self.reporting_progress(running, calls).await
    }

    /// A call as the tool-runners take it, with the `answers` to the questions it asked last.
    pub(super) fn invocation(
        &self,
        call: &ModelCall,
        timeout: Duration,
        answers: Option<crate::domain::input::Answers>,
    ) -> ToolInvocation {
        ToolInvocation {
            run_id: self.spec.run_id.clone(),
            call_id: call.id.clone(),
            name: call.name.clone(),
            arguments_json: call.arguments.clone(),
            metadata: self.spec.metadata.clone(),
            principal: self.spec.principal.clone(),
            epoch: self.epoch(),
            owner: self.ownership(),
            timeout,
            answers,
            task: None,
            cancel_task: false,
            rerun_in_doubt: false,
            progress: None,
        }
    }

    /// One call on a tool-runner, in its `execute_tool` span (which records the `approval` that
    /// let it run, if it needed one: a call in doubt it lets run is sent saying a person chose to
    /// run it again), with the answers to the questions it asked last and the task it became, if
    /// any (`prior`): a task is polled (and canceled, when the run is to end after the turn)
    /// instead of the tool started again.
    pub(super) fn execute(
        &self,
        index: usize,
        call: &ModelCall,
        timeout: Duration,
        approval: Option<&super::pending::TurnApproval>,
        prior: (
            Option<crate::domain::input::Answers>,
            Option<crate::domain::task::ToolTask>,
        ),
    ) -> impl Future<Output = CallOutcome> + use<> {
        let payloads = self.deps.trace_payloads;
        let span = telemetry::execute_tool_span(&call.name, &call.id, &call.arguments, payloads);
        if let Some(decision) = approval.and_then(|a| a.decision.as_ref()) {
            telemetry::record_approval(&span, decision);
        }
        let (answers, task) = prior;
        let mut invocation = self.invocation(call, timeout, answers);
        invocation.rerun_in_doubt = approval.is_some_and(|a| a.in_doubt && a.cleared());
        invocation.progress = Some(self.call_progress.of_call(index));
        invocation.cancel_task = task.is_some() && self.cancel.after_turn().is_some();
        invocation.task = task;
        let tool = call.name.clone();
        let owner = self.ownership();
        let future = span.in_scope(|| self.deps.tools.execute(invocation));
        async move {
            let moved = || owner.as_ref().is_some_and(|o| !o.holds());
            if moved() {
                // This replica no longer acts for the run: the call never leaves, and the run
                // ends here at once (its ownership stopped).
                return std::future::pending().await;
            }
            // A takeover's calls wait out the fence grace first: neither the call's duration
            // nor its timeout counts that wait.
            if let Some(owner) = &owner {
                owner.calls_allowed().await;
            }
            let _in_flight = InFlight::new(metric::TOOL_CALLS_IN_FLIGHT);
            let started = Instant::now();
            let result = tokio::time::timeout(timeout, future).await.unwrap_or_else(|_| {
                Err(ToolCallError::new(
                    "TIMEOUT",
                    format!("no result within {}", humantime::format_duration(timeout)),
                ))
            });
            let elapsed = started.elapsed();
            if moved() {
                // The run moved while the call was out (a runner refused it as a replaced
                // owner's, or the lease ran out): its outcome is the new owner's to find.
                return std::future::pending().await;
            }
            let (result, asked, task) = match result {
                Ok(ToolOutput::Result(json)) => (Ok(json), None, None),
                Ok(ToolOutput::Asked(questions)) => (Ok(String::new()), Some(questions), None),
                Ok(ToolOutput::Task(task)) => (Ok(String::new()), None, Some(task)),
                Err(e) => (Err(e), None, None),
            };
            if asked.is_none() && task.is_none() {
                telemetry::record_tool_call(&tool, &result, elapsed, payloads);
            }
            CallOutcome {
                index,
                result,
                elapsed,
                rejected: false,
                reported: false,
                asked,
                task,
            }
        }
        .instrument(span)
    }

    /// Records every outcome (bad calls included, with their error) in the result and as events,
    /// in the model's order (those reported while the turn waited for a decision were recorded
    /// then), and returns what is fed back: the assistant's calls and one tool message each.
    pub(super) fn report_results(
        &mut self,
        sorted: &SortedCalls,
        mut outcomes: Vec<CallOutcome>,
        approvals: &[super::pending::TurnApproval],
        turn: u32,
    ) -> Vec<(ToolCall, Message)> {
        outcomes.extend(sorted.bad.iter().map(|(index, error)| CallOutcome {
            index: *index,
            result: Err(error.clone()),
            elapsed: Duration::ZERO,
            rejected: false,
            reported: false,
            asked: None,
            task: None,
        }));
        outcomes.sort_by_key(|o| o.index);
        let mut fed_back = Vec::with_capacity(outcomes.len());
        for outcome in &mut outcomes {
            self.report_call(sorted, outcome, approvals, turn);
            let call = &sorted.calls[outcome.index];
            let content = match &outcome.result {
                Ok(json) => self.fed_back_result(json),
                Err(error) => error.to_tool_message(),
            };
            let assistant_call = ToolCall {
                id: call.id.clone(),
                name: call.name.clone(),
                arguments: call.arguments.clone(),
            };
            let tool_message = Message::Tool {
                tool_call_id: call.id.clone(),
                content,
            };
            fed_back.push((assistant_call, tool_message));
        }
        self.keep_model_order(sorted, turn);
        fed_back
    }

    /// The turn's records in the model's order, though some were recorded while the turn waited
    /// for a decision (they are the newest records: no other turn's come between).
    fn keep_model_order(&self, sorted: &SortedCalls, turn: u32) {
        let mut state = lock(self.state);
        let first = state
            .tool_calls
            .iter()
            .rposition(|r| r.turn != turn)
            .map_or(0, |i| i + 1);
        let position = |id: &str| sorted.calls.iter().position(|c| c.id == id);
        state.tool_calls[first..].sort_by_key(|r| position(&r.call_id));
    }

    /// Records one call's outcome in the result and sends `tool_call_finished`, once: an outcome
    /// reported already (while its turn waited for a decision) is left as it is. Its error is
    /// bounded here, as the record, the event and the model's tool message keep it.
    pub(super) fn report_call(
        &mut self,
        sorted: &SortedCalls,
        outcome: &mut CallOutcome,
        approvals: &[super::pending::TurnApproval],
        turn: u32,
    ) {
        if outcome.reported {
            return;
        }
        outcome.reported = true;
        let approval = approvals
            .iter()
            .find(|a| a.index == outcome.index)
            .and_then(|a| a.decision.clone());
        let unbounded = std::mem::replace(&mut outcome.result, Ok(String::new()));
        outcome.result = unbounded.map_err(|error| self.bounded_error(error));
        let result = outcome.result.clone();
        let call = &sorted.calls[outcome.index];
        let duration_ms = u64::try_from(outcome.elapsed.as_millis()).unwrap_or(u64::MAX);
        lock(self.state).tool_calls.push(ToolCallRecord {
            call_id: call.id.clone(),
            name: call.name.clone(),
            arguments_json: call.arguments.clone(),
            ok: result.is_ok(),
            error: result.as_ref().err().cloned(),
            duration_ms,
            turn,
            approval,
        });
        self.emitter.queue(Event::ToolCallFinished {
            call_id: call.id.clone(),
            name: call.name.clone(),
            content_json: result.as_ref().ok().cloned(),
            content_truncated: false,
            error: result.err(),
            duration_ms,
        });
    }

    /// A tool result as the model sees it: at most `max_tool_result_bytes`, cut with a note saying
    /// how much was left out.
    pub(super) fn fed_back_result(&self, json: &str) -> String {
        counted_cut(json, self.deps.max_tool_result_bytes, "result").unwrap_or_else(|| json.to_owned())
    }

    /// A tool error as the run keeps it (its record, its event, the model's tool message): the
    /// message at most `max_tool_result_bytes`, cut with a note saying how much was left out (a
    /// runner passes on a command's stderr or an MCP server's error text).
    pub(super) fn bounded_error(&self, mut error: ToolCallError) -> ToolCallError {
        if let Some(cut) = counted_cut(&error.message, self.deps.max_tool_result_bytes, "message") {
            error.message = cut;
        }
        error
    }

    /// Failures count once per turn, however many of its calls failed.
    pub(super) fn count_failures(&mut self, any_failed: bool) {
        if any_failed {
            self.progress.failed_turns += 1;
            lock(self.state).failed_turns = self.progress.failed_turns;
        }
    }

    /// `TOOL_FAILURE_LIMIT` once the failing turns exceed `max_tool_failures`.
    pub(super) fn check_failure_limit(&self) -> Step<()> {
        let max = self.spec.limits.max_tool_failures;
        if self.progress.failed_turns > max {
            return Err(End::Failed(
                FailureReason::ToolFailureLimit,
                format!(
                    "{} turn(s) had failing tool calls; at most {max} are tolerated",
                    self.progress.failed_turns
                ),
            ));
        }
        Ok(())
    }

    /// One assistant message with the turn's text and its normal calls only, then one tool
    /// message per call, in the model's order.
    pub(super) fn append_to_conversation(&mut self, turn: &mut Turn, fed_back: Vec<(ToolCall, Message)>) {
        let (tool_calls, tool_messages): (Vec<ToolCall>, Vec<Message>) = fed_back.into_iter().unzip();
        self.conversation.push(Message::Assistant {
            content: std::mem::take(&mut turn.text),
            tool_calls,
            reasoning: Some(std::mem::take(&mut turn.reasoning)).filter(|r| !r.is_empty()),
        });
        self.conversation.extend(tool_messages);
    }

    /// Queues the turn's end (sent with the next model request, or with the run's end).
    pub(super) fn finish_turn(&mut self, turn: &Turn, budget_left: u32) {
        self.progress.last_turn_tokens = turn.usage.prompt_tokens.saturating_add(turn.usage.completion_tokens);
        self.emitter.queue(Event::TurnFinished {
            turn: turn.number,
            usage: turn.usage,
            tool_call_budget_remaining: budget_left,
            failed_turns: self.progress.failed_turns,
        });
    }

    pub(super) fn offers(&self, name: &str) -> bool {
        self.offer.normal.contains(name) || self.offer.exit.contains(name)
    }
}

/// `tool_call_started` of `call`.
pub(super) fn started_event(call: &ModelCall, turn: u32) -> Event {
    Event::ToolCallStarted {
        call_id: call.id.clone(),
        name: call.name.clone(),
        arguments_json: call.arguments.clone(),
        turn,
        arguments_truncated: false,
    }
}

pub(super) fn is_json_object(text: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(text).is_ok_and(|v| v.is_object())
}

/// Gives every call of the run a unique id: the model's when it sent one that is new, else a
/// generated one (the model sees the same id in the tool message).
#[derive(Default)]
pub(super) struct IdAllocator {
    pub(super) used: HashSet<String>,
    pub(super) generated: u32,
}

impl IdAllocator {
    pub(super) fn take(&mut self, id: Option<String>) -> String {
        if let Some(id) = id.filter(|id| !self.used.contains(id)) {
            self.used.insert(id.clone());
            return id;
        }
        loop {
            self.generated += 1;
            let id = format!("call_{}", self.generated);
            if self.used.insert(id.clone()) {
                return id;
            }
        }
    }
}

/// [`shared::text::cut_with_note`], counted in the metrics when it cuts.
pub(super) fn counted_cut(text: &str, max: usize, what: &str) -> Option<String> {
    let cut = shared::text::cut_with_note(text, max, what);
    if cut.is_some() {
        metrics::counter!(metric::TOOL_RESULTS_CUT).increment(1);
    }
    cut
}
