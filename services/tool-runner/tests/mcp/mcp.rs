//! The tool-runner's MCP servers against the official reference servers, installed by
//! `./scripts/mcp-servers` (which `./scripts/test` runs): `@modelcontextprotocol/server-everything`
//! (npm; stdio and streamable HTTP) and `mcp-server-time` (PyPI; stdio). The runner is the real
//! service on a loopback port, called through the generated gRPC client.

use std::time::{Duration, Instant};

use proto::toolrunner::v1::ToolErrorCode as Code;
use serde_json::json;
use testkit::mcp_servers::{everything_js, time_server};
use testkit::{Outcome, Runner, run_tool};
use tool_runner::Config;

type TestResult = anyhow::Result<()>;

/// A runner whose manifest is `manifest` (written into `dir`).
async fn runner_with(dir: &tempfile::TempDir, manifest: &str) -> anyhow::Result<Runner> {
    let path = dir.path().join("tools.toml");
    std::fs::write(&path, manifest)?;
    Runner::start(Config {
        tools_manifest: Some(path),
        ..Config::default()
    })
    .await
}

/// server-everything over stdio, its stdin copied to `stdin.log` in `dir` (to see what the
/// runner sends), and mcp-server-time (required).
/// `zone` is the time server's local time zone: it tells that test's server apart from the
/// other tests' (which run at the same time).
fn stdio_manifest(dir: &tempfile::TempDir, extra: &str, zone: &str) -> anyhow::Result<String> {
    let log = dir.path().join("stdin.log");
    Ok(format!(
        r#"
[[mcp_servers]]
name = "everything"
command = "sh"
args = ["-c", "tee -a '{log}' | exec node '{js}' stdio"]
timeout = "3s"
{extra}

[[mcp_servers]]
name = "time"
command = "{time}"
args = ["--local-timezone", "{zone}"]
required = true
"#,
        log = log.display(),
        js = everything_js()?.display(),
        time = time_server()?.display(),
    ))
}

async fn call(runner: &Runner, tool: &str, args: serde_json::Value) -> anyhow::Result<Outcome> {
    let response = runner
        .client()
        .await?
        .run_tool(run_tool(tool, &args.to_string()))
        .await?;
    Outcome::of(response.into_inner())
}

/// Text, structured content, JSON text, an image described (not carried), a resource link.
async fn answers_are_mapped_text_structured_json_image_and_link(runner: &Runner) -> TestResult {
    assert_eq!(
        call(runner, "everything__get-sum", json!({"a": 2, "b": 3}))
            .await?
            .unwrap_ok(),
        json!("The sum of 2 and 3 is 5.")
    );
    let weather = call(
        runner,
        "everything__get-structured-content",
        json!({"location": "Chicago"}),
    )
    .await?
    .unwrap_ok();
    assert!(weather["temperature"].is_number(), "{weather}");
    let now = call(runner, "time__get_current_time", json!({"timezone": "Europe/Paris"}))
        .await?
        .unwrap_ok();
    assert_eq!(now["timezone"], "Europe/Paris", "{now}");
    let image = call(runner, "everything__get-tiny-image", json!({})).await?.unwrap_ok();
    assert_eq!(image[1]["type"], "image", "{image}");
    assert_eq!(image[1]["mimeType"], "image/png");
    assert!(
        image[1]["bytes"].as_u64().unwrap_or(0) > 100 && image[1].get("data").is_none(),
        "{image}"
    );
    let links = call(runner, "everything__get-resource-links", json!({"count": 2}))
        .await?
        .unwrap_ok();
    assert_eq!(links[1]["type"], "resource_link", "{links}");

    Ok(())
}

