//! The HTTP side: `POST /v1/chat/completions` and `POST /v1/responses` (streaming only), and
//! `GET /v1/models`.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{Value, json};

use crate::pieces::{Piece, split_n, split_text};
use crate::prefix_cache::{Lookup, PrefixCache, prompt_of};
use crate::scenario::{Scenario, Step, Turn};

/// The scenarios a server plays: a default one and named ones (chosen by the request's `model`).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenarios {
    /// Played when no named scenario matches the model.
    pub default: Scenario,
    /// Scenarios by model name.
    #[serde(default)]
    pub named: HashMap<String, Scenario>,
}

impl From<Scenario> for Scenarios {
    fn from(default: Scenario) -> Self {
        Self {
            default,
            named: HashMap::new(),
        }
    }
}

#[derive(Default)]
struct Shared {
    scenarios: Scenarios,
    requests: Mutex<Vec<Value>>,
    /// The request bodies as they came, when recorded.
    raw_requests: Mutex<Vec<Bytes>>,
    /// The simulated prefix cache (off under load: the benchmark measures the orchestrator, not
    /// this server's bookkeeping).
    cache: Option<PrefixCache>,
    attempts: Mutex<HashMap<(String, usize), usize>>,
    record: bool,
    /// Time served per conversation, when measured (see [`MockLlm::start_timed`]).
    served: Option<Mutex<HashMap<String, Duration>>>,
}

/// A running stand-in model.
pub struct MockLlm {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl MockLlm {
    /// Serves `scenarios` on 127.0.0.1 (a free port), recording every request body.
    pub async fn start(scenarios: impl Into<Scenarios>) -> std::io::Result<Self> {
        Self::start_with(scenarios.into(), true).await
    }

    /// Like [`MockLlm::start`] without recording requests and without the prefix cache (for
    /// load: memory and the cost of a request stay flat).
    pub async fn start_unrecorded(scenarios: impl Into<Scenarios>) -> std::io::Result<Self> {
        Self::start_with(scenarios.into(), false).await
    }

    /// Like [`MockLlm::start_unrecorded`], and measures the time it serves each conversation
    /// (keyed by its first user message): from a request's arrival to its stream's last byte,
    /// summed over the conversation's requests. A benchmark subtracts it from a run's wall time
    /// to get what the orchestrator added, without the model's own timer lateness.
    pub async fn start_timed(scenarios: impl Into<Scenarios>) -> std::io::Result<Self> {
        let shared = Shared {
            scenarios: scenarios.into(),
            served: Some(Mutex::default()),
            ..Shared::default()
        };
        Self::start_shared(shared).await
    }

    /// Like [`MockLlm::start`], on `addr` (e.g. one of several loopback addresses on one port,
    /// as pods behind one headless Service).
    pub async fn start_on(addr: SocketAddr, scenarios: impl Into<Scenarios>) -> std::io::Result<Self> {
        let shared = Shared {
            scenarios: scenarios.into(),
            record: true,
            cache: Some(PrefixCache::default()),
            ..Shared::default()
        };
        Self::start_at(addr, shared).await
    }

    async fn start_with(scenarios: Scenarios, record: bool) -> std::io::Result<Self> {
        Self::start_shared(Shared {
            scenarios,
            record,
            cache: record.then(PrefixCache::default),
            ..Shared::default()
        })
        .await
    }

    async fn start_shared(shared: Shared) -> std::io::Result<Self> {
        Self::start_at(SocketAddr::from(([127, 0, 0, 1], 0)), shared).await
    }

    async fn start_at(addr: SocketAddr, shared: Shared) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(shared);
        let app = router(Arc::clone(&shared));
        let task = tokio::spawn(async move {
            let _ = axum::serve(nodelay(listener), app).await;
        });
        Ok(Self { addr, shared, task })
    }

    /// Where it listens (a front or a proxy put before it connects here).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The OpenAI-style base URL, ending in `/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The time served per conversation since the last call (empty unless started with
    /// [`MockLlm::start_timed`]); clears the tally.
    pub fn take_served(&self) -> HashMap<String, Duration> {
        self.shared
            .served
            .as_ref()
            .map_or_else(HashMap::new, |served| std::mem::take(&mut *shared::sync::lock(served)))
    }

    /// Every request body received so far.
    pub fn requests(&self) -> Vec<Value> {
        shared::sync::lock(&self.shared.requests).clone()
    }

