//! Tool calls written in the text, for models or servers without structured tool calls
//! (docs/architecture.md, "Fallback directives and the hold-back"), and the hold-back that keeps streamed text equal to final text.
//!
//! Recognised directives:
//! * `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Hermes / Qwen style), anywhere;
//! * a fenced block (```` ```json … ``` ````) holding `{"name"|"tool": …, "arguments"|"parameters": {…}}`;
//! * the same JSON object as the whole message.
//!
//! [`TextGate`] releases text as it streams, except from the first character that could open a
//! directive: that text is held until it is resolved — released when it turns out not to be a
//! directive, or decided at the end of the turn by [`TextGate::finish`].

use serde_json::{Map, Value};

const OPEN_TAG: &str = "<tool_call>";
const CLOSE_TAG: &str = "</tool_call>";
const FENCE: &str = "```";
/// What opens a JSON object.
const OBJECT_OPEN: char = '{';

/// A tool call found in the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextCall {
    /// Tool name.
    pub name: String,
    /// Arguments object, serialized.
    pub arguments: String,
}

/// How the held-back text of a turn resolves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// No directive: release `text`.
    Text(String),
    /// Directives found: run `calls`; release `stripped` (the text without them). `raw` is the
    /// held text as written, released instead if a call turns out unusable (unknown tool).
    Calls {
        /// The calls, in order.
        calls: Vec<TextCall>,
        /// Held text without the directives.
        stripped: String,
        /// Held text as written.
        raw: String,
    },
    /// A directive is malformed: release `raw` as it is and fail the run.
    Malformed {
        /// What is wrong.
        detail: String,
        /// Held text as written.
        raw: String,
    },
}

/// Splits a turn's streamed text into what can be shown now and what must wait.
#[derive(Debug, Default)]
pub struct TextGate {
    /// All text of the turn.
    buf: String,
    /// How much of `buf` has been released.
    released: usize,
}

impl TextGate {
    /// Adds streamed text; returns the part that is safe to show now (may be empty).
    pub fn push(&mut self, delta: &str) -> String {
        self.buf.push_str(delta);
        let hold_from = self.hold_from();
        let out = self.buf[self.released..hold_from].to_owned();
        self.released = hold_from;
        out
    }

    /// All text of the turn so far, released or not.
    pub fn text(&self) -> &str {
        &self.buf
    }

    /// The text held back so far.
    pub fn held(&self) -> &str {
        &self.buf[self.released..]
    }

    /// Where held-back text starts (`buf.len()` when nothing must be held).
    fn hold_from(&self) -> usize {
        if self.may_be_standalone_directive() {
            return 0;
        }
        self.first_possible_directive().unwrap_or(self.buf.len())
    }

    /// A message whose first non-blank character opens an object may be a standalone JSON
    /// directive: it is held whole until the turn ends.
    fn may_be_standalone_directive(&self) -> bool {
        if self.released > 0 {
            return false;
        }
        let trimmed = self.buf.trim_start();
        trimmed.is_empty() || trimmed.starts_with(OBJECT_OPEN)
    }

    /// The first place after the released text that opens, or may still open, a `<tool_call>`
    /// tag or a fenced block holding a directive; fenced blocks that are closed and hold no
    /// directive, and `<` or `` ` `` that cannot open one, stream on.
    fn first_possible_directive(&self) -> Option<usize> {
        let mut at = self.released;
        while let Some(offset) = self.buf[at..].find(['<', '`']) {
            let p = at + offset;
            let rest = &self.buf[p..];
            if rest.starts_with('<') {
                if rest.starts_with(OPEN_TAG) || OPEN_TAG.starts_with(rest) {
                    return Some(p);
                }
                at = p + 1;
            } else if rest.len() < FENCE.len() && FENCE.starts_with(rest) {
                return Some(p);
            } else if let Some(body) = rest.strip_prefix(FENCE) {
                match body.find(FENCE) {
                    None => return Some(p),
                    Some(close) if fenced_directive(&body[..close]).is_some() => return Some(p),
                    Some(close) => at = p + FENCE.len() + close + FENCE.len(),
                }
            } else {
                at = p + 1;
            }
        }
        None
    }

    /// Resolves the held text at the end of the turn. With structured calls the held text is not
    /// parsed for directives: `<tool_call>` markup (finished or not) is dropped as server noise
    /// and the rest released.
    pub fn finish(self, has_structured_calls: bool) -> Resolution {
        let held = &self.buf[self.released..];
        if has_structured_calls {
            return Resolution::Text(strip_tool_call_markup(held));
        }
        if held.is_empty() {
            return Resolution::Text(String::new());
        }
        if self.released == 0
            && let Some(call) = standalone_directive(held)
        {
            return Resolution::Calls {
                calls: vec![call],
                stripped: String::new(),
                raw: held.to_owned(),
            };
        }
        match find_directives(held) {
            Ok((calls, _)) if calls.is_empty() => Resolution::Text(held.to_owned()),
            Ok((calls, stripped)) => Resolution::Calls {
                calls,
                stripped,
                raw: held.to_owned(),
            },
            Err(detail) => Resolution::Malformed {
                detail,
                raw: held.to_owned(),
            },
        }
    }
}

