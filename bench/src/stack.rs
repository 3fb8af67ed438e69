//! The system under test: the orchestrator as its own process (so its CPU time and memory are its
//! own), the stand-in model and a tool-runner in the benchmark's process.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use mock_llm::{MockLlm, Scenarios};
use proto::orchestrator::v1 as pb;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tonic::transport::Channel;

/// A running stack.
pub(crate) struct Stack {
    /// The stand-in model.
    pub mock: MockLlm,
    /// The tool-runner's endpoint.
    pub runner: String,
    /// The orchestrator process.
    pub child: Child,
    /// Its pid.
    pub pid: u32,
    /// Its gRPC address (for callers in other languages).
    pub address: String,
    /// Client channels (streams are spread over them: HTTP/2 limits streams per connection).
    pub channels: Vec<Channel>,
    /// Where its `/metrics` are, when `extra` turned them on.
    pub metrics: Option<String>,
}

/// A process serving `Orchestrate` as a measurement calls it: its pid (for its CPU), its address
/// (for callers in other languages) and the benchmark's channels to it.
pub(crate) struct Target<'a> {
    pub pid: u32,
    pub address: &'a str,
    pub channels: &'a [Channel],
}

impl Target<'_> {
    /// A client on the `i`th channel (streams are spread over them).
    pub(crate) fn client(&self, i: usize) -> pb::orchestrator_client::OrchestratorClient<Channel> {
        pb::orchestrator_client::OrchestratorClient::new(self.channels[i % self.channels.len()].clone())
    }
}

/// How an orchestrator process of the benchmark is started (kept to start replicas alike).
#[derive(Clone)]
pub(crate) struct Launch {
    pub bin: std::path::PathBuf,
    pub model_url: String,
    pub runner: String,
    pub otlp: Option<String>,
    pub rust_log: String,
    pub extra: Vec<String>,
    /// Environment variables of the orchestrator's own (its runtime's shape).
    pub env: Vec<(String, String)>,
}

/// An orchestrator process serving.
pub(crate) struct Process {
    pub child: Child,
    pub pid: u32,
    /// Its gRPC address.
    pub address: String,
    /// Where its `/metrics` are, when `extra` turned them on.
    pub metrics: Option<String>,
    /// Its last log lines (for a report on a process that misbehaved).
    pub logs: std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<String>>>,
}

/// Log lines kept per process.
const KEPT_LOG_LINES: usize = 200;

