//! The command line a person uses, through the real `orchestrator` binary against a running one
//! (in-memory store, a tool-runner in this process, the stand-in model): `get` and `cancel`
//! (both modes) beside `call`, `--json` for scripts, an attach past a run's last event told how
//! the run ended, and bad input refused before anything is sent — an endpoint without its
//! scheme, an id that breaks the rule of ids, a typo of a command — in words that say what to do;
//! a port a second process already holds named by its flag.

use std::time::Duration;

use mock_llm::{MockLlm, Scenario, Step, Turn};
use orchestrator_client::RunRequest;
use proto::orchestrator::v1 as pb;
use serde_json::json;
use testkit::Service;
use tokio::process::Command;

type TestResult = anyhow::Result<()>;

const BIN: &str = env!("CARGO_BIN_EXE_orchestrator");

/// An orchestrator on the stand-in model playing `scenario` and a tool-runner in this process.
struct World {
    orchestrator: Service,
    _llm: MockLlm,
}

async fn world(scenario: Scenario) -> anyhow::Result<World> {
    let llm = MockLlm::start(scenario).await?;
    let runner = testkit::helpers::tool_runner_in_process().await?;
    let orchestrator = testkit::runs::orchestrator(BIN, (&llm.base_url(), &runner), None, &[]).await?;
    Ok(World {
        orchestrator,
        _llm: llm,
    })
}

impl World {
    fn endpoint(&self) -> String {
        format!("http://{}", self.orchestrator.grpc)
    }
}

/// `orchestrator ARGS` run to its end: exit code, stdout, stderr.
async fn cli(args: &[&str]) -> anyhow::Result<(Option<i32>, String, String)> {
    let mut command = Command::new(BIN);
    command.env("ORCHESTRATOR_METRICS_LISTEN", "off");
    testkit::run_to_end(command, args, &[]).await
}

/// Turn 1 sleeps `ms` in a tool; turn 2 answers.
fn sleep_then_answer(ms: u64) -> Scenario {
    Scenario::new(vec![
        Turn::text("Working.").then(Step::call("sleep", json!({ "ms": ms }))),
        Turn::text("Done."),
    ])
}

