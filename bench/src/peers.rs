//! `bench --peers`: the paced relay's peers, measured on the same stand-in model in the same run.
//! Each peer relays the same streamed text, as many at once; the figure is the CPU and wake-ups
//! per token of the peer's own process. So far: the OpenAI Agents SDK (an agent without tools,
//! streamed; `bench/peers/agents_sdk.py`, with `openai-agents` installed into the test cache on
//! first use), agentic-api's Rust gateway (`agentic-server` from its wheel, installed the same
//! way; the stand-in model serves it `/v1/responses`), and the LiteLLM proxy as a plain relay
//! (installed by `./scripts/model-servers`).

use std::time::Duration;

use futures::StreamExt;
use serde::Serialize;
use testkit::model_servers::{LITELLM_MASTER_KEY, ModelServer};

use crate::procstat;
use crate::relay::{MODEL, Paced, text_pieces};

/// One peer, measured; or why it was not.
#[derive(Debug, Serialize)]
pub(crate) struct Peer {
    pub name: String,
    /// What the peer does with each token.
    pub role: String,
    pub cpu_us_per_token: Option<f64>,
    pub switches_per_token: Option<f64>,
    pub not_run: Option<String>,
}

/// Every peer against the stand-in model at `model_url`.
pub(crate) async fn measure(model_url: &str, paced: &Paced) -> Vec<Peer> {
    vec![
        agents_sdk(model_url, paced).await,
        agentic_api(model_url, paced).await,
        litellm(model_url, paced).await,
    ]
}

/// A peer's figures, or why it was not measured.
fn peer(name: &str, role: &str, figures: anyhow::Result<(f64, f64)>) -> Peer {
    let (cpu, switches, not_run) = match figures {
        Ok((cpu, switches)) => (Some(cpu), Some(switches), None),
        Err(e) => (None, None, Some(format!("{e:#}"))),
    };
    Peer {
        name: name.into(),
        role: role.into(),
        cpu_us_per_token: cpu,
        switches_per_token: switches,
        not_run,
    }
}

/// The OpenAI Agents SDK the benchmark installs (pinned, so runs compare).
const AGENTS_SDK: &str = "openai-agents==0.24.0";

/// The OpenAI Agents SDK running an agent without tools, streamed.
async fn agents_sdk(model_url: &str, paced: &Paced) -> Peer {
    let role = "agent loop, streamed (OpenAI Agents SDK, Python)";
    peer("openai-agents", role, agents_sdk_figures(model_url, paced).await)
}

/// The venv's Python with the Agents SDK, installed when missing.
async fn agents_sdk_python() -> anyhow::Result<std::path::PathBuf> {
    let venv = pip_installed("openai-agents", AGENTS_SDK, &["-c", "import agents"]).await?;
    Ok(venv.join("bin/python"))
}

/// The virtualenv `<test cache>/peers/<name>` with `requirement` installed (pip) when the venv's
/// Python cannot run `check` yet.
async fn pip_installed(name: &str, requirement: &str, check: &[&str]) -> anyhow::Result<std::path::PathBuf> {
    let venv = testkit::model_servers::cache_dir().join("peers").join(name);
    let python = venv.join("bin/python");
    if run(&python, check).await.is_ok() {
        return Ok(venv);
    }
    eprintln!("bench: installing {requirement} (pip, into {})", venv.display());
    let venv_arg = venv.to_string_lossy().into_owned();
    run(std::path::Path::new("python3"), &["-m", "venv", &venv_arg]).await?;
    run(
        &venv.join("bin/pip"),
        &["install", "--quiet", "--disable-pip-version-check", requirement],
    )
    .await?;
    run(&python, check)
        .await
        .map_err(|e| e.context(format!("{requirement} was installed but does not work")))?;
    Ok(venv)
}

/// Runs `program` with `args` to its end (without blocking the runtime); an error unless it
/// succeeded.
async fn run(program: &std::path::Path, args: &[&str]) -> anyhow::Result<()> {
    let output = tokio::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await?;
    anyhow::ensure!(
        output.status.success(),
        "{} {args:?}: {}: {}",
        program.display(),
        output.status,
        shared::text::excerpt(String::from_utf8_lossy(&output.stderr).trim())
    );
    Ok(())
}

