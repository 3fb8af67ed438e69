//! Tool calls written in the text, for models or servers without structured tool calls
//! (docs/architecture.md, "Fallback directives and the hold-back"), and the hold-back that keeps streamed text equal to final text.
//!
//! Recognised directives:
//! * `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Hermes / Qwen style), anywhere;
//! * a fenced block (```` ```json … ``` ````) holding `{"name"|"tool": …, "arguments"|"parameters": {…}}`;
//! * the same JSON object as the whole message.
//!
//! A `<tool_call>` or an object counts only when its first key is `name` or `tool`, and a fenced
//! block only when its info string is empty or `json`: the same rules by which the hold-back
//! ([`super::hold_back`]) releases text, so what it released is never parsed as a directive.

use serde_json::{Map, Value};

pub(super) const OPEN_TAG: &str = "<tool_call>";
const CLOSE_TAG: &str = "</tool_call>";
pub(super) const FENCE: &str = "```";
/// What opens a JSON object.
pub(super) const OBJECT_OPEN: char = '{';
/// Tool-call markup of servers that parse calls in the text themselves (Qwen3-Coder's XML form
/// in llama.cpp); it can leak into the content before the server recognises it.
pub(super) const XML_FUNCTION: &str = "<function=";

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

/// Resolves the held text of a turn at its end. `whole_message`: nothing of the turn was
/// released, so the held text may be one standalone directive. With structured calls the held
/// text is not parsed for directives: `<tool_call>` markup (finished or not) is dropped as server
/// noise and the rest released.
pub(super) fn resolve_held(held: &str, whole_message: bool, has_structured_calls: bool) -> Resolution {
    if has_structured_calls {
        return Resolution::Text(strip_tool_call_markup(held));
    }
    if held.is_empty() {
        return Resolution::Text(String::new());
    }
    if whole_message && let Some(call) = standalone_directive(held) {
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

/// Whether the first key of the object `text` starts with is `name` or `tool`; `None` when the
/// text ends before that is known.
pub(super) fn first_key_names_a_tool(text: &str) -> Option<bool> {
    let inner = text.strip_prefix(OBJECT_OPEN)?.trim_start();
    if inner.is_empty() {
        return None;
    }
    let Some(key) = inner.strip_prefix('"') else {
        return Some(false);
    };
    match key.find(['"', '\\']) {
        Some(end) => Some(key.as_bytes()[end] == b'"' && matches!(&key[..end], "name" | "tool")),
        None if "name".starts_with(key) || "tool".starts_with(key) => None,
        None => Some(false),
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
                let body = &rest[t + OPEN_TAG.len()..];
                if first_key_names_a_tool(body.trim_start()) != Some(true) {
                    // A mention of the tag, not a directive.
                    stripped.push_str(&rest[..t + OPEN_TAG.len()]);
                    rest = body;
                    continue;
                }
                stripped.push_str(&rest[..t]);
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

/// The directive in a fenced block's body, if it is one: an empty or `json` info string (or `{`
/// right after the fence), then an object whose first key is `name` or `tool`. `Some(Err)` when
/// it looks like a directive (has a name key) but is malformed.
pub(super) fn fenced_directive(body: &str) -> Option<Result<TextCall, String>> {
    let one_line = body.trim_start_matches([' ', '\t']);
    let json = if one_line.starts_with(OBJECT_OPEN) {
        one_line.trim()
    } else {
        let (info, rest) = body.split_once('\n')?;
        let info = info.trim();
        (info.is_empty() || info.eq_ignore_ascii_case("json")).then_some(rest.trim())?
    };
    if first_key_names_a_tool(json) != Some(true) {
        return None;
    }
    let value: Value = serde_json::from_str(json).ok()?;
    let object = value.as_object()?;
    looks_like_directive(object).then(|| parse_object(object, false))
}

/// The whole message as one directive object, if it is exactly that.
fn standalone_directive(text: &str) -> Option<TextCall> {
    if first_key_names_a_tool(text.trim()) != Some(true) {
        return None;
    }
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
            shared::text::excerpt(body.trim())
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

    #[test]
    fn the_first_key_decides() {
        assert_eq!(first_key_names_a_tool("{"), None);
        assert_eq!(first_key_names_a_tool("{ \"na"), None);
        assert_eq!(first_key_names_a_tool("{\"name\""), Some(true));
        assert_eq!(first_key_names_a_tool("{\n  \"tool\": 1"), Some(true));
        assert_eq!(first_key_names_a_tool("{\"names\""), Some(false));
        assert_eq!(first_key_names_a_tool("{\"x"), Some(false));
        assert_eq!(first_key_names_a_tool("{1"), Some(false));
        assert_eq!(first_key_names_a_tool("{\"n\\u0061me\""), Some(false));
    }

    #[test]
    fn fences_need_an_empty_or_json_info_string() {
        let directive = "{\"name\": \"a\", \"arguments\": {}}";
        assert!(fenced_directive(&format!("json\n{directive}\n")).is_some());
        assert!(fenced_directive(&format!("JSON\n{directive}")).is_some());
        assert!(fenced_directive(&format!("\n{directive}")).is_some());
        assert!(fenced_directive(directive).is_some(), "one line");
        assert!(fenced_directive(&format!("python\n{directive}")).is_none());
        assert!(fenced_directive("json\n{\"arguments\": {}, \"name\": \"a\"}").is_none());
    }
}
