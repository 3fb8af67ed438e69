//! The fault matrix: one test per fault, each against a real orchestrator process. Every test
//! checks the run's terminal status and reason, that the output produced before the fault is
//! kept (in the stream and in `GetRun`), that the run's slot is freed and the in-flight gauges
//! are back to 0, that nothing panicked, and that the process goes on serving a normal run.
//!
//! Every LLM fault is played to both readers of the model's socket (`--llm-reader run`, the
//! `paced-http1` crate, and `pooled`, the shared client https and proxies use).
//!
//! LLM faults come from the stand-in model (scripted per model name) or, for what it cannot do
//! (a stall before the headers, an error body that never ends, a reset connection, a
//! `Retry-After`), from a raw HTTP server here that plays one fault per connection and then
//! answers normally.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mock_llm::{MockLlm, Scenario, Scenarios, Step, Turn};
use proto::orchestrator::v1 as pb;
use proto::toolrunner::v1 as tr;
use testkit::nats::Nats;
use testkit::{Service, scrape, user};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::Command;

type TestResult = anyhow::Result<()>;

/// An orchestrator process on `llm` and `runner`, with short timeouts so faults show quickly
/// (from the environment, so `extra` flags can override them).
async fn orchestrator(llm: &str, runner: &str, extra: &[&str]) -> anyhow::Result<Service> {
    let mut command = testkit::orchestrator_command(env!("CARGO_BIN_EXE_orchestrator"), llm, runner);
    command
        .env("LLM_IDLE_TIMEOUT", "1s")
        .env("LLM_MAX_RETRIES", "1")
        .env("LLM_RETRY_BACKOFF", "50ms")
        .args(extra);
    Service::orchestrator(command).await
}

async fn client(
    service: &Service,
) -> anyhow::Result<pb::orchestrator_client::OrchestratorClient<tonic::transport::Channel>> {
    Ok(pb::orchestrator_client::OrchestratorClient::connect(format!("http://{}", service.grpc)).await?)
}

async fn get_run(
    client: &mut pb::orchestrator_client::OrchestratorClient<tonic::transport::Channel>,
    run_id: impl Into<String>,
) -> anyhow::Result<pb::RunResult> {
    let request = pb::GetRunRequest { run_id: run_id.into() };
    Ok(client.get_run(request).await?.into_inner())
}

/// A run as its caller saw it: the text of its deltas and its final result.
struct Seen {
    text: String,
    result: pb::RunResult,
}

/// A run being watched as its caller reads it.
struct Watch {
    stream: tonic::Streaming<pb::OrchestrateEvent>,
    text: String,
}

impl Watch {
    async fn start(service: &Service, request: pb::OrchestrateRequest) -> anyhow::Result<Self> {
        let stream = client(service).await?.orchestrate(request).await?.into_inner();
        Ok(Self {
            stream,
            text: String::new(),
        })
    }

    /// The next event, keeping the text; `None` at `run_finished` or the end of the stream.
    async fn next(&mut self) -> anyhow::Result<Option<pb::orchestrate_event::Event>> {
        let Some(event) = self.stream.message().await? else {
            return Ok(None);
        };
        if let Some(pb::orchestrate_event::Event::TextDelta(d)) = &event.event {
            self.text.push_str(&d.text);
        }
        Ok(event.event)
    }

    /// Reads until a tool call has started.
    async fn until_call_started(&mut self) -> TestResult {
        while let Some(event) = self.next().await? {
            if matches!(event, pb::orchestrate_event::Event::ToolCallStarted(_)) {
                return Ok(());
            }
        }
        anyhow::bail!("the stream ended before a tool call started")
    }

    /// Reads to `run_finished`.
    async fn finish(mut self) -> anyhow::Result<Seen> {
        while let Some(event) = self.next().await? {
            if let pb::orchestrate_event::Event::RunFinished(f) = event {
                let result = f
                    .result
                    .ok_or_else(|| anyhow::anyhow!("run_finished without a result"))?;
                return Ok(Seen {
                    text: self.text,
                    result,
                });
            }
        }
        anyhow::bail!("the stream ended without run_finished")
    }
}

async fn run(service: &Service, request: pb::OrchestrateRequest) -> anyhow::Result<Seen> {
    Watch::start(service, request).await?.finish().await
}

fn model(name: &str) -> pb::OrchestrateRequest {
    pb::OrchestrateRequest {
        model: name.into(),
        ..user("go")
    }
}

/// What every fault test ends with: status and reason as expected, the output kept in the stream
/// and in GetRun, gauges at 0, no panic, and a normal run (model `fine`) still completes.
async fn assert_fault(
    service: &Service,
    seen: &Seen,
    status: pb::RunStatus,
    reason: pb::FailureReason,
    kept: &str,
) -> TestResult {
    let r = &seen.result;
    assert_eq!(
        (r.status(), r.failure_reason()),
        (status, reason),
        "{}",
        r.failure_detail
    );
    assert!(r.text.contains(kept), "output kept: {:?} in {:?}", kept, r.text);
    assert_eq!(seen.text, r.text, "streamed text equals the result's");
    let mut client = client(service).await?;
    let stored = get_run(&mut client, r.run_id.clone()).await?;
    assert_eq!(&stored, r, "GetRun returns the same result");
    settled(service).await?;
    let after = run(service, model("fine")).await?;
    assert_eq!(
        after.result.status(),
        pb::RunStatus::Completed,
        "the process goes on serving"
    );
    assert!(
        !service.logs().iter().any(|l| l.contains("panicked")),
        "{:?}",
        service.logs()
    );
    Ok(())
}

