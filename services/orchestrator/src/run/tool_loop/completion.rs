//! The streamed completion of a turn: events read in batches, visible text shown to the caller
//! through the repeated-line detector, reasoning kept apart, usage recorded, and a completion that
//! breaks off turned into the run's end, or, when a model endpoint of several cut it, into the
//! turn starting again on another.
//!
//! With a stream interval the model's stream is read once per interval, on ticks every run with
//! that interval shares (so one timer wake serves them all), and what arrived in between is one
//! batch: one text event instead of one per token. The turn's first batch goes at once.

use futures::stream::{BoxStream, Fuse};
use futures::{FutureExt, StreamExt};
use shared::sync::lock;
use tokio::time::Instant;

use super::spend::Allowance;
use super::*;
use crate::domain::chat::Usage;
use crate::domain::model::{ChatRequest, LlmError, LlmEvent, ReadPace};
use crate::domain::{Event, FailureReason};
use crate::run::loop_detector::LoopDetector;
use crate::run::turn::{TurnCollector, TurnOutput};
use crate::telemetry::metric;

/// How a turn's completion ended.
pub(super) enum Streamed {
    /// Whole.
    Done(TurnOutput),
    /// Cut by `endpoint`, which sent events first: the turn may start again on another.
    Cut { endpoint: String, error: LlmError },
}

/// What a turn's attempt changed in the run, to take back when the turn starts again.
pub(super) struct TurnMark {
    text_len: usize,
    reasoning_len: usize,
    reasoning_truncated: bool,
    detector: LoopDetector,
    reasoning_detector: LoopDetector,
}

