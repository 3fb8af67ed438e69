//! Durable runs (`durable.rs`): checkpoints at safe points, hand-over, resuming, the log and the
//! lease.

use super::*;

/// A run journal in memory: keeps every checkpoint saved, in order, with how far the run's log
/// (when it watches one) had kept the events then.
#[derive(Default)]
pub(super) struct Journal {
    saved: Mutex<Vec<Vec<u8>>>,
    /// Saves refused before the journal takes any.
    refuse_saves: std::sync::atomic::AtomicUsize,
    /// Every save after the first is refused.
    refuse_after_first: bool,
    log: Option<tokio::sync::watch::Receiver<crate::domain::ports::Settled>>,
    kept_at_save: Mutex<Vec<u64>>,
    /// The store's lease terms (a store other replicas read); none: the run never lapses.
    lease: Option<crate::domain::LeaseTerms>,
    /// The save of this index (0: the first) takes this long before the store takes it.
    slow_save: Option<(usize, Duration)>,
    /// Transcript segments kept (at their index + 1), when the journal keeps them.
    segments: Option<Mutex<Vec<Vec<u8>>>>,
}

/// The memory store with the lease terms of a store other replicas read.
struct Leased {
    inner: crate::store::memory::MemoryStore,
    terms: crate::domain::LeaseTerms,
}

impl crate::domain::ports::ResultStore for Leased {
    fn put(&self, result: RunResult) -> BoxFuture<'static, Result<(), crate::domain::ports::StoreError>> {
        self.inner.put(result)
    }
    fn claim(
        &self,
        result: RunResult,
    ) -> BoxFuture<'static, Result<crate::domain::ports::Claim, crate::domain::ports::StoreError>> {
        self.inner.claim(result)
    }
    fn get(&self, run_id: &str) -> BoxFuture<'static, Result<Option<RunResult>, crate::domain::ports::StoreError>> {
        self.inner.get(run_id)
    }
    fn lease(&self) -> Option<crate::domain::LeaseTerms> {
        Some(self.terms)
    }
}

/// An event log that keeps each batch appended 30 ms later (a publish and its acknowledgement).
struct SlowLog {
    settled: tokio::sync::watch::Sender<crate::domain::ports::Settled>,
}

impl crate::domain::ports::LogWriter for SlowLog {
    fn append(&mut self, events: &[NumberedEvent]) {
        let (settled, last) = (self.settled.clone(), events.last().map_or(0, |e| e.seq));
        tokio::spawn(async move {
            // Stays: the scripted world's time (a slow log), on the tests' paused clock: not a wait.
            tokio::time::sleep(Duration::from_millis(30)).await;
            settled.send_modify(|s| s.kept_through = s.kept_through.max(last));
        });
    }
    fn settled(&self) -> Option<tokio::sync::watch::Receiver<crate::domain::ports::Settled>> {
        Some(self.settled.subscribe())
    }
}

impl Journal {
    /// A journal that keeps transcript segments.
    fn keeping_segments() -> Self {
        Self {
            segments: Some(Mutex::default()),
            ..Self::default()
        }
    }

    /// The checkpoints saved, each whole (its chunks and segments read back), with what of its
    /// conversation its segments held.
    async fn whole_checkpoints(&self) -> Vec<(Checkpoint, Segmented)> {
        let kept = self
            .segments
            .as_ref()
            .map(|s| s.lock().unwrap().clone())
            .unwrap_or_default();
        let read = |positions: Vec<u64>| {
            let read = positions.iter().map(|p| kept[*p as usize - 1].clone()).collect();
            futures::future::ready(Ok::<_, String>(read))
        };
        let mut chunks = crate::run::chunks::Kept::default();
        let mut whole = Vec::new();
        let saved = self.saved.lock().unwrap().clone();
        for bytes in saved {
            let mut c = Checkpoint::unfolded(&bytes, &mut chunks, read).await.unwrap();
            let segmented = c.read_transcript(&mut chunks, read).await.unwrap();
            whole.push((c, segmented));
        }
        whole
    }

    /// The checkpoints saved, as saved (a journal that keeps segments keeps their chunks apart:
    /// see [`Self::whole_checkpoints`]).
    pub(super) fn checkpoints(&self) -> Vec<Checkpoint> {
        let saved = self.saved.lock().unwrap();
        saved
            .iter()
            .map(|bytes| serde_json::from_slice(bytes).unwrap())
            .collect()
    }
}

