//! Eager dispatch (`eager.rs`): calls started while the model writes the rest of its turn.

use super::*;

/// A piece of call `index`'s arguments, as servers stream them after the first fragment.
fn fragment(index: u32, arguments: &str) -> Result<LlmEvent, LlmError> {
    Ok(LlmEvent::ToolCallFragment {
        index: Some(index),
        id: None,
        name: None,
        arguments: Some(arguments.into()),
    })
}

/// A turn whose first call (a 500 ms nap) is complete at 0.4 s, while the model writes the
/// second call's arguments until 1.2 s; then an answer. Events come 200 ms apart.
fn slow_first_tool() -> Vec<Vec<Result<LlmEvent, LlmError>>> {
    vec![
        vec![
            call(0, "nap", r#"{"ms": 500}"#),
            call(1, "nap", r#"{"ms":"#),
            fragment(1, " 10"),
            fragment(1, ", \"pad\": "),
            fragment(1, "\"x\""),
            fragment(1, "}"),
        ],
        vec![text("rested")],
    ]
}

async fn timed(
    outside: Outside,
    turns: Vec<Vec<Result<LlmEvent, LlmError>>>,
    limits: Limits,
) -> (RunResult, Duration, Arc<Tools>) {
    let started = Instant::now();
    let (result, _, _, tools) = play_with(turns, limits, outside).await;
    (result, started.elapsed(), tools)
}

fn paced(eager: bool) -> Outside {
    Outside {
        eager,
        pace: Some(Duration::from_millis(200)),
        ..Outside::default()
    }
}

#[tokio::test(start_paused = true)]
async fn a_call_complete_in_the_stream_starts_while_the_model_writes_the_next() {
    let (at_end, at_end_took, _) = timed(paced(false), slow_first_tool(), limits()).await;
    let (early, early_took, tools) = timed(paced(true), slow_first_tool(), limits()).await;
    for result in [&at_end, &early] {
        assert_eq!(result.status, RunStatus::Completed, "{result:?}");
        assert_eq!(result.tool_calls.len(), 2);
    }
    // The same calls, ids and arguments, in the model's order.
    let calls = |r: &RunResult| {
        r.tool_calls
            .iter()
            .map(|c| (c.call_id.clone(), c.arguments_json.clone(), c.ok))
            .collect::<Vec<_>>()
    };
    assert_eq!(calls(&early), calls(&at_end));
    assert_eq!(*tools.started.lock().unwrap(), ["id0", "id1"]);
    // The first nap ran from 0.4 s, not from the stream's end at 1.2 s: the turn ends with the
    // stream (plus the second nap), not 0.5 s after it.
    let saved = at_end_took.saturating_sub(early_took);
    assert!(
        saved >= Duration::from_millis(400) && saved <= Duration::from_millis(500),
        "started at the end {at_end_took:?}, early {early_took:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn calls_start_early_only_within_the_budget_in_call_order() {
    let turns = vec![vec![
        call(0, "nap", r#"{"ms": 100}"#),
        call(1, "nap", r#"{"ms": 100}"#),
        call(2, "nap", r#"{"ms": 100}"#),
    ]];
    let limits = Limits {
        tool_call_budget: 1,
        ..limits()
    };
    let (result, _, tools) = timed(paced(true), turns, limits).await;
    assert_eq!(
        (result.status, result.failure_reason),
        (RunStatus::Failed, Some(FailureReason::ToolBudgetExhausted))
    );
    assert_eq!(
        *tools.started.lock().unwrap(),
        ["id0"],
        "only the first fits the budget"
    );
    assert_eq!(result.tool_calls.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_turn_that_fails_on_a_later_bad_call_still_records_the_call_that_ran() {
    let turns = vec![vec![call(0, "nap", r#"{"ms": 100}"#), call(1, "nope", "{}")]];
    let (result, _, tools) = timed(paced(true), turns, limits()).await;
    assert_eq!(
        (result.status, result.failure_reason),
        (RunStatus::Failed, Some(FailureReason::ToolParseError)),
        "{result:?}"
    );
    assert_eq!(*tools.started.lock().unwrap(), ["id0"]);
    let recorded: Vec<(&str, bool)> = result.tool_calls.iter().map(|c| (c.call_id.as_str(), c.ok)).collect();
    assert_eq!(recorded, [("id0", true)]);
}

#[tokio::test(start_paused = true)]
async fn calls_that_are_not_run_anyway_are_not_started_early() {
    // An exit call, a call needing a bad argument object, an unknown tool: none starts early.
    let turns = vec![
        vec![
            call(0, "done", "{}"),
            call(1, "nap", "[1]"),
            call(2, "nap", r#"{"ms": 1}"#),
        ],
        vec![text("ok")],
    ];
    let outside = Outside {
        parse_policy: ParsePolicy::FeedBack,
        ..paced(true)
    };
    let (result, _, tools) = timed(outside, turns, limits()).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(
        *tools.started.lock().unwrap(),
        ["id2"],
        "only the normal call, at the turn's end"
    );
    assert_eq!(result.signals.len(), 1);
}

/// A durable run of [`slow_first_tool`] with text before its calls: its checkpoints.
async fn durable_early_run() -> (RunResult, Vec<Checkpoint>) {
    let mut turns = slow_first_tool();
    turns[0].insert(0, text("checking "));
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        ..paced(true)
    };
    let (result, _, _, _) = play_with(turns, limits(), outside).await;
    (result, journal.checkpoints())
}

/// The checkpoint saved before the first call started early.
fn cut_short(checkpoints: Vec<Checkpoint>) -> Checkpoint {
    first(checkpoints, "of a call started early", |c| {
        c.calls.as_ref().is_some_and(|calls| calls.cut_short.is_some())
    })
}

#[tokio::test(start_paused = true)]
async fn a_durable_run_checkpoints_a_call_before_it_starts_early() {
    let (result, checkpoints) = durable_early_run().await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(result.text, "checking rested");
    let saved = cut_short(checkpoints);
    let calls = saved.calls.as_ref().unwrap();
    let ids: Vec<&str> = calls.sorted.calls.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["id0"], "the calls started so far");
    assert_eq!(calls.turn.text, "checking ");
    assert!(
        saved
            .outbox
            .iter()
            .any(|e| matches!(&e.event, Event::ToolCallStarted { call_id, .. } if call_id == "id0")),
        "its announcement leaves after the checkpoint holding it: {:?}",
        saved.outbox
    );
}

#[tokio::test(start_paused = true)]
async fn a_run_resumed_from_a_call_started_early_goes_on_with_it() {
    // The log holds nothing past the checkpoint: the turn keeps its text.
    let saved = cut_short(durable_early_run().await.1);
    let seq = saved.seq;
    let (result, events, script, tools) = resume_at(saved, seq).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(
        *tools.started.lock().unwrap(),
        ["id0"],
        "the started call runs again, same id"
    );
    assert_eq!(result.text, "checking all done");
    assert!(!events.iter().any(|e| matches!(e.event, Event::TurnRestarted { .. })));
    let request = script.requests.lock().unwrap()[0].clone();
    let assistant = request.messages.iter().find_map(|m| match m {
        Message::Assistant {
            content, tool_calls, ..
        } => Some((content.clone(), tool_calls.len())),
        _ => None,
    });
    assert_eq!(assistant, Some(("checking ".to_owned(), 1)));

    // The log holds text streamed after it: the turn's text is void, its call goes on.
    let saved = cut_short(durable_early_run().await.1);
    let logged = saved.seq + 3;
    let (result, events, script, tools) = resume_at(saved, logged).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(*tools.started.lock().unwrap(), ["id0"]);
    assert_eq!(result.text, "all done");
    let restarted = events.iter().find_map(|e| match &e.event {
        Event::TurnRestarted { turn: 1, reason, .. } => Some(reason.clone()),
        _ => None,
    });
    assert!(
        restarted
            .as_deref()
            .is_some_and(|r| r.contains("goes on with the 1 call(s)")),
        "{restarted:?}"
    );
    assert!(gap_free_from(&events, logged + 1), "{events:?}");
    let request = script.requests.lock().unwrap()[0].clone();
    let tool_messages = request
        .messages
        .iter()
        .filter(|m| matches!(m, Message::Tool { .. }))
        .count();
    assert_eq!(tool_messages, 1, "the turn is its started call");
}
