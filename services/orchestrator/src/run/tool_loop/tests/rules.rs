//! The rules of a turn (`rules.rs`): batches, parallel and exit calls, failures, the budget,
//! cancels, deadlines, the loop detector, the turn guard, token budgets and the usage book.

use super::*;

#[tokio::test(start_paused = true)]
async fn events_produced_together_reach_the_stream_as_one_batch() {
    let turn1 = vec![
        call(0, "nap", r#"{"ms": 5}"#),
        call(1, "nap", r#"{"ms": 5}"#),
        call(2, "done", r#"{"ok": true}"#),
    ];
    let turn2 = vec![Ok(LlmEvent::TextDelta("fin".into()))];
    let (result, batches, _, _) = play_batched(vec![turn1, turn2], limits()).await;
    assert_eq!(result.status, RunStatus::Completed);
    let kinds: Vec<Vec<&str>> = batches
        .iter()
        .map(|b| {
            b.iter()
                .map(|e| match &e.event {
                    Event::RunStarted { .. } => "run_started",
                    Event::TextDelta { .. } => "text",
                    Event::ReasoningDelta { .. } => "reasoning",
                    Event::ToolCallStarted { .. } => "call_started",
                    Event::ToolCallFinished { .. } => "call_finished",
                    Event::Signal(_) => "signal",
                    Event::TurnFinished { .. } => "turn_finished",
                    Event::TurnRestarted { .. } => "turn_restarted",
                    Event::ApprovalRequested { .. } => "approval_requested",
                    Event::MessageAdded { .. } => "message_added",
                    Event::ToolInputRequested { .. } => "input_requested",
                    Event::ToolCallProgress { .. } => "call_progress",
                    Event::CallDecided { .. } => "call_decided",
                    Event::RunFinished(_) => "run_finished",
                })
                .collect()
        })
        .collect();
    assert_eq!(
        kinds,
        [
            vec!["run_started"],
            vec!["signal", "call_started", "call_started"],
            vec!["call_finished", "call_finished", "turn_finished"],
            vec!["text"],
            vec!["turn_finished", "run_finished"],
        ]
    );
    let seqs: Vec<u64> = batches.iter().flatten().map(|e| e.seq).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "numbered without gaps"
    );
}

#[tokio::test(start_paused = true)]
async fn parallel_calls_overlap_and_exit_calls_are_signals() {
    let turn1 = vec![
        Ok(LlmEvent::TextDelta("napping".into())),
        call(0, "nap", r#"{"ms": 500}"#),
        call(1, "nap", r#"{"ms": 500}"#),
        call(2, "done", r#"{"ok": true}"#),
        call(3, "nap", r#"{"ms": 500}"#),
        Ok(LlmEvent::Usage(Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            cached_prompt_tokens: 1,
        })),
    ];
    let (result, events, script, tools) = play(vec![turn1], limits()).await;
    assert_eq!(result.status, RunStatus::Completed);
    assert_eq!(tools.peak.load(Ordering::SeqCst), 3, "all three ran at once");
    assert_eq!(
        result.tool_calls.iter().map(|c| c.call_id.as_str()).collect::<Vec<_>>(),
        ["id0", "id1", "id3"]
    );
    assert_eq!(result.signals.len(), 1);
    assert_eq!(
        result.usage,
        Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            cached_prompt_tokens: 1,
        }
    );
    // The second request: the status note after the tool messages shows the spent budget; the
    // exit call is not in the conversation.
    let second = script.requests.lock().unwrap()[1].clone();
    let Some(Message::User { content: note, .. }) = second.messages.last() else {
        panic!("a status note last: {:?}", second.messages)
    };
    assert!(
        note.contains("Turn 2 of at most 8") && note.contains("7 normal call(s) left"),
        "{note}"
    );
    let Message::Assistant { tool_calls, .. } = &second.messages[2] else {
        panic!("{:?}", second.messages)
    };
    assert_eq!(
        tool_calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
        ["nap", "nap", "nap"]
    );
    assert!(events.windows(2).all(|w| w[1].seq == w[0].seq + 1));
}

#[tokio::test(start_paused = true)]
async fn failures_count_once_per_turn_and_the_limit_ends_the_run() {
    let failing = || vec![call(0, "bad", "{}"), call(1, "bad", "{}"), call(2, "bad", "{}")];
    let (result, ..) = play(vec![failing(), failing(), vec![]], limits()).await;
    assert_eq!(
        (result.status, result.failure_reason, result.failed_turns),
        (RunStatus::Failed, Some(FailureReason::ToolFailureLimit), 2)
    );
    assert_eq!(result.tool_calls.len(), 6);
}

#[tokio::test(start_paused = true)]
async fn the_budget_runs_the_first_calls_then_ends() {
    let turn = vec![
        call(0, "nap", r#"{"n": 1}"#),
        call(1, "nap", r#"{"n": 2}"#),
        call(2, "nap", r#"{"n": 3}"#),
    ];
    let (result, ..) = play(
        vec![turn],
        Limits {
            tool_call_budget: 2,
            ..limits()
        },
    )
    .await;
    assert_eq!(result.failure_reason, Some(FailureReason::ToolBudgetExhausted));
    assert_eq!(
        result
            .tool_calls
            .iter()
            .map(|c| c.arguments_json.as_str())
            .collect::<Vec<_>>(),
        [r#"{"n": 1}"#, r#"{"n": 2}"#]
    );
}

#[tokio::test(start_paused = true)]
async fn an_error_mid_stream_keeps_held_back_text() {
    let turn = vec![
        Ok(LlmEvent::TextDelta("visible <tool_".into())),
        Err(LlmError::Protocol("the LLM stream broke off".into())),
    ];
    let (result, ..) = play(vec![turn], limits()).await;
    assert_eq!(
        (result.status, result.failure_reason),
        (RunStatus::Failed, Some(FailureReason::LlmError))
    );
    assert_eq!(result.text, "visible <tool_", "held-back text is output too");
}

#[tokio::test(start_paused = true)]
async fn text_arriving_at_once_is_one_delta_and_a_loop_is_cut_at_the_repeated_line() {
    let line = "the same line again\n";
    let turn = vec![
        Ok(LlmEvent::TextDelta(line.repeat(10))),
        Ok(LlmEvent::TextDelta("never shown".into())),
    ];
    let (result, events, ..) = play(vec![turn], limits()).await;
    assert_eq!(result.failure_reason, Some(FailureReason::RepeatedLineLoop));
    assert_eq!(
        result.text,
        line.repeat(8),
        "output stops at the eighth repetition (the threshold)"
    );
    let deltas = events
        .iter()
        .filter(|e| matches!(e.event, Event::TextDelta { .. }))
        .count();
    assert_eq!(deltas, 1, "chunks already there are shown as one delta");
}

#[tokio::test(start_paused = true)]
async fn the_turn_guard_holds_whatever_max_turns_says() {
    let forever: Vec<_> = (0..200).map(|_| vec![call(0, "nap", "{}")]).collect();
    let (result, ..) = play(
        forever,
        Limits {
            max_turns: 1000,
            tool_call_budget: 10_000,
            ..limits()
        },
    )
    .await;
    assert_eq!(
        (result.failure_reason, result.turns),
        (Some(FailureReason::MaxTurnsExceeded), HARD_MAX_TURNS)
    );
}

#[tokio::test(start_paused = true)]
async fn a_cancel_mid_code_block_keeps_the_held_text_and_the_usage() {
    let turn = vec![text(HELD_CALL), usage(7, 3)];
    let outside = Outside {
        hang: true,
        cancel_after: Some(Duration::from_secs(1)),
        ..Outside::default()
    };
    let (result, batches, ..) = play_with(vec![turn], limits(), outside).await;
    assert_eq!(result.status, RunStatus::Canceled);
    assert_eq!(result.text, HELD_CALL);
    assert_eq!(streamed(&batches), (result.text.clone(), true));
    assert_eq!(result.usage.prompt_tokens, 7, "the interrupted turn's usage counts");
}

/// A turn whose call naps `ms`, then one the model would answer with.
pub(super) fn a_nap_then_an_answer(ms: u64) -> Vec<Vec<Result<LlmEvent, LlmError>>> {
    vec![
        vec![text("Napping.\n"), call(0, "nap", &format!("{{\"ms\": {ms}}}"))],
        vec![text("Rested.")],
    ]
}

#[tokio::test(start_paused = true)]
async fn a_cancel_after_the_turn_lets_its_call_finish_and_asks_the_model_no_more() {
    let outside = Outside {
        cancel_after: Some(Duration::from_secs(1)),
        cancel_mode: CancelMode::AfterTurn,
        ..Outside::default()
    };
    let (result, batches, script, _) = play_with(a_nap_then_an_answer(3000), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Canceled);
    assert_eq!(result.failure_detail, "canceled by the test");
    assert_eq!(result.text, "Napping.\n");
    assert_eq!(result.tool_calls.len(), 1);
    assert!(
        result.tool_calls[0].ok,
        "the turn's call ran to its end: {:?}",
        result.tool_calls
    );
    assert_eq!(script.requests.lock().unwrap().len(), 1, "no new model request");
    assert_eq!(streamed(&batches), (result.text.clone(), true));
}

#[tokio::test(start_paused = true)]
async fn an_immediate_cancel_after_a_cancel_after_the_turn_wins() {
    let outside = Outside {
        cancel_after: Some(Duration::from_secs(1)),
        cancel_mode: CancelMode::AfterTurn,
        cancel_at_once_after: Some(Duration::from_secs(2)),
        ..Outside::default()
    };
    let (result, _, script, _) = play_with(a_nap_then_an_answer(60_000), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Canceled);
    assert_eq!(result.failure_detail, "canceled at once by the test");
    assert!(
        result.tool_calls.iter().all(|c| !c.ok),
        "the call in flight was abandoned, not waited for: {:?}",
        result.tool_calls
    );
    assert_eq!(script.requests.lock().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_cancel_after_a_turn_that_ends_the_run_lets_it_complete() {
    let outside = Outside {
        cancel_after: Some(Duration::from_millis(10)),
        cancel_mode: CancelMode::AfterTurn,
        pace: Some(Duration::from_millis(100)),
        ..Outside::default()
    };
    let turn = vec![text("All "), text("done.")];
    let (result, ..) = play_with(vec![turn], limits(), outside).await;
    assert_eq!(
        (result.status, result.text.as_str()),
        (RunStatus::Completed, "All done.")
    );
}

#[tokio::test(start_paused = true)]
async fn the_deadline_keeps_held_text_and_code_blocks_stream_before_it() {
    let turn = vec![text("```rust\nfn main() {}\n```\n"), text(OPEN_DIRECTIVE)];
    let outside = Outside {
        hang: true,
        ..Outside::default()
    };
    let limits = Limits {
        run_timeout: Duration::from_secs(3),
        ..limits()
    };
    let (result, batches, ..) = play_with(vec![turn], limits, outside).await;
    assert_eq!(
        (result.status, result.failure_reason),
        (RunStatus::Failed, Some(FailureReason::DeadlineExceeded))
    );
    assert_eq!(result.text, format!("```rust\nfn main() {{}}\n```\n{OPEN_DIRECTIVE}"));
    let (text, no_gaps) = streamed(&batches);
    assert!(no_gaps && text == result.text);
    let first = batches.iter().flatten().find_map(|e| match &e.event {
        Event::TextDelta { text, .. } => Some(text.clone()),
        _ => None,
    });
    assert_eq!(
        first.as_deref(),
        Some("```rust\nfn main() {}\n```\n"),
        "the code block streamed at once"
    );
}

/// A deadline already past when a run goes on (a parked run woken by it) ends the run, even
/// when its loop is done at once: the deadline's timer alone fires only once the runtime's clock
/// next moves, and a resumed run could take a whole turn before that.
#[tokio::test]
async fn a_deadline_already_past_wins_over_a_loop_that_is_done() {
    let mut spec = spec(limits());
    spec.deadline = Deadline::new(Instant::now(), Duration::ZERO, None, Duration::ZERO);
    let ends = Ends {
        cancel: &Cancel::default(),
        caller: None,
        hand_over: &HandOver::default(),
        persister: None,
    };
    let end = race(std::future::ready(End::Completed), &spec, ends).await;
    assert!(matches!(end, End::Failed(FailureReason::DeadlineExceeded, _)));
}

#[tokio::test(start_paused = true)]
async fn usage_of_a_turn_that_breaks_off_counts() {
    let turn = vec![
        text("partial"),
        usage(11, 5),
        Err(LlmError::Protocol("the LLM stream broke off".into())),
    ];
    let (result, ..) = play(vec![turn], limits()).await;
    assert_eq!(result.failure_reason, Some(FailureReason::LlmError));
    assert_eq!((result.usage.prompt_tokens, result.usage.completion_tokens), (11, 5));
}

/// The `max_tokens` each model request asked for, in order.
fn asked_max_tokens(script: &Script) -> Vec<Option<u32>> {
    script
        .requests
        .lock()
        .unwrap()
        .iter()
        .map(|r| r.params.max_tokens)
        .collect()
}

/// A run's token budget counts each turn's prompt (at least the last turn's prompt and
/// completion, which it holds) against what is left: a request asks for at most what remains
/// after it, and a turn whose prompt leaves nothing is never asked; the run ends FAILED
/// `TOKEN_BUDGET` with its output and tool results kept.
#[tokio::test(start_paused = true)]
async fn a_turn_is_asked_only_for_what_the_budget_leaves_after_its_prompt() {
    let turn = || vec![text("working"), call(0, "nap", r#"{"ms": 1}"#), usage(30, 20)];
    let budget = Limits {
        max_total_tokens: 120,
        ..many_turns()
    };
    let (result, _, script, _) = play(vec![turn(), turn(), turn(), turn()], budget).await;
    assert_eq!(
        (result.status, result.failure_reason, result.turns),
        (RunStatus::Failed, Some(FailureReason::TokenBudget), 2)
    );
    assert_eq!(result.tool_calls.len(), 2, "the calls that ran are kept");
    assert!(
        result.failure_detail.contains("spent 100 tokens")
            && result.failure_detail.contains("120")
            && result.failure_detail.contains("at least 50 tokens"),
        "{}",
        result.failure_detail
    );
    // Turn 2's prompt counts as turn 1's 50: 70 left, 20 for its answer; turn 3 is never asked.
    let asked = asked_max_tokens(&script);
    assert_eq!(asked, [Some(120), Some(20)]);
}

/// A turn that goes over the budget (its model answered more than the prompt count foresaw) is
/// the last.
#[tokio::test(start_paused = true)]
async fn the_turn_that_spends_the_token_budget_is_the_last() {
    let turns = vec![
        vec![text("working"), call(0, "nap", r#"{"ms": 1}"#), usage(30, 20)],
        vec![text("working"), call(0, "nap", r#"{"ms": 1}"#), usage(90, 20)],
        vec![text("done"), usage(10, 5)],
    ];
    let budget = Limits {
        max_total_tokens: 120,
        ..many_turns()
    };
    let (result, _, script, _) = play(turns, budget).await;
    assert_eq!(
        (result.status, result.failure_reason, result.turns),
        (RunStatus::Failed, Some(FailureReason::TokenBudget), 2)
    );
    assert!(
        result.failure_detail.contains("160 tokens"),
        "{}",
        result.failure_detail
    );
    assert_eq!(asked_max_tokens(&script), [Some(120), Some(20)]);
}

/// A budget that is never reached changes nothing: a large one sets no `max_tokens`.
#[tokio::test(start_paused = true)]
async fn a_budget_not_reached_changes_nothing() {
    let turns = vec![
        vec![text("working"), call(0, "nap", r#"{"ms": 1}"#), usage(30, 20)],
        vec![text("done"), usage(10, 5)],
    ];
    let (result, _, script, _) = play(
        turns,
        Limits {
            max_total_tokens: 1_000_000,
            ..limits()
        },
    )
    .await;
    assert_eq!((result.status, result.usage.prompt_tokens), (RunStatus::Completed, 40));
    let asked = asked_max_tokens(&script);
    assert_eq!(asked, [None, None]);
}

/// A usage book that refuses the adds whose numbers (from 1) it is given, as a store cut off
/// would, and keeps the others.
struct RefusingBook {
    book: crate::store::memory::MemoryUsage,
    refuse: Vec<usize>,
    adds: Mutex<usize>,
}

impl RefusingBook {
    fn refusing(refuse: Vec<usize>) -> Arc<Self> {
        Arc::new(Self {
            book: crate::store::memory::MemoryUsage::new(Duration::from_secs(3600)),
            refuse,
            adds: Mutex::default(),
        })
    }

    /// The tokens the book holds for the test's caller.
    async fn tokens(&self) -> u64 {
        use crate::domain::ports::UsageBook as _;
        let windows = self.book.read(&spec(limits()).principal, 0, u64::MAX).await.unwrap();
        windows.iter().map(|(_, tally)| tally.tokens()).sum()
    }
}

impl crate::domain::ports::UsageBook for RefusingBook {
    fn add(
        &self,
        principal: &str,
        window: u64,
        spend: crate::domain::usage::Add,
    ) -> futures::future::BoxFuture<'static, Result<crate::domain::usage::Tally, crate::domain::ports::StoreError>>
    {
        let number = {
            let mut adds = self.adds.lock().unwrap();
            *adds += 1;
            *adds
        };
        if self.refuse.contains(&number) {
            let refused = crate::domain::ports::StoreError::Unavailable {
                operation: "usage add",
                key: principal.to_owned(),
                reason: "cut off".to_owned(),
            };
            return Box::pin(std::future::ready(Err(refused)));
        }
        self.book.add(principal, window, spend)
    }

    fn read(
        &self,
        principal: &str,
        from: u64,
        to: u64,
    ) -> futures::future::BoxFuture<
        'static,
        Result<Vec<(u64, crate::domain::usage::Tally)>, crate::domain::ports::StoreError>,
    > {
        self.book.read(principal, from, to)
    }
}

/// Three turns that spend 50, 50 and 15 tokens.
fn three_spending_turns() -> Vec<Vec<Result<LlmEvent, LlmError>>> {
    vec![
        vec![text("working"), call(0, "nap", r#"{"ms": 1}"#), usage(30, 20)],
        vec![text("working"), call(0, "nap", r#"{"ms": 1}"#), usage(30, 20)],
        vec![text("done"), usage(10, 5)],
    ]
}

/// A turn's spend the book refused (the store cut off) is booked by the next add: the book
/// ends holding every token the run spent.
#[tokio::test(start_paused = true)]
async fn a_turns_spend_the_book_refused_is_booked_by_the_next_add() {
    let book = RefusingBook::refusing(vec![1]);
    let outside = Outside {
        usage: book.clone(),
        ..Outside::default()
    };
    let (result, _, _, _) = play_with(three_spending_turns(), many_turns(), outside).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(result.usage.prompt_tokens + result.usage.completion_tokens, 115);
    assert_eq!(
        book.tokens().await,
        115,
        "the refused turn's 50 tokens came with the next add"
    );
}

/// A durable run whose end the book refused is not shown ended: the replica that takes it over
/// books its spend and ends it (no end is shown whose spend the book may lack).
#[tokio::test(start_paused = true)]
async fn a_durable_runs_end_waits_for_its_spend_to_be_booked() {
    let book = RefusingBook::refusing(vec![3, 4]);
    let outside = Outside {
        usage: book.clone(),
        journal: Some(Arc::default()),
        ..Outside::default()
    };
    let (result, batches, _, _) = play_with(three_spending_turns(), many_turns(), outside).await;
    let events: Vec<NumberedEvent> = batches.into_iter().flatten().collect();
    assert_eq!(result.turns, 3, "{result:?}");
    assert!(
        events.iter().all(|e| e.finished().is_none()),
        "no end is shown: {events:?}"
    );
    assert_eq!(book.tokens().await, 100, "the first two turns are booked");
}
