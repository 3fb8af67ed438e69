//! `--fleet`: the model's time on a fleet of two real `llama-server` processes (llama.cpp with
//! SmolLM2-135M-Instruct, prompt cache on), as installed by `scripts/model-servers`.
//!
//! The same runs twice, side by side in one benchmark run:
//! * **sticky**: the orchestrator is given both servers (`--llm-base-url` twice) and keeps each
//!   run's turns on one of them;
//! * **round robin**: the orchestrator is given one address, a TCP proxy that sends each new
//!   connection to the next server (as a Kubernetes Service or an L4 balancer does), with a new
//!   connection per completion (`--llm-max-idle-connections 0`), so each turn lands where the
//!   proxy sends it.
//!
//! Each run has a long first message (its own) and every turn makes the same call, written in the
//! text under a grammar (so every CPU produces it), until `max_turns` ends the run. What counts:
//! the prompt tokens the servers had to prefill in later turns (prompt − cached, as they report
//! them), the model time of a later turn (from the orchestrator sending its request to the call
//! it made: prefill plus a fixed decode), and the runs' wall time.
//!
//! Then the transcript itself: one run's requests, recorded as sent, are replayed to a fresh
//! server in order, as they are and with the per-turn line the BIOS used to start with ("This is
//! turn N of at most M."), and llama.cpp's `timings.prompt_n` says how many prompt tokens each
//! later turn prefilled.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use proto::orchestrator::v1 as pb;
use serde::Serialize;
use testkit::model_servers::{ModelServer, Relay, TEMPLATE_FILE, installed};

use crate::stack::{Launch, Process, endpoint, model_and_runner, spawn};

/// Every turn writes this call in its text (the fallback parser runs it).
const TEXT_CALL_BODY: &str =
    r#"{"grammar": "root ::= \"<tool_call>{\\\"name\\\": \\\"time_now\\\", \\\"arguments\\\": {}}</tool_call>\""}"#;
/// The model name the orchestrator asks for.
const MODEL: &str = "smollm2";
/// How long one run may take.
const RUN_LIMIT: Duration = Duration::from_secs(600);

/// The runs of one side.
#[derive(Debug, Clone, Copy, Serialize)]
struct Shape {
    runs: usize,
    turns: u32,
    /// Repeats of the background sentence in each run's first message.
    background: usize,
}

impl Shape {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                runs: 2,
                turns: 3,
                background: 60,
            }
        } else {
            Self {
                runs: 4,
                turns: 4,
                background: 80,
            }
        }
    }
}

/// One side's figures.
#[derive(Debug, Serialize)]
struct Side {
    name: &'static str,
    runs: usize,
    /// Later turns (2 and on) measured.
    later_turns: usize,
    /// Prompt tokens of a later turn, mean.
    prompt_tokens: f64,
    /// Prompt tokens a later turn had to prefill (prompt − cached), mean.
    prefilled_tokens: f64,
    /// Share of later turns' prompt tokens the servers had cached.
    cached_share: f64,
    /// A later turn's model time (request sent → its call), mean, ms.
    later_turn_ms: f64,
    /// A run's wall time, mean, ms.
    run_ms: f64,
}

/// The transcript replayed with and without the per-turn BIOS line.
#[derive(Debug, Serialize)]
struct Replay {
    /// `timings.prompt_n` of each later turn, as sent now.
    prefix_kept: Vec<u64>,
    /// The same with the BIOS's first line saying the turn, as before.
    bios_per_turn: Vec<u64>,
}

#[derive(Debug, Serialize)]
struct Report {
    server: String,
    shape: Shape,
    sticky: Side,
    round_robin: Side,
    replay: Replay,
}

/// A TCP proxy that sends each new connection to the next of `upstreams`.
struct RoundRobin {
    address: String,
    _task: tokio::task::JoinHandle<()>,
}

impl RoundRobin {
    async fn start(upstreams: Vec<String>) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?.to_string();
        let next = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let upstream = upstreams[next.fetch_add(1, Ordering::Relaxed) % upstreams.len()].clone();
                tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Ok(Self { address, _task: task })
    }
}

