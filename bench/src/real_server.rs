//! The real-server row: the same prompt streamed from a real `llama-server` (llama.cpp with
//! SmolLM2-135M-Instruct, as installed by `scripts/model-servers`) through the orchestrator and
//! directly, one run at a time, interleaved so drift on the machine hits both alike.
//!
//! "The same prompt" is exact: a warm-up run through the orchestrator is recorded by a TCP relay
//! in front of the server, and every direct request replays that recorded body byte for byte.
//! Both paths go through the relay, so its hop is on both sides of the comparison. The output is
//! greedy and `ignore_eos` makes every answer exactly `max_tokens` tokens, so every run asks the
//! server for the same work. A grammar keeps the answer to one line without `{`, `<` or a
//! backtick, so on no machine can the model's words open a call in the text or trip the
//! repeated-line detector: both paths stream the same plain tokens.
//!
//! CPU is read from the scheduler (`/proc/<pid>/task/*/schedstat`, nanoseconds) rather than from
//! `/proc/<pid>/stat` (clock ticks of 10 ms): a few dozen turns cost the orchestrator a few
//! milliseconds, below the ticks' resolution.

use std::time::{Duration, Instant};

use futures::StreamExt;
use mock_llm::Scenarios;
use proto::orchestrator::v1 as pb;
use serde::Serialize;
use testkit::model_servers::{MODEL_FILE, ModelServer, Relay};

use crate::measure::{Quantiles, quantiles};
use crate::procstat;
use crate::stack::Stack;

/// The row's name (also what `--only` selects it by).
pub(crate) const NAME: &str = "llama_server_text";
/// The prompt of every run.
const PROMPT: &str = "Write a short poem about the sea.";
/// The model name the orchestrator asks for (llama-server serves its one model under any name).
const MODEL: &str = "smollm2";
/// How long one run may take (on two busy cores a 64-token answer takes a few seconds).
const RUN_LIMIT: Duration = Duration::from_secs(120);

/// How many runs each way and how long each answer is.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct RealServer {
    pub runs: usize,
    pub max_tokens: u32,
}

impl RealServer {
    /// The quick (CI) or the full row.
    pub(crate) fn new(quick: bool) -> Self {
        if quick {
            Self {
                runs: 3,
                max_tokens: 32,
            }
        } else {
            Self {
                runs: 20,
                max_tokens: 64,
            }
        }
    }
}

/// The row as reported.
#[derive(Debug, Serialize)]
pub(crate) struct RealServerRow {
    pub name: &'static str,
    pub server: String,
    pub prompt: &'static str,
    pub settings: RealServer,
    /// Completion tokens of every run, both ways (the server's own count).
    pub tokens_per_run: u64,
    /// The whole answer, directly from the server.
    pub direct_ms: Quantiles,
    /// The whole run, through the orchestrator (to its `RunFinished`).
    pub via_ms: Quantiles,
    /// Request to the first answer token, directly.
    pub direct_first_token_ms: Quantiles,
    /// Request to the first `text_delta`, through the orchestrator.
    pub via_first_token_ms: Quantiles,
    /// Median run time through the orchestrator minus directly.
    pub added_p50_ms: f64,
    pub orchestrator_cpu_per_turn_us: f64,
    pub orchestrator_cpu_per_token_us: f64,
    /// The model server's CPU per answer, for scale.
    pub server_cpu_per_turn_ms: f64,
}

/// One answer as the client saw it.
struct Sample {
    wall: Duration,
    first_token: Duration,
    tokens: u64,
}

impl RealServer {
    /// Starts llama-server, the relay and an orchestrator on them, and measures the row.
    pub(crate) async fn measure(self, orchestrator_bin: &std::path::Path) -> anyhow::Result<RealServerRow> {
        let llama = ModelServer::llama(&["--parallel", "1", "--ctx-size", "2048"]).await?;
        let server_pid = llama
            .pid()
            .ok_or_else(|| anyhow::anyhow!("llama-server exited at once:\n{}", llama.logs()))?;
        let relay = Relay::start(&llama.origin).await?;
        let flags = ["--llm-base-url", &relay.base_url(), "--llm-model", MODEL];
        let scenarios = Scenarios {
            default: mock_llm::Scenario::demo(),
            named: Default::default(),
        };
        let stack = Stack::start(orchestrator_bin, scenarios, 1, None, "warn", &flags, &[]).await?;
        let result = self.measure_on(&stack, &relay, server_pid).await;
        stack.stop().await;
        result.map_err(|e| e.context(format!("llama-server's last lines:\n{}", llama.logs())))
    }

