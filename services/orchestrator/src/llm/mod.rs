//! The LLM client: any OpenAI-compatible `/v1/chat/completions` server, streamed.
//!
//! * [`fleet`]: the model endpoints, which one each run's turns go to, failover and health;
//! * [`client`]: the HTTP side of one endpoint (request body, API key, extra headers, what is
//!   worth a retry, idle timeout), with `direct`: connections read by the run's own task;
//! * [`sse`]: bytes → SSE events → semantic [`LlmEvent`]s, tolerant of the differences between
//!   real servers (see `tests/fixtures/llm-streams/`);
//! * [`assembler`]: tool-call fragments → whole tool calls;
//!
//! The run loop only sees the [`ChatModel`] trait, so it is tested without a network.

pub mod assembler;
pub mod client;
mod direct;
mod hyper_reader;
pub mod fleet;
pub mod sse;

use std::sync::atomic::Ordering::Relaxed;

use futures::future::BoxFuture;
use futures::stream::BoxStream;

pub use crate::domain::chat::{Message, ToolCall, ToolDefinition, Usage};
pub use crate::domain::params::{SamplingParams, ToolChoice};
pub use client::HttpLlm;
pub use fleet::Fleet;

/// One streamed chat completion request.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// Model name.
    pub model: String,
    /// The conversation.
    pub messages: Vec<Message>,
    /// Tools offered (normal and exit), shared by every turn of the run (their schemas can be
    /// large, and a run held open should not keep one copy per request).
    pub tools: std::sync::Arc<[ToolDefinition]>,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// Set by the reader while it reads the stream only on its ticks.
    pub pace: ReadPace,
    /// What keeps a run's turns on one model endpoint, whose prefix cache holds its transcript:
    /// the run id, or a key the caller chose (e.g. a conversation id).
    pub affinity: String,
    /// An endpoint to try only when no other will do: it just cut this turn's stream.
    pub avoid: Option<String>,
}

/// Whether a completion's reader reads it only on its stream interval's ticks (shared between
/// the reader and the connection). While it does, the connection's socket need not wake anyone
/// for each chunk that arrives: the reader takes them all at the next tick; and once a tick's
/// read found the socket drained, it is not read again before the next tick.
#[derive(Debug, Clone, Default)]
pub struct ReadPace(std::sync::Arc<PaceState>);

#[derive(Debug, Default)]
struct PaceState {
    ticking: std::sync::atomic::AtomicBool,
    /// Ticks the reader has woken on.
    ticks: std::sync::atomic::AtomicU64,
    /// `ticks` + 1 when the socket was last found drained (0: never).
    drained: std::sync::atomic::AtomicU64,
}

impl ReadPace {
    /// The reader now reads only on its ticks (`true`), or waits for the next chunk (`false`).
    pub fn set_ticking(&self, ticking: bool) {
        self.0.ticking.store(ticking, Relaxed);
    }

    /// Whether the reader reads only on its ticks.
    pub fn ticking(&self) -> bool {
        self.0.ticking.load(Relaxed)
    }

    /// The reader woke on a tick: the socket is worth reading again.
    pub fn ticked(&self) {
        self.0.ticks.fetch_add(1, Relaxed);
    }

    /// Ticks the reader has woken on.
    pub fn ticks(&self) -> u64 {
        self.0.ticks.load(Relaxed)
    }

    /// The connection read everything the socket held (a short read, or none).
    pub fn drained(&self) {
        self.0.drained.store(self.0.ticks.load(Relaxed) + 1, Relaxed);
    }

    /// Whether the socket was found drained since the reader's last tick: what arrives after
    /// waits for the next one.
    pub fn drained_this_tick(&self) -> bool {
        self.ticking() && self.0.drained.load(Relaxed) == self.0.ticks.load(Relaxed) + 1
    }
}

/// A hint between reader and connection, not part of what is asked: any two are equal.
impl PartialEq for ReadPace {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// What the stream says, independent of any server's quirks.
#[derive(Debug, Clone, PartialEq)]
pub enum LlmEvent {
    /// User-visible text.
    TextDelta(String),
    /// Reasoning text (`reasoning_content` / `reasoning`); not user-visible output.
    ReasoningDelta(String),
    /// A piece of a tool call.
    ToolCallFragment {
        /// `index` as sent (absent on some servers).
        index: Option<u32>,
        /// `id` when sent.
        id: Option<String>,
        /// `function.name` (or a piece of it) when sent.
        name: Option<String>,
        /// A piece of `function.arguments`.
        arguments: Option<String>,
    },
    /// Token usage (the last one seen wins: some servers send it on every chunk).
    Usage(Usage),
    /// The choice's `finish_reason`.
    Finish(String),
    /// `data: [DONE]`.
    Done,
}

/// Why a completion could not be (fully) streamed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LlmError {
    /// No byte arrived for longer than the idle timeout.
    #[error("the LLM stream sent nothing for {0}")]
    Stalled(String),
    /// The server could not be reached or answered with an HTTP error (after retries).
    #[error("{0}")]
    Http(String),
    /// The server reported an error inside the stream.
    #[error("the LLM server reported an error: {0}")]
    Server(String),
    /// The stream broke off or could not be understood.
    #[error("{0}")]
    Protocol(String),
    /// One endpoint of several cut the stream after it sent events (it broke off or went
    /// quiet): the turn may start again on another.
    #[error("{error} (from the model server at {endpoint})")]
    Cut {
        /// The endpoint, as logs show it.
        endpoint: String,
        /// What happened.
        error: Box<LlmError>,
    },
}

impl LlmError {
    /// The error itself, without the endpoint that cut the stream.
    pub fn cause(&self) -> &LlmError {
        match self {
            Self::Cut { error, .. } => error.cause(),
            other => other,
        }
    }
}

/// A source of streamed chat completions (the real HTTP client, or a scripted one in tests).
pub trait ChatModel: Send + Sync + 'static {
    /// Starts a completion; the stream yields events until the completion ends or fails.
    fn stream(
        &self,
        request: ChatRequest,
    ) -> BoxFuture<'static, Result<BoxStream<'static, Result<LlmEvent, LlmError>>, LlmError>>;
}
