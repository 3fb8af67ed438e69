//! Server-sent events → [`LlmEvent`]s.
//!
//! Layers, outermost first:
//! 1. a byte guard: the idle timeout (any byte, keep-alive comments included, is progress), caps
//!    on the length of one line and of one event (all its lines up to the blank line that ends
//!    it), so neither an endless line nor an event that never ends can grow memory, and
//!    reads cut after each blank line, so the framer's buffer holds one event at a time (it
//!    copies what follows each line it takes: a read carrying a whole stream cost ~1.6× per event);
//! 2. SSE framing by `eventsource-stream` (comments skipped, multi-line data joined);
//! 3. each `data:` payload decoded as a `chat.completion.chunk`, tolerating what real servers
//!    send (missing `index`, `null` fields, usage-only chunks, `reasoning_content`, errors inside
//!    chunks or as `event: error`).

use std::collections::VecDeque;
use std::fmt::Display;
use std::future::Future as _;
use std::time::Duration;

use bytes::Bytes;
use eventsource_stream::{EventStreamError, Eventsource};
use futures::stream::{BoxStream, Stream, StreamExt};
use serde::Deserialize;

use crate::domain::chat::Usage;
use crate::domain::model::{LlmError, LlmEvent};

/// Limits applied while decoding a stream.
#[derive(Debug, Clone, Copy)]
pub struct DecodeLimits {
    /// Longest time without a byte before the stream counts as stalled.
    pub idle_timeout: Duration,
    /// Longest line (one SSE field) accepted, in bytes.
    pub max_line_bytes: usize,
    /// Largest event (its lines up to the blank line that ends it) accepted, in bytes.
    pub max_event_bytes: usize,
}

/// Decodes an SSE byte stream into semantic events. Ends after `[DONE]`, at the end of the body,
/// or with one error item.
pub fn decode<S, E>(bytes: S, limits: DecodeLimits) -> BoxStream<'static, Result<LlmEvent, LlmError>>
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: Display + Send + 'static,
{
    let guarded = guard(bytes.boxed(), limits);
    let events = guarded.eventsource();
    let state = DecodeState {
        events: Box::pin(events),
        pending: VecDeque::new(),
        seen_data: false,
        finished: false,
    };
    futures::stream::unfold(state, |mut state| async move {
        loop {
            if let Some(item) = state.pending.pop_front() {
                if item.is_err() {
                    state.finished = true;
                }
                return Some((item, state));
            }
            if state.finished {
                return None;
            }
            match state.events.next().await {
                None => {
                    state.finished = true;
                    if !state.seen_data {
                        state.pending.push_back(Err(LlmError::Protocol(
                            "the LLM server's response contained no SSE data (is this an OpenAI-compatible streaming endpoint?)"
                                .into(),
                        )));
                    }
                }
                Some(Err(e)) => state.pending.push_back(Err(stream_error(e))),
                Some(Ok(event)) => {
                    state.seen_data = true;
                    if event.event == "error" {
                        state.pending.push_back(Err(LlmError::Server(error_message(&event.data))));
                    } else if event.data.trim() == "[DONE]" {
                        state.pending.push_back(Ok(LlmEvent::Done));
                        state.finished = true;
                    } else {
                        match parse_chunk(&event.data) {
                            Ok(events) => state.pending.extend(events.into_iter().map(Ok)),
                            Err(e) => state.pending.push_back(Err(e)),
                        }
                    }
                }
            }
        }
    })
    .boxed()
}

type SseEvents =
    std::pin::Pin<Box<dyn Stream<Item = Result<eventsource_stream::Event, EventStreamError<LlmError>>> + Send>>;

struct DecodeState {
    events: SseEvents,
    pending: VecDeque<Result<LlmEvent, LlmError>>,
    seen_data: bool,
    finished: bool,
}