impl Driver<'_> {
    /// The turn's completion, asking for at most `allowance` tokens. A stream that a model endpoint of several cut after it sent
    /// events starts again on another endpoint (at most `max_turn_restarts` times a turn),
    /// announced by `turn_restarted`: what the cut attempt showed is taken back from the
    /// result, as a caller drops it from its transcript.
    pub(super) async fn complete_turn(
        &mut self,
        number: u32,
        turn: &mut Turn,
        allowance: Allowance,
    ) -> Step<TurnOutput> {
        let (mut restarts, mut avoid) = (0, None);
        loop {
            let mark = self.mark_turn();
            let mut request = self.chat_request(number);
            request.params = match allowance {
                Allowance::Within(left) => request.params.within_tokens(left),
                Allowance::Held(held) => request.params.bounded_to(held),
            };
            request.avoid = avoid.take();
            let may_restart = restarts < self.deps.max_turn_restarts && !self.eager.any();
            match self.stream_completion(request, turn, may_restart).await? {
                Streamed::Done(output) => return Ok(output),
                Streamed::Cut { endpoint, error } => {
                    restarts += 1;
                    self.restart_turn(mark, turn, &endpoint, &error);
                    avoid = Some(endpoint);
                }
            }
        }
    }

    fn mark_turn(&self) -> TurnMark {
        let state = lock(self.state);
        TurnMark {
            text_len: state.text.len(),
            reasoning_len: state.reasoning.len(),
            reasoning_truncated: state.reasoning_truncated,
            detector: self.loops.text.clone(),
            reasoning_detector: self.loops.reasoning.clone(),
        }
    }

    /// Takes the cut attempt back (its text, reasoning and what the detectors saw; its usage is
    /// not counted) and announces the next attempt.
    fn restart_turn(&mut self, mark: TurnMark, turn: &mut Turn, endpoint: &str, error: &LlmError) {
        self.completion = None;
        {
            let mut state = lock(self.state);
            state.text.truncate(mark.text_len);
            state.reasoning.truncate(mark.reasoning_len);
            state.reasoning_truncated = mark.reasoning_truncated;
        }
        (self.loops.text, self.loops.reasoning) = (mark.detector, mark.reasoning_detector);
        (turn.text, turn.reasoning, turn.usage) = (String::new(), String::new(), Usage::default());
        self.progress.attempt += 1;
        tracing::warn!(turn = turn.number, attempt = self.progress.attempt, %endpoint, "the model stream was cut; the turn starts again on another endpoint: {}", error.cause());
        metrics::counter!(metric::TURNS_RESTARTED, "why" => "model_endpoint").increment(1);
        self.emitter.queue(Event::TurnRestarted {
            turn: turn.number,
            attempt: self.progress.attempt,
            reason: format!(
                "the model server at {endpoint} cut the stream ({}); the turn starts again on another",
                error.cause()
            ),
        });
    }

    /// Streams the completion: visible text goes to the caller and the repeated-line detector as
    /// it arrives, reasoning to a detector of its own. A stream error keeps every byte: text held
    /// back for directive parsing is output too, and the usage reported so far counts (unless
    /// `may_restart` and a model endpoint of several cut it: then the turn starts again).
    pub(super) async fn stream_completion(
        &mut self,
        request: ChatRequest,
        turn: &mut Turn,
        may_restart: bool,
    ) -> Step<Streamed> {
        self.emitter.flush().await;
        let requested = Instant::now();
        let pace = request.pace.clone();
        let stream = self.deps.model.stream(request).await.map_err(llm_failure)?;
        let collector = TurnCollector::new(self.deps.output.max_calls_per_turn, self.deps.output.max_argument_bytes);
        let completion = Completion::new(stream, collector, requested)
            .every(self.spec.stream_interval, pace)
            .at_most(self.emitter.max_event_bytes());
        self.completion = Some(completion);
        while let Some(batch) = self.next_batch().await {
            self.reason(turn, &batch.reasoning).await?;
            self.show(turn, &batch.text).await?;
            self.within_output_while_held()?;
            self.start_complete_calls(turn).await;
            match batch.error {
                Some(LlmError::Cut { endpoint, error }) if may_restart => {
                    return Ok(Streamed::Cut {
                        endpoint,
                        error: *error,
                    });
                }
                Some(e) => {
                    self.keep_interrupted_turn(true);
                    return Err(llm_failure(e));
                }
                None => {}
            }
        }
        let output = self
            .completion
            .take()
            .map_or_else(|| TurnCollector::default().finish(), Completion::finish);
        self.record_usage(&output, turn);
        Ok(Streamed::Done(output))
    }

    pub(super) async fn next_batch(&mut self) -> Option<Batch> {
        self.completion.as_mut()?.next_batch().await
    }

    /// A turn the run ends in the middle of: the usage it reported counts, and its held text
    /// is released (queued, sent before `run_finished`, seen by the repeated-line detector)
    /// unless the run ends because that text loops.
    pub(super) fn keep_interrupted_turn(&mut self, release_text: bool) {
        let Some(mut completion) = self.completion.take() else {
            return;
        };
        if release_text {
            let mut held = completion.collector.release_held();
            held.truncate(shared::text::truncate(&held, self.output_room()).len());
            self.loops.text.feed(&held);
            let turn = lock(self.state).turns;
            self.emitter.queue(Event::TextDelta { text: held, turn });
        }
        if let Some(usage) = completion.collector.usage() {
            lock(self.state).usage.add(usage);
        }
    }

    /// Reasoning goes to a repeated-line detector of its own: a line repeated too often ends the
    /// run `REPEATED_LINE_LOOP`, as in text, with the reasoning kept up to that line.
    pub(super) async fn reason(&mut self, turn: &mut Turn, reasoning: &str) -> Step<()> {
        if reasoning.is_empty() {
            return Ok(());
        }
        let tripped = self.loops.reasoning.feed(reasoning);
        let seen = tripped.as_ref().map_or(reasoning, |(_, end)| &reasoning[..*end]);
        self.keep_reasoning(turn, seen).await;
        match tripped {
            None => Ok(()),
            Some((line, _)) => {
                self.keep_interrupted_turn(false);
                Err(End::Failed(
                    FailureReason::RepeatedLineLoop,
                    format!(
                        "the model repeated the line {:?} too often in its reasoning",
                        shared::text::excerpt(&line)
                    ),
                ))
            }
        }
    }

    /// Reasoning is streamed and kept in the result up to `max_reasoning_bytes` per run; past
    /// them the result is flagged truncated and the run goes on (reasoning is not output). With
    /// `send_reasoning`, the turn keeps its own reasoning, up to the same bound, to send back.
    pub(super) async fn keep_reasoning(&mut self, turn: &mut Turn, reasoning: &str) {
        let max = self.deps.output.max_reasoning_bytes;
        let kept = {
            let mut state = lock(self.state);
            let kept = shared::text::truncate(reasoning, max.saturating_sub(state.reasoning.len()));
            state.reasoning_truncated |= kept.len() < reasoning.len();
            kept
        };
        self.emitter.reasoning(kept, turn.number).await;
        if self.deps.send_reasoning {
            let room = max.saturating_sub(turn.reasoning.len());
            turn.reasoning.push_str(shared::text::truncate(reasoning, room));
        }
    }

    /// Adds a finished completion's usage and finish reason to the turn, the run and the span.
    pub(super) fn record_usage(&self, output: &TurnOutput, turn: &mut Turn) {
        turn.usage = output.usage;
        let chat_span = tracing::Span::current();
        chat_span.record("gen_ai.usage.input_tokens", output.usage.prompt_tokens);
        chat_span.record("gen_ai.usage.output_tokens", output.usage.completion_tokens);
        chat_span.record(
            "gen_ai.usage.cache_read.input_tokens",
            output.usage.cached_prompt_tokens,
        );
        if let Some(reason) = &output.finish_reason {
            chat_span.record("gen_ai.response.finish_reasons", reason.as_str());
        }
        let mut state = lock(self.state);
        state.usage.add(output.usage);
        if let Some(reason) = &output.finish_reason {
            state.finish_reason.clone_from(reason);
        }
    }

    /// Shows visible text and feeds the repeated-line detector; when it trips, the text is shown
    /// up to the end of the repeated line and the run ends `REPEATED_LINE_LOOP`.
    pub(super) async fn show(&mut self, turn: &mut Turn, text: &str) -> Step<()> {
        if text.is_empty() {
            return Ok(());
        }
        let tripped = self.loops.text.feed(text);
        let mut shown = tripped.as_ref().map_or(text, |(_, end)| &text[..*end]);
        let over = shown.len() > self.output_room();
        if over {
            shown = shared::text::truncate(shown, self.output_room());
        }
        self.emitter.text(shown, turn.number).await;
        turn.text.push_str(shown);
        if over {
            self.keep_interrupted_turn(false);
            return Err(self.output_limit("its text"));
        }
        match tripped {
            None => Ok(()),
            Some((line, _)) => {
                self.keep_interrupted_turn(false);
                Err(End::Failed(
                    FailureReason::RepeatedLineLoop,
                    format!(
                        "the model repeated the line {:?} too often",
                        shared::text::excerpt(&line)
                    ),
                ))
            }
        }
    }
}

