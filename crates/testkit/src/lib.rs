//! The one test harness of the workspace, used by both services' process tests, the end-to-end
//! tests, the clients', the demo's and the bench's tests:
//!
//! * a real binary spawned on loopback with JSON logs ([`Service`]), a command run to its end
//!   ([`run_to_end`]), waiting for processes to go; binaries are named by the caller
//!   (`CARGO_BIN_EXE_*` is only visible in the binary's own package; [`sibling_bin`]);
//! * [`inprocess`]: the services served in the test's own process ([`Served`], [`Runner`],
//!   [`stack::Stack`]);
//! * the real outside components: [`model_servers`] (llama-server, LiteLLM), [`mcp_servers`],
//!   [`nats`] (a `nats-server -js`), [`otlp`] (a trace collector), [`python`] (the grpcio
//!   virtualenv), [`pki`] (test certificates);
//! * [`fronts`]: a TLS front and a forward HTTP proxy, for the hosted path to a model server;
//! * [`helpers`]: `/metrics` scraping, one run to its end; [`proto_docs`]: the contract's
//!   documentation checks;
//! * [`receiver`]: a webhook receiver that records what it is POSTed;
//! * [`wait`]: waiting for a condition with a deadline (no fixed sleeps in tests);
//! * [`runs`]: the orchestrator process, a client of it, a run's call running and its end;
//! * [`arm_watchdog`]: a hung test fails its binary after ten minutes instead of holding the suite.

#![forbid(unsafe_code)]

pub mod fronts;
pub mod helpers;
pub mod inprocess;
pub mod mcp_servers;
pub mod model_servers;
pub mod module_graph;
pub mod nats;
pub mod otlp;
pub mod pki;
pub mod proto_docs;
pub mod proxy;
pub mod python;
pub mod receiver;
pub mod runs;
pub mod wait;

pub use helpers::{delta, get_run, orchestrate, scrape, sibling_bin, start_detached, tool_runner_in_process, user};
pub use inprocess::{Outcome, Runner, Served, reflected_services, run_tool, stack};

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

/// How long a spawned service may take to log that it serves.
const START_LIMIT: Duration = Duration::from_secs(20);

/// How long one test binary may run before the watchdog ends it (`TESTKIT_BINARY_LIMIT_SECS`
/// overrides). A package's tests are a few binaries grouped by behaviour, and the slowest,
/// the orchestrator's `durability`, takes about ten minutes on two cores; a hung wait must fail
/// its binary, not hold the whole suite until CI's own limit.
const BINARY_LIMIT: Duration = Duration::from_secs(1500);

/// Arms, once per test binary, a thread that ends the process with a clear message when the
/// binary outlives [`BINARY_LIMIT`]. Everything that starts a server or a process arms it, so
/// every test that could wait on one is covered; `cargo test --no-fail-fast` then reports the
/// binary as failed and goes on with the others.
pub fn arm_watchdog() {
    static ARMED: std::sync::Once = std::sync::Once::new();
    ARMED.call_once(|| {
        let limit = std::env::var("TESTKIT_BINARY_LIMIT_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .map_or(BINARY_LIMIT, Duration::from_secs);
        let spawned = std::thread::Builder::new()
            .name("testkit-watchdog".into())
            .spawn(move || {
                std::thread::sleep(limit);
                let binary = std::env::args().next().unwrap_or_default();
                eprintln!(
                    "testkit watchdog: {binary} has run for {}s, past its limit: a test is hung \
                 (the test named \"running for over 60 seconds\" above); ending the binary",
                    limit.as_secs()
                );
                std::process::exit(124);
            });
        if let Err(e) = spawned {
            eprintln!("testkit watchdog: not armed: {e}");
        }
    });
}

/// The repository root (for `deploy/` files and the tools manifest).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `command` with `args` and `env` added (stdin closed) to its end, at most 60 s: exit code,
/// stdout, stderr.
pub async fn run_to_end(
    mut command: Command,
    args: &[&str],
    env: &[(&str, &str)],
) -> anyhow::Result<(Option<i32>, String, String)> {
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        command
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .output(),
    )
    .await??;
    Ok((
        output.status.code(),
        String::from_utf8(output.stdout)?,
        String::from_utf8(output.stderr)?,
    ))
}

/// The command of an orchestrator process (`bin`: the test's `CARGO_BIN_EXE_orchestrator`) on
/// the model at `llm` and the tool-runners at `runners` (`TOOL_RUNNER_ENDPOINTS`), exporting no
/// spans; the test adds its own settings, then [`Service::orchestrator`] starts it.
pub fn orchestrator_command(bin: &str, llm: &str, runners: &str) -> Command {
    let mut command = Command::new(bin);
    command
        .env("LLM_BASE_URL", llm)
        .env("TOOL_RUNNER_ENDPOINTS", runners)
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT");
    command
}

/// `command` keeping its runs and signals in the NATS at `nats` (`submit_report` the exit tool
/// the signal topic carries): a replica of a durable deployment.
pub fn on_nats(mut command: Command, nats: &str) -> Command {
    command
        .env("ORCHESTRATOR_RUN_STORE", nats)
        .env("ORCHESTRATOR_SIGNAL_TOPIC", nats)
        .env("ORCHESTRATOR_EXIT_TOOLS", "submit_report");
    command
}

/// A spawned service (`--log-format json`), the addresses it logged, and every log line it wrote.
pub struct Service {
    /// The process.
    pub child: Child,
    /// Its gRPC address.
    pub grpc: String,
    /// Its metrics address.
    pub metrics: String,
    logs: Arc<Mutex<Vec<String>>>,
    reader: Option<JoinHandle<()>>,
}

