//! Planted secrets never show. Every credential the orchestrator holds gets a unique value: the
//! LLM API key, an `LLM_HEADERS` value, the password and a query key in `LLM_BASE_URL`, the
//! password of the NATS user in the signal topic's and result store's URL, and a caller's bearer
//! token (plus a wrong one a caller tries). Then, with `RUST_LOG=debug`, the real binary:
//!
//! * completes a run with a tool call and a signal on a NATS server that requires that password,
//!   on the stand-in model;
//! * meets an LLM gateway that echoes the request's headers into its error message, one that
//!   redirects to another origin (whose listener must see no connection at all), one that
//!   redirects within its origin (followed, and echoing again), and a closed port;
//! * refuses flags holding credentials at start.
//!
//! Then every output is searched for every secret: each log line of both processes, every span
//! they exported, `/metrics`, every event and status a caller received, and the start errors.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use mock_llm::{MockLlm, Scenario, Step, Turn};
use proto::orchestrator::v1 as pb;
use serde_json::json;
use testkit::Service;
use testkit::nats::Nats;
use testkit::otlp::Collector;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::Command;

type TestResult = anyhow::Result<()>;

const API_KEY: &str = "sk-PLANTED-api-key-5d1c";
const HEADER_VALUE: &str = "PLANTED-header-value-77ae";
const URL_PASSWORD: &str = "PLANTED-url-password-0b3e";
const URL_QUERY_KEY: &str = "PLANTED-query-key-c4f2";
const NATS_PASSWORD: &str = "PLANTED-nats-password-9e61";
const CALLER_TOKEN: &str = "PLANTED-caller-token-2a87";
const WRONG_TOKEN: &str = "PLANTED-wrong-token-6b05";

const SECRETS: [&str; 7] = [
    API_KEY,
    HEADER_VALUE,
    URL_PASSWORD,
    URL_QUERY_KEY,
    NATS_PASSWORD,
    CALLER_TOKEN,
    WRONG_TOKEN,
];

/// Everything the test saw, to be searched for the secrets at the end.
#[derive(Default)]
struct Outputs(Vec<(String, String)>);

impl Outputs {
    fn add(&mut self, source: &str, text: impl Into<String>) {
        self.0.push((source.to_owned(), text.into()));
    }

    fn assert_no_secret(&self) {
        for (source, text) in &self.0 {
            for secret in SECRETS {
                assert!(
                    !text.contains(secret),
                    "{secret} leaked into {source}:\n{}",
                    text.lines()
                        .filter(|l| l.contains(secret))
                        .collect::<Vec<_>>()
                        .join("\n")
                );
            }
        }
    }
}

/// The orchestrator binary with every LLM credential planted and debug logs, exporting spans.
fn orchestrator(llm_host: &str, otlp: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_orchestrator"));
    command
        .env("RUST_LOG", "debug")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", otlp)
        .env_remove("OTEL_SERVICE_NAME")
        .env(
            "LLM_BASE_URL",
            format!("http://svc:{URL_PASSWORD}@{llm_host}/v1?key={URL_QUERY_KEY}"),
        )
        .env("LLM_API_KEY", API_KEY)
        .env("LLM_HEADERS", format!("X-Gateway-Key: {HEADER_VALUE}; X-Tenant: t1"))
        .env("LLM_MAX_RETRIES", "0");
    command
}

/// A caller's request with `token`.
fn with_token<T>(token: &str, request: T) -> anyhow::Result<tonic::Request<T>> {
    let mut request = tonic::Request::new(request);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse()?);
    Ok(request)
}