/// In-flight gauges back to 0 (within a few seconds: the slot is freed after the final send).
async fn settled(service: &Service) -> TestResult {
    testkit::wait::until("the in-flight gauges back to 0", Duration::from_secs(5), || async {
        let metrics = scrape(&service.metrics).await.ok()?;
        let gauge = |name: &str| metrics.get(name).copied().unwrap_or(-1.0);
        let gauges = (
            gauge("orchestrator_runs_in_flight{}"),
            gauge("orchestrator_tool_calls_in_flight{}"),
        );
        (gauges == (0.0, 0.0)).then_some(())
    })
    .await
}

/// The stand-in model with a `fine` scenario and `name` → `scenario`.
async fn mock(name: &str, scenario: Scenario) -> anyhow::Result<MockLlm> {
    let mut scenarios = Scenarios::from(Scenario::new(vec![Turn::text("fine")]));
    scenarios.named.insert(name.to_owned(), scenario);
    scenarios
        .named
        .insert("fine".to_owned(), Scenario::new(vec![Turn::text("all good")]));
    Ok(MockLlm::start(scenarios).await?)
}

/// Who reads the model's socket (`--llm-reader`): the run's own task (`paced-http1`, the default
/// for plain http) and the shared client (https, proxies). Every LLM fault is played to both.
const READERS: [&str; 2] = ["run", "pooled"];

/// `extra`, reading the model with `reader`.
fn reading<'a>(reader: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut flags = vec!["--llm-reader", reader];
    flags.extend_from_slice(extra);
    flags
}

/// One scripted LLM fault on the stand-in model, checked end to end on both readers.
async fn scripted_fault(
    turn: Turn,
    extra: &[&str],
    status: pb::RunStatus,
    reason: pb::FailureReason,
    kept: &str,
) -> TestResult {
    for reader in READERS {
        let mock = mock("fault", Scenario::new(vec![turn.clone()])).await?;
        let runner = testkit::tool_runner_in_process().await?;
        let service = orchestrator(&mock.base_url(), &runner, &reading(reader, extra)).await?;
        let seen = run(&service, model("fault")).await?;
        assert_fault(&service, &seen, status, reason, kept)
            .await
            .map_err(|e| e.context(format!("--llm-reader {reader}")))?;
        service.stop().await?;
    }
    Ok(())
}

use pb::FailureReason as Reason;
use pb::RunStatus as Status;

#[tokio::test]
async fn llm_500_on_every_attempt() -> TestResult {
    let turn = Turn {
        fail_first: vec![500, 500],
        ..Turn::text("never")
    };
    scripted_fault(turn, &[], Status::Failed, Reason::LlmError, "").await
}

#[tokio::test]
async fn llm_500_then_success_is_retried() -> TestResult {
    let turn = Turn {
        fail_first: vec![503],
        ..Turn::text("after a retry")
    };
    for reader in READERS {
        let mock = mock("fault", Scenario::new(vec![turn.clone()])).await?;
        let runner = testkit::tool_runner_in_process().await?;
        let service = orchestrator(&mock.base_url(), &runner, &reading(reader, &[])).await?;
        let seen = run(&service, model("fault")).await?;
        assert_eq!(seen.result.status(), Status::Completed, "--llm-reader {reader}");
        assert_eq!(seen.result.text, "after a retry");
        settled(&service).await?;
        service.stop().await?;
    }
    Ok(())
}

#[tokio::test]
async fn llm_connection_reset_mid_text() -> TestResult {
    let turn = Turn::text("Half an answer").then(Step::Cut);
    scripted_fault(turn, &[], Status::Failed, Reason::LlmError, "Half an answer").await
}

#[tokio::test]
async fn llm_connection_reset_mid_tool_call() -> TestResult {
    let turn = Turn::text("Calling:")
        .then(Step::call("calculate", serde_json::json!({"expression": "1+1"})))
        .then(Step::Cut);
    scripted_fault(turn, &[], Status::Failed, Reason::LlmError, "Calling:").await
}

#[tokio::test]
async fn llm_stall_mid_stream() -> TestResult {
    let turn = Turn::text("Thinking out loud ```json\n{\"name\": \"calc").then(Step::Stall);
    scripted_fault(
        turn,
        &[],
        Status::Failed,
        Reason::LlmStreamStalled,
        "Thinking out loud ```json\n{\"name\": \"calc",
    )
    .await
}

#[tokio::test]
async fn llm_garbage() -> TestResult {
    let turn = Turn::text("Before the garbage. ").then(Step::Raw {
        sse: "data: {this is not json\n\n".into(),
    });
    scripted_fault(turn, &[], Status::Failed, Reason::LlmError, "Before the garbage. ").await
}

