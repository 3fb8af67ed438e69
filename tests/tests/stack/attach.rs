//! Re-attaching to runs (`AttachRun`) with the in-memory store, and run slots that count running
//! work only: the real orchestrator, tool-runner and stand-in model on loopback.

use std::time::Duration;

use futures::StreamExt;
use mock_llm::{Scenario, Step, Turn};
use proto::orchestrator::v1 as pb;
use proto::orchestrator::v1::RunStatus as S;
use serde_json::json;
use testkit::stack::{Outcome, Stack, request, runner_config};
use tonic::transport::Channel;

type TestResult = anyhow::Result<()>;
type Client = pb::orchestrator_client::OrchestratorClient<Channel>;

/// Two turns that stream word by word, 5 ms apart, with a tool call between them.
fn slow_two_turns() -> Scenario {
    let words: String = (0..40).map(|i| format!("word{i} ")).collect();
    Scenario {
        token_delay_ms: 5,
        ..Scenario::new(vec![
            Turn::text(&words).then(Step::call("sleep", json!({"ms": 50}))),
            Turn::text(&words),
        ])
    }
}

async fn attach(client: &mut Client, run_id: &str, after_seq: u64) -> Result<Vec<pb::OrchestrateEvent>, tonic::Status> {
    let request = pb::AttachRunRequest {
        run_id: run_id.into(),
        after_seq,
    };
    every_event(client.attach_run(request).await?.into_inner()).await
}

/// The events `Orchestrate` answers `request` with, to the end of its stream.
async fn orchestrate(
    client: &mut Client,
    request: pb::OrchestrateRequest,
) -> Result<Vec<pb::OrchestrateEvent>, tonic::Status> {
    every_event(client.orchestrate(request).await?.into_inner()).await
}

/// Every event of `stream`, to its end.
async fn every_event(
    mut stream: tonic::Streaming<pb::OrchestrateEvent>,
) -> Result<Vec<pb::OrchestrateEvent>, tonic::Status> {
    let mut events = Vec::new();
    while let Some(event) = stream.next().await {
        events.push(event?);
    }
    Ok(events)
}

fn detached(run_id: &str) -> pb::OrchestrateRequest {
    let mut req = request("go", &[]);
    req.run_id = run_id.into();
    req.detached = true;
    req
}

/// A caller that leaves mid-run and attaches again from its last seq gets the rest of the
/// stream: together one gap-free stream that keeps the invariants. A finished run replays the
/// same events from any seq.
#[tokio::test]
async fn a_caller_that_left_reattaches_from_its_last_seq_and_the_finished_run_replays() -> TestResult {
    let stack = Stack::start(slow_two_turns(), runner_config(None), |_| {}).await?;
    let mut client = stack.client().await?;
    let mut first = client.orchestrate(detached("attach-1")).await?.into_inner();
    let mut seen = Vec::new();
    while seen.len() < 7 {
        match first.next().await {
            Some(event) => seen.push(event?),
            None => anyhow::bail!("the run ended before 7 events"),
        }
    }
    drop(first);
    let rest = attach(&mut client, "attach-1", 7).await?;
    anyhow::ensure!(rest.first().map(|e| e.seq) == Some(8), "the rest starts at seq 8");
    seen.extend(rest);
    let whole = Outcome::new(seen, Duration::ZERO)?;
    assert_eq!(whole.status(), S::Completed);
    assert_eq!(whole.result.turns, 2);

    // The finished run replays its kept log, from the start or from any seq; a retry of its
    // Orchestrate gets the same events as its caller did, from the log.
    assert_eq!(attach(&mut client, "attach-1", 0).await?, whole.events);
    let retried = orchestrate(&mut client, detached("attach-1")).await?;
    assert_eq!(retried, whole.events, "a retried Orchestrate replays the log");
    assert_eq!(attach(&mut client, "attach-1", 20).await?, whole.events[20..]);
    let last = whole.events.len() as u64;
    assert!(
        attach(&mut client, "attach-1", last).await?.is_empty(),
        "nothing after the end"
    );
    Ok(())
}

/// Several callers attached to a live run each get every event up to run_finished.
#[tokio::test]
async fn callers_attached_to_a_live_run_follow_it_to_its_end() -> TestResult {
    let stack = Stack::start(slow_two_turns(), runner_config(None), |_| {}).await?;
    let mut client = stack.client().await?;
    let original = client.orchestrate(detached("attach-live")).await?.into_inner();
    let collect = |stream: tonic::Streaming<pb::OrchestrateEvent>| async move {
        stream.map(|e| e.map_err(anyhow::Error::from)).collect::<Vec<_>>().await
    };
    let original = tokio::spawn(collect(original));
    // Attach while the run streams (its first turn takes about 200 ms), once it has begun; how
    // far it has got when the attaches come does not change what they must see (every event once).
    let begun = || {
        let mut probe = client.clone();
        async move {
            let request = pb::GetRunRequest {
                run_id: "attach-live".into(),
            };
            let run = probe.get_run(request).await.ok()?.into_inner();
            (run.turns >= 1).then_some(())
        }
    };
    testkit::wait::until("the run's first turn", Duration::from_secs(10), begun).await?;
    let (mut a, mut b) = (client.clone(), client.clone());
    let (from_start, from_three) = tokio::join!(attach(&mut a, "attach-live", 0), attach(&mut b, "attach-live", 3));
    let original: Vec<_> = original.await?.into_iter().collect::<anyhow::Result<_>>()?;
    let original = Outcome::new(original, Duration::ZERO)?;
    assert_eq!(from_start?, original.events);
    assert_eq!(from_three?, original.events[3..]);
    Ok(())
}

