//! Replicas sharing one NATS store (orchestrator processes on loopback): results and signals
//! seen by every replica and kept across a restart, a run id run once, re-attaching on another
//! replica, draining, cancel through any replica, take-over (from the first turn, twice, past a
//! deadline, of a replica from before incarnations, after a node is lost), and which checkpoint a
//! take-over reads.

use std::sync::Mutex;
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;
use orchestrator::domain::ports::{EventLog, LogError, ResultStore};
use orchestrator::domain::{RunResult, RunStatus};
use orchestrator::store::nats::{NatsLog, NatsLogOptions};
use proto::orchestrator::v1 as pb;
use testkit::nats::Nats;
use testkit::{Service, get_run, orchestrate, start_detached};

use crate::common::{ended, finished_event, keep, log_bounds, orphans_once_lapsed, replica_store, text_event};

type TestResult = anyhow::Result<()>;

/// An orchestrator process using NATS for signals and results, with a tool-runner and the
/// stand-in model in this process.
async fn orchestrator_process(nats: &Nats, llm: &str, runner: &str, extra: &[&str]) -> anyhow::Result<Service> {
    let command = testkit::orchestrator_command(env!("CARGO_BIN_EXE_orchestrator"), llm, runner);
    let mut command = testkit::on_nats(command, &nats.url());
    command.args(extra);
    Service::orchestrator(command).await
}

#[tokio::test]
async fn replicas_share_results_and_signals_and_results_survive_a_restart() -> TestResult {
    let nats = Nats::start().await?;
    let mock = mock_llm::MockLlm::start(mock_llm::Scenario::demo()).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let a = orchestrator_process(&nats, &mock.base_url(), &runner, &[]).await?;
    let b = orchestrator_process(&nats, &mock.base_url(), &runner, &[]).await?;
    let (a_url, b_url) = (format!("http://{}", a.grpc), format!("http://{}", b.grpc));

    // B's SubscribeSignals sees the signal of a run on A (it reads the broker).
    let mut subscriber = pb::orchestrator_client::OrchestratorClient::connect(b_url.clone())
        .await?
        .subscribe_signals(pb::SubscribeSignalsRequest {
            run_id: "shared-run".into(),
            tool_names: vec![],
        })
        .await?
        .into_inner();
    let finished = orchestrate(
        &a_url,
        pb::OrchestrateRequest {
            run_id: "shared-run".into(),
            ..testkit::user("go")
        },
    )
    .await?;
    assert_eq!(finished.status(), pb::RunStatus::Completed);
    let event = tokio::time::timeout(Duration::from_secs(10), subscriber.message())
        .await??
        .and_then(|e| e.event);
    let Some(pb::signal_event::Event::Signal(seen)) = event else {
        anyhow::bail!("no signal on B: {event:?}")
    };
    assert_eq!(
        (seen.run_id.as_str(), seen.tool_name.as_str()),
        ("shared-run", "submit_report")
    );

    // B answers GetRun for the run A finished; the signal's delivery gets confirmed.
    let on_b = testkit::wait::until("B to read the signal delivered", Duration::from_secs(10), || async {
        let r = get_run(&b_url, "shared-run").await.ok()?;
        (r.signals.first().map(|s| s.delivery()) == Some(pb::SignalDelivery::Delivered)).then_some(r)
    })
    .await?;
    assert_eq!(on_b.status(), pb::RunStatus::Completed);
    assert_eq!((on_b.text.as_str(), on_b.tool_calls.len()), (finished.text.as_str(), 3));
    assert_eq!(on_b.signals[0].delivery(), pb::SignalDelivery::Delivered);
    // The same run id on B replays the stored result instead of running again.
    let replay = orchestrate(
        &b_url,
        pb::OrchestrateRequest {
            run_id: "shared-run".into(),
            ..testkit::user("go")
        },
    )
    .await?;
    assert_eq!(replay.run_id, "shared-run");
    assert_eq!(mock.requests().len(), 2, "the model was asked only for the first run");

    // Results survive a restart of both orchestrators. (B's open SubscribeSignals stream ends
    // when B drains, or B could not stop.)
    a.stop().await?;
    b.stop().await?;
    assert!(
        subscriber.message().await.ok().flatten().is_none(),
        "the subscription ended with the drain"
    );
    let c = orchestrator_process(&nats, &mock.base_url(), &runner, &[]).await?;
    let after = get_run(&format!("http://{}", c.grpc), "shared-run").await?;
    assert_eq!((after.status(), after.text), (pb::RunStatus::Completed, finished.text));
    c.stop().await
}

/// Two replicas share a NATS store. A run is started on both at once: exactly one runs it, the
/// other answers ALREADY_EXISTS. Then the replica running it is killed (SIGKILL) while a tool call
/// runs: once its lease lapses the other replica takes the run over from its checkpoint, sends
/// the call in flight again (same call id) and finishes the run; the model is not asked again
/// for the turn whose calls were checkpointed, and the id is still never run twice.
#[tokio::test]
async fn a_run_id_runs_once_across_replicas_and_a_killed_replicas_run_is_taken_over() -> TestResult {
    use mock_llm::{Scenario, Step, Turn};
    let nats = Nats::start().await?;
    let slow = Scenario::new(vec![
        Turn::text("Starting a long wait.\n").then(Step::call("sleep", serde_json::json!({"ms": 3_000}))),
        Turn::text("done"),
    ]);
    let mock = mock_llm::MockLlm::start(slow).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let lease = ["--run-store-lease", "2s"];
    let a = orchestrator_process(&nats, &mock.base_url(), &runner, &lease).await?;
    let b = orchestrator_process(&nats, &mock.base_url(), &runner, &lease).await?;
    let (a_url, b_url) = (format!("http://{}", a.grpc), format!("http://{}", b.grpc));

    let request = pb::OrchestrateRequest {
        run_id: "contested".into(),
        detached: true,
        ..testkit::user("go")
    };
    let start = |url: String, request: pb::OrchestrateRequest| async move {
        let mut client = pb::orchestrator_client::OrchestratorClient::connect(url).await?;
        let mut stream = client.orchestrate(request).await?.into_inner();
        let first = stream.message().await?;
        anyhow::Ok((stream, first))
    };
    let (on_a, on_b) = tokio::join!(
        start(a_url.clone(), request.clone()),
        start(b_url.clone(), request.clone())
    );
    let code = |e: &anyhow::Error| e.downcast_ref::<tonic::Status>().map(tonic::Status::code);
    let (stream, owner, survivor, survivor_url) = match (on_a, on_b) {
        (Ok((stream, _)), Err(e)) if code(&e) == Some(tonic::Code::AlreadyExists) => (stream, a, b, b_url),
        (Err(e), Ok((stream, _))) if code(&e) == Some(tonic::Code::AlreadyExists) => (stream, b, a, a_url),
        (a, b) => anyhow::bail!("exactly one replica must run it: {:?} / {:?}", a.err(), b.err()),
    };
    // Once the tool call runs (its start is sent only after the turn's checkpoint is saved), crash.
    let mut stream = stream;
    testkit::runs::read_until(&mut stream, |e| {
        matches!(e, pb::orchestrate_event::Event::ToolCallStarted(_))
    })
    .await?;
    owner.kill().await?;
    drop(stream);
    let finished = ended(&survivor_url, "contested").await?;
    assert_eq!(
        finished.status(),
        pb::RunStatus::Completed,
        "{}",
        finished.failure_detail
    );
    assert_eq!(finished.text, "Starting a long wait.\ndone");
    assert_eq!(finished.tool_calls.len(), 1, "the call in flight counts once");
    assert!(survivor.logged("took the run over", Duration::from_secs(1)).await);
    assert_eq!(
        mock.requests().len(),
        2,
        "turn 1 was checkpointed: the model is asked once per turn"
    );
    // The id is not run again: its result is replayed.
    let replay = orchestrate(&survivor_url, request).await?;
    assert_eq!(replay.status(), pb::RunStatus::Completed);
    assert_eq!(mock.requests().len(), 2);
    survivor.stop().await
}