fn stream_error(e: EventStreamError<LlmError>) -> LlmError {
    match e {
        EventStreamError::Transport(e) => e,
        EventStreamError::Utf8(e) => LlmError::Protocol(format!("the LLM stream is not UTF-8: {e}")),
        EventStreamError::Parser(e) => LlmError::Protocol(format!("the LLM stream is not valid SSE: {e}")),
    }
}

struct GuardState {
    bytes: BoxStream<'static, Result<Bytes, LlmError>>,
    sizes: Sizes,
    ended: bool,
    /// The rest of the last read, event by event.
    cut: VecDeque<Bytes>,
    /// One timer for the whole stream, pushed back only when it fires early: a timer armed and
    /// dropped for every read cost two trips through the runtime's timer wheel per token.
    idle: std::pin::Pin<Box<tokio::time::Sleep>>,
    last_read: tokio::time::Instant,
}

impl GuardState {
    /// The next piece of the last read, counted against the caps event by event, so the events
    /// before a line or an event that is too large still pass, however the reads were cut.
    fn next_piece(&mut self, limits: DecodeLimits) -> Option<Result<Bytes, LlmError>> {
        let piece = self.cut.pop_front()?;
        if let Err(message) = self.sizes.take(&piece, limits) {
            self.ended = true;
            self.cut.clear();
            return Some(Err(LlmError::Protocol(message)));
        }
        Some(Ok(piece))
    }

    /// The next read, or `Stalled` once nothing was read for `idle_timeout`.
    async fn next_read(&mut self, idle_timeout: Duration) -> Result<Option<Result<Bytes, LlmError>>, LlmError> {
        std::future::poll_fn(|cx| {
            if let std::task::Poll::Ready(read) = self.bytes.poll_next_unpin(cx) {
                self.last_read = tokio::time::Instant::now();
                return std::task::Poll::Ready(Ok(read));
            }
            loop {
                std::task::ready!(self.idle.as_mut().poll(cx));
                let due = self.last_read + idle_timeout;
                if tokio::time::Instant::now() >= due {
                    let waited = humantime::format_duration(idle_timeout).to_string();
                    return std::task::Poll::Ready(Err(LlmError::Stalled(waited)));
                }
                self.idle.as_mut().reset(due);
            }
        })
        .await
    }
}

/// Cuts `chunk` after each `\n\n` (the end of an event, as servers send them), without copying,
/// and queues the pieces in order.
fn cut_events(mut chunk: Bytes, into: &mut VecDeque<Bytes>) {
    let whole = chunk.clone();
    let mut taken = 0;
    for end in memchr::memmem::find_iter(&whole, b"\n\n").map(|at| at + 2) {
        if end < whole.len() {
            into.push_back(chunk.split_to(end - taken));
            taken = end;
        }
    }
    into.push_back(chunk);
}

/// The size of the line and of the event being read.
#[derive(Debug, Default)]
struct Sizes {
    /// Bytes of the current line so far (its `\n` excluded).
    line: usize,
    /// The current line so far is a lone `\r` (a blank line in CRLF streams).
    line_is_cr: bool,
    /// Bytes of the current event's finished lines.
    event: usize,
}

impl Sizes {
    /// Counts `chunk`; an error when a line or an event grows past its cap, wherever the chunk
    /// boundaries fall (a whole line inside one chunk is checked as it ends).
    fn take(&mut self, chunk: &[u8], limits: DecodeLimits) -> Result<(), String> {
        let mut from = 0;
        for at in memchr::memchr_iter(b'\n', chunk) {
            self.extend(&chunk[from..at]);
            self.check(limits)?;
            if self.line == 0 || self.line_is_cr {
                self.event = 0;
            } else {
                self.event += self.line + 1;
            }
            (self.line, self.line_is_cr) = (0, false);
            from = at + 1;
        }
        self.extend(&chunk[from..]);
        self.check(limits)
    }

