//! Output accounting against the bounds (`output.rs`): cut results and arguments, split text, slow
//! readers, the per-turn limits.

use super::*;

#[tokio::test(start_paused = true)]
async fn large_tool_results_and_arguments_are_cut_for_the_model_and_in_their_events() {
    let big = format!(r#"{{"pad": "{}"}}"#, "x".repeat(5000));
    let (result, batches, script, _) = play_batched(vec![vec![call(0, "nap", &big)]], limits()).await;
    assert_eq!(result.status, RunStatus::Completed);
    let second = script.requests.lock().unwrap()[1].clone();
    let Some(Message::Tool { content, .. }) = second.messages.iter().rfind(|m| matches!(m, Message::Tool { .. }))
    else {
        panic!("{:?}", second.messages)
    };
    assert!(content.len() < 1100, "{} bytes fed back", content.len());
    assert!(content.ends_with(&format!(
        "[result cut: {} of {} bytes left out]",
        big.len() - 1024,
        big.len()
    )));
    let finished = batches.iter().flatten().find_map(|e| match &e.event {
        Event::ToolCallFinished {
            content_json,
            content_truncated,
            ..
        } => Some((content_json.clone().unwrap_or_default().len(), *content_truncated)),
        _ => None,
    });
    assert_eq!(finished, Some((1024, true)));
    // The arguments: cut in their event, whole in the run's record.
    let started = batches.iter().flatten().find_map(|e| match &e.event {
        Event::ToolCallStarted {
            arguments_json,
            arguments_truncated,
            ..
        } => Some((arguments_json.len(), *arguments_truncated)),
        _ => None,
    });
    assert_eq!(started, Some((1024, true)));
    assert_eq!(result.tool_calls[0].arguments_json, big);
}

#[tokio::test(start_paused = true)]
async fn long_tool_error_messages_are_cut_everywhere_the_run_keeps_them() {
    let message = "e".repeat(5000);
    let args = serde_json::json!({ "message": message }).to_string();
    let (result, batches, script, _) = play_batched(vec![vec![call(0, "bad", &args)]], limits()).await;
    let marker = format!("\n[message cut: {} of 5000 bytes left out]", 5000 - 1024);
    let kept = format!("{}{marker}", &message[..1024]);
    // The model's tool message, and the run's record.
    let second = script.requests.lock().unwrap()[1].clone();
    let Some(Message::Tool { content, .. }) = second.messages.iter().rfind(|m| matches!(m, Message::Tool { .. }))
    else {
        panic!("{:?}", second.messages)
    };
    let fed_back: serde_json::Value = serde_json::from_str(content).unwrap();
    assert_eq!(fed_back["error"]["message"], kept.as_str());
    let record = result.tool_calls[0].error.clone().unwrap();
    assert_eq!(record.message, kept);
    // The event: at most max_event_bytes (1024 here) of it.
    let event_message = batches.iter().flatten().find_map(|e| match &e.event {
        Event::ToolCallFinished { error: Some(e), .. } => Some(e.message.clone()),
        _ => None,
    });
    assert_eq!(event_message.as_deref(), Some(&message[..1024]));
    // A message within the bound is kept whole.
    let short = serde_json::json!({ "message": "e".repeat(1024) }).to_string();
    let (result, ..) = play_batched(vec![vec![call(0, "bad", &short)]], limits()).await;
    assert_eq!(result.tool_calls[0].error.clone().unwrap().message.len(), 1024);
}

#[tokio::test(start_paused = true)]
async fn long_text_is_split_over_events_of_the_largest_size() {
    let long = "é".repeat(1500);
    let (result, batches, ..) = play_batched(vec![vec![text(&long)]], limits()).await;
    let deltas: Vec<usize> = batches
        .iter()
        .flatten()
        .filter_map(|e| match &e.event {
            Event::TextDelta { text, .. } => Some(text.len()),
            _ => None,
        })
        .collect();
    assert_eq!(
        deltas,
        [1024, 1024, 952],
        "split on char boundaries, at most 1024 bytes each"
    );
    assert_eq!(streamed(&batches), (result.text, true));
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_stops_reading_is_given_up_and_frees_the_run() {
    let turns = (0..50)
        .map(|i| vec![text(&format!("line {i}\n")), call(0, "nap", "{}")])
        .collect();
    let outside = Outside {
        buffer: 1,
        read_every: None,
        attached: true,
        emit: EmitSettings {
            send_timeout: Duration::from_secs(2),
            ..EMIT
        },
        ..Outside::default()
    };
    let limits = many_turns();
    let started = Instant::now();
    let (result, ..) = play_with(turns, limits, outside).await;
    assert_eq!(result.status, RunStatus::Canceled);
    assert!(
        result.failure_detail.contains("stopped reading"),
        "{}",
        result.failure_detail
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "ended by the send timeout, not the deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn a_cancel_during_a_slow_read_leaves_no_gap_in_seq() {
    let turns = (0..20)
        .map(|i| vec![text(&format!("t{i} ")), call(0, "nap", "{}")])
        .collect();
    let outside = Outside {
        buffer: 1,
        read_every: Some(Duration::from_millis(300)),
        cancel_after: Some(Duration::from_millis(1000)),
        ..Outside::default()
    };
    let (result, batches, ..) = play_with(turns, many_turns(), outside).await;
    assert_eq!(result.status, RunStatus::Canceled);
    let (text, no_gaps) = streamed(&batches);
    assert!(
        no_gaps,
        "{:?}",
        batches.iter().flatten().map(|e| e.seq).collect::<Vec<_>>()
    );
    assert_eq!(text, result.text);
    assert!(matches!(
        batches.last().and_then(|b| b.last()).map(|e| &e.event),
        Some(Event::RunFinished(_))
    ));
}

fn bounded(max_calls_per_turn: usize, max_argument_bytes: usize, max_output_bytes: usize) -> Outside {
    Outside {
        output: OutputBounds {
            max_calls_per_turn,
            max_argument_bytes,
            max_output_bytes,
            ..(&crate::Config::default().runs.output).into()
        },
        ..Outside::default()
    }
}

async fn play_bounded(turns: Vec<Vec<Result<LlmEvent, LlmError>>>, outside: Outside) -> (RunResult, usize) {
    let (result, _, _, tools) = play_with(turns, limits(), outside).await;
    (result, tools.peak.load(Ordering::SeqCst))
}

#[tokio::test(start_paused = true)]
async fn calls_per_turn_on_both_sides_of_the_limit() {
    let naps = |n: u32| (0..n).map(|i| call(i, "nap", r#"{"ms": 1}"#)).collect::<Vec<_>>();
    let (result, ran) = play_bounded(vec![naps(2), vec![text("done")]], bounded(2, 1024, 4096)).await;
    assert_eq!(
        (result.status, result.tool_calls.len(), ran),
        (RunStatus::Completed, 2, 2)
    );

    let mut turn = vec![text("fanning out\n")];
    turn.extend(naps(3));
    let (result, ran) = play_bounded(vec![turn], bounded(2, 1024, 4096)).await;
    assert_eq!(
        (result.status, result.failure_reason, ran),
        (RunStatus::Failed, Some(FailureReason::OutputLimit), 0)
    );
    assert!(
        result.failure_detail.contains("more than 2 tool calls"),
        "{}",
        result.failure_detail
    );
    assert_eq!(result.text, "fanning out\n", "the text before is kept");
}

#[tokio::test(start_paused = true)]
async fn argument_bytes_on_both_sides_of_the_limit() {
    let at_limit = format!(r#"{{"s": "{}"}}"#, "x".repeat(64 - 9));
    let over = format!(r#"{{"s": "{}"}}"#, "x".repeat(65 - 9));
    assert_eq!((at_limit.len(), over.len()), (64, 65));
    let (result, ran) = play_bounded(
        vec![vec![call(0, "nap", &at_limit)], vec![text("done")]],
        bounded(8, 64, 4096),
    )
    .await;
    assert_eq!(
        (result.status, ran),
        (RunStatus::Completed, 1),
        "{}",
        result.failure_detail
    );
    // Over the limit: a bad call, as arguments that are not JSON are (this spec's policy
    // is FAIL; with FEED_BACK the error goes back to the model).
    let (result, ran) = play_bounded(vec![vec![call(0, "nap", &over)]], bounded(8, 64, 4096)).await;
    assert_eq!(
        (result.status, result.failure_reason, ran),
        (RunStatus::Failed, Some(FailureReason::ToolParseError), 0)
    );
    assert!(
        result
            .failure_detail
            .contains("65 bytes, over this server's limit of 64"),
        "{}",
        result.failure_detail
    );
}

#[tokio::test(start_paused = true)]
async fn output_bytes_on_both_sides_of_the_limit_and_while_held() {
    let (result, _) = play_bounded(vec![vec![text(&"a".repeat(100))]], bounded(8, 64, 100)).await;
    assert_eq!((result.status, result.text.len()), (RunStatus::Completed, 100));

    let (result, _) = play_bounded(
        vec![vec![text(&"a".repeat(60)), text(&"b".repeat(60))]],
        bounded(8, 64, 100),
    )
    .await;
    assert_eq!(
        (result.status, result.failure_reason),
        (RunStatus::Failed, Some(FailureReason::OutputLimit))
    );
    assert_eq!(result.text, format!("{}{}", "a".repeat(60), "b".repeat(40)));

    // A directive that never closes is held, not shown; it counts all the same.
    let open = format!("Here:\n```json\n{}", "c".repeat(200));
    let (result, _) = play_bounded(vec![vec![text(&open)]], bounded(8, 64, 100)).await;
    assert_eq!(result.failure_reason, Some(FailureReason::OutputLimit));
    assert_eq!(result.text, open[..100], "what fits of the held text is kept");
}

// Durable runs: the checkpoints a run saves, and a run resumed from each kind of safe point.