/// Finds `<tool_call>` blocks and fenced directives; returns the calls and the text without them.
fn find_directives(text: &str) -> Result<(Vec<TextCall>, String), String> {
    let mut calls = Vec::new();
    let mut stripped = String::new();
    let mut rest = text;
    loop {
        let tag = rest.find(OPEN_TAG);
        let fence = rest.find(FENCE);
        match (tag, fence) {
            (Some(t), f) if f.is_none_or(|f| t < f) => {
                stripped.push_str(&rest[..t]);
                let body = &rest[t + OPEN_TAG.len()..];
                let close = body
                    .find(CLOSE_TAG)
                    .ok_or("a <tool_call> block is never closed with </tool_call>")?;
                calls.push(parse_directive(&body[..close], true)?);
                rest = &body[close + CLOSE_TAG.len()..];
            }
            (_, Some(f)) => {
                let body = &rest[f + FENCE.len()..];
                match body.find(FENCE) {
                    Some(close) => {
                        if let Some(call) = fenced_directive(&body[..close]) {
                            stripped.push_str(&rest[..f]);
                            calls.push(call?);
                        } else {
                            stripped.push_str(&rest[..f + FENCE.len() + close + FENCE.len()]);
                        }
                        rest = &body[close + FENCE.len()..];
                    }
                    None => {
                        stripped.push_str(rest);
                        return Ok((calls, stripped));
                    }
                }
            }
            _ => {
                stripped.push_str(rest);
                return Ok((calls, stripped));
            }
        }
    }
}

/// The directive in a fenced block's body (after an optional `json` tag), if it is one.
/// `Some(Err)` when it looks like a directive (has a name key) but is malformed.
fn fenced_directive(body: &str) -> Option<Result<TextCall, String>> {
    let body = body.trim_start();
    let body = body.strip_prefix("json").unwrap_or(body).trim();
    let value: Value = serde_json::from_str(body).ok()?;
    let object = value.as_object()?;
    looks_like_directive(object).then(|| parse_object(object, false))
}

/// The whole message as one directive object, if it is exactly that.
fn standalone_directive(text: &str) -> Option<TextCall> {
    let value: Value = serde_json::from_str(text.trim()).ok()?;
    let object = value.as_object()?;
    if object.len() != 2 || !looks_like_directive(object) {
        return None;
    }
    parse_object(object, false).ok()
}

fn looks_like_directive(object: &Map<String, Value>) -> bool {
    let has_name = object
        .get("name")
        .or_else(|| object.get("tool"))
        .is_some_and(Value::is_string);
    let has_args = object.contains_key("arguments") || object.contains_key("parameters");
    has_name && has_args
}

fn parse_directive(body: &str, lenient: bool) -> Result<TextCall, String> {
    let value: Value = serde_json::from_str(body.trim()).map_err(|e| {
        format!(
            "the <tool_call> block is not valid JSON ({e}): {}",
            crate::llm::sse::excerpt(body.trim())
        )
    })?;
    let object = value.as_object().ok_or("a <tool_call> block must hold a JSON object")?;
    parse_object(object, lenient)
}

fn parse_object(object: &Map<String, Value>, lenient: bool) -> Result<TextCall, String> {
    let name = object
        .get("name")
        .or_else(|| object.get("tool"))
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or("a tool call directive needs a \"name\" (or \"tool\") string")?;
    let arguments = match object.get("arguments").or_else(|| object.get("parameters")) {
        Some(Value::Object(args)) => Value::Object(args.clone()).to_string(),
        // Some models write the arguments as a JSON string.
        Some(Value::String(s)) if serde_json::from_str::<Value>(s).is_ok_and(|v| v.is_object()) => s.clone(),
        None if lenient => "{}".to_owned(),
        _ => return Err(format!("the arguments of the {name:?} directive must be a JSON object")),
    };
    Ok(TextCall {
        name: name.to_owned(),
        arguments,
    })
}

/// Removes `<tool_call>` blocks (and an unfinished one at the end) from `text`.
fn strip_tool_call_markup(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN_TAG).or_else(|| partial_tag_at_end(rest)) {
        out.push_str(&rest[..start]);
        match rest[start..].find(CLOSE_TAG) {
            Some(close) => rest = &rest[start + close + CLOSE_TAG.len()..],
            None => return out,
        }
    }
    out.push_str(rest);
    out
}

