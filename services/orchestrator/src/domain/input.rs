//! Questions a tool call asks a person before it can finish (an MCP server's `input_required`,
//! through the tool-runner), and the answers: what the run waits for, the rules an answer must
//! pass, and what the call's next attempt carries to the tool.
//!
//! A call that asks waits like a call that needs approval (`approval.rs`): its questions are a
//! [`PendingApproval`](super::approval::PendingApproval)'s `questions`, its answers the
//! decision's. Every question is answered once, in one request: accepted with content its
//! schema takes (a form) or with none (a URL, which the person visited), declined, or canceled.
//! Questions nobody answered before they expired are each answered `cancel`.

use std::collections::BTreeMap;

use serde_json::Value;
pub use shared::tools::InputMode;

/// The questions of a call, and the tool's state to send back with their answers.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Questions {
    /// Opaque, sent back unchanged (the tool keeps nothing between the attempts).
    pub request_state: String,
    /// The questions, by key.
    pub requests: Vec<InputRequest>,
}

/// One question.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct InputRequest {
    /// Its key.
    pub key: String,
    /// How it is answered.
    pub mode: InputMode,
    /// What the person is asked.
    pub message: String,
    /// A form's JSON Schema (`Null` for a URL).
    pub schema: Value,
    /// A URL question's page (empty for a form); never shown to the model.
    pub url: String,
}

impl InputRequest {
    /// Checks a URL question's page before a person is shown it: `https://`, or `http://` to
    /// this machine (a local tool's page); never `file:`, `javascript:` or a custom scheme, which
    /// would open something other than a web page on the person's machine.
    pub fn check_url(&self) -> Result<(), String> {
        if self.mode != InputMode::Url {
            return Ok(());
        }
        let refused = |why: &str| {
            Err(format!(
                "the tool asked a person to open {:?}, {why}: a question's page must be https:// (or http:// on loopback)",
                shared::text::excerpt(&self.url)
            ))
        };
        let Ok(url) = reqwest::Url::parse(&self.url) else {
            return refused("which is no URL");
        };
        let Some(host) = url.host_str() else {
            return refused("which names no host");
        };
        let address = host.trim_start_matches('[').trim_end_matches(']');
        let loopback = host.eq_ignore_ascii_case("localhost")
            || address.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
        match url.scheme() {
            "https" => Ok(()),
            "http" if loopback => Ok(()),
            "http" => refused("a plaintext page off this machine"),
            _ => refused("whose scheme is not a web page's"),
        }
    }
}

/// What a person did with a question.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr, serde::Serialize, serde::Deserialize)]
#[strum(serialize_all = "snake_case")]
pub enum InputAction {
    /// Gave the content asked for (or visited the page).
    Accept,
    /// Refused to.
    Decline,
    /// Dismissed it without choosing (and what a question nobody answered in time gets).
    Cancel,
}

/// The answer to one question (its `Debug` form leaves out what the person typed).
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct InputAnswer {
    /// The question's key.
    pub key: String,
    /// What the person did.
    pub action: InputAction,
    /// An accepted form's content (a JSON object).
    pub content: Option<Value>,
}

impl std::fmt::Debug for InputAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InputAnswer")
            .field("key", &self.key)
            .field("action", &self.action)
            .field("content", &self.content.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// The answers a call's next attempt carries to its tool (its `Debug` form leaves them out).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Answers {
    /// The questions' state, as it came.
    pub request_state: String,
    /// Each answer as the tool reads it (an MCP elicitation result), by key.
    pub responses: BTreeMap<String, Value>,
}

