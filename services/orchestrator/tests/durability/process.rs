//! Tests of the `orchestrator` process itself: exit codes for bad flags, the `call` client against
//! a served orchestrator, and the drain on SIGTERM. (The one-command demo is the `demo` package.)

use tokio::process::Command;

type TestResult = anyhow::Result<()>;

const BIN: &str = env!("CARGO_BIN_EXE_orchestrator");

/// Runs the binary to its end; `LLM_BASE_URL` from the shell must not change what it does, and
/// it never takes the default metrics port (tests run side by side).
async fn run_to_end(args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<(Option<i32>, String, String)> {
    let mut command = Command::new(BIN);
    command
        .env_remove("LLM_BASE_URL")
        .env("ORCHESTRATOR_METRICS_LISTEN", "off");
    testkit::run_to_end(command, args, env).await
}

#[tokio::test]
async fn bad_flags_exit_2_naming_the_problem() -> TestResult {
    let cases: [(&[&str], &str); 4] = [
        (
            &["--listen", "127.0.0.1:0", "--max-turns-ceiling", "129"],
            "--max-turns-ceiling = 129 is above its cap of 128",
        ),
        (
            &["--listen", "127.0.0.1:0", "--exit-tool", "bad.name"],
            "--exit-tool \"bad.name\"",
        ),
        (
            &["--listen", "127.0.0.1:0", "--llm-base-url", "ftp://x"],
            "must be an http or https URL",
        ),
        (
            &["--listen", "127.0.0.1:0", "--llm-header", "no-colon"],
            "--llm-header entry 1 is not `Name: value`",
        ),
    ];
    for (args, expected) in cases {
        let (code, _, stderr) = run_to_end(args, &[]).await?;
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
    let (code, _, stderr) = run_to_end(&["--listen", "127.0.0.1:0"], &[("ORCHESTRATOR_MAX_RUNS", "0")]).await?;
    assert_eq!(code, Some(2));
    assert!(stderr.contains("--max-runs = 0 is below its minimum of 1"), "{stderr}");

    // The same checks hold for a settings file; a key that is no flag names the file.
    let dir = tempfile::tempdir()?;
    let settings = dir.path().join("orchestrator.toml");
    let path = settings.display().to_string();
    for (text, expected) in [
        (
            "max-turns-ceiling = 129\n",
            "--max-turns-ceiling = 129 is above its cap of 128".to_owned(),
        ),
        (
            "llm-api-key = \"sk-1\"\n",
            format!("{path}: unknown setting \"llm-api-key\""),
        ),
    ] {
        std::fs::write(&settings, text)?;
        let (code, _, stderr) = run_to_end(&["--listen", "127.0.0.1:0"], &[("ORCHESTRATOR_CONFIG", &path)]).await?;
        assert_eq!(code, Some(2), "{text}: {stderr}");
        assert!(stderr.contains(&expected), "{text}: {stderr}");
    }
    Ok(())
}

/// `call --attach` replays the finished run from the start (printing what the run printed, after
/// a line saying where it starts), or from a seq on.
async fn call_attach_replays_what_the_run_printed(endpoint: &str, printed: &str) -> TestResult {
    let (code, replayed, stderr) =
        run_to_end(&["call", "--endpoint", endpoint, "--attach", "process-run"], &[]).await?;
    assert_eq!(code, Some(0), "{replayed}\n{stderr}");
    assert_eq!(
        replayed,
        format!("▶ attached to run process-run: its events from the first\n{printed}"),
        "the replay prints what the run printed"
    );
    let (code, tail, stderr) = run_to_end(
        &[
            "call",
            "--endpoint",
            endpoint,
            "--attach",
            "process-run",
            "--after",
            "3",
        ],
        &[],
    )
    .await?;
    assert_eq!(code, Some(0), "{tail}\n{stderr}");
    assert!(
        tail.starts_with("▶ attached to run process-run: its events after seq 3\n")
            && !tail.contains("▶ run process-run started")
            && tail.contains("■ COMPLETED"),
        "{tail}"
    );
    Ok(())
}

/// A renamed flag keeps its old name for a release: on the command line and as its old
/// environment variable it still sets the setting (here past its cap, so the binary stops at once
/// naming the new flag), with a warning naming both names.
#[tokio::test]
async fn a_renamed_flag_works_under_its_old_name_with_a_warning() -> TestResult {
    let warning = "warning: --handoff-grace is renamed --hand-over-grace";
    let (code, _, stderr) = run_to_end(&["--listen", "127.0.0.1:0", "--handoff-grace", "11m"], &[]).await?;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains(warning), "{stderr}");
    assert!(
        stderr.contains("--hand-over-grace = 11m is above its cap of 10m"),
        "{stderr}"
    );
    let (code, _, stderr) = run_to_end(&["--listen", "127.0.0.1:0"], &[("ORCHESTRATOR_HANDOFF_GRACE", "11m")]).await?;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("warning: ORCHESTRATOR_HANDOFF_GRACE is renamed ORCHESTRATOR_HAND_OVER_GRACE"),
        "{stderr}"
    );
    assert!(stderr.contains("--hand-over-grace = 11m is above its cap"), "{stderr}");
    // Under its new name, nothing is said.
    let (code, _, stderr) = run_to_end(&["--listen", "127.0.0.1:0", "--hand-over-grace", "11m"], &[]).await?;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(!stderr.contains("warning:"), "{stderr}");
    // A parked run is parked: --max-awaiting-runs became --max-parked-runs.
    let old = ["--listen", "127.0.0.1:0", "--max-awaiting-runs=0"];
    let (code, _, stderr) = run_to_end(&old, &[]).await?;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("warning: --max-awaiting-runs is renamed --max-parked-runs"),
        "{stderr}"
    );
    assert!(stderr.contains("--max-parked-runs = 0 is below"), "{stderr}");
    let env = [("ORCHESTRATOR_MAX_AWAITING_RUNS", "0")];
    let (code, _, stderr) = run_to_end(&["--listen", "127.0.0.1:0"], &env).await?;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("ORCHESTRATOR_MAX_AWAITING_RUNS is renamed"), "{stderr}");
    Ok(())
}

