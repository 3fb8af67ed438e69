//! Tests of the `demo` binary: the whole loop on the stand-in model, and the runtime's worker
//! threads from `TOKIO_WORKER_THREADS`.

use tokio::process::Command;

type TestResult = anyhow::Result<()>;

const BIN: &str = env!("CARGO_BIN_EXE_demo");

/// Runs the demo to its end; `LLM_BASE_URL` from the shell must not turn it real.
async fn run_to_end(args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<(Option<i32>, String, String)> {
    let mut command = Command::new(BIN);
    command.env_remove("LLM_BASE_URL");
    testkit::run_to_end(command, args, env).await
}

#[tokio::test]
async fn the_demo_shows_a_whole_run_with_parallel_calls_and_a_signal() -> TestResult {
    let (code, stdout, stderr) = run_to_end(&[], &[]).await?;
    assert_eq!(code, Some(0), "stdout:\n{stdout}\nstderr:\n{stderr}");
    for expected in [
        "stand-in",
        "── turn 1",
        "⚙ calculate",
        "⚙ time_now",
        "⚙ sleep",
        "calculate",
        "✔",
        "⚑ signal submit_report",
        "■ COMPLETED · 2 turn(s) · 3 tool call(s) · 1 signal(s)",
    ] {
        assert!(stdout.contains(expected), "{expected:?} missing from:\n{stdout}");
    }
    Ok(())
}

#[tokio::test]
async fn worker_threads_come_from_tokio_worker_threads_and_bad_values_exit_2() -> TestResult {
    let (code, stdout, stderr) = run_to_end(&[], &[("TOKIO_WORKER_THREADS", "1")]).await?;
    assert_eq!(code, Some(0), "one worker thread runs the demo:\n{stdout}\n{stderr}");
    assert!(stdout.contains("■ COMPLETED"), "{stdout}");
    for bad in ["0", "1025", "two"] {
        let (code, _, stderr) = run_to_end(&[], &[("TOKIO_WORKER_THREADS", bad)]).await?;
        assert_eq!(code, Some(2), "{bad}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "demo: TOKIO_WORKER_THREADS={bad:?} must be a whole number from 1 to 1024"
            )),
            "{bad}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    Ok(())
}

#[tokio::test]
async fn the_orchestrators_run_limits_and_demo_tools_come_from_the_environment() -> TestResult {
    // One turn allowed: the first turn's calls run, then the run ends at the limit (exit 1).
    let (code, stdout, stderr) = run_to_end(&[], &[("ORCHESTRATOR_MAX_TURNS", "1")]).await?;
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("■ FAILED · 1 turn(s) · 3 tool call(s)") && stdout.contains("MAX_TURNS_EXCEEDED"),
        "{stdout}"
    );

    for (name, value, message) in [
        (
            "ORCHESTRATOR_MAX_TURNS",
            "0",
            "--max-turns = 0 is below its minimum of 1",
        ),
        (
            "DEMO_TOOLS",
            "submit_report",
            "DEMO_TOOLS=\"submit_report\" names no tool-runner tool",
        ),
    ] {
        let (code, stdout, stderr) = run_to_end(&[], &[(name, value)]).await?;
        assert_eq!(code, Some(2), "{name}={value}: {stdout}\n{stderr}");
        assert!(stderr.contains(message), "{name}={value}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    Ok(())
}