/// The server's `isError` is `FAILED`, our schema check `INVALID_ARGUMENTS`, a denied tool
/// `NOT_FOUND`.
async fn errors_are_the_servers_our_schema_checks_and_denied_tools(runner: &Runner) -> TestResult {
    let (code, message) = call(runner, "time__get_current_time", json!({"timezone": "Nowhere/City"}))
        .await?
        .unwrap_err();
    assert_eq!(code, Code::Failed);
    assert!(message.contains("Nowhere/City"), "{message}");
    let (code, message) = call(runner, "everything__get-sum", json!({"a": "x"}))
        .await?
        .unwrap_err();
    assert_eq!(code, Code::InvalidArguments, "{message}");
    let (code, message) = call(runner, "everything__get-env", json!({})).await?.unwrap_err();
    assert_eq!(code, Code::NotFound, "{message}");
    Ok(())
}

#[tokio::test]
async fn stdio_servers_are_listed_called_and_their_answers_mapped() -> TestResult {
    let dir = tempfile::tempdir()?;
    let extra = "deny = [\"get-env\"]\nneeds_approval = [\"get-sum\"]";
    let runner = runner_with(&dir, &stdio_manifest(&dir, extra, "UTC")?).await?;
    let tools = runner.tools().await?;
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    for expected in [
        "echo",
        "everything__get-sum",
        "everything__echo",
        "time__get_current_time",
        "time__convert_time",
    ] {
        assert!(names.contains(&expected), "{expected} missing from {names:?}");
    }
    assert!(
        !names.contains(&"everything__get-env"),
        "denied tools are not offered: {names:?}"
    );
    let sum = tools
        .iter()
        .find(|t| t.name == "everything__get-sum")
        .ok_or_else(|| anyhow::anyhow!("no get-sum"))?;
    assert_eq!((sum.source.as_str(), sum.timeout_ms), ("mcp", 3000));
    // Approval per tool of a server: get-sum's calls wait for a person, its other tools' do not.
    let marked: Vec<&str> = tools
        .iter()
        .filter(|t| t.needs_approval)
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(marked, ["everything__get-sum"], "{tools:?}");
    let schema: serde_json::Value = serde_json::from_str(&sum.parameters_json_schema)?;
    assert_eq!(schema["properties"]["a"]["type"], "number", "{schema}");

    answers_are_mapped_text_structured_json_image_and_link(&runner).await?;
    errors_are_the_servers_our_schema_checks_and_denied_tools(&runner).await?;
    Ok(())
}

/// server-everything (its newest release) asks within the call (`elicitation/create` on the
/// session, as servers before 2026-07-28 do) once the client offers elicitation: nobody can
/// answer a call held open on one runner, so the runner answers `cancel`, never `decline` on a
/// person's behalf, and the tool says so.
#[tokio::test]
async fn a_question_asked_within_the_call_is_answered_cancel_not_decline() -> TestResult {
    let dir = tempfile::tempdir()?;
    let runner = runner_with(&dir, &stdio_manifest(&dir, "", "Etc/GMT-2")?).await?;
    let answer = call(&runner, "everything__trigger-elicitation-request", json!({}))
        .await?
        .unwrap_ok();
    let text = answer.to_string();
    assert!(text.contains("cancelled") && !text.contains("declined"), "{text}");
    Ok(())
}

/// A call carries the orchestrator's run id, call id and epoch to the MCP server in its request's
/// `_meta`, so a server with side effects can answer a second delivery from the first and refuse
/// an owner older than the newest it has seen.
#[tokio::test]
async fn a_call_carries_its_run_id_call_id_and_epoch_in_meta() -> TestResult {
    let dir = tempfile::tempdir()?;
    let runner = runner_with(&dir, &stdio_manifest(&dir, "", "Etc/GMT-5")?).await?;
    let mut request = run_tool("everything__echo", &json!({"message": "once"}).to_string());
    request.run_id = "run-7".into();
    request.call_id = "call_3".into();
    request.epoch = 4;
    let answer = Outcome::of(runner.client().await?.run_tool(request).await?.into_inner())?;
    assert_eq!(answer.unwrap_ok(), json!("Echo: once"));
    let sent = wait_for(|| {
        let log = std::fs::read_to_string(dir.path().join("stdin.log")).unwrap_or_default();
        log.lines()
            .find(|l| l.contains("\"tools/call\"") && l.contains("once"))
            .map(str::to_owned)
    })
    .await?;
    let call: serde_json::Value = serde_json::from_str(&sent)?;
    let meta = &call["params"]["_meta"];
    assert_eq!(
        (
            &meta["orchestrator/run_id"],
            &meta["orchestrator/call_id"],
            &meta["orchestrator/epoch"]
        ),
        (&json!("run-7"), &json!("call_3"), &json!(4)),
        "{call}"
    );
    Ok(())
}

