//! Small helpers of the process-level tests: a binary built beside another, scraping
//! `/metrics`, a one-message request, one run to its end, a tool-runner in this process, a
//! command left running whose lines are read as they come.

use std::collections::HashMap;
use std::path::PathBuf;

/// The binary `name` built beside `sibling` (a `CARGO_BIN_EXE_*` path) by the workspace test
/// command.
pub fn sibling_bin(sibling: &str, name: &str) -> anyhow::Result<PathBuf> {
    let path = PathBuf::from(sibling).with_file_name(name);
    anyhow::ensure!(
        path.exists(),
        "{} is missing: run the workspace tests (./scripts/test) or `cargo build -p tool-runner` first",
        path.display()
    );
    Ok(path)
}

/// The tool-runner binary, built beside the orchestrator's by the workspace test command (for the
/// orchestrator's own tests: `CARGO_BIN_EXE_orchestrator` is only set there).
#[macro_export]
macro_rules! tool_runner_bin {
    () => {
        $crate::sibling_bin(env!("CARGO_BIN_EXE_orchestrator"), "tool-runner")
    };
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

/// How much `series` grew between two scrapes (a series not there counts as 0).
pub fn delta(before: &HashMap<String, f64>, after: &HashMap<String, f64>, series: &str) -> f64 {
    after.get(series).copied().unwrap_or(0.0) - before.get(series).copied().unwrap_or(0.0)
}

/// A request with one user message.
pub fn user(prompt: &str) -> proto::orchestrator::v1::OrchestrateRequest {
    use proto::orchestrator::v1 as pb;
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
    request: impl tonic::IntoRequest<proto::orchestrator::v1::OrchestrateRequest>,
) -> anyhow::Result<proto::orchestrator::v1::RunResult> {
    use proto::orchestrator::v1 as pb;
    let mut client = pb::orchestrator_client::OrchestratorClient::connect(endpoint.to_owned()).await?;
    let mut stream = client.orchestrate(request).await?.into_inner();
    while let Some(event) = stream.message().await? {
        if let Some(pb::orchestrate_event::Event::RunFinished(f)) = event.event {
            return f.result.ok_or_else(|| anyhow::anyhow!("run_finished without a result"));
        }
    }
    anyhow::bail!("the stream ended without run_finished")
}

/// `GetRun` of `run_id` on `endpoint`.
pub async fn get_run(endpoint: &str, run_id: &str) -> anyhow::Result<proto::orchestrator::v1::RunResult> {
    use proto::orchestrator::v1 as pb;
    let mut client = pb::orchestrator_client::OrchestratorClient::connect(endpoint.to_owned()).await?;
    let request = pb::GetRunRequest { run_id: run_id.into() };
    Ok(client.get_run(request).await?.into_inner())
}

/// Starts a detached run `run_id` (prompt "go") on `endpoint` and leaves it: it goes on, and its
/// events stay in its log for `AttachRun`.
pub async fn start_detached(endpoint: &str, run_id: &str) -> anyhow::Result<()> {
    use proto::orchestrator::v1 as pb;
    let mut client = pb::orchestrator_client::OrchestratorClient::connect(endpoint.to_owned()).await?;
    let request = pb::OrchestrateRequest {
        run_id: run_id.into(),
        detached: true,
        ..user("go")
    };
    drop(client.orchestrate(request).await?);
    Ok(())
}

/// A tool-runner with the default settings in this process; its URL.
pub async fn tool_runner_in_process() -> anyhow::Result<String> {
    tool_runner_in_process_with(tool_runner::Config::default()).await
}

/// A tool-runner with `config` in this process; its URL.
pub async fn tool_runner_in_process_with(config: tool_runner::Config) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(tool_runner::serve(listener, config, std::future::pending()));
    Ok(url)
}

/// A command left running (a `--watch`) whose stdout is read a line at a time; killed when
/// dropped.
pub struct Printing {
    _child: tokio::process::Child,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    /// Every line read so far, for a failed wait to show.
    pub seen: Vec<String>,
}

impl Printing {
    /// Starts `command` with its stdout read here.
    pub fn spawn(mut command: tokio::process::Command) -> anyhow::Result<Self> {
        use tokio::io::AsyncBufReadExt;
        let mut child = command
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow::anyhow!("no stdout"))?;
        Ok(Self {
            _child: child,
            lines: tokio::io::BufReader::new(stdout).lines(),
            seen: Vec::new(),
        })
    }

    /// The first line from now on that `matches`, read within `limit`.
    pub async fn line_where(
        &mut self,
        what: &str,
        limit: std::time::Duration,
        matches: impl Fn(&str) -> bool,
    ) -> anyhow::Result<String> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let next = tokio::time::timeout_at(deadline, self.lines.next_line()).await;
            let line = match next {
                Ok(Ok(Some(line))) => line,
                Ok(Ok(None)) => anyhow::bail!("the command ended before {what}: {:?}", self.seen),
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => anyhow::bail!("no line of {what} within {limit:?}: {:?}", self.seen),
            };
            self.seen.push(line.clone());
            if matches(&line) {
                return Ok(line);
            }
        }
    }
}