/// Reads the checkpoint object `name` over and over while the run goes on, keeping the newest
/// whole copy (and its metadata) until the object is gone.
fn keep_the_newest_checkpoint(
    checkpoints: jetstream::object_store::ObjectStore,
    name: String,
) -> tokio::task::JoinHandle<Option<(Vec<u8>, jetstream::object_store::ObjectMetadata)>> {
    tokio::spawn(async move {
        let mut kept = None;
        for _ in 0..500 {
            // Bounded: an object deleted while it is read leaves the read waiting for
            // chunks that are gone.
            match tokio::time::timeout(Duration::from_secs(1), read_object(&checkpoints, &name)).await {
                Ok(Some(bytes)) => kept = Some(bytes),
                Ok(None) if kept.is_some() => break,
                Ok(None) | Err(_) => {}
            }
            // Stays: the pace of a sampler (it keeps the newest copy it reads), not a wait.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        kept
    })
}

/// A run's log replayed from seq 0 through `AttachRun` ends `run_finished` COMPLETED with `text`.
async fn the_replay_from_its_log_is_whole(url: &str, run_id: &str, text: &str) -> TestResult {
    let client = orchestrator_client::ClientBuilder::new(url.to_owned())
        .connect()
        .await?;
    let mut replay = client.attach(run_id, 0).await?;
    let mut finished = None;
    while let Some(event) = tokio::time::timeout(Duration::from_secs(10), replay.next_event()).await?? {
        if let orchestrator_client::Event::Finished(result) = event {
            finished = Some(result.status());
        }
    }
    assert_eq!(
        (finished, replay.text()),
        (Some(pb::RunStatus::Completed), text),
        "the log is whole"
    );
    Ok(())
}

/// The crash window between a durable run's end reaching its log and its record: the record
/// still reads RUNNING with a checkpoint and its thread is still held by it (put back here as
/// they were just before the end), the log ends with `run_finished`. The replica taking the run
/// over stores that end instead of resuming: the model is not asked again, the checkpoint goes,
/// the log stays whole, and the run joins its thread (once, with its last answer) and lets it go.
#[tokio::test]
async fn a_run_whose_log_holds_its_end_is_stored_as_ended_not_resumed() -> TestResult {
    use mock_llm::{Scenario, Step, Turn};
    let nats = Nats::start().await?;
    let mock = mock_llm::MockLlm::start(Scenario::new(vec![
        // The call lasts long enough for whole copies of the checkpoint to be read while it
        // stands (a copy that overlaps the checkpoint's deletion is given up).
        Turn::text("one ").then(Step::call("sleep", serde_json::json!({"ms": 1500}))),
        Turn::text("two"),
    ]))
    .await?;
    let runner = testkit::tool_runner_in_process().await?;
    let lease = ["--run-store-lease", "1s"];
    let a = orchestrator_process(&nats, &mock.base_url(), &runner, &lease).await?;
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    let (kv, checkpoints) = (
        js.get_key_value("orchestrator-runs").await?,
        js.get_object_store("orchestrator-runs-checkpoints").await?,
    );
    let key = "run.ended-late";
    let mut revisions = kv.watch(key).await?;
    // The entry that names the run under its replica's incarnation (gone with the run's end).
    let mut owner_entries = kv.watch("owner.>").await?;
    let threads = js.get_key_value("orchestrator-runs-threads").await?;
    let mut thread_revisions = threads.watch("thread.late-thread").await?;
    // Keep the newest checkpoint while the run goes on.
    let kept = keep_the_newest_checkpoint(checkpoints.clone(), format!("{key}#1"));
    let request = pb::OrchestrateRequest {
        run_id: "ended-late".into(),
        thread_id: "late-thread".into(),
        ..testkit::user("go")
    };
    let ended = tokio::time::timeout(
        Duration::from_secs(30),
        orchestrate(&format!("http://{}", a.grpc), request),
    )
    .await??;
    assert_eq!(ended.status(), pb::RunStatus::Completed);
    a.stop().await?;
    let checkpoint = tokio::time::timeout(Duration::from_secs(30), kept)
        .await??
        .ok_or_else(|| anyhow::anyhow!("no checkpoint was seen"))?;
    let mut entries = Vec::new();
    while let Ok(Some(entry)) = tokio::time::timeout(Duration::from_millis(500), revisions.next()).await {
        entries.push(entry?);
    }
    anyhow::ensure!(entries.len() >= 2, "the record was written {} times", entries.len());
    let running = entries[entries.len() - 2].value.clone();
    let held = tokio::time::timeout(Duration::from_secs(5), thread_revisions.next())
        .await?
        .ok_or_else(|| anyhow::anyhow!("the thread was never written"))??
        .value;
    let held_by: orchestrator::domain::thread::Thread = serde_json::from_slice(&held)?;
    assert_eq!(
        held_by.live.as_deref(),
        Some("ended-late"),
        "the thread as the run took it"
    );

    // Back to the moment before the record said the run ended (its lease long lapsed).
    let (checkpoint, meta) = checkpoint;
    checkpoints.put(meta, &mut checkpoint.as_slice()).await?;
    let owner_entry = tokio::time::timeout(Duration::from_secs(5), owner_entries.next())
        .await?
        .ok_or_else(|| anyhow::anyhow!("the run was never entered under its replica"))??
        .key;
    kv.put(&owner_entry, bytes::Bytes::new()).await?;
    kv.put(key, running).await?;
    threads.put("thread.late-thread", held).await?;
    let b = orchestrator_process(&nats, &mock.base_url(), &runner, &lease).await?;
    let b_url = format!("http://{}", b.grpc);
    assert!(
        b.logged("had ended on the replica that stopped", Duration::from_secs(10))
            .await
    );
    let stored = get_run(&b_url, "ended-late").await?;
    assert_eq!(
        (stored.status(), stored.text.as_str()),
        (pb::RunStatus::Completed, "one two")
    );
    assert_eq!(mock.requests().len(), 2, "nothing of the run ran again");
    assert!(
        checkpoints.get(&format!("{key}#1")).await.is_err(),
        "its checkpoint is gone"
    );
    the_replay_from_its_log_is_whole(&b_url, "ended-late", "one two").await?;
    // The thread is let go once the end is stored (the record first, then the thread).
    let thread: orchestrator::domain::thread::Thread = testkit::wait::until(
        "the ended run to let its thread go",
        Duration::from_secs(10),
        || async {
            let bytes = threads.get("thread.late-thread").await.ok()??;
            let thread: orchestrator::domain::thread::Thread = serde_json::from_slice(&bytes).ok()?;
            thread.live.is_none().then_some(thread)
        },
    )
    .await?;
    let runs: Vec<&str> = thread.runs.iter().map(|r| r.run_id.as_str()).collect();
    assert_eq!(runs, ["ended-late"]);
    let last = thread.runs[0].messages.last().cloned();
    assert!(
        matches!(&last, Some(orchestrator::domain::chat::Message::Assistant { content, .. }) if content == "two"),
        "the run's last answer is in the thread: {last:?}"
    );
    b.stop().await
}

/// The whole object under `key`, or `None` when there is none (or it went while being read).
/// An object's bytes and its metadata (a checkpoint's names the run's admission).
async fn read_object(
    store: &jetstream::object_store::ObjectStore,
    key: &str,
) -> Option<(Vec<u8>, jetstream::object_store::ObjectMetadata)> {
    let mut object = store.get(key).await.ok()?;
    let mut bytes = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut object, &mut bytes)
        .await
        .ok()?;
    let meta = jetstream::object_store::ObjectMetadata {
        name: key.to_owned(),
        description: object.info().description.clone(),
        ..Default::default()
    };
    Some((bytes, meta))
}