/// `RunToolStream`: the server's `notifications/progress` arrive as `progress` updates while
/// the call runs, then its answer as `done`; `RunTool` of the same call gives the answer alone.
#[tokio::test]
async fn a_long_call_streams_its_progress_before_its_answer() -> TestResult {
    use proto::toolrunner::v1::run_tool_update::Update;
    let dir = tempfile::tempdir()?;
    let runner = runner_with(&dir, &stdio_manifest(&dir, "", "Etc/GMT-6")?).await?;
    let long = json!({"duration": 1, "steps": 4}).to_string();
    let mut updates = runner
        .client()
        .await?
        .run_tool_stream(proto::toolrunner::v1::RunToolStreamRequest {
            call: Some(run_tool("everything__trigger-long-running-operation", &long)),
        })
        .await?
        .into_inner();
    let mut seen = Vec::new();
    while let Some(update) = updates.message().await? {
        seen.push(update.update.ok_or_else(|| anyhow::anyhow!("an empty update"))?);
    }
    let Some(Update::Done(done)) = seen.pop() else {
        anyhow::bail!("the last update is not the answer: {seen:?}");
    };
    let answer = Outcome::of(done)?.unwrap_ok();
    assert!(answer.to_string().contains("Steps: 4"), "{answer}");
    let progress: Vec<(f64, f64)> = seen
        .iter()
        .map(|u| match u {
            Update::Progress(p) => Ok((p.progress, p.total)),
            Update::Done(_) => Err(anyhow::anyhow!("two answers: {seen:?}")),
        })
        .collect::<anyhow::Result<_>>()?;
    assert!(!progress.is_empty(), "no progress before the answer");
    assert!(progress.iter().all(|&(_, total)| total == 4.0), "{progress:?}");
    assert!(progress.windows(2).all(|w| w[0].0 < w[1].0), "{progress:?}");
    assert_eq!(progress.last().map(|p| p.0), Some(4.0), "{progress:?}");
    let unary = call(
        &runner,
        "everything__trigger-long-running-operation",
        json!({"duration": 0.2, "steps": 2}),
    )
    .await?;
    assert!(unary.unwrap_ok().to_string().contains("Steps: 2"));
    Ok(())
}

