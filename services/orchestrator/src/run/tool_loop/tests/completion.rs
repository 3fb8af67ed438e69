//! The streamed completion (`completion.rs`): reasoning, pacing, the prefix each request keeps,
//! turns restarted on another endpoint.

use super::*;

#[tokio::test(start_paused = true)]
async fn a_model_looping_in_its_reasoning_is_stopped() {
    let thinking = |n: usize| Ok(LlmEvent::ReasoningDelta("Wait, let me reconsider.\n".repeat(n)));
    let (result, ..) = play(vec![vec![thinking(7), text("ok")]], limits()).await;
    assert_eq!(
        result.status,
        RunStatus::Completed,
        "7 repetitions: under the threshold of 8"
    );
    let (result, ..) = play(vec![vec![thinking(8), text("never")]], limits()).await;
    assert_eq!(result.failure_reason, Some(FailureReason::RepeatedLineLoop));
    assert!(result.failure_detail.contains("reasoning"), "{}", result.failure_detail);
    assert_eq!(result.text, "", "reasoning is not output");
    assert_eq!(
        result.reasoning,
        "Wait, let me reconsider.\n".repeat(8),
        "kept up to the repeated line"
    );
}

fn reasoning(t: &str) -> Result<LlmEvent, LlmError> {
    Ok(LlmEvent::ReasoningDelta(t.into()))
}