    /// Every request body received so far, byte for byte as it came.
    pub fn raw_requests(&self) -> Vec<Bytes> {
        shared::sync::lock(&self.shared.raw_requests).clone()
    }
}

impl Drop for MockLlm {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `scenarios` on `listener` until `shutdown` resolves (used by the binary; requests are
/// not recorded).
pub async fn serve(
    listener: tokio::net::TcpListener,
    scenarios: Scenarios,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let shared = Arc::new(Shared {
        scenarios,
        cache: Some(PrefixCache::default()),
        ..Shared::default()
    });
    axum::serve(listener, router(shared))
        .with_graceful_shutdown(shutdown)
        .await
}

/// Sends small SSE chunks at once (no Nagle delay), as a real streaming server does.
fn nodelay(listener: tokio::net::TcpListener) -> impl axum::serve::Listener<Addr = SocketAddr> {
    use axum::serve::ListenerExt;
    listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    })
}

/// The largest request body taken: a real server takes long conversations and large tool lists
/// (axum's own default, 2 MB, would refuse them).
const MAX_REQUEST_BYTES: usize = 64 * 1024 * 1024;

fn router(shared: Arc<Shared>) -> axum::Router {
    axum::Router::new()
        .route("/v1/chat/completions", post(completions))
        .route("/v1/responses", post(responses))
        .route("/v1/models", get(models))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .with_state(shared)
}

async fn models(State(shared): State<Arc<Shared>>) -> Json<Value> {
    let mut names: Vec<&String> = shared.scenarios.named.keys().collect();
    names.sort();
    Json(
        json!({"object": "list", "data": names.iter().map(|n| json!({"id": n, "object": "model", "owned_by": "mock-llm"})).collect::<Vec<_>>()}),
    )
}

fn error_response(status: StatusCode, message: &str) -> Response {
    (
        status,
        Json(json!({"error": {"message": message, "type": "mock_error", "code": status.as_u16()}})),
    )
        .into_response()
}

async fn completions(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    play(&shared, &body, Api::ChatCompletions)
}

async fn responses(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    play(&shared, &body, Api::Responses)
}

/// The two streaming APIs a scenario is played through.
#[derive(Clone, Copy)]
enum Api {
    /// `POST /v1/chat/completions`: the conversation in `messages`.
    ChatCompletions,
    /// `POST /v1/responses`: the conversation in `input`.
    Responses,
}

impl Api {
    /// The conversation's items.
    fn conversation(self, request: &Value) -> &[Value] {
        let field = match self {
            Self::ChatCompletions => "messages",
            Self::Responses => "input",
        };
        request[field].as_array().map_or(&[], Vec::as_slice)
    }

    /// How many answers the conversation already holds: the turn to play next.
    fn answered(self, request: &Value) -> usize {
        match self {
            Self::ChatCompletions => self
                .conversation(request)
                .iter()
                .filter(|m| m["role"] == "assistant")
                .count(),
            Self::Responses => crate::responses::assistant_turns(request),
        }
    }

    /// The prompt of `request` (its body `body`) as the prefix cache serves it. The Responses
    /// API's prompt, and any prompt when the cache is off, is counted but not cached.
    fn prompt(self, shared: &Shared, body: &[u8], request: &Value) -> Lookup {
        match (self, &shared.cache) {
            (Self::ChatCompletions, Some(cache)) => cache.serve(prompt_of(body)),
            _ => {
                let chars: usize = self.conversation(request).iter().map(|m| m.to_string().len()).sum();
                Lookup {
                    prompt_tokens: (chars / crate::prefix_cache::BYTES_PER_TOKEN) as u64,
                    cached_tokens: 0,
                }
            }
        }
    }

    fn render(self, turn: &Turn, model: &str, turn_number: usize, prompt: Lookup) -> Option<Vec<Piece>> {
        match self {
            Self::ChatCompletions => Some(render(turn, model, turn_number, prompt)),
            Self::Responses => crate::responses::playable(turn)
                .then(|| crate::responses::render(turn, model, turn_number, prompt.prompt_tokens)),
        }
    }
}