/// Events of a completion that are already here, taken together.
pub(super) struct Batch {
    /// Their visible text, shown as one delta: token by token while the model is slower than the
    /// orchestrator, in batches when it is not.
    pub(super) text: String,
    /// Their reasoning text.
    pub(super) reasoning: String,
    /// The stream broke off after them.
    pub(super) error: Option<LlmError>,
}

/// A completion as it streams in, read in [`Batch`]es.
pub(super) struct Completion {
    /// Fused: a batch may see the end before the loop does.
    pub(super) stream: Fuse<BoxStream<'static, Result<LlmEvent, LlmError>>>,
    pub(super) collector: TurnCollector,
    pub(super) requested: Instant,
    pub(super) first_token: bool,
    /// Read the stream once per this (zero: whenever it has something).
    interval: std::time::Duration,
    /// A batch with text or reasoning was handed out: later ones wait for the tick.
    shown: bool,
    /// A tick found nothing since the last chunk: the model is slower than the interval, so its
    /// chunks are read as they come, each at once (ticks would only wake the run for nothing),
    /// until two come closer together than the interval.
    slower: bool,
    /// When the last batch's first chunk was read.
    last_read: Option<Instant>,
    /// Tells the connection when chunks need wake nobody until the next tick.
    pace: ReadPace,
    /// A batch stops taking events once its text and reasoning reach this (one event's worth):
    /// a model faster than the run is read in bounded batches, each shown before the next.
    max_batch_bytes: usize,
}

