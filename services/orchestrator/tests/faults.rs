//! The fault matrix: one test per fault, each against a real orchestrator process. Every test
//! checks the run's terminal status and reason, that the output produced before the fault is
//! kept (in the stream and in `GetRun`), that the run's slot is freed and the in-flight gauges
//! are back to 0, that nothing panicked, and that the process goes on serving a normal run.
//!
//! LLM faults come from the stand-in model (scripted per model name) or, for what it cannot do
//! (a stall before the headers, an error body that never ends, a reset connection, a
//! `Retry-After`), from a raw HTTP server here that plays one fault per connection and then
//! answers normally.

mod common;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use common::{Service, scrape, user};
use mock_llm::{MockLlm, Scenario, Scenarios, Step, Turn};
use proto::orchestrator::v1 as pb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::Command;

type TestResult = anyhow::Result<()>;

/// An orchestrator process on `llm` and `runner`, with short timeouts so faults show quickly
/// (from the environment, so `extra` flags can override them).
async fn orchestrator(llm: &str, runner: &str, extra: &[&str]) -> anyhow::Result<Service> {
    let mut command = Command::new(env!("CARGO_BIN_EXE_orchestrator"));
    command
        .env("LLM_BASE_URL", llm)
        .env("TOOL_RUNNER_ENDPOINTS", runner)
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env("LLM_IDLE_TIMEOUT", "1s")
        .env("LLM_MAX_RETRIES", "1")
        .env("LLM_RETRY_BACKOFF", "50ms")
        .args(extra);
    Service::spawn(command, "127.0.0.1", "orchestrator serving").await
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

async fn run(service: &Service, request: pb::OrchestrateRequest) -> anyhow::Result<Seen> {
    let mut client = client(service).await?;
    let mut stream = client.orchestrate(request).await?.into_inner();
    let mut text = String::new();
    while let Some(event) = stream.message().await? {
        match event.event {
            Some(pb::orchestrate_event::Event::TextDelta(d)) => text.push_str(&d.text),
            Some(pb::orchestrate_event::Event::RunFinished(f)) => {
                let result = f
                    .result
                    .ok_or_else(|| anyhow::anyhow!("run_finished without a result"))?;
                return Ok(Seen { text, result });
            }
            _ => {}
        }
    }
    anyhow::bail!("the stream ended without run_finished")
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
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let metrics = scrape(&service.metrics).await?;
        let runs = metrics.get("orchestrator_runs_in_flight{}").copied().unwrap_or(-1.0);
        let calls = metrics
            .get("orchestrator_tool_calls_in_flight{}")
            .copied()
            .unwrap_or(-1.0);
        if (runs, calls) == (0.0, 0.0) {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "gauges not back to 0: runs {runs}, calls {calls}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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

/// One scripted LLM fault on the stand-in model, checked end to end.
async fn scripted_fault(
    turn: Turn,
    extra: &[&str],
    status: pb::RunStatus,
    reason: pb::FailureReason,
    kept: &str,
) -> TestResult {
    let mock = mock("fault", Scenario::new(vec![turn])).await?;
    let service = orchestrator(&mock.base_url(), &common::tool_runner_in_process().await?, extra).await?;
    let seen = run(&service, model("fault")).await?;
    assert_fault(&service, &seen, status, reason, kept).await?;
    service.stop().await
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
    let mock = mock("fault", Scenario::new(vec![turn])).await?;
    let service = orchestrator(&mock.base_url(), &common::tool_runner_in_process().await?, &[]).await?;
    let seen = run(&service, model("fault")).await?;
    assert_eq!(seen.result.status(), Status::Completed);
    assert_eq!(seen.result.text, "after a retry");
    settled(&service).await?;
    service.stop().await
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
            let fault = faults.lock().unwrap_or_else(PoisonError::into_inner).pop_front();
            seen.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(tokio::time::Instant::now());
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
            tokio::time::sleep(Duration::from_millis(100)).await;
            socket.set_zero_linger()?;
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
    let (url, _) = raw_llm(vec![fault]).await?;
    let service = orchestrator(&url, &common::tool_runner_in_process().await?, &[]).await?;
    let started = tokio::time::Instant::now();
    let seen = run(&service, user("go")).await?;
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "ended by the idle timeout, not the run's deadline"
    );
    assert_fault(&service, &seen, status, reason, kept).await?;
    service.stop().await
}

#[tokio::test]
async fn llm_stall_before_headers() -> TestResult {
    raw_fault(Raw::StallBeforeHeaders, Status::Failed, Reason::LlmStreamStalled, "").await
}

#[tokio::test]
async fn llm_error_body_that_never_ends() -> TestResult {
    let (url, _) = raw_llm(vec![Raw::ErrorBodyNeverEnds, Raw::ErrorBodyNeverEnds]).await?;
    let service = orchestrator(&url, &common::tool_runner_in_process().await?, &[]).await?;
    let seen = run(&service, user("go")).await?;
    assert!(
        seen.result.failure_detail.contains("500") && seen.result.failure_detail.contains("did not arrive"),
        "{}",
        seen.result.failure_detail
    );
    assert_fault(&service, &seen, Status::Failed, Reason::LlmError, "").await?;
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
    let (url, arrivals) = raw_llm(vec![Raw::RetryAfter]).await?;
    let service = orchestrator(&url, &common::tool_runner_in_process().await?, &[]).await?;
    let seen = run(&service, user("go")).await?;
    assert_eq!(
        (seen.result.status(), seen.result.text.as_str()),
        (Status::Completed, "all good")
    );
    let arrivals = arrivals.lock().unwrap_or_else(PoisonError::into_inner).clone();
    assert!(
        arrivals.len() >= 2 && arrivals[1] - arrivals[0] >= Duration::from_millis(900),
        "the retry waited Retry-After (1s), not the 50ms backoff"
    );
    service.stop().await
}

#[tokio::test]
async fn llm_connection_refused() -> TestResult {
    let closed = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/v1", closed.local_addr()?);
    drop(closed);
    let service = orchestrator(&url, &common::tool_runner_in_process().await?, &[]).await?;
    let seen = run(&service, user("go")).await?;
    let r = &seen.result;
    assert_eq!((r.status(), r.failure_reason()), (Status::Failed, Reason::LlmError));
    assert!(r.failure_detail.contains("cannot reach"), "{}", r.failure_detail);
    settled(&service).await?;
    service.stop().await
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
    let service = orchestrator(&mock.base_url(), &common::tool_runner_in_process().await?, &[]).await?;
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
    let service = orchestrator(&mock.base_url(), &common::tool_runner_in_process().await?, &[]).await?;
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
    let service = orchestrator(&mock.base_url(), &common::tool_runner_in_process().await?, &[]).await?;
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
        &common::tool_runner_in_process().await?,
        &[
            "--event-send-timeout",
            "1s",
            "--event-buffer",
            "4",
            "--llm-idle-timeout",
            "60s",
        ],
    )
    .await?;
    let mut client = client(&service).await?;
    let stream = client
        .orchestrate(pb::OrchestrateRequest {
            run_id: "not-reading".into(),
            ..model("fault")
        })
        .await?
        .into_inner();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let stored = loop {
        let r = get_run(&mut client, "not-reading").await?;
        if r.status() != Status::Running || tokio::time::Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
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
