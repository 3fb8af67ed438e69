//! Which events of a run's stream webhooks are told of, as [`Happening`]s: the run's start, each
//! call that waits for a person (an approval, or answers to its questions), and its end.

use serde_json::{Map, Value, json};

use crate::domain::webhook::{Happening, Topic};
use crate::domain::{Event, NumberedEvent, RunResult};

/// The happenings among `batch`, of the run whose state is `run` (read only when there are
/// some).
pub(crate) fn happenings(run: &std::sync::Mutex<RunResult>, batch: &[NumberedEvent]) -> Vec<Happening> {
    let found: Vec<(u64, Topic, Map<String, Value>)> = batch
        .iter()
        .filter_map(|numbered| topic_of(&numbered.event).map(|(topic, detail)| (numbered.seq, topic, detail)))
        .collect();
    if found.is_empty() {
        return Vec::new();
    }
    let run = shared::sync::lock(run);
    found
        .into_iter()
        .map(|(seq, topic, detail)| Happening {
            topic,
            seq,
            run_id: run.run_id.clone(),
            principal: run.principal.clone(),
            thread_id: (!run.thread_id.is_empty()).then(|| run.thread_id.clone()),
            agent: run.agent.as_ref().map(|a| a.name.clone()),
            labels: run.labels.clone(),
            detail,
        })
        .collect()
}

fn object(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

/// The topic of `event` and what its payload says of it, if webhooks are told of it.
fn topic_of(event: &Event) -> Option<(Topic, Map<String, Value>)> {
    let (topic, detail) = match event {
        Event::RunStarted { model, queued_ms, .. } => (
            Topic::Started,
            json!({"status": "RUNNING", "model": model, "queued_ms": queued_ms}),
        ),
        Event::ApprovalRequested {
            call_id,
            name,
            expires_at_unix_ms,
            in_doubt,
            ..
        } => (
            Topic::Awaiting,
            json!({"status": "AWAITING_APPROVAL", "call_id": call_id, "tool": name, "waits_for": "approval",
                   "expires_at_unix_ms": expires_at_unix_ms, "in_doubt": in_doubt}),
        ),
        Event::ToolInputRequested {
            call_id,
            name,
            expires_at_unix_ms,
            ..
        } => (
            Topic::Awaiting,
            json!({"status": "AWAITING_INPUT", "call_id": call_id, "tool": name, "waits_for": "answers",
                   "expires_at_unix_ms": expires_at_unix_ms}),
        ),
        Event::RunFinished(result) => (Topic::Finished, finished(result)),
        _ => return None,
    };
    Some((topic, object(detail)))
}

/// What `run.finished` says of the run: how it ended, and what it cost.
fn finished(result: &RunResult) -> Value {
    let reason: Option<&'static str> = result.failure_reason.map(Into::into);
    json!({
        "status": result.status.name(),
        "failure_reason": reason,
        "failure_detail": (!result.failure_detail.is_empty()).then_some(&result.failure_detail),
        "turns": result.turns,
        "signals": result.signals.iter().map(|s| s.tool_name.as_str()).collect::<Vec<_>>(),
        "usage": {"prompt_tokens": result.usage.prompt_tokens, "completion_tokens": result.usage.completion_tokens},
    })
}