/// `get` shows a run as a line and as JSON; `cancel --after-turn` lets a live run's turn end
/// and ends it CANCELED with its calls kept; `cancel` of an ended run says so; an attach past
/// the last event says how the run ended.
#[tokio::test]
async fn get_and_cancel_from_a_shell() -> TestResult {
    let w = world(sleep_then_answer(1500)).await?;
    let endpoint = w.endpoint();
    let at = ["--endpoint", endpoint.as_str()];
    let client = testkit::runs::client(&w.orchestrator).await?;
    let request = RunRequest::prompt("work").run_id("shell-1").tool("sleep");
    let stream = client.orchestrate(request).await?;
    testkit::runs::until_the_call_runs(&client, "shell-1").await?;

    let (code, shown, stderr) = cli(&[&["get", "shell-1"][..], &at].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(shown.starts_with("run shell-1 · RUNNING"), "{shown}");
    let (code, canceled, stderr) = cli(&[&["cancel", "shell-1", "--after-turn"][..], &at].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        canceled.contains("ends CANCELED once its turn in progress has ended"),
        "{canceled}"
    );
    let result = tokio::time::timeout(Duration::from_secs(30), stream.result()).await??;
    assert_eq!(result.status, pb::RunStatus::Canceled as i32);
    assert_eq!(
        result.tool_calls.len(),
        1,
        "the turn's call ran and is kept: {result:?}"
    );

    let (code, json, stderr) = cli(&[&["get", "shell-1", "--json"][..], &at].concat()).await?;
    assert_eq!(code, Some(2), "get exits as the run ended, CANCELED: {stderr}");
    let read: serde_json::Value = serde_json::from_str(json.trim())?;
    assert_eq!(read["runId"], "shell-1");
    assert_eq!(read["status"], "RUN_STATUS_CANCELED");
    assert_eq!(read["toolCalls"][0]["name"], "sleep");
    let (code, again, stderr) = cli(&[&["cancel", "shell-1"][..], &at].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(again.contains("had already ended (CANCELED)"), "{again}");
    let (code, json, _) = cli(&[&["cancel", "shell-1", "--json"][..], &at].concat()).await?;
    assert_eq!(code, Some(0));
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(json.trim())?["canceled"],
        false
    );

    let past = (result_seqs(&client, "shell-1").await? + 5).to_string();
    let (code, attached, stderr) = cli(&[&["call", "--attach", "shell-1", "--after", &past][..], &at].concat()).await?;
    assert_eq!(code, Some(2), "a canceled run exits 2: {attached}\n{stderr}");
    assert!(
        attached.contains(&format!(
            "run shell-1 has no events after seq {past}: it ended CANCELED"
        )),
        "{attached}\n{stderr}"
    );
    let (code, _, stderr) = cli(&[&["get", "nobody"][..], &at].concat()).await?;
    assert_eq!(code, Some(3), "a refused call exits 3");
    assert!(
        stderr.contains("run \"nobody\"")
            && stderr.contains("(NOT_FOUND)")
            && !stderr.contains("Some requested entity"),
        "{stderr}"
    );
    Ok(())
}

/// The run's last seq, read through `AttachRun` from the start.
async fn result_seqs(client: &orchestrator_client::Client, run_id: &str) -> anyhow::Result<u64> {
    let mut run = client.attach(run_id, 0).await?;
    while run.next_event().await?.is_some() {}
    Ok(run.last_seq())
}

/// A run that waits for its thread says so while it waits: which run holds the thread, and its
/// place among those waiting; then it runs.
#[tokio::test]
async fn a_run_waiting_for_its_thread_says_for_which_run() -> TestResult {
    let w = world(sleep_then_answer(2500)).await?;
    let endpoint = w.endpoint();
    let client = testkit::runs::client(&w.orchestrator).await?;
    let first = RunRequest::prompt("work").run_id("holder").tool("sleep").thread("trip");
    let holder = client.orchestrate(first).await?;
    testkit::runs::until_the_call_runs(&client, "holder").await?;
    let (code, printed, stderr) = cli(&[
        "call",
        "--endpoint",
        &endpoint,
        "--prompt",
        "and then?",
        "--tool",
        "sleep",
        "--thread",
        "trip",
        "--on-busy",
        "enqueue",
        "--run-id",
        "next",
    ])
    .await?;
    assert_eq!(code, Some(0), "{printed}\n{stderr}");
    assert!(
        printed.contains("… the run waits for thread trip: run holder holds it; it is 1 of 1 waiting"),
        "{printed}"
    );
    assert!(printed.contains("■ COMPLETED"), "{printed}");
    tokio::time::timeout(Duration::from_secs(30), holder.result()).await??;
    Ok(())
}

/// `call` with the id of a run that had ended replays it, and says so: its events as logged
/// (from its start), or — its log no longer holding it whole — its output as one piece, under no
/// turn's header.
#[tokio::test]
async fn a_replay_says_it_is_one() -> TestResult {
    for (text, replayed) in [
        (
            "Hi.".to_owned(),
            "▶ run again-1 had ended: its events as logged, replayed",
        ),
        (
            "word ".repeat(20_000),
            "▶ run again-1 had ended and its log no longer holds it whole: its output, replayed as one piece",
        ),
    ] {
        let llm = MockLlm::start(Scenario::new(vec![Turn::text(&text)])).await?;
        let runner = testkit::helpers::tool_runner_in_process().await?;
        let flags = ["--event-log-max-bytes", "65536"];
        let orchestrator = testkit::runs::orchestrator(BIN, (&llm.base_url(), &runner), None, &flags).await?;
        let endpoint = format!("http://{}", orchestrator.grpc);
        let call = [
            "call",
            "--endpoint",
            endpoint.as_str(),
            "--prompt",
            "hello",
            "--run-id",
            "again-1",
        ];
        let (code, first, stderr) = cli(&call).await?;
        assert_eq!(code, Some(0), "{stderr}");
        assert!(!first.contains("replayed"), "{first}");
        let (code, again, stderr) = cli(&call).await?;
        assert_eq!(code, Some(0), "{stderr}");
        assert_eq!(again.lines().next(), Some(replayed), "{}", excerpt(&again));
        assert!(!again.starts_with('\n'), "no blank line first");
        let last = again.lines().last().unwrap_or_default();
        assert!(last.starts_with("■ COMPLETED"), "{}", excerpt(&again));
        if text.len() > 100 {
            assert!(
                !again.contains("── turn"),
                "one piece, no turn header: {}",
                excerpt(&again)
            );
        } else {
            assert!(
                again.contains("▶ run again-1 started") && again.contains("── turn 1"),
                "{again}"
            );
        }
    }
    Ok(())
}

/// The first and last lines of `printed`, for a failure's message.
fn excerpt(printed: &str) -> String {
    let lines: Vec<&str> = printed.lines().collect();
    match lines.as_slice() {
        [first, .., last] => format!("{first}\n…\n{last}"),
        _ => printed.to_owned(),
    }
}

/// `runs --json` is one JSON answer of `ListRuns`.
#[tokio::test]
async fn runs_print_json_for_scripts() -> TestResult {
    let w = world(Scenario::new(vec![Turn::text("Hi.")])).await?;
    let endpoint = w.endpoint();
    let client = testkit::runs::client(&w.orchestrator).await?;
    client.run(RunRequest::prompt("hello").run_id("listed-1")).await?;
    let (code, json, stderr) = cli(&["runs", "--json", "--endpoint", &endpoint]).await?;
    assert_eq!(code, Some(0), "{stderr}");
    let page: serde_json::Value = serde_json::from_str(json.trim())?;
    assert_eq!(page["runs"][0]["runId"], "listed-1", "{json}");
    assert_eq!(page["runs"][0]["status"], "RUN_STATUS_COMPLETED");
    Ok(())
}

/// `runs --watch` prints the listing, then each run that is new or changed until interrupted,
/// as rows or (with `--json`) as `RunSummary` lines; a pace outside its bounds is refused naming
/// the flag.
#[tokio::test]
async fn runs_are_watched_as_they_change() -> TestResult {
    let w = world(sleep_then_answer(300)).await?;
    let endpoint = w.endpoint();
    for pace in ["50ms", "2m"] {
        let (code, _, told) = cli(&["runs", "--watch", "--watch-every", pace, "--endpoint", &endpoint]).await?;
        assert_eq!(code, Some(2), "{told}");
        assert!(told.contains("--watch-every"), "{told}");
    }
    let watch = |json: bool| -> anyhow::Result<testkit::helpers::Printing> {
        let mut command = Command::new(BIN);
        command.env("ORCHESTRATOR_METRICS_LISTEN", "off").args([
            "runs",
            "-w",
            "--watch-every",
            "100ms",
            "--endpoint",
            &endpoint,
        ]);
        if json {
            command.arg("--json");
        }
        testkit::helpers::Printing::spawn(command)
    };
    let (mut rows, mut lines) = (watch(false)?, watch(true)?);
    let limit = Duration::from_secs(20);
    rows.line_where("the empty listing", limit, |l| l.contains("no run matches"))
        .await?;
    lines.line_where("the listing", limit, |l| l.starts_with('{')).await?;
    let (code, _, told) = cli(&[
        "call",
        "--prompt",
        "hi",
        "--run-id",
        "watched-1",
        "--endpoint",
        &endpoint,
    ])
    .await?;
    assert_eq!(code, Some(0), "{told}");
    let completed = |l: &str| l.starts_with("watched-1 ") && l.contains("COMPLETED");
    rows.line_where("the run's row, completed", limit, completed).await?;
    let summary = |l: &str| {
        let summary: serde_json::Value = serde_json::from_str(l).unwrap_or_default();
        summary["runId"] == "watched-1" && summary["status"] == "RUN_STATUS_COMPLETED"
    };
    lines.line_where("the run's summary, completed", limit, summary).await?;
    Ok(())
}

/// Text the command line did not write reaches the terminal without control sequences: a
/// model's answer that would retitle the terminal, clear it and plant a hidden link is printed as
/// its words, by `call` and by `get`; `--json` keeps the text as it is (escaped by JSON).
#[tokio::test]
async fn model_text_reaches_the_terminal_without_control_sequences() -> TestResult {
    let hostile =
        "\u{1b}]0;pwned\u{7}Refund \u{1b}[2J\u{1b}[Hdone\u{1b}]8;;https://evil.example\u{1b}\\ here\u{1b}]8;;\u{1b}\\.";
    let w = world(Scenario::new(vec![Turn::text(hostile)])).await?;
    let endpoint = w.endpoint();
    let (code, called, stderr) = cli(&[
        "call",
        "--endpoint",
        &endpoint,
        "--run-id",
        "hostile-1",
        "--prompt",
        "refund it",
    ])
    .await?;
    assert_eq!(code, Some(0), "{stderr}");
    let (code, got, stderr) = cli(&["get", "--endpoint", &endpoint, "hostile-1"]).await?;
    assert_eq!(code, Some(0), "{stderr}");
    for printed in [&called, &got] {
        assert!(!printed.contains('\u{1b}') && !printed.contains('\u{7}'), "{printed:?}");
        assert!(printed.contains("Refund done here."), "{printed:?}");
    }
    let (_, json, _) = cli(&["get", "--json", "--endpoint", &endpoint, "hostile-1"]).await?;
    let run: serde_json::Value = serde_json::from_str(json.trim())?;
    assert_eq!(run["text"], hostile, "{json}");
    Ok(())
}

/// `call --json` prints the run's events as JSON Lines, one `OrchestrateEvent` per line with seqs
/// 1, 2, … and `run_finished` last; a replay's line goes to stderr, leaving stdout all JSON.
#[tokio::test]
async fn call_prints_its_events_as_json_lines() -> TestResult {
    let w = world(sleep_then_answer(10)).await?;
    let endpoint = w.endpoint();
    let call = [
        "call",
        "--json",
        "--endpoint",
        endpoint.as_str(),
        "--prompt",
        "hello",
        "--run-id",
        "lines-1",
    ];
    for replay in [false, true] {
        let (code, lines, stderr) = cli(&call).await?;
        assert_eq!(code, Some(0), "{stderr}");
        let events = lines
            .lines()
            .map(serde_json::from_str::<serde_json::Value>)
            .collect::<Result<Vec<_>, _>>()?;
        let seqs: Vec<u64> = events.iter().filter_map(|e| e["seq"].as_str()?.parse().ok()).collect();
        assert_eq!(seqs, (1..=events.len() as u64).collect::<Vec<_>>(), "{lines}");
        assert!(events.iter().all(|e| e["runId"] == "lines-1"), "{lines}");
        assert!(events[0]["runStarted"]["model"].is_string(), "{lines}");
        let started = events.iter().find_map(|e| e.get("toolCallStarted"));
        assert_eq!(started.map(|c| &c["name"]), Some(&json!("sleep")), "{lines}");
        let last = events.last().map(|e| &e["runFinished"]["result"]);
        assert_eq!(
            last.map(|r| &r["status"]),
            Some(&json!("RUN_STATUS_COMPLETED")),
            "{lines}"
        );
        assert_eq!(stderr.contains("replayed"), replay, "{stderr}");
    }
    Ok(())
}

/// Bad input is refused before anything is sent (exit 2), saying what to write instead; what
/// only the server can refuse names the flag beside the contract's field; the server refuses a
/// malformed id `INVALID_ARGUMENT` naming the rule, never `NOT_FOUND`.
#[tokio::test]
async fn bad_input_is_refused_saying_what_to_write() -> TestResult {
    let (code, _, stderr) = cli(&["get", "r-1", "--endpoint", "127.0.0.1:50051"]).await?;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("has no scheme: write http://127.0.0.1:50051"),
        "{stderr}"
    );
    for bad in ["ünï", "a b", ""] {
        let (code, _, stderr) = cli(&["thread", bad]).await?;
        assert_eq!(code, Some(2), "{bad:?}: {stderr}");
        assert!(stderr.contains("printable ASCII characters without spaces"), "{stderr}");
        let (code, _, stderr) = cli(&["call", "--prompt", "x", "--thread", bad, "--on-busy", "enqueue"]).await?;
        assert_eq!(code, Some(2), "{bad:?}: {stderr}");
    }
    let (code, _, stderr) = cli(&["call", "--prompt", "x", "--after", "3"]).await?;
    assert_eq!(code, Some(2), "--after needs --attach: {stderr}");
    let (code, _, stderr) = cli(&["cancle", "r-1"]).await?;
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("did you mean 'cancel'?") && !stderr.contains("'call'"),
        "{stderr}"
    );

    let w = world(Scenario::new(vec![Turn::text("Hi.")])).await?;
    let endpoint = w.endpoint();
    let unknown = [
        "call",
        "--prompt",
        "x",
        "--needs-approval",
        "no_such_tool",
        "--endpoint",
        &endpoint,
    ];
    let (code, _, stderr) = cli(&unknown).await?;
    assert_eq!(code, Some(3), "{stderr}");
    assert!(
        stderr.contains("tools.approval.tools (--needs-approval) names \"no_such_tool\""),
        "a server's refusal names the flag beside the field: {stderr}"
    );
    let mut raw = pb::orchestrator_client::OrchestratorClient::connect(w.endpoint()).await?;
    let long = "x".repeat(300);
    for bad in ["ünï", long.as_str(), ""] {
        let refused = raw
            .get_thread(pb::GetThreadRequest {
                thread_id: bad.to_owned(),
            })
            .await
            .expect_err("a malformed thread id");
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{bad:?}: {refused:?}");
        assert!(refused.message().contains("printable ASCII"), "{refused:?}");
        let refused = raw
            .get_run(pb::GetRunRequest { run_id: bad.to_owned() })
            .await
            .expect_err("a malformed run id");
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{bad:?}: {refused:?}");
    }
    Ok(())
}