#[tokio::test]
async fn llm_endless_event() -> TestResult {
    let turn = Turn::text("Before the flood. ").then(Step::Raw {
        sse: "data: x\n".repeat(20_000),
    });
    scripted_fault(
        turn,
        &["--llm-max-line-bytes", "1024", "--llm-max-event-bytes", "65536"],
        Status::Failed,
        Reason::LlmError,
        "Before the flood. ",
    )
    .await
}

#[tokio::test]
async fn llm_error_event() -> TestResult {
    let turn = Turn::text("Partial. ").then(Step::Error {
        message: "model overloaded".into(),
    });
    scripted_fault(turn, &[], Status::Failed, Reason::LlmError, "Partial. ").await
}

/// What a raw connection does, before the server answers normally.
#[derive(Clone, Copy, Debug)]
enum Raw {
    /// Reads the request, never answers.
    StallBeforeHeaders,
    /// Answers 500 with a body that starts and never ends.
    ErrorBodyNeverEnds,
    /// Answers 429 with `Retry-After: 1`.
    RetryAfter,
    /// Streams some text, then resets the connection.
    ResetMidText,
    /// Answers with something that is not HTTP, then closes.
    NotHttp,
    /// Streams "all good" after a response head padded to this many bytes.
    LongHead(usize),
}

/// A raw HTTP/1.1 LLM server: plays `faults` on the first connections, then streams "all good".
async fn raw_llm(faults: Vec<Raw>) -> anyhow::Result<(String, Arc<Mutex<Vec<tokio::time::Instant>>>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/v1", listener.local_addr()?);
    let faults = Arc::new(Mutex::new(VecDeque::from(faults)));
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&arrivals);
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let fault = shared::sync::lock(&faults).pop_front();
            shared::sync::lock(&seen).push(tokio::time::Instant::now());
            tokio::spawn(serve_raw(socket, fault));
        }
    });
    Ok((url, arrivals))
}

async fn read_request(socket: &mut TcpStream) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = socket.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf);
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().to_owned())
                })
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + length {
                return Ok(());
            }
        }
    }
}

fn sse_text(text: &str) -> String {
    let chunk = serde_json::json!({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]});
    format!("data: {chunk}\n\n")
}

async fn serve_raw(mut socket: TcpStream, fault: Option<Raw>) -> std::io::Result<()> {
    read_request(&mut socket).await?;
    match fault {
        Some(Raw::StallBeforeHeaders) => std::future::pending::<()>().await,
        Some(Raw::ErrorBodyNeverEnds) => {
            let head = "HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
            let piece = "{\"error\": {\"message\": \"overloa";
            socket
                .write_all(format!("{head}{:x}\r\n{piece}\r\n", piece.len()).as_bytes())
                .await?;
            std::future::pending::<()>().await;
        }
        Some(Raw::RetryAfter) => {
            let body = "{\"error\": {\"message\": \"slow down\"}}";
            let answer = format!(
                "HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            socket.write_all(answer.as_bytes()).await?;
        }
        Some(Raw::ResetMidText) => {
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
            let piece = sse_text("Cut off in the mid");
            socket
                .write_all(format!("{head}{:x}\r\n{piece}\r\n", piece.len()).as_bytes())
                .await?;
            // Stays: the stand-in server's own pacing (the piece reaches the client before the
            // reset), not a wait for a condition.
            tokio::time::sleep(Duration::from_millis(100)).await;
            socket.set_zero_linger()?;
        }
        Some(Raw::NotHttp) => socket.write_all(b"SSH-2.0-OpenSSH_9.6\r\n").await?,
        Some(Raw::LongHead(bytes)) => {
            let body = format!("{}data: [DONE]\n\n", sse_text("all good"));
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n",
                body.len()
            );
            let padding = bytes.saturating_sub(head.len() + "x-padding: \r\n\r\n".len());
            let answer = format!("{head}x-padding: {}\r\n\r\n{body}", "p".repeat(padding));
            socket.write_all(answer.as_bytes()).await?;
        }
        None => {
            let body = format!("{}data: [DONE]\n\n", sse_text("all good"));
            let answer = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            socket.write_all(answer.as_bytes()).await?;
        }
    }
    Ok(())
}

/// One fault on the raw server, checked end to end (played once: a response that started, or
/// did not come in time, is not retried).
async fn raw_fault(fault: Raw, status: pb::RunStatus, reason: pb::FailureReason, kept: &str) -> TestResult {
    for reader in READERS {
        let (url, _) = raw_llm(vec![fault]).await?;
        let service = orchestrator(&url, &testkit::tool_runner_in_process().await?, &reading(reader, &[])).await?;
        let started = tokio::time::Instant::now();
        let seen = run(&service, user("go")).await?;
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "ended by the idle timeout, not the run's deadline (--llm-reader {reader})"
        );
        assert_fault(&service, &seen, status, reason, kept)
            .await
            .map_err(|e| e.context(format!("--llm-reader {reader}")))?;
        service.stop().await?;
    }
    Ok(())
}

#[tokio::test]
async fn llm_stall_before_headers() -> TestResult {
    raw_fault(Raw::StallBeforeHeaders, Status::Failed, Reason::LlmStreamStalled, "").await
}

