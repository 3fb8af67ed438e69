//! A stand-in for an OpenAI-compatible LLM server, for tests, the benchmark and the demo.
//!
//! It plays [`Scenario`]s — scripted turns of text, parallel tool calls, exit calls, bad calls,
//! delays, cuts, stalls and HTTP errors — through the chat-completions API or, for gateways that
//! ask for it, the Responses API — and replays recorded SSE streams byte for byte. It is
//! clearly not a model: it answers what the script says, whatever it is asked. Like a real
//! server it keeps a [prefix cache](prefix_cache): the usage it reports says how much of each
//! prompt was cached, and a scenario may make the uncached part cost time.

#![forbid(unsafe_code)]

mod pieces;
pub mod prefix_cache;
mod responses;
pub mod scenario;
pub mod server;

pub use scenario::{Scenario, Step, Turn};
pub use server::{MockLlm, Scenarios, serve};