/// Plays the scenario's next turn of the conversation in `body` through `api`.
fn play(shared: &Arc<Shared>, body: &[u8], api: Api) -> Response {
    let arrived = Instant::now();
    let Ok(request) = serde_json::from_slice::<Value>(body) else {
        return error_response(StatusCode::BAD_REQUEST, "the request body is not JSON");
    };
    if shared.record {
        shared::sync::lock(&shared.requests).push(request.clone());
        shared::sync::lock(&shared.raw_requests).push(Bytes::copy_from_slice(body));
    }
    if request["stream"] != true {
        return error_response(
            StatusCode::BAD_REQUEST,
            "mock-llm only serves streaming requests (stream: true)",
        );
    }
    let model = request["model"].as_str().unwrap_or_default().to_owned();
    let scenario = shared.scenarios.named.get(&model).unwrap_or(&shared.scenarios.default);
    let answered = api.answered(&request);
    let fallback = Turn::text("(mock-llm: the scenario has no more turns.)");
    let turn = within_max_tokens(scenario.turn(answered).unwrap_or(&fallback).clone(), &request);
    if let Some(refusal) = scripted_failure(shared, &model, answered, &turn) {
        return refusal;
    }
    let prompt = api.prompt(shared, body, &request);
    let Some(chunks) = api.render(&turn, &model, answered + 1, prompt) else {
        return error_response(
            StatusCode::BAD_REQUEST,
            "a recorded chat-completions stream cannot be played through /v1/responses",
        );
    };
    let prefill = Duration::from_micros(scenario.prefill_us_per_token.saturating_mul(prompt.uncached_tokens()));
    let pace = (
        Duration::from_millis(scenario.ttft_ms) + prefill,
        Duration::from_millis(scenario.token_delay_ms),
    );
    let key = first_user_text(api.conversation(&request));
    let stream = paced(chunks, pace).chain(tally_when_sent(shared, key, arrived));
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| error_response(StatusCode::INTERNAL_SERVER_ERROR, "cannot build the response"))
}

/// `turn` as a server plays it for a request with `max_tokens`: no more completion tokens than
/// that in its scripted usage, as a real server stops there.
fn within_max_tokens(mut turn: Turn, request: &Value) -> Turn {
    if let (Some([prompt, completion]), Some(max)) = (turn.usage, request["max_tokens"].as_u64()) {
        turn.usage = Some([prompt, completion.min(max)]);
    }
    turn
}

/// The first user message's text: the key a conversation's served time is tallied under.
fn first_user_text(conversation: &[Value]) -> String {
    conversation
        .iter()
        .find(|m| m["role"] == "user")
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_owned()
}

/// The scripted HTTP error for this attempt at a turn (`fail_first`), if any: attempts are
/// counted per model and conversation length, so a retry of the same turn gets the next entry.
fn scripted_failure(shared: &Shared, model: &str, assistant_messages: usize, turn: &Turn) -> Option<Response> {
    let attempt = {
        let mut attempts = shared::sync::lock(&shared.attempts);
        let n = attempts.entry((model.to_owned(), assistant_messages)).or_insert(0);
        *n += 1;
        *n - 1
    };
    let status = *turn.fail_first.get(attempt)?;
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    Some(error_response(
        status,
        &format!("scripted failure (attempt {})", attempt + 1),
    ))
}

/// The pieces as a byte stream at the scenario's pace: the first after `ttft`, each next one
/// `gap` later; scripted delays, stalls and cuts happen where they are.
fn paced(
    chunks: Vec<Piece>,
    (ttft, gap): (Duration, Duration),
) -> impl futures::Stream<Item = std::io::Result<Bytes>> + Send + 'static {
    futures::stream::iter(chunks.into_iter().enumerate()).then(move |(i, piece)| async move {
        let wait = if i == 0 { ttft } else { gap };
        if !wait.is_zero() && !matches!(piece, Piece::Delay(_)) {
            tokio::time::sleep(wait).await;
        }
        match piece {
            Piece::Bytes(b) => Ok(Bytes::from(b)),
            Piece::Delay(d) => {
                tokio::time::sleep(d).await;
                Ok(Bytes::new())
            }
            Piece::Stall => std::future::pending().await,
            Piece::Cut => {
                // Let what was sent before reach the client, as it would on a real network.
                tokio::time::sleep(Duration::from_millis(100)).await;
                Err(std::io::Error::other("mock-llm: scripted cut"))
            }
        }
    })
}

/// An empty stream that, when timed, adds the time since `arrived` to the conversation's tally
/// (under `key`, its first user message) once the response before it has been sent.
fn tally_when_sent(
    shared: &Arc<Shared>,
    key: String,
    arrived: Instant,
) -> impl futures::Stream<Item = std::io::Result<Bytes>> + Send + 'static {
    let timing = shared.served.is_some().then(|| (Arc::clone(shared), key));
    futures::stream::once(async move {
        if let Some((shared, key)) = timing
            && let Some(served) = &shared.served
        {
            *shared::sync::lock(served).entry(key).or_default() += arrived.elapsed();
        }
    })
    .filter_map(|()| std::future::ready(None::<std::io::Result<Bytes>>))
}