#[tokio::test]
async fn llm_error_body_that_never_ends() -> TestResult {
    for reader in READERS {
        let (url, _) = raw_llm(vec![Raw::ErrorBodyNeverEnds, Raw::ErrorBodyNeverEnds]).await?;
        let service = orchestrator(&url, &testkit::tool_runner_in_process().await?, &reading(reader, &[])).await?;
        let seen = run(&service, user("go")).await?;
        assert!(
            seen.result.failure_detail.contains("500") && seen.result.failure_detail.contains("did not arrive"),
            "--llm-reader {reader}: {}",
            seen.result.failure_detail
        );
        assert_fault(&service, &seen, Status::Failed, Reason::LlmError, "").await?;
        service.stop().await?;
    }
    Ok(())
}

/// A model server that does not answer in HTTP/1.1 ends the run `LLM_ERROR` saying so (not
/// retried: something answered).
#[tokio::test]
async fn llm_answer_that_is_not_http() -> TestResult {
    for (reader, says) in [
        ("run", "not valid HTTP/1.1"),
        ("pooled", "request to the LLM server failed"),
    ] {
        let (url, arrivals) = raw_llm(vec![Raw::NotHttp]).await?;
        let service = orchestrator(&url, &testkit::tool_runner_in_process().await?, &reading(reader, &[])).await?;
        let seen = run(&service, user("go")).await?;
        let detail = &seen.result.failure_detail;
        assert!(detail.contains(says), "--llm-reader {reader}: {detail}");
        assert_eq!(
            shared::sync::lock(&arrivals).len(),
            1,
            "not retried (--llm-reader {reader})"
        );
        assert_fault(&service, &seen, Status::Failed, Reason::LlmError, "").await?;
        service.stop().await?;
    }
    Ok(())
}

/// `--llm-max-line-bytes` bounds the model's response head too: a head under it streams, one
/// over it ends the run `LLM_ERROR`.
#[tokio::test]
async fn a_response_head_is_bounded_by_llm_max_line_bytes() -> TestResult {
    let (url, _) = raw_llm(vec![Raw::LongHead(4000), Raw::LongHead(4200)]).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let service = orchestrator(&url, &runner, &["--llm-max-line-bytes", "4096"]).await?;
    let under = run(&service, user("go")).await?;
    assert_eq!(
        under.result.status(),
        Status::Completed,
        "{}",
        under.result.failure_detail
    );
    assert_eq!(under.result.text, "all good");
    let over = run(&service, user("go")).await?;
    let detail = &over.result.failure_detail;
    assert!(detail.contains("longer than 4096 bytes"), "{detail}");
    assert_fault(&service, &over, Status::Failed, Reason::LlmError, "").await?;
    service.stop().await
}

/// The shared client (`--llm-reader pooled`, as for https or a proxy) bounds a response head by
/// hyper's own read buffer (about 400 KiB), not by `--llm-max-line-bytes`: a head over that ends
/// the run `LLM_ERROR`, never a buffer that grows without end.
#[tokio::test]
async fn the_pooled_reader_bounds_a_response_head_by_its_read_buffer() -> TestResult {
    let (url, _) = raw_llm(vec![Raw::LongHead(600_000)]).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let service = orchestrator(&url, &runner, &reading("pooled", &[])).await?;
    let over = run(&service, user("go")).await?;
    assert_fault(&service, &over, Status::Failed, Reason::LlmError, "").await?;
    service.stop().await
}

#[tokio::test]
async fn llm_reset_mid_text_on_the_wire() -> TestResult {
    raw_fault(
        Raw::ResetMidText,
        Status::Failed,
        Reason::LlmError,
        "Cut off in the mid",
    )
    .await
}

#[tokio::test]
async fn llm_429_with_retry_after_is_honoured() -> TestResult {
    for reader in READERS {
        let (url, arrivals) = raw_llm(vec![Raw::RetryAfter]).await?;
        let service = orchestrator(&url, &testkit::tool_runner_in_process().await?, &reading(reader, &[])).await?;
        let seen = run(&service, user("go")).await?;
        assert_eq!(
            (seen.result.status(), seen.result.text.as_str()),
            (Status::Completed, "all good"),
            "--llm-reader {reader}"
        );
        let arrivals = shared::sync::lock(&arrivals).clone();
        assert!(
            arrivals.len() >= 2 && arrivals[1] - arrivals[0] >= Duration::from_millis(900),
            "the retry waited Retry-After (1s), not the 50ms backoff (--llm-reader {reader})"
        );
        service.stop().await?;
    }
    Ok(())
}

#[tokio::test]
async fn llm_connection_refused() -> TestResult {
    for reader in READERS {
        let closed = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/v1", closed.local_addr()?);
        drop(closed);
        let service = orchestrator(&url, &testkit::tool_runner_in_process().await?, &reading(reader, &[])).await?;
        let seen = run(&service, user("go")).await?;
        let r = &seen.result;
        assert_eq!(
            (r.status(), r.failure_reason()),
            (Status::Failed, Reason::LlmError),
            "--llm-reader {reader}"
        );
        assert!(r.failure_detail.contains("cannot reach"), "{}", r.failure_detail);
        settled(&service).await?;
        service.stop().await?;
    }
    Ok(())
}

