//! The tool-runners' contract as the runners' client sends and reads it: a call as a `RunTool`
//! request's body, and a runner's answer (content, error, questions, task, in doubt) as the
//! call's output or the error the model sees.

use proto::toolrunner::v1 as pb;

use crate::domain::ToolCallError;
use crate::domain::input::Questions;
use crate::domain::ports::{ToolInvocation, ToolOutput};
use crate::domain::task::ToolTask;

/// A call as the body of its `RunTool` request (the headers are the transport's).
pub(crate) fn run_tool_body(call: &ToolInvocation) -> pb::RunToolRequest {
    pb::RunToolRequest {
        run_id: call.run_id.clone(),
        call_id: call.call_id.clone(),
        tool_name: call.name.clone(),
        arguments_json: call.arguments_json.clone(),
        metadata: call.metadata.clone().into_iter().collect(),
        principal: call.principal.clone(),
        epoch: call.epoch,
        input: call.answers.as_ref().map(|answers| pb::ToolInputAnswers {
            request_state: answers.request_state.clone(),
            responses_json: answers
                .responses
                .iter()
                .map(|(key, response)| (key.clone(), response.to_string()))
                .collect(),
        }),
        task: call.task.as_ref().map(|task| pb::ToolTaskRef {
            task_id: task.id.clone(),
            cancel: call.cancel_task,
        }),
        rerun_in_doubt: call.rerun_in_doubt,
    }
}

/// A runner's answer: the tool's JSON content, its questions, the task it became (held by
/// `runner` when pinned there), or its error with the runner's code.
pub(crate) fn outcome(
    response: pb::RunToolResponse,
    max_questions: usize,
    runner: &str,
) -> Result<ToolOutput, ToolCallError> {
    match response.outcome {
        Some(pb::run_tool_response::Outcome::ContentJson(json)) => Ok(ToolOutput::Result(json)),
        Some(pb::run_tool_response::Outcome::Error(e)) => {
            let code = pb::ToolErrorCode::try_from(e.code).unwrap_or(pb::ToolErrorCode::Unspecified);
            let name = code.as_str_name().trim_start_matches("TOOL_ERROR_CODE_");
            Err(ToolCallError::new(
                if name == "UNSPECIFIED" { "FAILED" } else { name },
                e.message,
            ))
        }
        Some(pb::run_tool_response::Outcome::InputRequired(asked)) => {
            questions(asked, max_questions).map(ToolOutput::Asked)
        }
        Some(pb::run_tool_response::Outcome::InDoubt(doubt)) => {
            Err(ToolCallError::new(ToolCallError::IN_DOUBT, doubt.message))
        }
        Some(pb::run_tool_response::Outcome::Task(task)) if task.task_id.is_empty() => Err(ToolCallError::new(
            "FAILED",
            "the tool-runner answered with a task that has no id",
        )),
        Some(pb::run_tool_response::Outcome::Task(task)) => Ok(ToolOutput::Task(ToolTask {
            runner: task.pinned.then(|| runner.to_owned()),
            id: task.task_id,
            status: task.status,
            message: task.message,
            ttl_ms: (task.ttl_ms > 0).then_some(task.ttl_ms),
            poll_interval_ms: (task.poll_interval_ms > 0).then_some(task.poll_interval_ms),
        })),
        None => Err(ToolCallError::new(
            "FAILED",
            "the tool-runner answered with neither a result nor an error",
        )),
    }
}

/// A runner's questions, at most `max` (`--max-tool-questions`), in modes this version knows.
fn questions(asked: pb::ToolInputRequired, max: usize) -> Result<Questions, ToolCallError> {
    if asked.requests.is_empty() || asked.requests.len() > max {
        return Err(ToolCallError::new(
            "FAILED",
            format!(
                "the tool asked {} questions; a call may ask 1 to {max} (--max-tool-questions)",
                asked.requests.len()
            ),
        ));
    }
    let mut requests = Vec::with_capacity(asked.requests.len());
    for r in asked.requests {
        let mode = r.mode.clone();
        let request = super::input_request(r.key, &r.mode, r.message, &r.schema_json, r.url).ok_or_else(|| {
            ToolCallError::new(
                "FAILED",
                format!("the tool asked a question in mode {mode:?}, which this orchestrator does not know"),
            )
        })?;
        request.check_url().map_err(|why| ToolCallError::new("FAILED", why))?;
        requests.push(request);
    }
    Ok(Questions {
        request_state: asked.request_state,
        requests,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A runner's questions are taken up to `--max-tool-questions`; one more fails the call, and
    /// so does a mode this version does not know.
    #[test]
    fn questions_are_held_to_max_tool_questions() {
        let question = |key: &str, mode: &str| pb::ToolInputRequest {
            key: key.into(),
            mode: mode.into(),
            message: "ok?".into(),
            schema_json: r#"{"type": "object"}"#.into(),
            url: if mode == "url" {
                "https://pay.example/1".into()
            } else {
                String::new()
            },
        };
        let asked = pb::ToolInputRequired {
            request_state: "s".into(),
            requests: vec![question("a", "form"), question("b", "url")],
        };
        let taken = questions(asked.clone(), 2).unwrap();
        assert_eq!((taken.requests.len(), taken.request_state.as_str()), (2, "s"));
        let refused = questions(asked, 1).unwrap_err();
        assert!(
            refused.message.contains("asked 2 questions; a call may ask 1 to 1"),
            "{refused:?}"
        );
        let odd = pb::ToolInputRequired {
            request_state: String::new(),
            requests: vec![question("a", "voice")],
        };
        assert!(questions(odd, 2).unwrap_err().message.contains("\"voice\""));
    }

    /// A URL question's page is https://, or http:// on loopback; any other is refused before a
    /// person sees it, failing the call.
    #[test]
    fn a_url_questions_page_is_a_web_page() {
        let asking = |url: &str| pb::ToolInputRequired {
            request_state: String::new(),
            requests: vec![pb::ToolInputRequest {
                key: "pay".into(),
                mode: "url".into(),
                message: "Pay here".into(),
                schema_json: String::new(),
                url: url.into(),
            }],
        };
        for good in [
            "https://pay.example/1",
            "http://127.0.0.1:8000/pay",
            "http://localhost/pay",
            "http://[::1]/x",
        ] {
            assert!(questions(asking(good), 2).is_ok(), "{good}");
        }
        for bad in [
            "file:///etc/passwd",
            "javascript:alert(1)",
            "ms-settings:display",
            "http://pay.example/1",
            "not a url",
            "",
        ] {
            let refused = questions(asking(bad), 2).unwrap_err();
            assert!(refused.message.contains("must be https://"), "{bad}: {refused:?}");
        }
    }
}