async fn agents_sdk_figures(model_url: &str, paced: &Paced) -> anyhow::Result<(f64, f64)> {
    let concurrency = paced.concurrency.to_string();
    let rounds = paced.rounds.to_string();
    let args = ["--model", MODEL, "--concurrency", &concurrency, "--rounds", &rounds];
    let (cpu, switches, done) = drive_agents_sdk(model_url, &args).await?;
    let tokens = done["tokens"].as_u64().unwrap_or(0);
    anyhow::ensure!(tokens > 0, "no text came through the Agents SDK");
    Ok((cpu.as_secs_f64() * 1e6 / tokens as f64, switches as f64 / tokens as f64))
}

/// Runs `bench/peers/agents_sdk.py` with `args` against the model: the CPU and switches of its
/// process over the measured part, and what it reported at its end.
async fn drive_agents_sdk(model_url: &str, args: &[&str]) -> anyhow::Result<(Duration, u64, serde_json::Value)> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let python = agents_sdk_python().await?;
    let folder = tempfile::tempdir()?;
    let script = folder.path().join("agents_sdk.py");
    std::fs::write(&script, include_str!("../peers/agents_sdk.py"))?;
    let mut child = tokio::process::Command::new(python)
        .arg(&script)
        .args(["--base-url", model_url])
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let pid = child
        .id()
        .ok_or_else(|| anyhow::anyhow!("the Agents SDK driver exited at once"))?;
    let (mut stdin, stdout) = (
        child.stdin.take().ok_or_else(|| anyhow::anyhow!("no stdin"))?,
        child.stdout.take().ok_or_else(|| anyhow::anyhow!("no stdout"))?,
    );
    let mut lines = BufReader::new(stdout).lines();
    let limit = Duration::from_secs(300);
    let mut next_line = async || {
        tokio::time::timeout(limit, lines.next_line())
            .await?
            .map_err(anyhow::Error::from)?
            .ok_or_else(|| anyhow::anyhow!("the Agents SDK driver ended early"))
    };
    anyhow::ensure!(next_line().await? == "ready", "the Agents SDK driver did not get ready");
    let (cpu, switches) = (procstat::scheduled_time(pid)?, procstat::switches(pid)?);
    stdin.write_all(b"go\n").await?;
    let done: serde_json::Value = serde_json::from_str(&next_line().await?)?;
    let cpu = procstat::scheduled_time(pid)?.saturating_sub(cpu);
    let switches = procstat::switches(pid)?.saturating_sub(switches);
    let _ = stdin.write_all(b"exit\n").await;
    Ok((cpu, switches, done))
}

/// The model the stand-in plays the agent run under.
const AGENT_MODEL: &str = "agent";

/// A run of two turns and one tool call, one run after another: the orchestrator's CPU per run
/// (its own process and the tool-runner's) beside the Agents SDK's (its one process, the tool a
/// Python function in it).
#[derive(Debug, Serialize)]
pub(crate) struct AgentRuns {
    pub runs: usize,
    pub orchestrator_cpu_us_per_run: Option<f64>,
    pub agents_sdk_cpu_us_per_run: Option<f64>,
    pub not_run: Vec<String>,
}

/// The stand-in model's agent run: some text and an `echo` call, then the answer.
pub(crate) fn agent_scenario() -> mock_llm::Scenario {
    use mock_llm::{Scenario, Step, Turn};
    Scenario::new(vec![
        Turn::text("Let me look that up. ").then(Step::call("echo", serde_json::json!({"text": "forty-two"}))),
        Turn::text("The tool says forty-two, so the answer is forty-two."),
    ])
}

