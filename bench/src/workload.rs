//! Workloads: what a run asks of the model and the tools, how many run at once, and what the
//! client measures while driving them; plus the two baselines (the stand-in model called
//! directly, and a raw tonic echo loop against the tool-runner).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use mock_llm::{Scenario, Step, Turn};
use proto::orchestrator::v1 as pb;
use proto::toolrunner::v1 as tr;
use serde::Serialize;

use crate::stack::Stack;

/// Which tool the calls use.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) enum Tool {
    /// `echo`: returns at once.
    Echo,
    /// `sleep` for this many milliseconds.
    Sleep(u64),
}

/// One workload.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Workload {
    /// Name (also the model name the stand-in model plays it under).
    pub name: String,
    /// Runs in flight at once.
    pub concurrency: usize,
    /// Runs in all.
    pub runs: usize,
    /// Turns that call tools (a final text-only turn follows).
    pub tool_turns: u32,
    /// Parallel calls per tool turn.
    pub calls_per_turn: usize,
    /// The tool.
    pub tool: Tool,
    /// Exit calls per tool turn.
    pub exit_calls: usize,
    /// Words of text per turn.
    pub text_words: usize,
    /// Model: time to first token.
    pub ttft_ms: u64,
    /// Model: delay between chunks.
    pub token_delay_ms: u64,
    /// Spread the runs' starts evenly over one scripted run time instead of starting them all
    /// at once, so the load is steady (runs arrive as they would in service) rather than one
    /// burst that every run then queues behind.
    pub paced: bool,
}

impl Workload {
    /// One run at a time of one text-only turn of 20 words, the model answering at once: what
    /// the grid's workloads change from.
    pub(crate) fn base() -> Self {
        Self {
            name: String::new(),
            concurrency: 1,
            runs: 1,
            tool_turns: 0,
            calls_per_turn: 0,
            tool: Tool::Echo,
            exit_calls: 0,
            text_words: 20,
            ttft_ms: 0,
            token_delay_ms: 0,
            paced: false,
        }
    }

    /// Turns per run (tool turns plus the final one).
    pub(crate) fn turns(&self) -> u32 {
        self.tool_turns + 1
    }

    /// The stand-in model's script.
    pub(crate) fn scenario(&self) -> Scenario {
        let text = "lorem ".repeat(self.text_words);
        let mut turns = Vec::new();
        for _ in 0..self.tool_turns {
            let mut turn = Turn::text(&text);
            for _ in 0..self.calls_per_turn {
                turn = turn.then(match self.tool {
                    Tool::Echo => Step::call("echo", serde_json::json!({"x": 1})),
                    Tool::Sleep(ms) => Step::call("sleep", serde_json::json!({ "ms": ms })),
                });
            }
            for _ in 0..self.exit_calls {
                turn = turn.then(Step::call("done", serde_json::json!({"ok": true})));
            }
            turns.push(turn);
        }
        turns.push(Turn::text(if text.is_empty() { "ok" } else { &text }));
        Scenario {
            turns,
            ttft_ms: self.ttft_ms,
            token_delay_ms: self.token_delay_ms,
            ..Scenario::default()
        }
    }

    /// Chunks the model streams in one turn (the role chunk, words, and per call a name chunk
    /// and three argument fragments, the finish and usage chunks) and so the scripted time.
    fn scripted_turn(&self, with_calls: bool) -> Duration {
        let words = self.text_words.max(1);
        let calls = if with_calls {
            self.calls_per_turn + self.exit_calls
        } else {
            0
        };
        let chunks = 1 + words + calls * 4 + 2;
        Duration::from_millis(self.ttft_ms + self.token_delay_ms * (chunks as u64 - 1))
    }

    /// When the `worker`-th of the concurrent runs starts (zero unless paced).
    pub(crate) fn start_offset(&self, worker: usize) -> Duration {
        if self.paced {
            self.scripted_run()
                .mul_f64(worker as f64 / self.concurrency.max(1) as f64)
        } else {
            Duration::ZERO
        }
    }

    /// What the tools were scripted to take for one run (the slowest call of each tool turn).
    pub(crate) fn scripted_tools(&self) -> Duration {
        match self.tool {
            Tool::Sleep(ms) if self.calls_per_turn > 0 => Duration::from_millis(ms) * self.tool_turns,
            _ => Duration::ZERO,
        }
    }

    /// What the model and the tools were scripted to take for one run.
    pub(crate) fn scripted_run(&self) -> Duration {
        self.scripted_turn(true) * self.tool_turns + self.scripted_tools() + self.scripted_turn(false)
    }
}

/// What the client saw of one run.
#[derive(Debug, Clone)]
pub(crate) struct RunSample {
    /// The run's first user message, unique per run: the stand-in model tallies the time it
    /// served the run under it.
    pub key: String,
    /// Wall time of the whole run.
    pub wall: Duration,
    /// Wall time of each turn (from the previous turn's end, or the run's start).
    pub turns: Vec<Duration>,
    /// Completed without error.
    pub ok: bool,
}