/// Where a truncated `<tool_call` starts at the very end of `text`.
fn partial_tag_at_end(text: &str) -> Option<usize> {
    let start = text.rfind('<')?;
    OPEN_TAG.starts_with(&text[start..]).then_some(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `parts`, returns (streamed text, resolution).
    fn run(parts: &[&str], structured: bool) -> (String, Resolution) {
        let mut gate = TextGate::default();
        let streamed: String = parts.iter().map(|p| gate.push(p)).collect();
        (streamed, gate.finish(structured))
    }

    fn call(name: &str, arguments: &str) -> TextCall {
        TextCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    #[test]
    fn plain_text_streams_through_even_with_angle_brackets_and_code() {
        let (streamed, end) = run(
            &["a < b and <b>bold</b> ", "`x` and ```rust\nfn f() {}\n```", " done"],
            false,
        );
        assert_eq!(streamed, "a < b and <b>bold</b> `x` and ```rust\nfn f() {}\n``` done");
        assert_eq!(end, Resolution::Text(String::new()));
    }

    #[test]
    fn a_split_tool_call_tag_is_held_and_becomes_a_call() {
        let (streamed, end) = run(
            &[
                "Let me check.\n<tool",
                "_call>{\"name\": \"get\", \"arguments\": {\"q\": 1}}</tool_call>",
            ],
            false,
        );
        assert_eq!(streamed, "Let me check.\n");
        assert_eq!(
            end,
            Resolution::Calls {
                calls: vec![call("get", r#"{"q":1}"#)],
                stripped: String::new(),
                raw: "<tool_call>{\"name\": \"get\", \"arguments\": {\"q\": 1}}</tool_call>".into()
            }
        );
    }

    #[test]
    fn several_blocks_are_several_calls_and_text_between_is_kept() {
        let text = "<tool_call>{\"tool\":\"a\",\"parameters\":{}}</tool_call> and <tool_call>{\"name\":\"b\",\"arguments\":\"{\\\"x\\\":2}\"}</tool_call>";
        let (streamed, end) = run(&[text], false);
        assert_eq!(streamed, "");
        let Resolution::Calls { calls, stripped, .. } = end else {
            panic!("{end:?}")
        };
        assert_eq!(calls, vec![call("a", "{}"), call("b", r#"{"x":2}"#)]);
        assert_eq!(stripped, " and ");
    }

    #[test]
    fn standalone_json_and_fenced_json_directives() {
        let (streamed, end) = run(&["  {\"tool\": \"finish\", ", "\"arguments\": {\"ok\": true}}"], false);
        assert_eq!(streamed, "");
        assert!(
            matches!(end, Resolution::Calls { ref calls, .. } if calls == &vec![call("finish", r#"{"ok":true}"#)]),
            "{end:?}"
        );

        let (streamed, end) = run(
            &["Here:\n```json\n{\"name\": \"get\", \"arguments\": {}}\n```\n"],
            false,
        );
        assert_eq!(streamed, "Here:\n");
        assert!(
            matches!(end, Resolution::Calls { ref stripped, .. } if stripped == "\n"),
            "{end:?}"
        );
    }

    #[test]
    fn json_that_is_not_a_directive_is_just_text() {
        let (streamed, end) = run(&["{\"name\": \"Bob\", \"age\": 3}"], false);
        assert_eq!(streamed, "");
        assert_eq!(end, Resolution::Text("{\"name\": \"Bob\", \"age\": 3}".into()));
        let (streamed, end) = run(&["x ```json\n{\"a\": 1}\n``` y"], false);
        assert_eq!(streamed, "x ```json\n{\"a\": 1}\n``` y");
        assert_eq!(end, Resolution::Text(String::new()));
    }

    #[test]
    fn malformed_directives_keep_the_text() {
        let (_, end) = run(&["<tool_call>{\"name\": \"get\", \"arguments\": {"], false);
        assert!(
            matches!(end, Resolution::Malformed { ref detail, .. } if detail.contains("never closed")),
            "{end:?}"
        );
        let (_, end) = run(&["<tool_call>not json</tool_call>"], false);
        assert!(
            matches!(end, Resolution::Malformed { ref raw, .. } if raw == "<tool_call>not json</tool_call>"),
            "{end:?}"
        );
        let (_, end) = run(
            &["<tool_call>{\"name\": \"get\", \"arguments\": [1]}</tool_call>"],
            false,
        );
        assert!(
            matches!(end, Resolution::Malformed { ref detail, .. } if detail.contains("must be a JSON object")),
            "{end:?}"
        );
    }

    #[test]
    fn with_structured_calls_leaked_markup_is_dropped() {
        let (streamed, end) = run(&["Checking.\n", "<tool_call>\n<function=get", "_weather"], true);
        assert_eq!(streamed, "Checking.\n");
        assert_eq!(end, Resolution::Text(String::new()));
        let (_, end) = run(&["a <tool_call>{}</tool_call> b <tool_c"], true);
        assert_eq!(end, Resolution::Text(" b ".into()));
    }
}