/// NATS, the stand-in model playing `scenario`, a tool-runner, and two orchestrator processes
/// (with `extra` flags) sharing the NATS store: the replicas of the attach tests.
struct Replicas {
    _nats: Nats,
    _mock: mock_llm::MockLlm,
    a: Service,
    b: Service,
}

impl Replicas {
    async fn start(scenario: mock_llm::Scenario, extra: &[&str]) -> anyhow::Result<Self> {
        let nats = Nats::start().await?;
        let mock = mock_llm::MockLlm::start(scenario).await?;
        let runner = testkit::tool_runner_in_process().await?;
        let a = orchestrator_process(&nats, &mock.base_url(), &runner, extra).await?;
        let b = orchestrator_process(&nats, &mock.base_url(), &runner, extra).await?;
        Ok(Self {
            _nats: nats,
            _mock: mock,
            a,
            b,
        })
    }
}

/// `words` words streamed one by one, 20 ms apart: a run that lasts while the test acts on it.
fn slow_text(words: &str) -> mock_llm::Scenario {
    mock_llm::Scenario {
        token_delay_ms: 20,
        ..mock_llm::Scenario::new(vec![mock_llm::Turn::text(words)])
    }
}

async fn client(
    service: &Service,
) -> anyhow::Result<pb::orchestrator_client::OrchestratorClient<tonic::transport::Channel>> {
    Ok(pb::orchestrator_client::OrchestratorClient::connect(format!("http://{}", service.grpc)).await?)
}

/// A caller that leaves a run on replica A re-attaches on replica B from its last seq, and gets
/// the rest while the run still goes on A: together one gap-free stream, equal to B's replay of
/// the finished run and to GetRun.
#[tokio::test]
async fn a_caller_reattaches_on_another_replica_to_a_live_run_and_replays_it_there() -> TestResult {
    let words: String = (0..60).map(|i| format!("word{i} ")).collect();
    let scenario = mock_llm::Scenario {
        token_delay_ms: 10,
        ..mock_llm::Scenario::new(vec![
            mock_llm::Turn::text(&words).then(mock_llm::Step::call("sleep", serde_json::json!({"ms": 50}))),
            mock_llm::Turn::text(&words),
        ])
    };
    let Replicas { a, b, _nats, _mock } = Replicas::start(scenario, &[]).await?;
    let b_url = format!("http://{}", b.grpc);
    let mut on_a = client(&a).await?;
    let mut first = on_a
        .orchestrate(pb::OrchestrateRequest {
            run_id: "roaming".into(),
            detached: true,
            ..testkit::user("go")
        })
        .await?
        .into_inner();
    let mut seen = Vec::new();
    while seen.len() < 6 {
        match first.next().await {
            Some(event) => seen.push(event?),
            None => anyhow::bail!("the run ended before 6 events"),
        }
    }
    drop(first);
    let mut on_b = client(&b).await?;
    let attach = |after_seq| pb::AttachRunRequest {
        run_id: "roaming".into(),
        after_seq,
    };
    let rest = on_b.attach_run(attach(6)).await?.into_inner();
    let rest: Vec<_> = tokio::time::timeout(Duration::from_secs(30), rest.collect::<Vec<_>>())
        .await?
        .into_iter()
        .collect::<Result<_, _>>()?;
    anyhow::ensure!(
        rest.first().map(|e| e.seq) == Some(7),
        "the rest starts at 7: {:?}",
        rest.first()
    );
    seen.extend(rest);
    let whole = testkit::stack::Outcome::new(seen, Duration::ZERO)?;
    assert_eq!(whole.status(), pb::RunStatus::Completed);
    assert_eq!(whole.result.text, format!("{words}{words}"));
    assert_eq!(get_run(&b_url, "roaming").await?, whole.result);
    let replay: Vec<_> = on_b
        .attach_run(attach(0))
        .await?
        .into_inner()
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    assert_eq!(replay, whole.events);
    let unknown = on_b.attach_run(pb::AttachRunRequest {
        run_id: "never-ran".into(),
        after_seq: 0,
    });
    assert_eq!(unknown.await.err().map(|s| s.code()), Some(tonic::Code::NotFound));
    a.stop().await?;
    b.stop().await
}

/// A replica that drains ends the streams of callers attached to runs of other replicas with
/// UNAVAILABLE naming the run and the last seq sent (so its shutdown is not held by them); the
/// caller attaches again on another replica from there and gets the rest.
#[tokio::test]
async fn a_draining_replica_ends_attached_streams_with_where_to_resume() -> TestResult {
    let words: String = (0..150).map(|i| format!("w{i} ")).collect();
    let Replicas { a, mut b, _nats, _mock } = Replicas::start(slow_text(&words), &[]).await?;
    start_detached(&format!("http://{}", a.grpc), "drained").await?;
    let mut on_a = client(&a).await?;
    let attach = |after_seq| pb::AttachRunRequest {
        run_id: "drained".into(),
        after_seq,
    };
    let mut stream = client(&b).await?.attach_run(attach(0)).await?.into_inner();
    let mut seen = Vec::new();
    while seen.len() < 3 {
        match stream.message().await? {
            Some(event) => seen.push(event),
            None => anyhow::bail!("the run ended before 3 events"),
        }
    }
    b.signal(nix::sys::signal::Signal::SIGTERM)?;
    let ended = loop {
        match tokio::time::timeout(Duration::from_secs(10), stream.message()).await? {
            Ok(Some(event)) => seen.push(event),
            Ok(None) => anyhow::bail!("the stream ended without an error"),
            Err(status) => break status,
        }
    };
    let last = seen.last().map_or(0, |e| e.seq);
    assert_eq!(ended.code(), tonic::Code::Unavailable, "{ended:?}");
    let expected = format!("attach to run \"drained\" again after seq {last}");
    assert!(ended.message().contains(&expected), "{ended:?}");
    assert_eq!(b.wait_exit().await?, Some(0), "the drained replica stopped");

    let rest = on_a.attach_run(attach(last)).await?.into_inner();
    let rest: Vec<_> = tokio::time::timeout(Duration::from_secs(30), rest.collect::<Vec<_>>())
        .await?
        .into_iter()
        .collect::<Result<_, _>>()?;
    seen.extend(rest);
    let whole = testkit::stack::Outcome::new(seen, Duration::ZERO)?;
    assert_eq!(whole.result.text, words);
    a.stop().await
}