#[tokio::test]
async fn a_call_past_its_timeout_or_given_up_by_its_caller_is_canceled_on_the_server() -> TestResult {
    let dir = tempfile::tempdir()?;
    let runner = runner_with(&dir, &stdio_manifest(&dir, "", "UTC")?).await?;
    let started = Instant::now();
    let (code, message) = call(
        &runner,
        "everything__trigger-long-running-operation",
        json!({"duration": 30, "steps": 3}),
    )
    .await?
    .unwrap_err();
    assert_eq!(code, Code::Timeout, "{message}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "stopped at the 3 s timeout"
    );
    // notifications/cancelled reached the server, naming the request.
    let sent = wait_for(|| {
        let log = std::fs::read_to_string(dir.path().join("stdin.log")).unwrap_or_default();
        log.contains("notifications/cancelled").then_some(log)
    })
    .await?;
    let cancel = sent
        .lines()
        .find(|l| l.contains("notifications/cancelled"))
        .ok_or_else(|| anyhow::anyhow!("no cancel"))?;
    let cancel: serde_json::Value = serde_json::from_str(cancel)?;
    assert!(
        cancel["params"]["requestId"].is_number() || cancel["params"]["requestId"].is_string(),
        "{cancel}"
    );
    assert_eq!(
        call(&runner, "everything__echo", json!({"message": "still here"}))
            .await?
            .unwrap_ok(),
        json!("Echo: still here")
    );

    // A caller that gives up (drops its RunTool) cancels the MCP request too.
    let long = json!({"duration": 30, "steps": 3});
    let gave_up = tokio::time::timeout(
        Duration::from_millis(1000),
        call(&runner, "everything__trigger-long-running-operation", long),
    )
    .await;
    assert!(gave_up.is_err(), "the call was still running: {gave_up:?}");
    wait_for(|| {
        let log = std::fs::read_to_string(dir.path().join("stdin.log")).unwrap_or_default();
        (log.matches("notifications/cancelled").count() == 2).then_some(())
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_crashed_stdio_server_fails_its_calls_cleanly_is_restarted_and_health_follows_it() -> TestResult {
    use tonic_health::pb::health_check_response::ServingStatus;
    let dir = tempfile::tempdir()?;
    let runner = runner_with(&dir, &stdio_manifest(&dir, "", "Etc/GMT-3")?).await?;
    assert_eq!(health(&runner).await?, ServingStatus::Serving);

    // Kill the required time server (its whole process: the runner started it in a group of its own).
    let killed = std::process::Command::new("pkill")
        .args(["-f", "mcp-server-time --local-timezone Etc/GMT-3"])
        .status()?;
    assert!(killed.success());
    let failed = wait_for_async(|| async {
        let out = call(&runner, "time__get_current_time", json!({"timezone": "UTC"}))
            .await
            .ok()?;
        matches!(out, Outcome::Err(..)).then_some(out)
    })
    .await?;
    let (code, message) = failed.unwrap_err();
    assert_eq!(code, Code::Unavailable, "{message}");
    assert!(message.contains("time"), "{message}");

    // Restarted with backoff: calls work again and health is back to SERVING.
    let answer = wait_for_async(|| async {
        call(&runner, "time__get_current_time", json!({"timezone": "UTC"}))
            .await
            .ok()
            .filter(|out| matches!(out, Outcome::Ok(_)))
    })
    .await?;
    assert_eq!(answer.unwrap_ok()["timezone"], "UTC");
    assert_eq!(health(&runner).await?, ServingStatus::Serving);
    Ok(())
}

#[tokio::test]
async fn a_required_server_that_never_starts_keeps_the_runner_not_serving_but_its_own_tools_work() -> TestResult {
    use tonic_health::pb::health_check_response::ServingStatus;
    let dir = tempfile::tempdir()?;
    let manifest =
        "[[mcp_servers]]\nname = \"broken\"\ncommand = \"false\"\nrequired = true\nconnect_timeout = \"2s\"\n";
    let runner = runner_with(&dir, manifest).await?;
    assert_eq!(health(&runner).await?, ServingStatus::NotServing);
    assert_eq!(
        call(&runner, "echo", json!({"a": 1})).await?.unwrap_ok(),
        json!({"a": 1})
    );
    Ok(())
}

#[tokio::test]
async fn a_streamable_http_server_is_listed_and_called_with_headers_from_the_environment() -> TestResult {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut server = http_everything(port).await?;

    // The runner reaches it through a proxy that keeps each connection's first request head.
    // The header's value comes from a variable the test process has (it may not set one: no
    // unsafe code).
    let (proxy_port, heads) = recording_proxy(port).await?;
    let variable = "HOME";
    let dir = tempfile::tempdir()?;
    let manifest = format!(
        "[[mcp_servers]]\nname = \"remote\"\nurl = \"http://127.0.0.1:{proxy_port}/mcp\"\nprefix = \"\"\nallow = [\"get-sum\", \"echo\"]\nheaders = {{ \"X-Team\" = \"tests\" }}\nheaders_from_env = {{ Authorization = \"{variable}\" }}\n"
    );
    let runner = runner_with(&dir, &manifest).await?;
    let names: Vec<String> = runner
        .tools()
        .await?
        .into_iter()
        .filter(|t| t.source == "mcp")
        .map(|t| t.name)
        .collect();
    // No prefix: the names clash with the built-in echo, which wins.
    assert_eq!(names, ["get-sum"]);
    assert_eq!(
        call(&runner, "get-sum", json!({"a": 40, "b": 2})).await?.unwrap_ok(),
        json!("The sum of 40 and 2 is 42.")
    );
    let heads = heads.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.clone();
    let home = std::env::var(variable)?;
    let first = heads.first().map(|h| h.to_ascii_lowercase()).unwrap_or_default();
    assert!(first.starts_with("post /mcp "), "{first}");
    assert!(first.contains("\r\nx-team: tests\r\n"), "{first}");
    assert!(
        first.contains(&format!("\r\nauthorization: {}\r\n", home.to_ascii_lowercase())),
        "{first}"
    );
    drop(runner);
    let _ = server.kill().await;
    Ok(())
}

#[tokio::test]
async fn an_http_server_that_goes_away_fails_calls_cleanly_and_is_reconnected_when_back() -> TestResult {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let server = http_everything(port).await?;
    let dir = tempfile::tempdir()?;
    let manifest = format!(
        "[[mcp_servers]]\nname = \"remote\"\nurl = \"http://127.0.0.1:{port}/mcp\"\nallow = [\"get-sum\"]\nrequired = true\nconnect_timeout = \"2s\"\nrestart_backoff_max = \"1s\"\nping_interval = \"1s\"\n"
    );
    let runner = runner_with(&dir, &manifest).await?;
    let sum = json!({"a": 1, "b": 2});
    assert_eq!(
        call(&runner, "remote__get-sum", sum.clone()).await?.unwrap_ok(),
        json!("The sum of 1 and 2 is 3.")
    );

    // Gone: calls fail as retryable tool errors (no hang); the next ping goes unanswered, which
    // ends the session, so health says the required server is down.
    drop(server);
    let (code, message) = call(&runner, "remote__get-sum", sum.clone()).await?.unwrap_err();
    assert_eq!(code, Code::Unavailable, "{message}");
    wait_for_async(|| async {
        (health(&runner).await.ok()? == tonic_health::pb::health_check_response::ServingStatus::NotServing)
            .then_some(())
    })
    .await?;

    // Back (a new process, so a new session): the runner reconnects and calls work again.
    let _server = http_everything(port).await?;
    let answer = wait_for_async(|| async {
        call(&runner, "remote__get-sum", sum.clone())
            .await
            .ok()
            .filter(|out| matches!(out, Outcome::Ok(_)))
    })
    .await?;
    assert_eq!(answer.unwrap_ok(), json!("The sum of 1 and 2 is 3."));
    assert_eq!(
        health(&runner).await?,
        tonic_health::pb::health_check_response::ServingStatus::Serving
    );
    Ok(())
}

/// A TCP proxy on a loopback port to `upstream`, recording the head of each connection's first
/// request (to see the headers the runner sends).
async fn recording_proxy(upstream: u16) -> anyhow::Result<(u16, std::sync::Arc<std::sync::Mutex<Vec<String>>>)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let heads = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let recorded = std::sync::Arc::clone(&heads);
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let heads = std::sync::Arc::clone(&recorded);
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && head.len() < 64 * 1024 {
                    match client.read(&mut byte).await {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                if let Ok(mut heads) = heads.lock() {
                    heads.push(String::from_utf8_lossy(&head).into_owned());
                }
                let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await else {
                    return;
                };
                if server.write_all(&head).await.is_ok() {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    Ok((port, heads))
}

/// server-everything over streamable HTTP on `port` (at `/mcp`), once it accepts connections;
/// killed when dropped.
async fn http_everything(port: u16) -> anyhow::Result<tokio::process::Child> {
    let server = tokio::process::Command::new("node")
        .arg(everything_js()?)
        .arg("streamableHttp")
        .env("PORT", port.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    wait_for_async(|| async { tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok() }).await?;
    Ok(server)
}

#[tokio::test]
async fn a_server_is_held_to_max_tools_and_max_message_bytes() -> TestResult {
    let dir = tempfile::tempdir()?;
    let runner = runner_with(
        &dir,
        &stdio_manifest(&dir, "max_tools = 3\nmax_message_bytes = 65536", "Etc/GMT-4")?,
    )
    .await?;
    let offered: Vec<String> = runner
        .tools()
        .await?
        .into_iter()
        .filter(|t| t.name.starts_with("everything__"))
        .map(|t| t.name)
        .collect();
    assert_eq!(offered.len(), 3, "{offered:?}");

    // An answer under the bound arrives; one over it is refused, not buffered.
    let echo = offered.iter().find(|n| n.ends_with("__echo"));
    let echo = echo.ok_or_else(|| anyhow::anyhow!("echo is not among the first 3: {offered:?}"))?;
    let small = "a".repeat(60_000);
    assert_eq!(
        call(&runner, echo, json!({"message": small})).await?.unwrap_ok(),
        json!(format!("Echo: {small}"))
    );
    let started = Instant::now();
    let big = "b".repeat(70_000);
    let (code, message) = call(&runner, echo, json!({"message": big})).await?.unwrap_err();
    assert_eq!(code, Code::Failed, "{message}");
    assert!(
        message.contains("larger than max_message_bytes (65536 bytes)"),
        "{message}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "failed at once, not at the 3 s timeout"
    );
    // The session goes on.
    assert_eq!(
        call(&runner, echo, json!({"message": "after"})).await?.unwrap_ok(),
        json!("Echo: after")
    );

    // Over streamable HTTP too.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let _server = http_everything(port).await?;
    let manifest = format!(
        "[[mcp_servers]]\nname = \"remote\"\nurl = \"http://127.0.0.1:{port}/mcp\"\nallow = [\"echo\"]\ntimeout = \"3s\"\nmax_message_bytes = 65536\n"
    );
    let runner = runner_with(&dir, &manifest).await?;
    let (code, message) = call(&runner, "remote__echo", json!({"message": big}))
        .await?
        .unwrap_err();
    assert_eq!(code, Code::Failed, "{message}");
    assert!(message.contains("max_message_bytes = 65536 bytes"), "{message}");
    assert_eq!(
        call(&runner, "remote__echo", json!({"message": "after"}))
            .await?
            .unwrap_ok(),
        json!("Echo: after")
    );
    Ok(())
}

#[tokio::test]
async fn manifest_errors_name_the_server_and_the_problem() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("tools.toml");
    for (manifest, expected) in [
        (
            "[[mcp_servers]]\nname = \"a\"\n",
            "give command (a stdio server) or url",
        ),
        (
            "[[mcp_servers]]\nname = \"a\"\ncommand = \"sh\"\nurl = \"http://x/mcp\"\n",
            "not both",
        ),
        (
            "[[mcp_servers]]\nname = \"a\"\nurl = \"ftp://x/mcp\"\n",
            "must be http or https",
        ),
        (
            "[[mcp_servers]]\nname = \"a\"\nurl = \"http://x/mcp\"\nheaders_from_env = { Authorization = \"MCP_TEST_UNSET_VARIABLE\" }\n",
            "MCP_TEST_UNSET_VARIABLE, which is not set",
        ),
        (
            "[[mcp_servers]]\nname = \"a\"\ncommand = \"no-such-program-xyz\"\n",
            "was not found on PATH",
        ),
        (
            "[[mcp_servers]]\nname = \"a\"\ncommand = \"sh\"\ntimeout = \"2h\"\n",
            "timeout = 2h is above its cap of 1h",
        ),
        (
            "[[mcp_servers]]\nname = \"a\"\ncommand = \"sh\"\nping_interval = \"999ms\"\n",
            "ping_interval = 999ms is below its minimum of 1s",
        ),
        (
            "[[mcp_servers]]\nname = \"a\"\ncommand = \"sh\"\nping_interval = \"11m\"\n",
            "ping_interval = 11m is above its cap of 10m",
        ),
        (
            "[[mcp_servers]]\nname = \"a\"\ncommand = \"sh\"\nmax_message_bytes = 1023\n",
            "max_message_bytes = 1023 is below its minimum of 1024",
        ),
        (
            "[[mcp_servers]]\nname = \"a\"\ncommand = \"sh\"\nmax_tools = 10001\n",
            "max_tools = 10001 is above its cap of 10000",
        ),
        (
            "[[mcp_servers]]\nname = \"a\"\ncommand = \"sh\"\n[[mcp_servers]]\nname = \"a\"\ncommand = \"sh\"\n",
            "used by mcp_servers #1 already",
        ),
        (
            "[[mcp_servers]]\nname = \"a\"\ncommand = \"sh\"\nprefix = \"a.b\"\n",
            "prefix \"a.b\"",
        ),
        (
            "[[mcp_servers]]\nname = \"a\"\ncommand = \"sh\"\nprotocol = \"2027-01-01\"\n",
            "protocol \"2027-01-01\" must be \"auto\" or one of 2026-07-28, 2025-11-25",
        ),
    ] {
        std::fs::write(&path, manifest)?;
        let error = tool_runner::tools::manifest::load(&path)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            error.contains(expected),
            "{manifest}: {error:?} should contain {expected:?}"
        );
        assert!(
            manifest.contains("name = \"a\"") && error.contains("mcp_servers a"),
            "{error}"
        );
    }
    // Both sides of the caps are accepted.
    std::fs::write(
        &path,
        "[[mcp_servers]]\nname = \"a\"\ncommand = \"sh\"\ntimeout = \"1h\"\nmax_message_bytes = 1024\nmax_tools = 10000\nping_interval = \"10m\"\n",
    )?;
    assert!(tool_runner::tools::manifest::load(&path).is_ok());
    std::fs::write(
        &path,
        "[[mcp_servers]]\nname = \"a\"\ncommand = \"sh\"\nping_interval = \"1s\"\n",
    )?;
    assert!(tool_runner::tools::manifest::load(&path).is_ok());
    for protocol in ["auto", "2026-07-28", "2024-11-05"] {
        std::fs::write(
            &path,
            format!("[[mcp_servers]]\nname = \"a\"\ncommand = \"sh\"\nprotocol = \"{protocol}\"\n"),
        )?;
        assert!(tool_runner::tools::manifest::load(&path).is_ok(), "{protocol}");
    }
    Ok(())
}

/// The runner's health for its `ToolRunner` service.
async fn health(runner: &Runner) -> anyhow::Result<tonic_health::pb::health_check_response::ServingStatus> {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let check = HealthCheckRequest {
        service: "toolrunner.v1.ToolRunner".into(),
    };
    Ok(HealthClient::new(runner.channel().await?)
        .check(check)
        .await?
        .into_inner()
        .status())
}

/// Polls `probe` for up to 20 s.
async fn wait_for<T>(probe: impl FnMut() -> Option<T>) -> anyhow::Result<T> {
    testkit::wait::until_sync("the MCP server", Duration::from_secs(20), probe).await
}

/// Polls `probe` for up to 20 s.
async fn wait_for_async<T, F: Future<Output = Option<T>>>(probe: impl FnMut() -> F) -> anyhow::Result<T> {
    testkit::wait::until("the MCP server", Duration::from_secs(20), probe).await
}