impl crate::domain::ports::RunJournal for Journal {
    fn save(
        &self,
        _result: RunResult,
        _deadline_unix_ms: u64,
        checkpoint: Vec<u8>,
    ) -> BoxFuture<'static, Result<(), crate::domain::ports::StoreError>> {
        let refuse = self.refuse_saves.fetch_update(
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
            |n| n.checked_sub(1),
        );
        if refuse.is_ok() || (self.refuse_after_first && !self.saved.lock().unwrap().is_empty()) {
            let refused = crate::domain::ports::StoreError::Unavailable {
                operation: "checkpoint put",
                key: "r".into(),
                reason: "refused by the test".into(),
            };
            return futures::future::ready(Err(refused)).boxed();
        }
        let index = {
            let mut saved = self.saved.lock().unwrap();
            saved.push(checkpoint);
            saved.len() - 1
        };
        if let Some(log) = &self.log {
            self.kept_at_save.lock().unwrap().push(log.borrow().kept_through);
        }
        // Stays: the scripted world's time (a slow save), on the tests' paused clock: not a wait.
        match self.slow_save {
            Some((slow, took)) if slow == index => tokio::time::sleep(took).map(Ok).boxed(),
            _ => futures::future::ready(Ok(())).boxed(),
        }
    }
    fn claim_resumable(
        &self,
        result: RunResult,
        deadline_unix_ms: u64,
        checkpoint: Vec<u8>,
    ) -> BoxFuture<'static, Result<crate::domain::ports::Claim, crate::domain::ports::StoreError>> {
        let saved = self.save(result, deadline_unix_ms, checkpoint);
        async move { saved.await.map(|()| crate::domain::ports::Claim::Claimed) }.boxed()
    }
    fn keeps_segments(&self) -> bool {
        self.segments.is_some()
    }
    fn keep_segment(
        &self,
        _run_id: &str,
        segment: Vec<u8>,
    ) -> BoxFuture<'static, Result<Option<u64>, crate::domain::ports::StoreError>> {
        let position = self.segments.as_ref().map(|kept| {
            let mut kept = kept.lock().unwrap();
            kept.push(segment);
            kept.len() as u64
        });
        futures::future::ready(Ok(position)).boxed()
    }
    fn forget(&self, _run_id: &str) -> BoxFuture<'static, Result<(), crate::domain::ports::StoreError>> {
        futures::future::ready(Ok(())).boxed()
    }
    fn orphans(&self) -> BoxFuture<'static, Result<Vec<String>, crate::domain::ports::StoreError>> {
        futures::future::ready(Ok(Vec::new())).boxed()
    }
    fn take_over(
        &self,
        _run_id: &str,
    ) -> BoxFuture<'static, Result<Option<crate::domain::ports::Claimed>, crate::domain::ports::StoreError>> {
        futures::future::ready(Ok(None)).boxed()
    }
    fn hand_over(&self, _run_id: &str) -> BoxFuture<'static, Result<(), crate::domain::ports::StoreError>> {
        futures::future::ready(Ok(())).boxed()
    }
    fn hand_overs(&self) -> BoxFuture<'static, BoxStream<'static, ()>> {
        futures::future::ready(futures::stream::empty().boxed()).boxed()
    }
    fn cancel_elsewhere(
        &self,
        _run_id: &str,
        _reason: &str,
        _mode: crate::domain::CancelMode,
    ) -> BoxFuture<'static, Result<Option<crate::domain::ports::RemoteCancel>, crate::domain::ports::StoreError>> {
        futures::future::ready(Ok(None)).boxed()
    }
    fn cancel_asks(&self) -> BoxFuture<'static, BoxStream<'static, crate::domain::ports::CancelAsk>> {
        futures::future::ready(futures::stream::empty().boxed()).boxed()
    }
}

pub(super) fn durable(state: &SharedState, journal: Arc<Journal>) -> Persister {
    let memory = crate::store::memory::MemoryStore::new(16, Duration::from_secs(60));
    let store: Arc<dyn crate::domain::ports::ResultStore> = match journal.lease {
        Some(terms) => Arc::new(Leased { inner: memory, terms }),
        None => Arc::new(memory),
    };
    let timeout = Duration::from_secs(1);
    let backlog = crate::run::backlog::Backlog::new(Arc::clone(&store), 16, timeout, timeout);
    Persister::new(store, Arc::clone(state), timeout, backlog).with_journal(Some(journal))
}

