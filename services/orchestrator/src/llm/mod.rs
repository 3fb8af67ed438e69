//! The LLM client: any OpenAI-compatible `/v1/chat/completions` server, streamed.
//!
//! * [`client`]: the HTTP side (request body, API key, extra headers, retries before the first
//!   byte, idle timeout);
//! * [`sse`]: bytes → SSE events → semantic [`LlmEvent`]s, tolerant of the differences between
//!   real servers (see `tests/fixtures/llm-streams/`);
//! * [`assembler`]: tool-call fragments → whole tool calls;
//! * [`params`]: the model parameters of a run and their rules.
//!
//! The run loop only sees the [`ChatModel`] trait, so it is tested without a network.

pub mod assembler;
pub mod client;
pub mod params;
pub mod sse;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use serde_json::Value;

pub use client::HttpLlm;
pub use params::{SamplingParams, ToolChoice};

/// One message of the conversation sent to the model.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// A system message (the BIOS, the caller's system message).
    System(String),
    /// A user message.
    User {
        /// Text.
        content: String,
        /// Optional participant name.
        name: Option<String>,
    },
    /// An assistant message, possibly with tool calls.
    Assistant {
        /// Text (may be empty).
        content: String,
        /// Tool calls it made.
        tool_calls: Vec<ToolCall>,
        /// The turn's reasoning, sent back as `reasoning_content` (only with `--llm-send-reasoning`).
        reasoning: Option<String>,
    },
    /// A tool result answering `tool_call_id`.
    Tool {
        /// The call answered.
        tool_call_id: String,
        /// The result (JSON text).
        content: String,
    },
}

/// A whole tool call, as the model made it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// Call id (generated when the server sent none).
    pub id: String,
    /// Tool name.
    pub name: String,
    /// Arguments as the model wrote them.
    pub arguments: String,
}

/// A tool offered to the model.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDefinition {
    /// Name.
    pub name: String,
    /// Description for the model.
    pub description: String,
    /// JSON Schema of the arguments.
    pub parameters: Value,
}

/// One streamed chat completion request.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// Model name.
    pub model: String,
    /// The conversation.
    pub messages: Vec<Message>,
    /// Tools offered (normal and exit).
    pub tools: Vec<ToolDefinition>,
    /// Sampling parameters.
    pub params: SamplingParams,
}

/// Token usage of one completion.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
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
}

/// A source of streamed chat completions (the real HTTP client, or a scripted one in tests).
pub trait ChatModel: Send + Sync + 'static {
    /// Starts a completion; the stream yields events until the completion ends or fails.
    fn stream(
        &self,
        request: ChatRequest,
    ) -> BoxFuture<'static, Result<BoxStream<'static, Result<LlmEvent, LlmError>>, LlmError>>;
}
