//! Real OpenAI-compatible model servers for the tests: llama.cpp's `llama-server` with
//! SmolLM2-135M-Instruct, and the LiteLLM proxy. `scripts/model-servers` (run by `./scripts/test`)
//! installs them under the test cache, outside the checkout; a test run without them fails saying
//! so. Tests take [`one_at_a_time`] first: on two cores, servers generating side by side slow each
//! other down past any sensible idle timeout.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};

/// The model file in the cache's `models/`.
pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The chat template in the cache's `templates/` that gives SmolLM2 structured tool calls.
pub const TEMPLATE_FILE: &str = "meta-llama-Llama-3.2-3B-Instruct.jinja";
/// `extra_body` of a text-only turn (`tool_choice: none`) on llama-server: a GBNF grammar that
/// admits any text without `{`, `<` or a backtick, so no CPU's arithmetic can make the model open a
/// call written in the text (a JSON object, `<tool_call>` or a fenced block), which the fallback
/// parser would act on. What the model writes within it is still its own.
pub const PLAIN_TEXT_BODY: &str = r#"{"grammar": "root ::= [^{<`]*"}"#;
/// `extra_body` that makes llama-server's own tool-call grammar produce a call on any CPU: with
/// `tool_choice: required` (and from the first `{` on with `auto`) the grammar admits text, then a
/// call `{"name": …, "parameters": …}` of an offered tool; a bias of +100 on the `{` token makes it
/// the greedy choice wherever the grammar admits it, so the call starts at once. Offer tools whose
/// arguments cannot hold `{` (a free string argument would fill with it), e.g. `time_now`, and
/// send `parallel_tool_calls: false` so one call ends the turn.
pub const FORCED_CALL_BODY: &str = r#"{"logit_bias": {"{": 100}}"#;
/// The master key of the LiteLLM proxy that [`ModelServer::litellm_test_proxy`] starts.
pub const LITELLM_MASTER_KEY: &str = "sk-litellm-test-master";
/// Log lines kept of a server, for failure messages.
const KEPT_LOG_LINES: usize = 200;
/// How long a server may take to answer its health check (LiteLLM imports for a while).
const START_LIMIT: Duration = Duration::from_secs(120);

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Waits until no other test of this process runs a model server; hold the guard for the test.
pub async fn one_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().await
}

/// Where `scripts/model-servers` installs: `$ORCHESTRATOR_TEST_CACHE`, else
/// `$XDG_CACHE_HOME/orchestrator-tests`, else `~/.cache/orchestrator-tests`.
pub fn cache_dir() -> PathBuf {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("ORCHESTRATOR_TEST_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("orchestrator-tests")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/orchestrator-tests")))
        .unwrap_or_else(|| PathBuf::from(".cache/orchestrator-tests"))
}

/// `relative` in the cache, or an error saying how to install it.
pub fn installed(relative: &str) -> anyhow::Result<PathBuf> {
    let path = cache_dir().join(relative);
    anyhow::ensure!(
        path.exists(),
        "{} is missing: ./scripts/model-servers installs it (./scripts/test runs it first)",
        path.display()
    );
    Ok(path)
}

/// A model server process on a loopback port, killed when dropped.
pub struct ModelServer {
    /// `http://127.0.0.1:PORT`.
    pub origin: String,
    child: Child,
    log: Arc<Mutex<VecDeque<String>>>,
    http: reqwest::Client,
    /// Files the server runs from, removed when it stops.
    _folder: Option<tempfile::TempDir>,
}

impl ModelServer {
    /// `llama-server` with the SmolLM2 model and `args` (slots, context size, template …).
    pub async fn llama(args: &[&str]) -> anyhow::Result<Self> {
        let binary = installed("bin/llama-server")?;
        let model = installed(&format!("models/{MODEL_FILE}"))?;
        let port = free_port()?;
        let mut command = Command::new(binary);
        command
            .arg("--model")
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--threads", "2", "--no-webui"])
            .args(args);
        Self::spawn(command, port, "/health").await
    }

    /// The LiteLLM proxy with the tests' configuration (`tests/fixtures/litellm`: model
    /// `stand-in`, mock answers, [`LITELLM_MASTER_KEY`]), run from a copy in a temporary folder so
    /// the checkout stays clean.
    pub async fn litellm_test_proxy() -> anyhow::Result<Self> {
        let fixtures = crate::repo_root().join("tests/fixtures/litellm");
        let folder = tempfile::tempdir()?;
        for file in ["config.yaml", "mock_answers.py"] {
            std::fs::copy(fixtures.join(file), folder.path().join(file))?;
        }
        let mut server = Self::litellm(&folder.path().join("config.yaml")).await?;
        server._folder = Some(folder);
        Ok(server)
    }

    /// The LiteLLM proxy with `config` (its folder is the working directory, so a callback module
    /// next to it is found).
    pub async fn litellm(config: &Path) -> anyhow::Result<Self> {
        let binary = installed("litellm/bin/litellm")?;
        let port = free_port()?;
        let mut command = Command::new(binary);
        command
            .arg("--config")
            .arg(config)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .env("LITELLM_TELEMETRY", "False")
            .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            .env("NO_DOCS", "True");
        if let Some(dir) = config.parent() {
            command.current_dir(dir).env("PYTHONPATH", dir);
        }
        Self::spawn(command, port, "/health/liveliness").await
    }