/// A caller attached on replica B to a run of replica A, when A is killed (SIGKILL) while the
/// model streams: once A's lease lapses B takes the run over, restarts the turn (announced by
/// `turn_restarted`) and finishes it; the caller's one stream goes on without a gap and, with the
/// restarted turn's earlier text dropped, tells the run's text.
#[tokio::test]
async fn a_follower_of_a_killed_replicas_run_follows_it_to_the_replica_that_took_it_over() -> TestResult {
    let words: String = (0..200).map(|i| format!("w{i} ")).collect();
    let Replicas { a, b, _nats, _mock } = Replicas::start(slow_text(&words), &["--run-store-lease", "1s"]).await?;
    start_detached(&format!("http://{}", a.grpc), "orphaned").await?;
    let client = orchestrator_client::ClientBuilder::new(format!("http://{}", b.grpc))
        .connect()
        .await?;
    let mut stream = client.attach("orphaned", 0).await?;
    while stream.last_seq() < 5 {
        if stream.next_event().await?.is_none() {
            anyhow::bail!("the run ended before 5 events");
        }
    }
    // The Python and TypeScript examples follow it too, from B.
    let target = b.grpc.to_string();
    let follow = ["--target", target.as_str(), "--attach", "orphaned", "--timeout", "90"];
    let mut python = testkit::python::python_example("orchestrate.py")?;
    let mut typescript = testkit::python::typescript_example()?;
    let mut examples = Vec::new();
    for (name, command) in [("python", &mut python), ("typescript", &mut typescript)] {
        let child = command
            .args(follow)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        examples.push((name, child.wait_with_output()));
    }
    a.kill().await?;
    let mut restarted = false;
    let result = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(event) = stream.next_event().await? {
            match event {
                orchestrator_client::Event::TurnRestarted(r) => restarted = r.turn == 1 && r.attempt == 2,
                orchestrator_client::Event::Finished(result) => return anyhow::Ok(result),
                _ => {}
            }
        }
        anyhow::bail!("the stream ended without run_finished")
    })
    .await??;
    assert!(restarted, "turn 1 restarted as attempt 2");
    assert_eq!(result.status(), pb::RunStatus::Completed, "{}", result.failure_detail);
    assert_eq!(result.text, words);
    assert_eq!(
        stream.text(),
        words,
        "the typed stream drops the abandoned attempt's text"
    );
    assert_eq!(get_run(&format!("http://{}", b.grpc), "orphaned").await?.text, words);
    for (name, output) in examples {
        let output = tokio::time::timeout(Duration::from_secs(90), output).await??;
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert_eq!(
            output.status.code(),
            Some(0),
            "{name}: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(stdout.contains("turn 1 restarted (attempt 2"), "{name}: {stdout}");
        assert!(
            stdout.lines().any(|l| l == format!("text after restarts: {words}")),
            "{name} drops the abandoned attempt's text: {stdout}"
        );
    }
    b.stop().await
}

/// `CancelRun` reaches a run from any replica: a run live on replica A (its caller's stream open
/// there, a long tool call in flight) is canceled through replica B, which asks A; A's caller sees
/// `run_finished` CANCELED with CancelRun's reason, and both replicas read the run CANCELED. A
/// second cancel through B says it had ended; an unknown id is NOT_FOUND there.
#[tokio::test]
async fn a_run_is_canceled_through_any_replica() -> TestResult {
    use mock_llm::{Scenario, Step, Turn};
    let slow = Scenario::new(vec![
        Turn::text("Waiting.\n").then(Step::call("sleep", serde_json::json!({"ms": 30_000}))),
        Turn::text("never reached"),
    ]);
    let Replicas { a, b, _nats, _mock } = Replicas::start(slow, &[]).await?;
    let (a_url, b_url) = (format!("http://{}", a.grpc), format!("http://{}", b.grpc));

    let mut on_a = pb::orchestrator_client::OrchestratorClient::connect(a_url.clone()).await?;
    let request = pb::OrchestrateRequest {
        run_id: "cancel-anywhere".into(),
        ..testkit::user("go")
    };
    let mut stream = on_a.orchestrate(request).await?.into_inner();
    // Read until the tool call is in flight on A.
    let started = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(event) = stream.message().await? {
            if matches!(event.event, Some(pb::orchestrate_event::Event::ToolCallStarted(_))) {
                return anyhow::Ok(());
            }
        }
        anyhow::bail!("the stream ended before the tool call started")
    });
    started.await??;

    let mut on_b = pb::orchestrator_client::OrchestratorClient::connect(b_url.clone()).await?;
    let cancel = |run_id: &str| pb::CancelRunRequest {
        run_id: run_id.into(),
        ..Default::default()
    };
    let answer = on_b.cancel_run(cancel("cancel-anywhere")).await?.into_inner();
    assert!(answer.canceled, "{answer:?}");
    assert_eq!(answer.status(), pb::RunStatus::Canceled);

    let finished = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(event) = stream.message().await? {
            if let Some(pb::orchestrate_event::Event::RunFinished(f)) = event.event {
                return f.result.ok_or_else(|| anyhow::anyhow!("run_finished without a result"));
            }
        }
        anyhow::bail!("the stream ended without run_finished")
    })
    .await??;
    assert_eq!(finished.status(), pb::RunStatus::Canceled, "{finished:?}");
    assert_eq!(finished.failure_detail, "canceled by CancelRun");
    assert_eq!(finished.text, "Waiting.\n", "the output so far is kept");
    for url in [&a_url, &b_url] {
        assert_eq!(get_run(url, "cancel-anywhere").await?.status(), pb::RunStatus::Canceled);
    }
    let again = on_b.cancel_run(cancel("cancel-anywhere")).await?.into_inner();
    assert!(!again.canceled);
    assert_eq!(again.status(), pb::RunStatus::Canceled);
    let unknown = on_b.cancel_run(cancel("no-such-run")).await;
    assert_eq!(unknown.err().map(|s| s.code()), Some(tonic::Code::NotFound));
    a.stop().await?;
    b.stop().await
}

