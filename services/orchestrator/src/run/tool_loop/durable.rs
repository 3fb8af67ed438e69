//! Durable runs (docs/architecture.md, "Durable runs"): the run's checkpoint at each safe point,
//! and resuming a run from one on the replica that took it over.
//!
//! The safe points of a turn: (a) its calls are assembled and announced, (b) each call finished,
//! (c) the turn ended. At (a) and (c) the loop waits until the event log holds every event sent,
//! writes the checkpoint with the events it has numbered but not sent (the outbox), then sends
//! them; at (b) it waits until the log holds the calls' announcement, then writes the checkpoint
//! with the call's outcome before that outcome is reported.
//! So the log never holds an event the checkpoint does not account for, except the text of a
//! turn still streaming: a replica that resumes after (c) and finds such events in the log
//! restarts that turn and says so (`turn_restarted`).

use std::future::Future;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::{CallOutcome, Driver, End, SortedCalls, Spend, Step, Turn};
use crate::domain::chat::Message;
use crate::domain::chat::Usage;
use crate::domain::ports::StoreError;
use crate::domain::{Event, NumberedEvent, RunResult, RunSpec};
use crate::run::chunks;
use crate::run::live::{Cancel, Settler};
use crate::run::persist::{Persister, Snapshot};
use crate::run::steering::{Inbox, Kept};

/// Everything another replica needs to resume a run at a safe point.
#[derive(Serialize, Deserialize)]
pub struct Checkpoint {
    /// What the run was asked to do (its deadline as a Unix time).
    pub spec: RunSpec,
    /// Its output so far.
    pub result: RunResult,
    /// The first messages of the turns so far, kept in the journal (in order): a checkpoint names
    /// them instead of holding them again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub segments: Vec<SegmentRef>,
    /// Assistant and tool messages of the turns so far (after those of `segments`). Stored under
    /// a key of its own: a replica of an earlier version, which knows no segments, cannot read
    /// the checkpoint and hands the run back, rather than resume it with the messages after the
    /// segments only. It reads checkpoints of earlier versions (`conversation`) whole.
    #[serde(rename = "conversation_after_segments", alias = "conversation")]
    pub conversation: Vec<Message>,
    /// How far the run got (kept flat in the stored checkpoint).
    #[serde(flatten)]
    pub progress: Progress,
    /// Call ids given out (a resumed run never gives one out twice).
    pub call_ids: Vec<String>,
    /// Call ids generated so far.
    pub generated_ids: u32,
    /// The last seq numbered.
    pub seq: u64,
    /// Events numbered and not known to be in the log yet.
    pub outbox: Vec<NumberedEvent>,
    /// The current turn's calls, when the checkpoint is taken among them.
    pub calls: Option<TurnCalls>,
    /// Why the run is to end once its turn has ended (a cancel that let the turn finish), so a
    /// replica that takes the run over ends it there too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel_after_turn: Option<String>,
    /// The messages sent to the run and not taken by a turn yet, and how many it was sent.
    #[serde(default, skip_serializing_if = "Kept::is_empty")]
    pub steering: Kept,
}

/// A segment of a run's transcript kept in the journal: where, and how many messages it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentRef {
    /// Where the journal keeps it.
    pub position: u64,
    /// Its messages (checked when it is read back).
    pub messages: u32,
}

/// What of a run's conversation is kept in the journal: its first `messages` messages, as
/// `segments`. Those never change (only a last user message does, which is never kept), so
/// each safe point keeps what is new since the last and its checkpoint names the rest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Segmented {
    /// The segments, in the conversation's order.
    pub segments: Vec<SegmentRef>,
    /// The conversation's messages they hold.
    pub messages: usize,
}

