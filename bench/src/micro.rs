//! Micro-benchmarks of the orchestrator's hot paths, run in this process on one thread (so the
//! figures are steadier than the whole-system grid): SSE decoding of a completion stream, delivered
//! as one buffer (a model faster than the orchestrator) and one event per read (a model streaming
//! token by token).

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use orchestrator::llm::sse::{DecodeLimits, decode};
use serde::Serialize;

/// Text chunks per decoded stream.
const EVENTS: usize = 200;

/// SSE decoding cost.
#[derive(Debug, Serialize)]
pub(crate) struct SseDecode {
    /// Events per decoded stream (text chunks, the finish chunk, the usage chunk, `[DONE]`).
    pub events_per_stream: usize,
    /// Nanoseconds per event when the whole stream arrives in one read.
    pub one_read_ns_per_event: f64,
    /// Nanoseconds per event when every event arrives in a read of its own.
    pub read_per_event_ns_per_event: f64,
}

/// One `chat.completion.chunk` event as OpenAI-compatible servers send it.
fn event(delta: &str, finish: Option<&str>, usage: bool) -> String {
    let choices = if usage {
        "[]".to_owned()
    } else {
        let finish = finish.map_or("null".to_owned(), |f| format!("\"{f}\""));
        format!(r#"[{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":{finish}}}]"#)
    };
    let usage = if usage {
        r#","usage":{"prompt_tokens":812,"completion_tokens":200,"total_tokens":1012}"#
    } else {
        ""
    };
    format!(
        "data: {{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":1732250000,\"model\":\"bench-model\",\"choices\":{choices}{usage}}}\n\n"
    )
}

fn stream_events() -> Vec<String> {
    let mut events = Vec::with_capacity(EVENTS + 3);
    events.push(event(r#"{"role":"assistant","content":""}"#, None, false));
    for i in 1..EVENTS {
        events.push(event(&format!(r#"{{"content":"word{i} "}}"#), None, false));
    }
    events.push(event("{}", Some("stop"), false));
    events.push(event("{}", None, true));
    events.push("data: [DONE]\n\n".to_owned());
    events
}

/// Decodes `reads` `rounds` times; returns the time per event.
async fn time_decode(reads: &[Bytes], events: usize, rounds: usize) -> anyhow::Result<Duration> {
    let limits = DecodeLimits {
        idle_timeout: Duration::from_secs(60),
        max_line_bytes: 1 << 20,
        max_event_bytes: 4 << 20,
    };
    let started = Instant::now();
    for _ in 0..rounds {
        // The decoder needs a stream that owns its reads; cloning `Bytes` only counts references.
        let input = futures::stream::iter(Vec::from(reads)).map(Ok::<_, std::io::Error>);
        let mut decoded = decode(input, limits);
        let mut seen = 0;
        while let Some(item) = decoded.next().await {
            item.map_err(|e| anyhow::anyhow!("the benchmark stream did not decode: {e}"))?;
            seen += 1;
        }
        // The role-only first chunk yields nothing; every other event yields one.
        anyhow::ensure!(seen + 1 >= events, "decoded {seen} events of {events}");
    }
    Ok(started.elapsed() / u32::try_from(rounds * events)?)
}

/// Measures SSE decoding (`rounds` streams per delivery, in five batches).
pub(crate) async fn sse_decode(rounds: usize) -> anyhow::Result<SseDecode> {
    let events = stream_events();
    let whole = vec![Bytes::from(events.concat())];
    let one_each: Vec<Bytes> = events.iter().map(|e| Bytes::from(e.clone())).collect();
    // Warm up, then the fastest of five batches (on a shared machine the slower ones measure
    // the neighbours).
    time_decode(&whole, events.len(), rounds.div_ceil(10)).await?;
    let (mut one_read, mut read_per_event) = (Duration::MAX, Duration::MAX);
    for _ in 0..5 {
        one_read = one_read.min(time_decode(&whole, events.len(), rounds.div_ceil(5)).await?);
        read_per_event = read_per_event.min(time_decode(&one_each, events.len(), rounds.div_ceil(5)).await?);
    }
    Ok(SseDecode {
        events_per_stream: events.len(),
        one_read_ns_per_event: one_read.as_secs_f64() * 1e9,
        read_per_event_ns_per_event: read_per_event.as_secs_f64() * 1e9,
    })
}
