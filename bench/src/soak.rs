//! `bench --soak N`: N runs through the real orchestrator process, about `--soak-fault-rate` of
//! them with a fault from the fault matrix (LLM errors, resets, stalls, garbage, error events,
//! unknown tools, slow tools, CancelRun, callers that leave or whose deadline passes). Afterwards
//! every run must be terminal, retrievable with `GetRun` and as its fault says; the in-flight
//! gauges must be back to 0; and the resident memory must be back near what it was after the
//! warm-up. Writes `soak.md` and `soak.json`; exits non-zero when a check fails.

use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt;
use mock_llm::{Scenario, Scenarios, Step, Turn};
use proto::orchestrator::v1 as pb;
use serde::Serialize;
use serde_json::json;

use crate::procstat;
use crate::stack::Stack;

/// What one run of the soak is made to go through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Kind {
    Fine,
    Llm500,
    ResetMidText,
    StallMidStream,
    Garbage,
    ErrorEvent,
    UnknownTool,
    SlowTool,
    CancelRun,
    CallerGone,
    CallerDeadline,
}

const FAULTS: [Kind; 10] = [
    Kind::Llm500,
    Kind::ResetMidText,
    Kind::StallMidStream,
    Kind::Garbage,
    Kind::ErrorEvent,
    Kind::UnknownTool,
    Kind::SlowTool,
    Kind::CancelRun,
    Kind::CallerGone,
    Kind::CallerDeadline,
];

impl Kind {
    /// The model name its scenario is served under.
    fn model(self) -> String {
        format!(
            "soak_{}",
            serde_json::to_value(self)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default()
        )
    }

    /// Its scenario; `runs` bounds how often it is played (the stand-in model counts scripted
    /// failures per model, not per run, so every attempt of every run must have one).
    fn scenario(self, runs: u64) -> Scenario {
        let sleep = |ms: u64| Step::call("sleep", json!({"ms": ms}));
        let turns = match self {
            Kind::Fine => vec![
                Turn::text("Adding.\n").then(Step::call("calculate", json!({"expression": "2+2"}))),
                Turn::text("It is 4."),
            ],
            Kind::Llm500 => vec![Turn {
                fail_first: vec![
                    500;
                    usize::try_from(runs / FAULTS.len() as u64 + 1).unwrap_or(usize::MAX / 4) * 2 + 8
                ],
                ..Turn::text("never")
            }],
            Kind::ResetMidText => vec![Turn::text("Half an answer").then(Step::Cut)],
            Kind::StallMidStream => vec![Turn::text("Thinking").then(Step::Stall)],
            Kind::Garbage => vec![Turn::text("Before").then(Step::Raw {
                sse: "data: {not json\n\n".into(),
            })],
            Kind::ErrorEvent => vec![Turn::text("Before").then(Step::Error {
                message: "overloaded".into(),
            })],
            Kind::UnknownTool => vec![Turn::text("Trying.\n").then(Step::call("no_such_tool", json!({})))],
            Kind::SlowTool => vec![Turn::text("Waiting.\n").then(sleep(5_000)), Turn::text("Gave up.")],
            Kind::CancelRun | Kind::CallerGone | Kind::CallerDeadline => {
                vec![Turn::text("Working.\n").then(sleep(3_000)), Turn::text("Done.")]
            }
        };
        Scenario::new(turns)
    }

    /// The terminal status (and failure reason) the run must end with.
    fn expected(self) -> (pb::RunStatus, pb::FailureReason) {
        use pb::FailureReason as R;
        use pb::RunStatus as S;
        match self {
            Kind::Fine | Kind::SlowTool => (S::Completed, R::Unspecified),
            Kind::Llm500 | Kind::ResetMidText | Kind::Garbage | Kind::ErrorEvent => (S::Failed, R::LlmError),
            Kind::StallMidStream => (S::Failed, R::LlmStreamStalled),
            Kind::UnknownTool => (S::Failed, R::ToolParseError),
            Kind::CancelRun | Kind::CallerGone => (S::Canceled, R::Unspecified),
            Kind::CallerDeadline => (S::Failed, R::DeadlineExceeded),
        }
    }