impl Checkpoint {
    /// The checkpoint stored as `bytes`: the chunks it names read with `read` (their bytes, at
    /// the positions asked, in order) and put in place, those read noted in `chunks`. An error
    /// says what could not be read.
    pub async fn unfolded<F, Fut>(bytes: &[u8], chunks: &mut chunks::Kept, read: F) -> Result<Self, String>
    where
        F: Fn(Vec<u64>) -> Fut,
        Fut: Future<Output = Result<Vec<Vec<u8>>, String>>,
    {
        let value = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        let value = chunks::unfold(value, chunks, read).await?;
        serde_json::from_value(value).map_err(|e| e.to_string())
    }

    /// Its conversation whole: the transcript segments it names read with `read` (their chunks
    /// in place, noted in `chunks`) and put first; what they hold.
    pub async fn read_transcript<F, Fut>(&mut self, chunks: &mut chunks::Kept, read: F) -> Result<Segmented, String>
    where
        F: Fn(Vec<u64>) -> Fut,
        Fut: Future<Output = Result<Vec<Vec<u8>>, String>>,
    {
        let positions = self.segments.iter().map(|s| s.position).collect();
        let mut segments = Vec::new();
        for bytes in read(positions).await? {
            let value = serde_json::from_slice(&bytes).map_err(|e| format!("a segment: {e}"))?;
            segments.push(chunks::unfold(value, chunks, &read).await?);
        }
        Segmented::resolve(self, segments)
    }
}

impl Segmented {
    /// The conversation of the checkpoint `c` whole, its segments' messages (`kept`, read from
    /// the journal in `c.segments`' order, their chunks in place) first; and what of it is kept.
    fn resolve(c: &mut Checkpoint, kept: Vec<serde_json::Value>) -> Result<Self, String> {
        let mut whole = Vec::new();
        for (segment, value) in c.segments.iter().zip(kept) {
            let messages: Vec<Message> = serde_json::from_value(value)
                .map_err(|e| format!("segment {} cannot be read: {e}", segment.position))?;
            if messages.len() != segment.messages as usize {
                return Err(format!(
                    "segment {} holds {} messages, its checkpoint says {}",
                    segment.position,
                    messages.len(),
                    segment.messages
                ));
            }
            whole.extend(messages);
        }
        let segmented = Self {
            messages: whole.len(),
            segments: std::mem::take(&mut c.segments),
        };
        whole.append(&mut c.conversation);
        c.conversation = whole;
        Ok(segmented)
    }
}

/// How far a run got, counted against its limits: what the loop's rules count as they go and a
/// checkpoint carries over to the replica that resumes the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// Turns ended.
    pub turns_done: u32,
    /// The attempt of the turn after `turns_done` (1, or more once it was restarted).
    pub attempt: u32,
    /// Normal calls executed (against the tool-call budget).
    pub used_budget: u32,
    /// Turns with a failed call (against the failure limit).
    pub failed_turns: u32,
    /// Bytes of the arguments and errors of the calls and signals recorded so far (against the
    /// output bound), counted at the turn boundaries where they change, not on every batch of
    /// text.
    pub recorded_bytes: usize,
    /// The run's tokens its caller's usage book holds: each add books the tokens past these,
    /// so a turn's add that failed is made good by the next, and a replica that takes the run
    /// over books what the checkpoint's owner may not have (the book adds only what it had not
    /// had of the run: never twice, never missing).
    #[serde(default)]
    pub booked: Usage,
    /// The tokens the model counted for the last turn's prompt and completion: the next
    /// prompt holds them all, so they are what it is counted as before the model counts it.
    #[serde(default)]
    pub last_turn_tokens: u64,
}

impl Default for Progress {
    fn default() -> Self {
        Self {
            turns_done: 0,
            attempt: 1,
            used_budget: 0,
            failed_turns: 0,
            recorded_bytes: 0,
            booked: Usage::default(),
            last_turn_tokens: 0,
        }
    }
}