/// A run is resumable from the moment its id is claimed: its replica is SIGKILLed while the model
/// is still thinking over the first turn (no turn has ended, nothing but `run_started` was sent),
/// and the other replica takes it over from the checkpoint the claim put in place, asks the model
/// for that turn again and completes it; the run's log tells one gap-free stream with one
/// `run_started`.
#[tokio::test]
async fn a_run_whose_replica_dies_in_its_first_turn_is_taken_over_from_its_start() -> TestResult {
    use mock_llm::{Scenario, Step, Turn};
    let thinking = Scenario::new(vec![
        Turn::default()
            .then(Step::Delay { ms: 2_500 })
            .then(Step::text("thought "))
            .then(Step::call("echo", serde_json::json!({"n": 1}))),
        Turn::text("done"),
    ]);
    let Replicas {
        a,
        b,
        _nats,
        _mock: mock,
    } = Replicas::start(thinking, &["--run-store-lease", "1s"]).await?;
    let b_url = format!("http://{}", b.grpc);
    start_detached(&format!("http://{}", a.grpc), "first-turn").await?;
    testkit::wait::until_sync("the model to be asked", Duration::from_secs(10), || {
        (!mock.requests().is_empty()).then_some(())
    })
    .await?;
    a.kill().await?;

    let client = orchestrator_client::ClientBuilder::new(b_url.clone()).connect().await?;
    let finished = ended(&b_url, "first-turn").await?;
    assert_eq!(
        finished.status(),
        pb::RunStatus::Completed,
        "{}",
        finished.failure_detail
    );
    assert_eq!(finished.text, "thought done");
    assert!(b.logged("took the run over", Duration::from_secs(1)).await);
    assert_eq!(mock.requests().len(), 3, "turn 1 was asked again, turn 2 once");
    let mut replay = client.attach("first-turn", 0).await?;
    let mut started = 0;
    while let Some(event) = tokio::time::timeout(Duration::from_secs(10), replay.next_event()).await?? {
        if matches!(event, orchestrator_client::Event::Started(_)) {
            started += 1;
        }
    }
    assert_eq!((started, replay.text()), (1, "thought done"));
    b.stop().await
}

/// A second admission of an id that is taken is refused without touching the checkpoint of the
/// run holding it. Two admissions that race (both saw the id free) may still leave the loser's
/// start checkpoint under the key; should the winner's replica then die before its next
/// checkpoint, the run is never resumed from the loser's: the replica taking it over finds the
/// checkpoint names another admission, and the run reads lost at once (its id free for a retry).
#[tokio::test]
async fn a_checkpoint_of_a_losing_duplicate_admission_is_never_resumed() -> TestResult {
    use orchestrator::domain::ports::{Claim, RunJournal};
    let nats = Nats::start().await?;
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    let lease = Duration::from_millis(500);
    let (a, b, c) = (
        replica_store(&js, "race-runs", "a", lease).await?,
        replica_store(&js, "race-runs", "b", lease).await?,
        replica_store(&js, "race-runs", "c", lease).await?,
    );
    let _c_alive = keep(&c);
    let checkpoints = js.get_object_store("race-runs-checkpoints").await?;
    let deadline = shared::sync::unix_ms() + 60_000;

    // Taken: refused, and a's checkpoint stays as a put it.
    let kept = RunResult::running("kept");
    assert!(matches!(
        a.claim_resumable(kept.clone(), deadline, b"a's start".to_vec()).await,
        Ok(Claim::Claimed)
    ));
    let again = b.claim_resumable(kept, deadline, b"b's start".to_vec()).await;
    assert!(matches!(again, Ok(Claim::Taken(_))), "{again:?}");

    // Raced: b's start checkpoint landed after a's, as b's claim was failing, before a's run
    // saved a checkpoint of its own (and a's replica then died).
    let raced = RunResult::running("raced");
    assert!(matches!(
        a.claim_resumable(raced.clone(), deadline, b"a's start".to_vec()).await,
        Ok(Claim::Claimed)
    ));
    let loser = jetstream::object_store::ObjectMetadata {
        name: "run.raced".into(),
        description: Some("b/1/0".into()),
        ..Default::default()
    };
    checkpoints.put(loser, &mut b"b's start".as_slice()).await?;

    // a's replica dies; c sees its records unchanged for a lease (its own clock), then they
    // have lapsed.
    assert!(c.orphans().await?.is_empty(), "nothing has lapsed as c first sees it");
    orphans_once_lapsed(&c, &["kept", "raced"]).await?;
    assert_eq!(
        c.take_over("kept").await?.map(|c| c.checkpoint),
        Some(b"a's start".to_vec())
    );
    assert_eq!(
        c.take_over("raced").await?,
        None,
        "b's checkpoint is not resumed as a's run"
    );
    let lost = c.get("raced").await?.ok_or_else(|| anyhow::anyhow!("no record"))?;
    assert_eq!(
        (lost.status, lost.failure_reason),
        (
            RunStatus::Failed,
            Some(orchestrator::domain::FailureReason::OrchestratorLost)
        )
    );
    assert!(
        matches!(c.claim(raced).await, Ok(Claim::Claimed)),
        "the id is free again"
    );
    Ok(())
}

/// Two admissions of one id at once: only the winner puts anything under the key. The loser's
/// start checkpoint is large, so (were it put before its claim was decided) it would land after
/// the winner's first save and overwrite it; the replica taking the run over resumes from the
/// winner's save.
#[tokio::test]
async fn a_losing_duplicate_admission_never_overwrites_the_winners_checkpoint() -> TestResult {
    use orchestrator::domain::ports::{Claim, RunJournal};
    let nats = Nats::start().await?;
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    let lease = Duration::from_millis(500);
    let (a, b, c) = (
        replica_store(&js, "dup-runs", "a", lease).await?,
        replica_store(&js, "dup-runs", "b", lease).await?,
        replica_store(&js, "dup-runs", "c", lease).await?,
    );
    let _c_alive = keep(&c);
    let deadline = shared::sync::unix_ms() + 60_000;
    let run = RunResult::running("dup");
    let large = vec![b'b'; 8 << 20];
    // b's admission goes on by itself while a's is answered and a, if it won, saves at once.
    let b = std::sync::Arc::new(b);
    let on_b = tokio::spawn({
        let (b, run) = (std::sync::Arc::clone(&b), run.clone());
        async move { b.claim_resumable(run, deadline, large).await }
    });
    let on_a = a.claim_resumable(run.clone(), deadline, b"a's start".to_vec()).await?;
    if matches!(on_a, Claim::Claimed) {
        a.save(run.clone(), deadline, b"the winner's first save".to_vec())
            .await?;
    }
    let on_b = on_b.await??;
    match (&on_a, &on_b) {
        (Claim::Claimed, Claim::Taken(_)) => {}
        (Claim::Taken(_), Claim::Claimed) => b.save(run, deadline, b"the winner's first save".to_vec()).await?,
        (x, y) => anyhow::bail!("exactly one admission wins: {x:?} / {y:?}"),
    }
    assert!(c.orphans().await?.is_empty(), "nothing has lapsed as c first sees it");
    orphans_once_lapsed(&c, &["dup"]).await?;
    assert_eq!(
        c.take_over("dup").await?.map(|c| c.checkpoint),
        Some(b"the winner's first save".to_vec()),
        "the run resumes from the winner's checkpoint"
    );
    Ok(())
}