#[tokio::test]
async fn no_tool_runner_answering_is_unavailable_not_a_run_without_tools() -> TestResult {
    // A black hole: accepts connections, never answers.
    let hole = TcpListener::bind("127.0.0.1:0").await?;
    let runner = format!("http://{}", hole.local_addr()?);
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = hole.accept().await {
            held.push(socket);
        }
    });
    let mock = mock("fault", Scenario::new(vec![Turn::text("unused")])).await?;
    let service = orchestrator(&mock.base_url(), &runner, &[]).await?;
    let mut client = client(&service).await?;
    let status = client.orchestrate(model("fault")).await.err();
    let status = status.ok_or_else(|| anyhow::anyhow!("a run started without tools"))?;
    assert_eq!(status.code(), tonic::Code::Unavailable, "{}", status.message());
    assert!(
        status.message().contains("no tool-runner answers"),
        "{}",
        status.message()
    );
    assert!(mock.requests().is_empty(), "the model was never asked");
    settled(&service).await?;
    service.stop().await
}

#[tokio::test]
async fn a_slow_tool_times_out_and_the_run_goes_on() -> TestResult {
    let turns = vec![
        Turn::text("Waiting.\n").then(Step::call("sleep", serde_json::json!({"ms": 5000}))),
        Turn::text("The wait timed out."),
    ];
    let mock = mock("fault", Scenario::new(turns)).await?;
    let service = orchestrator(&mock.base_url(), &testkit::tool_runner_in_process().await?, &[]).await?;
    let request = pb::OrchestrateRequest {
        limits: Some(pb::RunLimits {
            tool_timeout_ms: Some(300),
            ..Default::default()
        }),
        ..model("fault")
    };
    let seen = run(&service, request).await?;
    let r = &seen.result;
    assert_eq!(r.status(), Status::Completed);
    assert_eq!(r.tool_calls[0].error.as_ref().map(|e| e.code.as_str()), Some("TIMEOUT"));
    assert_eq!(r.text, "Waiting.\nThe wait timed out.");
    settled(&service).await?;
    service.stop().await
}

#[tokio::test]
async fn a_caller_deadline_ends_the_run_deadline_exceeded_not_canceled() -> TestResult {
    let turns = vec![Turn::text("Starting.\n").then(Step::call("sleep", serde_json::json!({"ms": 10_000})))];
    let mock = mock("fault", Scenario::new(turns)).await?;
    let service = orchestrator(&mock.base_url(), &testkit::tool_runner_in_process().await?, &[]).await?;
    let mut request = tonic::Request::new(pb::OrchestrateRequest {
        run_id: "with-a-deadline".into(),
        ..model("fault")
    });
    request.set_timeout(Duration::from_secs(2));
    let mut client = client(&service).await?;
    let mut stream = client.orchestrate(request).await?.into_inner();
    let mut last = None;
    while let Ok(Some(event)) = stream.message().await {
        last = event.event;
    }
    let Some(pb::orchestrate_event::Event::RunFinished(finished)) = last else {
        anyhow::bail!("the caller did not get run_finished before its deadline: {last:?}")
    };
    let result = finished.result.unwrap_or_default();
    assert_eq!(
        (result.status(), result.failure_reason()),
        (Status::Failed, Reason::DeadlineExceeded)
    );
    let stored = get_run(&mut client, "with-a-deadline").await?;
    assert_eq!(stored.failure_reason(), Reason::DeadlineExceeded);
    assert_eq!(stored.text, "Starting.\n");
    settled(&service).await?;
    service.stop().await
}

#[tokio::test]
async fn a_caller_that_goes_away_cancels_its_run() -> TestResult {
    let turns = vec![Turn::text("Starting.\n").then(Step::call("sleep", serde_json::json!({"ms": 10_000})))];
    let mock = mock("fault", Scenario::new(turns)).await?;
    let service = orchestrator(&mock.base_url(), &testkit::tool_runner_in_process().await?, &[]).await?;
    let mut client = client(&service).await?;
    let mut stream = client
        .orchestrate(pb::OrchestrateRequest {
            run_id: "left".into(),
            ..model("fault")
        })
        .await?
        .into_inner();
    while let Some(event) = stream.message().await? {
        if matches!(event.event, Some(pb::orchestrate_event::Event::ToolCallStarted(_))) {
            break;
        }
    }
    drop(stream);
    settled(&service).await?;
    let stored = get_run(&mut client, "left").await?;
    assert_eq!(stored.status(), Status::Canceled);
    assert_eq!(stored.text, "Starting.\n");
    service.stop().await
}