/// Measures [`AgentRuns`] (runs: ten times the paced rounds).
pub(crate) async fn agent_runs(bin: &std::path::Path, paced: &Paced) -> AgentRuns {
    let runs = paced.rounds * 10;
    let mock = match mock_llm::MockLlm::start_unrecorded(mock_llm::Scenarios {
        default: agent_scenario(),
        named: std::collections::HashMap::new(),
    })
    .await
    {
        Ok(mock) => mock,
        Err(e) => {
            return AgentRuns {
                runs,
                orchestrator_cpu_us_per_run: None,
                agents_sdk_cpu_us_per_run: None,
                not_run: vec![format!("the stand-in model: {e}")],
            };
        }
    };
    let mut not_run = Vec::new();
    let ours = orchestrator_agent_runs(bin, &mock.base_url(), runs).await;
    let args = ["--model", AGENT_MODEL, "--concurrency", "1", "--rounds", "1"];
    let runs_arg = runs.to_string();
    let theirs = drive_agents_sdk(&mock.base_url(), &[&args[..], &["--agent-runs", &runs_arg]].concat()).await;
    let per_run = |cpu: Duration| cpu.as_secs_f64() * 1e6 / runs as f64;
    let ours = ours.map_err(|e| not_run.push(format!("orchestrator: {e:#}"))).ok();
    let theirs = theirs.map_err(|e| not_run.push(format!("openai-agents: {e:#}"))).ok();
    AgentRuns {
        runs,
        orchestrator_cpu_us_per_run: ours.map(per_run),
        agents_sdk_cpu_us_per_run: theirs.map(|(cpu, _, _)| per_run(cpu)),
        not_run,
    }
}

/// `runs` agent runs one after another through an orchestrator and a tool-runner process (the
/// binaries beside `bin`): their CPU together, after three runs of warm-up.
async fn orchestrator_agent_runs(bin: &std::path::Path, model_url: &str, runs: usize) -> anyhow::Result<Duration> {
    let runner_bin = bin.with_file_name("tool-runner");
    anyhow::ensure!(
        runner_bin.exists(),
        "{} is missing: cargo build --release -p tool-runner",
        runner_bin.display()
    );
    let runner = testkit::Service::spawn(
        tokio::process::Command::new(&runner_bin),
        "127.0.0.1",
        "tool-runner serving",
    )
    .await?;
    let runner_pid = runner.pid().ok_or_else(|| anyhow::anyhow!("the tool-runner exited"))?;
    let launch = crate::stack::Launch {
        bin: bin.to_owned(),
        model_url: model_url.to_owned(),
        runner: format!("http://{}", runner.grpc),
        otlp: None,
        rust_log: orchestrator::DEFAULT_LOG_FILTER.to_owned(),
        extra: Vec::new(),
        env: Vec::new(),
    };
    let mut orchestrator = crate::stack::spawn(&launch, "127.0.0.1:0").await?;
    let mut client = proto::orchestrator::v1::orchestrator_client::OrchestratorClient::new(
        crate::stack::endpoint(&orchestrator.address)?.connect().await?,
    );
    let cpu = || -> anyhow::Result<Duration> {
        Ok(procstat::scheduled_time(orchestrator.pid)? + procstat::scheduled_time(runner_pid)?)
    };
    let mut before = Duration::ZERO;
    for n in 0..runs + 3 {
        if n == 3 {
            before = cpu()?;
        }
        let request = proto::orchestrator::v1::OrchestrateRequest {
            model: AGENT_MODEL.to_owned(),
            ..testkit::user(&format!("agent run {n}"))
        };
        let mut stream = client.orchestrate(request).await?.into_inner();
        let mut status = None;
        while let Some(event) = tokio::time::timeout(Duration::from_secs(60), stream.message()).await?? {
            if let Some(proto::orchestrator::v1::orchestrate_event::Event::RunFinished(f)) = event.event {
                status = f.result.map(|r| r.status());
            }
        }
        anyhow::ensure!(
            status == Some(proto::orchestrator::v1::RunStatus::Completed),
            "agent run {n} ended {status:?}"
        );
    }
    let spent = cpu()?.saturating_sub(before);
    let _ = orchestrator.child.kill().await;
    Ok(spent)
}

/// The LiteLLM proxy relaying the paced stream (OpenAI chat completions in and out).
async fn litellm(model_url: &str, paced: &Paced) -> Peer {
    let role = "plain relay (LiteLLM proxy, chat completions)";
    peer("litellm", role, litellm_figures(model_url, paced).await)
}

