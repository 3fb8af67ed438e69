//! `POST /v1/responses` (streaming only): the same scenarios played as OpenAI Responses API
//! events, for gateways that ask their upstream for that API (vLLM serves it too). A turn becomes
//! `response.created`, then per step an output item (a message with `response.output_text.delta`
//! events, a reasoning item, a function call with `response.function_call_arguments.delta`
//! events), then `response.completed` (or `response.incomplete` for a `length` finish) with the
//! output and usage.

use serde_json::{Value, json};

use crate::pieces::{Piece, split_n, split_text};
use crate::scenario::{Step, Turn};

/// Numbers the responses served: gateways store responses and their items by id, so ids are
/// unique per server.
static NEXT_RESPONSE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// How many assistant turns `input` already holds: each run of consecutive output items (an
/// assistant message, function calls, reasoning) is one turn.
pub(crate) fn assistant_turns(request: &Value) -> usize {
    let Some(items) = request["input"].as_array() else {
        return 0;
    };
    let is_output = |item: &Value| {
        item["role"] == "assistant" || matches!(item["type"].as_str(), Some("function_call" | "reasoning"))
    };
    let mut turns = 0;
    let mut in_output = false;
    for item in items {
        let output = is_output(item);
        if output && !in_output {
            turns += 1;
        }
        in_output = output;
    }
    turns
}

/// Whether the turn can be played as Responses events (recorded chat-completions streams cannot).
pub(crate) fn playable(turn: &Turn) -> bool {
    !turn.steps.iter().any(|s| matches!(s, Step::Raw { .. }))
}

/// The events of one turn, in order, as SSE pieces.
pub(crate) fn render(turn: &Turn, model: &str, turn_number: usize, prompt_tokens: u64) -> Vec<Piece> {
    let mut events = Events {
        out: Vec::new(),
        sequence: 0,
        response_id: format!(
            "resp_mock_{}",
            NEXT_RESPONSE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ),
        model: model.to_owned(),
        output: Vec::new(),
        open_message: None,
        output_chars: 0,
    };
    events.emit("response.created", json!({"response": events.response("in_progress")}));
    events.emit(
        "response.in_progress",
        json!({"response": events.response("in_progress")}),
    );
    for step in &turn.steps {
        match step {
            Step::Text { text, chunk_chars } => events.text(&split_text(text, *chunk_chars)),
            Step::Reasoning { text } => events.reasoning(text),
            Step::ToolCall {
                name,
                arguments,
                id,
                fragments,
            } => {
                let arguments = match arguments {
                    Value::String(raw) => raw.clone(),
                    other => other.to_string(),
                };
                // As through chat completions: `call_<turn>_<index of the call in the turn>`.
                let calls = events.output.iter().filter(|i| i["type"] == "function_call").count();
                let call_id = id.clone().unwrap_or_else(|| format!("call_{turn_number}_{calls}"));
                events.function_call(name, &call_id, &split_n(&arguments, fragments.unwrap_or(3)));
            }
            Step::Delay { ms } => events.out.push(Piece::Delay(std::time::Duration::from_millis(*ms))),
            Step::Cut => {
                events.out.push(Piece::Cut);
                return events.out;
            }
            Step::Stall => {
                events.out.push(Piece::Stall);
                return events.out;
            }
            Step::Error { message } => {
                events.emit(
                    "error",
                    json!({"code": "server_error", "message": message, "param": null}),
                );
                return events.out;
            }
            Step::Raw { .. } => {}
        }
    }
    events.close_message();
    events.finish(turn, prompt_tokens);
    events.out
}

/// The events of a turn as they are built: the response's output so far and the open message.
struct Events {
    out: Vec<Piece>,
    sequence: u64,
    response_id: String,
    model: String,
    /// Finished output items, for `response.completed`.
    output: Vec<Value>,
    /// The message item being streamed: its id and text so far.
    open_message: Option<(String, String)>,
    output_chars: usize,
}

impl Events {
    /// One SSE event of `kind` with `fields`, numbered.
    fn emit(&mut self, kind: &str, mut fields: Value) {
        fields["type"] = json!(kind);
        fields["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        self.out
            .push(Piece::Bytes(format!("event: {kind}\ndata: {fields}\n\n")));
    }

    fn response(&self, status: &str) -> Value {
        json!({"id": self.response_id, "object": "response", "created_at": 0, "status": status,
            "model": self.model, "output": self.output, "parallel_tool_calls": true, "tool_choice": "auto", "tools": []})
    }

    fn text(&mut self, pieces: &[String]) {
        let output_index = self.output.len();
        let item_id = match &self.open_message {
            Some((id, _)) => id.clone(),
            None => {
                let id = format!("msg_{}_{output_index}", self.response_id);
                let item =
                    json!({"id": id, "type": "message", "status": "in_progress", "role": "assistant", "content": []});
                self.emit(
                    "response.output_item.added",
                    json!({"output_index": output_index, "item": item}),
                );
                let part = json!({"type": "output_text", "text": "", "annotations": []});
                self.emit(
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": output_index, "content_index": 0, "part": part}),
                );
                self.open_message = Some((id.clone(), String::new()));
                id
            }
        };
        for delta in pieces {
            self.output_chars += delta.len();
            if let Some((_, text)) = &mut self.open_message {
                text.push_str(delta);
            }
            self.emit(
                "response.output_text.delta",
                json!({"item_id": item_id, "output_index": output_index, "content_index": 0, "delta": delta, "logprobs": []}),
            );
        }
    }

    fn close_message(&mut self) {
        let Some((id, text)) = self.open_message.take() else {
            return;
        };
        let output_index = self.output.len();
        let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
        let at = json!({"item_id": id, "output_index": output_index, "content_index": 0});
        self.emit(
            "response.output_text.done",
            json!({"text": text, "logprobs": []}).merged(&at),
        );
        self.emit("response.content_part.done", json!({"part": part}).merged(&at));
        let item = json!({"id": id, "type": "message", "status": "completed", "role": "assistant", "content": [part]});
        self.emit(
            "response.output_item.done",
            json!({"output_index": output_index, "item": item}),
        );
        self.output.push(item);
    }

    fn reasoning(&mut self, text: &str) {
        self.close_message();
        let output_index = self.output.len();
        let id = format!("rs_{}_{output_index}", self.response_id);
        let item = json!({"id": id, "type": "reasoning", "summary": [], "content": []});
        self.emit(
            "response.output_item.added",
            json!({"output_index": output_index, "item": item}),
        );
        let at = json!({"item_id": id, "output_index": output_index, "content_index": 0});
        for delta in split_text(text, None) {
            self.emit("response.reasoning_text.delta", json!({"delta": delta}).merged(&at));
        }
        self.emit("response.reasoning_text.done", json!({"text": text}).merged(&at));
        let item = json!({"id": id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]});
        self.emit(
            "response.output_item.done",
            json!({"output_index": output_index, "item": item}),
        );
        self.output.push(item);
    }