/// Runs `--fleet` and writes `fleet.{md,json}` into `out`.
pub(crate) async fn run(bin: &std::path::Path, quick: bool, out: &std::path::Path) -> anyhow::Result<()> {
    let shape = Shape::new(quick);
    let template = installed(&format!("templates/{TEMPLATE_FILE}"))?;
    let template = template.to_string_lossy().into_owned();
    let server_args = [
        "--parallel",
        "2",
        "--ctx-size",
        "16384",
        "--jinja",
        "--chat-template-file",
        &template,
    ];
    let (_, runner) = model_and_runner(mock_llm::Scenario::demo().into(), None).await?;
    let mut sides = Vec::new();
    for name in ["sticky", "round_robin"] {
        // Fresh servers for each side: neither starts with the other's cache.
        let servers = [
            ModelServer::llama(&server_args).await?,
            ModelServer::llama(&server_args).await?,
        ];
        let origins: Vec<String> = servers.iter().map(|s| s.origin.clone()).collect();
        eprintln!("bench: fleet {name} on {}", origins.join(", "));
        let mut _proxy = None;
        let (model_url, extra) = if name == "sticky" {
            let urls: Vec<String> = origins.iter().map(|o| format!("{o}/v1")).collect();
            (urls.join(","), Vec::new())
        } else {
            let upstreams = origins
                .iter()
                .map(|o| o.trim_start_matches("http://").to_owned())
                .collect();
            let proxy = RoundRobin::start(upstreams).await?;
            let url = format!("http://{}/v1", proxy.address);
            _proxy = Some(proxy);
            (url, vec!["--llm-max-idle-connections".to_owned(), "0".to_owned()])
        };
        let launch = Launch {
            bin: bin.to_owned(),
            model_url,
            runner: runner.clone(),
            otlp: None,
            rust_log: "warn".into(),
            extra,
            env: Vec::new(),
        };
        let process = spawn(&launch, "127.0.0.1:0").await?;
        let side = measure_side(name, &process, shape).await;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(process.pid)?),
            nix::sys::signal::Signal::SIGKILL,
        );
        sides.push(side.map_err(|e| e.context(format!("{name}: {}", servers[0].logs())))?);
    }
    let replay = replay(bin, &runner, shape, &server_args, &template).await?;
    let round_robin = sides.pop().ok_or_else(|| anyhow::anyhow!("no round-robin side"))?;
    let sticky = sides.pop().ok_or_else(|| anyhow::anyhow!("no sticky side"))?;
    let report = Report {
        server: format!(
            "2 × llama-server (llama.cpp), {}, 2 slots each",
            testkit::model_servers::MODEL_FILE
        ),
        shape,
        sticky,
        round_robin,
        replay,
    };
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("fleet.json"), serde_json::to_string_pretty(&report)?)?;
    let md = markdown(&report);
    std::fs::write(out.join("fleet.md"), &md)?;
    eprintln!("{md}");
    Ok(())
}

