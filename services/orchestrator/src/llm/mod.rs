//! The LLM client: any OpenAI-compatible `/v1/chat/completions` server, streamed.
//!
//! * [`fleet`]: the model endpoints, which one each run's turns go to, failover and health;
//! * [`client`]: the HTTP side of one endpoint (API key, extra headers, what is worth a retry,
//!   idle timeout); a plain-http endpoint's connections are read by the run's own task (the
//!   `paced-http1` crate, whose read pace a run sets);
//! * [`body`]: the request's JSON body, each turn's written from what is new in it;
//! * [`sse`]: bytes → SSE events → semantic
//!   [`LlmEvent`](crate::domain::model::LlmEvent)s, tolerant of the differences between
//!   real servers (see `tests/fixtures/llm-streams/`);
//!
//! It implements the model port of the domain ([`ChatModel`](crate::domain::model::ChatModel) and its
//! request, events and errors); the loop sees that port alone, so it is tested without a network.

pub mod body;
pub mod client;
pub mod fleet;
pub mod sse;

pub use client::HttpLlm;
pub use fleet::Fleet;
