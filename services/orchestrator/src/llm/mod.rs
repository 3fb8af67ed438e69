//! The LLM client: any OpenAI-compatible `/v1/chat/completions` server, streamed.
//!
//! * [`fleet`]: the model endpoints, which one each run's turns go to, failover and health;
//! * [`client`]: the HTTP side of one endpoint (API key, extra headers, what is worth a retry,
//!   idle timeout); a plain-http endpoint's connections are read by the run's own task (the
//!   `paced-http1` crate, whose [`ReadPace`] a run sets);
//! * [`body`]: the request's JSON body, each turn's written from what is new in it;
//! * [`sse`]: bytes → SSE events → semantic [`LlmEvent`]s, tolerant of the differences between
//!   real servers (see `tests/fixtures/llm-streams/`);
//! * [`assembler`]: tool-call fragments → whole tool calls;
//!
//! The run loop only sees the [`ChatModel`] trait, so it is tested without a network.

pub mod assembler;
pub mod body;
pub mod client;
pub mod fleet;
pub mod sse;

use futures::future::BoxFuture;
use futures::stream::BoxStream;

use crate::domain::chat::{Message, ToolDefinition, Usage};
use crate::domain::params::SamplingParams;
pub use client::HttpLlm;
pub use fleet::Fleet;
pub use paced_http1::ReadPace;

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
    /// The run's requests' serialized beginning, shared by its turns (a fresh one: the body is
    /// written whole).
    pub prefix: body::WirePrefix,
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
