use super::*;

fn user(parts: Vec<a2a::Part>) -> a2a::Message {
    a2a::Message {
        message_id: "m-1".into(),
        role: a2a::Role::User.into(),
        parts,
        ..Default::default()
    }
}

fn part(content: a2a::part::Content) -> a2a::Part {
    a2a::Part {
        content: Some(content),
        ..Default::default()
    }
}

#[test]
fn text_and_data_parts_make_the_user_message_and_a_file_is_refused() {
    let data = prost_types::Value {
        kind: Some(prost_types::value::Kind::NumberValue(7.0)),
    };
    let message = user(vec![
        part(a2a::part::Content::Text("refund order".into())),
        part(a2a::part::Content::Data(data)),
    ]);
    assert_eq!(user_text(&message), Ok("refund order\n7.0".to_owned()));
    let request = run_request(&message, Some("refunds")).unwrap();
    assert_eq!(request.agent, "refunds");
    assert_eq!(request.thread_id.len(), 36, "a new context is a new thread");
    let file = user(vec![part(a2a::part::Content::Url("https://x/y.pdf".into()))]);
    assert_eq!(user_text(&file).map_err(|e| e.code), Err(-32005));
    let agents = a2a::Message {
        role: a2a::Role::Agent.into(),
        ..message
    };
    assert_eq!(user_text(&agents).map_err(|e| e.code), Err(-32602));
}

#[test]
fn a_runs_status_is_its_tasks_state_and_a_person_waited_for_is_input_required() {
    use pb::RunStatus as S;
    for (status, expected) in [
        (S::Running, a2a::TaskState::Working),
        (S::AwaitingTask, a2a::TaskState::Working),
        (S::AwaitingApproval, a2a::TaskState::InputRequired),
        (S::AwaitingInput, a2a::TaskState::InputRequired),
        (S::Completed, a2a::TaskState::Completed),
        (S::Failed, a2a::TaskState::Failed),
        (S::Canceled, a2a::TaskState::Canceled),
    ] {
        assert_eq!(state(status as i32), expected, "{status:?}");
    }
}

#[test]
fn a_runs_events_stream_as_artifact_appends_then_its_end() {
    use pb::orchestrate_event::Event as E;
    let mut streamer = Streamer::new("r-1", "t-1");
    let event = |event| pb::OrchestrateEvent {
        run_id: "r-1".into(),
        seq: 1,
        event: Some(event),
    };
    let text = |t: &str| {
        event(E::TextDelta(pb::TextDelta {
            text: t.into(),
            ..Default::default()
        }))
    };
    let appends = |items: &[a2a::StreamResponse]| -> Vec<(bool, bool)> {
        items
            .iter()
            .filter_map(|i| match &i.payload {
                Some(a2a::stream_response::Payload::ArtifactUpdate(u)) => Some((u.append, u.last_chunk)),
                _ => None,
            })
            .collect()
    };
    let (first, ends) = streamer.items(&text("Hel"));
    assert_eq!((appends(&first), ends), (vec![(false, false)], false));
    let (second, _) = streamer.items(&text("lo"));
    assert_eq!(appends(&second), [(true, false)]);
    let finished = pb::RunResult {
        status: pb::RunStatus::Completed.into(),
        ..Default::default()
    };
    let (last, ends) = streamer.items(&event(E::RunFinished(pb::RunFinished { result: Some(finished) })));
    assert!(ends);
    assert_eq!(appends(&last), [(true, true)]);
    let Some(a2a::stream_response::Payload::StatusUpdate(update)) = &last[1].payload else {
        panic!("the end is a status update: {last:?}");
    };
    assert_eq!(
        update.status.as_ref().map(|s| s.state),
        Some(a2a::TaskState::Completed as i32)
    );
}

fn waiting_run(questions: bool) -> pb::RunResult {
    let input_requests = match questions {
        true => vec![pb::ToolInputRequest {
            key: "reason".into(),
            mode: "form".into(),
            message: "Why?".into(),
            ..Default::default()
        }],
        false => Vec::new(),
    };
    pb::RunResult {
        run_id: "r-1".into(),
        status: pb::RunStatus::AwaitingApproval.into(),
        pending_approvals: vec![pb::PendingApproval {
            call_id: "c-1".into(),
            name: "refund".into(),
            arguments_json: "{}".into(),
            input_requests,
            input_round: "1".into(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn data(json: serde_json::Value) -> a2a::Part {
    let value = crate::wire::json::from_json_lenient::<prost_types::Value>(json, "google.protobuf.Value").unwrap();
    part(a2a::part::Content::Data(value))
}

#[test]
fn a_reply_approves_or_rejects_the_waiting_calls_in_words_or_data() {
    let run = waiting_run(false);
    let decided = |message: a2a::Message| match reply(&run, &message) {
        Ok(Reply::Decide(d)) => d
            .into_iter()
            .map(|d| (d.call_id, d.kind, d.message))
            .collect::<Vec<_>>(),
        other => panic!("{other:?}"),
    };
    let approve = pb::DecisionKind::Approve as i32;
    let reject = pb::DecisionKind::Reject as i32;
    assert_eq!(
        decided(user(vec![part(a2a::part::Content::Text("Approve.".into()))])),
        [("c-1".into(), approve, String::new())]
    );
    assert_eq!(
        decided(user(vec![part(a2a::part::Content::Text("reject too large".into()))])),
        [("c-1".into(), reject, "too large".into())]
    );
    let json = serde_json::json!({"decision": "reject", "callId": "c-1", "message": "no"});
    assert_eq!(decided(user(vec![data(json)])), [("c-1".into(), reject, "no".into())]);
    let unclear = reply(&run, &user(vec![part(a2a::part::Content::Text("maybe".into()))]))
        .err()
        .unwrap();
    assert_eq!(unclear.code, -32602);
    assert!(
        unclear.message.contains("refund({})") && unclear.message.contains("\"approve\""),
        "{}",
        unclear.message
    );
}

#[test]
fn a_reply_answers_a_tools_questions_by_key_or_declines_them() {
    let run = waiting_run(true);
    let Ok(Reply::Answer(requests)) = reply(
        &run,
        &user(vec![data(serde_json::json!({"answers": {"reason": "damaged"}}))]),
    ) else {
        panic!("answers");
    };
    assert_eq!((requests[0].call_id.as_str(), requests[0].round.as_str()), ("c-1", "1"));
    assert_eq!(requests[0].answers[0].content_json, "\"damaged\"");
    let missing = reply(&run, &user(vec![data(serde_json::json!({"answers": {}}))]))
        .err()
        .unwrap();
    assert!(
        missing.message.contains("no answer for question \"reason\""),
        "{}",
        missing.message
    );
    let Ok(Reply::Answer(declined)) = reply(&run, &user(vec![part(a2a::part::Content::Text("decline".into()))])) else {
        panic!("declined");
    };
    assert_eq!(declined[0].answers[0].action, pb::InputAction::Decline as i32);
    assert_eq!(asked(&run), ["c-1/1".to_owned()].into());
}