/// Turn 1 says a word and calls `nap` twice (`id0` finishes first), turn 2 answers.
pub(super) fn two_naps_then_an_answer() -> Vec<Vec<Result<LlmEvent, LlmError>>> {
    vec![
        vec![
            text("checking "),
            call(0, "nap", r#"{"ms": 10}"#),
            call(1, "nap", r#"{"ms": 50}"#),
        ],
        vec![text("all done")],
    ]
}

/// The run played whole and durable: its result, events and checkpoints.
async fn whole_durable_run() -> (RunResult, Vec<NumberedEvent>, Vec<Checkpoint>) {
    durable_run_claimed(false).await
}

/// [`whole_durable_run`], its id claimed with its start checkpoint when `claim_resumable`.
async fn durable_run_claimed(claim_resumable: bool) -> (RunResult, Vec<NumberedEvent>, Vec<Checkpoint>) {
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        claim_resumable,
        ..Outside::default()
    };
    let (result, batches, _, _) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    (result, batches.into_iter().flatten().collect(), journal.checkpoints())
}

/// Resumes from `checkpoint` with the log holding events through `logged`; the model plays
/// only turn 2.
pub(super) async fn resume_at(
    checkpoint: Checkpoint,
    logged: u64,
) -> (RunResult, Vec<NumberedEvent>, Arc<Script>, Arc<Tools>) {
    let outside = Outside {
        journal: Some(Arc::default()),
        resumed: Some(Resumed {
            checkpoint,
            logged,
            segmented: Default::default(),
        }),
        ..Outside::default()
    };
    let turn2 = two_naps_then_an_answer().split_off(1);
    let (result, batches, script, tools) = play_with(turn2, limits(), outside).await;
    (result, batches.into_iter().flatten().collect(), script, tools)
}

/// The first of `checkpoints` that `pick` matches.
pub(super) fn first(checkpoints: Vec<Checkpoint>, what: &str, pick: impl Fn(&Checkpoint) -> bool) -> Checkpoint {
    match checkpoints.into_iter().find(|c| pick(c)) {
        Some(checkpoint) => checkpoint,
        None => panic!("no checkpoint {what}"),
    }
}

pub(super) fn gap_free_from(events: &[NumberedEvent], first: u64) -> bool {
    events.iter().zip(first..).all(|(e, n)| e.seq == n)
}

#[tokio::test(start_paused = true)]
async fn a_run_asked_to_hand_over_does_so_at_its_next_safe_point() {
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        hand_over: true,
        ..Outside::default()
    };
    let (result, _, script, tools) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Running, "handed over, not ended: {result:?}");
    let checkpoints = journal.checkpoints();
    assert_eq!(checkpoints.len(), 1, "handed over at its first safe point");
    assert!(checkpoints[0].calls.is_none() && checkpoints[0].progress.turns_done == 0);
    assert!(
        script.requests.lock().unwrap().is_empty(),
        "the model was not asked here"
    );
    assert!(
        tools.started.lock().unwrap().is_empty(),
        "no call ran on the replica handing over"
    );
}

/// A checkpoint the store does not take stops the run at that safe point: what it would reveal
/// (the calls' announcement) never leaves, no call runs, and the run resumes from its last good
/// checkpoint on whichever replica claims it next.
#[tokio::test(start_paused = true)]
async fn a_checkpoint_the_store_refuses_stops_the_run_before_anything_it_holds_leaves() {
    let journal = Arc::new(Journal {
        refuse_after_first: true,
        ..Journal::default()
    });
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        ..Outside::default()
    };
    let (result, events, script, tools) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    stopped_before_its_calls(&result, &events, &tools);
    assert_eq!(journal.checkpoints().len(), 1, "only the turn's start was saved");
    assert_eq!(script.requests.lock().unwrap().len(), 1, "turn 1 was asked for");
}

/// A durable run whose park the store refuses stops here, ended nowhere: its log writer went
/// with the park, so waiting in place would let its checkpoints run ahead of its log. The
/// replica that takes it next resumes it from its last checkpoint; no call ran.
#[tokio::test(start_paused = true)]
async fn a_durable_run_the_store_will_not_park_stops_here_for_another_replica() {
    let journal = Arc::new(Journal::default());
    let approvals = Arc::new(crate::store::memory::approvals::HookedApprovals {
        refuse_park: true,
        ..crate::store::memory::approvals::HookedApprovals::new()
    });
    let outside = naps_wait_for_approval(&journal, approvals);
    let (result, batches, script, tools) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Running, "stopped here, not ended: {result:?}");
    assert!(tools.started.lock().unwrap().is_empty(), "no call ran");
    let events: Vec<&NumberedEvent> = batches.iter().flatten().collect();
    assert!(
        events
            .iter()
            .any(|e| matches!(e.event, Event::ApprovalRequested { .. })),
        "the calls waited for approval: {events:?}"
    );
    assert!(!events.iter().any(|e| e.finished().is_some()), "no run_finished");
    assert_eq!(script.requests.lock().unwrap().len(), 1, "no turn after the first");
    let last = journal.checkpoints().pop().unwrap();
    assert!(
        last.calls.is_some(),
        "the last checkpoint holds the turn's pending approvals"
    );
}

/// A durable run whose wait the shared approval store kept without its answer reaching the run
/// does not decide the calls at once: a person may answer the wait the store holds, and the
/// run would go on rejecting a call a person approved. It stops here, and the replica that takes
/// it over opens the same wait again, keeping the decisions made meanwhile.
#[tokio::test(start_paused = true)]
async fn a_durable_run_whose_wait_went_unanswered_stops_rather_than_decide_its_calls() {
    let journal = Arc::new(Journal::default());
    let approvals = Arc::new(crate::store::memory::approvals::HookedApprovals {
        lose_open_answers: true,
        ..crate::store::memory::approvals::HookedApprovals::new()
    });
    let outside = naps_wait_for_approval(&journal, Arc::clone(&approvals));
    let (result, batches, script, tools) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Running, "stopped here, not ended: {result:?}");
    assert!(tools.started.lock().unwrap().is_empty(), "no call ran");
    let events: Vec<&NumberedEvent> = batches.iter().flatten().collect();
    assert!(!events.iter().any(|e| e.finished().is_some()), "no run_finished");
    assert_eq!(script.requests.lock().unwrap().len(), 1, "no turn after the first");
    let waiting = crate::domain::ports::ApprovalStore::parked_calls(&*approvals, &result.run_id).await;
    let waiting = waiting.unwrap().expect("the wait the store kept");
    assert!(
        waiting.calls.iter().all(|call| call.decision.is_none()),
        "the kept wait is left for a person to answer: {:?}",
        waiting.calls
    );
}

