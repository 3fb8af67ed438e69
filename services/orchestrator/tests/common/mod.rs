//! Helpers shared by the process-level tests: spawning the real binaries, reading the addresses
//! they log, and scraping `/metrics`.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// The tool-runner binary, built beside this package's binary by the workspace test command.
pub fn tool_runner_bin() -> anyhow::Result<PathBuf> {
    let path = PathBuf::from(env!("CARGO_BIN_EXE_orchestrator")).with_file_name("tool-runner");
    anyhow::ensure!(
        path.exists(),
        "{} is missing: run the workspace tests (./scripts/test) or `cargo build -p tool-runner` first",
        path.display()
    );
    Ok(path)
}

/// A spawned service and the addresses it logged.
pub struct Service {
    /// The process.
    pub child: Child,
    /// Its gRPC address.
    pub grpc: String,
    /// Its metrics address.
    pub metrics: String,
    /// Log lines written after it started serving.
    pub logs: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Service {
    /// Spawns `command` listening on `ip` (any port), metrics on `ip` too, and waits until it
    /// logs `ready_message` with its address.
    pub async fn spawn(command: Command, ip: &str, ready_message: &str) -> anyhow::Result<Self> {
        Self::spawn_on(command, &format!("{ip}:0"), ip, ready_message).await
    }

    /// Spawns `command` listening on `listen` (`ip:port`), metrics on `metrics_ip` (any port).
    pub async fn spawn_on(
        mut command: Command,
        listen: &str,
        metrics_ip: &str,
        ready_message: &str,
    ) -> anyhow::Result<Self> {
        let mut child = command
            .args([
                "--listen",
                listen,
                "--metrics-listen",
                &format!("{metrics_ip}:0"),
                "--log-format",
                "json",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stderr = child.stderr.take().ok_or_else(|| anyhow::anyhow!("no stderr"))?;
        let mut lines = BufReader::new(stderr).lines();
        let (mut grpc, mut metrics) = (None, None);
        while grpc.is_none() || metrics.is_none() {
            let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
                .await??
                .ok_or_else(|| anyhow::anyhow!("the service exited before serving"))?;
            let entry: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            let address = entry["address"].as_str().map(str::to_owned);
            if entry["message"] == ready_message {
                grpc = address;
            } else if entry["message"] == "metrics serving on /metrics" {
                metrics = address;
            }
        }
        // Keep draining the logs so the process never blocks on a full pipe.
        let logs = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = std::sync::Arc::clone(&logs);
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Ok(mut logs) = sink.lock() {
                    logs.push(line);
                }
            }
        });
        Ok(Self {
            child,
            grpc: grpc.unwrap_or_default(),
            metrics: metrics.unwrap_or_default(),
            logs,
        })
    }

    pub async fn stop(mut self) -> anyhow::Result<()> {
        let pid = self.child.id().ok_or_else(|| anyhow::anyhow!("no pid"))?.to_string();
        Command::new("kill").args(["-TERM", &pid]).status().await?;
        let status = tokio::time::timeout(Duration::from_secs(15), self.child.wait()).await??;
        anyhow::ensure!(status.success(), "exit status {status}");
        Ok(())
    }
}

/// Scrapes `/metrics` into series (name + sorted labels) → value.
pub async fn scrape(address: &str) -> anyhow::Result<HashMap<String, f64>> {
    let body = reqwest::get(format!("http://{address}/metrics")).await?.text().await?;
    let mut series = HashMap::new();
    for line in body.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let Some((key, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (name, labels) = match key.split_once('{') {
            Some((name, rest)) => {
                let mut labels: Vec<&str> = rest
                    .trim_end_matches('}')
                    .split(',')
                    .filter(|l| !l.is_empty())
                    .collect();
                labels.sort_unstable();
                (name, labels.join(","))
            }
            None => (key, String::new()),
        };
        series.insert(format!("{name}{{{labels}}}"), value.parse().unwrap_or(f64::NAN));
    }
    Ok(series)
}

pub fn delta(before: &HashMap<String, f64>, after: &HashMap<String, f64>, series: &str) -> f64 {
    after.get(series).copied().unwrap_or(0.0) - before.get(series).copied().unwrap_or(0.0)
}

impl Service {
    /// Kills the process at once (SIGKILL), as a crashed pod.
    pub async fn kill(mut self) -> anyhow::Result<()> {
        self.child.kill().await?;
        Ok(())
    }
}

/// A request with one user message.
pub fn user(prompt: &str) -> shared::proto::orchestrator::v1::OrchestrateRequest {
    use shared::proto::orchestrator::v1 as pb;
    pb::OrchestrateRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: prompt.into(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Runs one `Orchestrate` call on `endpoint` to its end and returns the final result.
pub async fn orchestrate(
    endpoint: &str,
    request: impl tonic::IntoRequest<shared::proto::orchestrator::v1::OrchestrateRequest>,
) -> anyhow::Result<shared::proto::orchestrator::v1::RunResult> {
    use shared::proto::orchestrator::v1 as pb;
    let mut client = pb::orchestrator_client::OrchestratorClient::connect(endpoint.to_owned()).await?;
    let mut stream = client.orchestrate(request).await?.into_inner();
    while let Some(event) = stream.message().await? {
        if let Some(pb::orchestrate_event::Event::RunFinished(f)) = event.event {
            return f.result.ok_or_else(|| anyhow::anyhow!("run_finished without a result"));
        }
    }
    anyhow::bail!("the stream ended without run_finished")
}