    /// The text the run must keep, whatever ended it.
    fn kept(self) -> &'static str {
        match self {
            Kind::Fine => "Adding.\nIt is 4.",
            Kind::Llm500 => "",
            Kind::ResetMidText => "Half an answer",
            Kind::StallMidStream => "Thinking",
            Kind::Garbage | Kind::ErrorEvent => "Before",
            Kind::UnknownTool => "Trying.\n",
            Kind::SlowTool => "Waiting.\nGave up.",
            Kind::CancelRun | Kind::CallerGone | Kind::CallerDeadline => "Working.\n",
        }
    }
}

/// The kind of run `i`: a fault for about `rate` of the runs, spread evenly over the faults.
fn kind_of(i: u64, rate: f64) -> Kind {
    // A multiplicative hash spreads the faults over the run numbers (and so over time).
    let h = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11;
    let unit = h as f64 / (1u64 << 53) as f64;
    if unit >= rate {
        return Kind::Fine;
    }
    FAULTS[(i % FAULTS.len() as u64) as usize]
}

/// Every scenario a soak of `runs` runs uses, by model name.
pub(crate) fn scenarios(runs: u64) -> Scenarios {
    Scenarios {
        default: Kind::Fine.scenario(runs),
        named: std::iter::once(Kind::Fine)
            .chain(FAULTS)
            .map(|k| (k.model(), k.scenario(runs)))
            .collect(),
    }
}

/// Flags the soak runs the orchestrator with: faults show within a second or two.
pub(crate) const FLAGS: &[&str] = &[
    "--llm-idle-timeout",
    "1s",
    "--llm-max-retries",
    "1",
    "--llm-retry-backoff",
    "10ms",
    "--metrics-listen",
    "127.0.0.1:0",
    // Enough for every run to be read back right after it ends (runs in flight ≪ this), few
    // enough that the results kept do not hide a leak in the memory figure.
    "--keep-results",
    "2000",
];

/// The soak's settings.
pub(crate) struct Soak {
    pub runs: u64,
    /// The result store (`memory` or `nats`), for the report.
    pub store: String,
    pub fault_rate: f64,
    pub concurrency: usize,
}

#[derive(Debug, Serialize)]
struct Report {
    runs: u64,
    store: String,
    fault_rate: f64,
    concurrency: usize,
    faults_injected: u64,
    wall_s: f64,
    runs_per_s: f64,
    mismatches: Vec<String>,
    not_retrievable: u64,
    runs_in_flight_after: f64,
    tool_calls_in_flight_after: f64,
    rss_baseline_mib: f64,
    rss_peak_mib: f64,
    rss_after_mib: f64,
    passed: bool,
}

