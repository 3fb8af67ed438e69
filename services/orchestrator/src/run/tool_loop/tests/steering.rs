//! Messages sent to a live run (`run/steering.rs` and the inbox rules of `rules.rs`), and a run on
//! a thread.

use super::*;

pub(super) fn user(text: &str) -> UserMessage {
    UserMessage {
        content: text.to_owned(),
        name: None,
    }
}

/// The text of the newest message of a request, when it is a user message.
fn last_user_text(request: &ChatRequest) -> Option<&str> {
    match request.messages.last() {
        Some(Message::User { content, .. }) => Some(content),
        _ => None,
    }
}

/// The `message_added` events: their turn and text.
fn messages_added(events: &[NumberedEvent]) -> Vec<(u32, &str)> {
    events
        .iter()
        .filter_map(|e| match &e.event {
            Event::MessageAdded { turn, content, .. } => Some((*turn, content.as_str())),
            _ => None,
        })
        .collect()
}

/// Steering: a message sent while the turn's call runs joins the conversation after the call's
/// result (after the turn's status note, as one user message), so the next request holds it at
/// its end and starts with the one before byte for byte.
#[tokio::test(start_paused = true)]
async fn a_message_sent_while_a_call_runs_joins_the_next_request_after_its_result() {
    let outside = Outside {
        messages: vec![(Duration::from_secs(1), "Also check the weather in Oslo.")],
        ..Outside::default()
    };
    let (result, batches, script, _) = play_with(a_nap_then_an_answer(3000), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    let events: Vec<NumberedEvent> = batches.into_iter().flatten().collect();
    assert_eq!(messages_added(&events), [(2, "Also check the weather in Oslo.")]);
    let turn_one_ended = events
        .iter()
        .position(|e| matches!(e.event, Event::TurnFinished { turn: 1, .. }));
    let added = events
        .iter()
        .position(|e| matches!(e.event, Event::MessageAdded { .. }));
    assert!(turn_one_ended < added, "announced after turn 1 ended");
    let requests = script.requests.lock().unwrap();
    assert_eq!(requests.len(), 2);
    let last = last_user_text(&requests[1]).unwrap_or_default();
    assert!(last.ends_with("Also check the weather in Oslo."), "{last:?}");
    assert!(
        matches!(
            requests[1].messages[requests[1].messages.len() - 2],
            Message::Tool { .. }
        ),
        "after the call's result"
    );
    assert_eq!(
        requests[0].messages[..],
        requests[1].messages[..requests[0].messages.len()],
        "the first request is a prefix of the second"
    );
}

/// A run canceled once its turn ends has no next turn: a message sent during that turn joins
/// nothing and is not announced as joining one.
#[tokio::test(start_paused = true)]
async fn a_message_sent_to_a_run_canceled_after_its_turn_joins_no_turn() {
    let outside = Outside {
        messages: vec![(Duration::from_secs(1), "Also check the weather in Oslo.")],
        cancel_after: Some(Duration::from_secs(2)),
        cancel_mode: CancelMode::AfterTurn,
        ..Outside::default()
    };
    let (result, batches, script, _) = play_with(a_nap_then_an_answer(3000), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Canceled, "{result:?}");
    let events: Vec<NumberedEvent> = batches.into_iter().flatten().collect();
    assert_eq!(messages_added(&events), [], "no turn 2 for it to join");
    assert_eq!(script.requests.lock().unwrap().len(), 1);
}

/// A message that comes while the model answers without calling a tool gives the run one more
/// turn, which holds the answer and then the message.
#[tokio::test(start_paused = true)]
async fn a_message_sent_while_the_model_answers_takes_one_more_turn() {
    let outside = Outside {
        messages: vec![(Duration::from_millis(150), "Shorter, please.")],
        pace: Some(Duration::from_millis(100)),
        ..Outside::default()
    };
    let turns = vec![vec![text("A long "), text("answer.")], vec![text("Short.")]];
    let (result, events, script) = {
        let (result, batches, script, _) = play_with(turns, limits(), outside).await;
        (result, batches.into_iter().flatten().collect::<Vec<_>>(), script)
    };
    assert_eq!(result.status, RunStatus::Completed);
    assert_eq!(result.text, "A long answer.Short.");
    assert_eq!(result.turns, 2);
    assert_eq!(messages_added(&events), [(2, "Shorter, please.")]);
    let requests = script.requests.lock().unwrap();
    let answer = &requests[1].messages[requests[1].messages.len() - 2];
    assert!(
        matches!(answer, Message::Assistant { content, tool_calls, .. } if content == "A long answer." && tool_calls.is_empty()),
        "{answer:?}"
    );
    assert!(last_user_text(&requests[1]).is_some_and(|t| t.ends_with("Shorter, please.")));
}

/// A run that answered with nothing waiting takes no more messages; one in its last turn takes
/// none either (no boundary is left), and the message that came before that turn joined it.
#[tokio::test(start_paused = true)]
async fn the_inbox_closes_when_the_run_answers_and_in_its_last_turn() {
    let answered = Outside::default();
    let inbox = answered.inbox.clone();
    let (result, ..) = play_with(vec![vec![text("Done.")]], limits(), answered).await;
    assert_eq!(result.status, RunStatus::Completed);
    assert_eq!(inbox.send(user("late")), Err(Refused::Closed(Closed::Answered)));

    let two_turns = Limits {
        max_turns: 2,
        ..limits()
    };
    let last = Outside {
        messages: vec![(Duration::from_secs(1), "in time")],
        ..Outside::default()
    };
    let inbox = last.inbox.clone();
    let (result, batches, ..) = play_with(a_nap_then_an_answer(3000), two_turns, last).await;
    assert_eq!(result.status, RunStatus::Completed);
    let events: Vec<NumberedEvent> = batches.into_iter().flatten().collect();
    assert_eq!(messages_added(&events), [(2, "in time")]);
    assert_eq!(inbox.send(user("too late")), Err(Refused::Closed(Closed::LastTurn)));
}

/// A run on a thread: the model sees the thread's messages after the system messages and before
/// the request's; as the run ends, its request messages and turns join the thread and it lets
/// the thread go.
#[tokio::test(start_paused = true)]
async fn a_run_on_a_thread_sees_its_history_and_adds_its_messages_as_it_ends() {
    use crate::domain::ports::ThreadStore;
    use crate::domain::thread::{RunThread, Thread, ThreadLimits};
    let store = Arc::new(crate::store::memory::MemoryThreads::new(8, Duration::from_secs(3600)));
    let bounds = ThreadLimits {
        max_runs: 8,
        max_bytes: 1 << 20,
        max_queue: 2,
    };
    let keeper = Arc::new(crate::threads::Keeper::new(
        store.clone(),
        bounds,
        Duration::from_secs(1),
    ));
    let mut held = Thread::new("t", "", shared::sync::unix_ms());
    held.live = Some("r".into());
    assert!(store.write(held, 0).await.unwrap());
    let answer = Message::Assistant {
        content: "earlier answer".into(),
        tool_calls: Vec::new(),
        reasoning: None,
    };
    let earlier = vec![user_message("earlier question"), answer];
    let outside = Outside {
        thread: Some(RunThread {
            thread_id: "t".into(),
            history: earlier.clone(),
            ..RunThread::default()
        }),
        threads: Some(keeper),
        ..Outside::default()
    };
    let (result, _, script, _) = play_with(a_nap_then_an_answer(10), limits(), outside).await;
    assert_eq!((result.status, result.thread_id.as_str()), (RunStatus::Completed, "t"));
    let first = script.requests.lock().unwrap()[0].messages.clone();
    assert_eq!(first[1..3], earlier[..], "after the BIOS, before the request's");
    assert_eq!(first[3], user_message("go"));
    let (thread, _) = store.read("t").await.unwrap().unwrap();
    assert_eq!(thread.live, None, "the run let the thread go");
    let kept: Vec<&Message> = thread.messages().collect();
    assert_eq!(kept[0], &user_message("go"), "its request's messages, then its turns");
    assert!(matches!(kept.last(), Some(Message::Assistant { content, .. }) if content == "Rested."));
    assert_eq!(thread.runs[0].run_id, "r");
}

fn user_message(text: &str) -> Message {
    Message::User {
        content: text.into(),
        name: None,
    }
}

/// A message that waits when the run's replica stops is in the checkpoints of the turn's calls:
/// the replica that resumes the run has it join at the turn's end.
#[tokio::test(start_paused = true)]
async fn a_waiting_message_is_kept_in_the_checkpoint_and_joins_on_resume() {
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        messages: vec![(Duration::from_millis(5), "kept")],
        ..Outside::default()
    };
    let (ended, ..) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(ended.status, RunStatus::Completed, "{ended:?}");
    let one_done = first(journal.checkpoints(), "after one call, with the message", |c| {
        c.calls.as_ref().is_some_and(|calls| calls.finished.len() == 1) && !c.steering.waiting.is_empty()
    });
    let seq = one_done.seq;
    let (result, events, script, _) = resume_at(one_done, seq).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(messages_added(&events), [(2, "kept")]);
    let requests = script.requests.lock().unwrap();
    assert!(last_user_text(&requests[0]).is_some_and(|t| t.ends_with("kept")));
}