/// A second orchestrator on the same host with the first's metrics port is refused naming the
/// flag that moves it.
#[tokio::test]
async fn a_metrics_port_clash_names_the_flag() -> TestResult {
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = taken.local_addr()?.to_string();
    let mut command = Command::new(BIN);
    command.env("LLM_BASE_URL", "http://127.0.0.1:9/v1");
    let args = ["--listen", "127.0.0.1:0", "--metrics-listen", &port];
    let (code, _, stderr) = testkit::run_to_end(command, &args, &[]).await?;
    assert_ne!(code, Some(0));
    assert!(
        stderr.contains(&format!("cannot listen on {port}")) && stderr.contains("--metrics-listen"),
        "{stderr}"
    );
    Ok(())
}

/// The Python function docs/webhooks.md gives a receiver, as it is written there.
fn documented_verifier() -> anyhow::Result<String> {
    let docs = include_str!("../../../../docs/webhooks.md");
    let start = docs
        .find("```python\n")
        .ok_or_else(|| anyhow::anyhow!("no python block in docs/webhooks.md"))?;
    let block = &docs[start + "```python\n".len()..];
    let end = block
        .find("```")
        .ok_or_else(|| anyhow::anyhow!("the python block never ends"))?;
    let code = &block[..end];
    anyhow::ensure!(
        code.lines().count() <= 10,
        "the verifier is {} lines, not 10",
        code.lines().count()
    );
    Ok(code.to_owned())
}