async fn litellm_figures(model_url: &str, paced: &Paced) -> anyhow::Result<(f64, f64)> {
    let folder = tempfile::tempdir()?;
    let config = folder.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "model_list:\n  - model_name: {MODEL}\n    litellm_params:\n      model: openai/{MODEL}\n      api_base: {model_url}\n      api_key: not-checked\nlitellm_settings:\n  telemetry: false\ngeneral_settings:\n  master_key: {LITELLM_MASTER_KEY}\n"
        ),
    )?;
    let proxy = ModelServer::litellm(&config).await?;
    let pid = proxy.pid().ok_or_else(|| anyhow::anyhow!("the LiteLLM proxy exited"))?;
    let relay = Relay {
        url: format!("{}/chat/completions", proxy.base_url()),
        body: serde_json::json!({
            "model": MODEL,
            "stream": true,
            "messages": [{"role": "user", "content": "relay"}],
        }),
        text_key: "\"content\":\"",
    };
    relay.measure(pid, paced).await
}

/// agentic-api (the vLLM project's Rust gateway; pinned, so runs compare).
const AGENTIC_API: &str = "agentic-api==0.9.0";

/// agentic-api's gateway relaying the paced stream (Responses API in and out; it asks the
/// stand-in model for `/v1/responses`), in its default configuration (responses stored in
/// SQLite).
async fn agentic_api(model_url: &str, paced: &Paced) -> Peer {
    let role = "gateway, Responses API (agentic-api, Rust)";
    peer("agentic-api", role, agentic_api_figures(model_url, paced).await)
}

async fn agentic_api_figures(model_url: &str, paced: &Paced) -> anyhow::Result<(f64, f64)> {
    let venv = pip_installed("agentic-api", AGENTIC_API, &["-m", "agentic_api", "--version"]).await?;
    let folder = tempfile::tempdir()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let upstream = model_url.trim_end_matches('/').trim_end_matches("/v1");
    let database = format!("sqlite://{}", folder.path().join("agentic.db").display());
    let gateway = tokio::process::Command::new(venv.join("bin/agentic-server"))
        .args(["--llm-api-base", upstream, "--skip-llm-ready-check"])
        .args(["--gateway-host", "127.0.0.1", "--gateway-port", &port.to_string()])
        .args(["--db-url", &database])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let pid = gateway
        .id()
        .ok_or_else(|| anyhow::anyhow!("agentic-server exited at once"))?;
    let address = format!("127.0.0.1:{port}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(&address).await.is_err() {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "agentic-server did not listen on {address} within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let relay = Relay {
        url: format!("http://{address}/v1/responses"),
        body: serde_json::json!({"model": MODEL, "stream": true, "input": "relay"}),
        text_key: "\"delta\":\"",
    };
    relay.measure(pid, paced).await
}

/// A streaming HTTP relay measured from outside: the request it is sent, and how its streamed
/// text is recognized (the JSON key before a text piece).
struct Relay {
    url: String,
    body: serde_json::Value,
    text_key: &'static str,
}

impl Relay {
    /// One round of warm-up, then `rounds` rounds: the CPU and switches of process `pid` per
    /// token relayed.
    async fn measure(&self, pid: u32, paced: &Paced) -> anyhow::Result<(f64, f64)> {
        self.round(paced).await?;
        let (cpu, switches) = (procstat::scheduled_time(pid)?, procstat::switches(pid)?);
        let mut tokens = 0;
        for _ in 0..paced.rounds {
            tokens += self.round(paced).await?;
        }
        let cpu = procstat::scheduled_time(pid)?.saturating_sub(cpu);
        let switches = procstat::switches(pid)?.saturating_sub(switches);
        anyhow::ensure!(tokens > 0, "no text came through {}", self.url);
        Ok((cpu.as_secs_f64() * 1e6 / tokens as f64, switches as f64 / tokens as f64))
    }

    /// `concurrency` streams through the relay at once, each read to its end; the tokens
    /// relayed (events with text).
    async fn round(&self, paced: &Paced) -> anyhow::Result<usize> {
        let client = reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?;
        let calls = (0..paced.concurrency).map(|_| {
            let request = client.post(&self.url).bearer_auth(LITELLM_MASTER_KEY).json(&self.body);
            async move {
                let response = request.send().await?.error_for_status()?;
                let mut bytes = response.bytes_stream();
                let mut text = Vec::new();
                while let Some(chunk) = bytes.next().await {
                    text.extend_from_slice(&chunk?);
                }
                anyhow::Ok(text_pieces(&text, self.text_key.as_bytes()))
            }
        });
        let mut tokens = 0;
        for relayed in futures::future::join_all(calls).await {
            tokens += relayed?;
        }
        Ok(tokens)
    }
}