/// The request of run `n`.
fn request(n: usize, shape: Shape) -> pb::OrchestrateRequest {
    let background = format!("Run {n} background: the sea, the wind and the tide. ").repeat(shape.background);
    pb::OrchestrateRequest {
        model: MODEL.into(),
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: format!("{background}\nWhat time is it?"),
            ..Default::default()
        }],
        params: Some(pb::ModelParams {
            temperature: Some(0.0),
            max_tokens: Some(48),
            tool_choice: "none".into(),
            extra_body_json: TEXT_CALL_BODY.into(),
            ..Default::default()
        }),
        tools: Some(pb::ToolSelection {
            normal: vec!["time_now".into()],
            ..Default::default()
        }),
        limits: Some(pb::RunLimits {
            max_turns: Some(shape.turns),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// What one run showed: per later turn (prompt, cached, model time), and its wall time.
struct RunSeen {
    later: Vec<(u64, u64, Duration)>,
    wall: Duration,
}

async fn measure_side(name: &'static str, process: &Process, shape: Shape) -> anyhow::Result<Side> {
    let channel = endpoint(&process.address)?.connect().await?;
    let runs = (0..shape.runs).map(|n| {
        let client = pb::orchestrator_client::OrchestratorClient::new(channel.clone());
        watch(client, request(n, shape))
    });
    let seen = futures::future::try_join_all(runs).await?;
    let later: Vec<&(u64, u64, Duration)> = seen.iter().flat_map(|s| &s.later).collect();
    let count = later.len().max(1) as f64;
    let prompt: u64 = later.iter().map(|l| l.0).sum();
    let cached: u64 = later.iter().map(|l| l.1).sum();
    Ok(Side {
        name,
        runs: seen.len(),
        later_turns: later.len(),
        prompt_tokens: prompt as f64 / count,
        prefilled_tokens: (prompt - cached.min(prompt)) as f64 / count,
        cached_share: cached as f64 / prompt.max(1) as f64,
        later_turn_ms: later.iter().map(|l| l.2.as_secs_f64() * 1e3).sum::<f64>() / count,
        run_ms: seen.iter().map(|s| s.wall.as_secs_f64() * 1e3).sum::<f64>() / seen.len().max(1) as f64,
    })
}

/// One run to its end (`MAX_TURNS_EXCEEDED`, every turn having made its call).
async fn watch(
    mut client: pb::orchestrator_client::OrchestratorClient<tonic::transport::Channel>,
    request: pb::OrchestrateRequest,
) -> anyhow::Result<RunSeen> {
    use pb::orchestrate_event::Event;
    let started = Instant::now();
    let mut stream = client.orchestrate(request).await?.into_inner();
    let (mut later, mut asked_at, mut usage) = (Vec::new(), None::<Instant>, Vec::new());
    loop {
        let event = tokio::time::timeout(RUN_LIMIT, stream.next())
            .await
            .map_err(|_| anyhow::anyhow!("no event for {RUN_LIMIT:?}"))?
            .ok_or_else(|| anyhow::anyhow!("the stream ended without RunFinished"))??;
        match event.event {
            // The turn's end is sent with the next request.
            Some(Event::TurnFinished(t)) => {
                usage.push(t.usage.unwrap_or_default());
                asked_at = Some(Instant::now());
            }
            Some(Event::ToolCallStarted(_)) => {
                if let (Some(at), Some(_)) = (asked_at.take(), usage.last()) {
                    later.push(at.elapsed());
                }
            }
            Some(Event::RunFinished(f)) => {
                let result = f.result.unwrap_or_default();
                anyhow::ensure!(
                    result.failure_reason() == pb::FailureReason::MaxTurnsExceeded,
                    "the run ended {:?} ({:?}): {}",
                    result.status(),
                    result.failure_reason(),
                    result.failure_detail
                );
                let later = usage
                    .iter()
                    .skip(1)
                    .zip(later)
                    .map(|(u, time)| (u.prompt_tokens, u.cached_prompt_tokens, time))
                    .collect();
                return Ok(RunSeen {
                    later,
                    wall: started.elapsed(),
                });
            }
            _ => {}
        }
    }
}

/// One run's requests, recorded through a relay, replayed to a fresh server as sent and with the
/// per-turn BIOS line.
async fn replay(
    bin: &std::path::Path,
    runner: &str,
    shape: Shape,
    server_args: &[&str],
    template: &str,
) -> anyhow::Result<Replay> {
    let server = ModelServer::llama(server_args).await?;
    let relay = Relay::start(&server.origin).await?;
    let launch = Launch {
        bin: bin.to_owned(),
        model_url: relay.base_url(),
        runner: runner.to_owned(),
        otlp: None,
        rust_log: "warn".into(),
        extra: Vec::new(),
        env: Vec::new(),
    };
    let process = spawn(&launch, "127.0.0.1:0").await?;
    let client = pb::orchestrator_client::OrchestratorClient::new(endpoint(&process.address)?.connect().await?);
    watch(client, request(99, shape)).await?;
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(process.pid)?),
        nix::sys::signal::Signal::SIGKILL,
    );
    let bodies = relay.requests();
    let fresh = ModelServer::llama(&[
        "--parallel",
        "1",
        "--ctx-size",
        "8192",
        "--jinja",
        "--chat-template-file",
        template,
    ])
    .await?;
    let url = format!("{}/v1/chat/completions", fresh.origin);
    let http = reqwest::Client::builder().timeout(RUN_LIMIT).build()?;
    let mut prefix_kept = Vec::new();
    for body in &bodies {
        prefix_kept.push(prompt_n(&http, &url, body).await?);
    }
    let mut bios_per_turn = Vec::new();
    for (turn, body) in bodies.iter().enumerate() {
        let mut value: serde_json::Value = serde_json::from_str(body)?;
        if let Some(bios) = value["messages"][0]["content"].as_str() {
            let line = format!("This is turn {} of at most {}. ", turn + 1, shape.turns);
            value["messages"][0]["content"] = format!("{line}{bios}").into();
        }
        bios_per_turn.push(prompt_n(&http, &url, &value.to_string()).await?);
    }
    Ok(Replay {
        prefix_kept: prefix_kept.split_off(1.min(prefix_kept.len())),
        bios_per_turn: bios_per_turn.split_off(1.min(bios_per_turn.len())),
    })
}