/// Runs a request to its end, keeping every event (or the refusal) in `outputs`; the result.
async fn run_recorded(
    endpoint: &str,
    request: tonic::Request<pb::OrchestrateRequest>,
    outputs: &mut Outputs,
) -> anyhow::Result<Option<pb::RunResult>> {
    let mut client = pb::orchestrator_client::OrchestratorClient::connect(endpoint.to_owned()).await?;
    let mut stream = match client.orchestrate(request).await {
        Ok(response) => response.into_inner(),
        Err(status) => {
            outputs.add("a refusal", format!("{status:?}"));
            return Ok(None);
        }
    };
    let mut result = None;
    while let Some(event) = tokio::time::timeout(Duration::from_secs(30), stream.message()).await?? {
        outputs.add("an event", format!("{event:?}"));
        if let Some(pb::orchestrate_event::Event::RunFinished(f)) = event.event {
            result = f.result;
        }
    }
    Ok(result)
}

/// A misbehaving LLM gateway, by the request's model: `echo` answers 401 with every request
/// header in its error message; `elsewhere` redirects (307) to another origin; `hop` redirects
/// within its origin to a path that echoes. It keeps each request head it got.
struct Gateway {
    address: String,
    heads: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Gateway {
    async fn start(elsewhere: String) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?.to_string();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let kept = Arc::clone(&heads);
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(answer(stream, elsewhere.clone(), Arc::clone(&kept)));
            }
        });
        Ok(Self { address, heads, task })
    }
}

/// Reads one HTTP/1.1 request (head and `Content-Length` body).
async fn read_request(stream: &mut TcpStream) -> anyhow::Result<(String, serde_json::Value)> {
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    let head_end = loop {
        let n = stream.read(&mut buf).await?;
        anyhow::ensure!(n > 0 && data.len() < 1 << 20, "incomplete request");
        data.extend_from_slice(&buf[..n]);
        if let Some(i) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&data[..head_end]).into_owned();
    let length: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().to_owned())
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    while data.len() < head_end + length {
        let n = stream.read(&mut buf).await?;
        anyhow::ensure!(n > 0, "incomplete body");
        data.extend_from_slice(&buf[..n]);
    }
    Ok((head, serde_json::from_slice(&data[head_end..]).unwrap_or_default()))
}

