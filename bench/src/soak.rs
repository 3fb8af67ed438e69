//! `bench --soak N`: N runs through the real orchestrator process, about `--soak-fault-rate` of
//! them with a fault from the fault matrix (LLM errors, resets, stalls, garbage, error events,
//! unknown tools, slow tools, CancelRun, callers that leave or whose deadline passes). Afterwards
//! every run must be terminal, retrievable with `GetRun` and as its fault says; the in-flight
//! gauges must be back to 0; and the resident memory must be back near what it was after the
//! warm-up. Writes `soak.md` and `soak.json`; exits non-zero when a check fails.
//!
//! With `--soak-replica-faults EVERY` (NATS store) the runs go through three replicas instead,
//! one of which is killed or drained and replaced every `EVERY` (see `replicas`): every caller
//! follows its run across replicas (`AttachRun` from the last seq it saw) and must see one
//! gap-free stream, whose text once `turn_restarted` is applied is the stored result's. The
//! caller-side faults (CancelRun, callers that leave or whose deadline passes) are left out then:
//! a run that moved has no caller of its own. The memory check is left out too (the processes
//! are replaced).

use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt;
use mock_llm::{Scenario, Scenarios, Step, Turn};
use proto::orchestrator::v1 as pb;
use serde::Serialize;
use serde_json::json;

use crate::procstat;
use crate::replicas::Replicas;
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
                    // Every attempt of every run fails: a run's turn is asked up to twice,
                    // and again when its replica dies while it streams.
                    usize::try_from(runs / FAULTS.len() as u64 + 1).unwrap_or(usize::MAX / 8) * 4 + 8
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

impl Kind {
    /// Whether the fault is the caller's doing (left out when runs move between replicas).
    fn by_the_caller(self) -> bool {
        matches!(self, Kind::CancelRun | Kind::CallerGone | Kind::CallerDeadline)
    }
}