impl Service {
    /// Spawns `command` listening on `ip` (any port), metrics on `ip` too, and waits until it
    /// logs `ready_message` with its address.
    pub async fn spawn(command: Command, ip: &str, ready_message: &str) -> anyhow::Result<Self> {
        Self::spawn_on(command, &format!("{ip}:0"), ip, ready_message).await
    }

    /// Spawns an orchestrator's `command` on loopback and waits until it serves.
    pub async fn orchestrator(command: Command) -> anyhow::Result<Self> {
        Self::spawn(command, "127.0.0.1", "orchestrator serving").await
    }

    /// Spawns `command` listening on `listen` (`ip:port`), metrics on `metrics_ip` (any port).
    pub async fn spawn_on(
        mut command: Command,
        listen: &str,
        metrics_ip: &str,
        ready_message: &str,
    ) -> anyhow::Result<Self> {
        arm_watchdog();
        let mut child = command
            .args(["--listen", listen, "--metrics-listen", &format!("{metrics_ip}:0")])
            .args(["--log-format", "json"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stderr = child.stderr.take().ok_or_else(|| anyhow::anyhow!("no stderr"))?;
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let reader = tokio::spawn(read_logs(stderr, Arc::clone(&logs), ready_message.to_owned(), ready_tx));
        let (grpc, metrics) = tokio::time::timeout(START_LIMIT, ready_rx)
            .await?
            .map_err(|_| anyhow::anyhow!("the service exited before serving"))?;
        Ok(Self {
            child,
            grpc,
            metrics,
            logs,
            reader: Some(reader),
        })
    }

    /// The process id, while it runs (to read its CPU time).
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Its log lines as they keep coming, for a test that outlives this handle (to show a
    /// retired process's lines when it fails).
    pub fn log_book(&self) -> Arc<Mutex<Vec<String>>> {
        Arc::clone(&self.logs)
    }

    /// Every log line so far.
    pub fn logs(&self) -> Vec<String> {
        self.logs.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Whether a log line containing `needle` is written within `limit` (lines are read as the
    /// process writes them, so a test polls rather than looks once).
    pub async fn logged(&self, needle: &str, limit: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if self.logs().iter().any(|l| l.contains(needle)) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// Sends `signal` to the process.
    pub fn signal(&self, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
        let pid = self
            .child
            .id()
            .ok_or_else(|| anyhow::anyhow!("process already reaped"))?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(i32::try_from(pid)?), signal)?;
        Ok(())
    }

    /// Waits (at most 15 s) for the process to exit and for its last log line; its exit code.
    pub async fn wait_exit(&mut self) -> anyhow::Result<Option<i32>> {
        let status = tokio::time::timeout(Duration::from_secs(15), self.child.wait()).await??;
        if let Some(reader) = self.reader.take() {
            tokio::time::timeout(Duration::from_secs(10), reader).await??;
        }
        Ok(status.code())
    }

    /// SIGTERM, then the process must exit 0.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.signal(nix::sys::signal::Signal::SIGTERM)?;
        let code = self.wait_exit().await?;
        anyhow::ensure!(code == Some(0), "exit code {code:?}");
        Ok(())
    }

    /// Kills the process at once (SIGKILL), as a crashed pod.
    pub async fn kill(mut self) -> anyhow::Result<()> {
        self.child.kill().await?;
        Ok(())
    }

    /// The address its log line `message` gave (e.g. "console serving"), if it logged one.
    pub fn address_logged(&self, message: &str) -> Option<String> {
        self.logs().iter().find_map(|line| {
            let entry: serde_json::Value = serde_json::from_str(line).ok()?;
            (entry["message"] == message).then(|| entry["address"].as_str().map(str::to_owned))?
        })
    }
}

/// Keeps every log line (so the process never blocks on a full pipe) and reports the gRPC and
/// metrics addresses once both are logged.
async fn read_logs(
    stderr: tokio::process::ChildStderr,
    logs: Arc<Mutex<Vec<String>>>,
    ready_message: String,
    ready: tokio::sync::oneshot::Sender<(String, String)>,
) {
    let mut ready = Some(ready);
    let (mut grpc, mut metrics) = (None, None);
    let mut lines = BufReader::new(stderr).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let entry: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        let address = entry["address"].as_str().map(str::to_owned);
        if entry["message"] == ready_message.as_str() {
            grpc = address;
        } else if entry["message"] == "metrics serving on /metrics" {
            metrics = address;
        }
        if let (Some(g), Some(m)) = (&grpc, &metrics)
            && let Some(tx) = ready.take()
        {
            let _ = tx.send((g.clone(), m.clone()));
        }
        if let Ok(mut logs) = logs.lock() {
            logs.push(line);
        }
    }
}

/// Whether process `pid` still runs (a zombie waiting to be reaped counts as gone).
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // Field 3 is the state; the command name in field 2 may contain spaces, so look after ')'.
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Waits up to `limit` for every pid to be gone; returns those still alive.
pub async fn wait_gone(pids: &[u32], limit: Duration) -> Vec<u32> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let alive: Vec<u32> = pids.iter().copied().filter(|p| process_alive(*p)).collect();
        if alive.is_empty() || tokio::time::Instant::now() >= deadline {
            return alive;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Reads whitespace-separated pids a test tool wrote to `path`, waiting up to 5 s for `count`.
pub async fn read_pids(path: &std::path::Path, count: usize) -> anyhow::Result<Vec<u32>> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let pids: Vec<u32> = std::fs::read_to_string(path)
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|s| s.parse().ok())
            .collect();
        if pids.len() >= count {
            return Ok(pids);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the tool wrote {} of {count} pids to {}",
            pids.len(),
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