/// A refused call is the orchestrator's answer, not a usage error: exit 3, and not worded as a
/// configuration error; conflicting flags are a usage error, exit 2.
async fn a_refused_call_exits_3_and_bad_usage_exits_2(endpoint: &str) -> TestResult {
    let (code, _, stderr) = run_to_end(&["call", "--endpoint", endpoint, "--attach", "no-such-run"], &[]).await?;
    assert_eq!(code, Some(3), "{stderr}");
    assert!(
        stderr.contains("attach to run \"no-such-run\": ")
            && stderr.contains("(NOT_FOUND)")
            && !stderr.contains("invalid configuration"),
        "{stderr}"
    );
    let (code, _, stderr) = run_to_end(&["call", "--prompt", "x", "--attach", "r"], &[]).await?;
    assert_eq!(code, Some(2), "--prompt and --attach together: {stderr}");

    Ok(())
}

/// SIGTERM drains and exits 0, logging each step; the API key is in no log line.
async fn sigterm_drains_and_the_key_is_never_logged(orchestrator: &mut testkit::Service) -> TestResult {
    orchestrator.signal(nix::sys::signal::Signal::SIGTERM)?;
    assert_eq!(orchestrator.wait_exit().await?, Some(0));
    let logs = orchestrator.logs().join("\n");
    for expected in [
        "stop signal received",
        "draining",
        "orchestrator stopped",
        "run finished",
    ] {
        assert!(logs.contains(expected), "{expected:?} missing from the logs:\n{logs}");
    }
    assert!(!logs.contains("sk-never-logged"), "the API key leaked into the logs");
    Ok(())
}

#[tokio::test]
async fn serve_call_and_drain_on_sigterm() -> TestResult {
    // A tool-runner and the stand-in model in this process; the orchestrator as a real process.
    let runner_url = testkit::tool_runner_in_process().await?;
    let mock = mock_llm::MockLlm::start(mock_llm::Scenario::demo()).await?;

    // The settings from a file (`--config`); the key stays in the environment.
    let dir = tempfile::tempdir()?;
    let settings = dir.path().join("orchestrator.toml");
    std::fs::write(
        &settings,
        format!(
            "shutdown-grace = \"5s\"\nllm-base-url = \"{}\"\ntool-runner = [\"{runner_url}\"]\nexit-tool = [\"submit_report\"]\n",
            mock.base_url()
        ),
    )?;
    let mut command = Command::new(BIN);
    command
        .args(["--config", &settings.display().to_string()])
        .env_remove("LLM_BASE_URL")
        .env_remove("TOOL_RUNNER_ENDPOINTS")
        .env_remove("ORCHESTRATOR_EXIT_TOOLS")
        .env("LLM_API_KEY", "sk-never-logged");
    let mut orchestrator = testkit::Service::orchestrator(command).await?;
    let endpoint = format!("http://{}", orchestrator.grpc);
    let (code, stdout, stderr) = run_to_end(
        &[
            "call",
            "--endpoint",
            &endpoint,
            "--prompt",
            "go",
            "--run-id",
            "process-run",
            "--tool",
            "calculate",
            "--tool",
            "time_now",
            "--tool",
            "sleep",
        ],
        &[],
    )
    .await?;
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("‥ reasoning\nThree independent lookups")
            && stdout.contains("‥ answer\nI'll gather")
            && stdout.contains("⚑ signal submit_report")
            && stdout.contains("■ COMPLETED"),
        "{stdout}"
    );
    call_attach_replays_what_the_run_printed(&endpoint, &stdout).await?;
    a_refused_call_exits_3_and_bad_usage_exits_2(&endpoint).await?;
    sigterm_drains_and_the_key_is_never_logged(&mut orchestrator).await?;
    Ok(())
}

#[tokio::test]
async fn worker_threads_come_from_tokio_worker_threads_and_bad_values_exit_2() -> TestResult {
    let (code, stdout, stderr) = run_to_end(&["--version"], &[("TOKIO_WORKER_THREADS", "1")]).await?;
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("orchestrator"), "{stdout}");
    for bad in ["0", "1025", "two"] {
        let (code, _, stderr) = run_to_end(&["--version"], &[("TOKIO_WORKER_THREADS", bad)]).await?;
        assert_eq!(code, Some(2), "{bad}: {stderr}");
        let expected = format!("orchestrator: TOKIO_WORKER_THREADS={bad:?} must be a whole number from 1 to 1024");
        assert!(stderr.contains(&expected), "{bad}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    Ok(())
}
