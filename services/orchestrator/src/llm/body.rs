//! The JSON body of a streamed chat completion request (OpenAI's wire form), written from the
//! borrowed conversation with no intermediate `serde_json::Value` tree, and from what is new: a
//! run's transcript is append-only, so the body of its turn N starts with the body of turn N−1 up
//! to that request's last message, kept serialized in the run's [`RequestPrefix`](crate::domain::model::RequestPrefix) — a turn costs
//! the new messages and one copy, not the whole transcript written again.
//!
//! Only the last message of a request may still change (a note or a steered message joins the
//! newest user message as a paragraph), so a prefix keeps every message but the last.

use std::sync::Arc;

use serde::Serialize;
use serde_json::Value;

use crate::domain::chat::{Message, ToolDefinition};
use crate::domain::model::ChatRequest;
use crate::domain::params::ToolChoice;

/// What a run's [`RequestPrefix`](crate::domain::model::RequestPrefix) holds for this adapter: empty until the first body is written,
/// then `{"model":…,"tools":[…],"messages":[` and every message of the last request but its last.
struct Prefix {
    /// The model it was written for.
    model: String,
    /// The tools it was written for (shared by every turn of a run: compared by address).
    tools: Arc<[ToolDefinition]>,
    /// Messages written.
    messages: usize,
    /// The bytes: the body's opening, then the messages separated by commas.
    bytes: Vec<u8>,
    /// Where the last message written begins in `bytes`: a request whose message there reads
    /// otherwise is another transcript.
    last_at: usize,
}

/// The body of `request` (see the module docs).
pub fn request_body(request: &ChatRequest) -> Vec<u8> {
    request_body_with(request, None)
}

/// [`request_body`], carrying the request's affinity key in the body field `affinity_field`
/// when one is set (e.g. OpenAI's `prompt_cache_key`). Written from the request's
/// [`RequestPrefix`](crate::domain::model::RequestPrefix) when it holds a beginning of this request, which it then holds up to this
/// request's last message but one.
pub fn request_body_with(request: &ChatRequest, affinity_field: Option<&str>) -> Vec<u8> {
    request
        .prefix
        .with(|held: &mut Option<Prefix>| body_from(held, request, affinity_field))
}

/// [`request_body_with`] from the prefix `held`, which is left holding this request's beginning.
fn body_from(held: &mut Option<Prefix>, request: &ChatRequest, affinity_field: Option<&str>) -> Vec<u8> {
    let stable = request.messages.len().saturating_sub(1);
    let mut prefix = match held.take() {
        Some(prefix) if prefix.continues(request) => prefix,
        _ => Prefix::opening(request),
    };
    prefix.extend(&request.messages[prefix.messages.min(stable)..stable]);
    let mut body = Vec::with_capacity(prefix.bytes.len() + 4096);
    body.extend_from_slice(&prefix.bytes);
    if let Some(last) = request.messages.last() {
        if prefix.messages > 0 {
            body.push(b',');
        }
        write_json(&mut body, &WireMessage(last));
    }
    body.push(b']');
    close(&mut body, &Tail::of(request, affinity_field));
    *held = Some(prefix);
    debug_assert_eq!(
        body,
        whole_body(request, affinity_field),
        "a body from the prefix is the whole body"
    );
    body
}