    async fn spawn(mut command: Command, port: u16, health: &str) -> anyhow::Result<Self> {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let log = Arc::new(Mutex::new(VecDeque::new()));
        if let Some(out) = child.stdout.take() {
            keep_lines(out, Arc::clone(&log));
        }
        if let Some(err) = child.stderr.take() {
            keep_lines(err, Arc::clone(&log));
        }
        let server = Self {
            origin: format!("http://127.0.0.1:{port}"),
            child,
            log,
            http: reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?,
            _folder: None,
        };
        server.wait_healthy(health).await?;
        Ok(server)
    }

    /// The OpenAI-compatible base URL (`…/v1`).
    pub fn base_url(&self) -> String {
        format!("{}/v1", self.origin)
    }

    async fn wait_healthy(&self, path: &str) -> anyhow::Result<()> {
        let started = std::time::Instant::now();
        loop {
            if let Ok(response) = self.http.get(format!("{}{path}", self.origin)).send().await
                && response.status().is_success()
            {
                return Ok(());
            }
            anyhow::ensure!(
                started.elapsed() < START_LIMIT,
                "the model server did not become healthy within {START_LIMIT:?}:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// GET `path` as JSON.
    pub async fn get_json(&self, path: &str) -> anyhow::Result<Value> {
        let response = self.http.get(format!("{}{path}", self.origin)).send().await?;
        let status = response.status();
        let body = response.bytes().await?;
        anyhow::ensure!(
            status.is_success(),
            "GET {path}: {status}: {}",
            String::from_utf8_lossy(&body)
        );
        Ok(serde_json::from_slice(&body)?)
    }

    /// POST `body` to `path` with `headers`; the status and the body as text.
    pub async fn post(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> anyhow::Result<(u16, String)> {
        let mut request = self
            .http
            .post(format!("{}{path}", self.origin))
            .header("content-type", "application/json")
            .body(body.to_string());
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = request.send().await?;
        let status = response.status().as_u16();
        Ok((status, response.text().await?))
    }

    /// The last lines the server logged.
    pub fn logs(&self) -> String {
        let log = shared::sync::lock(&self.log);
        log.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    /// The server's process id (none once it has been reaped), to read its CPU time.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

/// A port that was free a moment ago (the servers take a port number, not a listener).
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Keeps the last [`KEPT_LOG_LINES`] lines of `stream` in `log`.
fn keep_lines(stream: impl AsyncRead + Unpin + Send + 'static, log: Arc<Mutex<VecDeque<String>>>) {
    tokio::spawn(async move {
        let mut lines = BufReader::new(stream).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let mut log = shared::sync::lock(&log);
            if log.len() == KEPT_LOG_LINES {
                log.pop_front();
            }
            log.push_back(line);
        }
    });
}

/// Most request bytes a [`Relay`] keeps.
const RELAY_MAX_RECORDED: usize = 16 * 1024 * 1024;

/// A TCP relay in front of a model server that records the bodies of the HTTP/1.1 requests it
/// passes on, so a test sees exactly what the orchestrator sent.
pub struct Relay {
    addr: std::net::SocketAddr,
    bodies: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// Relays 127.0.0.1:(any port) to `origin` (`http://host:port`).
    pub async fn start(origin: &str) -> anyhow::Result<Self> {
        let upstream = origin.trim_start_matches("http://").to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let recorded = Arc::clone(&bodies);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(relay_connection(client, upstream.clone(), Arc::clone(&recorded)));
            }
        });
        Ok(Self { addr, bodies, task })
    }

    /// The base URL to give the orchestrator (`…/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The bodies of the requests relayed so far, in order.
    pub fn requests(&self) -> Vec<String> {
        shared::sync::lock(&self.bodies).clone()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies one connection both ways, taking the request bodies out of what the client sends, until
/// either side closes.
async fn relay_connection(client: tokio::net::TcpStream, upstream: String, bodies: Arc<Mutex<Vec<String>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let up = async {
        let mut buffer = vec![0u8; 16 * 1024];
        let mut pending = Vec::new();
        let mut recorded = 0usize;
        loop {
            let n = client_read.read(&mut buffer).await?;
            if n == 0 {
                return server_write.shutdown().await;
            }
            if recorded < RELAY_MAX_RECORDED {
                recorded += n;
                pending.extend_from_slice(&buffer[..n]);
                take_bodies(&mut pending, &bodies);
            }
            server_write.write_all(&buffer[..n]).await?;
        }
    };
    let down = tokio::io::copy(&mut server_read, &mut client_write);
    // Either side closing closes both: a server that closes after a response must not leave the
    // client writing its next request into a dead connection.
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

/// Moves every whole request (head + `Content-Length` body) at the start of `pending` to `bodies`.
fn take_bodies(pending: &mut Vec<u8>, bodies: &Mutex<Vec<String>>) {
    while let Some(head_end) = pending.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4) {
        let head = String::from_utf8_lossy(&pending[..head_end]).to_ascii_lowercase();
        let length = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        if pending.len() < head_end + length {
            return;
        }
        let body = String::from_utf8_lossy(&pending[head_end..head_end + length]).into_owned();
        shared::sync::lock(bodies).push(body);
        pending.drain(..head_end + length);
    }
}