impl Checkpoint {
    /// The run was asked to end once its turn under way ends after this checkpoint was saved (a
    /// cancel its record kept): resumed from it, the run ends there, and its record keeps
    /// saying so.
    pub fn end_after_turn(&mut self, reason: String) {
        self.result.ends_after_turn.get_or_insert_with(|| reason.clone());
        self.cancel_after_turn.get_or_insert(reason);
    }

    /// The last seq the run sent before this checkpoint (the log held it then): the event before
    /// the outbox's first, or the last numbered when nothing is queued. A log that ends before it
    /// lost its oldest events to age or trimming, not to a hole.
    pub fn sent_through(&self) -> u64 {
        self.outbox.first().map_or(self.seq, |e| e.seq.saturating_sub(1))
    }

    /// The checkpoint of a run about to start, as its first safe point takes it: its spec and
    /// first state `result`, with `run_started` (seq 1) still to send. A durable run's id is
    /// claimed with it, so the run is resumable from its first moment.
    pub fn at_start(spec: &RunSpec, result: RunResult) -> Self {
        Self {
            spec: spec.clone(),
            result,
            segments: Vec::new(),
            conversation: Vec::new(),
            progress: Progress::default(),
            call_ids: Vec::new(),
            generated_ids: 0,
            seq: 1,
            outbox: vec![NumberedEvent {
                seq: 1,
                event: super::run_started(spec),
            }],
            calls: None,
            cancel_after_turn: None,
            steering: Kept::default(),
        }
    }

    /// The checkpoint as the persister writes it; one that cannot be encoded is not written.
    pub fn snapshot(&self) -> Result<Snapshot, StoreError> {
        Ok(Snapshot {
            result: self.result.clone(),
            deadline_unix_ms: self.spec.deadline.unix_ms(),
            checkpoint: serde_json::to_value(self).map_err(|e| StoreError::Unencodable {
                what: "the run's checkpoint",
                reason: e.to_string(),
            })?,
        })
    }
}

/// A turn whose calls were assembled: what is left of it is running them and reporting.
#[derive(Clone, Serialize, Deserialize)]
pub struct TurnCalls {
    pub(super) turn: Turn,
    #[serde(rename = "partition")]
    pub(super) sorted: SortedCalls,
    pub(super) spend: Spend,
    /// Outcomes of the calls that finished, in the order they finished.
    pub(super) finished: Vec<CallOutcome>,
    /// The calls that wait for a person's decision, and their decisions.
    #[serde(default)]
    pub(super) approvals: Vec<super::pending::TurnApproval>,
    /// Saved while the model still wrote, before a call started early left: the turn's calls
    /// are those started so far, and the run's text and reasoning were these long when the
    /// turn began.
    #[serde(default)]
    pub(super) cut_short: Option<TurnStart>,
    /// The tasks calls became (their servers run them in the background), followed until they
    /// end.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) tasks: Vec<super::pending::Following>,
}

#[cfg(test)]
impl TurnCalls {
    /// A turn of `n` normal calls, all executed, none finished.
    pub(super) fn for_tests(n: usize) -> Self {
        let calls = (0..n)
            .map(|i| super::ModelCall {
                id: format!("call_{i}"),
                name: "crunch".into(),
                arguments: "{}".into(),
                argument_bytes: 2,
            })
            .collect();
        Self {
            turn: super::Turn {
                number: 1,
                text: String::new(),
                usage: Usage::default(),
                reasoning: String::new(),
            },
            sorted: SortedCalls {
                calls,
                normal: (0..n).collect(),
                exit: Vec::new(),
                bad: Vec::new(),
            },
            spend: Spend {
                executed: (0..n).collect(),
                exhausted: false,
                left: 0,
            },
            finished: Vec::new(),
            approvals: Vec::new(),
            cut_short: None,
            tasks: Vec::new(),
        }
    }
}

/// How long the run's text and reasoning were when a turn began.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub(super) struct TurnStart {
    pub(super) text_len: usize,
    pub(super) reasoning_len: usize,
}

