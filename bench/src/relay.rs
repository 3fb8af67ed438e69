//! What the paced relay streams: the stand-in model's paced turn, how many runs at once, and
//! how a stream's text chunks are counted. Shared by the relay's measurement (`paced`) and its
//! peers (`peers`).

use mock_llm::{Scenario, Scenarios, Step, Turn};
use proto::orchestrator::v1 as pb;
use serde::Serialize;

/// The model name the stand-in model plays the paced turn under.
pub(crate) const MODEL: &str = "paced";

/// What the paced workload streams, and how many at once.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Paced {
    pub tokens: usize,
    pub pace_ms: u64,
    pub concurrency: usize,
    /// Rounds of `concurrency` runs measured per interval (after one round of warm-up).
    pub rounds: usize,
    pub intervals_ms: Vec<u32>,
}

impl Paced {
    /// The full measurement, or a quick one (CI); `BENCH_PACED_INTERVALS` (comma-separated ms)
    /// measures only those intervals, to profile one.
    pub(crate) fn new(quick: bool) -> Self {
        let mut paced = Self::sized(quick);
        if let Ok(list) = std::env::var("BENCH_PACED_INTERVALS") {
            let chosen: Vec<u32> = list.split(',').filter_map(|ms| ms.trim().parse().ok()).collect();
            if !chosen.is_empty() {
                paced.intervals_ms = chosen;
            }
        }
        paced
    }

    fn sized(quick: bool) -> Self {
        if quick {
            Self {
                tokens: 50,
                pace_ms: 10,
                concurrency: 10,
                rounds: 1,
                intervals_ms: vec![0, 20],
            }
        } else {
            Self {
                tokens: 200,
                pace_ms: 10,
                concurrency: 20,
                rounds: 3,
                intervals_ms: vec![0, 5, 20, 50],
            }
        }
    }

    /// The model's scripts: the paced turn under [`MODEL`].
    pub(crate) fn scenarios(&self) -> Scenarios {
        Scenarios {
            default: Scenario::demo(),
            named: [(MODEL.to_owned(), self.scenario())].into_iter().collect(),
        }
    }

    fn scenario(&self) -> Scenario {
        Scenario {
            token_delay_ms: self.pace_ms,
            ..Scenario::new(vec![Turn {
                steps: vec![Step::Text {
                    text: "tok ".repeat(self.tokens),
                    chunk_chars: Some(4),
                }],
                ..Turn::default()
            }])
        }
    }

    pub(crate) fn request(&self, interval_ms: u32, n: usize) -> pb::OrchestrateRequest {
        pb::OrchestrateRequest {
            model: MODEL.to_owned(),
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: format!("paced #{n}"),
                ..Default::default()
            }],
            params: Some(pb::ModelParams {
                stream_interval_ms: Some(interval_ms),
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

/// How many non-empty `content` fields a streamed completion's bytes hold (its text chunks).
pub(crate) fn text_chunks(bytes: &[u8]) -> usize {
    text_pieces(bytes, b"\"content\":\"")
}

/// How many non-empty string fields of `key` (`"name":"`) a stream's bytes hold.
pub(crate) fn text_pieces(bytes: &[u8], key: &[u8]) -> usize {
    bytes
        .windows(key.len() + 1)
        .filter(|w| w.starts_with(key) && w[key.len()] != b'"')
        .count()
}