#[tokio::test]
async fn a_caller_that_stops_reading_is_given_up_within_the_send_timeout() -> TestResult {
    // ~7 MB of distinct lines in 2 KiB chunks: more than the HTTP/2 window and the event buffer hold.
    let text: String = (0..200_000)
        .map(|i| format!("line {i} of the output nobody reads\n"))
        .collect();
    let turn = Turn {
        steps: vec![Step::Text {
            text,
            chunk_chars: Some(2048),
        }],
        ..Turn::default()
    };
    let mock = mock("fault", Scenario::new(vec![turn])).await?;
    let service = orchestrator(
        &mock.base_url(),
        &testkit::tool_runner_in_process().await?,
        &[
            "--event-send-timeout",
            "1s",
            "--event-buffer",
            "4",
            "--llm-idle-timeout",
            "60s",
            "--max-output-bytes",
            "16777216",
        ],
    )
    .await?;
    // The result keeps what the run read before its caller was given up: up to the 16 MiB
    // of output allowed here.
    let mut client = client(&service).await?.max_decoding_message_size(32 << 20);
    let stream = client
        .orchestrate(pb::OrchestrateRequest {
            run_id: "not-reading".into(),
            ..model("fault")
        })
        .await?
        .into_inner();
    let stored = testkit::wait::until("the run to end", Duration::from_secs(60), || {
        let mut client = client.clone();
        async move {
            let r = get_run(&mut client, "not-reading").await.ok()?;
            (r.status() != Status::Running).then_some(r)
        }
    })
    .await?;
    assert_eq!(stored.status(), Status::Canceled, "{}", stored.failure_detail);
    assert!(
        stored.failure_detail.contains("stopped reading"),
        "{}",
        stored.failure_detail
    );
    settled(&service).await?;
    drop(stream);
    service.stop().await
}

// ---- tool-runner faults -------------------------------------------------------------------

fn runner_command(extra: &[&str]) -> anyhow::Result<Command> {
    let mut command = Command::new(testkit::tool_runner_bin!()?);
    command.args(extra).env_remove("OTEL_EXPORTER_OTLP_ENDPOINT");
    Ok(command)
}

/// The error codes of a result's failed tool calls, in call order.
fn failed_calls(seen: &Seen) -> Vec<String> {
    seen.result
        .tool_calls
        .iter()
        .filter_map(|c| c.error.as_ref().map(|e| format!("{}: {}", e.code, e.message)))
        .collect()
}

#[tokio::test]
async fn a_tool_runner_killed_mid_call_fails_the_call_and_the_run_goes_on() -> TestResult {
    let runner = Service::spawn(runner_command(&[])?, "127.0.0.1", "tool-runner serving").await?;
    let address = runner.grpc.clone();
    let turns = vec![
        Turn::text("Calling.\n").then(Step::call("sleep", serde_json::json!({"ms": 10_000}))),
        Turn::text("The runner went away."),
    ];
    let mock = mock("fault", Scenario::new(turns)).await?;
    let service = orchestrator(&mock.base_url(), &format!("http://{address}"), &[]).await?;
    let mut watch = Watch::start(&service, model("fault")).await?;
    watch.until_call_started().await?;
    testkit::wait::until("the call to run on the runner", Duration::from_secs(10), || async {
        let metrics = scrape(&runner.metrics).await.ok()?;
        (metrics.get("tool_runner_executions_in_flight{}").copied()? > 0.0).then_some(())
    })
    .await?;
    runner.kill().await?;
    let seen = watch.finish().await?;
    let failed = failed_calls(&seen);
    assert!(failed.len() == 1 && failed[0].starts_with("UNAVAILABLE"), "{failed:?}");
    assert_eq!(seen.result.failed_turns, 1);
    // A runner comes back on the same address; later runs use it.
    let runner = Service::spawn_on(runner_command(&[])?, &address, "127.0.0.1", "tool-runner serving").await?;
    let kept = "Calling.\nThe runner went away.";
    assert_fault(&service, &seen, Status::Completed, Reason::Unspecified, kept).await?;
    runner.stop().await?;
    service.stop().await
}

/// A tool-runner that lists a tool and accepts calls of it, but never answers them.
struct BlackHole;

#[tonic::async_trait]
impl tr::tool_runner_server::ToolRunner for BlackHole {
    async fn list_tools(
        &self,
        _: tonic::Request<tr::ListToolsRequest>,
    ) -> Result<tonic::Response<tr::ListToolsResponse>, tonic::Status> {
        let lookup = tr::ToolSpec {
            name: "lookup".into(),
            description: "Looks a word up.".into(),
            parameters_json_schema: r#"{"type":"object"}"#.into(),
            timeout_ms: 60_000,
            source: "builtin".into(),
            needs_approval: false,
            mcp_protocol: String::new(),
            idempotent: true,
        };
        Ok(tonic::Response::new(tr::ListToolsResponse {
            tools: vec![lookup],
            records_calls: false,
        }))
    }

    async fn run_tool(
        &self,
        _: tonic::Request<tr::RunToolRequest>,
    ) -> Result<tonic::Response<tr::RunToolResponse>, tonic::Status> {
        std::future::pending().await
    }

    type RunToolStreamStream = futures::stream::Pending<Result<tr::RunToolUpdate, tonic::Status>>;

    /// Takes the call and never says another word.
    async fn run_tool_stream(
        &self,
        _: tonic::Request<tr::RunToolStreamRequest>,
    ) -> Result<tonic::Response<Self::RunToolStreamStream>, tonic::Status> {
        Ok(tonic::Response::new(futures::stream::pending()))
    }
}

