//! The model port: what the loop asks a model for ([`ChatRequest`]) and what it hears back
//! ([`LlmEvent`]s, or an [`LlmError`]), through [`ChatModel`]. The HTTP adapter (`llm/`) turns
//! any OpenAI-compatible server's stream into these events; the loop assembles them into text
//! and tool calls ([`super::assembly`]) and never sees a server's wire.

use std::any::Any;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use futures::stream::BoxStream;

use super::chat::{Message, ToolDefinition, Usage};
use super::params::SamplingParams;
pub use paced_http1::ReadPace;

/// The serialized beginning of a run's requests, which the model adapter writes and the run
/// keeps for its next turn (a turn then costs what is new in it). Opaque to the loop: each run
/// holds one and hands it to every turn's request. Cheap to clone; its equality is always true
/// (a cache, not content).
#[derive(Clone, Default)]
pub struct RequestPrefix(Arc<Mutex<Option<Box<dyn Any + Send>>>>);

impl RequestPrefix {
    /// Calls `f` with what the adapter kept here as a `T` (`None`: nothing yet, or something
    /// else), and keeps what `f` leaves.
    pub fn with<T: Any + Send, R>(&self, f: impl FnOnce(&mut Option<T>) -> R) -> R {
        let mut slot = shared::sync::lock(&self.0);
        let mut held = slot.take().and_then(|kept| kept.downcast::<T>().ok()).map(|kept| *kept);
        let answer = f(&mut held);
        *slot = held.map(|kept| Box::new(kept) as Box<dyn Any + Send>);
        answer
    }
}

impl std::fmt::Debug for RequestPrefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = shared::sync::lock(&self.0).is_some();
        write!(f, "RequestPrefix({})", if held { "held" } else { "empty" })
    }
}

impl PartialEq for RequestPrefix {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

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
    pub prefix: RequestPrefix,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_keeps_what_its_adapter_leaves_and_forgets_another_type() {
        let prefix = RequestPrefix::default();
        assert_eq!(
            prefix.with(|held: &mut Option<Vec<u8>>| held.replace(b"{".to_vec())),
            None
        );
        let copy = prefix.clone();
        assert_eq!(
            copy.with(|held: &mut Option<Vec<u8>>| held.clone()),
            Some(b"{".to_vec())
        );
        assert_eq!(prefix.with(|held: &mut Option<String>| held.clone()), None);
        assert_eq!(
            prefix.with(|held: &mut Option<Vec<u8>>| held.clone()),
            None,
            "a foreign type drops it"
        );
    }
}