/// `record` (a run's record, protobuf) without field `tag`, as a build that never knew the field
/// writes it.
fn without_field(record: &[u8], tag: u64) -> anyhow::Result<Vec<u8>> {
    fn varint(bytes: &[u8], at: &mut usize) -> anyhow::Result<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *bytes
                .get(*at)
                .ok_or_else(|| anyhow::anyhow!("a varint runs past the end"))?;
            *at += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        anyhow::bail!("a varint longer than 64 bits")
    }
    let (mut kept, mut at) = (Vec::with_capacity(record.len()), 0);
    while at < record.len() {
        let start = at;
        let key = varint(record, &mut at)?;
        match key & 7 {
            0 => {
                varint(record, &mut at)?;
            }
            1 => at += 8,
            2 => {
                let len = usize::try_from(varint(record, &mut at)?)?;
                at += len;
            }
            5 => at += 4,
            other => anyhow::bail!("wire type {other} is not in a run's record"),
        }
        anyhow::ensure!(at <= record.len(), "a field runs past the end");
        if key >> 3 != tag {
            kept.extend_from_slice(&record[start..at]);
        }
    }
    Ok(kept)
}

/// A replica from before incarnations renewed each run's record itself and named no incarnation
/// in it (nor entered it in the owner index): when it dies, a replica of this build still takes
/// the run over, found by the checkpoint scan of its first look and judged by the record's own
/// revision.
#[tokio::test]
async fn a_run_of_a_replica_from_before_incarnations_is_taken_over() -> TestResult {
    use orchestrator::domain::ports::{Claim, RunJournal};
    let nats = Nats::start().await?;
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    let lease = Duration::from_millis(500);
    let old = replica_store(&js, "legacy-runs", "old", lease).await?;
    let deadline = shared::sync::unix_ms() + 60_000;
    let run = RunResult::running("legacy");
    assert!(matches!(
        old.claim_resumable(run, deadline, b"old start".to_vec()).await,
        Ok(Claim::Claimed)
    ));
    // Written back as the old build wrote it: no incarnation (field 14), no owner entry.
    let kv = js.get_key_value("legacy-runs").await?;
    let written = kv
        .get("run.legacy")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no record"))?;
    let legacy = without_field(&written, 14)?;
    assert!(legacy.len() < written.len(), "the record named an incarnation");
    kv.put("run.legacy", legacy.into()).await?;
    let mut entries = kv.keys().await?;
    while let Some(key) = entries.next().await {
        let key = key?;
        if key.starts_with("owner.") {
            kv.delete(&key).await?;
        }
    }
    drop(old);
    // A new replica: the record lapses on its own revision, seen unchanged for a lease.
    let new = replica_store(&js, "legacy-runs", "new", lease).await?;
    let _new_alive = keep(&new);
    orphans_once_lapsed(&new, &["legacy"]).await?;
    assert_eq!(
        new.take_over("legacy").await?.map(|c| c.checkpoint),
        Some(b"old start".to_vec())
    );
    assert_eq!(new.epoch("legacy"), 2);
    Ok(())
}

/// A replica that took a run over saves its first checkpoint in its own epoch (the previous
/// owner's object is then deleted) and renews its lease; if it dies then, the next replica takes
/// the run over from that checkpoint. (The renewal once wrote the record naming the deleted
/// object again, and the run could never be taken over.) A record naming an object that is gone
/// reads lost, never resumed from an object it does not name.
#[tokio::test]
async fn a_run_taken_over_twice_resumes_from_the_second_owners_checkpoint() -> TestResult {
    use orchestrator::domain::ports::{Claim, RunJournal};
    let nats = Nats::start().await?;
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    let lease = Duration::from_millis(500);
    let (a, b, c) = (
        replica_store(&js, "twice-runs", "a", lease).await?,
        replica_store(&js, "twice-runs", "b", lease).await?,
        replica_store(&js, "twice-runs", "c", lease).await?,
    );
    let (b_alive, _c_alive) = (keep(&b), keep(&c));
    let deadline = shared::sync::unix_ms() + 60_000;
    let run = RunResult::running("twice");
    assert!(matches!(
        a.claim_resumable(run.clone(), deadline, b"a's start".to_vec()).await,
        Ok(Claim::Claimed)
    ));
    // a dies; b takes the run over once it has seen its record unchanged for a lease.
    assert!(b.orphans().await?.is_empty());
    orphans_once_lapsed(&b, &["twice"]).await?;
    assert_eq!(
        b.take_over("twice").await?.map(|c| c.checkpoint),
        Some(b"a's start".to_vec())
    );
    // b saves its checkpoint, then writes its state, then dies.
    b.save(run.clone(), deadline, b"b's turn".to_vec()).await?;
    b.put(run.clone()).await?;
    drop(b_alive);
    assert!(c.orphans().await?.is_empty());
    orphans_once_lapsed(&c, &["twice"]).await?;
    assert_eq!(
        c.take_over("twice").await?.map(|c| c.checkpoint),
        Some(b"b's turn".to_vec())
    );

    // a's incarnation lapsed while it did nothing: a claim brings its next one up (as a process
    // resumed from a pause claims at once), and takes nothing back of what it held.
    assert!(matches!(
        a.claim_resumable(RunResult::running("again"), deadline, b"a's again".to_vec())
            .await,
        Ok(Claim::Claimed)
    ));
    assert_eq!(c.epoch("twice"), 3);

    // A record that names a checkpoint gone is never resumed from another object of the run's
    // (one its record does not name may be a replaced owner's): the run is lost.
    let gone = RunResult::running("gone");
    let e = replica_store(&js, "twice-runs", "e", lease).await?;
    assert!(matches!(
        e.claim_resumable(gone.clone(), deadline, b"e's start".to_vec()).await,
        Ok(Claim::Claimed)
    ));
    drop(e);
    let checkpoints = js.get_object_store("twice-runs-checkpoints").await?;
    // Its start checkpoint is in the start object (epoch 0).
    let admission = checkpoints.info("run.gone").await?.description;
    let newer = jetstream::object_store::ObjectMetadata {
        name: "run.gone#2".into(),
        description: admission,
        ..Default::default()
    };
    checkpoints.put(newer, &mut b"a later turn".as_slice()).await?;
    checkpoints.delete("run.gone").await?;
    let d = replica_store(&js, "twice-runs", "d", lease).await?;
    let _d_alive = keep(&d);
    assert!(!d.orphans().await?.contains(&"gone".to_owned()));
    testkit::wait::until("d to see \"gone\" lapsed", Duration::from_secs(10), || async {
        d.orphans().await.ok()?.contains(&"gone".to_owned()).then_some(())
    })
    .await?;
    assert_eq!(d.take_over("gone").await?.map(|c| c.checkpoint), None);
    let lost = d.get("gone").await?.ok_or_else(|| anyhow::anyhow!("no record"))?;
    assert_eq!(
        (lost.status, lost.failure_reason),
        (
            RunStatus::Failed,
            Some(orchestrator::domain::FailureReason::OrchestratorLost)
        )
    );
    Ok(())
}