impl Prefix {
    /// The opening of `request`'s body: its model and tools, up to its first message.
    fn opening(request: &ChatRequest) -> Self {
        let mut bytes = Vec::new();
        write_json(
            &mut bytes,
            &Head {
                model: &request.model,
                tools: request.tools.iter().map(WireTool::new).collect(),
            },
        );
        bytes.pop(); // the object's `}`: the messages follow
        bytes.extend_from_slice(br#","messages":["#);
        let last_at = bytes.len();
        Self {
            model: request.model.clone(),
            tools: Arc::clone(&request.tools),
            messages: 0,
            bytes,
            last_at,
        }
    }

    /// Whether `request` begins with what this prefix holds: its model, tools, more messages,
    /// and the last message held where it was. A run's requests only add messages, and only
    /// the last one changes, so that is all a run's next request is checked for: one message
    /// written again, not the transcript.
    fn continues(&self, request: &ChatRequest) -> bool {
        let same_last = || match self.messages.checked_sub(1) {
            None => true,
            Some(last) => {
                let mut written = Vec::with_capacity(self.bytes.len() - self.last_at);
                write_json(&mut written, &WireMessage(&request.messages[last]));
                written == self.bytes[self.last_at..]
            }
        };
        self.model == request.model
            && Arc::ptr_eq(&self.tools, &request.tools)
            && request.messages.len() > self.messages
            && same_last()
    }

    /// Writes `messages` after those held.
    fn extend(&mut self, messages: &[Message]) {
        for message in messages {
            if self.messages > 0 {
                self.bytes.push(b',');
            }
            self.last_at = self.bytes.len();
            write_json(&mut self.bytes, &WireMessage(message));
            self.messages += 1;
        }
    }
}

/// Serializes `value` after `into` (borrowed strings, numbers and `Value`s: cannot fail).
fn write_json(into: &mut Vec<u8>, value: &impl Serialize) {
    let _ = serde_json::to_writer(&mut *into, value);
}

/// Ends `body` with the fields of `tail`, after the messages.
fn close(body: &mut Vec<u8>, tail: &Tail<'_>) {
    let at = body.len();
    write_json(body, tail);
    // `{"stream":true,…}` becomes `,"stream":true,…}`: the body's object goes on.
    if let Some(open) = body.get_mut(at) {
        *open = b',';
    }
}

/// The body written whole, field by field: what [`request_body_with`] must equal.
fn whole_body(request: &ChatRequest, affinity_field: Option<&str>) -> Vec<u8> {
    let body = Body {
        model: &request.model,
        tools: request.tools.iter().map(WireTool::new).collect(),
        messages: request.messages.iter().map(WireMessage).collect(),
        tail: Tail::of(request, affinity_field),
    };
    serde_json::to_vec(&body).unwrap_or_default()
}

/// What opens the body: what the model reads first.
#[derive(Serialize)]
struct Head<'a> {
    model: &'a str,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<WireTool<'a>>,
}

impl<'a> Tail<'a> {
    /// The fields of `request`'s body after its messages.
    fn of(request: &'a ChatRequest, affinity_field: Option<&'a str>) -> Self {
        let p = &request.params;
        // Servers refuse tool_choice and parallel_tool_calls without tools.
        let offers_tools = !request.tools.is_empty();
        Tail {
            stream: true,
            stream_options: StreamOptions { include_usage: true },
            temperature: p.temperature,
            top_p: p.top_p,
            max_tokens: p.max_tokens,
            stop: &p.stop,
            seed: p.seed,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            tool_choice: p.tool_choice.as_ref().filter(|_| offers_tools).map(WireToolChoice),
            parallel_tool_calls: p.parallel_tool_calls.filter(|_| offers_tools),
            reasoning_effort: p.reasoning_effort.as_deref(),
            affinity: affinity_field
                .filter(|_| !request.affinity.is_empty())
                .map(|name| AffinityField(name, &request.affinity)),
            extra: &p.extra_body,
        }
    }
}

/// Wire form of [`ChatRequest`] (OpenAI chat completions). What the model reads comes first,
/// the tools then the messages, and what varies per turn (`tool_choice`) after them, so a
/// turn's body starts with the previous turn's up to the end of its last message.
#[derive(Serialize)]
struct Body<'a> {
    model: &'a str,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<WireTool<'a>>,
    messages: Vec<WireMessage<'a>>,
    #[serde(flatten)]
    tail: Tail<'a>,
}

/// The fields after the messages.
#[derive(Serialize)]
struct Tail<'a> {
    stream: bool,
    stream_options: StreamOptions,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    stop: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    presence_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    frequency_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<WireToolChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parallel_tool_calls: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_effort: Option<&'a str>,
    /// The run's affinity key, under the configured field name.
    #[serde(flatten)]
    affinity: Option<AffinityField<'a>>,
    /// `extra_body`: checked to set no field above.
    #[serde(flatten)]
    extra: &'a serde_json::Map<String, Value>,
}

/// One field, `name: value`, of the body.
struct AffinityField<'a>(&'a str, &'a str);

impl Serialize for AffinityField<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(1))?;
        map.serialize_entry(self.0, self.1)?;
        map.end()
    }
}

/// `"auto"`, `"none"`, `"required"`, or `{"type": "function", "function": {"name": …}}`.
struct WireToolChoice<'a>(&'a ToolChoice);

impl Serialize for WireToolChoice<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            ToolChoice::Tool(name) => {
                serde_json::json!({"type": "function", "function": {"name": name}}).serialize(serializer)
            }
            other => serializer.serialize_str(&other.to_string()),
        }
    }
}

