//! Calls their servers run as tasks (`tasks.rs`): polled, expired, canceled.

use super::*;

/// The question the `ask` tool asks.
pub(super) fn confirm_question() -> crate::domain::input::Questions {
    crate::domain::input::Questions {
        request_state: "order=7".into(),
        requests: vec![crate::domain::input::InputRequest {
            key: "confirm".into(),
            mode: crate::domain::input::InputMode::Form,
            message: "Refund 5?".into(),
            schema: serde_json::json!({"type": "object", "properties": {"confirm": {"type": "boolean"}}}),
            url: String::new(),
        }],
    }
}

/// A turn whose one call becomes a task `args` describe, then one the model would answer with.
fn a_task_then_an_answer(args: &str) -> Vec<Vec<Result<LlmEvent, LlmError>>> {
    vec![vec![text("Crunching."), call(0, "nap", args)], vec![text("Done.")]]
}

fn progress(events: &[NumberedEvent]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match &e.event {
            Event::ToolCallProgress { message, .. } => Some(message.clone()),
            _ => None,
        })
        .collect()
}

/// A call that became a task is polled until the task ends: each new word of its server is
/// streamed, never fed to the model, and the task's result is the call's.
#[tokio::test(start_paused = true)]
async fn a_task_is_polled_until_it_ends_and_its_result_is_the_calls() {
    let (result, events, script, tools) = play(a_task_then_an_answer(r#"{"task_polls": 3}"#), limits()).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(
        progress(&events),
        [
            "task task-id0 is working: poll 0",
            "task task-id0 is working: poll 1",
            "task task-id0 is working: poll 2"
        ]
    );
    assert!(result.tool_calls[0].ok, "{result:?}");
    assert_eq!(tools.polls.lock().unwrap()["id0"], 3);
    let second = serde_json::to_string(&script.requests.lock().unwrap()[1].messages).unwrap();
    assert!(second.contains(r#"{\"polls\":3}"#), "{second}");
    assert!(!second.contains("poll 2"), "progress never reaches the model: {second}");
}

/// A task still working past its ttl fails its call, fed back like any failure; the run goes on.
#[tokio::test(start_paused = true)]
async fn a_task_past_its_ttl_fails_its_call() {
    let (result, _, _, tools) = play(a_task_then_an_answer(r#"{"task_polls": 1000, "ttl_ms": 1}"#), limits()).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    let error = result.tool_calls[0].error.clone().unwrap();
    assert_eq!(error.code, "FAILED");
    assert!(error.message.contains("ttlMs"), "{error:?}");
    assert_eq!(result.failed_turns, 1);
    assert!(tools.canceled_tasks.lock().unwrap().is_empty());
}

/// A run canceled while it follows a task asks the server to cancel it: at once (the run ends
/// there), or after the turn (the poll cancels it, and the turn ends with the task's outcome).
#[tokio::test(start_paused = true)]
async fn a_run_canceled_while_it_follows_a_task_cancels_the_task() {
    for mode in [CancelMode::Immediate, CancelMode::AfterTurn] {
        let outside = Outside {
            cancel_after: Some(Duration::from_millis(300)),
            cancel_mode: mode,
            ..Outside::default()
        };
        let (result, _, _, tools) =
            play_with(a_task_then_an_answer(r#"{"task_polls": 100000}"#), limits(), outside).await;
        assert_eq!(result.status, RunStatus::Canceled, "{mode:?}: {result:?}");
        assert_eq!(*tools.canceled_tasks.lock().unwrap(), ["id0"], "{mode:?}");
        if mode == CancelMode::AfterTurn {
            assert_eq!(result.tool_calls[0].error.as_ref().unwrap().code, "CANCELED");
        }
    }
}