/// The kind of run `i`: a fault for about `rate` of the runs, spread evenly over `faults`.
fn kind_of(i: u64, rate: f64, faults: &[Kind]) -> Kind {
    // A multiplicative hash spreads the faults over the run numbers (and so over time).
    let h = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11;
    let unit = h as f64 / (1u64 << 53) as f64;
    if unit >= rate || faults.is_empty() {
        return Kind::Fine;
    }
    faults[(i % faults.len() as u64) as usize]
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

/// What the soak runs against: one orchestrator, or replicas with replica faults.
#[derive(Clone, Copy)]
pub(crate) enum Target<'a> {
    One(&'a Stack),
    Fleet(&'a Replicas, Duration),
}

impl Target<'_> {
    fn client(self, i: usize) -> Client {
        match self {
            Target::One(stack) => stack.client(i),
            Target::Fleet(replicas, _) => replicas.client(i),
        }
    }

    async fn metrics(self) -> Vec<String> {
        match self {
            Target::One(stack) => stack.metrics.iter().cloned().collect(),
            Target::Fleet(replicas, _) => replicas.metrics().await,
        }
    }

    /// The faults the runs get.
    fn faults(self) -> Vec<Kind> {
        match self {
            Target::One(_) => FAULTS.to_vec(),
            Target::Fleet(..) => FAULTS.into_iter().filter(|k| !k.by_the_caller()).collect(),
        }
    }

    /// Whether callers follow their runs across replicas.
    fn follows(self) -> bool {
        matches!(self, Target::Fleet(..))
    }
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
    /// Replicas killed, drained, cut off from NATS and paused while the runs went on (replica
    /// faults).
    replicas_killed: u64,
    replicas_drained: u64,
    replicas_cut_off: u64,
    replicas_paused: u64,
    /// Not measured with replicas (they are replaced).
    rss_baseline_mib: Option<f64>,
    rss_peak_mib: Option<f64>,
    rss_after_mib: Option<f64>,
    passed: bool,
}

impl Soak {
    /// Runs the soak on `target` and writes the report into `out`.
    pub(crate) async fn run(&self, target: Target<'_>, out: &Path) -> anyhow::Result<bool> {
        let warm_up = (self.runs / 20).clamp(1, 500);
        drive(target, 0..warm_up, 0.0, self.concurrency).await;
        settle(target).await?;
        // One process's memory: not with replicas, which are replaced.
        let pid = match target {
            Target::One(stack) => Some(stack.pid),
            Target::Fleet(..) => None,
        };
        let baseline = pid.map(procstat::rss).transpose()?;
        let peak = pid.map(procstat::PeakRss::start);
        let started = Instant::now();
        let outcomes = self.drive_with_faults(target, warm_up).await?;
        let wall = started.elapsed();
        let (runs_after, calls_after) = settle(target).await?;
        let after = pid.map(procstat::rss).transpose()?;
        let peak = match peak {
            Some(peak) => Some(peak.finish().await.max(after.unwrap_or(0))),
            None => None,
        };
        let [killed, drained, cut_off, paused] = match target {
            Target::One(_) => [0; 4],
            Target::Fleet(replicas, _) => [
                &replicas.kills,
                &replicas.drains,
                &replicas.partitions,
                &replicas.pauses,
            ]
            .map(|n| n.load(std::sync::atomic::Ordering::Relaxed)),
        };
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
            replicas_killed: killed,
            replicas_drained: drained,
            replicas_cut_off: cut_off,
            replicas_paused: paused,
            rss_baseline_mib: baseline.map(mib),
            rss_peak_mib: peak.map(mib),
            rss_after_mib: after.map(mib),
            passed: false,
        };
        // "Back near its baseline": within a quarter of it plus 16 MiB (allocator slack).
        let rss_ok = match (report.rss_baseline_mib, report.rss_after_mib) {
            (Some(baseline), Some(after)) => after <= baseline * 1.25 + 16.0,
            _ => true,
        };
        let replicas_ok = matches!(target, Target::One(_)) || killed + drained + cut_off + paused > 0;
        report.passed = report.mismatches.is_empty()
            && report.not_retrievable == 0
            && (runs_after, calls_after) == (0.0, 0.0)
            && rss_ok
            && replicas_ok;
        write(&report, out)?;
        Ok(report.passed)
    }

    /// The measured runs (after `warm_up`), with replica faults injected meanwhile when the
    /// target has replicas.
    async fn drive_with_faults(&self, target: Target<'_>, warm_up: u64) -> anyhow::Result<Vec<Outcome>> {
        let runs = drive(target, warm_up..warm_up + self.runs, self.fault_rate, self.concurrency);
        let Target::Fleet(replicas, every) = target else {
            return Ok(runs.await);
        };
        let (done, finished) = tokio::sync::oneshot::channel::<()>();
        let runs = async move {
            let outcomes = runs.await;
            let _ = done.send(());
            outcomes
        };
        let faults = replicas.inject_faults(every, async {
            let _ = finished.await;
        });
        let (outcomes, injected) = tokio::join!(runs, faults);
        injected?;
        Ok(outcomes)
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

impl Outcome {
    /// A run found by GetRun, with what is wrong with it if anything.
    fn checked(kind: Kind, mismatch: Option<String>) -> Self {
        Self {
            kind,
            retrievable: true,
            mismatch,
        }
    }
}

async fn drive(target: Target<'_>, ids: std::ops::Range<u64>, rate: f64, concurrency: usize) -> Vec<Outcome> {
    let total = ids.end - ids.start;
    let step = (total / 10).max(1);
    let faults = target.faults();
    futures::stream::iter(ids.clone())
        .map(|i| {
            let kind = kind_of(i, rate, &faults);
            async move {
                let outcome = one(target, i, kind).await;
                if (i - ids.start + 1).is_multiple_of(step) {
                    eprintln!("soak: {} of {total} runs", i - ids.start + 1);
                }
                outcome
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await
}

/// Plays run `i` as its kind says, then reads it back with GetRun and checks it.
async fn one(target: Target<'_>, i: u64, kind: Kind) -> Outcome {
    let run_id = format!("soak-{i}");
    let mut client = target.client(i as usize);
    let played = tokio::time::timeout(PLAY_LIMIT, play(&mut client, &run_id, kind, target.follows()));
    let played = played
        .await
        .unwrap_or_else(|_| Err(anyhow::anyhow!("no run_finished within {PLAY_LIMIT:?}")));
    let streamed = match played {
        Ok(events) => events,
        Err(e) => return Outcome::checked(kind, Some(format!("{run_id} ({kind:?}): {e}"))),
    };
    let stored = match read_back(&client, &run_id, target.follows()).await {
        Ok(stored) => stored,
        Err(status) => {
            return Outcome {
                retrievable: false,
                ..Outcome::checked(kind, Some(format!("{run_id} ({kind:?}): GetRun failed: {status}")))
            };
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
    if mismatch.is_none() && target.follows() && told(&streamed) != stored.text {
        mismatch = Some(format!(
            "{run_id} ({kind:?}): the caller's stream tells {:?}, the stored result {:?}",
            told(&streamed),
            stored.text
        ));
    }
    if mismatch.is_none() {
        mismatch = replay_mismatch(&client, &run_id, &stored, target.follows())
            .await
            .map(|e| format!("{run_id} ({kind:?}): AttachRun replay: {e}"));
    }
    Outcome::checked(kind, mismatch)
}

/// The run as GetRun answers once it is no longer RUNNING (or as it reads after 30 s): a caller
/// that left or timed out gets nothing more, and its run ends on its own a moment later.
async fn read_back(client: &Client, run_id: &str, follows: bool) -> Result<pb::RunResult, tonic::Status> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let read = retried(follows, || {
            let (mut client, run_id) = (client.clone(), run_id.to_owned());
            async move { client.get_run(pb::GetRunRequest { run_id }).await }
        });
        let stored = read.await?.into_inner();
        if stored.status() != pb::RunStatus::Running || Instant::now() > deadline {
            return Ok(stored);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

type Client = pb::orchestrator_client::OrchestratorClient<tonic::transport::Channel>;

/// What is wrong with the run's event log as `AttachRun` replays it from the start: it must
/// number its events 1, 2, 3 … and end with `run_finished` whose status and text are the stored
/// result's, and its text deltas must add up to that text (once `turn_restarted` is applied).
async fn replay_mismatch(client: &Client, run_id: &str, stored: &pb::RunResult, follows: bool) -> Option<String> {
    use pb::orchestrate_event::Event as E;
    let events = retried(follows, || {
        let mut client = client.clone();
        let request = pb::AttachRunRequest {
            run_id: run_id.to_owned(),
            after_seq: 0,
        };
        async move {
            let mut stream = client.attach_run(request).await?.into_inner();
            let mut events = Vec::new();
            while let Some(event) = stream.message().await? {
                events.push(event);
            }
            Ok::<_, tonic::Status>(events)
        }
    });
    let events = match tokio::time::timeout(Duration::from_secs(30), events).await {
        Err(_) => return Some("no end within 30 s".into()),
        Ok(Err(status)) => return Some(status.to_string()),
        Ok(Ok(events)) => events,
    };
    if let Some((i, e)) = events.iter().enumerate().find(|(i, e)| e.seq != *i as u64 + 1) {
        return Some(format!("seq {} at position {i}", e.seq));
    }
    let text = told(&events);
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

/// The text `events` tell: the text deltas, without those of a turn's attempt that a
/// `turn_restarted` voided (the client crate's rule).
fn told(events: &[pb::OrchestrateEvent]) -> String {
    let mut transcript = orchestrator_client::Transcript::default();
    for event in events.iter().filter_map(|e| e.event.clone()) {
        transcript.apply(&orchestrator_client::Event::from_proto(event));
    }
    transcript.text().to_owned()
}

/// The caller's side of one run; the events it saw. A caller that `follows` its run attaches
/// to it again (from the last seq it saw) whenever its stream ends early or breaks, and checks
/// the events add up to one stream without gaps.
async fn play(
    client: &mut Client,
    run_id: &str,
    kind: Kind,
    follows: bool,
) -> anyhow::Result<Vec<pb::OrchestrateEvent>> {
    let mut stream = start(client, run_id, kind, follows).await?;
    // Read to the stream's end (its trailers), as a client should: dropping it at run_finished
    // makes the client's HTTP/2 library reset the stream, and after 1024 such resets h2 closes
    // the whole connection (GOAWAY "too_many_internal_resets").
    let mut events: Vec<pb::OrchestrateEvent> = Vec::new();
    let mut finished = false;
    let mut reattached = 0;
    loop {
        let event = match stream.message().await {
            Ok(Some(event)) => event,
            Ok(None) if finished || !follows => break,
            // The caller's own deadline passing ends its stream with an error, as it should.
            Err(_) if kind == Kind::CallerDeadline => return Ok(events),
            Err(status) if !follows || status.code() == tonic::Code::DataLoss => return Err(status.into()),
            ended => {
                reattached += 1;
                anyhow::ensure!(reattached <= MAX_REATTACHES, "gave up following the run: {ended:?}");
                stream = reattach(client, run_id, events.last().map_or(0, |e| e.seq)).await?;
                continue;
            }
        };
        let last = events.last().map_or(0, |e| e.seq);
        if event.seq <= last {
            continue; // sent again by the replica re-attached to
        }
        anyhow::ensure!(
            event.seq == last + 1,
            "a gap in the stream: seq {} after {last}",
            event.seq
        );
        reattached = 0;
        match event.event {
            Some(pb::orchestrate_event::Event::ToolCallStarted(_)) if kind == Kind::CallerGone => return Ok(events),
            Some(pb::orchestrate_event::Event::ToolCallStarted(_)) if kind == Kind::CancelRun => {
                client
                    .cancel_run(pb::CancelRunRequest {
                        run_id: run_id.into(),
                        ..Default::default()
                    })
                    .await?;
            }
            Some(pb::orchestrate_event::Event::RunFinished(_)) => finished = true,
            _ => {}
        }
        events.push(event);
    }
    anyhow::ensure!(
        finished || kind == Kind::CallerDeadline,
        "the stream ended without run_finished"
    );
    Ok(events)
}

/// How long a caller follows its run at most (moves included).
const PLAY_LIMIT: Duration = Duration::from_secs(180);

/// Re-attaches in a row a follower may make without a new event.
const MAX_REATTACHES: u32 = 50;

/// Starts the run; a caller that follows tries again while no replica takes it (a draining one
/// refuses it with UNAVAILABLE; one that just died drops the call).
async fn start(
    client: &mut Client,
    run_id: &str,
    kind: Kind,
    follows: bool,
) -> anyhow::Result<tonic::Streaming<pb::OrchestrateEvent>> {
    let mut attempt = 0;
    loop {
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
        match client.orchestrate(request).await {
            Ok(stream) => return Ok(stream.into_inner()),
            Err(status) if follows && broken(&status) && attempt < MAX_REATTACHES => {
                attempt += 1;
                tokio::time::sleep(backoff(attempt)).await;
            }
            // The first attempt started the run after all: follow it.
            Err(status) if follows && attempt > 0 && status.code() == tonic::Code::AlreadyExists => {
                return reattach(client, run_id, 0).await;
            }
            Err(status) => return Err(status.into()),
        }
    }
}

/// `AttachRun` from `after_seq` on whichever replica answers, retried with backoff for up to
/// a minute (a killed replica's runs move once their lease lapses).
async fn reattach(
    client: &mut Client,
    run_id: &str,
    after_seq: u64,
) -> anyhow::Result<tonic::Streaming<pb::OrchestrateEvent>> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut attempt = 0;
    loop {
        attempt += 1;
        tokio::time::sleep(backoff(attempt)).await;
        let request = pb::AttachRunRequest {
            run_id: run_id.to_owned(),
            after_seq,
        };
        match client.attach_run(request).await {
            Ok(stream) => return Ok(stream.into_inner()),
            Err(status) if Instant::now() > deadline => {
                anyhow::bail!("AttachRun after seq {after_seq} kept failing: {status}")
            }
            Err(_) => {}
        }
    }
}

/// A call that failed on its way: refused by a draining replica, or its connection lost
/// (`INTERNAL` is what a call reads as when its connection closes under it, e.g. the HTTP/2
/// GOAWAY of a replica that stops: the calls retried are reads, safe to send again).
fn broken(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled | tonic::Code::Internal
    )
}

/// `call`, tried again for up to 30 s while it fails on its way when callers follow runs
/// across replicas being replaced (a balanced channel may pick one that just died); once
/// otherwise.
async fn retried<T, F, Fut>(follows: bool, mut call: F) -> Result<T, tonic::Status>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, tonic::Status>>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut attempt = 0;
    loop {
        match call().await {
            Err(status) if follows && broken(&status) && Instant::now() < deadline => {
                attempt += 1;
                tokio::time::sleep(backoff(attempt)).await;
            }
            done => return done,
        }
    }
}

fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(50u64.saturating_mul(1 << attempt.min(5)))
}

/// Waits until no run or tool call is in flight on any orchestrator; the gauges as last read.
async fn settle(target: Target<'_>) -> anyhow::Result<(f64, f64)> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let addresses = target.metrics().await;
        anyhow::ensure!(!addresses.is_empty(), "the orchestrator serves no metrics");
        let mut now = (0.0, 0.0);
        for address in addresses {
            let body = reqwest::get(format!("http://{address}/metrics")).await?.text().await?;
            let gauge = |name: &str| {
                body.lines()
                    .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse::<f64>().ok()))
                    .unwrap_or(f64::NAN)
            };
            now.0 += gauge("orchestrator_runs_in_flight ");
            now.1 += gauge("orchestrator_tool_calls_in_flight ");
        }
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
         | replicas killed / drained / cut off from NATS / paused while the runs went on | {} / {} / {} / {} |\n\
         | RSS after warm-up → peak → after | {} |\n",
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
        report.replicas_killed,
        report.replicas_drained,
        report.replicas_cut_off,
        report.replicas_paused,
        match (report.rss_baseline_mib, report.rss_peak_mib, report.rss_after_mib) {
            (Some(baseline), Some(peak), Some(after)) => format!("{baseline:.1} → {peak:.1} → {after:.1} MiB"),
            _ => "not measured (the replicas are replaced)".to_owned(),
        },
    );
    for m in &report.mismatches {
        md.push_str(&format!("\n* {m}"));
    }
    std::fs::write(out.join("soak.md"), md)?;
    eprintln!("{}", std::fs::read_to_string(out.join("soak.md"))?);
    Ok(())
}
