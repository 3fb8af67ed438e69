//! MCP tools their server runs as tasks (the MCP tasks extension), at the tool-runner: the
//! tests' own FastMCP server (`tests/fixtures/mcp/tasks_server.py`, `fastmcp-tasks`, installed by
//! `./scripts/mcp-servers`) over stdio. The runner offers the extension; a call the server makes a
//! task comes back as `task` (its id, interval, and pinned: a stdio server's task lives in this
//! runner); the call's next attempts carrying the task poll it to its result, or cancel it (the
//! server stops the work); a task the server does not know fails the attempt with its own error;
//! a task that asks a person inside it comes back as questions, and the answer goes to the task.

use proto::toolrunner::v1 as pb;
use serde_json::json;
use testkit::mcp_servers::tasks_server_table;
use testkit::{Outcome, Runner, run_tool};
use tool_runner::Config;

type TestResult = anyhow::Result<()>;

async fn runner(dir: &tempfile::TempDir) -> anyhow::Result<Runner> {
    let path = dir.path().join("tools.toml");
    std::fs::write(&path, tasks_server_table(&dir.path().join("tasks.log"))?)?;
    Runner::start(Config {
        tools_manifest: Some(path),
        ..Config::default()
    })
    .await
}

fn log(dir: &tempfile::TempDir) -> Vec<String> {
    std::fs::read_to_string(dir.path().join("tasks.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The call's next attempt (its arguments as every attempt carries them): it goes on with `task`
/// (canceling it when `cancel`).
fn follow(task: &pb::ToolTask, cancel: bool) -> pb::RunToolRequest {
    pb::RunToolRequest {
        task: Some(pb::ToolTaskRef {
            task_id: task.task_id.clone(),
            cancel,
        }),
        ..run_tool("batch__crunch", r#"{"dataset": "any"}"#)
    }
}

async fn send(runner: &Runner, request: pb::RunToolRequest) -> anyhow::Result<Outcome> {
    Outcome::of(runner.client().await?.run_tool(request).await?.into_inner())
}

/// Polls a task with the attempts `poll` makes until it is no longer working (within 30 s).
async fn until_done(runner: &Runner, poll: impl Fn() -> pb::RunToolRequest) -> anyhow::Result<Outcome> {
    testkit::wait::until("the task to end", std::time::Duration::from_secs(30), || async {
        match send(runner, poll()).await {
            Ok(Outcome::Task(_)) | Err(_) => None,
            Ok(done) => Some(done),
        }
    })
    .await
}

#[tokio::test]
async fn a_call_the_server_makes_a_task_is_polled_to_its_result() -> TestResult {
    let dir = tempfile::tempdir()?;
    let runner = runner(&dir).await?;
    let args = json!({"dataset": "q1", "seconds": 1.0});
    let task = send(&runner, run_tool("batch__crunch", &args.to_string()))
        .await?
        .unwrap_task();
    assert!(!task.task_id.is_empty(), "{task:?}");
    assert_eq!(
        (task.status.as_str(), task.poll_interval_ms, task.pinned),
        ("working", 500, true)
    );
    assert!(task.ttl_ms > 0, "{task:?}");
    let done = until_done(&runner, || follow(&task, false)).await?.unwrap_ok();
    assert_eq!(done["result"], "crunched q1");
    assert_eq!(log(&dir), ["started q1", "done q1"], "the work ran once");
    Ok(())
}

#[tokio::test]
async fn a_task_canceled_stops_on_its_server_and_an_unknown_one_fails() -> TestResult {
    let dir = tempfile::tempdir()?;
    let runner = runner(&dir).await?;
    let args = json!({"dataset": "q2", "seconds": 60.0});
    let task = send(&runner, run_tool("batch__crunch", &args.to_string()))
        .await?
        .unwrap_task();
    testkit::wait::until("the work to start", std::time::Duration::from_secs(20), || {
        let started = log(&dir).contains(&"started q2".to_owned());
        async move { started.then_some(()) }
    })
    .await?;
    let canceled = match send(&runner, follow(&task, true)).await? {
        Outcome::Task(_) => until_done(&runner, || follow(&task, false)).await?,
        other => other,
    };
    let (code, message) = canceled.unwrap_err();
    assert_eq!(code, pb::ToolErrorCode::Canceled, "{message}");
    testkit::wait::until(
        "the server to stop the work",
        std::time::Duration::from_secs(20),
        || {
            let cancelled = log(&dir).contains(&"cancelled q2".to_owned());
            async move { cancelled.then_some(()) }
        },
    )
    .await?;

    let unknown = pb::ToolTask {
        task_id: "no-such-task".into(),
        ..task
    };
    let (code, message) = send(&runner, follow(&unknown, false)).await?.unwrap_err();
    assert_eq!(code, pb::ToolErrorCode::Failed, "{message}");
    assert!(message.contains("no longer knows task no-such-task"), "{message}");
    Ok(())
}

/// The next attempt of an `approve_batch` call of `batch` that became `task`.
fn follow_batch(task: &pb::ToolTask, args: &str) -> pb::RunToolRequest {
    pb::RunToolRequest {
        tool_name: "batch__approve_batch".into(),
        arguments_json: args.to_owned(),
        ..follow(task, false)
    }
}

#[tokio::test]
async fn a_task_that_asks_inside_it_comes_back_as_questions_and_takes_the_answer() -> TestResult {
    let dir = tempfile::tempdir()?;
    let runner = runner(&dir).await?;
    let args = json!({"batch": "b7"}).to_string();
    let task = send(&runner, run_tool("batch__approve_batch", &args))
        .await?
        .unwrap_task();
    let asked = testkit::wait::until("the task to ask", std::time::Duration::from_secs(30), || async {
        match send(&runner, follow_batch(&task, &args)).await {
            Ok(Outcome::Asked(asked)) => Some(asked),
            _ => None,
        }
    })
    .await?;
    let [question] = &asked.requests[..] else {
        anyhow::bail!("one question expected: {asked:?}");
    };
    // The server keys a task's questions its own way (unique over the task's life).
    assert_eq!(question.mode, "form", "{question:?}");
    assert!(question.message.contains("b7"), "{question:?}");
    assert!(log(&dir).is_empty(), "nothing processed before the answer");
    let answer = pb::RunToolRequest {
        input: Some(pb::ToolInputAnswers {
            request_state: asked.request_state.clone(),
            responses_json: [(
                question.key.clone(),
                json!({"action": "accept", "content": {"approve": true}}).to_string(),
            )]
            .into(),
        }),
        ..follow_batch(&task, &args)
    };
    let answered = send(&runner, answer).await?;
    let done = match answered {
        Outcome::Task(_) => until_done(&runner, || follow_batch(&task, &args)).await?,
        other => other,
    };
    let done = done.unwrap_ok();
    assert_eq!(done["result"], "batch b7 processed", "{done}");
    assert_eq!(log(&dir), ["processed b7"]);
    Ok(())
}

/// `tool-runner call` follows a call its server makes a task to its result, and past its
/// `--timeout` cancels the task (on the server too), saying so; as docs/tool-runner.md shows.
#[tokio::test]
async fn the_command_line_follows_a_task_and_cancels_it_past_its_timeout() -> TestResult {
    let dir = tempfile::tempdir()?;
    let runner = runner(&dir).await?;
    let endpoint = format!("http://{}", runner.addr);
    let call = |args: &[&str]| {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_tool-runner"));
        command.env("TOOL_RUNNER_METRICS_LISTEN", "off");
        let args: Vec<String> = ["call", "--endpoint", &endpoint]
            .iter()
            .chain(args)
            .map(|a| (*a).to_owned())
            .collect();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            testkit::run_to_end(command, &args, &[]).await
        }
    };
    let (code, printed, told) = call(&["batch__crunch", r#"{"dataset":"q3","seconds":1}"#]).await?;
    assert_eq!(code, Some(0), "{told}");
    assert!(
        told.contains("batch__crunch runs as task") && told.contains("(working"),
        "{told}"
    );
    assert!(printed.contains("crunched q3"), "{printed}");
    let slow = ["--timeout", "2s", "batch__crunch", r#"{"dataset":"q4","seconds":60}"#];
    let (code, _, told) = call(&slow).await?;
    assert_ne!(code, Some(0), "{told}");
    assert!(told.contains("--timeout (2s) passed: canceling task"), "{told}");
    assert!(told.contains("CANCELED"), "{told}");
    testkit::wait::until(
        "the server to stop the work",
        std::time::Duration::from_secs(20),
        || {
            let cancelled = log(&dir).contains(&"cancelled q4".to_owned());
            async move { cancelled.then_some(()) }
        },
    )
    .await?;
    Ok(())
}