#[tokio::test]
async fn a_black_holed_tool_runner_times_the_call_out_and_the_run_goes_on() -> TestResult {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let runner = format!("http://{}", listener.local_addr()?);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(tr::tool_runner_server::ToolRunnerServer::new(BlackHole))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let turns = vec![
        Turn::text("Looking up.\n").then(Step::call("lookup", serde_json::json!({"word": "x"}))),
        Turn::text("No answer came."),
    ];
    let mock = mock("fault", Scenario::new(turns)).await?;
    let service = orchestrator(&mock.base_url(), &runner, &[]).await?;
    let request = pb::OrchestrateRequest {
        limits: Some(pb::RunLimits {
            tool_timeout_ms: Some(500),
            ..Default::default()
        }),
        ..model("fault")
    };
    let seen = run(&service, request).await?;
    let failed = failed_calls(&seen);
    assert!(failed.len() == 1 && failed[0].starts_with("TIMEOUT"), "{failed:?}");
    let kept = "Looking up.\nNo answer came.";
    assert_fault(&service, &seen, Status::Completed, Reason::Unspecified, kept).await?;
    service.stop().await
}

#[tokio::test]
async fn an_overloaded_tool_runner_refuses_calls_which_are_retried_then_fed_back() -> TestResult {
    let runner = Service::spawn(
        runner_command(&["--max-concurrency", "1"])?,
        "127.0.0.1",
        "tool-runner serving",
    )
    .await?;
    let sleep = || Step::call("sleep", serde_json::json!({"ms": 2000}));
    let turns = vec![
        Turn::text("Two at once.\n").then(sleep()).then(sleep()),
        Turn::text("One was refused."),
    ];
    let mock = mock("fault", Scenario::new(turns)).await?;
    let service = orchestrator(&mock.base_url(), &format!("http://{}", runner.grpc), &[]).await?;
    let before = scrape(&service.metrics).await?;
    let seen = run(&service, model("fault")).await?;
    let failed = failed_calls(&seen);
    assert!(
        failed.len() == 1 && failed[0].starts_with("UNAVAILABLE") && failed[0].contains("ResourceExhausted"),
        "{failed:?}"
    );
    assert_eq!(seen.result.tool_calls.len(), 2);
    assert_eq!(
        seen.result.failed_turns, 1,
        "two calls in one turn, one failure counted"
    );
    let after = scrape(&service.metrics).await?;
    let retries = testkit::delta(
        &before,
        &after,
        "orchestrator_tool_call_retries_total{reason=\"concurrency_limit\"}",
    );
    assert_eq!(retries, 3.0, "the refused call was retried --tool-call-retries times");
    let kept = "Two at once.\nOne was refused.";
    assert_fault(&service, &seen, Status::Completed, Reason::Unspecified, kept).await?;
    runner.stop().await?;
    service.stop().await
}

// ---- the orchestrator's own lifecycle -----------------------------------------------------

#[tokio::test]
async fn sigterm_with_runs_in_flight_ends_them_within_the_grace_period_keeping_their_output() -> TestResult {
    let turns = vec![Turn::text("Working.\n").then(Step::call("sleep", serde_json::json!({"ms": 30_000})))];
    let mock = mock("fault", Scenario::new(turns)).await?;
    let mut service = orchestrator(
        &mock.base_url(),
        &testkit::tool_runner_in_process().await?,
        &["--shutdown-grace", "2s"],
    )
    .await?;
    let mut watches = Vec::new();
    for _ in 0..3 {
        let mut watch = Watch::start(&service, model("fault")).await?;
        watch.until_call_started().await?;
        watches.push(watch);
    }
    let signaled = tokio::time::Instant::now();
    service.signal(nix::sys::signal::Signal::SIGTERM)?;
    for watch in watches {
        let seen = watch.finish().await?;
        let r = &seen.result;
        assert_eq!(r.status(), Status::Canceled, "{}", r.failure_detail);
        assert!(r.failure_detail.contains("shutting down"), "{}", r.failure_detail);
        assert_eq!((r.text.as_str(), seen.text.as_str()), ("Working.\n", "Working.\n"));
    }
    assert!(signaled.elapsed() < Duration::from_secs(10), "within the grace period");
    assert_eq!(service.wait_exit().await?, Some(0));
    let logs = service.logs().join("\n");
    assert!(!logs.contains("panicked"), "{logs}");
    assert!(logs.contains("canceled the runs still in flight"), "{logs}");
    Ok(())
}

// ---- NATS faults --------------------------------------------------------------------------

/// An orchestrator keeping results (and signals, with `submit_report` as exit tool) in `nats`.
async fn orchestrator_on_nats(nats_url: &str, llm: &str, runner: &str, extra: &[&str]) -> anyhow::Result<Service> {
    let mut flags = vec![
        "--run-store",
        nats_url,
        "--signal-topic",
        nats_url,
        "--exit-tool",
        "submit_report",
    ];
    flags.extend_from_slice(extra);
    orchestrator(llm, runner, &flags).await
}

#[tokio::test]
async fn nats_down_at_start_stops_the_orchestrator_with_a_clear_error() -> TestResult {
    let closed = TcpListener::bind("127.0.0.1:0").await?.local_addr()?;
    let url = format!("nats://{closed}");
    let started = tokio::time::Instant::now();
    let (code, _, stderr) = testkit::run_to_end(
        Command::new(env!("CARGO_BIN_EXE_orchestrator")),
        &[
            "--run-store",
            &url,
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "off",
        ],
        &[],
    )
    .await?;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains(&format!("cannot connect to NATS at {url}")), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(30), "it fails fast");
    Ok(())
}