/// A durable run's surroundings where every `nap` call waits for a person's approval (a minute)
/// in `approvals`.
fn naps_wait_for_approval(
    journal: &Arc<Journal>,
    approvals: Arc<crate::store::memory::approvals::HookedApprovals>,
) -> Outside {
    Outside {
        journal: Some(Arc::clone(journal)),
        approval: crate::domain::approval::ApprovalRules {
            tools: ["nap".to_owned()].into(),
            timeout: Duration::from_secs(60),
            ..Default::default()
        },
        approvals,
        ..Outside::default()
    }
}

/// The run stopped here (it moves) before its turn's calls: it did not end, no call ran, and the
/// calls were never announced from here.
fn stopped_before_its_calls(result: &RunResult, events: &[EventBatch], tools: &Tools) {
    assert_eq!(result.status, RunStatus::Running, "stopped here, not ended: {result:?}");
    assert!(tools.started.lock().unwrap().is_empty(), "no call ran");
    let events: Vec<&NumberedEvent> = events.iter().flatten().collect();
    assert!(
        !events.iter().any(|e| matches!(e.event, Event::ToolCallStarted { .. })),
        "the calls were never announced: {events:?}"
    );
    assert!(!events.iter().any(|e| e.finished().is_some()), "no run_finished");
}

/// An owner whose lease ran out while its checkpoint was being saved (a save slower than the
/// lease less its margin, as a paused or cut-off replica sees it) acts no more once the save
/// returns: the store took the checkpoint, but nothing it holds leaves from here (not the calls'
/// announcement) and no call runs; another replica resumes the run from that checkpoint.
#[tokio::test(start_paused = true)]
async fn an_owner_whose_lease_ran_out_during_a_save_sends_and_runs_nothing_after_it() {
    let journal = Arc::new(Journal {
        // The save returns within the store timeout (1 s), after the lease less its margin.
        lease: Some(crate::domain::LeaseTerms {
            length: Duration::from_millis(600),
            margin: Duration::from_millis(200),
            fence_grace: Duration::ZERO,
        }),
        slow_save: Some((1, Duration::from_millis(500))),
        ..Journal::default()
    });
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        ..Outside::default()
    };
    let (result, events, _, tools) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    stopped_before_its_calls(&result, &events, &tools);
    assert_eq!(
        journal.checkpoints().len(),
        2,
        "the turn's start and its calls were saved"
    );
}

#[tokio::test(start_paused = true)]
async fn a_durable_run_is_checkpointed_at_each_safe_point() {
    let (_, events, checkpoints) = whole_durable_run().await;
    let at = |c: &Checkpoint| match &c.calls {
        None => format!("turn end {}", c.progress.turns_done),
        Some(calls) => format!("calls, {} finished", calls.finished.len()),
    };
    assert_eq!(
        checkpoints.iter().map(at).collect::<Vec<_>>(),
        [
            "turn end 0",
            "calls, 0 finished",
            "calls, 1 finished",
            "calls, 2 finished",
            "turn end 1"
        ],
        "the last turn ends the run: its result is written instead"
    );
    assert!(checkpoints.windows(2).all(|w| w[0].seq <= w[1].seq));
    assert!(checkpoints.iter().all(|c| c.seq < events.len() as u64));
}