impl std::fmt::Debug for Answers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Answers")
            .field("keys", &self.responses.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl InputAnswer {
    /// The answer as an MCP elicitation result: `{"action", "content"?}`.
    pub fn response(&self) -> Value {
        let action: &str = self.action.into();
        let mut response = serde_json::json!({ "action": action });
        if let Some(content) = &self.content {
            response["content"] = content.clone();
        }
        response
    }
}

impl Questions {
    /// The round these questions are (16 hex digits of a digest of the tool's state and the
    /// questions): a call that asks again, after its run moved to another replica, asks a new
    /// round, and answers name the round they answer, so an answer to an earlier round is
    /// never taken for the one asked now.
    pub fn round(&self) -> String {
        use sha2::{Digest as _, Sha256};
        let mut digest = Sha256::new();
        digest.update(self.request_state.as_bytes());
        for request in &self.requests {
            digest.update([0]);
            digest.update(request.key.as_bytes());
            digest.update([0]);
            digest.update(request.message.as_bytes());
        }
        digest.finalize()[..8].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Every question answered `cancel` (nobody answered before they expired).
    pub fn canceled(&self) -> Vec<InputAnswer> {
        self.requests
            .iter()
            .map(|r| InputAnswer {
                key: r.key.clone(),
                action: InputAction::Cancel,
                content: None,
            })
            .collect()
    }

    /// What the call's next attempt carries, given `answers`.
    pub fn answered(&self, answers: &[InputAnswer]) -> Answers {
        Answers {
            request_state: self.request_state.clone(),
            responses: answers.iter().map(|a| (a.key.clone(), a.response())).collect(),
        }
    }

    /// Checks `answers` against the questions: each question answered exactly once, no other
    /// key, an accepted form's content a JSON object its schema takes, an accepted URL without
    /// content. The error names the question (and the field the schema refused).
    pub fn check(&self, answers: &[InputAnswer]) -> Result<(), String> {
        for answer in answers {
            let Some(question) = self.requests.iter().find(|r| r.key == answer.key) else {
                let keys: Vec<&str> = self.requests.iter().map(|r| r.key.as_str()).collect();
                return Err(format!("no question has the key {:?} (the keys: {keys:?})", answer.key));
            };
            if answers.iter().filter(|a| a.key == answer.key).count() > 1 {
                return Err(format!("question {:?} is answered twice", answer.key));
            }
            check_content(question, answer)?;
        }
        if let Some(missing) = self.requests.iter().find(|r| !answers.iter().any(|a| a.key == r.key)) {
            return Err(format!(
                "question {:?} is not answered (every question of the call is answered in one request)",
                missing.key
            ));
        }
        Ok(())
    }
}

/// An answer's content against its question.
fn check_content(question: &InputRequest, answer: &InputAnswer) -> Result<(), String> {
    let key = &question.key;
    match (answer.action, question.mode, &answer.content) {
        (InputAction::Accept, InputMode::Form, Some(content)) => {
            shared::tools::check_arguments(&question.schema, &content.to_string())
                .map_err(|e| format!("the content for question {key:?} is refused: {e}"))
        }
        (InputAction::Accept, InputMode::Form, None) => {
            Err(format!("question {key:?} is a form: accepting it takes content_json"))
        }
        (InputAction::Accept, InputMode::Url, Some(_)) => Err(format!(
            "question {key:?} asks the person to visit a page: accepting it takes no content"
        )),
        (InputAction::Decline | InputAction::Cancel, _, Some(_)) => {
            Err(format!("only an accepted answer carries content (question {key:?})"))
        }
        _ => Ok(()),
    }
}

/// The cap of `--max-tool-questions`, and so the most answers one `AnswerToolInput` carries.
pub const MAX_QUESTIONS: usize = 256;

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn questions() -> Questions {
        Questions {
            request_state: "s1".into(),
            requests: vec![
                InputRequest {
                    key: "confirm".into(),
                    mode: InputMode::Form,
                    message: "Refund 5?".into(),
                    schema: json!({"type": "object", "properties": {"confirm": {"type": "boolean"}}, "required": ["confirm"]}),
                    url: String::new(),
                },
                InputRequest {
                    key: "pay".into(),
                    mode: InputMode::Url,
                    message: "Pay".into(),
                    schema: Value::Null,
                    url: "https://pay.example/1".into(),
                },
            ],
        }
    }

    fn answer(key: &str, action: InputAction, content: Option<Value>) -> InputAnswer {
        InputAnswer {
            key: key.into(),
            action,
            content,
        }
    }

    #[test]
    fn every_question_answered_once_with_content_its_schema_takes() {
        let good = [
            answer("confirm", InputAction::Accept, Some(json!({"confirm": true}))),
            answer("pay", InputAction::Accept, None),
        ];
        assert_eq!(questions().check(&good), Ok(()));
        let sent = questions().answered(&good);
        assert_eq!(sent.request_state, "s1");
        assert_eq!(
            sent.responses["confirm"],
            json!({"action": "accept", "content": {"confirm": true}})
        );
        assert_eq!(sent.responses["pay"], json!({"action": "accept"}));
        let canceled = questions().answered(&questions().canceled());
        assert_eq!(canceled.responses["pay"], json!({"action": "cancel"}));
    }

    #[test]
    fn each_broken_rule_is_named() {
        let declined = answer("pay", InputAction::Decline, None);
        for (answers, says) in [
            (vec![declined.clone()], "question \"confirm\" is not answered"),
            (
                vec![
                    answer("confirm", InputAction::Accept, Some(json!({"confirm": "yes"}))),
                    declined.clone(),
                ],
                "the content for question \"confirm\" is refused",
            ),
            (
                vec![answer("confirm", InputAction::Accept, None), declined.clone()],
                "accepting it takes content_json",
            ),
            (
                vec![
                    answer("confirm", InputAction::Cancel, None),
                    answer("pay", InputAction::Accept, Some(json!({}))),
                ],
                "accepting it takes no content",
            ),
            (
                vec![
                    answer("confirm", InputAction::Cancel, None),
                    declined.clone(),
                    declined.clone(),
                ],
                "answered twice",
            ),
            (
                vec![answer("other", InputAction::Cancel, None)],
                "no question has the key \"other\"",
            ),
        ] {
            let refused = questions().check(&answers).unwrap_err();
            assert!(refused.contains(says), "{refused} should say {says}");
        }
    }
}
