//! Approvals in the loop (docs/architecture.md, "Approvals"): the calls of a turn whose tool
//! needs a person's decision are announced with `approval_requested` instead of
//! `tool_call_started`; the turn's other calls run at once; then the run parks (its checkpoint,
//! state and log writer go to the approval store, and it leaves its slot) unless every call was
//! decided meanwhile. Once decided, the run resumes (here or after a park) with the decisions
//! applied: an approved call is announced and runs (with edited arguments, if so decided), a
//! rejected or expired one fails with its decision as the error, which is fed back to the model
//! and does not count as a failed call.
//!
//! A call that asked questions (its tool answered `input_required`) waits the same way, after it
//! ran: `tool_input_requested` announces the questions, the run parks (status `AWAITING_INPUT`
//! when nothing else waits), and once answered (or expired: `cancel` to each) the call runs again
//! with the answers; it may ask again, up to `--max-input-rounds` times.
//!
//! A call that ran on a person's approval and came back *in doubt* (its tool-runner went away
//! before its outcome was kept, and the tool is not declared idempotent) goes back to a person
//! once, `approval_requested` saying so: approved, it is sent again saying a person chose to run
//! it again; rejected, it stays in doubt and the model is told so.

use shared::sync::lock;

use super::durable::TurnCalls;
use super::pending::TurnApproval;
use super::{CallOutcome, Driver, End, Step};
use crate::domain::ToolCallError;
use crate::domain::approval::{ApprovalDecision, ApprovalOutcome, OnTimeout, PendingApproval};
use crate::domain::ports::{ParkOutcome, Parked, ParkedCalls, Wait};
use crate::domain::{Event, FailureReason, RunStatus};
use crate::telemetry::metric;

impl super::Checkpoint {
    /// The checkpoint of a parked run that is ready to go on: its calls' decisions taken in (a
    /// call nobody decided before it expired is rejected as timed out) and, when its deadline
    /// pauses while a person decides and it waited for one, the deadline moved by the wait (a
    /// run parked only for its tools' tasks is held to its deadline).
    pub fn decided(mut self, waiting: &ParkedCalls) -> Self {
        let now = shared::sync::unix_ms();
        let for_a_person = self.calls.as_ref().is_some_and(TurnCalls::undecided);
        if let Some(calls) = self.calls.as_mut() {
            calls.take_decisions(&waiting.calls);
            calls.approvals.iter_mut().for_each(|a| {
                a.expire(now);
            });
        }
        if self.spec.approval.pause_deadline && for_a_person && waiting.parked_at_unix_ms > 0 {
            let waited = now.saturating_sub(waiting.parked_at_unix_ms);
            self.spec.deadline.at += std::time::Duration::from_millis(waited);
        }
        self.result.pending_approvals.clone_from(&waiting.calls);
        self
    }

    /// Whether calls of the checkpoint's turn wait for decisions or follow tasks (a run parked
    /// with them goes on with what its wait holds).
    pub fn awaits_decisions(&self) -> bool {
        self.calls
            .as_ref()
            .is_some_and(|calls| calls.undecided() || !calls.tasks.is_empty())
    }

    /// The status of the run parked with this checkpoint (before its decisions are taken in).
    pub fn parked_as(&self) -> RunStatus {
        self.calls.as_ref().map_or(RunStatus::AwaitingApproval, |calls| {
            calls.parked_as(&self.result.pending_approvals)
        })
    }
}

impl TurnCalls {
    /// The status of a run parked with these calls: waiting for a person (approval or input, as
    /// `pending` says) while a call is undecided, else for its tasks.
    fn parked_as(&self, pending: &[PendingApproval]) -> RunStatus {
        if self.undecided() {
            RunStatus::parked_for(pending)
        } else {
            RunStatus::AwaitingTask
        }
    }

    /// Whether calls still wait for a decision.
    pub(super) fn undecided(&self) -> bool {
        self.approvals.iter().any(|a| a.decision.is_none())
    }

    /// `approval`'s call waits (again) for a person: in place of what it waited for before.
    fn wait_again(&mut self, approval: TurnApproval) {
        self.approvals.retain(|a| a.index != approval.index);
        self.approvals.push(approval);
    }

    /// Takes the decisions of `calls` (by call id) for the calls that wait.
    pub(super) fn take_decisions(&mut self, calls: &[PendingApproval]) {
        for approval in self.approvals.iter_mut().filter(|a| a.decision.is_none()) {
            let id = &self.sorted.calls[approval.index].id;
            if let Some(decided) = calls.iter().find(|c| &c.call_id == id) {
                approval.decision.clone_from(&decided.decision);
            }
        }
    }