impl Soak {
    /// Runs the soak on `stack` and writes the report into `out`.
    pub(crate) async fn run(&self, stack: &Stack, out: &Path) -> anyhow::Result<bool> {
        let warm_up = (self.runs / 20).clamp(1, 500);
        drive(stack, 0..warm_up, 0.0, self.concurrency).await;
        settle(stack).await?;
        let baseline = procstat::rss(stack.pid)?;
        let peak = procstat::PeakRss::start(stack.pid);
        let started = Instant::now();
        let outcomes = drive(stack, warm_up..warm_up + self.runs, self.fault_rate, self.concurrency).await;
        let wall = started.elapsed();
        let (runs_after, calls_after) = settle(stack).await?;
        let after = procstat::rss(stack.pid)?;
        let mut report = Report {
            runs: self.runs,
            store: self.store.clone(),
            fault_rate: self.fault_rate,
            concurrency: self.concurrency,
            faults_injected: outcomes.iter().filter(|o| o.kind != Kind::Fine).count() as u64,
            wall_s: wall.as_secs_f64(),
            runs_per_s: self.runs as f64 / wall.as_secs_f64(),
            mismatches: outcomes.iter().filter_map(|o| o.mismatch.clone()).take(20).collect(),
            not_retrievable: outcomes.iter().filter(|o| !o.retrievable).count() as u64,
            runs_in_flight_after: runs_after,
            tool_calls_in_flight_after: calls_after,
            rss_baseline_mib: mib(baseline),
            rss_peak_mib: mib(peak.finish().await.max(after)),
            rss_after_mib: mib(after),
            passed: false,
        };
        // "Back near its baseline": within a quarter of it plus 16 MiB (allocator slack).
        let rss_ok = report.rss_after_mib <= report.rss_baseline_mib * 1.25 + 16.0;
        report.passed = report.mismatches.is_empty()
            && report.not_retrievable == 0
            && (runs_after, calls_after) == (0.0, 0.0)
            && rss_ok;
        write(&report, out)?;
        Ok(report.passed)
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// One run of the soak as checked.
struct Outcome {
    kind: Kind,
    retrievable: bool,
    mismatch: Option<String>,
}

async fn drive(stack: &Stack, ids: std::ops::Range<u64>, rate: f64, concurrency: usize) -> Vec<Outcome> {
    let total = ids.end - ids.start;
    let step = (total / 10).max(1);
    futures::stream::iter(ids.clone())
        .map(|i| async move {
            let outcome = one(stack, i, kind_of(i, rate)).await;
            if (i - ids.start + 1).is_multiple_of(step) {
                eprintln!("soak: {} of {total} runs", i - ids.start + 1);
            }
            outcome
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await
}

/// Plays run `i` as its kind says, then reads it back with GetRun and checks it.
async fn one(stack: &Stack, i: u64, kind: Kind) -> Outcome {
    let run_id = format!("soak-{i}");
    let mut client = stack.client(i as usize);
    if let Err(e) = play(&mut client, &run_id, kind).await {
        return Outcome {
            kind,
            retrievable: true,
            mismatch: Some(format!("{run_id} ({kind:?}): {e}")),
        };
    }
    // A caller that left or timed out gets nothing more: its run ends on its own a moment later.
    let deadline = Instant::now() + Duration::from_secs(30);
    let stored = loop {
        match client.get_run(pb::GetRunRequest { run_id: run_id.clone() }).await {
            Ok(r) if r.get_ref().status() != pb::RunStatus::Running || Instant::now() > deadline => {
                break r.into_inner();
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(status) => {
                return Outcome {
                    kind,
                    retrievable: false,
                    mismatch: Some(format!("{run_id} ({kind:?}): GetRun failed: {status}")),
                };
            }
        }
    };
    let seen = (stored.status(), stored.failure_reason());
    let mut mismatch = (seen != kind.expected() || !stored.text.starts_with(kind.kept())).then(|| {
        format!(
            "{run_id} ({kind:?}): {seen:?} with text {:?}, expected {:?} keeping {:?} ({})",
            stored.text,
            kind.expected(),
            kind.kept(),
            stored.failure_detail
        )
    });
    if mismatch.is_none() {
        mismatch = replay_mismatch(&mut client, &run_id, &stored)
            .await
            .map(|e| format!("{run_id} ({kind:?}): AttachRun replay: {e}"));
    }
    Outcome {
        kind,
        retrievable: true,
        mismatch,
    }
}

type Client = pb::orchestrator_client::OrchestratorClient<tonic::transport::Channel>;

/// What is wrong with the run's event log as `AttachRun` replays it from the start: it must
/// number its events 1, 2, 3 … and end with `run_finished` whose status and text are the stored
/// result's, and its text deltas must add up to that text.
async fn replay_mismatch(client: &mut Client, run_id: &str, stored: &pb::RunResult) -> Option<String> {
    use pb::orchestrate_event::Event as E;
    let request = pb::AttachRunRequest {
        run_id: run_id.to_owned(),
        after_seq: 0,
    };
    let events = async {
        let mut stream = client.attach_run(request).await?.into_inner();
        let mut events = Vec::new();
        while let Some(event) = stream.message().await? {
            events.push(event);
        }
        Ok::<_, tonic::Status>(events)
    };
    let events = match tokio::time::timeout(Duration::from_secs(30), events).await {
        Err(_) => return Some("no end within 30 s".into()),
        Ok(Err(status)) => return Some(status.to_string()),
        Ok(Ok(events)) => events,
    };
    if let Some((i, e)) = events.iter().enumerate().find(|(i, e)| e.seq != *i as u64 + 1) {
        return Some(format!("seq {} at position {i}", e.seq));
    }
    let text: String = events
        .iter()
        .filter_map(|e| match &e.event {
            Some(E::TextDelta(t)) => Some(t.text.as_str()),
            _ => None,
        })
        .collect();
    let last = match events.last().and_then(|e| e.event.as_ref()) {
        Some(E::RunFinished(f)) => f.result.clone().unwrap_or_default(),
        other => return Some(format!("the last event is {other:?}, not run_finished")),
    };
    (last.status != stored.status || last.text != stored.text || text != stored.text).then(|| {
        format!(
            "run_finished {:?} with {} bytes, deltas {} bytes, stored {:?} with {} bytes",
            last.status(),
            last.text.len(),
            text.len(),
            stored.status(),
            stored.text.len()
        )
    })
}

/// The caller's side of one run.
async fn play(client: &mut Client, run_id: &str, kind: Kind) -> anyhow::Result<()> {
    let mut request = tonic::Request::new(pb::OrchestrateRequest {
        run_id: run_id.into(),
        model: kind.model(),
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "go".into(),
            ..Default::default()
        }],
        limits: (kind == Kind::SlowTool).then(|| pb::RunLimits {
            tool_timeout_ms: Some(200),
            ..Default::default()
        }),
        ..Default::default()
    });
    if kind == Kind::CallerDeadline {
        request.set_timeout(Duration::from_millis(1500));
    }
    let mut stream = client.orchestrate(request).await?.into_inner();
    // Read to the stream's end (its trailers), as a client should: dropping it at run_finished
    // makes the client's HTTP/2 library reset the stream, and after 1024 such resets h2 closes
    // the whole connection (GOAWAY "too_many_internal_resets").
    let mut finished = false;
    loop {
        let event = match stream.message().await {
            Ok(Some(event)) => event,
            Ok(None) => break,
            // The caller's own deadline passing ends its stream with an error, as it should.
            Err(_) if kind == Kind::CallerDeadline => return Ok(()),
            Err(status) => anyhow::bail!("the stream failed: {status}"),
        };
        match event.event {
            Some(pb::orchestrate_event::Event::ToolCallStarted(_)) if kind == Kind::CallerGone => return Ok(()),
            Some(pb::orchestrate_event::Event::ToolCallStarted(_)) if kind == Kind::CancelRun => {
                client
                    .cancel_run(pb::CancelRunRequest { run_id: run_id.into() })
                    .await?;
            }
            Some(pb::orchestrate_event::Event::RunFinished(_)) => finished = true,
            _ => {}
        }
    }
    anyhow::ensure!(
        finished || kind == Kind::CallerDeadline,
        "the stream ended without run_finished"
    );
    Ok(())
}

/// Waits until no run or tool call is in flight; the gauges as last read.
async fn settle(stack: &Stack) -> anyhow::Result<(f64, f64)> {
    let address = stack
        .metrics
        .as_deref()
        .ok_or_else(|| anyhow::anyhow!("the orchestrator serves no metrics"))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let body = reqwest::get(format!("http://{address}/metrics")).await?.text().await?;
        let gauge = |name: &str| {
            body.lines()
                .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse::<f64>().ok()))
                .unwrap_or(f64::NAN)
        };
        let now = (
            gauge("orchestrator_runs_in_flight "),
            gauge("orchestrator_tool_calls_in_flight "),
        );
        if now == (0.0, 0.0) || Instant::now() > deadline {
            return Ok(now);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn write(report: &Report, out: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("soak.json"), serde_json::to_string_pretty(report)?)?;
    let verdict = if report.passed { "PASSED" } else { "FAILED" };
    let mut md = format!(
        "# Soak: {} runs, {:.0} % faults, {} store — {verdict}\n\n\
         | figure | value |\n|---|---|\n\
         | runs (after a warm-up) | {} |\n| faults injected | {} |\n| concurrency | {} |\n\
         | wall time | {:.1} s ({:.0} runs/s) |\n| runs not as their fault says, or whose AttachRun replay differs | {} |\n\
         | runs GetRun cannot find | {} |\n| runs / tool calls in flight after | {} / {} |\n\
         | RSS after warm-up → peak → after | {:.1} → {:.1} → {:.1} MiB |\n",
        report.runs,
        report.fault_rate * 100.0,
        report.store,
        report.runs,
        report.faults_injected,
        report.concurrency,
        report.wall_s,
        report.runs_per_s,
        report.mismatches.len(),
        report.not_retrievable,
        report.runs_in_flight_after,
        report.tool_calls_in_flight_after,
        report.rss_baseline_mib,
        report.rss_peak_mib,
        report.rss_after_mib,
    );
    for m in &report.mismatches {
        md.push_str(&format!("\n* {m}"));
    }
    std::fs::write(out.join("soak.md"), md)?;
    eprintln!("{}", std::fs::read_to_string(out.join("soak.md"))?);
    Ok(())
}