/// The prompt tokens the server prefilled for `body` (llama.cpp's `timings.prompt_n`).
async fn prompt_n(http: &reqwest::Client, url: &str, body: &str) -> anyhow::Result<u64> {
    let mut value: serde_json::Value = serde_json::from_str(body)?;
    value["stream"] = false.into();
    if let Some(object) = value.as_object_mut() {
        object.remove("stream_options");
    }
    let answer: serde_json::Value = http
        .post(url)
        .json(&value)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    answer["timings"]["prompt_n"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("no timings.prompt_n in {answer}"))
}

fn markdown(report: &Report) -> String {
    let row = |s: &Side| {
        format!(
            "| {} | {} | {} | {:.0} | {:.0} | {:.1} % | {:.0} | {:.0} |\n",
            s.name,
            s.runs,
            s.later_turns,
            s.prompt_tokens,
            s.prefilled_tokens,
            s.cached_share * 100.0,
            s.later_turn_ms,
            s.run_ms
        )
    };
    let (sticky, rr) = (&report.sticky, &report.round_robin);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let mean = |v: &[u64]| v.iter().sum::<u64>() as f64 / v.len().max(1) as f64;
    format!(
        "# The model's time: a fleet of two llama-servers\n\n{}: {} runs at once, {} turns each (every turn makes one call, written in its text under a grammar), a first message of {} repeated sentences per run. Sticky: the orchestrator is given both servers and keeps each run's turns on one. Round robin: one address, a TCP proxy sending each new connection to the next server, a new connection per completion. Fresh servers for each side. A later turn's model time runs from the orchestrator sending its request to the call it made (prefill plus the same decode).\n\n| side | runs | later turns | prompt tokens | prefilled tokens | cached | later-turn model time (ms) | run wall time (ms) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n{}{}\n**Sticky ÷ round robin**: later-turn model time ×{:.2}, prefilled tokens ×{:.2}, run wall time ×{:.2}.\n\n## The transcript keeps its prefix\n\nOne run's {} requests, recorded as sent, replayed in order to a fresh llama-server (one slot): the prompt tokens each later turn prefilled (`timings.prompt_n`), as sent now and with the BIOS's first line saying the turn (as before the status notes):\n\n| | later turns' prompt_n | mean |\n|---|---|---:|\n| as sent (prefix kept) | {:?} | {:.0} |\n| BIOS line per turn | {:?} | {:.0} |\n\nBIOS per turn ÷ prefix kept: ×{:.1} tokens prefilled.\n",
        report.server,
        report.shape.runs,
        report.shape.turns,
        report.shape.background,
        row(sticky),
        row(rr),
        ratio(sticky.later_turn_ms, rr.later_turn_ms),
        ratio(sticky.prefilled_tokens, rr.prefilled_tokens),
        ratio(sticky.run_ms, rr.run_ms),
        report.replay.prefix_kept.len() + 1,
        report.replay.prefix_kept,
        mean(&report.replay.prefix_kept),
        report.replay.bios_per_turn,
        mean(&report.replay.bios_per_turn),
        ratio(mean(&report.replay.bios_per_turn), mean(&report.replay.prefix_kept)),
    )
}
