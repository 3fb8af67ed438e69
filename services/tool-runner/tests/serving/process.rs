//! Tests of the `tool-runner` process itself: signals and drain, exit codes, flags and their
//! environment equivalents, JSON logs, and the `list` / `call` / `check-manifest` commands.

use std::time::Duration;

use proto::toolrunner::v1 as pb;
use testkit::{Service, repo_root};
use tokio::process::Command;

type TestResult = anyhow::Result<()>;

const BIN: &str = env!("CARGO_BIN_EXE_tool-runner");

/// The binary on a free loopback port with JSON logs, serving; `extra` flags added.
async fn start(extra: &[&str]) -> anyhow::Result<Service> {
    start_with(extra, &[]).await
}

/// [`start`] with `env` set too.
async fn start_with(extra: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Service> {
    let mut command = Command::new(BIN);
    command
        .args(extra)
        .envs(env.iter().copied())
        // A valid worker-thread count (bad ones are refused: see the limits test).
        .env("TOKIO_WORKER_THREADS", "2")
        .current_dir(repo_root());
    Service::spawn(command, "127.0.0.1", "tool-runner serving").await
}

/// Waits until the runner has `n` executions in flight (its gauge, on its metrics port).
async fn until_in_flight(process: &Service, n: f64) -> TestResult {
    testkit::wait::until(
        &format!("{n} executions in flight"),
        Duration::from_secs(10),
        || async {
            let metrics = testkit::scrape(&process.metrics).await.ok()?;
            (metrics.get("tool_runner_executions_in_flight{}").copied() == Some(n)).then_some(())
        },
    )
    .await
}

async fn client(
    service: &Service,
) -> anyhow::Result<pb::tool_runner_client::ToolRunnerClient<tonic::transport::Channel>> {
    Ok(pb::tool_runner_client::ToolRunnerClient::connect(format!("http://{}", service.grpc)).await?)
}

fn request(tool: &str, args: &str) -> pb::RunToolRequest {
    pb::RunToolRequest {
        tool_name: tool.into(),
        arguments_json: args.into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn sigterm_drains_in_flight_calls_refuses_new_ones_and_exits_zero() -> TestResult {
    let mut process = start(&["--shutdown-grace", "10s"]).await?;
    let client = client(&process).await?;
    let in_flight = tokio::spawn({
        let mut client = client.clone();
        async move { client.run_tool(request("sleep", r#"{"ms": 1500}"#)).await }
    });
    until_in_flight(&process, 1.0).await?;
    process.signal(nix::sys::signal::Signal::SIGTERM)?;
    // Once the drain has begun, a new call is refused (an echo before that is harmless).
    let refused = testkit::wait::until("a new call refused", Duration::from_secs(5), || {
        let mut client = client.clone();
        async move { client.run_tool(request("echo", "{}")).await.err() }
    })
    .await?;
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    let finished = in_flight.await??.into_inner();
    assert!(
        matches!(finished.outcome, Some(pb::run_tool_response::Outcome::ContentJson(_))),
        "{finished:?}"
    );

    assert_eq!(process.wait_exit().await?, Some(0));
    let logs = process.logs().join("\n");
    for expected in [
        "stop signal received",
        "SIGTERM",
        "draining",
        "drained",
        "tool-runner stopped",
    ] {
        assert!(logs.contains(expected), "logs lack {expected:?}:\n{logs}");
    }
    Ok(())
}

#[tokio::test]
async fn sigint_with_a_call_past_the_grace_period_still_exits_zero() -> TestResult {
    let mut process = start(&["--shutdown-grace", "200ms"]).await?;
    let mut client = client(&process).await?;
    let _stuck = tokio::spawn(async move { client.run_tool(request("sleep", r#"{"ms": 30000}"#)).await });
    until_in_flight(&process, 1.0).await?;
    process.signal(nix::sys::signal::Signal::SIGINT)?;
    assert_eq!(process.wait_exit().await?, Some(0));
    assert!(
        process.logs().join("\n").contains("grace period over"),
        "{:?}",
        process.logs()
    );
    Ok(())
}

async fn run_to_end(args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<(Option<i32>, String, String)> {
    testkit::run_to_end(Command::new(BIN), args, env).await
}

#[tokio::test]
async fn a_bad_manifest_stops_startup_naming_file_tool_and_problem() -> TestResult {
    let dir = tempfile::tempdir()?;
    let manifest = dir.path().join("tools.toml");
    std::fs::write(
        &manifest,
        "[[tool]]\nname = \"slow\"\ndescription = \"d\"\nargv = [\"sleep\", \"1\"]\ntimeout = \"3h\"\n",
    )?;
    let path = manifest.display().to_string();
    // No metrics port: another test of this file may hold the default one.
    let args = [
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "off",
        "--tools-manifest",
        &path,
    ];
    let (code, _, stderr) = run_to_end(&args, &[]).await?;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains(&path)
            && stderr.contains("tool \"slow\"")
            && stderr.contains("timeout = 3h is above its cap of 1h"),
        "{stderr}"
    );
    // check-manifest says the same without serving.
    let (code, _, stderr) = run_to_end(&["check-manifest", &path], &[]).await?;
    assert_eq!(code, Some(2));
    assert!(stderr.contains("timeout = 3h"), "{stderr}");
    Ok(())
}

/// The runner serving with `extra` flags and `env`, and the `max_concurrency` it logged.
async fn served_max_concurrency(extra: &[&str], env: &[(&str, &str)]) -> anyhow::Result<u64> {
    let service = start_with(extra, env).await?;
    let logged = service
        .logs()
        .iter()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .find(|line| line["message"] == "tool-runner serving")
        .and_then(|line| line["max_concurrency"].as_u64())
        .ok_or_else(|| anyhow::anyhow!("no max_concurrency in {:?}", service.logs()))?;
    service.stop().await?;
    Ok(logged)
}

/// `--config FILE` (or `TOOL_RUNNER_CONFIG`): the file's settings apply, the environment wins
/// over them and a flag over both; a bad file stops startup naming the file and the key, and a
/// value over its cap is refused as it would be from a flag.
#[tokio::test]
async fn a_settings_file_is_read_under_the_environment_and_the_flags() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("runner.toml");
    std::fs::write(
        &file,
        "max-concurrency = 7\nsleep_max = \"2s\"\nhttp-allow-port = [80, 8443]\n",
    )?;
    let path = file.display().to_string();
    assert_eq!(served_max_concurrency(&["--config", &path], &[]).await?, 7);
    assert_eq!(served_max_concurrency(&[], &[("TOOL_RUNNER_CONFIG", &path)]).await?, 7);
    let env = [("TOOL_RUNNER_MAX_CONCURRENCY", "9")];
    assert_eq!(served_max_concurrency(&["--config", &path], &env).await?, 9);
    assert_eq!(
        served_max_concurrency(&["--config", &path, "--max-concurrency", "11"], &env).await?,
        11
    );

    std::fs::write(&file, "max-concurency = 7\n")?;
    let (code, _, stderr) = run_to_end(&["--listen", "127.0.0.1:0", "--config", &path], &[]).await?;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains(&path) && stderr.contains("unknown setting \"max-concurency\""),
        "{stderr}"
    );
    std::fs::write(&file, "max-concurrency = 10001\n")?;
    let (code, _, stderr) = run_to_end(&["--listen", "127.0.0.1:0", "--config", &path], &[]).await?;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--max-concurrency = 10001 is above its cap of 10000"),
        "{stderr}"
    );
    Ok(())
}

#[tokio::test]
async fn limits_above_their_caps_are_refused_from_flags_and_environment() -> TestResult {
    let (code, _, stderr) = run_to_end(&["--listen", "127.0.0.1:0", "--max-json-depth", "129"], &[]).await?;
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("--max-json-depth = 129 is above its cap of 128"),
        "{stderr}"
    );
    let (code, _, stderr) = run_to_end(&["--listen", "127.0.0.1:0"], &[("TOOL_RUNNER_SHUTDOWN_GRACE", "2h")]).await?;
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("--shutdown-grace = 2h is above its cap of 1h"),
        "{stderr}"
    );
    let (code, _, stderr) = run_to_end(&["--listen", "127.0.0.1:0", "--shutdown-grace", "soon"], &[]).await?;
    assert_eq!(code, Some(2), "clap usage errors exit 2 too");
    assert!(stderr.contains("invalid duration"), "{stderr}");
    let (code, _, stderr) = run_to_end(&["--listen", "127.0.0.1:0"], &[("TOKIO_WORKER_THREADS", "0")]).await?;
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("tool-runner: TOKIO_WORKER_THREADS=\"0\" must be a whole number from 1 to 1024"),
        "{stderr}"
    );
    Ok(())
}

#[tokio::test]
async fn an_address_in_use_is_a_clear_startup_error() -> TestResult {
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let address = taken.local_addr()?.to_string();
    let (code, _, stderr) = run_to_end(&["--listen", &address, "--metrics-listen", "off"], &[]).await?;
    assert_eq!(code, Some(1));
    assert!(stderr.contains(&format!("cannot listen on {address}")), "{stderr}");
    Ok(())
}

#[tokio::test]
async fn list_and_call_commands_use_a_running_runner() -> TestResult {
    // A relative manifest path (the process runs in the repository root).
    let mut process = start(&["--tools-manifest", "deploy/tools/tools.toml"]).await?;
    let endpoint = format!("http://{}", process.grpc);

    let (code, stdout, _) = run_to_end(&["list", "--endpoint", &endpoint], &[]).await?;
    assert_eq!(code, Some(0));
    for tool in ["calculate", "echo", "sleep", "time_now", "text_stats", "system_info"] {
        assert!(
            stdout.lines().any(|l| l.starts_with(tool)),
            "{tool} missing from:\n{stdout}"
        );
    }
    let (code, stdout, stderr) = run_to_end(
        &["call", "calculate", r#"{"expression": "6 * 7"}"#],
        &[("TOOL_RUNNER_ENDPOINT", &endpoint)],
    )
    .await?;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&stdout)?["value"], 42);
    let (code, stdout, stderr) = run_to_end(
        &["call", "--endpoint", &endpoint, "text_stats", r#"{"text": "a b c"}"#],
        &[],
    )
    .await?;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&stdout)?["words"], 3);
    let (code, _, stderr) = run_to_end(&["call", "--endpoint", &endpoint, "sleep", r#"{"ms": -1}"#], &[]).await?;
    assert_eq!(code, Some(1));
    assert!(stderr.contains("INVALID_ARGUMENTS"), "{stderr}");
    let (code, _, stderr) = run_to_end(&["call", "--endpoint", "http://127.0.0.1:1", "echo"], &[]).await?;
    assert_eq!(code, Some(2));
    assert!(stderr.contains("cannot connect to http://127.0.0.1:1"), "{stderr}");

    process.signal(nix::sys::signal::Signal::SIGTERM)?;
    assert_eq!(process.wait_exit().await?, Some(0));
    // Every log line is one JSON object carrying the call's fields.
    let logs = process.logs();
    assert!(
        logs.iter()
            .all(|l| serde_json::from_str::<serde_json::Value>(l).is_ok()),
        "{logs:?}"
    );
    let call_line = logs
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["message"] == "tool call succeeded" && l["span"]["gen_ai.tool.name"] == "calculate")
        .ok_or_else(|| anyhow::anyhow!("no log line for the calculate call: {logs:?}"))?;
    assert_eq!(
        call_line["trace_id"].as_str().map(str::len),
        Some(32),
        "log lines carry the trace id: {call_line}"
    );
    assert_eq!(call_line["span_id"].as_str().map(str::len), Some(16), "{call_line}");
    Ok(())
}