    /// The line and the event so far within their caps.
    fn check(&self, limits: DecodeLimits) -> Result<(), String> {
        if self.line > limits.max_line_bytes {
            return Err(format!(
                "the LLM stream sent a line longer than {} bytes",
                limits.max_line_bytes
            ));
        }
        if self.event + self.line > limits.max_event_bytes {
            return Err(format!(
                "the LLM stream sent an event larger than {} bytes (lines without the blank line that ends an event)",
                limits.max_event_bytes
            ));
        }
        Ok(())
    }

    fn extend(&mut self, piece: &[u8]) {
        self.line_is_cr = (self.line == 0 && piece == b"\r") || (self.line_is_cr && piece.is_empty());
        self.line += piece.len();
    }
}

/// The byte guard: idle timeout, line-length cap, and a final blank line so an unterminated last
/// event is still dispatched.
fn guard<E: Display + Send + 'static>(
    bytes: BoxStream<'static, Result<Bytes, E>>,
    limits: DecodeLimits,
) -> impl Stream<Item = Result<Bytes, LlmError>> + Send + 'static {
    let bytes = bytes
        .map(|r| r.map_err(|e| LlmError::Protocol(format!("the LLM stream broke off: {e}"))))
        .boxed();
    let state = GuardState {
        bytes,
        sizes: Sizes::default(),
        ended: false,
        cut: VecDeque::new(),
        idle: Box::pin(tokio::time::sleep(limits.idle_timeout)),
        last_read: tokio::time::Instant::now(),
    };
    futures::stream::unfold(state, move |mut state| async move {
        if let Some(piece) = state.next_piece(limits) {
            return Some((piece, state));
        }
        if state.ended {
            return None;
        }
        match state.next_read(limits.idle_timeout).await {
            Err(stalled) => {
                state.ended = true;
                Some((Err(stalled), state))
            }
            Ok(None) => {
                state.ended = true;
                Some((Ok(Bytes::from_static(b"\n\n")), state))
            }
            Ok(Some(Err(e))) => {
                state.ended = true;
                Some((Err(e), state))
            }
            Ok(Some(Ok(chunk))) => {
                cut_events(chunk, &mut state.cut);
                let piece = state.next_piece(limits).unwrap_or_else(|| Ok(Bytes::new()));
                Some((piece, state))
            }
        }
    })
}

#[derive(Debug, Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Option<Vec<Choice>>,
    #[serde(default)]
    usage: Option<RawUsage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
    #[serde(default)]
    x_groq: Option<XGroq>,
    /// llama.cpp's server: its own account of the prompt, sent with the last chunk.
    #[serde(default)]
    timings: Option<Timings>,
}

#[derive(Debug, Deserialize)]
struct Timings {
    /// Prompt tokens taken from the slot's cache.
    #[serde(default)]
    cache_n: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct XGroq {
    #[serde(default)]
    usage: Option<RawUsage>,
}

#[derive(Debug, Deserialize)]
struct Choice {
    #[serde(default)]
    index: Option<u32>,
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    reasoning: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Deserialize)]
struct ToolCallDelta {
    #[serde(default)]
    index: Option<u32>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<FunctionDelta>,
}

#[derive(Debug, Deserialize)]
struct FunctionDelta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

#[derive(Debug, Deserialize)]
struct RawUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<PromptTokensDetails>,
}

