//! End-to-end tests of the tool-runner: the real service on a loopback port, called through the
//! generated gRPC client. Every built-in, command tools (success and every failure mode), argument
//! checks, the concurrency limit, cancellation, health, reflection and the in-process drain.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use proto::toolrunner::v1 as pb;
use proto::toolrunner::v1::ToolErrorCode as Code;
use serde_json::json;
use testkit::{Outcome, Runner, read_pids, repo_root, run_tool, wait_gone};
use tool_runner::Config;

type TestResult = anyhow::Result<()>;

async fn call(runner: &Runner, tool: &str, args: &str) -> anyhow::Result<Outcome> {
    let response = runner.client().await?.run_tool(run_tool(tool, args)).await?;
    Outcome::of(response.into_inner())
}

async fn default_runner() -> anyhow::Result<Runner> {
    Runner::start(Config::default()).await
}

#[tokio::test]
async fn list_tools_describes_every_builtin() -> TestResult {
    let runner = default_runner().await?;
    let tools = runner
        .client()
        .await?
        .list_tools(pb::ListToolsRequest {})
        .await?
        .into_inner()
        .tools;
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    // Sorted; the opt-in tools are absent without a sandbox root / allowlist.
    assert_eq!(names, ["calculate", "echo", "sleep", "time_now"]);
    for tool in &tools {
        assert_eq!(tool.source, "builtin");
        assert!(tool.timeout_ms > 0);
        assert!(!tool.description.is_empty());
        let schema: serde_json::Value = serde_json::from_str(&tool.parameters_json_schema)?;
        assert_eq!(schema["type"], "object", "{}", tool.name);
    }
    Ok(())
}

#[tokio::test]
async fn echo_returns_its_arguments() -> TestResult {
    let runner = default_runner().await?;
    let args = json!({"a": 1, "nested": {"b": [true, null, "x"]}});
    assert_eq!(call(&runner, "echo", &args.to_string()).await?.unwrap_ok(), args);
    // Empty arguments mean an empty object.
    assert_eq!(call(&runner, "echo", "").await?.unwrap_ok(), json!({}));
    Ok(())
}