impl Completion {
    pub(super) fn new(
        stream: BoxStream<'static, Result<LlmEvent, LlmError>>,
        collector: TurnCollector,
        requested: Instant,
    ) -> Self {
        Self {
            stream: stream.fuse(),
            collector,
            requested,
            first_token: true,
            interval: std::time::Duration::ZERO,
            shown: false,
            slower: false,
            last_read: None,
            pace: ReadPace::default(),
            max_batch_bytes: usize::MAX,
        }
    }

    /// Batches of at most about `bytes` of text and reasoning.
    pub(super) fn at_most(mut self, bytes: usize) -> Self {
        self.max_batch_bytes = bytes;
        self
    }

    /// The completion, read once per `interval` after its first text, telling the connection
    /// through `pace` when it reads only on ticks.
    pub(super) fn every(mut self, interval: std::time::Duration, pace: ReadPace) -> Self {
        self.interval = interval;
        self.pace = pace;
        self
    }

    /// Waits for the next event (after the first text, not before the next tick), then takes
    /// every one that is already here; `None` at the end.
    pub(super) async fn next_batch(&mut self) -> Option<Batch> {
        let ticking = self.on_ticks();
        let first = if ticking {
            tokio::time::sleep_until(next_tick(self.interval)).await;
            self.pace.ticked();
            match self.stream.next().now_or_never() {
                Some(item) => item?,
                None => {
                    // Nothing came since the last tick: wait for the next chunk, woken by it.
                    self.slower = true;
                    self.pace.set_ticking(false);
                    self.stream.next().await?
                }
            }
        } else {
            self.stream.next().await?
        };
        self.follow_the_models_pace();
        let mut batch = Batch {
            text: String::new(),
            reasoning: String::new(),
            error: None,
        };
        if self.add(first, &mut batch) {
            loop {
                let next = match self.stream.next().now_or_never() {
                    // On a tick, chunks the HTTP client's connection task has read but not
                    // handed over yet (it hands them over one at a time) come after a yield;
                    // a socket the run reads itself says when it is drained.
                    None if ticking && !self.pace.drained_this_tick() => {
                        tokio::task::yield_now().await;
                        self.stream.next().now_or_never()
                    }
                    next => next,
                };
                let Some(Some(item)) = next else { break };
                if !self.add(item, &mut batch) || batch.text.len() + batch.reasoning.len() >= self.max_batch_bytes {
                    break;
                }
            }
        }
        self.shown |= !batch.text.is_empty() || !batch.reasoning.is_empty();
        // Until the next tick, arriving chunks need wake nobody: they are read on the tick.
        self.pace.set_ticking(self.on_ticks());
        Some(batch)
    }

    /// Whether the next batch waits for a tick: after the first text, with an interval, unless
    /// the model is slower than it.
    fn on_ticks(&self) -> bool {
        self.shown && !self.interval.is_zero() && !self.slower
    }

    /// A chunk was just read: one that came sooner than the interval after the last batch's
    /// means the model is faster than the interval again, and batches wait for ticks.
    fn follow_the_models_pace(&mut self) {
        let now = Instant::now();
        if self
            .last_read
            .is_some_and(|last| now.saturating_duration_since(last) < self.interval)
        {
            self.slower = false;
        }
        self.last_read = Some(now);
    }