/// OpenAI's, vLLM's and SGLang's breakdown of the prompt tokens.
#[derive(Debug, Deserialize)]
struct PromptTokensDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// Decodes one `data:` payload (a `chat.completion.chunk`) into events. Only `choices[0]` (the
/// choice with index 0) is looked at: the orchestrator always asks for one choice.
pub fn parse_chunk(data: &str) -> Result<Vec<LlmEvent>, LlmError> {
    let chunk: Chunk = serde_json::from_str(data).map_err(|e| {
        LlmError::Protocol(format!(
            "the LLM server sent an invalid chunk ({e}): {}",
            shared::text::excerpt(data)
        ))
    })?;
    if let Some(error) = chunk.error.filter(|e| !e.is_null()) {
        return Err(LlmError::Server(describe_error(&error)));
    }
    // The strings are moved out of the parsed chunk, not copied: this runs once per token.
    let mut events = Vec::new();
    let choice = chunk
        .choices
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.index.unwrap_or(0) == 0);
    if let Some(choice) = choice {
        if let Some(delta) = choice.delta {
            for reasoning in [delta.reasoning_content, delta.reasoning].into_iter().flatten() {
                if !reasoning.is_empty() {
                    events.push(LlmEvent::ReasoningDelta(reasoning));
                }
            }
            if let Some(text) = delta.content.filter(|t| !t.is_empty()) {
                events.push(LlmEvent::TextDelta(text));
            }
            for call in delta.tool_calls.into_iter().flatten() {
                let (name, arguments) = call.function.map_or((None, None), |f| (f.name, f.arguments));
                events.push(LlmEvent::ToolCallFragment {
                    index: call.index,
                    id: call.id.filter(|s| !s.is_empty()),
                    name: name.filter(|s| !s.is_empty()),
                    arguments: arguments.filter(|s| !s.is_empty()),
                });
            }
        }
        if let Some(reason) = choice.finish_reason.filter(|r| !r.is_empty()) {
            events.push(LlmEvent::Finish(reason));
        }
    }
    let usage = chunk.usage.or(chunk.x_groq.and_then(|x| x.usage));
    if let Some(usage) = usage.filter(|u| u.prompt_tokens.is_some() || u.completion_tokens.is_some()) {
        let details = usage.prompt_tokens_details.and_then(|d| d.cached_tokens);
        let cached = details.or(chunk.timings.and_then(|t| t.cache_n)).unwrap_or(0);
        events.push(LlmEvent::Usage(Usage {
            prompt_tokens: usage.prompt_tokens.unwrap_or(0),
            completion_tokens: usage.completion_tokens.unwrap_or(0),
            cached_prompt_tokens: cached,
        }));
    }
    Ok(events)
}

/// The readable part of an error payload: `{"error": {...}}`, `{...}` or plain text.
fn error_message(data: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(data) {
        Ok(value) => describe_error(value.get("error").unwrap_or(&value)),
        Err(_) => shared::text::excerpt(data),
    }
}

