//! Threads through the real binary, on both stores: a thread of three runs where each model
//! request holds the earlier runs' messages; `GetThread`, `DeleteThread` and a stranger's
//! `NOT_FOUND`; the thread's limits and a request's window on both sides; each busy policy with
//! two callers racing on one thread (on one replica, and on two replicas over NATS); and a replica killed while a run holds the
//! thread (the run taken over ends once in the thread).

use std::time::Duration;

use mock_llm::{MockLlm, Scenario, Scenarios, Step, Turn};
use orchestrator_client::{Client, ClientBuilder, Event, RunRequest};
use proto::orchestrator::v1 as pb;
use testkit::Service;
use testkit::nats::Nats;
use testkit::runs::client;

type TestResult = anyhow::Result<()>;

/// The models: `chat` answers each run in one turn ("Answer 1.", "Answer 2." … by the answers
/// the conversation holds already); `nap` naps in each run's first turn, then answers.
async fn model(nap_ms: u64) -> anyhow::Result<MockLlm> {
    let chat = Scenario::new((1..=8).map(|n| Turn::text(&format!("Answer {n}."))).collect());
    let nap = Scenario::new(
        (1..=4)
            .flat_map(|n| {
                [
                    Turn::text("Napping.\n").then(Step::call("sleep", serde_json::json!({ "ms": nap_ms }))),
                    Turn::text(&format!("Rested {n}.")),
                ]
            })
            .collect(),
    );
    Ok(MockLlm::start(Scenarios {
        default: chat,
        named: [("nap".to_owned(), nap)].into_iter().collect(),
    })
    .await?)
}

async fn orchestrator(model: &MockLlm, runner: &str, nats: Option<&Nats>, flags: &[&str]) -> anyhow::Result<Service> {
    let bin = env!("CARGO_BIN_EXE_orchestrator");
    testkit::runs::orchestrator(bin, (&model.base_url(), runner), nats.map(Nats::url).as_deref(), flags).await
}

/// Runs `prompt` on `thread` to its end; its result.
async fn say(client: &Client, thread: &str, run_id: &str, prompt: &str) -> anyhow::Result<pb::RunResult> {
    let request = RunRequest::prompt(prompt).run_id(run_id).thread(thread);
    Ok(client.orchestrate(request).await?.result().await?)
}