#[tokio::test]
async fn sleep_waits_and_its_cap_is_enforced_by_the_schema() -> TestResult {
    let mut config = Config::default();
    config.builtins.sleep_max = Duration::from_millis(300);
    let runner = Runner::start(config).await?;
    let started = Instant::now();
    assert_eq!(
        call(&runner, "sleep", r#"{"ms": 300}"#).await?.unwrap_ok(),
        json!({"slept_ms": 300})
    );
    assert!(started.elapsed() >= Duration::from_millis(300));
    let (code, message) = call(&runner, "sleep", r#"{"ms": 301}"#).await?.unwrap_err();
    assert_eq!(code, Code::InvalidArguments);
    assert!(message.contains("at /ms") && message.contains("300"), "{message}");
    Ok(())
}

#[tokio::test]
async fn time_now_reports_the_current_time() -> TestResult {
    let runner = default_runner().await?;
    let now = json!(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis() as u64
    );
    let value = call(&runner, "time_now", "{}").await?.unwrap_ok();
    let reported = value["unix_ms"].as_u64().unwrap_or_default();
    assert!(reported.abs_diff(now.as_u64().unwrap_or_default()) < 60_000, "{value}");
    assert!(value["rfc3339"].as_str().is_some_and(|s| s.ends_with('Z')), "{value}");
    Ok(())
}

#[tokio::test]
async fn calculate_parses_arithmetic_and_explains_errors() -> TestResult {
    let runner = default_runner().await?;
    let value = call(&runner, "calculate", r#"{"expression": "(2 + 3) * 4 ^ 2 / sqrt(16)"}"#)
        .await?
        .unwrap_ok();
    assert_eq!(value["value"], json!(20));
    let (code, message) = call(&runner, "calculate", r#"{"expression": "system('ls')"}"#)
        .await?
        .unwrap_err();
    assert_eq!(code, Code::InvalidArguments);
    assert!(message.contains("unexpected character"), "{message}");
    Ok(())
}

#[tokio::test]
async fn sandboxed_file_tools_read_inside_and_refuse_escapes() -> TestResult {
    let dir = tempfile::tempdir()?;
    std::fs::create_dir(dir.path().join("docs"))?;
    std::fs::write(dir.path().join("docs/readme.txt"), "hello sandbox")?;
    std::fs::write(dir.path().join("big.txt"), "x".repeat(100))?;
    std::os::unix::fs::symlink("/etc", dir.path().join("escape"))?;
    let mut config = Config::default();
    config.builtins.sandbox_root = Some(dir.path().to_owned());
    config.builtins.read_max_bytes = 50;
    let runner = Runner::start(config).await?;

    let file = call(&runner, "read_file", r#"{"path": "docs/readme.txt"}"#)
        .await?
        .unwrap_ok();
    assert_eq!(file["content"], "hello sandbox");
    assert_eq!(file["truncated"], false);
    // Both sides of the size limit.
    let big = call(&runner, "read_file", r#"{"path": "big.txt"}"#).await?.unwrap_ok();
    assert_eq!(big["content"].as_str().map(str::len), Some(50));
    assert_eq!(big["truncated"], true);
    let small = call(&runner, "read_file", r#"{"path": "big.txt", "max_bytes": 100}"#)
        .await?
        .unwrap_ok();
    assert_eq!(
        small["content"].as_str().map(str::len),
        Some(50),
        "the runner's cap wins over the caller's"
    );

    let listing = call(&runner, "list_dir", "{}").await?.unwrap_ok();
    let names: Vec<&str> = listing["entries"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert_eq!(names, ["big.txt", "docs", "escape"]);
    assert_eq!(listing["entries"][1]["type"], "dir");

    for (path, why) in [
        ("../etc/passwd", ".."),
        ("/etc/passwd", "absolute"),
        ("escape/passwd", "outside the sandbox"),
    ] {
        let (code, message) = call(&runner, "read_file", &json!({ "path": path }).to_string())
            .await?
            .unwrap_err();
        assert_eq!(code, Code::PermissionDenied, "{path}: {message}");
        assert!(message.contains(why), "{path}: {message}");
    }
    let (code, _) = call(&runner, "list_dir", r#"{"path": "escape"}"#).await?.unwrap_err();
    assert_eq!(code, Code::PermissionDenied);
    let (code, message) = call(&runner, "read_file", r#"{"path": "missing.txt"}"#)
        .await?
        .unwrap_err();
    assert_eq!(
        (code, message.contains("does not exist")),
        (Code::Failed, true),
        "{message}"
    );
    Ok(())
}

#[tokio::test]
async fn opt_in_tools_are_off_by_default() -> TestResult {
    let runner = default_runner().await?;
    for (tool, flag) in [
        ("read_file", "--sandbox-root"),
        ("list_dir", "--sandbox-root"),
        ("http_get", "--http-allow-host"),
    ] {
        let (code, message) = call(&runner, tool, r#"{"path": "x", "url": "http://127.0.0.1/"}"#)
            .await?
            .unwrap_err();
        assert_eq!(code, Code::Unavailable, "{tool}");
        assert!(message.contains("disabled") && message.contains(flag), "{message}");
    }
    Ok(())
}

/// A one-thread HTTP server on loopback answering every request with `response(path)`.
fn http_server(response: fn(&str, u16) -> String) -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten().take(20) {
            let mut stream = stream;
            let mut buf = [0u8; 4096];
            let n = stream.read(&mut buf).unwrap_or(0);
            let request = String::from_utf8_lossy(&buf[..n]).into_owned();
            let path = request.split_whitespace().nth(1).unwrap_or("/").to_owned();
            let _ = stream.write_all(response(&path, port).as_bytes());
        }
    });
    Ok(port)
}

#[tokio::test]
async fn http_get_fetches_allowlisted_hosts_only() -> TestResult {
    let port = http_server(|path, port| match path {
        "/redirect-out" => {
            "HTTP/1.1 302 Found\r\nLocation: http://forbidden.test/\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                .into()
        }
        "/redirect-in" => format!(
            "HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:{port}/hello\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        ),
        "/big" => format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100\r\nConnection: close\r\n\r\n{}",
            "y".repeat(100)
        ),
        _ => {
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello".into()
        }
    })?;
    let get = |path: &str| json!({ "url": format!("http://127.0.0.1:{port}{path}") }).to_string();
    // The egress policy by default: loopback and ports other than 80/443 are refused, whatever
    // the host allowlist says, and so is a name that resolves to loopback.
    let mut config = Config::default();
    config.builtins.http_allow_hosts = vec!["127.0.0.1".into(), "localhost".into(), "169.254.169.254".into()];
    let closed = Runner::start(config.clone()).await?;
    let (code, message) = call(&closed, "http_get", &get("/hello")).await?.unwrap_err();
    assert_eq!(code, Code::PermissionDenied, "{message}");
    assert!(message.contains(&format!("port {port} is not allowed")), "{message}");
    let (code, message) = call(&closed, "http_get", r#"{"url": "http://localhost/"}"#)
        .await?
        .unwrap_err();
    assert_eq!(code, Code::PermissionDenied, "{message}");
    assert!(
        message.contains("resolves only to refused addresses") && message.contains("loopback"),
        "{message}"
    );
    let (code, message) = call(
        &closed,
        "http_get",
        r#"{"url": "http://169.254.169.254/latest/meta-data/"}"#,
    )
    .await?
    .unwrap_err();
    assert_eq!(code, Code::PermissionDenied, "{message}");
    assert!(message.contains("link-local"), "{message}");

    // Admitted by CIDR and port, loopback is reached.
    config.builtins.http_allow_cidrs = vec!["127.0.0.0/8".parse()?];
    config.builtins.http_allow_ports = vec![port];
    config.builtins.http_max_bytes = 60;
    let runner = Runner::start(config).await?;

    let page = call(&runner, "http_get", &get("/hello")).await?.unwrap_ok();
    assert_eq!(
        (page["status"].clone(), page["body"].clone()),
        (json!(200), json!("hello"))
    );
    let redirected = call(&runner, "http_get", &get("/redirect-in")).await?.unwrap_ok();
    assert_eq!(redirected["body"], "hello");
    let big = call(&runner, "http_get", &get("/big")).await?.unwrap_ok();
    assert_eq!(
        (big["body"].as_str().map(str::len), big["truncated"].clone()),
        (Some(60), json!(true))
    );

    let (code, message) = call(&runner, "http_get", &get("/redirect-out")).await?.unwrap_err();
    assert_eq!(code, Code::PermissionDenied, "{message}");
    assert!(message.contains("forbidden.test"), "{message}");
    let (code, message) = call(&runner, "http_get", r#"{"url": "http://example.com:1/"}"#)
        .await?
        .unwrap_err();
    assert_eq!(code, Code::PermissionDenied);
    assert!(
        message.contains("\"example.com\" is not on this runner's allowlist"),
        "{message}"
    );
    let (code, _) = call(&runner, "http_get", r#"{"url": "file:///etc/passwd"}"#)
        .await?
        .unwrap_err();
    assert_eq!(code, Code::PermissionDenied);
    Ok(())
}

#[tokio::test]
async fn the_example_manifest_tools_work() -> TestResult {
    let config = Config {
        tools_manifest: Some(repo_root().join("deploy/tools/tools.toml")),
        ..Config::default()
    };
    let runner = Runner::start(config).await?;
    let stats = call(&runner, "text_stats", r#"{"text": "one two\nthree \"four\"\n"}"#)
        .await?
        .unwrap_ok();
    assert_eq!(stats, json!({"lines": 2, "words": 4, "characters": 21}));
    let disk = call(&runner, "disk_usage", "{}").await?.unwrap_ok();
    assert!(disk["size_bytes"].as_f64().unwrap_or_default() > 0.0, "{disk}");
    let info = call(&runner, "system_info", "{}").await?.unwrap_ok();
    assert!(info.as_str().is_some_and(|s| s.starts_with("Linux")), "{info}");
    let tools = runner
        .client()
        .await?
        .list_tools(pb::ListToolsRequest {})
        .await?
        .into_inner()
        .tools;
    assert!(
        tools
            .iter()
            .any(|t| t.name == "text_stats" && t.source == "command" && t.timeout_ms == 10_000)
    );
    Ok(())
}

/// A manifest of misbehaving command tools, written into `dir`.
fn test_manifest(dir: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    std::fs::create_dir(dir.join("work"))?;
    let pidfile = dir.join("pids");
    let manifest = format!(
        r#"
[[tool]]
name = "cat_json"
description = "returns its arguments"
argv = ["cat"]
output = "json"

[[tool]]
name = "fail"
description = "exits 3 explaining why on stderr"
argv = ["sh", "-c", "echo 'noise' >&2; echo 'the disk is on fire' >&2; exit 3"]

[[tool]]
name = "fail_loud"
description = "exits 3 explaining why on stderr, which the model may see"
argv = ["sh", "-c", "echo 'the disk is on fire' >&2; exit 3"]
stderr_to_model = true

[[tool]]
name = "hog"
description = "allocates far past its memory limit"
argv = ["/usr/bin/python3", "-c", "bytearray(2 * 1024 ** 3)"]
[tool.limits]
max_memory_bytes = 268435456

[[tool]]
name = "spin"
description = "burns CPU without end"
argv = ["sh", "-c", "while :; do :; done"]
timeout = "20s"
[tool.limits]
max_cpu_seconds = 1

[[tool]]
name = "fork_flood"
description = "starts processes without end"
argv = ["sh", "-c", "while :; do sleep 37 & done"]
timeout = "1s"
[tool.limits]
max_processes = 64

[[tool]]
name = "disk_filler"
description = "writes a file without end"
argv = ["sh", "-c", "cat /dev/zero > filler"]
working_dir = "work"
timeout = "20s"
[tool.limits]
max_file_bytes = 1048576

[[tool]]
name = "hang"
description = "starts a grandchild and waits for it"
argv = ["sh", "-c", "sleep 30 & echo $$ $! > \"$PIDFILE\"; wait"]
timeout = "500ms"
env = {{ PIDFILE = "{pidfile}" }}

[[tool]]
name = "hang_long"
description = "starts a grandchild and waits for it"
argv = ["sh", "-c", "sleep 30 & echo $$ $! > \"$PIDFILE\"; wait"]
timeout = "30s"
env = {{ PIDFILE = "{pidfile}" }}

[[tool]]
name = "flood"
description = "writes without end"
argv = ["yes"]
max_stdout_bytes = 1000

[[tool]]
name = "at_cap"
description = "writes exactly 1000 bytes"
argv = ["head", "-c", "1000", "/dev/zero"]
max_stdout_bytes = 1000
output = "text"

[[tool]]
name = "text_out"
description = "prints text"
argv = ["echo", "not json"]

[[tool]]
name = "strict_json"
description = "prints text but promises JSON"
argv = ["echo", "not json"]
output = "json"

[[tool]]
name = "env_dump"
description = "prints its environment"
argv = ["env"]
output = "text"
env_allowlist = ["PATH"]
env = {{ GREETING = "hi" }}

[[tool]]
name = "where"
description = "prints its working directory"
argv = ["pwd"]
working_dir = "work"
output = "text"
"#,
        pidfile = pidfile.display()
    );
    let path = dir.join("tools.toml");
    std::fs::write(&path, manifest)?;
    Ok(path)
}

async fn command_runner(dir: &std::path::Path) -> anyhow::Result<Runner> {
    let config = Config {
        tools_manifest: Some(test_manifest(dir)?),
        ..Config::default()
    };
    Runner::start(config).await
}

#[tokio::test]
async fn command_tools_succeed_with_json_text_env_and_working_dir() -> TestResult {
    let dir = tempfile::tempdir()?;
    let runner = command_runner(dir.path()).await?;
    let args = json!({"x": [1, 2], "s": "é"});
    assert_eq!(call(&runner, "cat_json", &args.to_string()).await?.unwrap_ok(), args);
    assert_eq!(call(&runner, "text_out", "{}").await?.unwrap_ok(), json!("not json"));
    let mut request = run_tool("env_dump", "{}");
    request.metadata.insert("tenant-id".into(), "acme".into());
    request.principal = "billing".into();
    request.epoch = 3;
    let env = Outcome::of(runner.client().await?.run_tool(request).await?.into_inner())?.unwrap_ok();
    let env = env.as_str().unwrap_or_default();
    let mut names: Vec<&str> = env.lines().filter_map(|l| l.split('=').next()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "GREETING",
            "PATH",
            "TOOL_CALL_ID",
            "TOOL_META_TENANT_ID",
            "TOOL_PRINCIPAL",
            "TOOL_RUN_EPOCH",
            "TOOL_RUN_ID"
        ],
        "the environment is cleared except the allowlist and the call's context: {env}"
    );
    for line in [
        "TOOL_RUN_ID=test-run",
        "TOOL_CALL_ID=test-call",
        "TOOL_META_TENANT_ID=acme",
        "TOOL_PRINCIPAL=billing",
        "TOOL_RUN_EPOCH=3",
        "GREETING=hi",
    ] {
        assert!(env.lines().any(|l| l == line), "{line} missing from {env}");
    }
    let cwd = call(&runner, "where", "{}").await?.unwrap_ok();
    assert_eq!(
        cwd.as_str().map(std::path::PathBuf::from),
        Some(std::fs::canonicalize(dir.path().join("work"))?)
    );
    Ok(())
}

#[tokio::test]
async fn command_tool_failures_are_answers() -> TestResult {
    let dir = tempfile::tempdir()?;
    let runner = command_runner(dir.path()).await?;
    let (code, message) = call(&runner, "fail", "{}").await?.unwrap_err();
    assert_eq!(code, Code::Failed);
    // stderr stays out of what the model sees unless the manifest lets it through.
    assert!(
        message.contains("exited with status 3")
            && message.contains("stderr is in the runner's log")
            && !message.contains("the disk is on fire"),
        "{message}"
    );
    let (_, message) = call(&runner, "fail_loud", "{}").await?.unwrap_err();
    assert!(message.contains("the disk is on fire"), "{message}");

    // Output cap: both sides of the edge.
    assert_eq!(
        call(&runner, "at_cap", "{}").await?.unwrap_ok().as_str().map(str::len),
        Some(1000)
    );
    let (code, message) = call(&runner, "flood", "{}").await?.unwrap_err();
    assert_eq!(code, Code::Failed);
    assert!(message.contains("more than 1000 bytes"), "{message}");

    let (code, message) = call(&runner, "strict_json", "{}").await?.unwrap_err();
    assert_eq!(code, Code::Failed);
    assert!(
        message.contains("not valid JSON") && message.contains("not json"),
        "{message}"
    );
    Ok(())
}

/// The processes whose command line is `sleep 37` (the fork flood's children).
fn flood_children() -> usize {
    std::fs::read_dir("/proc")
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
                .filter(|cmdline| cmdline.as_slice() == b"sleep\x0037\x00")
                .count()
        })
        .unwrap_or(0)
}

#[tokio::test]
async fn command_tools_past_their_resource_limits_end_with_a_clear_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    let runner = command_runner(dir.path()).await?;
    let (code, message) = call(&runner, "hog", "{}").await?.unwrap_err();
    assert_eq!(code, Code::Failed);
    assert!(
        message.contains("exited with status 1") && message.contains("memory 256 MiB"),
        "{message}"
    );
    let (code, message) = call(&runner, "spin", "{}").await?.unwrap_err();
    assert_eq!(code, Code::Failed);
    assert!(message.contains("used up its 1 CPU seconds"), "{message}");
    let (code, message) = call(&runner, "disk_filler", "{}").await?.unwrap_err();
    assert_eq!(code, Code::Failed);
    assert!(message.contains("wrote a file past 1048576 bytes"), "{message}");
    assert_eq!(std::fs::metadata(dir.path().join("work/filler"))?.len(), 1_048_576);
    // A fork flood ends at its timeout with its whole process group (as root the kernel does
    // not enforce max_processes, so the timeout is what stops it here).
    let (code, message) = call(&runner, "fork_flood", "{}").await?.unwrap_err();
    assert_eq!(code, Code::Timeout, "{message}");
    testkit::wait::until_sync("no flood process left", std::time::Duration::from_secs(10), || {
        (flood_children() == 0).then_some(())
    })
    .await?;
    // The runner goes on serving.
    let args = json!({"after": "limits"});
    assert_eq!(call(&runner, "cat_json", &args.to_string()).await?.unwrap_ok(), args);
    Ok(())
}

#[tokio::test]
async fn command_tool_timeout_kills_the_whole_process_group() -> TestResult {
    let dir = tempfile::tempdir()?;
    let runner = command_runner(dir.path()).await?;
    let started = Instant::now();
    let (code, message) = call(&runner, "hang", "{}").await?.unwrap_err();
    assert_eq!(code, Code::Timeout, "{message}");
    assert!(started.elapsed() < Duration::from_secs(10));
    let pids = read_pids(&dir.path().join("pids"), 2).await?;
    assert_eq!(
        wait_gone(&pids, Duration::from_secs(5)).await,
        Vec::<u32>::new(),
        "shell and grandchild must be gone"
    );
    Ok(())
}

#[tokio::test]
async fn caller_cancellation_stops_the_tool() -> TestResult {
    let dir = tempfile::tempdir()?;
    let runner = command_runner(dir.path()).await?;
    let mut client = runner.client().await?;
    let pending = client.run_tool(run_tool("hang_long", "{}"));
    // Give up on the call after the tool has started: the client resets the HTTP/2 stream.
    let abandoned = tokio::time::timeout(Duration::from_millis(700), pending).await;
    assert!(abandoned.is_err(), "the call should still be running");
    let pids = read_pids(&dir.path().join("pids"), 2).await?;
    assert_eq!(
        wait_gone(&pids, Duration::from_secs(5)).await,
        Vec::<u32>::new(),
        "canceled tool's processes must be gone"
    );
    Ok(())
}

#[tokio::test]
async fn bad_arguments_get_clear_errors_and_nothing_breaks() -> TestResult {
    let mut config = Config::default();
    config.arg_limits.max_bytes = 1000;
    config.arg_limits.max_depth = 8;
    let runner = Runner::start(config).await?;
    let nested = |depth: usize| format!("{}{}", "{\"a\":".repeat(depth), "1".to_owned() + &"}".repeat(depth));
    let padded = |len: usize| {
        let base = r#"{"p":""}"#.len();
        format!(r#"{{"p":"{}"}}"#, "x".repeat(len - base))
    };
    let cases: Vec<(&str, String, &str)> = vec![
        ("echo", "{not json".into(), "not valid JSON"),
        ("echo", "[1, 2]".into(), "must be a JSON object, not an array"),
        ("echo", "\"text\"".into(), "not a string"),
        ("echo", padded(1001), "1001 bytes, above the limit of 1000"),
        ("echo", nested(9), "nest deeper than 8"),
        ("sleep", r#"{"ms": "soon"}"#.into(), "at /ms"),
        ("sleep", "{}".into(), "\"ms\" is a required property"),
        ("sleep", r#"{"ms": 1, "extra": true}"#.into(), "extra"),
        ("no_such_tool", "{}".into(), "no tool named \"no_such_tool\""),
    ];
    for (tool, args, expected) in cases {
        let (code, message) = call(&runner, tool, &args).await?.unwrap_err();
        let want = if tool == "no_such_tool" {
            Code::NotFound
        } else {
            Code::InvalidArguments
        };
        assert_eq!(code, want, "{args}: {message}");
        assert!(
            message.contains(expected),
            "{args}: {message:?} should contain {expected:?}"
        );
    }
    // The other side of both edges is accepted.
    assert!(matches!(call(&runner, "echo", &padded(1000)).await?, Outcome::Ok(_)));
    assert!(matches!(call(&runner, "echo", &nested(8)).await?, Outcome::Ok(_)));
    // A request without a tool name is not a tool call at all.
    let status = runner.client().await?.run_tool(run_tool("", "{}")).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    // Still serving.
    assert!(matches!(call(&runner, "echo", "{}").await?, Outcome::Ok(_)));
    Ok(())
}

#[tokio::test]
async fn concurrency_limit_refuses_beyond_and_admits_again_after() -> TestResult {
    let mut config = Config::default();
    config.server.max_concurrency = 2;
    let runner = Runner::start(config).await?;
    let mut busy = Vec::new();
    for _ in 0..2 {
        let mut client = runner.client().await?;
        busy.push(tokio::spawn(async move {
            client.run_tool(run_tool("sleep", r#"{"ms": 800}"#)).await
        }));
    }
    // Once both sleeps hold the two slots, a third call is refused (an echo admitted before that
    // merely finishes).
    let status = testkit::wait::until("both sleeps to hold the runner", Duration::from_secs(5), || async {
        let mut client = runner.client().await.ok()?;
        client.run_tool(run_tool("echo", "{}")).await.err()
    })
    .await?;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert!(
        status.message().contains("concurrency limit of 2"),
        "{}",
        status.message()
    );
    // Other methods are not limited.
    runner.client().await?.list_tools(pb::ListToolsRequest {}).await?;
    for call in busy {
        assert!(matches!(Outcome::of(call.await??.into_inner())?, Outcome::Ok(_)));
    }
    assert!(matches!(call(&runner, "echo", "{}").await?, Outcome::Ok(_)));
    Ok(())
}

#[tokio::test]
async fn health_reports_serving_then_not_serving_while_draining() -> TestResult {
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};
    let mut runner = default_runner().await?;
    let mut health = HealthClient::new(runner.channel().await?);
    let check = |service: &str| HealthCheckRequest {
        service: service.into(),
    };
    for service in ["", "toolrunner.v1.ToolRunner"] {
        assert_eq!(
            health.check(check(service)).await?.into_inner().status(),
            ServingStatus::Serving
        );
    }

    // A call in flight when the drain starts completes; new calls are refused.
    let mut client = runner.client().await?;
    let in_flight = tokio::spawn(async move { client.run_tool(run_tool("sleep", r#"{"ms": 700}"#)).await });
    // Stays: the runner in this process shows no count of calls in flight to wait for; the call
    // reaching it later than this would be refused by the drain, and the test would fail loudly.
    tokio::time::sleep(Duration::from_millis(200)).await;
    runner.begin_shutdown();
    testkit::wait::until("the runner to report NOT_SERVING", Duration::from_secs(5), || {
        let mut health = health.clone();
        async move {
            let status = health.check(check("toolrunner.v1.ToolRunner")).await.ok()?;
            (status.into_inner().status() == ServingStatus::NotServing).then_some(())
        }
    })
    .await?;
    assert_eq!(
        health.check(check("")).await?.into_inner().status(),
        ServingStatus::Serving,
        "the overall status stays SERVING during the drain, so liveness probes pass"
    );
    let refused = runner
        .client()
        .await?
        .run_tool(run_tool("echo", "{}"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(matches!(Outcome::of(in_flight.await??.into_inner())?, Outcome::Ok(_)));
    runner.shutdown().await
}

#[tokio::test]
async fn reflection_v1_and_v1alpha_list_the_services() -> TestResult {
    let runner = default_runner().await?;
    for names in testkit::reflected_services(runner.channel().await?).await? {
        for expected in [
            "toolrunner.v1.ToolRunner",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        ] {
            assert!(names.iter().any(|n| n == expected), "{names:?} lacks {expected}");
        }
        assert!(
            !names.iter().any(|n| n == "orchestrator.v1.Orchestrator"),
            "the runner does not serve it: {names:?}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn startup_refuses_invalid_configuration_and_manifests() -> TestResult {
    let dir = tempfile::tempdir()?;
    let manifest = dir.path().join("bad.toml");
    std::fs::write(
        &manifest,
        "[[tool]]\nname = \"echo\"\ndescription = \"clashes with the built-in\"\nargv = [\"cat\"]\n",
    )?;
    let config = Config {
        tools_manifest: Some(manifest),
        ..Config::default()
    };
    let err = tool_runner::server::build_catalog(&config)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("two tools are named \"echo\""), "{err}");

    let mut config = Config::default();
    config.server.max_concurrency = 10_001;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let err = tool_runner::serve(listener, config, std::future::pending())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--max-concurrency = 10001 is above its cap of 10000"),
        "{err}"
    );
    Ok(())
}