fn describe_error(error: &serde_json::Value) -> String {
    let message = error.get("message").and_then(|m| m.as_str());
    let code = error
        .get("code")
        .filter(|c| !c.is_null())
        .map(|c| c.as_str().map_or_else(|| c.to_string(), str::to_owned));
    match (message, code) {
        (Some(m), Some(c)) => format!("{m} (code {c})"),
        (Some(m), None) => m.to_owned(),
        _ => shared::text::excerpt(&error.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> DecodeLimits {
        DecodeLimits {
            idle_timeout: Duration::from_secs(5),
            max_line_bytes: 64,
            max_event_bytes: 256,
        }
    }

    /// Limits no well-formed test stream reaches.
    fn roomy() -> DecodeLimits {
        DecodeLimits {
            max_line_bytes: 4096,
            max_event_bytes: 8192,
            ..limits()
        }
    }

    async fn decode_all(parts: Vec<&'static str>, limits: DecodeLimits) -> Vec<Result<LlmEvent, LlmError>> {
        let stream = futures::stream::iter(parts.into_iter().map(|p| Ok::<_, std::io::Error>(Bytes::from(p))));
        decode(stream, limits).collect().await
    }

    #[test]
    fn cached_prompt_tokens_are_read_from_the_details_or_llama_cpps_timings() {
        let usage = |data: &str| match parse_chunk(data) {
            Ok(events) => events.into_iter().find_map(|e| match e {
                LlmEvent::Usage(u) => Some(u),
                _ => None,
            }),
            Err(e) => panic!("{e}"),
        };
        let openai = r#"{"choices":[],"usage":{"prompt_tokens":1200,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":1024}}}"#;
        let llama_cpp = r#"{"choices":[],"usage":{"prompt_tokens":300,"completion_tokens":5},"timings":{"cache_n":280,"prompt_n":20}}"#;
        let both = r#"{"choices":[],"usage":{"prompt_tokens":300,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":256}},"timings":{"cache_n":280}}"#;
        let none = r#"{"choices":[],"usage":{"prompt_tokens":300,"completion_tokens":5,"prompt_tokens_details":null}}"#;
        let cached = |data| usage(data).map(|u| (u.prompt_tokens, u.cached_prompt_tokens));
        assert_eq!(cached(openai), Some((1200, 1024)));
        assert_eq!(cached(llama_cpp), Some((300, 280)));
        assert_eq!(cached(both), Some((300, 256)), "the standard field wins");
        assert_eq!(cached(none), Some((300, 0)));
    }

    #[tokio::test]
    async fn text_finish_usage_and_done() {
        let events = decode_all(
            vec![
                ": keep-alive\n\ndata: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n",
                "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n",
            ],
            roomy(),
        )
        .await;
        assert_eq!(
            events,
            vec![
                Ok(LlmEvent::TextDelta("Hi".into())),
                Ok(LlmEvent::Finish("stop".into())),
                Ok(LlmEvent::Usage(Usage {
                    prompt_tokens: 3,
                    completion_tokens: 1,
                    cached_prompt_tokens: 0,
                })),
                Ok(LlmEvent::Done),
            ]
        );
    }

    #[tokio::test]
    async fn garbage_ends_with_one_clear_error() {
        let bad_json = decode_all(vec!["data: {not json}\n\n"], limits()).await;
        assert!(
            matches!(&bad_json[..], [Err(LlmError::Protocol(m))] if m.contains("invalid chunk")),
            "{bad_json:?}"
        );
        let wrong_type = decode_all(vec!["data: {\"choices\":[{\"delta\":{\"content\":5}}]}\n\n"], limits()).await;
        assert!(
            matches!(&wrong_type[..], [Err(LlmError::Protocol(_))]),
            "{wrong_type:?}"
        );
        let not_sse = decode_all(vec!["<html>502 Bad Gateway</html>"], limits()).await;
        assert!(
            matches!(&not_sse[..], [Err(LlmError::Protocol(m))] if m.contains("no SSE data")),
            "{not_sse:?}"
        );
        let error_event = decode_all(
            vec!["event: error\ndata: {\"error\":{\"message\":\"boom\",\"code\":\"x\"}}\n\n"],
            roomy(),
        )
        .await;
        assert_eq!(error_event, vec![Err(LlmError::Server("boom (code x)".into()))]);
    }

    #[tokio::test]
    async fn line_length_cap_on_both_sides() {
        let at_cap = decode_all(vec!["data: [DONE]", &*"          ".repeat(5).leak(), "\n\n"], limits()).await;
        assert_eq!(at_cap, vec![Ok(LlmEvent::Done)]);
        let endless = decode_all(vec!["data: ", &*"x".repeat(100).leak()], limits()).await;
        assert!(
            matches!(&endless[..], [Err(LlmError::Protocol(m))] if m.contains("longer than 64 bytes")),
            "{endless:?}"
        );
        // Found by the fuzz test: the events before a line that is too long pass however the
        // reads were cut (they were lost when both came in one read).
        let text = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n";
        let text_then_long: &'static str = format!("{text}data: {}\n\n", "x".repeat(100)).leak();
        let one_read = decode_all(vec![text_then_long], limits()).await;
        let two_reads = decode_all(
            vec![&text_then_long[..text.len()], &text_then_long[text.len()..]],
            limits(),
        )
        .await;
        assert!(
            matches!(&one_read[..], [Ok(LlmEvent::TextDelta(a)), Err(LlmError::Protocol(m))] if a == "a" && m.contains("longer than 64")),
            "{one_read:?}"
        );
        assert_eq!(one_read, two_reads);
        // Found by the fuzz test: a long line that ends inside the same read was not checked.
        let whole = decode_all(vec![&*format!("data: {}\n\n", "x".repeat(100)).leak()], limits()).await;
        assert!(
            matches!(&whole[..], [Err(LlmError::Protocol(m))] if m.contains("longer than 64 bytes")),
            "{whole:?}"
        );
    }

    #[tokio::test]
    async fn event_size_cap_on_both_sides() {
        // 32 lines of 8 bytes ("data: x\n" counts its newline): 256 bytes, then the blank line.
        let line = "data: x\n";
        let chunk = |text: &[u8]| {
            let mut sizes = Sizes::default();
            sizes.take(text, limits())
        };
        assert_eq!(chunk(line.repeat(32).as_bytes()), Ok(()), "at the cap");
        let past = chunk(format!("{}d", line.repeat(32)).as_bytes());
        assert!(past.is_err_and(|m| m.contains("larger than 256 bytes")));
        // Blank lines (LF or CRLF, split anywhere) end events, so a long stream of small events passes.
        let mut sizes = Sizes::default();
        for piece in ["data: x\r", "\n\r", "\n"].iter().cycle().take(3000) {
            assert_eq!(sizes.take(piece.as_bytes(), limits()), Ok(()));
        }
        // Through the decoder: data lines that never end their event.
        let endless = decode_all(vec![&*line.repeat(40).leak()], limits()).await;
        assert!(
            matches!(&endless[..], [Err(LlmError::Protocol(m))] if m.contains("larger than 256")),
            "{endless:?}"
        );
    }

    #[test]
    fn reads_are_cut_after_each_event_without_losing_a_byte() {
        let cut = |read: &'static str| {
            let mut pieces = VecDeque::new();
            cut_events(Bytes::from(read), &mut pieces);
            Vec::from(pieces)
        };
        assert_eq!(cut("data: a\n\n"), ["data: a\n\n"], "one event stays whole");
        assert_eq!(cut("data: a"), ["data: a"], "part of one too");
        assert_eq!(
            cut("data: a\n\ndata: b\n\n: ping\n\ndata: c"),
            ["data: a\n\n", "data: b\n\n", ": ping\n\n", "data: c"]
        );
        assert_eq!(cut("\n\n\n\nx"), ["\n\n", "\n\n", "x"]);
        assert_eq!(
            cut("data: a\r\n\r\ndata: b\r\n\r\n"),
            ["data: a\r\n\r\ndata: b\r\n\r\n"]
        );
    }

    #[tokio::test]
    async fn a_stream_without_bytes_stalls() {
        let stream = futures::stream::pending::<Result<Bytes, std::io::Error>>();
        let limits = DecodeLimits {
            idle_timeout: Duration::from_millis(50),
            max_line_bytes: 64,
            max_event_bytes: 256,
        };
        let events: Vec<_> = decode(stream, limits).collect().await;
        assert!(matches!(&events[..], [Err(LlmError::Stalled(_))]), "{events:?}");
    }

    /// Keep-alive comments every 30 ms for 300 ms, then nothing: with a 50 ms idle timeout the
    /// stream stalls 50 ms after its last byte, neither at the first timeout since it began nor
    /// later.
    #[tokio::test(start_paused = true)]
    async fn the_idle_timeout_counts_from_the_last_byte() {
        let keep_alives = futures::stream::unfold(0, |sent| async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            (sent < 10).then(|| {
                (
                    Ok::<_, std::io::Error>(Bytes::from_static(b": keep-alive\n\n")),
                    sent + 1,
                )
            })
        })
        .chain(futures::stream::pending());
        let limits = DecodeLimits {
            idle_timeout: Duration::from_millis(50),
            max_line_bytes: 64,
            max_event_bytes: 256,
        };
        let started = tokio::time::Instant::now();
        let events: Vec<_> = decode(keep_alives, limits).collect().await;
        assert!(matches!(&events[..], [Err(LlmError::Stalled(_))]), "{events:?}");
        // The tenth comment came at 300 ms, and the eleventh poll ended the keep-alives at 330.
        assert_eq!(started.elapsed(), Duration::from_millis(350));
    }
}