    /// Adds one item of the stream to `batch`; whether the batch may take more (not after an
    /// error).
    fn add(&mut self, item: Result<LlmEvent, LlmError>, batch: &mut Batch) -> bool {
        match item {
            Ok(event) => {
                self.take(event, batch);
                true
            }
            Err(e) => {
                batch.error = Some(e);
                false
            }
        }
    }

    /// Passes one event to the collector (time to first token is measured on the first one
    /// carrying output); text that can be shown now is added to `shown`.
    pub(super) fn take(&mut self, event: LlmEvent, batch: &mut Batch) {
        if self.first_token && is_token(&event) {
            self.first_token = false;
            let ttft = self.requested.elapsed().as_secs_f64();
            tracing::Span::current().record("gen_ai.response.time_to_first_token", ttft);
            metrics::histogram!(metric::TIME_TO_FIRST_TOKEN).record(ttft);
        }
        if let LlmEvent::ReasoningDelta(reasoning) = &event {
            batch.reasoning.push_str(reasoning);
        }
        if let Some(text) = self.collector.push(event) {
            batch.text.push_str(&text);
        }
    }

    /// Ends the stream and says what the turn produced.
    pub(super) fn finish(self) -> TurnOutput {
        drop(self.stream);
        self.collector.finish()
    }
}

/// The next tick of `interval` after now: ticks are counted from one moment for the whole
/// process, so every run with the same interval wakes on the same ticks.
fn next_tick(interval: std::time::Duration) -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    tick_after(epoch, Instant::now(), interval)
}

/// The first tick after `now` of ticks every `interval` through `epoch`, within one interval of
/// `now` whichever side of it `epoch` is (a runtime whose clock is behind the one that set the
/// epoch, as a test's paused clock can be, must not wait until the epoch).
fn tick_after(epoch: Instant, now: Instant, interval: std::time::Duration) -> Instant {
    let step = interval.as_nanos().max(1);
    let nanos = |n: u128| std::time::Duration::from_nanos(u64::try_from(n).unwrap_or(u64::MAX));
    if now >= epoch {
        let ticks = now.duration_since(epoch).as_nanos() / step + 1;
        return epoch.checked_add(nanos(ticks * step)).unwrap_or(now + interval);
    }
    // The latest tick at or before the epoch that is still after now.
    let ahead = epoch.duration_since(now).as_nanos();
    let back = (ahead - 1) / step * step;
    epoch.checked_sub(nanos(back)).unwrap_or(now + interval)
}

/// Whether an event carries generated output (for time to first token).
pub(super) fn is_token(event: &LlmEvent) -> bool {
    matches!(
        event,
        LlmEvent::TextDelta(_) | LlmEvent::ReasoningDelta(_) | LlmEvent::ToolCallFragment { .. }
    )
}

pub(super) fn llm_failure(e: LlmError) -> End {
    let span = tracing::Span::current();
    let stalled = matches!(e.cause(), LlmError::Stalled(_));
    span.record("error.type", if stalled { "llm_stream_stalled" } else { "llm_error" });
    span.record("otel.status_code", "ERROR");
    let reason = if stalled {
        FailureReason::LlmStreamStalled
    } else {
        FailureReason::LlmError
    };
    End::Failed(reason, e.to_string())
}

#[cfg(test)]
mod tick_tests {
    use super::*;

    #[test]
    fn the_next_tick_is_within_one_interval_on_either_side_of_the_epoch() {
        let interval = std::time::Duration::from_millis(5);
        let epoch = Instant::now() + std::time::Duration::from_secs(3600);
        for now in [
            epoch - std::time::Duration::from_millis(12),
            epoch - std::time::Duration::from_millis(10),
            epoch,
            epoch + std::time::Duration::from_millis(7),
        ] {
            let tick = tick_after(epoch, now, interval);
            assert!(tick > now && tick - now <= interval, "{:?} after now", tick - now);
            let phase = if tick >= epoch { tick - epoch } else { epoch - tick };
            assert_eq!(phase.as_nanos() % interval.as_nanos(), 0, "on the epoch's ticks");
        }
    }
}