/// `stream_options`: ask for the usage chunk at the end of the stream.
#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// `{"type": "function", "function": {...}}`.
#[derive(Serialize)]
struct WireTool<'a> {
    r#type: &'static str,
    function: WireFunction<'a>,
}

impl<'a> WireTool<'a> {
    fn new(tool: &'a ToolDefinition) -> Self {
        Self {
            r#type: "function",
            function: WireFunction {
                name: &tool.name,
                description: &tool.description,
                parameters: &tool.parameters,
            },
        }
    }
}

/// A tool's name, description and argument schema.
#[derive(Serialize)]
struct WireFunction<'a> {
    name: &'a str,
    description: &'a str,
    parameters: &'a Value,
}

/// One message in the wire form; the shape depends on the role.
struct WireMessage<'a>(&'a Message);

impl Serialize for WireMessage<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(None)?;
        match self.0 {
            Message::System(content) => {
                map.serialize_entry("role", "system")?;
                map.serialize_entry("content", content)?;
            }
            Message::User { content, name } => {
                map.serialize_entry("role", "user")?;
                map.serialize_entry("content", content)?;
                if let Some(name) = name {
                    map.serialize_entry("name", name)?;
                }
            }
            Message::Assistant {
                content,
                tool_calls,
                reasoning,
            } if tool_calls.is_empty() => {
                map.serialize_entry("role", "assistant")?;
                map.serialize_entry("content", content)?;
                if let Some(reasoning) = reasoning {
                    map.serialize_entry("reasoning_content", reasoning)?;
                }
            }
            Message::Assistant {
                content,
                tool_calls,
                reasoning,
            } => {
                map.serialize_entry("role", "assistant")?;
                map.serialize_entry("content", &Some(content.as_str()).filter(|c| !c.is_empty()))?;
                if let Some(reasoning) = reasoning {
                    map.serialize_entry("reasoning_content", reasoning)?;
                }
                let calls: Vec<WireToolCall<'_>> = tool_calls
                    .iter()
                    .map(|c| WireToolCall {
                        id: &c.id,
                        r#type: "function",
                        function: WireCallFunction {
                            name: &c.name,
                            arguments: &c.arguments,
                        },
                    })
                    .collect();
                map.serialize_entry("tool_calls", &calls)?;
            }
            Message::Tool { tool_call_id, content } => {
                map.serialize_entry("role", "tool")?;
                map.serialize_entry("tool_call_id", tool_call_id)?;
                map.serialize_entry("content", content)?;
            }
        }
        map.end()
    }
}

/// A tool call made by the assistant, as sent back in the conversation.
#[derive(Serialize)]
struct WireToolCall<'a> {
    id: &'a str,
    r#type: &'static str,
    function: WireCallFunction<'a>,
}