/// With a journal that keeps transcript segments, each safe point keeps what the conversation
/// added since the last one as a segment, and the checkpoint names the segments instead of
/// holding their messages; read back whole, every checkpoint is the one a journal without
/// segments saves.
#[tokio::test(start_paused = true)]
async fn checkpoints_name_the_kept_transcript_and_hold_only_what_is_new() {
    let three_turns = || {
        let mut turns = two_naps_then_an_answer();
        turns.insert(1, vec![text("again "), call(0, "nap", r#"{"ms": 10}"#)]);
        turns
    };
    let (plain, keeping) = (Arc::new(Journal::default()), Arc::new(Journal::keeping_segments()));
    for journal in [&plain, &keeping] {
        let outside = Outside {
            journal: Some(Arc::clone(journal)),
            ..Outside::default()
        };
        let (result, ..) = play_with(three_turns(), limits(), outside).await;
        assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    }
    let (whole, saved, unsplit) = (
        keeping.whole_checkpoints().await,
        keeping.checkpoints(),
        plain.checkpoints(),
    );
    assert_eq!(whole.len(), unsplit.len());
    let json = |c: &Checkpoint| serde_json::to_value(&c.conversation).unwrap();
    for (((read, segmented), saved), unsplit) in whole.iter().zip(&saved).zip(&unsplit) {
        assert_eq!(
            json(read),
            json(unsplit),
            "read back whole, a checkpoint is the unsplit one"
        );
        assert_eq!(segmented.messages + saved.conversation.len(), read.conversation.len());
        // Only a last user message (a note a steered message may still join) is held.
        assert!(saved.conversation.len() <= 1, "{:?}", saved.conversation);
    }
    let last = saved.last().unwrap();
    assert!(
        last.segments.len() >= 2,
        "a segment per turn ended: {:?}",
        last.segments
    );
}

/// A tool result kept apart as chunks: written to the journal once, though the call's outcome
/// (safe point (b)), its `tool_call_finished` in the outbox and its tool message (safe point
/// (c), cut to what the model is fed) all hold it (and its arguments, here the same text); no
/// checkpoint or segment holds a
/// chunk's worth of it; read back whole, every checkpoint is the one a journal without segments
/// saves.
#[tokio::test(start_paused = true)]
async fn a_long_tool_result_is_kept_once_and_checkpoints_read_back_whole() {
    // A result of 3 chunks and some, its letters in an order that does not repeat.
    let pad = crate::run::chunks::tests::letters(3 * crate::run::chunks::STRING_CHUNK + 100, 7);
    let arguments = serde_json::json!({"ms": 10, "pad": pad}).to_string();
    let turns = || vec![vec![text("reading "), call(0, "nap", &arguments)], vec![text("done")]];
    let (plain, keeping) = (Arc::new(Journal::default()), Arc::new(Journal::keeping_segments()));
    for journal in [&plain, &keeping] {
        let outside = Outside {
            journal: Some(Arc::clone(journal)),
            ..Outside::default()
        };
        let (result, ..) = play_with(turns(), limits(), outside).await;
        assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    }
    let whole = keeping.whole_checkpoints().await;
    let unsplit = plain.checkpoints();
    assert_eq!(whole.len(), unsplit.len());
    let json = |c: &Checkpoint| {
        let mut v = serde_json::to_value(c).unwrap();
        v["spec"]["deadline"] = serde_json::Value::Null;
        v
    };
    for ((read, _), unsplit) in whole.iter().zip(&unsplit) {
        assert_eq!(
            json(read),
            json(unsplit),
            "read back whole, a checkpoint is the unsplit one"
        );
    }
    let piece = |at: usize| pad[at..at + 64].to_owned();
    let kept = keeping.segments.as_ref().unwrap().lock().unwrap().clone();
    // Past the tool message's first KiB (the model is fed the result cut to 1 KiB here).
    for at in [
        1500,
        crate::run::chunks::STRING_CHUNK,
        2 * crate::run::chunks::STRING_CHUNK,
    ] {
        let holding = kept
            .iter()
            .filter(|k| String::from_utf8_lossy(k).contains(&piece(at)))
            .count();
        assert_eq!(holding, 1, "the chunk at {at} is kept once");
    }
    for saved in keeping.saved.lock().unwrap().iter() {
        assert!(
            !String::from_utf8_lossy(saved).contains(&piece(1500)),
            "a checkpoint names the chunks"
        );
    }
}

/// A checkpoint of an earlier version (its conversation under `conversation`, no segments) reads
/// whole; one of this version has no `conversation` key, so an earlier version refuses it instead
/// of resuming the run with the messages after its segments only.
#[tokio::test(start_paused = true)]
async fn a_checkpoint_of_an_earlier_version_reads_and_one_of_this_version_is_refused_by_it() {
    let journal = Arc::new(Journal::keeping_segments());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        ..Outside::default()
    };
    play_with(two_naps_then_an_answer(), limits(), outside).await;
    let (whole, _) = journal.whole_checkpoints().await.pop().unwrap();
    let mut earlier = serde_json::to_value(&whole).unwrap();
    let object = earlier.as_object_mut().unwrap();
    let messages = object.remove("conversation_after_segments").unwrap();
    object.insert("conversation".into(), messages.clone());
    let read: Checkpoint = serde_json::from_value(earlier).unwrap();
    assert_eq!(serde_json::to_value(&read.conversation).unwrap(), messages);
    let last = journal.saved.lock().unwrap().last().cloned().unwrap();
    let saved: serde_json::Value = serde_json::from_slice(&last).unwrap();
    assert!(
        saved.get("conversation").is_none() && saved.get("segments").is_some(),
        "{saved}"
    );
}

/// A turn's sorted calls keep the key every version so far wrote and read (`partition`), so a
/// checkpoint saved before the name changed resumes, and one saved now resumes on a replica not
/// yet rolled.
#[tokio::test(start_paused = true)]
async fn a_checkpoint_names_its_sorted_calls_as_earlier_versions_did() {
    let (_, _, checkpoints) = whole_durable_run().await;
    let in_turn = first(checkpoints, "in a turn with calls", |c| c.calls.is_some());
    let json = serde_json::to_value(&in_turn).unwrap();
    let calls = &json["calls"]["partition"]["calls"];
    assert!(calls.as_array().is_some_and(|calls| !calls.is_empty()), "{json}");
    let read: Checkpoint = serde_json::from_value(json).unwrap();
    assert_eq!(
        read.calls.map(|c| c.sorted.calls.len()),
        in_turn.calls.map(|c| c.sorted.calls.len())
    );
}

/// A durable run's id is claimed with `Checkpoint::at_start`, and its first safe point then saves
/// nothing: the two must be the same checkpoint (a run resumed from the claim's goes on exactly
/// as from the first safe point's).
#[tokio::test(start_paused = true)]
async fn the_start_checkpoint_of_the_claim_is_the_first_safe_points() {
    let (_, _, checkpoints) = whole_durable_run().await;
    // The deadline aside (a Unix time, taken when serialized), and the call ids given out in
    // order (a set).
    let without_deadline = |c: &Checkpoint| {
        let mut c = serde_json::to_value(c).unwrap();
        c["spec"]["deadline"] = serde_json::Value::Null;
        if let Some(ids) = c["call_ids"].as_array_mut() {
            ids.sort_by_key(|id| id.to_string());
        }
        c
    };
    let at_start = Checkpoint::at_start(&spec(limits()), RunResult::running("r"));
    assert_eq!(without_deadline(&at_start), without_deadline(&checkpoints[0]));

    // Claimed with it, the run saves it once: at its claim, not again before its first turn.
    let (_, _, claimed) = durable_run_claimed(true).await;
    let claimed: Vec<serde_json::Value> = claimed.iter().map(without_deadline).collect();
    let played: Vec<serde_json::Value> = checkpoints.iter().map(without_deadline).collect();
    assert_eq!(
        claimed, played,
        "the same checkpoints, the first one saved by the claim"
    );
}

#[tokio::test(start_paused = true)]
async fn a_resumed_turn_keeps_its_finished_calls_in_the_checkpoints_that_follow() {
    let (_, _, checkpoints) = whole_durable_run().await;
    let one_done = first(checkpoints, "after one call", |c| {
        c.calls.as_ref().is_some_and(|calls| calls.finished.len() == 1)
    });
    let journal = Arc::new(Journal::default());
    let seq = one_done.seq;
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        resumed: Some(Resumed {
            checkpoint: one_done,
            logged: seq,
            segmented: Default::default(),
        }),
        ..Outside::default()
    };
    play_with(two_naps_then_an_answer().split_off(1), limits(), outside).await;
    let finished: Vec<Vec<usize>> = journal
        .checkpoints()
        .iter()
        .filter_map(|c| c.calls.as_ref())
        .map(|calls| calls.finished.iter().map(|f| f.index).collect())
        .collect();
    assert_eq!(finished.last(), Some(&vec![0, 1]), "{finished:?}");
}

/// A cancel that lets the turn finish is kept in the checkpoints that follow it: a replica that
/// resumes the run from one finishes the turn's calls and ends it there, asking the model nothing.
#[tokio::test(start_paused = true)]
async fn a_cancel_after_the_turn_is_kept_in_the_checkpoint_and_honoured_on_resume() {
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        cancel_after: Some(Duration::from_millis(5)),
        cancel_mode: CancelMode::AfterTurn,
        ..Outside::default()
    };
    let (ended, ..) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(ended.status, RunStatus::Canceled, "{ended:?}");
    let one_done = first(journal.checkpoints(), "after one call, with the cancel", |c| {
        c.calls.as_ref().is_some_and(|calls| calls.finished.len() == 1) && c.cancel_after_turn.is_some()
    });
    let seq = one_done.seq;
    let (result, _, script, tools) = resume_at(one_done, seq).await;
    assert_eq!(*tools.started.lock().unwrap(), ["id1"], "the turn's other call runs");
    assert_eq!(result.status, RunStatus::Canceled, "{result:?}");
    assert_eq!(result.failure_detail, "canceled by the test");
    assert!(result.tool_calls.iter().all(|c| c.ok), "{:?}", result.tool_calls);
    assert!(
        script.requests.lock().unwrap().is_empty(),
        "the model is not asked again"
    );
}