/// Unknown runs are NOT_FOUND. A run's log is bounded: with --event-log-max-bytes at its floor a
/// long run's oldest events are dropped, so a replay from the start is OUT_OF_RANGE while a
/// re-attach near the end works; with the default bound the same run replays whole. A retried
/// Orchestrate of the run whose log dropped its start gets its result (its text as one delta).
#[tokio::test]
async fn attach_answers_not_found_and_a_bounded_log_refuses_what_it_dropped() -> TestResult {
    let long: String = (0..20_000).map(|i| format!("w{i} ")).collect();
    let scenario = Scenario::new(vec![Turn::default().then(Step::Text {
        text: long.clone(),
        chunk_chars: Some(1_000),
    })]);
    for (bound, replays) in [(64 * 1024, false), (8 << 20, true)] {
        let stack = Stack::start(scenario.clone(), runner_config(None), |c| {
            c.store.event_log_max_bytes = bound;
        })
        .await?;
        let mut client = stack.client().await?;
        let unknown = attach(&mut client, "no-such-run", 0).await.err().map(|s| s.code());
        assert_eq!(unknown, Some(tonic::Code::NotFound));
        let out = stack.run(request("go", &[])).await?;
        assert_eq!(out.result.text, long);
        let run_id = out.result.run_id.clone();
        let last = out.events.len() as u64;
        match attach(&mut client, &run_id, 0).await {
            Ok(events) => assert!(
                replays && events == out.events,
                "bound {bound}: replayed {}",
                events.len()
            ),
            Err(status) => {
                assert!(!replays, "bound {bound}: {status:?}");
                assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
                assert!(status.message().contains("GetRun"), "{status:?}");
            }
        }
        assert_eq!(
            attach(&mut client, &run_id, last - 1).await?,
            out.events[out.events.len() - 1..]
        );
        let mut again = request("go", &[]);
        again.run_id.clone_from(&run_id);
        let retried = Outcome::new(orchestrate(&mut client, again).await?, Duration::ZERO)?;
        assert_eq!(retried.result.text, long, "bound {bound}");
        if replays {
            assert_eq!(retried.events, out.events, "bound {bound}: the log replayed");
        }
    }
    Ok(())
}

/// A run that has ended frees its slot at once, even while its caller reads nothing and its
/// last events wait up to --event-send-timeout to be delivered: with one slot, a second run is
/// admitted as soon as the first has ended, and the first caller still gets its whole stream
/// when it reads.
#[tokio::test]
async fn a_finished_run_frees_its_slot_while_its_caller_reads_nothing() -> TestResult {
    let long: String = (0..40_000).map(|i| format!("w{i} ")).collect();
    let scenario = Scenario {
        token_delay_ms: 1,
        ..Scenario::new(vec![Turn::default().then(Step::Text {
            text: long,
            chunk_chars: Some(2_000),
        })])
    };
    let stack = Stack::start(scenario, runner_config(None), |c| {
        c.runs.max_runs = 1;
        c.runs.event_buffer = 1;
        c.runs.event_send_timeout = Duration::from_secs(60);
    })
    .await?;
    // A caller with a small HTTP/2 window, so the run's sends wait once it stops reading.
    let channel = Channel::from_shared(format!("http://{}", stack.addr))?
        .initial_stream_window_size(65_535)
        .connect()
        .await?;
    let mut idle = Client::new(channel);
    let mut req = request("go", &[]);
    req.run_id = "never-read".into();
    req.limits = Some(pb::RunLimits {
        run_timeout_ms: Some(1_000),
        ..Default::default()
    });
    let unread = idle.orchestrate(req).await?.into_inner();
    let mut client = stack.client().await?;
    let ended = testkit::wait::until("the unread run to end", Duration::from_secs(20), || {
        let mut client = client.clone();
        async move {
            let request = pb::GetRunRequest {
                run_id: "never-read".into(),
            };
            let run = client.get_run(request).await.ok()?.into_inner();
            (run.status != S::Running as i32).then_some(run)
        }
    })
    .await?;
    assert_eq!(ended.failure_reason, pb::FailureReason::DeadlineExceeded as i32);
    // The first run's last events are still waiting for its caller; the slot is free already.
    let mut quick = request("go", &[]);
    quick.limits = Some(pb::RunLimits {
        run_timeout_ms: Some(5_000),
        ..Default::default()
    });
    let admitted = client.orchestrate(quick).await;
    assert!(admitted.is_ok(), "the slot was still held: {:?}", admitted.err());
    // Read now, the first stream is whole and ends with run_finished.
    let events: Vec<_> = unread.collect::<Vec<_>>().await.into_iter().collect::<Result<_, _>>()?;
    let first = Outcome::new(events, Duration::ZERO)?;
    assert_eq!(first.result.failure_reason, pb::FailureReason::DeadlineExceeded as i32);
    Ok(())
}