/// Starts an orchestrator as `launch` says, listening on `listen`, and waits until it serves.
pub(crate) async fn spawn(launch: &Launch, listen: &str) -> anyhow::Result<Process> {
    let mut command = Command::new(&launch.bin);
    command
        .args(["--listen", listen, "--log-format", "json"])
        .args(["--tool-call-budget", "100000", "--tool-call-budget-ceiling", "100000"])
        .args(["--run-timeout", "30m", "--run-timeout-ceiling", "1h"])
        .args(["--tool-runner", &launch.runner])
        .args(&launch.extra)
        .env("ORCHESTRATOR_METRICS_LISTEN", "off")
        .env("ORCHESTRATOR_MAX_RUNS", "20000")
        .env("ORCHESTRATOR_KEEP_RESULTS", "100000")
        .env("LLM_IDLE_TIMEOUT", "120s")
        .env("LLM_BASE_URL", &launch.model_url)
        .env(
            "RUST_LOG",
            format!("{},orchestrator::server=info", log_filter(&launch.rust_log)),
        )
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    // Measure the shipped configuration (deploy/Dockerfile, the Kubernetes manifests), unless
    // the caller set these.
    for (name, value) in [("MIMALLOC_ARENA_EAGER_COMMIT", "0"), ("MIMALLOC_PURGE_DELAY", "0")] {
        if std::env::var_os(name).is_none() {
            command.env(name, value);
        }
    }
    // The orchestrator's runtime shape, apart from the benchmark's own.
    if let Some(workers) = std::env::var_os("BENCH_ORCHESTRATOR_WORKERS") {
        command.env(shared::runtime::WORKER_THREADS_ENV, workers);
    }
    if let Some(endpoint) = &launch.otlp {
        command.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint);
    }
    command.envs(launch.env.iter().map(|(k, v)| (k, v)));
    let mut child = command.spawn()?;
    let pid = child
        .id()
        .ok_or_else(|| anyhow::anyhow!("the orchestrator exited at once"))?;
    let stderr = child.stderr.take().ok_or_else(|| anyhow::anyhow!("no stderr"))?;
    let mut lines = BufReader::new(stderr).lines();
    let mut metrics = None;
    let address = loop {
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await??
            .ok_or_else(|| anyhow::anyhow!("the orchestrator exited before serving"))?;
        let entry: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        let message = entry["message"].as_str().unwrap_or_default();
        let address = entry["address"].as_str().unwrap_or_default().to_owned();
        if message.starts_with("metrics serving") {
            metrics = Some(address);
        } else if message == "orchestrator serving" {
            break address;
        }
    };
    let logs = std::sync::Arc::new(std::sync::Mutex::new(std::collections::VecDeque::new()));
    let kept = std::sync::Arc::clone(&logs);
    let mut whole = whole_log(pid);
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(file) = whole.as_mut() {
                use std::io::Write;
                let _ = writeln!(file, "{line}");
            }
            let mut kept = shared::sync::lock(&kept);
            if kept.len() == KEPT_LOG_LINES {
                kept.pop_front();
            }
            kept.push_back(line);
        }
    });
    Ok(Process {
        child,
        pid,
        address,
        metrics,
        logs,
    })
}

/// The orchestrator's log filter: the workload's, unless `BENCH_ORCHESTRATOR_LOG` sets one for
/// every orchestrator of the run (e.g. `info`, the shipped default, to count what its spans cost
/// in a workload that runs at `warn`).
fn log_filter(workload: &str) -> String {
    std::env::var("BENCH_ORCHESTRATOR_LOG").unwrap_or_else(|_| workload.to_owned())
}

/// Where the whole log of orchestrator `pid` goes when `BENCH_LOG_DIR` names a directory
/// (`orchestrator-<pid>.log`): to read what replicas that were killed said.
fn whole_log(pid: u32) -> Option<std::io::LineWriter<std::fs::File>> {
    let dir = std::path::PathBuf::from(std::env::var_os("BENCH_LOG_DIR")?);
    match std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::File::create(dir.join(format!("orchestrator-{pid}.log"))))
    {
        Ok(file) => Some(std::io::LineWriter::new(file)),
        Err(e) => {
            eprintln!(
                "bench: cannot keep the log of orchestrator {pid} in {}: {e}",
                dir.display()
            );
            None
        }
    }
}

/// The endpoint of an orchestrator at `address`, with wide HTTP/2 windows for streamed text.
pub(crate) fn endpoint(address: &str) -> anyhow::Result<tonic::transport::Endpoint> {
    Ok(tonic::transport::Endpoint::from_shared(format!("http://{address}"))?
        .initial_stream_window_size(Some(1 << 20))
        .initial_connection_window_size(Some(8 << 20)))
}

/// A channel to `addresses`, spread over them.
pub(crate) fn channel(addresses: &[String]) -> anyhow::Result<Channel> {
    let endpoints = addresses
        .iter()
        .map(|a| endpoint(a))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Channel::balance_list(endpoints.into_iter()))
}

/// The stand-in model playing `scenarios`, and a tool-runner in this process (reading run
/// fences from `run_store` when given, as a deployment's runners do); its endpoint.
pub(crate) async fn model_and_runner(
    scenarios: Scenarios,
    run_store: Option<String>,
) -> anyhow::Result<(MockLlm, String)> {
    let mock = MockLlm::start_timed(scenarios).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let runner = format!("http://{}", listener.local_addr()?);
    let mut runner_config = tool_runner::Config::default();
    runner_config.server.max_concurrency = 10_000;
    runner_config.fence.run_store = run_store;
    tokio::spawn(tool_runner::serve(listener, runner_config, std::future::pending()));
    Ok((mock, runner))
}