/// Drives `workload` against the stack.
pub(crate) async fn drive(stack: &Stack, workload: &Workload, model: &str) -> Vec<RunSample> {
    let next = Arc::new(AtomicUsize::new(0));
    let exit_tools: Vec<pb::ExitToolSpec> = if workload.exit_calls > 0 {
        vec![pb::ExitToolSpec {
            name: "done".into(),
            description: "finished".into(),
            parameters_json_schema: String::new(),
        }]
    } else {
        Vec::new()
    };
    let request = pb::OrchestrateRequest {
        model: model.to_owned(),
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "go".into(),
            ..Default::default()
        }],
        tools: Some(pb::ToolSelection {
            exit: exit_tools,
            ..Default::default()
        }),
        ..Default::default()
    };
    let workers = (0..workload.concurrency.min(workload.runs)).map(|w| {
        let (next, request, mut client) = (Arc::clone(&next), request.clone(), stack.client(w));
        let (runs, offset) = (workload.runs, workload.start_offset(w));
        async move {
            tokio::time::sleep(offset).await;
            let mut samples = Vec::new();
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= runs {
                    break;
                }
                let mut request = request.clone();
                let key = format!("go #{n}");
                request.messages[0].content.clone_from(&key);
                samples.push(one_run(&mut client, request, key).await);
            }
            samples
        }
    });
    futures::future::join_all(workers).await.into_iter().flatten().collect()
}

async fn one_run(
    client: &mut pb::orchestrator_client::OrchestratorClient<tonic::transport::Channel>,
    request: pb::OrchestrateRequest,
    key: String,
) -> RunSample {
    let started = Instant::now();
    let mut turns = Vec::new();
    let mut last = started;
    let mut ok = false;
    match client.orchestrate(request).await {
        Ok(response) => {
            let mut stream = response.into_inner();
            while let Some(Ok(event)) = stream.next().await {
                match event.event {
                    Some(pb::orchestrate_event::Event::TurnFinished(_)) => {
                        let now = Instant::now();
                        turns.push(now - last);
                        last = now;
                    }
                    Some(pb::orchestrate_event::Event::RunFinished(f)) => {
                        ok = f.result.is_some_and(|r| r.status() == pb::RunStatus::Completed);
                    }
                    _ => {}
                }
            }
        }
        Err(status) => eprintln!("  run refused: {:?}: {}", status.code(), status.message()),
    }
    RunSample {
        key,
        wall: started.elapsed(),
        turns,
        ok,
    }
}

/// Baseline: the same turns streamed from the stand-in model directly (no orchestrator), one
/// request per turn, `concurrency` at once and paced like the workload; returns each "run"'s
/// wall time.
pub(crate) async fn model_direct(base_url: &str, workload: &Workload, model: &str) -> anyhow::Result<Vec<Duration>> {
    let client = reqwest::Client::new();
    let url = format!("{base_url}/chat/completions");
    let next = Arc::new(AtomicUsize::new(0));
    let workers = (0..workload.concurrency.min(workload.runs)).map(|w| {
        let (client, url, next) = (client.clone(), url.clone(), Arc::clone(&next));
        let (runs, turns, model) = (workload.runs, workload.turns(), model.to_owned());
        let offset = workload.start_offset(w);
        async move {
            tokio::time::sleep(offset).await;
            let mut walls = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < runs {
                let started = Instant::now();
                let mut messages = vec![serde_json::json!({"role": "user", "content": "go"})];
                for _ in 0..turns {
                    let body = serde_json::json!({"model": model, "stream": true, "messages": messages});
                    let response = client
                        .post(&url)
                        .header(reqwest::header::CONTENT_TYPE, "application/json")
                        .body(body.to_string())
                        .send()
                        .await?;
                    let mut bytes = response.bytes_stream();
                    while let Some(chunk) = bytes.next().await {
                        chunk?;
                    }
                    // The next turn is picked by the number of assistant messages, as in a run.
                    messages.push(serde_json::json!({"role": "assistant", "content": "…"}));
                }
                walls.push(started.elapsed());
            }
            anyhow::Ok(walls)
        }
    });
    let mut all = Vec::new();
    for walls in futures::future::join_all(workers).await {
        all.extend(walls?);
    }
    Ok(all)
}

/// Baseline: raw tonic unary `RunTool` echo calls to the tool-runner, `concurrency` at once;
/// returns calls per second.
pub(crate) async fn echo_floor(runner: &str, concurrency: usize, calls: usize) -> anyhow::Result<f64> {
    let channel = tonic::transport::Channel::from_shared(runner.to_owned())?
        .connect()
        .await?;
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers = (0..concurrency).map(|_| {
        let (mut client, next) = (
            tr::tool_runner_client::ToolRunnerClient::new(channel.clone()),
            Arc::clone(&next),
        );
        async move {
            while next.fetch_add(1, Ordering::Relaxed) < calls {
                let request = tr::RunToolRequest {
                    tool_name: "echo".into(),
                    arguments_json: r#"{"x":1}"#.into(),
                    ..Default::default()
                };
                client.run_tool(request).await?;
            }
            anyhow::Ok(())
        }
    });
    for result in futures::future::join_all(workers).await {
        result?;
    }
    Ok(calls as f64 / started.elapsed().as_secs_f64())
}

/// The `q`-quantile of `values` (0 when empty).
pub(crate) fn quantile(values: &[Duration], q: f64) -> Duration {
    if values.is_empty() {
        return Duration::ZERO;
    }
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    let index = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}