/// A turn reasoning before its call, then one reasoning before its answer.
fn reasoning_turns() -> Vec<Vec<Result<LlmEvent, LlmError>>> {
    vec![
        vec![
            reasoning("I need a nap. "),
            reasoning("One will do."),
            call(0, "nap", r#"{"ms": 1}"#),
        ],
        vec![reasoning("Rested."), text("slept")],
    ]
}

fn with_reasoning(max_reasoning_bytes: usize, send_reasoning: bool) -> Outside {
    Outside {
        output: OutputBounds {
            max_reasoning_bytes,
            ..(&crate::Config::default().runs.output).into()
        },
        send_reasoning,
        ..Outside::default()
    }
}

/// Reasoning events' text, and their turns.
fn streamed_reasoning(batches: &[EventBatch]) -> (String, Vec<u32>) {
    batches
        .iter()
        .flatten()
        .filter_map(|e| match &e.event {
            Event::ReasoningDelta { text, turn } => Some((text.as_str(), *turn)),
            _ => None,
        })
        .fold((String::new(), Vec::new()), |(mut all, mut turns), (text, turn)| {
            all.push_str(text);
            turns.push(turn);
            (all, turns)
        })
}

#[tokio::test(start_paused = true)]
async fn reasoning_is_streamed_and_kept_apart_from_the_text_up_to_its_cap() {
    let all = "I need a nap. One will do.Rested.";
    let (result, batches, script, _) = play_with(reasoning_turns(), limits(), with_reasoning(all.len(), false)).await;
    assert_eq!((result.status, result.text.as_str()), (RunStatus::Completed, "slept"));
    assert_eq!((result.reasoning.as_str(), result.reasoning_truncated), (all, false));
    // Deltas already there are one event, as text is.
    assert_eq!(streamed_reasoning(&batches), (all.to_owned(), vec![1, 2]));
    let second = script.requests.lock().unwrap()[1].clone();
    assert!(
        matches!(&second.messages[2], Message::Assistant { reasoning: None, .. }),
        "not sent back unless configured: {:?}",
        second.messages[2]
    );

    // One byte under: the run goes on, its reasoning cut and flagged.
    let (result, batches, ..) = play_with(reasoning_turns(), limits(), with_reasoning(all.len() - 1, false)).await;
    assert_eq!((result.status, result.text.as_str()), (RunStatus::Completed, "slept"));
    assert_eq!(
        (result.reasoning.as_str(), result.reasoning_truncated),
        (&all[..all.len() - 1], true)
    );
    assert_eq!(streamed_reasoning(&batches).0, result.reasoning);

    // Nothing kept at all.
    let (result, batches, ..) = play_with(reasoning_turns(), limits(), with_reasoning(0, false)).await;
    assert_eq!(
        (result.status, result.reasoning.as_str(), result.reasoning_truncated),
        (RunStatus::Completed, "", true)
    );
    assert_eq!(streamed_reasoning(&batches).1, Vec::<u32>::new());
}

#[tokio::test(start_paused = true)]
async fn reasoning_goes_back_to_the_model_when_configured_within_its_cap() {
    let (result, _, script, _) = play_with(reasoning_turns(), limits(), with_reasoning(1024, true)).await;
    assert_eq!(result.status, RunStatus::Completed);
    let second = script.requests.lock().unwrap()[1].clone();
    let Message::Assistant {
        reasoning, tool_calls, ..
    } = &second.messages[2]
    else {
        panic!("{:?}", second.messages[2]);
    };
    assert_eq!(
        (reasoning.as_deref(), tool_calls.len()),
        (Some("I need a nap. One will do."), 1)
    );

    let (_, _, script, _) = play_with(reasoning_turns(), limits(), with_reasoning(6, true)).await;
    let second = script.requests.lock().unwrap()[1].clone();
    assert!(
        matches!(&second.messages[2], Message::Assistant { reasoning: Some(r), .. } if r == "I need"),
        "{:?}",
        second.messages[2]
    );
}

/// 40 tokens 10 ms apart, then a call, then an answer: played with `interval`, the text events
/// of turn 1, the whole stream, and the ticks turn 1's reader woke on.
async fn paced_run(interval: Duration) -> (Vec<String>, Vec<NumberedEvent>, RunResult, u64) {
    let mut turn1: Vec<_> = (0..40).map(|i| text(&format!("t{i} "))).collect();
    turn1.push(call(0, "nap", r#"{"ms": 1}"#));
    let outside = Outside {
        pace: Some(Duration::from_millis(10)),
        stream_interval: interval,
        ..Outside::default()
    };
    let (result, batches, script, _) = play_with(vec![turn1, vec![text("done")]], limits(), outside).await;
    let ticks = script.requests.lock().unwrap()[0].pace.ticks();
    let events: Vec<NumberedEvent> = batches.into_iter().flatten().collect();
    let texts = events
        .iter()
        .filter_map(|e| match &e.event {
            Event::TextDelta { text, turn: 1 } => Some(text.clone()),
            _ => None,
        })
        .collect();
    (texts, events, result, ticks)
}

/// With a 50 ms interval the first delta goes at once and the rest come a tick's worth at a time
/// (about 5 tokens per event instead of 1); the text, the seq numbering and the call are as
/// without it.
#[tokio::test(start_paused = true)]
async fn a_stream_interval_gathers_the_text_of_each_tick_into_one_event() {
    let (each, each_events, each_result, _) = paced_run(Duration::ZERO).await;
    let (gathered, events, result, ticks) = paced_run(Duration::from_millis(50)).await;
    assert!((8..=12).contains(&ticks), "{ticks} ticks");
    assert_eq!(each.len(), 40, "one event per token without an interval");
    assert_eq!(
        gathered.first().map(String::as_str),
        Some("t0 "),
        "the first delta at once"
    );
    assert!(
        (8..=12).contains(&gathered.len()),
        "400 ms of tokens in 50 ms ticks: {gathered:?}"
    );
    assert_eq!(gathered.concat(), each.concat());
    assert_eq!(result.text, each_result.text);
    assert!(events.iter().zip(1..).all(|(e, n)| e.seq == n), "gap-free");
    let kinds = |events: &[NumberedEvent]| {
        events
            .iter()
            .filter(|e| !matches!(e.event, Event::TextDelta { .. }))
            .map(|e| std::mem::discriminant(&e.event))
            .collect::<Vec<_>>()
    };
    assert_eq!(kinds(&events), kinds(&each_events), "every other event as without it");
}

/// A model slower than the interval (a token every 10 ms, ticks every 5 ms): once a tick finds
/// nothing, its tokens go as they come, and the run stops waking on ticks in between; the text
/// events are the same as without an interval.
#[tokio::test(start_paused = true)]
async fn a_model_slower_than_the_interval_is_read_as_it_comes() {
    let (each, ..) = paced_run(Duration::ZERO).await;
    let (texts, events, result, ticks) = paced_run(Duration::from_millis(5)).await;
    assert_eq!(texts, each, "one event per token, as without an interval");
    assert!(ticks <= 2, "woke on {ticks} ticks for 40 tokens");
    assert_eq!(result.status, RunStatus::Completed);
    assert!(events.iter().zip(1..).all(|(e, n)| e.seq == n), "gap-free");
}

/// The end of the messages in a request's body: what a model server's prefix cache can keep of it.
fn prompt_end(body: &[u8]) -> usize {
    let marker = br#"],"stream":true"#;
    body.windows(marker.len())
        .rposition(|w| w == marker)
        .map_or(body.len(), |at| at)
}

/// Each request's body starts with the one before it, byte for byte, up to the end of its
/// messages.
fn assert_each_request_extends_the_last(requests: &[ChatRequest]) {
    let bodies: Vec<Vec<u8>> = requests.iter().map(crate::llm::body::request_body).collect();
    for (n, pair) in bodies.windows(2).enumerate() {
        let kept = &pair[0][..prompt_end(&pair[0])];
        assert!(
            pair[1].starts_with(kept),
            "request {} does not start with request {}:\n{}\n---\n{}",
            n + 2,
            n + 1,
            String::from_utf8_lossy(kept),
            String::from_utf8_lossy(&pair[1])
        );
    }
}

#[tokio::test(start_paused = true)]
async fn each_turns_request_extends_the_last_through_results_failures_fallback_and_feedback() {
    let turns = vec![
        // Tool results, one of them a failure.
        vec![
            text("two at once "),
            call(0, "nap", r#"{"ms": 5}"#),
            call(1, "bad", "{}"),
        ],
        // A call written in the text.
        vec![text(
            r#"<tool_call>{"name": "nap", "arguments": {"ms": 1}}</tool_call>"#,
        )],
        // A bad call answered with an error (parse policy FEED_BACK), and an exit call.
        vec![call(0, "nope", "{}"), call(1, "done", "{}")],
        vec![text("done")],
    ];
    let outside = Outside {
        parse_policy: ParsePolicy::FeedBack,
        ..Outside::default()
    };
    let limits = Limits {
        max_tool_failures: 3,
        ..limits()
    };
    let (result, _, script, _) = play_with(turns, limits, outside).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    let requests = script.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 4);
    assert_each_request_extends_the_last(&requests);
    // The BIOS is the same every turn; what changed is in the status note after the newest
    // messages.
    assert!(requests.windows(2).all(|w| w[0].messages[0] == w[1].messages[0]));
    let Some(Message::User { content: note, .. }) = requests[3].messages.last() else {
        panic!("{:?}", requests[3].messages)
    };
    assert!(
        note.contains("Turn 4 of at most 8")
            && note.contains("7 normal call(s) left")
            && note.contains("1 more turn(s)"),
        "{note}"
    );
}

/// The requests of a durable run played whole, and its checkpoints.
async fn durable_requests() -> (Vec<ChatRequest>, Vec<Checkpoint>) {
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        ..Outside::default()
    };
    let (result, _, script, _) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    let requests = script.requests.lock().unwrap().clone();
    (requests, journal.checkpoints())
}

#[tokio::test(start_paused = true)]
async fn a_resumed_or_restarted_turn_sends_what_the_run_would_have_sent_here() {
    let (whole, checkpoints) = durable_requests().await;
    assert_each_request_extends_the_last(&whole);
    let (_, again) = durable_requests().await;
    let one_done = first(again, "after one call", |c| {
        c.calls.as_ref().is_some_and(|calls| calls.finished.len() == 1)
    });
    let turn_end = first(checkpoints, "at the end of turn 1", |c| {
        c.calls.is_none() && c.progress.turns_done == 1
    });
    let seq = one_done.seq;
    let (_, _, resumed, _) = resume_at(one_done, seq).await;
    let logged = turn_end.seq + 2;
    let (_, _, restarted, _) = resume_at(turn_end, logged).await;
    for (how, script) in [("resumed among its calls", resumed), ("restarted", restarted)] {
        let sent = script.requests.lock().unwrap().clone();
        assert_eq!(sent.len(), 1, "{how}");
        assert_eq!(
            crate::llm::body::request_body(&sent[0]),
            crate::llm::body::request_body(&whole[1]),
            "turn 2 {how} is the same request"
        );
    }
}

fn cut(endpoint: &str) -> Result<LlmEvent, LlmError> {
    Err(LlmError::Cut {
        endpoint: endpoint.into(),
        error: Box::new(LlmError::Protocol("the stream broke off".into())),
    })
}

#[tokio::test(start_paused = true)]
async fn a_stream_cut_by_one_endpoint_restarts_the_turn_on_another_taking_its_text_back() {
    let turns = vec![
        vec![text("first attempt, "), reasoning("thinking "), cut("http://a/v1")],
        vec![text("second "), call(0, "nap", r#"{"ms": 1}"#)],
        vec![text("done")],
    ];
    let (result, events, script, _) = play(turns, limits()).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(result.text, "second done");
    assert_eq!(result.reasoning, "");
    assert_eq!(result.turns, 2);
    let restarted: Vec<&Event> = events
        .iter()
        .map(|e| &e.event)
        .filter(|e| matches!(e, Event::TurnRestarted { .. }))
        .collect();
    let [
        Event::TurnRestarted {
            turn: 1,
            attempt: 2,
            reason,
        },
    ] = restarted.as_slice()
    else {
        panic!("{restarted:?}")
    };
    assert!(reason.contains("http://a/v1"), "{reason}");
    // The attempt after the cut asks the same, away from the endpoint that cut it.
    let requests = script.requests.lock().unwrap().clone();
    assert_eq!(requests[1].messages, requests[0].messages);
    assert_eq!(
        (requests[0].avoid.as_deref(), requests[1].avoid.as_deref()),
        (None, Some("http://a/v1"))
    );
    assert_eq!(requests[2].avoid, None);
}

#[tokio::test(start_paused = true)]
async fn turn_restarts_on_both_sides_of_their_limit() {
    // The loop's deps allow two restarts a turn: the third cut ends the run with its text.
    let cuts = |n: usize| {
        let mut turns: Vec<Vec<Result<LlmEvent, LlmError>>> = (0..n)
            .map(|i| vec![text(&format!("try {i} ")), cut("http://a/v1")])
            .collect();
        turns.push(vec![text("answer")]);
        turns
    };
    let (result, ..) = play(cuts(2), limits()).await;
    assert_eq!((result.status, result.text.as_str()), (RunStatus::Completed, "answer"));
    let (result, ..) = play(cuts(3), limits()).await;
    assert_eq!(
        (result.status, result.failure_reason),
        (RunStatus::Failed, Some(FailureReason::LlmError)),
        "{result:?}"
    );
    assert_eq!(result.text, "try 2 ", "the last attempt's text is kept");
    assert!(
        result.failure_detail.contains("http://a/v1"),
        "{}",
        result.failure_detail
    );
}