#[tokio::test(start_paused = true)]
async fn a_run_resumed_after_one_call_finished_runs_only_the_other() {
    let (whole, _, checkpoints) = whole_durable_run().await;
    let one_done = first(checkpoints, "after one call", |c| {
        c.calls.as_ref().is_some_and(|calls| calls.finished.len() == 1)
    });
    let seq = one_done.seq;
    let (result, events, script, tools) = resume_at(one_done, seq).await;
    assert_eq!(
        *tools.started.lock().unwrap(),
        ["id1"],
        "only the call in flight runs again"
    );
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(result.text, whole.text);
    let ids = |r: &RunResult| r.tool_calls.iter().map(|c| c.call_id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&result), ids(&whole));
    assert_eq!(script.requests.lock().unwrap().len(), 1, "turn 1 is not asked again");
    let second = script.requests.lock().unwrap()[0].clone();
    let tool_messages = second
        .messages
        .iter()
        .filter(|m| matches!(m, Message::Tool { .. }))
        .count();
    assert_eq!(tool_messages, 2, "both results go back to the model");
    assert!(gap_free_from(&events, seq + 1), "{events:?}");
}

#[tokio::test(start_paused = true)]
async fn a_run_resumed_with_its_log_ahead_restarts_the_turn_that_was_streaming() {
    let (whole, _, checkpoints) = whole_durable_run().await;
    let turn_end = first(checkpoints, "at the end of turn 1", |c| {
        c.calls.is_none() && c.progress.turns_done == 1
    });
    // The log holds two events of turn 2 the checkpoint does not account for.
    let logged = turn_end.seq + 2;
    let (result, events, script, tools) = resume_at(turn_end, logged).await;
    assert_eq!(
        events.first().map(|e| (e.seq, &e.event)),
        Some((
            logged + 1,
            &Event::TurnRestarted {
                turn: 2,
                attempt: 2,
                reason: "the orchestrator replica running the run stopped while the model was streaming".into()
            }
        ))
    );
    assert!(gap_free_from(&events, logged + 1), "{events:?}");
    assert!(tools.started.lock().unwrap().is_empty(), "turn 1's calls are done");
    assert_eq!(script.requests.lock().unwrap().len(), 1);
    assert_eq!(
        result.text, whole.text,
        "the restarted turn's first attempt is not in the result"
    );
    assert_eq!(result.status, RunStatus::Completed);
}