/// `webhooks add` registers a webhook (refusing the cloud metadata address and a port not
/// allowed, naming the flags), a run's end is POSTed to it, the documented Python verifier
/// accepts the delivery and refuses it changed or replayed an hour late, and `webhooks
/// deliveries`, `list` and `delete` show and remove it.
#[tokio::test]
async fn webhooks_are_registered_delivered_signed_and_listed_from_a_shell() -> TestResult {
    let receiver = testkit::receiver::Receiver::start().await?;
    let port = receiver.addr.port().to_string();
    let llm = MockLlm::start(Scenario::demo()).await?;
    let runner = testkit::helpers::tool_runner_in_process().await?;
    let allow = ["--webhook-allow-cidr", "127.0.0.0/8", "--webhook-allow-port", &port];
    let orchestrator = testkit::runs::orchestrator(BIN, (&llm.base_url(), &runner), None, &allow).await?;
    let endpoint = format!("http://{}", orchestrator.grpc);
    let at = ["--endpoint", endpoint.as_str()];
    let metadata = format!("http://169.254.169.254:{port}/latest/meta-data/");
    for (url, flag) in [
        (metadata.as_str(), "--webhook-allow-cidr"),
        ("http://127.0.0.1:1/hook", "--webhook-allow-port"),
    ] {
        let (code, _, stderr) = cli(&[&["webhooks", "add", url][..], &at].concat()).await?;
        assert_ne!(code, Some(0), "{url} was registered");
        assert!(stderr.contains(flag), "{url}: {stderr}");
    }
    let url = receiver.url();
    let add = [
        &["webhooks", "add", url.as_str(), "--event", "run.finished", "--json"][..],
        &at,
    ]
    .concat();
    let (code, stdout, stderr) = cli(&add).await?;
    assert_eq!(code, Some(0), "{stderr}");
    let hook: serde_json::Value = serde_json::from_str(stdout.trim())?;
    let (id, secret) = (
        hook["id"].as_str().unwrap_or_default(),
        hook["secret"].as_str().unwrap_or_default(),
    );
    assert!(id.starts_with("wh_") && secret.starts_with("whsec_"), "{hook}");

    let call = [
        "call",
        "--prompt",
        "go",
        "--run-id",
        "hooked",
        "--exit-tool",
        "submit_report",
    ];
    let (code, _, stderr) = cli(&[&call[..], &at].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    let got = testkit::wait::until_sync("the run's end delivered", Duration::from_secs(30), || {
        receiver.received().into_iter().next()
    })
    .await?;
    assert_eq!(got.json()["type"], "run.finished");
    assert_eq!(receiver.received().len(), 1, "run.started was not asked for");

    let case = json!({
        "secret": secret,
        "headers": {"webhook-id": got.id, "webhook-timestamp": got.timestamp, "webhook-signature": got.signature},
        "body": got.body,
    });
    let driver = r#"
import json, sys
case = json.load(sys.stdin)
headers, body = case["headers"], case["body"].encode()
late = {**headers, "webhook-timestamp": str(int(headers["webhook-timestamp"]) - 3600)}
print(verify(case["secret"], headers, body), verify(case["secret"], headers, body.replace(b"COMPLETED", b"FAILED")),
      verify(case["secret"], late, body))
"#;
    let script = format!("{}{driver}", documented_verifier()?);
    let mut python = Command::new("python3");
    python.args(["-c", &script]).stdin(std::process::Stdio::piped());
    python.stdout(std::process::Stdio::piped());
    let mut child = python.spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        use tokio::io::AsyncWriteExt;
        stdin.write_all(case.to_string().as_bytes()).await?;
    }
    let output = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output()).await??;
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "True False False");

    let (code, stdout, stderr) = cli(&[&["webhooks", "deliveries", "--webhook", id][..], &at].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    let row = stdout.lines().find(|l| l.contains(&got.id)).unwrap_or_default();
    assert!(
        row.contains("run.finished") && row.contains("delivered") && row.contains("204"),
        "{stdout}"
    );
    let (_, stdout, _) = cli(&[&["webhooks", "list"][..], &at].concat()).await?;
    assert!(stdout.contains(id) && !stdout.contains(secret), "{stdout}");
    let (code, _, stderr) = cli(&[&["webhooks", "delete", id][..], &at].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    let (code, _, stderr) = cli(&[&["webhooks", "delete", id][..], &at].concat()).await?;
    assert_ne!(code, Some(0));
    assert!(stderr.contains("no webhook"), "{stderr}");
    Ok(())
}

/// `orchestrator ARGS` whose reader has gone away before it prints (`| head` closed early): its
/// exit code and stderr.
async fn into_a_closed_pipe(args: &[&str]) -> anyhow::Result<(Option<i32>, String)> {
    let mut command = Command::new(BIN);
    command
        .env("ORCHESTRATOR_METRICS_LISTEN", "off")
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = command.spawn()?;
    drop(child.stdout.take());
    let output = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output()).await??;
    Ok((
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    ))
}