/// The `content` of every message of the model's `n`th request.
fn contents(model: &MockLlm, n: usize) -> Vec<String> {
    let requests = model.requests();
    requests
        .get(n)
        .and_then(|r| r["messages"].as_array())
        .map(|m| {
            m.iter()
                .map(|m| m["content"].as_str().unwrap_or_default().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether the model's `n`th request holds `text` in one of its messages.
fn holds(model: &MockLlm, n: usize, text: &str) -> bool {
    contents(model, n).iter().any(|c| c.contains(text))
}

/// A thread of three runs, each seeing the ones before; asked on `clients` in turn (one replica,
/// or alternating replicas).
async fn three_runs(model: &MockLlm, clients: &[&Client]) -> TestResult {
    let prompts = ["First question.", "Second question.", "Third question."];
    for (i, prompt) in prompts.iter().enumerate() {
        let on = clients[i % clients.len()];
        let run = say(on, "conversation", &format!("run-{i}"), prompt).await?;
        assert_eq!(run.status(), pb::RunStatus::Completed, "{run:?}");
        assert_eq!(run.thread_id, "conversation");
        assert_eq!(
            run.text,
            format!("Answer {}.", i + 1),
            "each run answers once, after the ones before"
        );
        for (earlier, asked) in prompts[..i].iter().enumerate() {
            assert!(holds(model, i, asked), "request {i} holds {asked:?}");
            assert!(holds(model, i, &format!("Answer {}.", earlier + 1)));
        }
        assert!(holds(model, i, prompt));
    }
    let thread = clients[0].thread("conversation").await?;
    let runs: Vec<&str> = thread.runs.iter().map(|r| r.run_id.as_str()).collect();
    assert_eq!(runs, ["run-0", "run-1", "run-2"]);
    assert_eq!(thread.messages.len(), 6, "three questions, three answers");
    assert_eq!(thread.live_run_id, "");
    Ok(())
}

#[tokio::test]
async fn a_thread_of_three_runs_on_the_memory_store() -> TestResult {
    let model = model(100).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let service = orchestrator(&model, &runner, None, &[]).await?;
    let client = client(&service).await?;
    three_runs(&model, &[&client]).await?;
    assert!(client.delete_thread("conversation").await?);
    let gone = client.thread("conversation").await.err().and_then(|e| e.code());
    assert_eq!(gone, Some(tonic::Code::NotFound));
    service.stop().await
}

#[tokio::test]
async fn a_thread_of_three_runs_across_two_replicas_on_nats() -> TestResult {
    let nats = Nats::start().await?;
    let model = model(100).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let a = orchestrator(&model, &runner, Some(&nats), &[]).await?;
    let b = orchestrator(&model, &runner, Some(&nats), &[]).await?;
    let (on_a, on_b) = (client(&a).await?, client(&b).await?);
    three_runs(&model, &[&on_a, &on_b]).await?;
    a.stop().await?;
    b.stop().await
}

/// The command line: `orchestrator call --thread` continues a thread, `orchestrator thread`
/// prints it and `--delete` deletes it.
#[tokio::test]
async fn the_command_line_continues_prints_and_deletes_a_thread() -> TestResult {
    let model = model(100).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let service = orchestrator(&model, &runner, None, &[]).await?;
    let endpoint = format!("http://{}", service.grpc);
    let cli = |args: &[&str]| {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_orchestrator"));
        command.args(args).args(["--endpoint", &endpoint]);
        command.output()
    };
    for prompt in ["Where is Oslo?", "And Bergen?"] {
        let call = cli(&["call", "--prompt", prompt, "--thread", "cli", "--on-busy", "enqueue"]).await?;
        assert!(call.status.success(), "{}", String::from_utf8_lossy(&call.stderr));
    }
    let second =
        String::from_utf8_lossy(&cli(&["call", "--prompt", "x", "--thread", "cli"]).await?.stdout).into_owned();
    assert!(second.contains("thread cli (2 earlier turn(s))"), "{second}");
    let printed = cli(&["thread", "cli"]).await?;
    let out = String::from_utf8_lossy(&printed.stdout);
    assert!(printed.status.success(), "{}", String::from_utf8_lossy(&printed.stderr));
    assert!(out.starts_with("thread cli · 3 run(s) · 6 message(s)"), "{out}");
    assert!(
        out.contains("user: Where is Oslo?") && out.contains("assistant: Answer 2."),
        "{out}"
    );
    let deleted = cli(&["thread", "cli", "--delete"]).await?;
    assert!(deleted.status.success(), "{}", String::from_utf8_lossy(&deleted.stderr));
    let gone = cli(&["thread", "cli"]).await?;
    assert!(!gone.status.success());
    assert!(String::from_utf8_lossy(&gone.stderr).contains("not found"));
    service.stop().await
}

/// A thread belongs to the principal that started it: another gets `NOT_FOUND` for it, from
/// `GetThread`, `DeleteThread` and a run naming it.
#[tokio::test]
async fn another_principal_is_told_the_thread_does_not_exist() -> TestResult {
    let model = model(100).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens.toml");
    let both = [("alice", "alice-token", ""), ("bob", "bob-token", "")];
    std::fs::write(&tokens, testkit::pki::tokens_toml(&both))?;
    let tokens = tokens.to_string_lossy().into_owned();
    let service = orchestrator(&model, &runner, None, &["--auth-tokens", &tokens]).await?;
    let as_ = |token: &str| {
        ClientBuilder::new(format!("http://{}", service.grpc))
            .token(token)
            .connect()
    };
    let (alice, bob) = (as_("alice-token").await?, as_("bob-token").await?);
    say(&alice, "alices", "a-1", "Hello.").await?;
    assert_eq!(alice.thread("alices").await?.principal, "alice");
    let code = |e: orchestrator_client::Error| e.code();
    assert_eq!(
        bob.thread("alices").await.err().and_then(code),
        Some(tonic::Code::NotFound)
    );
    assert_eq!(
        bob.delete_thread("alices").await.err().and_then(code),
        Some(tonic::Code::NotFound)
    );
    let run = bob
        .orchestrate(RunRequest::prompt("Mine now?").run_id("b-1").thread("alices"))
        .await;
    assert_eq!(run.err().and_then(code), Some(tonic::Code::NotFound));
    assert_eq!(alice.thread("alices").await?.runs.len(), 1, "untouched");
    service.stop().await
}

/// `--thread-max-runs` on both sides (at two runs nothing goes; a third drops the oldest run's
/// turns), and a request's `thread_history` window (the oldest turns left out, and said so).
#[tokio::test]
async fn a_thread_keeps_within_its_limits_and_a_request_sees_its_window() -> TestResult {
    let model = model(100).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let service = orchestrator(&model, &runner, None, &["--thread-max-runs", "2"]).await?;
    let client = client(&service).await?;
    say(&client, "bounded", "r-1", "One.").await?;
    say(&client, "bounded", "r-2", "Two.").await?;
    let at_bound = client.thread("bounded").await?;
    assert_eq!((at_bound.runs.len(), at_bound.dropped_turns), (2, 0));
    say(&client, "bounded", "r-3", "Three.").await?;
    let over = client.thread("bounded").await?;
    let runs: Vec<&str> = over.runs.iter().map(|r| r.run_id.as_str()).collect();
    assert_eq!(runs, ["r-2", "r-3"]);
    assert_eq!(over.dropped_turns, 1, "r-1's one turn");

    let windowed = RunRequest::prompt("Four.")
        .run_id("r-4")
        .thread("bounded")
        .thread_history(1);
    let mut stream = client.orchestrate(windowed).await?;
    let mut started = None;
    while let Some(event) = stream.next_event().await? {
        if let Event::Started(s) = event {
            started = Some(s);
        }
    }
    let started = started.ok_or_else(|| anyhow::anyhow!("no run_started"))?;
    assert_eq!(
        (
            started.thread_id.as_str(),
            started.thread_turns,
            started.thread_turns_left_out
        ),
        ("bounded", 1, 1)
    );
    let last = model.requests().len() - 1;
    assert!(
        !holds(&model, last, "Two.") && holds(&model, last, "Three."),
        "{:?}",
        contents(&model, last)
    );
    service.stop().await
}

/// `--thread-max-bytes` on both sides: two runs of 459 bytes fit in 1 KiB; a third drops the
/// oldest turn.
#[tokio::test]
async fn a_thread_keeps_within_its_bytes() -> TestResult {
    let model = model(100).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let service = orchestrator(&model, &runner, None, &["--thread-max-bytes", "1024"]).await?;
    let client = client(&service).await?;
    let prompt = |c: char| c.to_string().repeat(450);
    say(&client, "bytes", "b-1", &prompt('a')).await?;
    say(&client, "bytes", "b-2", &prompt('b')).await?;
    let under = client.thread("bytes").await?;
    assert_eq!((under.runs.len(), under.dropped_turns, under.bytes), (2, 0, 918));
    say(&client, "bytes", "b-3", &prompt('c')).await?;
    let over = client.thread("bytes").await?;
    assert_eq!(
        (run_ids(&over), over.dropped_turns, over.bytes),
        (vec!["b-2", "b-3"], 1, 918)
    );
    service.stop().await
}

/// Where the racing callers are: one replica on the memory store (both callers on it), or two
/// replicas on one NATS (the first caller on a, the second on b); the model naps 1.5 s in each
/// run's first turn.
struct Pair {
    _nats: Option<Nats>,
    model: MockLlm,
    a: Service,
    b: Option<Service>,
    on_a: Client,
    on_b: Client,
}

impl Pair {
    async fn start(on_nats: bool) -> anyhow::Result<Self> {
        let nats = match on_nats {
            true => Some(Nats::start().await?),
            false => None,
        };
        let model = model(1500).await?;
        let runner = testkit::tool_runner_in_process().await?;
        let a = orchestrator(&model, &runner, nats.as_ref(), &[]).await?;
        let b = match &nats {
            Some(nats) => Some(orchestrator(&model, &runner, Some(nats), &[]).await?),
            None => None,
        };
        let on_a = client(&a).await?;
        let on_b = client(b.as_ref().unwrap_or(&a)).await?;
        Ok(Self {
            _nats: nats,
            model,
            a,
            b,
            on_a,
            on_b,
        })
    }

    /// The first run, on replica a, napping: once its call runs, the second caller comes.
    async fn first_run_naps(&self, thread: &str) -> anyhow::Result<orchestrator_client::RunStream> {
        let request = RunRequest::prompt("First.")
            .run_id("first")
            .thread(thread)
            .model("nap")
            .tool("sleep");
        let mut stream = self.on_a.orchestrate(request).await?;
        loop {
            match tokio::time::timeout(Duration::from_secs(20), stream.next_event()).await?? {
                Some(Event::ToolCallStarted(_)) => return Ok(stream),
                Some(_) => {}
                None => anyhow::bail!("the first run ended before its call"),
            }
        }
    }

    /// The first run napping on replica a, then the second on replica b under `policy`: both
    /// runs' results.
    async fn race(
        &self,
        thread: &str,
        policy: pb::ThreadBusyPolicy,
    ) -> (anyhow::Result<pb::RunResult>, anyhow::Result<pb::RunResult>) {
        let first = match self.first_run_naps(thread).await {
            Ok(first) => first,
            Err(e) => return (Err(e), Err(anyhow::anyhow!("the first run did not start"))),
        };
        let second = self.on_b.orchestrate(Self::second(thread, policy));
        let (first, second) = tokio::join!(first.result(), async { second.await?.result().await });
        (first.map_err(Into::into), second.map_err(Into::into))
    }

    /// The second run, on replica b, under `policy`.
    fn second(thread: &str, policy: pb::ThreadBusyPolicy) -> RunRequest {
        RunRequest::prompt("Second.")
            .run_id("second")
            .thread(thread)
            .model("nap")
            .tool("sleep")
            .on_busy(policy)
    }

    async fn stop(self) -> TestResult {
        self.a.stop().await?;
        match self.b {
            Some(b) => b.stop().await,
            None => Ok(()),
        }
    }
}

fn run_ids(thread: &pb::Thread) -> Vec<&str> {
    thread.runs.iter().map(|r| r.run_id.as_str()).collect()
}

#[tokio::test]
async fn reject_refuses_the_second_run_naming_the_first() -> TestResult {
    for on_nats in [false, true] {
        reject(Pair::start(on_nats).await?).await?;
    }
    Ok(())
}

async fn reject(pair: Pair) -> TestResult {
    let first = pair.first_run_naps("busy-reject").await?;
    let second = pair
        .on_b
        .orchestrate(Pair::second("busy-reject", pb::ThreadBusyPolicy::Reject))
        .await;
    let refused = second.err().ok_or_else(|| anyhow::anyhow!("the second run started"))?;
    assert_eq!(refused.code(), Some(tonic::Code::Aborted));
    assert!(refused.to_string().contains("\"first\""), "{refused}");
    let held = pair.on_b.thread("busy-reject").await?;
    assert_eq!(held.live_run_id, "first");
    let deleted = pair
        .on_b
        .delete_thread("busy-reject")
        .await
        .err()
        .and_then(|e| e.code());
    assert_eq!(deleted, Some(tonic::Code::FailedPrecondition), "a held thread stays");
    // The holder's own id again is a live duplicate, as without a thread.
    let first_again = || {
        RunRequest::prompt("First.")
            .run_id("first")
            .thread("busy-reject")
            .model("nap")
            .tool("sleep")
    };
    let again = first_again();
    let duplicate = pair.on_b.orchestrate(again).await.err().and_then(|e| e.code());
    assert_eq!(duplicate, Some(tonic::Code::AlreadyExists));
    assert_eq!(first.result().await?.status(), pb::RunStatus::Completed);
    assert_eq!(run_ids(&pair.on_b.thread("busy-reject").await?), ["first"]);
    // A finished run's id replays it, whoever holds the thread (the same request: a retry).
    let other = RunRequest::prompt("First.").run_id("first").thread("busy-reject");
    let refused = pair.on_b.orchestrate(other).await.err().and_then(|e| e.code());
    assert_eq!(
        refused,
        Some(tonic::Code::InvalidArgument),
        "another request under its id"
    );
    let holder = pair
        .on_a
        .orchestrate(
            RunRequest::prompt("Hold.")
                .run_id("holder")
                .thread("busy-reject")
                .model("nap")
                .tool("sleep"),
        )
        .await?;
    let replayed = pair.on_b.orchestrate(first_again()).await?.result().await?;
    assert_eq!(replayed.status(), pb::RunStatus::Completed);
    assert_eq!(holder.result().await?.status(), pb::RunStatus::Completed);
    pair.stop().await
}

#[tokio::test]
async fn enqueue_starts_the_second_run_once_the_first_has_ended() -> TestResult {
    for on_nats in [false, true] {
        enqueue(Pair::start(on_nats).await?).await?;
    }
    Ok(())
}

async fn enqueue(pair: Pair) -> TestResult {
    let (first, second) = pair.race("busy-enqueue", pb::ThreadBusyPolicy::Enqueue).await;
    assert_eq!(first?.status(), pb::RunStatus::Completed);
    let second = second?;
    assert_eq!(second.status(), pb::RunStatus::Completed, "{second:?}");
    assert_eq!(second.text, "Napping.\nRested 2.", "it saw the first run's two turns");
    let thread = pair.on_a.thread("busy-enqueue").await?;
    assert_eq!(run_ids(&thread), ["first", "second"]);
    let second_request = pair.model.requests().len() - 2;
    assert!(holds(&pair.model, second_request, "First.") && holds(&pair.model, second_request, "Rested 1."));
    pair.stop().await
}

#[tokio::test]
async fn interrupt_ends_the_first_run_after_its_turn_and_keeps_its_output() -> TestResult {
    for on_nats in [false, true] {
        interrupt(Pair::start(on_nats).await?).await?;
    }
    Ok(())
}

async fn interrupt(pair: Pair) -> TestResult {
    let (first, second) = pair.race("busy-interrupt", pb::ThreadBusyPolicy::Interrupt).await;
    let first = first?;
    assert_eq!(first.status(), pb::RunStatus::Canceled, "{first:?}");
    assert!(
        first.failure_detail.contains("interrupted by run second"),
        "{}",
        first.failure_detail
    );
    assert!(first.tool_calls.iter().all(|c| c.ok), "its turn's call ran to its end");
    let second = second?;
    assert_eq!(second.status(), pb::RunStatus::Completed, "{second:?}");
    let thread = pair.on_a.thread("busy-interrupt").await?;
    assert_eq!(run_ids(&thread), ["first", "second"]);
    assert_eq!(thread.runs[0].status(), pb::RunStatus::Canceled);
    let first_call = thread.messages.iter().any(|m| m.role == "tool");
    assert!(first_call, "the first run's finished call is in the thread");
    pair.stop().await
}

#[tokio::test]
async fn rollback_cancels_the_first_run_and_drops_its_messages() -> TestResult {
    for on_nats in [false, true] {
        rollback(Pair::start(on_nats).await?).await?;
    }
    Ok(())
}

async fn rollback(pair: Pair) -> TestResult {
    let (first, second) = pair.race("busy-rollback", pb::ThreadBusyPolicy::Rollback).await;
    let first = first?;
    assert_eq!(first.status(), pb::RunStatus::Canceled, "{first:?}");
    assert!(
        first.failure_detail.contains("rolled back by run second"),
        "{}",
        first.failure_detail
    );
    let second = second?;
    assert_eq!(second.status(), pb::RunStatus::Completed, "{second:?}");
    assert_eq!(
        second.text, "Napping.\nRested 1.",
        "it started as if the first had not run"
    );
    let thread = pair.on_a.thread("busy-rollback").await?;
    assert_eq!(run_ids(&thread), ["second"]);
    let texts: Vec<&str> = thread.messages.iter().map(|m| m.content.as_str()).collect();
    assert!(!texts.contains(&"First."), "{texts:?}");
    pair.stop().await
}

/// The replica running the run that holds a thread is killed: another takes the run over and
/// ends it, and the thread holds that run once; the next run on the thread sees it once.
#[tokio::test]
async fn a_replica_killed_mid_run_leaves_the_thread_consistent() -> TestResult {
    let pair = Pair::start(true).await?;
    let Pair {
        _nats,
        model,
        mut a,
        b,
        on_b,
        ..
    } = pair;
    let request = RunRequest::prompt("First.")
        .run_id("survivor")
        .thread("killed")
        .model("nap")
        .tool("sleep")
        .detached(true);
    let on_a = client(&a).await?;
    let mut stream = on_a.orchestrate(request).await?;
    while let Some(event) = tokio::time::timeout(Duration::from_secs(20), stream.next_event()).await?? {
        if matches!(event, Event::ToolCallStarted(_)) {
            break;
        }
    }
    a.child.start_kill()?;
    let _ = a.child.wait().await;
    let ended = testkit::wait::until("the run to end on b", Duration::from_secs(60), || async {
        let run = on_b.get_run("survivor").await.ok()?;
        (!matches!(run.status(), pb::RunStatus::Running)).then_some(run)
    })
    .await?;
    assert_eq!(ended.status(), pb::RunStatus::Completed, "{ended:?}");
    let next = say(&on_b, "killed", "after", "Next.").await?;
    assert_eq!(next.status(), pb::RunStatus::Completed);
    let thread = on_b.thread("killed").await?;
    assert_eq!(run_ids(&thread), ["survivor", "after"], "no lost or doubled run");
    let firsts = thread.messages.iter().filter(|m| m.content == "First.").count();
    assert_eq!(firsts, 1);
    drop(model);
    match b {
        Some(b) => b.stop().await,
        None => Ok(()),
    }
}