fn chunk(model: &str, delta: Value, finish_reason: Option<&str>) -> Piece {
    let body = json!({
        "id": "chatcmpl-mock",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    });
    Piece::Bytes(format!("data: {body}\n\n"))
}

fn render(turn: &Turn, model: &str, turn_number: usize, prompt: Lookup) -> Vec<Piece> {
    let mut out = Vec::new();
    let replay = turn.steps.iter().any(|s| matches!(s, Step::Raw { .. }));
    if !replay {
        out.push(chunk(model, json!({"role": "assistant", "content": ""}), None));
    }
    let (mut calls, mut completion_chars) = (0usize, 0usize);
    for step in &turn.steps {
        match step {
            Step::Text { text, chunk_chars } => {
                completion_chars += text.len();
                out.extend(
                    split_text(text, *chunk_chars)
                        .into_iter()
                        .map(|t| chunk(model, json!({"content": t}), None)),
                );
            }
            Step::Reasoning { text } => {
                out.extend(
                    split_text(text, None)
                        .into_iter()
                        .map(|t| chunk(model, json!({"reasoning_content": t}), None)),
                );
            }
            Step::ToolCall { .. } => {
                completion_chars += tool_call(step, model, turn_number, calls, &mut out);
                calls += 1;
            }
            Step::Delay { ms } => out.push(Piece::Delay(Duration::from_millis(*ms))),
            Step::Cut => {
                out.push(Piece::Cut);
                return out;
            }
            Step::Stall => {
                out.push(Piece::Stall);
                return out;
            }
            Step::Raw { sse } => out.push(Piece::Bytes(sse.clone())),
            Step::Error { message } => {
                out.push(Piece::Bytes(format!(
                    "data: {}\n\n",
                    json!({"error": {"message": message, "code": 500}})
                )));
            }
        }
    }
    if !replay {
        out.extend(ending(turn, model, calls, prompt, completion_chars));
    }
    if turn.done {
        out.push(Piece::Bytes("data: [DONE]\n\n".to_owned()));
    }
    out
}

/// The chunks of the `index`th tool call of a turn, as servers stream them: the id and name
/// first, then the arguments in `fragments` pieces. Returns the arguments' length.
fn tool_call(step: &Step, model: &str, turn_number: usize, index: usize, out: &mut Vec<Piece>) -> usize {
    let Step::ToolCall {
        name,
        arguments,
        id,
        fragments,
    } = step
    else {
        return 0;
    };
    let id = id.clone().unwrap_or_else(|| format!("call_{turn_number}_{index}"));
    let args = match arguments {
        Value::String(raw) => raw.clone(),
        other => other.to_string(),
    };
    out.push(chunk(
        model,
        json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
        None,
    ));
    for piece in split_n(&args, fragments.unwrap_or(3)) {
        out.push(chunk(
            model,
            json!({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}),
            None,
        ));
    }
    args.len()
}

/// The end of a turn: the finish reason (scripted, else `tool_calls` or `stop`) and the usage
/// chunk (scripted, else about four characters a token), with the prompt tokens the prefix
/// cache held.
fn ending(turn: &Turn, model: &str, calls: usize, prompt: Lookup, completion_chars: usize) -> [Piece; 2] {
    let finish = turn
        .finish_reason
        .clone()
        .unwrap_or_else(|| if calls > 0 { "tool_calls" } else { "stop" }.to_owned());
    let [prompt_tokens, completion] = turn
        .usage
        .unwrap_or([prompt.prompt_tokens, (completion_chars / 4).max(1) as u64]);
    let cached = prompt.cached_tokens.min(prompt_tokens);
    let usage = json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": model, "choices": [],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}});
    [
        chunk(model, json!({}), Some(&finish)),
        Piece::Bytes(format!("data: {usage}\n\n")),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_splits_into_words_keeping_whitespace() {
        assert_eq!(split_text("Hello  big\nworld", None), vec!["Hello  ", "big\n", "world"]);
        assert_eq!(split_text("abcde", Some(2)), vec!["ab", "cd", "e"]);
        assert_eq!(split_n("{\"a\":1}", 3).concat(), "{\"a\":1}");
    }
}