impl TurnCalls {
    /// The calls of the turn to run now: not finished, and not waiting for approval (or
    /// approved and announced).
    pub(super) fn unfinished(&self) -> Vec<usize> {
        let done = |i: &usize| self.finished.iter().any(|f| f.index == *i);
        let held = |i: &usize| self.approvals.iter().any(|a| a.index == *i && !a.cleared());
        self.spend
            .executed
            .iter()
            .copied()
            .filter(|i| !done(i) && !held(i))
            .collect()
    }
}

/// A run resumed here: its checkpoint and the last seq its event log keeps.
pub struct Resumed {
    /// The checkpoint, its conversation whole.
    pub checkpoint: Checkpoint,
    /// The last seq in the run's event log.
    pub logged: u64,
    /// What of its conversation the journal keeps (its checkpoints go on naming it).
    pub segmented: Segmented,
}

/// Saves the checkpoint of a turn's calls as each call finishes (safe point (b)).
pub(super) struct CallRecorder {
    base: Mutex<Checkpoint>,
    persister: Persister,
    /// The calls' announcement may still be on its way to the log: a checkpoint that says it
    /// was sent waits until the log keeps it.
    settler: Settler,
    /// The run's cancel: one that lets the turn finish, asked while the calls run, goes into the
    /// checkpoints that follow.
    cancel: Cancel,
    /// The run's inbox: messages sent while the calls run go into the checkpoints that follow.
    inbox: Inbox,
    /// How often tasks are polled: a task's next poll is in its checkpoint.
    poll: crate::domain::task::PollBounds,
}

/// The log did not keep every event sent (it refused them for too long, or did not answer in
/// time): a checkpoint saved now would count them as sent, and the next owner would number on
/// past a gap in the log. Nothing is saved; this replica stops acting for the run, which
/// resumes elsewhere from its last checkpoint and sends again what the log lacks.
pub(super) fn log_not_kept(persister: &Persister) {
    tracing::warn!(
        "the event log did not keep the events sent; the run stops here and resumes from its last checkpoint"
    );
    persister.ownership().stop(crate::domain::Stop::Unsaved(
        "the event log did not keep the events sent".to_owned(),
    ));
}

impl CallRecorder {
    /// Adds `outcome` to the checkpoint and saves it (the newest state is written last): a
    /// result, or the task the call became, before anything else happens with it. A call that
    /// asked questions saves nothing here (see [`TurnCalls::record`]).
    pub(super) async fn finished(&self, outcome: &CallOutcome) {
        // A call that asks, or is in doubt (it may go back to a person), is kept by the safe
        // point that follows its wait.
        let in_doubt = (outcome.result.as_ref().err()).is_some_and(crate::domain::ToolCallError::in_doubt);
        if outcome.asked.is_some() || in_doubt {
            return;
        }
        if !self.settler.wait().await {
            return log_not_kept(&self.persister);
        }
        self.persister
            .save(|| {
                let mut base = shared::sync::lock(&self.base);
                if let Some(calls) = base.calls.as_mut() {
                    calls.record(outcome, self.poll, shared::sync::unix_ms());
                }
                base.cancel_after_turn = self.cancel.after_turn();
                base.steering = self.inbox.kept();
                base.snapshot()
            })
            .await;
    }
}