async fn answer(mut stream: TcpStream, elsewhere: String, heads: Arc<Mutex<Vec<String>>>) {
    let Ok((head, body)) = read_request(&mut stream).await else {
        return;
    };
    if let Ok(mut heads) = heads.lock() {
        heads.push(head.clone());
    }
    let echo = json!({"error": {"message": format!("bad credentials; you sent:\n{head}")}}).to_string();
    let (status, location, body) = if head.starts_with("POST /hop/") {
        (
            "401 Unauthorized",
            String::new(),
            format!("{{\"error\":{{\"message\":\"hopped\"}}}}{echo}"),
        )
    } else {
        match body["model"].as_str() {
            Some("echo") => ("401 Unauthorized", String::new(), echo),
            Some("elsewhere") => (
                "307 Temporary Redirect",
                format!("Location: http://{elsewhere}/v1/chat/completions\r\n"),
                String::new(),
            ),
            Some("hop") => (
                "307 Temporary Redirect",
                "Location: /hop/v1/chat/completions\r\n".to_owned(),
                String::new(),
            ),
            _ => ("400 Bad Request", String::new(), "{}".to_owned()),
        }
    };
    let response = format!(
        "HTTP/1.1 {status}\r\n{location}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

#[tokio::test]
async fn planted_secrets_never_show_in_logs_spans_metrics_or_errors() -> TestResult {
    let mut outputs = Outputs::default();
    let (collector, otlp) = Collector::start().await?;
    completed_run_on_nats_with_credentials(&otlp, &mut outputs).await?;
    llm_gateways_that_echo_redirect_or_vanish(&otlp, &mut outputs).await?;
    start_errors_hide_credentials(&mut outputs).await?;
    // Spans are exported in batches; both services have stopped (flushing them) by now.
    let spans = collector.0.lock().map(|s| format!("{s:?}")).unwrap_or_default();
    anyhow::ensure!(spans.contains("invoke_agent"), "no spans were exported");
    outputs.add("the exported spans", spans);
    outputs.assert_no_secret();
    Ok(())
}

/// A whole run (a tool call, a signal) with every credential in use: the NATS server refuses a
/// client without the password, and a caller needs the token.
async fn completed_run_on_nats_with_credentials(otlp: &str, outputs: &mut Outputs) -> TestResult {
    let nats = Nats::start_authenticated("orchestrator", NATS_PASSWORD).await?;
    let mock = MockLlm::start(Scenario::new(vec![
        Turn::text("Working.\n")
            .then(Step::call("calculate", json!({"expression": "6*7"})))
            .then(Step::call("submit_report", json!({"summary": "42"}))),
        Turn::text("Done."),
    ]))
    .await?;
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens.toml");
    std::fs::write(
        &tokens,
        format!(
            "[[token]]\nprincipal = \"svc-a\"\nsha256 = \"{}\"\n",
            shared::auth::token_sha256(CALLER_TOKEN)
        ),
    )?;
    let runner = testkit::tool_runner_in_process().await?;
    let llm_host = mock
        .base_url()
        .trim_start_matches("http://")
        .trim_end_matches("/v1")
        .to_owned();
    let mut command = orchestrator(&llm_host, otlp);
    command
        .env("TOOL_RUNNER_ENDPOINTS", &runner)
        .env("ORCHESTRATOR_EXIT_TOOLS", "submit_report")
        .env("ORCHESTRATOR_SIGNAL_TOPIC", nats.url())
        .env("ORCHESTRATOR_RUN_STORE", nats.url())
        .env("ORCHESTRATOR_AUTH_TOKENS", &tokens);
    let service = Service::orchestrator(command).await?;
    let endpoint = format!("http://{}", service.grpc);

    let request = testkit::user("compute");
    let result = run_recorded(&endpoint, with_token(CALLER_TOKEN, request.clone())?, outputs)
        .await?
        .ok_or_else(|| anyhow::anyhow!("the run was refused"))?;
    assert_eq!(result.status(), pb::RunStatus::Completed, "{result:?}");
    assert_eq!(result.signals.len(), 1, "{result:?}");
    let refused = run_recorded(&endpoint, with_token(WRONG_TOKEN, request)?, outputs).await?;
    assert!(refused.is_none(), "a wrong token was served");
    let mut client = pb::orchestrator_client::OrchestratorClient::connect(endpoint).await?;
    let get = with_token(
        CALLER_TOKEN,
        pb::GetRunRequest {
            run_id: result.run_id.clone(),
        },
    )?;
    outputs.add("GetRun", format!("{:?}", client.get_run(get).await?.into_inner()));
    anyhow::ensure!(!mock.requests().is_empty(), "the model got no request");
    let logs = stop_and_collect(service, outputs).await?;
    anyhow::ensure!(logs.contains("\"level\":\"DEBUG\""), "no debug-level log lines");
    Ok(())
}

/// A gateway that echoes credentials, one that redirects to another origin, a same-origin
/// redirect, then a closed port: each run FAILS with LLM_ERROR, its message scrubbed.
async fn llm_gateways_that_echo_redirect_or_vanish(otlp: &str, outputs: &mut Outputs) -> TestResult {
    let elsewhere = TcpListener::bind("127.0.0.1:0").await?;
    let elsewhere_address = elsewhere.local_addr()?.to_string();
    let gateway = Gateway::start(elsewhere_address).await?;
    let mut command = orchestrator(&gateway.address, otlp);
    command.env("TOOL_RUNNER_ENDPOINTS", testkit::tool_runner_in_process().await?);
    let service = Service::orchestrator(command).await?;
    let endpoint = format!("http://{}", service.grpc);
    let run = |model: &str| pb::OrchestrateRequest {
        model: model.into(),
        ..testkit::user("hi")
    };

    let echoed = failed_run(&endpoint, run("echo"), outputs).await?;
    assert!(
        echoed.contains("the LLM server answered 401") && echoed.contains("***"),
        "{echoed}"
    );
    let heads = gateway.heads.lock().map(|h| h.join("\n")).unwrap_or_default();
    assert!(
        heads.contains(API_KEY) && heads.contains(HEADER_VALUE),
        "the gateway did not get the credentials: {heads}"
    );

    let redirected = failed_run(&endpoint, run("elsewhere"), outputs).await?;
    assert!(redirected.contains("redirecting to another origin"), "{redirected}");
    let reached = tokio::time::timeout(Duration::from_millis(300), elsewhere.accept()).await;
    assert!(reached.is_err(), "the redirect to another origin was followed");

    let hopped = failed_run(&endpoint, run("hop"), outputs).await?;
    assert!(
        hopped.contains("hopped"),
        "a same-origin redirect was not followed: {hopped}"
    );

    gateway.task.abort();
    // The gateway's port refuses connections once its task is gone.
    testkit::wait::until("the gateway's port to refuse", Duration::from_secs(10), || async {
        TcpStream::connect(gateway.address.as_str())
            .await
            .is_err()
            .then_some(())
    })
    .await?;
    let unreachable = failed_run(&endpoint, run("echo"), outputs).await?;
    assert!(
        unreachable.contains("cannot reach the LLM server at http://***@127.0.0.1"),
        "{unreachable}"
    );
    stop_and_collect(service, outputs).await?;
    Ok(())
}

/// A run that must fail with LLM_ERROR; its error message.
async fn failed_run(endpoint: &str, request: pb::OrchestrateRequest, outputs: &mut Outputs) -> anyhow::Result<String> {
    let result = run_recorded(endpoint, tonic::Request::new(request), outputs)
        .await?
        .ok_or_else(|| anyhow::anyhow!("the run was refused"))?;
    assert_eq!(result.status(), pb::RunStatus::Failed, "{result:?}");
    assert_eq!(result.failure_reason(), pb::FailureReason::LlmError, "{result:?}");
    Ok(result.failure_detail)
}

/// Flags holding credentials that the orchestrator refuses at start (exit 2) or cannot use
/// (exit 1): the message names the problem, not the secret.
async fn start_errors_hide_credentials(outputs: &mut Outputs) -> TestResult {
    let bin = env!("CARGO_BIN_EXE_orchestrator");
    let header = format!("X-Gateway-Key {HEADER_VALUE}");
    let bad_scheme = format!("natz://u:{NATS_PASSWORD}@127.0.0.1:1");
    let closed = format!("nats://u:{NATS_PASSWORD}@127.0.0.1:1");
    let cases = [
        (("LLM_HEADERS", &header), 2, "--llm-header entry 1 is not `Name: value`"),
        (("ORCHESTRATOR_SIGNAL_TOPIC", &bad_scheme), 2, "use memory or nats://"),
        (
            ("ORCHESTRATOR_SIGNAL_TOPIC", &closed),
            1,
            "cannot connect to NATS at nats://127.0.0.1:1",
        ),
    ];
    for ((name, value), code, message) in cases {
        let mut command = Command::new(bin);
        command.env("RUST_LOG", "debug").env("LLM_API_KEY", API_KEY);
        let (exit, stdout, stderr) = testkit::run_to_end(
            command,
            &["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"],
            &[(name, value.as_str())],
        )
        .await?;
        assert_eq!(exit, Some(code), "{stderr}");
        assert!(stderr.contains(message), "{stderr}");
        outputs.add("a start error", format!("{stdout}{stderr}"));
    }
    Ok(())
}

/// Keeps a service's `/metrics`, stops it (SIGTERM: it flushes its spans) and keeps its log,
/// which it returns.
async fn stop_and_collect(mut service: Service, outputs: &mut Outputs) -> anyhow::Result<String> {
    let metrics = reqwest::get(format!("http://{}/metrics", service.metrics));
    outputs.add("/metrics", metrics.await?.text().await?);
    service.signal(nix::sys::signal::Signal::SIGTERM)?;
    service.wait_exit().await?;
    let logs = service.logs().join("\n");
    outputs.add("the logs", logs.clone());
    Ok(logs)
}