/// A follower whose consumer's node is lost goes on: the client gives the silent consumer up
/// after two missed idle heartbeats (one store timeout each, counted from twice that) and reads
/// on from a new one on a live node. It once waited for the client's defaults (a minute), and
/// an attached caller took the quiet of a run that had ended for its loss.
#[tokio::test]
async fn a_follower_goes_on_when_the_node_of_its_consumer_is_lost() -> TestResult {
    let mut cluster = testkit::nats::NatsCluster::start(3).await?;
    let options = NatsLogOptions {
        bounds: log_bounds(1 << 20),
        flush_interval: Duration::from_millis(20),
        timeout: Duration::from_secs(2),
        retry_for: Duration::from_secs(10),
        replicas: 3,
        shards: 1,
    };
    let log = NatsLog::open(
        &jetstream::new(async_nats::connect(cluster.seeds()).await?),
        "LOSS_EVENTS",
        options,
    )
    .await?;
    let mut writer = log.writer("followed", 0);
    writer.append(&[text_event(1, "a")]);
    let mut feed = log
        .follow("followed", 0)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no log of the run"))?;
    let first = tokio::time::timeout(Duration::from_secs(10), feed.next()).await?;
    assert_eq!(first.transpose()?.map(|e| e.seq), Some(1));

    // The node that holds the follower's consumer (the stream's only one) is lost.
    let js = jetstream::new(async_nats::connect(cluster.seeds()).await?);
    let mut consumers = js.get_stream("LOSS_EVENTS").await?.consumers();
    let consumer = consumers
        .next()
        .await
        .ok_or_else(|| anyhow::anyhow!("the follower has no consumer"))??;
    let host = consumer
        .cluster
        .and_then(|c| c.leader)
        .ok_or_else(|| anyhow::anyhow!("the consumer has no leader"))?;
    let lost = cluster
        .index_of(&host)
        .ok_or_else(|| anyhow::anyhow!("no node is named {host}"))?;
    cluster.kill(lost).await?;

    // The rest of the run is written once the stream leads again.
    cluster.stream_leader("LOSS_EVENTS").await?;
    let log = NatsLog::open(
        &jetstream::new(async_nats::connect(cluster.seeds()).await?),
        "LOSS_EVENTS",
        options,
    )
    .await?;
    let mut writer = log.writer("followed", 1);
    writer.append(&[text_event(2, "b"), finished_event(3)]);
    let mut settled = writer
        .settled()
        .ok_or_else(|| anyhow::anyhow!("a NATS writer settles in the background"))?;
    let kept = tokio::time::timeout(Duration::from_secs(30), settled.wait_for(|s| s.resolved(3))).await??;
    anyhow::ensure!(!kept.broken, "the log did not keep the rest of the run: {kept:?}");
    // With the client's defaults (15 s heartbeats) the lost consumer is given up after a
    // minute of silence; here after about 8 s, and made again once the stream answers. A pull
    // that failed meanwhile ends the feed `UNAVAILABLE`, and a feed quiet for longer than a
    // caller would wait is followed again: either way the follower gets the rest of the run.
    let mut seqs = Vec::new();
    let read_on = async {
        loop {
            // A feed quiet for 15 s (its consumer not made again yet) is followed again, as an
            // attached caller is told to when the run has ended.
            let next = tokio::time::timeout(Duration::from_secs(15), feed.next()).await;
            match next.unwrap_or(Some(Err(LogError::Unavailable {
                run_id: "followed".into(),
                reason: "quiet".into(),
            }))) {
                Some(Ok(event)) => seqs.push(event.seq),
                None => return anyhow::Ok(()),
                Some(Err(LogError::Unavailable { .. })) => {
                    let after = seqs.last().copied().unwrap_or(1);
                    // The stream (or the cluster's meta leader) may still be electing on a
                    // loaded machine: follow again until it answers, saying why it did not.
                    let last_refusal = Mutex::new(String::new());
                    let followed =
                        testkit::wait::until("the log to be followed again", Duration::from_secs(60), || async {
                            match log.follow("followed", after).await {
                                Ok(feed) => feed,
                                Err(e) => {
                                    *shared::sync::lock(&last_refusal) = e.to_string();
                                    None
                                }
                            }
                        })
                        .await;
                    feed = followed
                        .map_err(|e| anyhow::anyhow!("{e}; the last refusal: {}", shared::sync::lock(&last_refusal)))?;
                }
                Some(Err(e)) => return Err(anyhow::Error::from(e)),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(120), read_on)
        .await
        .map_err(|_| anyhow::anyhow!("the follower stalled with its consumer's node\n{}", cluster.logs()))??;
    assert_eq!(seqs, [2, 3]);
    Ok(())
}

/// A replaced owner's checkpoint is never what a takeover reads: c takes a's run over and dies
/// before it saves; a, replaced but unaware, saves once more (its record write is refused, but
/// its object put is not conditional); d takes the run over from c and resumes from a's last
/// checkpoint that its record named, not from the replaced owner's late one.
#[tokio::test]
async fn a_replaced_owners_late_checkpoint_is_never_what_a_takeover_reads() -> TestResult {
    use orchestrator::domain::ports::{Claim, RunJournal, StoreError};
    let nats = Nats::start().await?;
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    let lease = Duration::from_millis(500);
    let (a, c, d) = (
        replica_store(&js, "late-runs", "a", lease).await?,
        replica_store(&js, "late-runs", "c", lease).await?,
        replica_store(&js, "late-runs", "d", lease).await?,
    );
    let (c_alive, _d_alive) = (keep(&c), keep(&d));
    let deadline = shared::sync::unix_ms() + 60_000;
    let run = RunResult::running("late");
    let claimed = within(
        "a's claim",
        a.claim_resumable(run.clone(), deadline, b"a's start".to_vec()),
    )
    .await?;
    assert!(matches!(claimed, Ok(Claim::Claimed)));
    within("a's first save", a.save(run.clone(), deadline, b"a's first".to_vec())).await??;
    within("a's second save", a.save(run.clone(), deadline, b"a's second".to_vec())).await??;

    assert!(within("c's first look", c.orphans()).await??.is_empty());
    orphans_once_lapsed(&c, &["late"]).await?;
    let taken = within("c's takeover", c.take_over("late"))
        .await??
        .map(|t| t.checkpoint);
    assert_eq!(taken, Some(b"a's second".to_vec()));

    let late = within("a's late save", a.save(run, deadline, b"a's late".to_vec())).await?;
    assert!(matches!(late, Err(StoreError::Fenced { .. })), "{late:?}");
    drop(c_alive);

    assert!(within("d's first look", d.orphans()).await??.is_empty());
    orphans_once_lapsed(&d, &["late"]).await?;
    let taken = within("d's takeover", d.take_over("late"))
        .await??
        .map(|t| t.checkpoint);
    assert_eq!(
        taken,
        Some(b"a's second".to_vec()),
        "the object the record names, not the replaced owner's"
    );
    Ok(())
}

/// `step`'s answer within 20 s, else an error naming `what` (a store call that never answers
/// fails the test at once, saying where, rather than at the harness's watchdog).
async fn within<T>(what: &str, step: impl std::future::Future<Output = T>) -> anyhow::Result<T> {
    tokio::time::timeout(Duration::from_secs(20), step)
        .await
        .map_err(|_| anyhow::anyhow!("{what} did not answer within 20 s"))
}

/// A run whose owner died and whose deadline passed meanwhile is still taken over (the replica
/// that resumes it ends it at its deadline, through its log and its record): it is never left to
/// read lost from a comparison of two machines' clocks, nor its checkpoint deleted unread.
#[tokio::test]
async fn a_run_past_its_deadline_is_taken_over_to_be_ended() -> TestResult {
    use orchestrator::domain::ports::{Claim, RunJournal};
    let nats = Nats::start().await?;
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    let lease = Duration::from_millis(500);
    let (a, c) = (
        replica_store(&js, "late-deadline-runs", "a", lease).await?,
        replica_store(&js, "late-deadline-runs", "c", lease).await?,
    );
    let _c_alive = keep(&c);
    let deadline = shared::sync::unix_ms() + 300;
    let run = RunResult::running("overdue");
    assert!(matches!(
        a.claim_resumable(run.clone(), deadline, b"a's start".to_vec()).await,
        Ok(Claim::Claimed)
    ));
    assert!(c.orphans().await?.is_empty());
    orphans_once_lapsed(&c, &["overdue"]).await?;
    anyhow::ensure!(shared::sync::unix_ms() > deadline, "the deadline passed");
    assert_eq!(c.get("overdue").await?.map(|r| r.status), Some(RunStatus::Running));
    assert_eq!(
        c.take_over("overdue").await?.map(|t| t.checkpoint),
        Some(b"a's start".to_vec())
    );
    Ok(())
}

/// Webhook deliveries outlive the replica that wrote them: replica A runs two runs while the
/// receiver answers 503, so every delivery waits in the outbox with a failed attempt; A is then
/// killed (SIGKILL) and replica B, started after, delivers each one. The receiver gets every
/// delivery (deduplicated by webhook-id), each signed with the webhook's secret over its id,
/// timestamp and body, and B's `ListWebhookDeliveries` records the attempts.
#[tokio::test]
async fn webhooks_left_undelivered_by_a_killed_replica_are_delivered_by_another() -> TestResult {
    let nats = Nats::start().await?;
    let mock = mock_llm::MockLlm::start(mock_llm::Scenario::demo()).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let receiver = testkit::receiver::Receiver::start().await?;
    receiver.answer(503);
    let port = receiver.addr.port().to_string();
    let flags = [
        "--webhook-allow-cidr",
        "127.0.0.0/8",
        "--webhook-allow-port",
        &port,
        "--webhook-max-backoff",
        "1s",
        "--webhook-sweep-interval",
        "200ms",
    ];
    let a = orchestrator_process(&nats, &mock.base_url(), &runner, &flags).await?;
    let a_url = format!("http://{}", a.grpc);
    let mut client = pb::orchestrator_client::OrchestratorClient::connect(a_url.clone()).await?;
    let hook = client
        .create_webhook(pb::CreateWebhookRequest {
            url: receiver.url(),
            ..Default::default()
        })
        .await?
        .into_inner();
    for run_id in ["hooked-1", "hooked-2"] {
        let request = pb::OrchestrateRequest {
            run_id: run_id.into(),
            ..testkit::user("go")
        };
        assert_eq!(orchestrate(&a_url, request).await?.status(), pb::RunStatus::Completed);
    }
    // Each run's start and end were tried once and refused.
    let refused = testkit::wait::until_sync("four deliveries tried on A", Duration::from_secs(30), || {
        let distinct = receiver.distinct();
        (distinct.len() == 4).then_some(distinct)
    })
    .await?;
    a.kill().await?;
    receiver.answer(204);
    let b = orchestrator_process(&nats, &mock.base_url(), &runner, &flags).await?;
    let b_url = format!("http://{}", b.grpc);
    let mut client = pb::orchestrator_client::OrchestratorClient::connect(b_url).await?;
    let delivered = testkit::wait::until("B to deliver the four", Duration::from_secs(60), || {
        let (mut client, webhook_id) = (client.clone(), hook.id.clone());
        async move {
            let request = pb::ListWebhookDeliveriesRequest {
                webhook_id,
                ..Default::default()
            };
            let deliveries = client
                .list_webhook_deliveries(request)
                .await
                .ok()?
                .into_inner()
                .deliveries;
            let done = deliveries
                .iter()
                .filter(|d| d.state() == pb::WebhookDeliveryState::Delivered)
                .count();
            (done == 4).then_some(deliveries)
        }
    })
    .await?;
    // (A may have died between an attempt and its record: B's count may then start again.)
    assert!(
        delivered.iter().all(|d| d.attempts >= 1 && d.last_status == 204),
        "{delivered:?}"
    );
    let received = receiver.received();
    for delivery in &delivered {
        let tries = received.iter().filter(|r| r.id == delivery.id).count();
        assert!(
            tries >= 2,
            "{} was POSTed {tries} times, not refused on A then taken on B",
            delivery.id
        );
    }
    let events: std::collections::BTreeSet<(String, String)> =
        delivered.iter().map(|d| (d.run_id.clone(), d.event.clone())).collect();
    assert_eq!(events.len(), 4, "a start and an end of each run: {events:?}");
    let got = receiver.distinct();
    assert_eq!(got.len(), 4);
    for first_try in &refused {
        let Some(again) = got.iter().find(|r| r.id == first_try.id) else {
            anyhow::bail!("{} was never delivered again", first_try.id)
        };
        // The same delivery: the same body, signed with the webhook's secret.
        assert_eq!(again.body, first_try.body);
        let timestamp: u64 = again.timestamp.parse()?;
        let expected = orchestrator::domain::webhook::signature(&hook.secret, &again.id, timestamp, &again.body)?;
        assert_eq!(again.signature, expected);
        // A forged body does not carry that signature.
        let forged = again.body.replace("hooked", "forged");
        assert_ne!(
            orchestrator::domain::webhook::signature(&hook.secret, &again.id, timestamp, &forged)?,
            expected
        );
    }
    let finished = got
        .iter()
        .find(|r| r.json()["type"] == "run.finished")
        .map(|r| r.json());
    assert_eq!(
        finished.as_ref().map(|f| f["data"]["status"].clone()),
        Some("COMPLETED".into())
    );
    let _ = client
        .delete_webhook(pb::DeleteWebhookRequest { webhook_id: hook.id })
        .await?;
    b.stop().await
}