#[tokio::test(start_paused = true)]
async fn a_run_resumed_before_its_announcement_reached_the_log_sends_it_with_the_same_numbers() {
    let (_, whole_events, checkpoints) = whole_durable_run().await;
    let assembled = first(checkpoints, "of the assembled calls", |c| {
        c.calls.as_ref().is_some_and(|calls| calls.finished.is_empty())
    });
    let outbox = assembled.outbox.clone();
    assert!(
        outbox.iter().any(|e| matches!(e.event, Event::ToolCallStarted { .. })),
        "the announcement waits in the outbox: {outbox:?}"
    );
    assert_eq!(outbox, whole_events[outbox[0].seq as usize - 1..][..outbox.len()]);
    let logged = outbox[0].seq - 1;
    let (result, events, _, tools) = resume_at(assembled, logged).await;
    assert_eq!(events[..outbox.len()], outbox[..], "re-sent as numbered before");
    assert!(gap_free_from(&events, logged + 1));
    let mut started = tools.started.lock().unwrap().clone();
    started.sort();
    assert_eq!(started, ["id0", "id1"], "both calls run, with the same call ids");
    assert_eq!(result.status, RunStatus::Completed);
}

/// A checkpoint never says an event was sent that the log does not keep yet: the calls'
/// announcement is still on its way to the log when the first call finishes (the log takes 30 ms,
/// the call 10 ms), and the call's checkpoint waits for it. Otherwise a replica resuming from it
/// would leave the announcement out of the log for good.
#[tokio::test(start_paused = true)]
async fn a_call_checkpoint_waits_until_the_log_keeps_the_announcement() {
    let (settled, watched) = tokio::sync::watch::channel(crate::domain::ports::Settled::default());
    let journal = Arc::new(Journal {
        log: Some(watched),
        ..Journal::default()
    });
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        log: Some(Box::new(SlowLog { settled })),
        ..Outside::default()
    };
    let (result, _, _, _) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Completed);
    let kept = journal.kept_at_save.lock().unwrap().clone();
    let checkpoints = journal.checkpoints();
    assert_eq!(kept.len(), checkpoints.len());
    for (checkpoint, kept) in checkpoints.iter().zip(kept) {
        let sent_through = checkpoint.outbox.first().map_or(checkpoint.seq, |e| e.seq - 1);
        assert!(
            sent_through <= kept,
            "a checkpoint says events through {sent_through} were sent; the log kept {kept}"
        );
    }
}

/// An event log that keeps every batch at once, except one carrying the run's end.
struct EndlessLog {
    settled: tokio::sync::watch::Sender<crate::domain::ports::Settled>,
}

impl crate::domain::ports::LogWriter for EndlessLog {
    fn append(&mut self, events: &[NumberedEvent]) {
        if events.iter().any(|e| e.finished().is_some()) {
            return;
        }
        let last = events.last().map_or(0, |e| e.seq);
        self.settled.send_modify(|s| s.kept_through = s.kept_through.max(last));
    }
    fn settled(&self) -> Option<tokio::sync::watch::Receiver<crate::domain::ports::Settled>> {
        Some(self.settled.subscribe())
    }
}