impl Stack {
    /// The stack of `process` (an orchestrator already serving) on `mock` and `runner`, with one
    /// channel to it.
    pub(crate) fn of(mock: MockLlm, runner: String, process: Process) -> anyhow::Result<Self> {
        let channels = vec![channel(std::slice::from_ref(&process.address))?];
        Ok(Self {
            mock,
            runner,
            child: process.child,
            pid: process.pid,
            address: process.address,
            channels,
            metrics: process.metrics,
        })
    }

    /// Starts everything; `scenarios` are the model's scripts (chosen by model name); `extra`
    /// flags override the benchmark's settings (given as environment variables for that reason),
    /// and `env` is the orchestrator's own environment (its runtime's shape).
    pub(crate) async fn start(
        orchestrator_bin: &Path,
        scenarios: Scenarios,
        channels: usize,
        otlp: Option<&str>,
        rust_log: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let run_store = extra
            .windows(2)
            .find(|pair| pair[0] == "--run-store")
            .map(|pair| pair[1].to_owned());
        let (mock, runner) = model_and_runner(scenarios, run_store).await?;
        let launch = Launch {
            bin: orchestrator_bin.to_owned(),
            model_url: mock.base_url(),
            runner: runner.clone(),
            otlp: otlp.map(str::to_owned),
            rust_log: rust_log.to_owned(),
            extra: extra.iter().map(|f| (*f).to_owned()).collect(),
            env: env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        };
        let Process {
            child,
            pid,
            address,
            metrics,
            ..
        } = spawn(&launch, "127.0.0.1:0").await?;
        let mut pool = Vec::with_capacity(channels);
        for _ in 0..channels.max(1) {
            pool.push(endpoint(&address)?.connect().await?);
        }
        Ok(Self {
            mock,
            runner,
            child,
            pid,
            address,
            channels: pool,
            metrics,
        })
    }

    /// A client on the `i`-th channel (round robin).
    pub(crate) fn client(&self, i: usize) -> pb::orchestrator_client::OrchestratorClient<Channel> {
        self.target().client(i)
    }

    /// The orchestrator as a measurement calls it.
    pub(crate) fn target(&self) -> Target<'_> {
        Target {
            pid: self.pid,
            address: &self.address,
            channels: &self.channels,
        }
    }

    /// Stops the orchestrator gracefully (it flushes its spans), killing it after 10 s.
    pub(crate) async fn stop(mut self) {
        if let Ok(pid) = i32::try_from(self.pid) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
        }
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// Lets this process (and its children) open many sockets: 10,000 runs hold 10,000 model
/// streams.
pub(crate) fn raise_open_files() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard.min(1 << 20), hard);
    }
}

/// Starts runs `<prefix>-0` … `<prefix>-(n-1)` made by `request` from their ids, `concurrency`
/// at a time, not reading their streams; a run refused for want of a slot is tried again.
pub(crate) async fn start_runs(
    stack: &Stack,
    (prefix, n, concurrency): (&str, usize, usize),
    request: impl Fn(String) -> pb::OrchestrateRequest,
) -> anyhow::Result<()> {
    use futures::StreamExt as _;
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(0..n)
        .map(|i| {
            let mut client = stack.client(i);
            let run_id = format!("{prefix}-{i}");
            let made = request(run_id.clone());
            async move {
                loop {
                    match client.orchestrate(made.clone()).await {
                        Ok(stream) => {
                            drop(stream);
                            return Ok(());
                        }
                        Err(status) if status.code() == tonic::Code::ResourceExhausted => {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        Err(status) => return Err(anyhow::anyhow!("{run_id}: {status}")),
                    }
                }
            }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    results.into_iter().collect()
}