/// The called tool's name and its arguments as the model wrote them.
#[derive(Serialize)]
struct WireCallFunction<'a> {
    name: &'a str,
    arguments: &'a str,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::model::RequestPrefix;
    use serde_json::json;

    /// The request of a run's turn: its messages so far, sharing the run's tools and prefix.
    fn turn(messages: &[Message], tools: &Arc<[ToolDefinition]>, prefix: &RequestPrefix) -> ChatRequest {
        ChatRequest {
            model: "m".into(),
            messages: messages.to_vec(),
            tools: Arc::clone(tools),
            params: Default::default(),
            pace: Default::default(),
            affinity: "run-1".into(),
            avoid: None,
            prefix: prefix.clone(),
        }
    }

    fn held(prefix: &RequestPrefix) -> usize {
        prefix.with(|held: &mut Option<Prefix>| held.as_ref().map_or(0, |p| p.messages))
    }

    #[test]
    fn a_runs_bodies_written_from_its_prefix_are_its_whole_bodies() {
        let tools: Arc<[ToolDefinition]> = Arc::from(vec![ToolDefinition {
            name: "read_file".into(),
            description: "reads \"a\" file".into(),
            parameters: json!({"type": "object"}).into(),
        }]);
        let prefix = RequestPrefix::default();
        let mut messages = vec![
            Message::System("bios".into()),
            Message::User {
                content: "read it".into(),
                name: None,
            },
        ];
        for n in 0..12 {
            let request = turn(&messages, &tools, &prefix);
            assert_eq!(
                request_body_with(&request, Some("prompt_cache_key")),
                whole_body(&request, Some("prompt_cache_key")),
                "turn {n}"
            );
            assert_eq!(held(&prefix), messages.len() - 1, "every message but the last is held");
            messages.push(Message::Assistant {
                content: format!("turn {n} \u{1F600} \"quoted\""),
                tool_calls: vec![crate::domain::chat::ToolCall {
                    id: format!("c{n}"),
                    name: "read_file".into(),
                    arguments: "{\"path\":\"a\"}".into(),
                }],
                reasoning: (n % 2 == 0).then(|| "why".to_owned()),
            });
            messages.push(Message::Tool {
                tool_call_id: format!("c{n}"),
                content: "x".repeat(100 * n),
            });
            // A note, and every third turn a steered message joining it as a paragraph.
            crate::domain::chat::append_user(&mut messages, &format!("note {n}"), None);
            if n % 3 == 0 {
                crate::domain::chat::append_user(&mut messages, "and also", None);
            }
        }
    }

    #[test]
    fn a_prefix_of_another_model_tools_or_transcript_is_written_anew() {
        let (tools, other_tools): (Arc<[ToolDefinition]>, Arc<[ToolDefinition]>) =
            (Arc::from(vec![]), Arc::from(vec![]));
        let user = |text: &str| Message::User {
            content: text.into(),
            name: None,
        };
        let long = [user("a"), Message::System("b".into()), user("c")];
        type Tools = Arc<[ToolDefinition]>;
        let others: [(&str, &[Message], &Tools); 5] = [
            ("m", &long[..2], &tools),
            ("m", &long, &other_tools),
            ("other", &long, &tools),
            ("m", &[user("a"), Message::System("B".into()), user("c")], &tools),
            ("m", &[user("x"), user("y"), user("z"), user("w")], &tools),
        ];
        for (model, messages, tools_of) in others {
            let prefix = RequestPrefix::default();
            let _ = request_body(&turn(&long, &tools, &prefix));
            assert_eq!(held(&prefix), 2);
            let mut request = turn(messages, tools_of, &prefix);
            request.model = model.into();
            assert_eq!(
                request_body(&request),
                whole_body(&request, None),
                "{model} {messages:?}"
            );
        }
    }

    #[test]
    fn request_body_has_stream_usage_tools_and_only_set_params() {
        let request = ChatRequest {
            model: "m".into(),
            messages: vec![
                Message::System("bios".into()),
                Message::User {
                    content: "hi".into(),
                    name: None,
                },
                Message::Assistant {
                    content: String::new(),
                    tool_calls: vec![crate::domain::chat::ToolCall {
                        id: "c1".into(),
                        name: "t".into(),
                        arguments: "{}".into(),
                    }],
                    reasoning: None,
                },
                Message::Tool {
                    tool_call_id: "c1".into(),
                    content: "{\"ok\":1}".into(),
                },
            ],
            tools: std::sync::Arc::from([crate::domain::chat::ToolDefinition {
                name: "t".into(),
                description: "d".into(),
                parameters: json!({"type": "object"}).into(),
            }]),
            params: crate::domain::params::SamplingParams {
                temperature: Some(0.5),
                ..Default::default()
            },
            pace: crate::domain::model::ReadPace::default(),
            affinity: String::new(),
            avoid: None,
            prefix: Default::default(),
        };
        let body: Value = serde_json::from_slice(&request_body(&request)).unwrap();
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["temperature"], 0.5);
        assert!(body.get("top_p").is_none());
        assert_eq!(body["tools"][0]["function"]["name"], "t");
        assert_eq!(body["messages"][2]["content"], Value::Null);
        assert_eq!(body["messages"][2]["tool_calls"][0]["id"], "c1");
        assert_eq!(body["messages"][3]["tool_call_id"], "c1");
        assert_eq!(body["messages"][1], json!({"role": "user", "content": "hi"}));
        assert!(body.get("stop").is_none() && body.get("seed").is_none() && body.get("max_tokens").is_none());
    }

    #[test]
    fn every_parameter_reaches_the_body_exactly_and_extra_fields_merge_flat() {
        let tool = crate::domain::chat::ToolDefinition {
            name: "calculate".into(),
            description: "d".into(),
            parameters: json!({"type": "object"}).into(),
        };
        let params = crate::domain::params::SamplingParams {
            temperature: Some(0.0),
            top_p: Some(0.5),
            max_tokens: Some(64),
            stop: vec!["END".into()],
            seed: Some(7),
            presence_penalty: Some(0.5),
            frequency_penalty: Some(-0.5),
            tool_choice: Some(ToolChoice::Tool("calculate".into())),
            parallel_tool_calls: Some(false),
            reasoning_effort: Some("low".into()),
            extra_body: json!({"top_k": 20, "chat_template_kwargs": {"enable_thinking": false}})
                .as_object()
                .cloned()
                .unwrap(),
        };
        let request = |tools: Vec<crate::domain::chat::ToolDefinition>, params| ChatRequest {
            model: "m".into(),
            messages: vec![Message::System("s".into())],
            tools: tools.into(),
            params,
            pace: crate::domain::model::ReadPace::default(),
            affinity: String::new(),
            avoid: None,
            prefix: Default::default(),
        };
        let body: Value = serde_json::from_slice(&request_body(&request(vec![tool], params.clone()))).unwrap();
        let mut fields = body.as_object().unwrap().clone();
        fields.remove("messages");
        fields.remove("tools");
        assert_eq!(
            Value::Object(fields),
            json!({
                "model": "m", "stream": true, "stream_options": {"include_usage": true},
                "temperature": 0.0, "top_p": 0.5, "max_tokens": 64, "stop": ["END"], "seed": 7,
                "presence_penalty": 0.5, "frequency_penalty": -0.5,
                "tool_choice": {"type": "function", "function": {"name": "calculate"}},
                "parallel_tool_calls": false, "reasoning_effort": "low",
                "top_k": 20, "chat_template_kwargs": {"enable_thinking": false}
            })
        );
        for (choice, wire) in [
            (ToolChoice::Auto, "auto"),
            (ToolChoice::None, "none"),
            (ToolChoice::Required, "required"),
        ] {
            let params = crate::domain::params::SamplingParams {
                tool_choice: Some(choice),
                ..Default::default()
            };
            let tool = crate::domain::chat::ToolDefinition {
                name: "t".into(),
                description: "d".into(),
                parameters: json!({"type": "object"}).into(),
            };
            let body: Value = serde_json::from_slice(&request_body(&request(vec![tool], params))).unwrap();
            assert_eq!(body["tool_choice"], wire);
        }
        // Without tools, servers refuse tool_choice and parallel_tool_calls: neither is sent.
        let body: Value = serde_json::from_slice(&request_body(&request(vec![], params))).unwrap();
        assert!(body.get("tool_choice").is_none() && body.get("parallel_tool_calls").is_none());
        assert_eq!(body["reasoning_effort"], "low");
    }

    #[test]
    fn request_body_writes_every_message_shape_and_param_exactly() {
        let request = ChatRequest {
            model: "m".into(),
            messages: vec![
                Message::User {
                    content: "hi".into(),
                    name: Some("ann".into()),
                },
                Message::Assistant {
                    content: "hello".into(),
                    tool_calls: vec![],
                    reasoning: Some("they greeted".into()),
                },
                Message::Assistant {
                    content: "let me look".into(),
                    tool_calls: vec![crate::domain::chat::ToolCall {
                        id: "c1".into(),
                        name: "t".into(),
                        arguments: "{\"q\":1}".into(),
                    }],
                    reasoning: Some("t answers q".into()),
                },
            ],
            tools: std::sync::Arc::from([]),
            params: crate::domain::params::SamplingParams {
                temperature: Some(0.7),
                top_p: Some(0.9),
                max_tokens: Some(64),
                stop: vec!["END".into()],
                seed: Some(-3),
                ..Default::default()
            },
            pace: crate::domain::model::ReadPace::default(),
            affinity: String::new(),
            avoid: None,
            prefix: Default::default(),
        };
        let text = String::from_utf8(request_body(&request)).unwrap();
        // f32 parameters are written as the caller gave them, not widened (0.699999988…).
        assert!(text.contains("\"temperature\":0.7,"), "{text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert!(body.get("tools").is_none());
        assert_eq!(
            body["messages"],
            json!([
                {"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": "hello", "reasoning_content": "they greeted"},
                {"role": "assistant", "content": "let me look", "reasoning_content": "t answers q", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "t", "arguments": "{\"q\":1}"}}
                ]},
            ])
        );
        assert_eq!(body["max_tokens"], 64);
        assert_eq!(body["stop"], json!(["END"]));
        assert_eq!(body["seed"], -3);
        assert_eq!(body["model"], "m");
    }
}
