//! Questions a call asks before it can finish, and their answers: an MCP server's
//! `input_required` (a multi-round-trip `tools/call`) comes back to the orchestrator as
//! [`Output::InputRequired`]; the person's answers come with the call's next attempt, on any
//! runner ([`InputAnswers`]), with the opaque `request_state` the server gave.

use std::collections::BTreeMap;

use serde_json::Value;
pub use shared::tools::InputMode;

/// What a call gave back when it did not fail.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Its result.
    Done(Value),
    /// It asks these questions first.
    InputRequired(InputRequired),
    /// The server runs it as a task: the call goes on with it in its next attempts.
    Task(crate::tools::task::TaskState),
}

/// The questions of a call, and the state to send back with their answers.
#[derive(Debug, Clone, PartialEq)]
pub struct InputRequired {
    /// Opaque, sent back unchanged.
    pub request_state: String,
    /// The questions, by key.
    pub requests: Vec<InputRequest>,
}

/// One question.
#[derive(Debug, Clone, PartialEq)]
pub struct InputRequest {
    /// Its key.
    pub key: String,
    /// How it is answered.
    pub mode: InputMode,
    /// What the person is asked.
    pub message: String,
    /// A form's schema (`Null` for a URL).
    pub schema: Value,
    /// A URL question's page (empty for a form).
    pub url: String,
}

/// The answers to a call's questions, for its next attempt.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InputAnswers {
    /// As the questions came.
    pub request_state: String,
    /// Each answer (an MCP result, e.g. `{"action": "accept", "content": {...}}`) by key.
    pub responses: BTreeMap<String, Value>,
}

impl InputRequest {
    /// The question an MCP input request (`elicitation/create`, as JSON) asks; `Err` for a
    /// request the runner cannot put to a person (sampling, roots: it offers neither).
    pub fn of_mcp(key: &str, request: &Value) -> Result<Self, String> {
        let method = request["method"].as_str().unwrap_or_default();
        if method != "elicitation/create" {
            return Err(format!(
                "the server asked {method:?} (key {key:?}), which the tool-runner does not offer; only elicitation reaches a person"
            ));
        }
        let params = &request["params"];
        let message = params["message"].as_str().unwrap_or_default().to_owned();
        let question = match params["mode"].as_str() {
            Some("url") => Self {
                key: key.to_owned(),
                mode: InputMode::Url,
                message,
                schema: Value::Null,
                url: params["url"].as_str().unwrap_or_default().to_owned(),
            },
            Some("form") | None => Self {
                key: key.to_owned(),
                mode: InputMode::Form,
                message,
                schema: params["requestedSchema"].clone(),
                url: String::new(),
            },
            Some(other) => return Err(format!("the server asked for input in mode {other:?} (key {key:?})")),
        };
        Ok(question)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn elicitations_become_questions_and_other_requests_errors() {
        let form = json!({"method": "elicitation/create", "params": {"mode": "form", "message": "Refund?",
            "requestedSchema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}}});
        let question = InputRequest::of_mcp("confirm", &form).unwrap();
        assert_eq!((question.mode, question.message.as_str()), (InputMode::Form, "Refund?"));
        assert_eq!(question.schema["properties"]["ok"]["type"], "boolean");
        let url = json!({"method": "elicitation/create", "params": {"mode": "url", "message": "Pay", "url": "https://pay.example/1"}});
        let question = InputRequest::of_mcp("pay", &url).unwrap();
        assert_eq!(
            (question.mode, question.url.as_str()),
            (InputMode::Url, "https://pay.example/1")
        );
        let sampling = json!({"method": "sampling/createMessage", "params": {}});
        let refused = InputRequest::of_mcp("s", &sampling).unwrap_err();
        assert!(refused.contains("sampling/createMessage"), "{refused}");
    }
}