/// NATS goes down while a durable run is in a tool call. The checkpoint of the call's result
/// cannot be saved, so the run stops on its replica: nothing past its last checkpoint leaves, and
/// the caller's stream ends `UNAVAILABLE` (the Rust client re-attaches by itself). NATS is back:
/// the run is taken over from its last checkpoint (by this replica, through a fresh claim), the
/// call that was in flight runs again with the same call id and the next epoch, and the run
/// completes. The caller's stream is whole, and another replica reads the same result.
#[tokio::test]
async fn nats_down_mid_call_stops_the_run_and_it_completes_from_its_checkpoint_once_back() -> TestResult {
    let mut nats = Nats::start().await?;
    let turns = vec![
        Turn::text("Before.\n").then(Step::call("sleep", serde_json::json!({"ms": 1000}))),
        Turn::text("After."),
    ];
    let mock = mock("fault", Scenario::new(turns)).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let flags = ["--store-timeout", "500ms", "--run-store-lease", "2s"];
    let service = orchestrator_on_nats(&nats.url(), &mock.base_url(), &runner, &flags).await?;
    let patient = orchestrator_client::Retry {
        attempts: 60,
        first_backoff: Duration::from_millis(200),
        max_backoff: Duration::from_millis(500),
    };
    let caller = orchestrator_client::ClientBuilder::new(format!("http://{}", service.grpc))
        .retry(patient)
        .connect()
        .await?;
    let request = orchestrator_client::RunRequest::prompt("go")
        .model("fault")
        .run_id("while-down");
    let mut stream = caller.orchestrate(request).await?;
    loop {
        match tokio::time::timeout(Duration::from_secs(10), stream.next_event()).await?? {
            Some(orchestrator_client::Event::ToolCallStarted(_)) => break,
            Some(_) => {}
            None => anyhow::bail!("the stream ended before the call started"),
        }
    }
    nats.stop().await?;
    assert!(
        service
            .logged("this replica stops acting for the run", Duration::from_secs(10))
            .await,
        "the run stopped when its checkpoint could not be saved"
    );
    // Stays: NATS stays down a while longer after the run stopped acting (the outage is the
    // fault under test); the run must then resume from its checkpoint.
    tokio::time::sleep(Duration::from_secs(1)).await;
    nats.restart().await?;

    let mut finished = None;
    while let Some(event) = tokio::time::timeout(Duration::from_secs(60), stream.next_event()).await?? {
        if let orchestrator_client::Event::Finished(result) = event {
            finished = Some(result);
        }
    }
    let finished = finished.ok_or_else(|| anyhow::anyhow!("no run_finished"))?;
    assert_eq!(finished.status(), Status::Completed);
    assert_eq!(
        (stream.text(), finished.text.as_str()),
        ("Before.\nAfter.", "Before.\nAfter.")
    );
    assert!(stream.reattached() >= 1, "the caller re-attached");
    let other = orchestrator_on_nats(&nats.url(), &mock.base_url(), &runner, &[]).await?;
    assert_eq!(get_run(&mut client(&other).await?, "while-down").await?, *finished);
    other.stop().await?;
    assert_eq!(mock.requests().len(), 2, "the model was asked once per turn");
    service.stop().await
}

#[tokio::test]
async fn a_full_signal_stream_marks_signals_undelivered_and_the_run_keeps_them() -> TestResult {
    let nats = Nats::start().await?;
    let turns = vec![Turn::text("Reporting.\n").then(Step::call(
        "submit_report",
        serde_json::json!({"summary": "a report too big for the stream"}),
    ))];
    let mock = mock("fault", Scenario::new(turns)).await?;
    let service = orchestrator_on_nats(
        &nats.url(),
        &mock.base_url(),
        &testkit::tool_runner_in_process().await?,
        &["--signal-stream-max-bytes", "64", "--signal-publish-retries", "1"],
    )
    .await?;
    let seen = run(&service, model("fault")).await?;
    // run_finished does not wait for the broker: the signal is PENDING there, and the stored
    // result says how its delivery ended.
    assert_eq!(seen.result.signals.len(), 1, "{:?}", seen.result.signals);
    let here = client(&service).await?;
    let run_id = seen.result.run_id.clone();
    let stored = testkit::wait::until("the signal's delivery to end", Duration::from_secs(20), || {
        let (mut here, run_id) = (here.clone(), run_id.clone());
        async move {
            let stored = get_run(&mut here, run_id).await.ok()?;
            (stored.signals.first()?.delivery() != pb::SignalDelivery::Pending).then_some(stored)
        }
    })
    .await?;
    let signal = &stored.signals[0];
    assert_eq!(signal.delivery(), pb::SignalDelivery::Undelivered);
    assert!(
        signal.arguments_json.contains("too big"),
        "the signal is kept in the result"
    );
    let seen = Seen {
        text: seen.text,
        result: stored,
    };
    let failed = scrape(&service.metrics)
        .await?
        .get("orchestrator_signals_failed_total{}")
        .copied();
    assert_eq!(failed, Some(1.0));
    assert_fault(&service, &seen, Status::Completed, Reason::Unspecified, "Reporting.\n").await?;
    service.stop().await
}