    fn function_call(&mut self, name: &str, call_id: &str, fragments: &[String]) {
        self.close_message();
        let output_index = self.output.len();
        let id = format!("fc_{}_{output_index}", self.response_id);
        let item = |status: &str, arguments: &str| json!({"id": id, "type": "function_call", "status": status, "call_id": call_id, "name": name, "arguments": arguments});
        self.emit(
            "response.output_item.added",
            json!({"output_index": output_index, "item": item("in_progress", "")}),
        );
        let at = json!({"item_id": id, "output_index": output_index});
        for delta in fragments {
            self.emit(
                "response.function_call_arguments.delta",
                json!({"delta": delta}).merged(&at),
            );
        }
        let arguments = fragments.concat();
        self.output_chars += arguments.len();
        self.emit(
            "response.function_call_arguments.done",
            json!({"arguments": arguments, "name": name}).merged(&at),
        );
        let done = item("completed", &arguments);
        self.emit(
            "response.output_item.done",
            json!({"output_index": output_index, "item": done}),
        );
        self.output.push(done);
    }

    /// `response.completed`, or `response.incomplete` when the turn is scripted to stop at its
    /// length, with the usage (scripted, else about four characters a token).
    fn finish(&mut self, turn: &Turn, prompt_tokens: u64) {
        let [input, output] = turn
            .usage
            .unwrap_or([prompt_tokens, (self.output_chars / 4).max(1) as u64]);
        let usage = json!({"input_tokens": input, "output_tokens": output, "total_tokens": input + output,
            "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}});
        let (kind, status) = match turn.finish_reason.as_deref() {
            Some("length") => ("response.incomplete", "incomplete"),
            _ => ("response.completed", "completed"),
        };
        let mut response = self.response(status);
        response["usage"] = usage;
        if status == "incomplete" {
            response["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        self.emit(kind, json!({"response": response}));
    }
}

/// Adds another object's fields to a JSON object.
trait Merged {
    fn merged(self, other: &Value) -> Value;
}

impl Merged for Value {
    fn merged(mut self, other: &Value) -> Value {
        if let (Some(fields), Some(more)) = (self.as_object_mut(), other.as_object()) {
            fields.extend(more.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Step;

    fn events(pieces: &[Piece]) -> Vec<Value> {
        pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Bytes(b) => b
                    .lines()
                    .find_map(|l| l.strip_prefix("data: "))
                    .and_then(|d| serde_json::from_str(d).ok()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_turn_of_text_and_a_call_is_numbered_events_ending_completed() {
        let turn = Turn::text("Hello big world").then(Step::call("sleep", json!({"ms": 5})));
        let events = events(&render(&turn, "m", 1, 40));
        let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
        assert_eq!(kinds.first(), Some(&"response.created"));
        assert_eq!(kinds.last(), Some(&"response.completed"));
        let text: String = events
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .filter_map(|e| e["delta"].as_str())
            .collect();
        assert_eq!(text, "Hello big world");
        let arguments: String = events
            .iter()
            .filter(|e| e["type"] == "response.function_call_arguments.delta")
            .filter_map(|e| e["delta"].as_str())
            .collect();
        assert_eq!(arguments, r#"{"ms":5}"#);
        let sequence: Vec<u64> = events.iter().filter_map(|e| e["sequence_number"].as_u64()).collect();
        assert_eq!(sequence, (0..events.len() as u64).collect::<Vec<_>>());
        let output = &events[events.len() - 1]["response"]["output"];
        assert_eq!(output[0]["content"][0]["text"], "Hello big world");
        assert_eq!(output[1]["call_id"], "call_1_0");
    }

    #[test]
    fn turns_are_counted_from_the_runs_of_output_items_in_the_input() {
        let request = json!({"input": [
            {"role": "user", "content": "go"},
            {"type": "reasoning", "summary": []},
            {"type": "function_call", "call_id": "a"},
            {"type": "function_call", "call_id": "b"},
            {"type": "function_call_output", "call_id": "a"},
            {"type": "function_call_output", "call_id": "b"},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "more"},
        ]});
        assert_eq!(assistant_turns(&request), 2);
        assert_eq!(assistant_turns(&json!({"input": "hi"})), 0);
    }
}