impl Driver<'_> {
    /// The persister when the run is durable.
    pub(super) fn durable(&self) -> Option<&Persister> {
        self.persister.as_ref().filter(|p| p.durable())
    }

    /// This replica's ownership of a durable run (`None`: a run of this replica only).
    pub(super) fn ownership(&self) -> Option<crate::domain::Ownership> {
        self.durable().map(|p| p.ownership().clone())
    }

    /// The epoch of this replica's claim of the run (0: a run of this replica only).
    pub(super) fn epoch(&self) -> u64 {
        self.ownership().map_or(0, |o| o.epoch())
    }

    /// Whether this replica may act for the run now (always, for a run of this replica only).
    pub(super) fn acting(&self) -> bool {
        self.durable().is_none_or(|p| p.ownership().holds())
    }

    /// The run's checkpoint as of now, with `calls` the current turn's calls (if among them),
    /// its conversation whole.
    pub(super) fn whole_checkpoint(&self, calls: Option<&TurnCalls>) -> Checkpoint {
        Checkpoint {
            segments: Vec::new(),
            conversation: self.conversation.clone(),
            ..self.checkpoint(calls)
        }
    }

    /// The run's checkpoint as the journal keeps it: naming the segments of the conversation
    /// kept, holding the messages after them.
    pub(super) fn checkpoint(&self, calls: Option<&TurnCalls>) -> Checkpoint {
        let kept = self.segmented.messages.min(self.conversation.len());
        Checkpoint {
            spec: self.spec.clone(),
            result: shared::sync::lock(self.state).clone(),
            segments: self.segmented.segments.clone(),
            conversation: self.conversation[kept..].to_vec(),
            progress: self.progress,
            call_ids: self.ids.used.iter().cloned().collect(),
            generated_ids: self.ids.generated,
            seq: self.emitter.seq(),
            outbox: self.emitter.queued().to_vec(),
            calls: calls.cloned(),
            cancel_after_turn: self.cancel.after_turn(),
            steering: self.inbox.kept(),
        }
    }

    /// A safe point ((a) or (c)): with a durable run, waits until the log holds every event
    /// sent, saves the checkpoint, then sends what is queued; a run asked to hand over stops
    /// here. Without durability it only sends what is queued.
    pub(super) async fn safe_point(&mut self, calls: Option<&TurnCalls>) -> Step<()> {
        let Some(persister) = self.durable().cloned() else {
            self.emitter.flush().await;
            return Ok(());
        };
        if !self.emitter.settler(self.deps.log_settle_timeout).wait().await {
            log_not_kept(&persister);
            return Err(End::TakenOver);
        }
        self.keep_transcript(&persister).await;
        let checkpoint = self.checkpoint(calls);
        let saved = persister.save(|| checkpoint.snapshot()).await;
        self.send_at_safe_point(saved).await
    }

    /// Keeps the messages of the conversation that no longer change and are not kept yet, as
    /// one segment, so the checkpoints that follow name them: all but a last user message (a
    /// note or a steered message may still join it). Nothing when the journal keeps no
    /// segments or did not take this one: the checkpoint then holds them.
    async fn keep_transcript(&mut self, persister: &Persister) {
        let settled = match self.conversation.last() {
            Some(Message::User { .. }) => self.conversation.len() - 1,
            _ => self.conversation.len(),
        };
        let new = &self.conversation[self.segmented.messages.min(settled)..settled];
        let Ok(messages) = u32::try_from(new.len()) else { return };
        if messages == 0 {
            return;
        }
        let Ok(segment) = serde_json::to_value(new) else { return };
        if let Some(position) = persister.keep_segment(segment).await {
            self.segmented.segments.push(SegmentRef { position, messages });
            self.segmented.messages = settled;
        }
    }

    /// Sends what is queued at a safe point whose checkpoint the store took (`saved`) while this
    /// replica still acts for the run; otherwise the run ends here (it moves). A run asked to hand
    /// over stops here.
    async fn send_at_safe_point(&mut self, saved: bool) -> Step<()> {
        if !saved || !self.acting() {
            // What is queued reveals what the store does not hold: it stays here, and the run
            // resumes from its last good checkpoint (the persister stopped this replica's
            // ownership). A save that came back after the lease less its margin (the replica
            // was paused, or cut off, while it waited) is the same: another replica may own the
            // run by now.
            return Err(End::TakenOver);
        }
        self.emitter.flush().await;
        if self.hand_over.is_cancelled() {
            return Err(End::HandedOver);
        }
        Ok(())
    }

    /// A durable run's first safe point: the checkpoint its id was claimed with
    /// ([`Checkpoint::at_start`]) is this one, so only `run_started` goes out (a run whose claim
    /// saved none saves it here).
    pub(super) async fn start(&mut self) -> Step<()> {
        if !self.persister.as_ref().is_some_and(Persister::claimed_resumable) {
            return self.safe_point(None).await;
        }
        self.send_at_safe_point(true).await
    }

    /// The recorder of safe point (b) for `calls`, when the run is durable.
    pub(super) fn call_recorder(&self, calls: &TurnCalls) -> Option<Arc<CallRecorder>> {
        let persister = self.durable()?.clone();
        Some(Arc::new(CallRecorder {
            base: Mutex::new(self.checkpoint(Some(calls))),
            persister,
            settler: self.emitter.settler(self.deps.log_settle_timeout),
            cancel: self.cancel.clone(),
            inbox: self.inbox.clone(),
            poll: self.deps.tasks.poll,
        }))
    }

    /// Takes the driver's state from `checkpoint` (the emitter already numbers on from it and
    /// holds the outbox events the log lacks), then queues `turn_restarted` when the log holds
    /// events of a turn that was still streaming. Returns the turn's calls to finish, if any.
    pub(super) fn restore(&mut self, resumed: Resumed) -> Option<TurnCalls> {
        let Resumed {
            checkpoint: c,
            logged,
            segmented,
        } = resumed;
        *shared::sync::lock(self.state) = c.result;
        self.conversation = c.conversation;
        self.segmented = segmented;
        self.progress = c.progress;
        if let Some(reason) = &c.cancel_after_turn {
            self.cancel.cancel_with(crate::domain::CancelMode::AfterTurn, reason);
        }
        self.inbox.restore(c.steering);
        self.ids.used = c.call_ids.into_iter().collect();
        self.ids.generated = c.generated_ids;
        let mut calls = c.calls;
        if let Some(calls) = calls.as_mut().filter(|_| logged > c.seq) {
            self.void_cut_short_text(calls);
        } else if logged > c.seq && calls.is_none() {
            self.progress.attempt += 1;
            let turn = self.progress.turns_done + 1;
            tracing::info!(
                turn,
                attempt = self.progress.attempt,
                "the model stream of this turn was cut; it starts again"
            );
            self.emitter.queue(Event::TurnRestarted {
                turn,
                attempt: self.progress.attempt,
                reason: "the orchestrator replica running the run stopped while the model was streaming".to_owned(),
            });
        } else if logged > c.seq {
            tracing::warn!(
                logged,
                checkpoint = c.seq,
                "the event log is ahead of the checkpoint of this turn's calls"
            );
        }
        calls
    }

    /// A turn saved while the model still wrote, whose log holds what it streamed after: that
    /// text is not in the checkpoint, so the turn's text is void (`turn_restarted`) and the
    /// turn goes on with the calls it had started, without text.
    fn void_cut_short_text(&mut self, calls: &mut TurnCalls) {
        let Some(start) = calls.cut_short else {
            return;
        };
        {
            let mut state = shared::sync::lock(self.state);
            state.text.truncate(start.text_len);
            state.reasoning.truncate(start.reasoning_len);
        }
        (calls.turn.text, calls.turn.reasoning) = (String::new(), String::new());
        self.progress.attempt += 1;
        let started = calls.sorted.calls.len();
        tracing::info!(
            turn = calls.turn.number,
            started,
            "the model stream of this turn was cut after calls started; the turn goes on with them"
        );
        self.emitter.queue(Event::TurnRestarted {
            turn: calls.turn.number,
            attempt: self.progress.attempt,
            reason: format!(
                "the orchestrator replica running the run stopped while the model was streaming; the turn goes on with the {started} call(s) it had started"
            ),
        });
    }
}