/// Every command that prints, piped into a reader that went away, ends quietly with 141 (as a
/// process killed by SIGPIPE) and never panics, with and without --json; a listing paged with a
/// relative --since names its time in the next page's hint, so the hint runs as printed.
#[tokio::test]
async fn output_into_a_closed_pipe_ends_quietly_and_a_since_listing_pages() -> TestResult {
    let w = world(Scenario::new(vec![
        Turn::text("One."),
        Turn::text("Two."),
        Turn::text("Three."),
    ]))
    .await?;
    let endpoint = w.endpoint();
    let at = ["--endpoint", endpoint.as_str()];
    for run_id in ["piped-1", "piped-2", "piped-3"] {
        let call = ["call", "--prompt", "hi", "--run-id", run_id, "--thread", "piped"];
        let (code, _, stderr) = cli(&[&call[..], &at].concat()).await?;
        assert_eq!(code, Some(0), "{stderr}");
    }
    let commands: [&[&str]; 8] = [
        &["runs"],
        &["runs", "--json"],
        &["get", "piped-1"],
        &["get", "piped-1", "--json"],
        &["thread", "piped"],
        &["usage"],
        &["call", "--attach", "piped-1"],
        &["call", "--attach", "piped-1", "--json"],
    ];
    for args in commands {
        let (code, stderr) = into_a_closed_pipe(&[args, &at[..]].concat()).await?;
        assert_eq!(code, Some(141), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }

    let (code, first, stderr) = cli(&[&["runs", "--since", "1h", "--page-size", "1"][..], &at].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    let hint = first
        .lines()
        .find_map(|l| l.strip_prefix("more: "))
        .ok_or_else(|| anyhow::anyhow!("no next page: {first}"))?;
    assert!(hint.starts_with("--since 20"), "{hint}");
    let next: Vec<&str> = hint.split_whitespace().collect();
    let (code, second, stderr) = cli(&[&["runs", "--page-size", "1"][..], &next, &at].concat()).await?;
    assert_eq!(code, Some(0), "{hint}: {stderr}");
    let row = |page: &str| page.lines().nth(1).map(str::to_owned).unwrap_or_default();
    assert!(
        row(&second).starts_with("piped-") && row(&second) != row(&first),
        "{first}\n{second}"
    );
    Ok(())
}

/// An endpoint that is not the orchestrator's gRPC port, and a call without the token a server
/// asks for, are said with what to do (the flag), and exit 3.
#[tokio::test]
async fn a_wrong_endpoint_and_a_missing_token_say_what_to_do() -> TestResult {
    let not_grpc = testkit::receiver::Receiver::start().await?;
    let wrong = format!("http://{}", not_grpc.addr);
    let (code, _, stderr) = cli(&["get", "r-1", "--endpoint", &wrong]).await?;
    assert_eq!(code, Some(3), "{stderr}");
    assert!(
        stderr.contains("does not answer gRPC") && stderr.contains("--endpoint"),
        "{stderr}"
    );

    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens.toml");
    std::fs::write(&tokens, testkit::pki::tokens_toml(&[("alice", "alice-token", "")]))?;
    let llm = MockLlm::start(Scenario::new(vec![Turn::text("Hi.")])).await?;
    let runner = testkit::helpers::tool_runner_in_process().await?;
    let flags = ["--auth-tokens", tokens.to_str().unwrap_or_default()];
    let orchestrator = testkit::runs::orchestrator(BIN, (&llm.base_url(), &runner), None, &flags).await?;
    let endpoint = format!("http://{}", orchestrator.grpc);
    let (code, _, stderr) = cli(&["runs", "--endpoint", &endpoint]).await?;
    assert_eq!(code, Some(3), "{stderr}");
    assert!(
        stderr.contains("UNAUTHENTICATED") && stderr.contains("--token") && stderr.contains("ORCHESTRATOR_TOKEN"),
        "{stderr}"
    );
    let (code, _, stderr) = cli(&["runs", "--endpoint", &endpoint, "--token", "alice-token"]).await?;
    assert_eq!(code, Some(0), "{stderr}");
    Ok(())
}

/// The command line reaches an orchestrator that serves TLS with --ca (and, where it asks for
/// client certificates, --cert and --key); an https:// endpoint without --ca is refused naming
/// the flag, before anything is sent.
#[tokio::test]
async fn the_command_line_speaks_tls_and_mtls() -> TestResult {
    let pki = testkit::pki::Pki::new()?;
    pki.ca("ca").await?;
    pki.leaf("ca", "server").await?;
    pki.leaf("ca", "client").await?;
    let llm = MockLlm::start(Scenario::new(vec![Turn::text("Hi.")])).await?;
    let runner = testkit::helpers::tool_runner_in_process().await?;
    let (cert, key, ca) = (pki.arg("server.pem"), pki.arg("server.key"), pki.arg("ca.pem"));
    let flags = ["--tls-cert", &cert, "--tls-key", &key, "--tls-client-ca", &ca];
    let orchestrator = testkit::runs::orchestrator(BIN, (&llm.base_url(), &runner), None, &flags).await?;
    let endpoint = format!("https://{}", orchestrator.grpc);
    let (code, _, stderr) = cli(&["runs", "--endpoint", &endpoint]).await?;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--ca FILE") && stderr.contains("ORCHESTRATOR_CA"),
        "{stderr}"
    );
    let (client_cert, client_key) = (pki.arg("client.pem"), pki.arg("client.key"));
    let mtls = [
        "--ca",
        ca.as_str(),
        "--cert",
        client_cert.as_str(),
        "--key",
        client_key.as_str(),
    ];
    let call = ["call", "--prompt", "hi", "--endpoint", endpoint.as_str()];
    let (code, printed, stderr) = cli(&[&call[..], &mtls].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(printed.contains("■ COMPLETED"), "{printed}");
    let (code, listed, stderr) = cli(&[&["runs", "--endpoint", endpoint.as_str()][..], &mtls].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(listed.contains("COMPLETED"), "{listed}");
    // Without its certificate the server refuses the handshake: exit 3, not a panic.
    let (code, _, stderr) = cli(&["runs", "--endpoint", &endpoint, "--ca", &ca]).await?;
    assert_eq!(code, Some(3), "{stderr}");
    Ok(())
}

/// A run id named again with another request is refused naming the parts that differ (the same
/// request is a retry, answered with the run's end); a call waiting for approval never says it
/// waits longer than its run lasts: its expiry is the earlier of --approval-timeout and the
/// run's deadline.
#[tokio::test]
async fn a_reused_run_id_is_refused_and_an_approval_expires_with_its_run() -> TestResult {
    let w = world(sleep_then_answer(10)).await?;
    let endpoint = w.endpoint();
    let at = ["--endpoint", endpoint.as_str()];
    let first = ["call", "--prompt", "first", "--run-id", "reused-1", "--tool", "sleep"];
    let (code, _, stderr) = cli(&[&first[..], &at].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    let (code, again, stderr) = cli(&[&first[..], &at].concat()).await?;
    assert_eq!(code, Some(0), "the same request is a retry: {stderr}");
    assert!(again.contains("replayed"), "{again}");
    let other = [
        "call",
        "--prompt",
        "another",
        "--run-id",
        "reused-1",
        "--tool",
        "sleep",
        "--system",
        "Be brief.",
    ];
    let (code, _, stderr) = cli(&[&other[..], &at].concat()).await?;
    assert_eq!(code, Some(3), "{stderr}");
    assert!(
        stderr.contains("names a run started with another request (its messages, system differ)")
            && stderr.contains("INVALID_ARGUMENT"),
        "{stderr}"
    );

    let parked = [
        "call",
        "--prompt",
        "wait",
        "--run-id",
        "parked-1",
        "--tool",
        "sleep",
        "--needs-approval",
        "sleep",
        "--detach",
        "--run-timeout",
        "40s",
        "--approval-timeout",
        "1h",
    ];
    let (code, _, stderr) = cli(&[&parked[..], &at].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    let left = expiry_left(&at, "parked-1").await?;
    assert!(
        left <= 40_000,
        "the wait ends with the run, in {left} ms, not in an hour"
    );
    let (code, _, stderr) = cli(&[&["cancel", "parked-1"][..], &at].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");

    // With --pause-deadline the run's deadline waits too: the approval timeout alone bounds it.
    let paused = [&parked[..], &["--pause-deadline"]].concat();
    let paused: Vec<&str> = paused
        .iter()
        .map(|a| if *a == "parked-1" { "parked-2" } else { a })
        .collect();
    let (code, _, stderr) = cli(&[&paused[..], &at].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    let left = expiry_left(&at, "parked-2").await?;
    assert!(left > 3_000_000, "the paused run's call waits its hour: {left} ms");
    let (code, _, stderr) = cli(&[&["cancel", "parked-2"][..], &at].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    Ok(())
}

/// Once run `run_id` has a call waiting for approval (`approvals --json`), how long until its wait
/// expires, in ms.
async fn expiry_left(at: &[&str], run_id: &str) -> anyhow::Result<u64> {
    let what = format!("a call of {run_id} to wait");
    let listed = testkit::wait::until(&what, Duration::from_secs(30), || async {
        let (_, out, _) = cli(&[&["approvals", run_id, "--json"][..], at].concat()).await.ok()?;
        let listed: serde_json::Value = serde_json::from_str(out.trim()).ok()?;
        listed["approvals"].as_array().filter(|a| !a.is_empty()).cloned()
    })
    .await?;
    let expires: u64 = listed[0]["expiresAtUnixMs"].as_str().unwrap_or_default().parse()?;
    Ok(expires.saturating_sub(shared::sync::unix_ms()))
}
