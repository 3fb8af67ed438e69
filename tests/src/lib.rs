//! Helpers for the end-to-end tests: start the real services in-process on loopback port 0 (one
//! build, fast), connect the generated clients, and inspect processes.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use shared::proto::toolrunner::v1 as pb;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

/// The repository root (for `deploy/` files used by tests).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A tool-runner serving in this process.
pub struct Runner {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), tool_runner::Error>>>,
}

impl Runner {
    /// Starts `tool_runner::run` on 127.0.0.1:0 with `config`.
    pub async fn start(config: tool_runner::Config) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(tool_runner::run(listener, config, async move {
            let _ = stopped.await;
        }));
        Ok(Self {
            addr,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// A channel to it.
    pub async fn channel(&self) -> anyhow::Result<Channel> {
        Ok(Channel::from_shared(format!("http://{}", self.addr))?.connect().await?)
    }

    /// A tool-runner client.
    pub async fn client(&self) -> anyhow::Result<pb::tool_runner_client::ToolRunnerClient<Channel>> {
        Ok(pb::tool_runner_client::ToolRunnerClient::new(self.channel().await?))
    }

    /// Triggers the drain (as SIGTERM would) without waiting for it.
    pub fn begin_shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Triggers the drain and waits until the server has stopped.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        self.begin_shutdown();
        match self.task.take() {
            Some(task) => Ok(tokio::time::timeout(Duration::from_secs(30), task).await???),
            None => Ok(()),
        }
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A `RunTool` request with empty ids and metadata.
pub fn run_tool(tool: &str, arguments_json: &str) -> pb::RunToolRequest {
    pb::RunToolRequest {
        run_id: "test-run".into(),
        call_id: "test-call".into(),
        tool_name: tool.into(),
        arguments_json: arguments_json.into(),
        metadata: Default::default(),
    }
}

/// What a `RunTool` answered, flattened for assertions.
#[derive(Debug)]
pub enum Outcome {
    /// The result, parsed.
    Ok(serde_json::Value),
    /// The tool error: code and message.
    Err(pb::ToolErrorCode, String),
}

impl Outcome {
    /// From a response.
    pub fn of(response: pb::RunToolResponse) -> anyhow::Result<Self> {
        Ok(match response.outcome {
            Some(pb::run_tool_response::Outcome::ContentJson(json)) => Self::Ok(serde_json::from_str(&json)?),
            Some(pb::run_tool_response::Outcome::Error(e)) => {
                Self::Err(pb::ToolErrorCode::try_from(e.code)?, e.message)
            }
            None => anyhow::bail!("response has no outcome"),
        })
    }

    /// The result, or a test failure naming the error.
    pub fn unwrap_ok(self) -> serde_json::Value {
        match self {
            Self::Ok(v) => v,
            Self::Err(code, message) => panic!("expected a result, got {code:?}: {message}"),
        }
    }

    /// The error, or a test failure naming the result.
    pub fn unwrap_err(self) -> (pb::ToolErrorCode, String) {
        match self {
            Self::Err(code, message) => (code, message),
            Self::Ok(v) => panic!("expected an error, got {v}"),
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