    /// Calls still undecided when the approval store knew no wait of the run (it was lost): they are
    /// rejected (questions are answered `cancel`), so the turn can end.
    fn reject_undecided(&mut self, why: &str) {
        let now = shared::sync::unix_ms();
        for approval in self.approvals.iter_mut().filter(|a| a.decision.is_none()) {
            if let Some(questions) = &approval.questions {
                let mut unanswered = ApprovalDecision::unanswered(questions, now);
                unanswered.message = format!("{why}; each question was answered cancel");
                approval.decision = Some(unanswered);
                continue;
            }
            approval.decision = Some(ApprovalDecision {
                outcome: ApprovalOutcome::Rejected,
                principal: crate::domain::approval::TIMEOUT_PRINCIPAL.to_owned(),
                decided_at_unix_ms: now,
                message: format!("{why}; the call did not run"),
                original_arguments_json: String::new(),
                edited_arguments_json: String::new(),
                answers: Vec::new(),
            });
        }
    }
}

impl Driver<'_> {
    /// The turn's executed calls whose tool needs approval.
    pub(super) fn calls_needing_approval(&self, calls: &TurnCalls) -> Vec<TurnApproval> {
        let expires_at = (self.spec.approval).expires_at(shared::sync::unix_ms(), self.spec.deadline.unix_ms());
        calls
            .spend
            .executed
            .iter()
            .filter(|&&i| self.spec.approval.needs(&calls.sorted.calls[i].name))
            .map(|&index| TurnApproval::new(index, expires_at))
            .collect()
    }

    /// Announces the calls that wait (`approval_requested`, and the run's pending approvals) and
    /// opens their wait in the approval store. An approval store that takes no more runs rejects them at once
    /// (`APPROVAL_UNAVAILABLE`, fed back to the model).
    pub(super) async fn ask_for_approval(&mut self, calls: &mut TurnCalls) -> Step<()> {
        if calls.approvals.is_empty() {
            return Ok(());
        }
        for approval in &calls.approvals {
            let call = &calls.sorted.calls[approval.index];
            self.emitter.queue(Event::ApprovalRequested {
                call_id: call.id.clone(),
                name: call.name.clone(),
                arguments_json: call.arguments.clone(),
                turn: calls.turn.number,
                expires_at_unix_ms: approval.expires_at_unix_ms,
                arguments_truncated: false,
                in_doubt: false,
            });
        }
        metrics::counter!(metric::APPROVALS_REQUESTED).increment(calls.approvals.len() as u64);
        self.open_wait(calls).await
    }

    /// The calls that ran on a person's approval and came back in doubt (not asked about
    /// before) go back to a person: taken out of the finished calls, announced with
    /// `approval_requested` saying they are in doubt, and the turn's wait opened with them.
    pub(super) async fn ask_again_in_doubt(&mut self, calls: &mut TurnCalls) -> Step<()> {
        let expires_at = (self.spec.approval).expires_at(shared::sync::unix_ms(), self.spec.deadline.unix_ms());
        let mut doubted = Vec::new();
        for outcome in std::mem::take(&mut calls.finished) {
            let index = outcome.index;
            let asked_before = calls.approvals.iter().any(|a| a.index == index && a.in_doubt);
            let for_a_person = outcome.result.as_ref().err().is_some_and(ToolCallError::in_doubt)
                && !outcome.reported
                && !asked_before
                && self.spec.approval.needs(&calls.sorted.calls[index].name);
            if !for_a_person {
                calls.finished.push(outcome);
                continue;
            }
            calls.wait_again(TurnApproval {
                in_doubt: true,
                ..TurnApproval::new(index, expires_at)
            });
            doubted.push(index);
        }
        if doubted.is_empty() {
            return Ok(());
        }
        for &index in &doubted {
            let call = &calls.sorted.calls[index];
            tracing::warn!(gen_ai.tool.call.id = %call.id, gen_ai.tool.name = %call.name, "the approved call is in doubt; a person decides whether it runs again");
            self.emitter.queue(Event::ApprovalRequested {
                call_id: call.id.clone(),
                name: call.name.clone(),
                arguments_json: call.arguments.clone(),
                turn: calls.turn.number,
                expires_at_unix_ms: expires_at,
                arguments_truncated: false,
                in_doubt: true,
            });
        }
        metrics::counter!(metric::APPROVALS_REQUESTED).increment(doubted.len() as u64);
        self.open_wait(calls).await
    }

    /// Sorts what the calls that `ran` gave back: an outcome is finished; a call that asked
    /// questions waits for the answers (its next round), unless it asked `--max-input-rounds` times
    /// already (it then fails). The positions of the calls that asked.
    pub(super) fn take_questions(&mut self, calls: &mut TurnCalls, ran: Vec<CallOutcome>) -> Vec<usize> {
        let (timeout, deadline) = (self.spec.limits.input_timeout, self.spec.deadline.unix_ms());
        let expires_at = self.spec.approval.wait_ends(shared::sync::unix_ms(), timeout, deadline);
        let mut asked = Vec::new();
        for mut outcome in ran {
            let Some(questions) = outcome.asked.take() else {
                calls.finished.push(outcome);
                continue;
            };
            let index = outcome.index;
            let rounds = calls
                .approvals
                .iter()
                .find(|a| a.index == index)
                .map_or(0, |a| a.rounds);
            let most = self.deps.max_input_rounds;
            if rounds >= most {
                let why = format!(
                    "the tool asked for a person's input {} times; a call may ask at most {most} times (--max-input-rounds)",
                    rounds + 1
                );
                outcome.result = Err(ToolCallError::new("FAILED", why));
                calls.finished.push(outcome);
                continue;
            }
            calls.wait_again(TurnApproval {
                questions: Some(questions),
                rounds: rounds + 1,
                ..TurnApproval::new(index, expires_at)
            });
            asked.push(index);
        }
        asked
    }

    /// Announces the questions of the calls at `asked` (`tool_input_requested`) and opens the
    /// turn's wait with them.
    pub(super) async fn ask_for_input(&mut self, calls: &mut TurnCalls, asked: &[usize]) -> Step<()> {
        if asked.is_empty() {
            return Ok(());
        }
        for approval in calls.approvals.iter().filter(|a| asked.contains(&a.index)) {
            let (call, Some(questions)) = (&calls.sorted.calls[approval.index], &approval.questions) else {
                continue;
            };
            tracing::info!(gen_ai.tool.call.id = %call.id, gen_ai.tool.name = %call.name, questions = questions.requests.len(), "the tool asks a person before it can finish");
            self.emitter.queue(Event::ToolInputRequested {
                call_id: call.id.clone(),
                name: call.name.clone(),
                turn: calls.turn.number,
                expires_at_unix_ms: approval.expires_at_unix_ms,
                requests: questions.requests.clone(),
                round: questions.round(),
            });
        }
        metrics::counter!(metric::INPUT_REQUESTED).increment(asked.len() as u64);
        self.open_wait(calls).await
    }

    /// Opens (or opens again) the turn's wait in the approval store with every call that waits or waited,
    /// their decisions so far, and the run's pending approvals: those still undecided. An approval store
    /// of this process that takes no more runs decides them at once (rejected; questions answered
    /// `cancel`). A shared one that did not take the wait may hold it all the same (its answer
    /// was lost), where a person may answer it: the run stops here, and whichever replica takes
    /// it over opens the same wait again, keeping the decisions made meanwhile.
    async fn open_wait(&mut self, calls: &mut TurnCalls) -> Step<()> {
        let now = shared::sync::unix_ms();
        let context = crate::domain::approval::CallContext {
            prompt: self.spec.prompt(),
            labels: self.spec.labels.clone(),
            said_before: shared::text::ending(&calls.turn.text),
        };
        let mut waiting = Vec::with_capacity(calls.approvals.len());
        for approval in &calls.approvals {
            let call = &calls.sorted.calls[approval.index];
            let pending = PendingApproval {
                run_id: self.spec.run_id.clone(),
                call_id: call.id.clone(),
                name: call.name.clone(),
                arguments_json: call.arguments.clone(),
                turn: calls.turn.number,
                requested_at_unix_ms: now,
                expires_at_unix_ms: approval.expires_at_unix_ms,
                principal: self.spec.principal.clone(),
                decision: approval.decision.clone(),
                questions: approval.questions.clone(),
                in_doubt: approval.in_doubt,
                context: context.clone(),
            };
            waiting.push((pending, self.schema_of(&call.name)));
        }
        lock(self.state).pending_approvals = waiting
            .iter()
            .filter(|(p, _)| p.decision.is_none())
            .map(|(p, _)| p.clone())
            .collect();
        let wait = Wait {
            run_id: self.spec.run_id.clone(),
            principal: self.spec.principal.clone(),
            calls: waiting,
            epoch: self.epoch(),
        };
        let Err(reason) = self.deps.approvals.open(wait).await else {
            return Ok(());
        };
        if let Some(owner) = self.ownership() {
            tracing::warn!("{reason}; the run stops here and resumes from its last checkpoint");
            owner.stop(crate::domain::Stop::Unsaved(format!(
                "opening its wait failed: {reason}"
            )));
            return Err(End::TakenOver);
        }
        tracing::warn!("{reason}; the calls that wait for a person are decided at once");
        calls.reject_undecided(&format!("no person could be asked ({reason})"));
        Ok(())
    }

    fn schema_of(&self, tool: &str) -> serde_json::Value {
        self.spec.normal_tools.iter().find(|t| t.name == tool).map_or_else(
            || serde_json::json!({"type": "object"}),
            |t| t.parameters.as_ref().clone(),
        )
    }

    /// Acts on the decisions not acted on yet: an approved call is announced (with its edited
    /// arguments), one that does not run gets its outcome (the decision as its error). A timeout
    /// ends the run `APPROVAL_TIMEOUT` when the request asked for that.
    pub(super) async fn apply_decisions(&mut self, calls: &mut TurnCalls) -> Step<()> {
        if calls.approvals.iter().all(|a| a.applied || a.decision.is_none()) {
            return Ok(());
        }
        let number = calls.turn.number;
        for approval in calls.approvals.iter_mut().filter(|a| !a.applied) {
            let Some(decision) = approval.decision.clone() else {
                continue;
            };
            approval.applied = true;
            let outcome: &'static str = decision.outcome.into();
            metrics::counter!(metric::APPROVAL_DECISIONS, "outcome" => outcome).increment(1);
            let call = &mut calls.sorted.calls[approval.index];
            tracing::info!(
                gen_ai.tool.call.id = %call.id,
                gen_ai.tool.name = %call.name,
                orchestrator.approval.outcome = outcome,
                orchestrator.approval.principal = %decision.principal,
                "approval decided"
            );
            let waited_ms = match approval.asked_at_unix_ms {
                0 => 0,
                asked => decision.decided_at_unix_ms.saturating_sub(asked),
            };
            self.emitter.queue(Event::CallDecided {
                call_id: call.id.clone(),
                name: call.name.clone(),
                turn: number,
                decision: decision.clone(),
                waited_ms,
            });
            if decision.outcome == ApprovalOutcome::TimedOut && self.spec.approval.on_timeout == OnTimeout::FailRun {
                return Err(End::failed(
                    FailureReason::ApprovalTimeout,
                    format!(
                        "call {} ({}) was not decided within the approval timeout",
                        call.id, call.name
                    ),
                ));
            }
            if decision.outcome == ApprovalOutcome::Answered {
                // The call runs again with the answers; it was announced when it first ran.
                continue;
            }
            if decision.runs() {
                if decision.outcome == ApprovalOutcome::Edited {
                    call.arguments.clone_from(&decision.edited_arguments_json);
                    call.argument_bytes = call.arguments.len();
                }
                self.emitter.queue(Event::ToolCallStarted {
                    call_id: call.id.clone(),
                    name: call.name.clone(),
                    arguments_json: call.arguments.clone(),
                    turn: number,
                    arguments_truncated: false,
                });
            } else {
                let refused = ToolCallError::refused(&decision);
                calls.finished.push(CallOutcome {
                    index: approval.index,
                    result: Err(match approval.in_doubt {
                        true => refused.left_in_doubt(),
                        false => refused,
                    }),
                    elapsed: std::time::Duration::ZERO,
                    rejected: true,
                    reported: false,
                    asked: None,
                    task: None,
                });
            }
        }
        if !calls.undecided() {
            lock(self.state).pending_approvals.clear();
            // The wait goes only once a checkpoint holds its decisions: a replaced owner (whose
            // save the store refuses) never deletes what the run's new owner resumes with.
            self.safe_point(Some(calls)).await?;
            if let Some(reason) = self.deps.approvals.close_decided(&self.spec.run_id, self.epoch()).await {
                // A cancel that reached the wait after this owner took the run from it: the
                // caller was told the run is canceled, so it ends here, before its calls run.
                tracing::info!("the run's wait was canceled after the run was taken from it");
                return Err(End::Canceled(reason));
            }
        }
        Ok(())
    }

    /// The turn's other calls have run while some still wait for a decision: their outcomes are
    /// recorded and their `tool_call_finished` events reach the caller now, not once the wait
    /// ends; a durable run saves them in its checkpoint first (safe point (b)).
    pub(super) async fn report_while_waiting(&mut self, calls: &mut TurnCalls) -> Step<()> {
        let number = calls.turn.number;
        let mut finished = std::mem::take(&mut calls.finished);
        finished.sort_by_key(|o| o.index);
        for outcome in &mut finished {
            self.report_call(&calls.sorted, outcome, &calls.approvals, number);
        }
        calls.finished = finished;
        self.safe_point(Some(calls)).await
    }

    /// The turn's other calls have run and some still wait: the run parks, leaving its slot,
    /// unless every call was decided meanwhile (their decisions are then taken here). A durable
    /// run (NATS store) waits in place instead, keeping its slot and its lease: decisions reach
    /// it on this replica.
    pub(super) async fn await_decisions(&mut self, calls: &mut TurnCalls) -> Step<()> {
        self.emitter.flush().await;
        // A shared approval store resumes the run on any replica from the run's log: it must hold
        // everything sent, or the resumed run would number its events past a gap.
        if !self.emitter.settler(self.deps.log_settle_timeout).wait().await
            && let Some(persister) = self.durable()
        {
            super::durable::log_not_kept(persister);
            return Err(End::TakenOver);
        }
        // Whole: a parked run is resumed from the checkpoint its wait holds, without segments.
        let checkpoint = self.whole_checkpoint(Some(calls));
        let parked_as = calls.parked_as(&lock(self.state).pending_approvals);
        let result = {
            let mut state = lock(self.state);
            state.status = parked_as;
            let result = state.clone();
            state.status = RunStatus::Running;
            result
        };
        let parked = match crate::domain::ports::json("the run's checkpoint", &checkpoint) {
            Ok(checkpoint) => {
                let parked = Parked {
                    checkpoint,
                    result,
                    wake_at_unix_ms: self.wake_at(calls),
                    parked_at_unix_ms: shared::sync::unix_ms(),
                    deadline_unix_ms: self.spec.deadline.unix_ms(),
                    log: self.emitter.take_log(),
                };
                let park = self.deps.approvals.park(&self.spec.run_id, parked);
                match &self.persister {
                    Some(persister) => persister.parking(park).await,
                    None => park.await,
                }
            }
            Err(e) => Err(e),
        };
        match parked {
            Ok(ParkOutcome::Parked) => {
                lock(self.state).status = parked_as;
                tracing::info!(
                    status = <&str>::from(parked_as),
                    "the run waits for a person; it leaves its slot"
                );
                Err(End::Parked)
            }
            Ok(ParkOutcome::Decided(decided, parked)) => {
                self.emitter.restore_log(parked.log);
                calls.take_decisions(&decided);
                calls.reject_undecided("the wait for its approval was lost");
                Ok(())
            }
            Err(e) => match self.ownership() {
                // The store did not take the parked run, and its log writer went with the park:
                // the run stops here, and whichever replica takes it resumes it from its last
                // checkpoint (waiting in place, its checkpoints would run ahead of its log).
                Some(owner) => {
                    tracing::warn!("parking the run failed ({e}); it stops here and resumes from its checkpoint");
                    owner.stop(crate::domain::Stop::Unsaved(format!("parking it failed: {e}")));
                    Err(End::TakenOver)
                }
                None => {
                    tracing::warn!("parking the run failed ({e}); it waits for its approvals in place");
                    self.wait_in_place(calls).await;
                    Ok(())
                }
            },
        }
    }

    /// Waits on its slot until every call is decided or its wait expired (the run's deadline and
    /// a cancel end it from outside as always).
    async fn wait_in_place(&mut self, calls: &mut TurnCalls) {
        const LOOK_EVERY: std::time::Duration = std::time::Duration::from_millis(100);
        let run_id = self.spec.run_id.clone();
        loop {
            if let Ok(Some(waiting)) = self.deps.approvals.parked_calls(&run_id).await {
                calls.take_decisions(&waiting.calls);
            }
            let now = shared::sync::unix_ms();
            calls.approvals.iter_mut().for_each(|a| {
                a.expire(now);
            });
            if !calls.undecided() {
                return;
            }
            tokio::time::sleep(LOOK_EVERY).await;
        }
    }

    /// When a parked run wakes without decisions: its first expiry or its next task poll, or
    /// its deadline when sooner (unless the deadline pauses while a person decides).
    fn wake_at(&self, calls: &TurnCalls) -> u64 {
        let expiry = calls
            .approvals
            .iter()
            .filter(|a| a.decision.is_none())
            .map(|a| a.expires_at_unix_ms)
            .chain(calls.next_poll_at())
            .min()
            .unwrap_or(0);
        if self.spec.approval.pause_deadline && calls.undecided() {
            expiry
        } else {
            expiry.min(self.spec.deadline.unix_ms())
        }
    }
}