    async fn measure_on(self, stack: &Stack, relay: &Relay, server_pid: u32) -> anyhow::Result<RealServerRow> {
        let mut client = stack.client(0);
        let http = reqwest::Client::builder().timeout(RUN_LIMIT).build()?;
        let url = format!("{}/chat/completions", relay.base_url());
        via_orchestrator(&mut client, self.request()).await?;
        let body = relay
            .requests()
            .pop()
            .ok_or_else(|| anyhow::anyhow!("the relay recorded no request of the warm-up run"))?;

        let (mut via, mut direct) = (Vec::new(), Vec::new());
        let (mut orchestrator_cpu, server_before) = (Duration::ZERO, procstat::scheduled_time(server_pid)?);
        for _ in 0..self.runs {
            let before = procstat::scheduled_time(stack.pid)?;
            via.push(via_orchestrator(&mut client, self.request()).await?);
            orchestrator_cpu += procstat::scheduled_time(stack.pid)?.saturating_sub(before);
            direct.push(directly(&http, &url, &body).await?);
        }
        let server_cpu = procstat::scheduled_time(server_pid)?.saturating_sub(server_before);
        self.row(&via, &direct, orchestrator_cpu, server_cpu)
    }

    /// The run: the prompt, greedy, exactly `max_tokens` tokens, no tools.
    fn request(self) -> pb::OrchestrateRequest {
        pb::OrchestrateRequest {
            model: MODEL.into(),
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: PROMPT.into(),
                ..Default::default()
            }],
            params: Some(pb::ModelParams {
                temperature: Some(0.0),
                max_tokens: Some(self.max_tokens),
                tool_choice: "none".into(),
                extra_body_json: r#"{"ignore_eos": true, "grammar": "root ::= [^{<`\\n]*"}"#.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// The row from the samples; every answer must have been `max_tokens` long both ways, or the
    /// two sides did not do the same work.
    fn row(
        self,
        via: &[Sample],
        direct: &[Sample],
        orchestrator_cpu: Duration,
        server_cpu: Duration,
    ) -> anyhow::Result<RealServerRow> {
        let expected = u64::from(self.max_tokens);
        for (way, samples) in [("through the orchestrator", via), ("directly", direct)] {
            let tokens: Vec<u64> = samples.iter().map(|s| s.tokens).collect();
            anyhow::ensure!(
                tokens.iter().all(|&t| t == expected),
                "answers {way} were {tokens:?} tokens, not {expected} each"
            );
        }
        let walls = |s: &[Sample]| s.iter().map(|s| s.wall).collect::<Vec<_>>();
        let firsts = |s: &[Sample]| s.iter().map(|s| s.first_token).collect::<Vec<_>>();
        let (via_ms, direct_ms) = (quantiles(&walls(via), 1e3), quantiles(&walls(direct), 1e3));
        let runs = self.runs.max(1) as f64;
        Ok(RealServerRow {
            name: NAME,
            server: format!("llama-server (llama.cpp), {MODEL_FILE}, 1 slot, 2 threads"),
            prompt: PROMPT,
            settings: self,
            tokens_per_run: expected,
            added_p50_ms: via_ms.p50 - direct_ms.p50,
            direct_ms,
            via_ms,
            direct_first_token_ms: quantiles(&firsts(direct), 1e3),
            via_first_token_ms: quantiles(&firsts(via), 1e3),
            orchestrator_cpu_per_turn_us: orchestrator_cpu.as_secs_f64() * 1e6 / runs,
            orchestrator_cpu_per_token_us: orchestrator_cpu.as_secs_f64() * 1e6 / (runs * expected.max(1) as f64),
            server_cpu_per_turn_ms: server_cpu.as_secs_f64() * 1e3 / (2.0 * runs),
        })
    }
}

/// One run through the orchestrator, to its `RunFinished`; it must complete.
async fn via_orchestrator(
    client: &mut pb::orchestrator_client::OrchestratorClient<tonic::transport::Channel>,
    request: pb::OrchestrateRequest,
) -> anyhow::Result<Sample> {
    use pb::orchestrate_event::Event;
    let started = Instant::now();
    let mut first_token = None;
    let mut stream = client.orchestrate(request).await?.into_inner();
    loop {
        let event = tokio::time::timeout(RUN_LIMIT, stream.next())
            .await
            .map_err(|_| anyhow::anyhow!("no event from the orchestrator for {RUN_LIMIT:?}"))?
            .ok_or_else(|| anyhow::anyhow!("the run's stream ended without RunFinished"))??;
        match event.event {
            Some(Event::TextDelta(_)) => {
                first_token.get_or_insert_with(|| started.elapsed());
            }
            Some(Event::RunFinished(finished)) => {
                let result = finished.result.unwrap_or_default();
                anyhow::ensure!(
                    result.status() == pb::RunStatus::Completed,
                    "the run ended {:?} ({:?}): {}",
                    result.status(),
                    result.failure_reason(),
                    result.failure_detail
                );
                return Ok(Sample {
                    wall: started.elapsed(),
                    first_token: first_token.unwrap_or_default(),
                    tokens: result.usage.map_or(0, |u| u.completion_tokens),
                });
            }
            _ => {}
        }
    }
}

/// The recorded `body` sent to the server directly; the answer streamed to its end.
async fn directly(http: &reqwest::Client, url: &str, body: &str) -> anyhow::Result<Sample> {
    use eventsource_stream::Eventsource;
    let started = Instant::now();
    let response = http
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body.to_owned())
        .send()
        .await?
        .error_for_status()?;
    let (mut first_token, mut tokens) = (None, 0);
    let mut events = response.bytes_stream().eventsource();
    while let Some(event) = events.next().await {
        let event = event?;
        if event.data == "[DONE]" {
            break;
        }
        let chunk: serde_json::Value = serde_json::from_str(&event.data)?;
        let content = &chunk["choices"][0]["delta"]["content"];
        if content.as_str().is_some_and(|c| !c.is_empty()) {
            first_token.get_or_insert_with(|| started.elapsed());
        }
        if let Some(completion) = chunk["usage"]["completion_tokens"].as_u64() {
            tokens = completion;
        }
    }
    Ok(Sample {
        wall: started.elapsed(),
        first_token: first_token.unwrap_or_default(),
        tokens,
    })
}

/// The report's section.
pub(crate) fn markdown(row: &RealServerRow) -> String {
    let q = |q: &Quantiles| format!("{:.0} / {:.0}", q.p50, q.p99);
    format!(
        "\n## Real model server\n\n{}: the prompt \"{}\", greedy, exactly {} tokens per answer (`ignore_eos`), {} runs each way, one at a time and interleaved. The direct requests replay the body the orchestrator sent, byte for byte (recorded by a relay both paths go through). CPU is the scheduler's time of each process's threads.\n\n| row | runs | tokens/run | direct p50 / p99 (ms) | via orchestrator p50 / p99 (ms) | added p50 (ms) | first token direct p50 / p99 (ms) | first token via p50 / p99 (ms) | orchestrator CPU/turn (µs) | orchestrator CPU/token (µs) | server CPU/turn (ms) |\n|---|---:|---:|---|---|---:|---|---|---:|---:|---:|\n| {} | {} | {} | {} | {} | {:+.1} | {} | {} | {:.0} | {:.1} | {:.0} |\n",
        row.server,
        row.prompt,
        row.tokens_per_run,
        row.settings.runs,
        row.name,
        row.settings.runs,
        row.tokens_per_run,
        q(&row.direct_ms),
        q(&row.via_ms),
        row.added_p50_ms,
        q(&row.direct_first_token_ms),
        q(&row.via_first_token_ms),
        row.orchestrator_cpu_per_turn_us,
        row.orchestrator_cpu_per_token_us,
        row.server_cpu_per_turn_ms,
    )
}