/// A durable run whose end its log does not keep (its replica cut off from NATS as it ended)
/// stores no result from here and sends its caller no `run_finished`: the record stays the last
/// checkpoint's, and whoever takes the run over stores the end if the log got it after all, or
/// resumes the run. Otherwise the result would be stored while the log lacked its end for good,
/// and every follower would be told the events were lost.
#[tokio::test(start_paused = true)]
async fn a_run_whose_end_the_log_does_not_keep_stores_no_result_here() {
    let (settled, _) = tokio::sync::watch::channel(crate::domain::ports::Settled::default());
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        log: Some(Box::new(EndlessLog { settled })),
        ..Outside::default()
    };
    let (_, events, _, _) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert!(
        !events.iter().flatten().any(|e| e.finished().is_some()),
        "no run_finished reached the caller"
    );
    let last = journal.checkpoints().pop().map(|c| c.result.status);
    assert_eq!(last, Some(RunStatus::Running), "the last checkpoint is a live run's");
}

/// An event log that keeps the run's first batch (`run_started`) and loses the rest: the
/// stream lost its leader for longer than the writer retries, while the store answers.
struct LosingLog {
    settled: tokio::sync::watch::Sender<crate::domain::ports::Settled>,
}

impl crate::domain::ports::LogWriter for LosingLog {
    fn append(&mut self, events: &[NumberedEvent]) {
        let last = events.last().map_or(0, |e| e.seq);
        self.settled.send_modify(|s| match last {
            1 => s.kept_through = 1,
            _ => s.broken = true,
        });
    }
    fn settled(&self) -> Option<tokio::sync::watch::Receiver<crate::domain::ports::Settled>> {
        Some(self.settled.subscribe())
    }
}

/// A safe point whose log lost events sent since the last one saves no checkpoint: one would
/// count them as sent, and the replica taking the run over would number on past a gap in the
/// log for good (the simulation over the ports found it: a log of seqs 37..42 only). The run
/// stops here, ended nowhere, its last checkpoint the one before the loss; no call runs.
#[tokio::test(start_paused = true)]
async fn a_safe_point_after_the_log_lost_events_saves_nothing_and_stops_here() {
    let (settled, _) = tokio::sync::watch::channel(crate::domain::ports::Settled::default());
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        claim_resumable: true,
        log: Some(Box::new(LosingLog { settled })),
        ..Outside::default()
    };
    let (result, _, _, tools) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Running, "stopped here, not ended: {result:?}");
    assert!(tools.started.lock().unwrap().is_empty(), "no call ran");
    let checkpoints = journal.checkpoints();
    assert_eq!(checkpoints.len(), 1, "only the start was saved");
    assert_eq!(checkpoints[0].seq, 1, "the start checkpoint: run_started only");
}

// Coalesced streaming.

/// A question a replaced owner asked in a turn its checkpoint did not keep leaves a wait in the
/// approval store; the owner that resumes the run calls again, the tool answers without asking
/// this time, and the run ends: its end closes that wait too, so no person is left asked about a
/// run that is over (the simulation's seed 731213).
#[tokio::test(start_paused = true)]
async fn a_question_a_replaced_owner_asked_is_closed_when_the_run_ends() {
    use crate::domain::ports::ApprovalStore as _;
    let (_, _, checkpoints) = whole_durable_run().await;
    let one_done = first(checkpoints, "after one call", |c| {
        c.calls.as_ref().is_some_and(|calls| calls.finished.len() == 1)
    });
    let approvals = Arc::new(crate::store::memory::MemoryApprovals::new(16));
    let question = crate::domain::approval::PendingApproval {
        run_id: "r".into(),
        call_id: "id1".into(),
        name: "nap".into(),
        arguments_json: r#"{"ms": 50}"#.into(),
        turn: 1,
        requested_at_unix_ms: 0,
        expires_at_unix_ms: u64::MAX,
        principal: String::new(),
        decision: None,
        questions: Some(confirm_question()),
        in_doubt: false,
        context: Default::default(),
    };
    let stale = crate::domain::ports::Wait {
        run_id: "r".into(),
        principal: String::new(),
        calls: vec![(question, serde_json::json!({"type": "object"}))],
        epoch: 0,
    };
    approvals.open(stale).await.unwrap();
    let seq = one_done.seq;
    let outside = Outside {
        journal: Some(Arc::default()),
        resumed: Some(Resumed {
            checkpoint: one_done,
            logged: seq,
            segmented: Default::default(),
        }),
        approvals: Arc::clone(&approvals) as Arc<dyn crate::domain::ports::ApprovalStore>,
        ..Outside::default()
    };
    let turn2 = two_naps_then_an_answer().split_off(1);
    let (result, _, _, _) = play_with(turn2, limits(), outside).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    let left = approvals.parked_calls("r").await.unwrap();
    assert!(left.is_none(), "a wait outlived its run: {left:?}");
}
