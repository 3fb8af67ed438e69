//! Durable runs through the real binaries: orchestrator replicas sharing a real `nats-server -js`
//! (started here; `./scripts/test` installs it), a tool-runner with a command tool that logs the
//! call ids it runs, and the stand-in model with a scenario that streams text and calls a tool
//! every turn. Replicas are killed (SIGKILL) mid-stream and mid-tool-call, drained (SIGTERM) one
//! by one in a rolling deploy of 100 runs, drained while NATS restarts, cut off from NATS through a
//! proxy that holds their traffic, or paused (SIGSTOP) past their lease: every run still ends
//! COMPLETED, its stream (followed across replicas from the last seq seen) is gap-free and equal
//! to GetRun once `turn_restarted` is applied, its signal is in the signal stream once, no tool
//! call runs twice (the runner records it; a call sent again is answered from its record), no
//! call is sent by a replaced owner (the epochs the tool sees
//! never go down), and the in-flight gauges are back at 0.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use orchestrator_client::{Event, Transcript};
use proto::orchestrator::v1 as pb;
use testkit::nats::Nats;
use testkit::{Service, get_run, start_detached};

type TestResult = anyhow::Result<()>;

/// A command tool that appends `<run id>/<call id> <epoch>` to `log` and answers after `ms`.
fn manifest(dir: &std::path::Path, log: &std::path::Path, ms: u64) -> anyhow::Result<std::path::PathBuf> {
    let path = dir.join("tools.toml");
    let script = format!(
        "echo \"$TOOL_RUN_ID/$TOOL_CALL_ID $TOOL_RUN_EPOCH\" >> {}; sleep {}; printf '{{\"call\":\"%s\"}}' \"$TOOL_CALL_ID\"",
        log.display(),
        ms as f64 / 1000.0
    );
    let text = format!(
        "[[tool]]\nname = \"record\"\ndescription = \"records its call\"\nargv = [\"sh\", \"-c\", {script:?}]\ntimeout = \"1m\"\n"
    );
    std::fs::write(&path, text)?;
    Ok(path)
}

/// `turns` turns of `words` streamed 15 ms apart, each calling `record`, then a last turn that
/// submits its report (an exit tool: a signal) and ends.
fn scenario(turns: usize, words: &str) -> mock_llm::Scenario {
    use mock_llm::{Step, Turn};
    let mut all: Vec<Turn> = (0..turns)
        .map(|_| Turn::text(words).then(Step::call("record", serde_json::json!({}))))
        .collect();
    all.push(Turn::text("done").then(Step::call("submit_report", serde_json::json!({"ok": true}))));
    mock_llm::Scenario {
        token_delay_ms: 15,
        ..mock_llm::Scenario::new(all)
    }
}

/// How long the runners' fence reads may take (the replicas' `--run-fence-grace`, 500ms, is
/// longer, as each runner checks).
const FENCE_READ: Duration = Duration::from_millis(400);

/// A tool-runner in this process serving `manifest`'s tools, refusing a replaced owner's calls
/// by the fences it reads from the run store at `nats`; its URL.
async fn start_runner(manifest: &std::path::Path, nats: &str) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    // Room for a call of every run at once (the rolling deploy has 100).
    let mut config = testkit::stack::runner_config(Some(manifest.to_owned()));
    config.server.max_concurrency = 256;
    config.fence.run_store = Some(nats.to_owned());
    config.fence.timeout = FENCE_READ;
    tokio::spawn(tool_runner::serve(listener, config, std::future::pending()));
    Ok(url)
}

/// The NATS the fleet shares: one server, or a JetStream cluster.
enum Broker {
    Single(Box<Nats>),
    Cluster(testkit::nats::NatsCluster),
}

impl Broker {
    /// What replicas are given: the server's URL, or every node's (the seed list).
    fn url(&self) -> String {
        match self {
            Self::Single(nats) => nats.url(),
            Self::Cluster(cluster) => cluster.urls(),
        }
    }

    /// A client of it (every node given as a seed).
    async fn connect(&self) -> anyhow::Result<async_nats::Client> {
        Ok(match self {
            Self::Single(nats) => async_nats::connect(nats.url()).await?,
            Self::Cluster(cluster) => async_nats::connect(cluster.seeds()).await?,
        })
    }

    fn single(&mut self) -> anyhow::Result<&mut Nats> {
        match self {
            Self::Single(nats) => Ok(nats),
            Self::Cluster(_) => anyhow::bail!("the fleet runs on a NATS cluster"),
        }
    }
}

/// The fleet: NATS, the model, a tool-runner and orchestrator replica processes.
struct Fleet {
    nats: Broker,
    mock: mock_llm::MockLlm,
    runner_url: String,
    replicas: Vec<Option<Service>>,
    /// The gRPC addresses of the replicas serving now, as callers would find them.
    serving: Arc<Mutex<Vec<String>>>,
    /// `--hand-over-grace` of the replicas started from now on.
    hand_over_grace: &'static str,
    /// `--run-store-lease` of the replicas started from now on.
    lease: &'static str,
    /// More flags of the replicas started from now on.
    flags: Vec<String>,
    /// Every replica's log lines, retired ones included, to show a failed run's story.
    log_books: Vec<Arc<Mutex<Vec<String>>>>,
    calls_log: std::path::PathBuf,
    /// The command tools every runner of the fleet serves.
    manifest: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Fleet {
    async fn start(replicas: usize, scenario: mock_llm::Scenario, tool_ms: u64) -> anyhow::Result<Self> {
        Self::start_on(
            Broker::Single(Box::new(Nats::start().await?)),
            replicas,
            scenario,
            tool_ms,
        )
        .await
    }

    async fn start_on(
        nats: Broker,
        replicas: usize,
        scenario: mock_llm::Scenario,
        tool_ms: u64,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let calls_log = dir.path().join("calls.log");
        let manifest = manifest(dir.path(), &calls_log, tool_ms)?;
        let mock = mock_llm::MockLlm::start(scenario).await?;
        let runner_url = start_runner(&manifest, &nats.url()).await?;
        let mut fleet = Self {
            nats,
            mock,
            runner_url,
            replicas: Vec::new(),
            serving: Arc::default(),
            hand_over_grace: "5s",
            lease: "2s",
            flags: Vec::new(),
            log_books: Vec::new(),
            calls_log,
            manifest,
            _dir: dir,
        };
        for _ in 0..replicas {
            fleet.add().await?;
        }
        Ok(fleet)
    }

    /// Starts one more replica (by default a lease of 2 s, so a killed one's runs move soon).
    async fn add(&mut self) -> anyhow::Result<usize> {
        let nats = self.nats.url();
        self.add_on(&nats).await
    }

    /// Starts one more replica reaching NATS at `nats` (a proxy that can cut it off).
    async fn add_on(&mut self, nats: &str) -> anyhow::Result<usize> {
        let runner = self.runner_url.clone();
        self.add_with(nats, &runner).await
    }

    /// Starts another tool-runner like the first (same tools, same call log, the same run
    /// store to read fences from); its URL.
    async fn start_runner(&self) -> anyhow::Result<String> {
        start_runner(&self.manifest, &self.nats.url()).await
    }

    /// Starts one more replica reaching NATS at `nats` and sending its calls to `runner`.
    async fn add_with(&mut self, nats: &str, runner: &str) -> anyhow::Result<usize> {
        let orchestrator = env!("CARGO_BIN_EXE_orchestrator");
        let mut command = testkit::on_nats(
            testkit::orchestrator_command(orchestrator, &self.mock.base_url(), runner),
            nats,
        );
        // A takeover's calls wait the fence grace: short here, with the runners' fence reads
        // bounded shorter (FENCE_READ), as the rule between the two settings wants.
        command
            .args([
                "--run-store-lease",
                self.lease,
                "--hand-over-grace",
                self.hand_over_grace,
            ])
            .args(["--run-fence-grace", "500ms"])
            .args(&self.flags);
        let replica = Service::orchestrator(command).await?;
        lock(&self.serving).push(format!("http://{}", replica.grpc));
        self.log_books.push(replica.log_book());
        self.replicas.push(Some(replica));
        Ok(self.replicas.len() - 1)
    }

    /// The last lines of every replica (retired ones included) that name `run_id`, each with its
    /// replica's number: what a failed assertion on the run shows.
    fn story_of(&self, run_id: &str) -> String {
        const LAST: usize = 80;
        // As a JSON string: `rolling-1` is not `rolling-10`.
        let quoted = format!("\"{run_id}\"");
        let lines: Vec<String> = self
            .log_books
            .iter()
            .enumerate()
            .flat_map(|(i, book)| {
                let book = lock(book).clone();
                book.into_iter()
                    .filter(|l| l.contains(&quoted))
                    .map(move |l| format!("[replica {i}] {l}"))
            })
            .collect();
        lines[lines.len().saturating_sub(LAST)..].join("\n")
    }

    /// Takes replica `i` out of the fleet: callers no longer find it.
    fn retire(&mut self, i: usize) -> anyhow::Result<Service> {
        let replica = self.replicas[i]
            .take()
            .ok_or_else(|| anyhow::anyhow!("replica {i} is gone"))?;
        let url = format!("http://{}", replica.grpc);
        lock(&self.serving).retain(|u| *u != url);
        Ok(replica)
    }

    /// Kills replica `i` (SIGKILL).
    async fn kill(&mut self, i: usize) -> TestResult {
        self.retire(i)?.kill().await
    }

    /// Sends replica `i` SIGTERM; [`drained`] waits for its exit.
    fn begin_drain(&mut self, i: usize) -> anyhow::Result<Service> {
        let replica = self.retire(i)?;
        replica.signal(nix::sys::signal::Signal::SIGTERM)?;
        Ok(replica)
    }

    /// Drains replica `i` (SIGTERM) and waits until it exited 0; returns it, for its logs.
    async fn drain(&mut self, i: usize) -> anyhow::Result<Service> {
        drained(self.begin_drain(i)?).await
    }

    /// The series of metric `name` of every replica serving now, summed.
    async fn summed(&self, name: &str) -> anyhow::Result<f64> {
        let mut total = 0.0;
        for replica in self.replicas.iter().flatten() {
            let metrics = testkit::scrape(&replica.metrics).await?;
            total += metrics
                .iter()
                .filter(|(series, _)| *series == name || series.starts_with(&format!("{name}{{")))
                .map(|(_, v)| v)
                .sum::<f64>();
        }
        Ok(total)
    }

    /// The in-flight gauges of every replica serving now, summed: (runs, tool calls).
    async fn in_flight(&self) -> anyhow::Result<(f64, f64)> {
        let (mut runs, mut calls) = (0.0, 0.0);
        for replica in self.replicas.iter().flatten() {
            let metrics = testkit::scrape(&replica.metrics).await?;
            let sum = |name: &str| -> f64 {
                metrics
                    .iter()
                    .filter(|(series, _)| series.starts_with(&format!("{name}{{")))
                    .map(|(_, v)| v)
                    .sum()
            };
            runs += sum("orchestrator_runs_in_flight");
            calls += sum("orchestrator_tool_calls_in_flight");
        }
        Ok((runs, calls))
    }

    /// How many times the signal stream holds each run's signal (asked again for a while: a
    /// cluster that lost a node answers once it elected new leaders).
    async fn signals_per_run(&self) -> anyhow::Result<HashMap<String, usize>> {
        let (limit, pace) = (Duration::from_secs(60), Duration::from_millis(500));
        testkit::wait::until_paced("the signal stream to answer", limit, pace, || async {
            self.count_signals()
                .await
                .inspect_err(|e| eprintln!("reading the signal stream: {e:#}; asking again"))
                .ok()
        })
        .await
    }

    async fn count_signals(&self) -> anyhow::Result<HashMap<String, usize>> {
        use futures::StreamExt;
        let client = self.nats.connect().await?;
        let js = async_nats::jetstream::new(client);
        let consumer = js
            .get_stream("SIGNALS")
            .await?
            .create_consumer(async_nats::jetstream::consumer::pull::Config {
                deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::All,
                // A reader's own consumer needs no replicas: one node that holds the stream can
                // serve it while a cluster that lost a node places replicated ones again.
                num_replicas: 1,
                memory_storage: true,
                ..Default::default()
            })
            .await?;
        let mut messages = consumer
            .fetch()
            .max_messages(10_000)
            .expires(Duration::from_secs(1))
            .messages()
            .await?;
        let mut counts = HashMap::new();
        while let Some(message) = messages.next().await {
            let message = message.map_err(|e| anyhow::anyhow!("{e}"))?;
            let run = message
                .headers
                .as_ref()
                .and_then(|h| h.get("Orchestrator-Run-Id"))
                .map(|v| v.as_str().to_owned())
                .unwrap_or_default();
            *counts.entry(run).or_insert(0) += 1;
        }
        Ok(counts)
    }

    fn url(&self, i: usize) -> Option<String> {
        self.replicas[i].as_ref().map(|s| format!("http://{}", s.grpc))
    }

    fn urls(&self) -> Vec<String> {
        lock(&self.serving).clone()
    }

    /// What callers call to find the replicas serving now.
    fn directory(&self) -> impl Fn() -> Vec<String> + Send + 'static {
        let serving = Arc::clone(&self.serving);
        move || lock(&serving).clone()
    }

    /// The replica that runs `run_id` now: the last one that logged taking it over, or else
    /// the one it started on.
    fn owner(&self, run_id: &str, started_on: usize) -> usize {
        let took = |s: &Service| {
            s.logs()
                .iter()
                .any(|l| l.contains("took the run over") && l.contains(run_id))
        };
        (0..self.replicas.len())
            .rev()
            .find(|&i| self.replicas[i].as_ref().is_some_and(took))
            .unwrap_or(started_on)
    }

    /// `<run id>/<call id>` of the calls the tool ran, with how many times.
    fn calls(&self) -> HashMap<String, usize> {
        let mut counts = HashMap::new();
        for line in std::fs::read_to_string(&self.calls_log).unwrap_or_default().lines() {
            let id = line.split(' ').next().unwrap_or_default();
            *counts.entry(id.to_owned()).or_insert(0) += 1;
        }
        counts
    }

    /// The epochs of each run's calls, in the order the tool ran them. Each claim of a run has
    /// an epoch of its own, so a smaller epoch after a larger one is a call sent by a replica
    /// after another replica had taken the run and run its own calls: two owners acting.
    fn epochs(&self) -> HashMap<String, Vec<u64>> {
        let mut epochs: HashMap<String, Vec<u64>> = HashMap::new();
        for line in std::fs::read_to_string(&self.calls_log).unwrap_or_default().lines() {
            let (id, epoch) = line.split_once(' ').unwrap_or((line, ""));
            let run = id.rsplit_once('/').map_or(id, |(run, _)| run);
            epochs
                .entry(run.to_owned())
                .or_default()
                .push(epoch.parse().unwrap_or(0));
        }
        epochs
    }

    /// No call of a run was sent by a replica after another replica had run a call of it: the
    /// epochs of each run's calls never go down, and every call carries one.
    fn one_owner_at_a_time(&self) -> TestResult {
        for (run, epochs) in self.epochs() {
            anyhow::ensure!(
                epochs.iter().all(|&e| e > 0),
                "{run}: a call without an epoch: {epochs:?}"
            );
            anyhow::ensure!(
                epochs.windows(2).all(|w| w[0] <= w[1]),
                "{run}: a replaced owner ran a call after the new one did (epochs in the order run: {epochs:?})\n{}",
                self.story_of(run.as_str())
            );
        }
        Ok(())
    }
}

impl Fleet {
    /// The runner refuses a call sent now in any epoch older than the last one a run's calls ran
    /// in (as a replaced owner's call would be, arriving late): `FAILED_PRECONDITION` naming the
    /// run's epoch, and the tool does not run. Returns how many runs were tried (those that moved).
    async fn stale_calls_are_refused(&self) -> anyhow::Result<usize> {
        let channel = tonic::transport::Channel::from_shared(self.runner_url.clone())?
            .connect()
            .await?;
        let mut runner = proto::toolrunner::v1::tool_runner_client::ToolRunnerClient::new(channel);
        let before = self.calls().len();
        let mut tried = 0;
        for (run, epochs) in self.epochs() {
            let newest = epochs.iter().copied().max().unwrap_or(0);
            if newest < 2 {
                continue;
            }
            tried += 1;
            let request = proto::toolrunner::v1::RunToolRequest {
                run_id: run.clone(),
                call_id: "late".to_owned(),
                tool_name: "record".to_owned(),
                arguments_json: "{}".to_owned(),
                epoch: newest - 1,
                ..Default::default()
            };
            let refused = match runner.run_tool(request).await {
                Ok(_) => anyhow::bail!("{run}: a call of epoch {} ran after epoch {newest}", newest - 1),
                Err(status) => status,
            };
            anyhow::ensure!(
                refused.code() == tonic::Code::FailedPrecondition
                    && refused.metadata().get("x-run-epoch-current").is_some(),
                "{run}: {refused:?}"
            );
        }
        anyhow::ensure!(self.calls().len() == before, "a refused call ran");
        Ok(tried)
    }
}

/// Waits until a replica sent SIGTERM exited, which must be with 0; returns it, for its logs.
async fn drained(mut replica: Service) -> anyhow::Result<Service> {
    let code = replica.wait_exit().await?;
    anyhow::ensure!(code == Some(0), "a drained replica exited {code:?}");
    Ok(replica)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A caller following a run across replicas: it attaches from the last seq it saw to whichever
/// replica answers, until `run_finished`.
struct Follower {
    events: Vec<pb::OrchestrateEvent>,
}

impl Follower {
    async fn follow(
        run_id: String,
        urls: impl Fn() -> Vec<String>,
        mut events: Vec<pb::OrchestrateEvent>,
        seen: tokio::sync::watch::Sender<Vec<pb::OrchestrateEvent>>,
    ) -> anyhow::Result<Self> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        while tokio::time::Instant::now() < deadline {
            for url in urls() {
                let after_seq = events.last().map_or(0, |e| e.seq);
                let Ok(mut client) = pb::orchestrator_client::OrchestratorClient::connect(url).await else {
                    continue;
                };
                let request = pb::AttachRunRequest {
                    run_id: run_id.clone(),
                    after_seq,
                };
                let Ok(stream) = client.attach_run(request).await else {
                    continue;
                };
                let mut stream = stream.into_inner();
                loop {
                    let Ok(Some(event)) = stream.message().await else { break };
                    anyhow::ensure!(
                        event.seq == events.last().map_or(0, |e| e.seq) + 1,
                        "gap or duplicate: {} after {:?}",
                        event.seq,
                        events.last().map(|e| e.seq)
                    );
                    let last = matches!(event.event, Some(pb::orchestrate_event::Event::RunFinished(_)));
                    events.push(event);
                    seen.send_replace(events.clone());
                    if last {
                        return Ok(Self { events });
                    }
                }
            }
            // Stays: the pause before re-attaching (the run is moving), not a wait.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::bail!("run {run_id} did not finish; {} events seen", events.len())
    }

    /// The result in `run_finished`, and the text the stream tells once restarted turns are
    /// dropped (the client crate's rule).
    fn outcome(&self) -> anyhow::Result<(pb::RunResult, String)> {
        let mut transcript = Transcript::default();
        let mut result = None;
        for event in &self.events {
            let typed = event
                .event
                .clone()
                .map(orchestrator_client::Event::from_proto)
                .ok_or_else(|| anyhow::anyhow!("an empty event"))?;
            transcript.apply(&typed);
            if let Event::Finished(r) = typed {
                result = Some(r);
            }
        }
        Ok((
            *result.ok_or_else(|| anyhow::anyhow!("no run_finished"))?,
            transcript.text().to_owned(),
        ))
    }
}

/// A result with its signals' delivery left out: NATS confirms a signal after `run_finished` may
/// have left, and GetRun shows the confirmation.
fn settled(mut result: pb::RunResult) -> pb::RunResult {
    for signal in &mut result.signals {
        signal.delivery = 0;
    }
    result
}

/// Waits until `seen` has an event that `pick` matches.
async fn until(
    seen: &mut tokio::sync::watch::Receiver<Vec<pb::OrchestrateEvent>>,
    what: &str,
    pick: impl Fn(&[pb::OrchestrateEvent]) -> bool,
) -> anyhow::Result<Vec<pb::OrchestrateEvent>> {
    let found = tokio::time::timeout(Duration::from_secs(60), seen.wait_for(|events| pick(events))).await;
    match found {
        Ok(Ok(events)) => Ok(events.clone()),
        _ => anyhow::bail!("never saw {what}"),
    }
}

fn streaming_turn(events: &[pb::OrchestrateEvent], turn: u32) -> bool {
    use pb::orchestrate_event::Event as E;
    let text = events
        .iter()
        .filter(|e| matches!(&e.event, Some(E::TextDelta(t)) if t.turn == turn))
        .count();
    let called = events
        .iter()
        .any(|e| matches!(&e.event, Some(E::ToolCallStarted(c)) if c.turn == turn));
    text >= 3 && !called
}

/// Call ids started and not finished in `events`.
fn in_flight(events: &[pb::OrchestrateEvent]) -> Vec<String> {
    use pb::orchestrate_event::Event as E;
    let finished: Vec<&str> = events
        .iter()
        .filter_map(|e| match &e.event {
            Some(E::ToolCallFinished(f)) => Some(f.call_id.as_str()),
            _ => None,
        })
        .collect();
    events
        .iter()
        .filter_map(|e| match &e.event {
            Some(E::ToolCallStarted(c)) if !finished.contains(&c.call_id.as_str()) => Some(c.call_id.clone()),
            _ => None,
        })
        .collect()
}

/// Three replicas. The replica running a run is SIGKILLed while the model streams turn 2; the run
/// is taken over (turn 2 restarts, announced by `turn_restarted`). Then the replica running it now
/// is SIGKILLed while turn 3's tool call runs; the run is taken over again and the call in flight
/// is sent again with the same call id. The run ends COMPLETED with one signal; the caller's
/// stream is gap-free and tells GetRun's text; every call ran once (the one in flight at the kill
/// runs to its end on its runner, and the new owner's call is answered from its record).
#[tokio::test]
async fn a_run_survives_its_replica_killed_mid_stream_and_then_mid_tool_call() -> TestResult {
    let words: String = (0..40).map(|i| format!("w{i} ")).collect();
    let mut fleet = Fleet::start(3, scenario(4, &words), 3000).await?;
    let (_, mut seen, follower) = fleet.start_followed_elsewhere("durable-1").await?;

    until(&mut seen, "turn 2 streaming", |e| streaming_turn(e, 2)).await?;
    fleet.kill(0).await?;
    until(&mut seen, "turn_restarted", |events| {
        events
            .iter()
            .any(|e| matches!(e.event, Some(pb::orchestrate_event::Event::TurnRestarted(_))))
    })
    .await?;

    let events = until(&mut seen, "turn 3's call in flight", |e| {
        in_flight(e).len() == 1
            && e.iter()
                .any(|e| matches!(&e.event, Some(pb::orchestrate_event::Event::ToolCallStarted(c)) if c.turn == 3))
    })
    .await?;
    let in_flight_at_kill = in_flight(&events);
    let owner = fleet.owner("durable-1", 0);
    anyhow::ensure!(owner != 0, "a surviving replica took the run over");
    fleet.kill(owner).await?;
    // A replacement comes up, as Kubernetes would start one; the follower reaches it too.
    fleet.add().await?;

    let follower = follower.await??;
    let (result, told) = follower.outcome()?;
    assert_eq!(result.status(), pb::RunStatus::Completed, "{}", result.failure_detail);
    assert_eq!(told, result.text, "the stream tells the result's text");
    assert_eq!(result.text, format!("{words}{words}{words}{words}done"));
    assert_eq!(result.signals.len(), 1, "the signal is published once");
    let survivor = fleet
        .urls()
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("no replica left"))?;
    assert_eq!(settled(get_run(&survivor, "durable-1").await?), settled(result.clone()));

    let calls = fleet.calls();
    let ids: Vec<&str> = result.tool_calls.iter().map(|c| c.call_id.as_str()).collect();
    assert_eq!(ids.len(), 4, "{ids:?}");
    for id in &ids {
        let runs = calls.get(&format!("durable-1/{id}")).copied().unwrap_or(0);
        assert_eq!(
            runs, 1,
            "call {id} ran {runs} time(s) (in flight at the kill: {in_flight_at_kill:?})"
        );
    }
    Ok(())
}

/// Two replicas. A caller asks a run to end after its turn while the model streams the run's
/// second turn, and the run's replica is SIGKILLed before the turn ends: the replica that takes
/// the run over ends it `CANCELED` in the turn it resumes in, the model never asked for the turns
/// the scenario still had. (Here a checkpoint saved after the ask carries it too; the record
/// carries it when no checkpoint does — the simulation's seeds of
/// `a_cancel_after_the_turn_is_kept_when_the_run_moves`.)
#[tokio::test]
async fn a_cancel_after_the_turn_outlives_its_replica_killed_mid_turn() -> TestResult {
    let words: String = (0..60).map(|i| format!("w{i} ")).collect();
    let mut fleet = Fleet::start(2, scenario(4, &words), 200).await?;
    let (_, mut seen, follower) = fleet.start_followed_elsewhere("after-turn-1").await?;
    until(&mut seen, "turn 2 streaming", |e| streaming_turn(e, 2)).await?;
    let first = fleet.url(0).ok_or_else(|| anyhow::anyhow!("no replica"))?;
    let mut client = pb::orchestrator_client::OrchestratorClient::connect(first).await?;
    let answer = client
        .cancel_run(pb::CancelRunRequest {
            run_id: "after-turn-1".into(),
            mode: pb::CancelMode::AfterTurn as i32,
        })
        .await?
        .into_inner();
    anyhow::ensure!(answer.canceled, "the run was told to end after its turn: {answer:?}");
    fleet.kill(0).await?;
    let (result, _) = follower.await??.outcome()?;
    assert_eq!(result.status(), pb::RunStatus::Canceled, "{}", result.failure_detail);
    assert!(
        result.turns <= 2,
        "the run went on for {} turns after it was asked to end",
        result.turns
    );
    assert_eq!(fleet.owner("after-turn-1", 0), 1, "the other replica took the run over");
    Ok(())
}

/// Three replicas. A turn's first call starts while the model still writes the turn's second
/// (eager dispatch: its checkpoint is saved first); the replica running the run is SIGKILLed
/// while the model writes. The run is taken over from that checkpoint and the turn goes on with
/// the call it had started (sent again with the same call id): the second call, never complete,
/// never runs. The run ends COMPLETED; the caller's stream tells GetRun's text.
#[tokio::test]
async fn a_call_started_early_survives_its_replica_killed_while_the_model_writes() -> TestResult {
    use mock_llm::{Step, Turn};
    let second = Step::ToolCall {
        name: "record".into(),
        arguments: serde_json::json!({"pad": "x".repeat(400)}),
        id: None,
        fragments: Some(200),
    };
    let scenario = mock_llm::Scenario {
        token_delay_ms: 15,
        ..mock_llm::Scenario::new(vec![
            Turn::text("Two records. ")
                .then(Step::call("record", serde_json::json!({})))
                .then(second),
            Turn::text("done").then(Step::call("submit_report", serde_json::json!({"ok": true}))),
        ])
    };
    let mut fleet = Fleet::start(3, scenario, 300).await?;
    let (_, mut seen, follower) = fleet.start_followed_elsewhere("early-1").await?;
    let started = until(&mut seen, "the first call started while the model writes", |events| {
        events
            .iter()
            .any(|e| matches!(&e.event, Some(pb::orchestrate_event::Event::ToolCallStarted(c)) if c.turn == 1))
    })
    .await?;
    let early = in_flight(&started).into_iter().next().unwrap_or_default();
    fleet.kill(0).await?;

    let follower = follower.await??;
    let (result, told) = follower.outcome()?;
    assert_eq!(
        result.status(),
        pb::RunStatus::Completed,
        "{}\n{}",
        result.failure_detail,
        fleet.story_of("early-1")
    );
    assert_eq!(told, result.text, "the stream tells the result's text");
    let turn1: Vec<&str> = result
        .tool_calls
        .iter()
        .filter(|c| c.turn == 1)
        .map(|c| c.call_id.as_str())
        .collect();
    assert_eq!(turn1, [early.as_str()], "the turn goes on with the call it had started");
    let calls = fleet.calls();
    let runs = calls.get(&format!("early-1/{early}")).copied().unwrap_or(0);
    assert!(
        (1..=2).contains(&runs),
        "the started call ran {runs} time(s): {calls:?}"
    );
    assert_eq!(calls.len(), 1, "no other call ran: {calls:?}");
    assert_eq!(result.signals.len(), 1);
    Ok(())
}

/// A drained replica (SIGTERM) hands its runs over at their next safe point instead of canceling
/// them: its callers' streams end UNAVAILABLE naming the run and the last seq, it exits 0 at once,
/// and another replica resumes each run well before a lease (15 s) could lapse. Every run ends
/// COMPLETED with a gap-free stream, and no call ran twice.
#[tokio::test]
async fn a_drained_replica_hands_its_runs_over_and_they_complete_elsewhere() -> TestResult {
    let words: String = (0..20).map(|i| format!("w{i} ")).collect();
    let mut fleet = Fleet::start(2, scenario(3, &words), 300).await?;
    let a = fleet.url(0).ok_or_else(|| anyhow::anyhow!("no replica"))?;
    let mut client = pb::orchestrator_client::OrchestratorClient::connect(a.clone()).await?;
    let mut streams = Vec::new();
    for i in 0..5 {
        let request = pb::OrchestrateRequest {
            run_id: format!("drained-{i}"),
            ..testkit::user("go")
        };
        streams.push(client.orchestrate(request).await?.into_inner());
    }
    let mut seen: Vec<Vec<pb::OrchestrateEvent>> = vec![Vec::new(); streams.len()];
    for (stream, seen) in streams.iter_mut().zip(&mut seen) {
        while seen.len() < 3 {
            match stream.message().await? {
                Some(event) => seen.push(event),
                None => anyhow::bail!("a run ended early"),
            }
        }
    }
    let drained_at = tokio::time::Instant::now();
    let replica = fleet.replicas[0].as_ref().ok_or_else(|| anyhow::anyhow!("gone"))?;
    replica.signal(nix::sys::signal::Signal::SIGTERM)?;
    for (i, (stream, seen)) in streams.iter_mut().zip(&mut seen).enumerate() {
        let ended = loop {
            match tokio::time::timeout(Duration::from_secs(20), stream.message()).await? {
                Ok(Some(event)) => seen.push(event),
                Ok(None) => anyhow::bail!("run {i}: the stream ended without a status"),
                Err(status) => break status,
            }
        };
        assert_eq!(ended.code(), tonic::Code::Unavailable, "{ended:?}");
        let last = seen.last().map_or(0, |e| e.seq);
        let expected = format!("attach to it again after seq {last}");
        assert!(ended.message().contains(&expected), "{ended:?}");
    }
    let mut a = fleet.replicas[0].take().ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(a.wait_exit().await?, Some(0), "the drained replica exits 0");
    let b = fleet.url(1).ok_or_else(|| anyhow::anyhow!("no replica"))?;
    for (i, seen) in seen.into_iter().enumerate() {
        let run_id = format!("drained-{i}");
        let (tx, _) = tokio::sync::watch::channel(Vec::new());
        let urls = vec![b.clone()];
        let after = seen.last().map_or(0, |e| e.seq);
        let rest = Follower::follow(run_id.clone(), move || urls.clone(), seen, tx).await?;
        anyhow::ensure!(rest.events.iter().any(|e| e.seq == after + 1));
        let (result, told) = rest.outcome()?;
        assert_eq!(
            result.status(),
            pb::RunStatus::Completed,
            "{run_id}: {}\n{}",
            result.failure_detail,
            fleet.story_of(&run_id)
        );
        assert_eq!(told, result.text);
        assert_eq!(result.text, format!("{words}{words}{words}done"));
        assert_eq!(settled(get_run(&b, &run_id).await?), settled(result));
    }
    assert!(
        drained_at.elapsed() < Duration::from_secs(60),
        "every run moved and ended without waiting for leases"
    );
    let calls = fleet.calls();
    assert_eq!(calls.len(), 5 * 3, "{calls:?}");
    for (id, runs) in calls {
        assert_eq!(
            runs, 1,
            "call {id} ran {runs} times: a handed-over run resumes from its safe point"
        );
    }
    Ok(())
}

/// `orchestrator call` follows its run when the replica it reached drains: behind an address
/// whose endpoints change as a Kubernetes Service's do, the command re-attaches by itself,
/// says so once, prints the rest of the run without a gap or a repeat, and exits 0 when the run
/// completes elsewhere.
#[tokio::test]
async fn the_command_line_follows_its_run_to_another_replica_at_a_drain() -> TestResult {
    let words: String = (0..20).map(|i| format!("w{i} ")).collect();
    let mut fleet = Fleet::start(2, scenario(3, &words), 300).await?;
    let address = |i: usize| -> anyhow::Result<std::net::SocketAddr> {
        let replica = fleet.replicas[i].as_ref().ok_or_else(|| anyhow::anyhow!("gone"))?;
        Ok(replica.grpc.parse()?)
    };
    let service = testkit::proxy::CutProxy::start(address(0)?).await?;
    let endpoint = format!("http://{}", service.addr());
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_orchestrator"));
    command.env("ORCHESTRATOR_METRICS_LISTEN", "off");
    let args = [
        "call",
        "--endpoint",
        &endpoint,
        "--prompt",
        "go",
        "--run-id",
        "cli-drained",
    ];
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let caller = tokio::spawn(async move {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        testkit::run_to_end(command, &args, &[]).await
    });
    let first_call = || fleet.calls().keys().any(|id| id.contains("cli-drained")).then_some(());
    testkit::wait::until_sync("the run's first call", Duration::from_secs(20), first_call).await?;
    service.redirect(address(1)?);
    drained(fleet.begin_drain(0)?).await?;
    let (code, printed, told) = caller.await??;
    let moved: Vec<&str> = printed.lines().filter(|l| l.starts_with('↪')).collect();
    assert_eq!(moved.len(), 1, "{printed}\n{told}");
    assert!(
        moved[0].contains("run cli-drained moved to another replica"),
        "{printed}"
    );
    assert!(printed.contains("■ COMPLETED"), "{printed}\n{told}");
    assert_eq!(code, Some(0), "{printed}\n{told}");
    assert_eq!(printed.matches("done").count(), 1, "the end printed once: {printed}");
    let b = fleet.url(1).ok_or_else(|| anyhow::anyhow!("no replica"))?;
    let result = get_run(&b, "cli-drained").await?;
    assert_eq!(result.status(), pb::RunStatus::Completed);
    for (id, runs) in fleet.calls() {
        assert_eq!(runs, 1, "call {id} ran {runs} times");
    }
    Ok(())
}

/// A run's id, the events its caller saw so far, and the caller's task.
type Following = (
    String,
    tokio::sync::watch::Receiver<Vec<pb::OrchestrateEvent>>,
    tokio::task::JoinHandle<anyhow::Result<Follower>>,
);

impl Fleet {
    /// Starts `run_id` detached on replica 0 and follows it from its start on the other replicas
    /// serving now (replica 0 is the one a test takes down).
    async fn start_followed_elsewhere(&self, run_id: &str) -> anyhow::Result<Following> {
        let first = self.url(0).ok_or_else(|| anyhow::anyhow!("no replica"))?;
        start_detached(&first, run_id).await?;
        let (seen_tx, seen) = tokio::sync::watch::channel(Vec::new());
        let urls: Vec<String> = self.urls()[1..].to_vec();
        let follower = tokio::spawn(Follower::follow(
            run_id.into(),
            move || urls.clone(),
            Vec::new(),
            seen_tx,
        ));
        Ok((run_id.to_owned(), seen, follower))
    }
}

/// Follows each of `runs` from its start across the replicas serving (a task per caller).
fn follow_all(fleet: &Fleet, runs: &[String]) -> Vec<Following> {
    runs.iter()
        .map(|run_id| {
            let (tx, seen) = tokio::sync::watch::channel(Vec::new());
            let task = tokio::spawn(Follower::follow(run_id.clone(), fleet.directory(), Vec::new(), tx));
            (run_id.clone(), seen, task)
        })
        .collect()
}

fn finished(events: &[pb::OrchestrateEvent]) -> bool {
    events
        .iter()
        .any(|e| matches!(e.event, Some(pb::orchestrate_event::Event::RunFinished(_))))
}

/// What every fault test ends with: every run COMPLETED with its text, its caller's stream
/// gap-free (checked as it is read) and telling the same text as GetRun, its signal in the
/// stream once, each of its calls run once (the runners record durable calls: one sent again
/// after its run moved is answered from its record), and the in-flight gauges of the replicas
/// serving back at 0.
async fn all_completed(fleet: &Fleet, followers: Vec<Following>, text: &str) -> TestResult {
    let count = followers.len();
    let survivor = fleet
        .urls()
        .first()
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no replica"))?;
    let mut results = Vec::new();
    for (run_id, _, task) in followers {
        results.push((run_id, task.await??.outcome()?));
    }
    let calls = fleet.calls();
    let mut call_ids = 0;
    for (run_id, (result, told)) in results {
        assert_eq!(
            result.status(),
            pb::RunStatus::Completed,
            "{run_id}: {}\n{}",
            result.failure_detail,
            fleet.story_of(&run_id)
        );
        assert_eq!(result.text, text, "{run_id}");
        assert_eq!(told, result.text, "{run_id}: the stream tells the result's text");
        assert_eq!(settled(get_run(&survivor, &run_id).await?), settled(result.clone()));
        for call in &result.tool_calls {
            let ran = calls.get(&format!("{run_id}/{}", call.call_id)).copied().unwrap_or(0);
            assert_eq!(
                ran,
                1,
                "{run_id}: call {} ran {ran} time(s)\n{}",
                call.call_id,
                fleet.story_of(&run_id)
            );
            assert!(call.ok, "{run_id}: {call:?}");
            call_ids += 1;
        }
    }
    assert_eq!(calls.len(), call_ids, "no call outside the results ran");
    let signals = fleet.signals_per_run().await?;
    assert_eq!(signals.len(), count, "{signals:?}");
    assert!(
        signals.values().all(|&n| n == 1),
        "every signal is published once: {signals:?}"
    );
    let gauges = testkit::wait::until("the in-flight gauges at 0", Duration::from_secs(10), || async {
        matches!(fleet.in_flight().await, Ok((runs, calls)) if runs == 0.0 && calls == 0.0).then_some(())
    })
    .await;
    match gauges {
        Ok(()) => Ok(()),
        Err(_) => anyhow::bail!("in-flight gauges not back to 0: {:?}", fleet.in_flight().await?),
    }
}

/// A rolling deploy: 100 runs in flight on three replicas, and each replica in turn drained
/// (SIGTERM, exit 0) and replaced by a new one while every run is still going. Runs move at
/// their next safe point each time their replica drains (some more than once); every caller
/// follows its run from replica to replica. Every run ends COMPLETED, every call ran exactly once.
#[tokio::test]
async fn a_rolling_deploy_of_every_replica_moves_100_runs_and_loses_nothing() -> TestResult {
    // Few tokens and long tool calls: 100 runs of debug builds on two cores stay in flight
    // through the whole deploy without saturating the machine. Each drain waits for its runs'
    // calls in flight and each new replica for its start, several seconds on a loaded machine:
    // 14 turns of a 1.5 s call (and the last: 15, within the default 16) keep every run going
    // past the third drain (8 turns did not, in one of ten runs with a core burnt).
    let words = "w0 w1 w2 ";
    let turns = 14;
    let mut fleet = Fleet::start(0, scenario(turns, words), 1500).await?;
    fleet.hand_over_grace = "10s";
    // Drains move runs at their safe points, without waiting for a lease; a lease of 2 s can
    // lapse on a loaded CI machine (renewed every third of it), and another replica then takes
    // over a run whose call is still running, which is the lost-replica case this test is not
    // about (the call is then answered from its runner's record).
    fleet.lease = "6s";
    for _ in 0..3 {
        fleet.add().await?;
    }
    let runs: Vec<String> = (0..100).map(|i| format!("rolling-{i}")).collect();
    let urls = fleet.urls();
    for (i, run_id) in runs.iter().enumerate() {
        start_detached(&urls[i % urls.len()], run_id).await?;
    }
    let followers = follow_all(&fleet, &runs);
    let mut moved = 0;
    let mut events_before = vec![0; followers.len()];
    for replica in 0..3 {
        // Each run goes on (an event it had not when the last replica went) before the next goes.
        for ((run_id, seen, _), before) in followers.iter().zip(&mut events_before) {
            let at_least = *before;
            *before = until(&mut seen.clone(), &format!("{run_id} to go on"), |e| e.len() > at_least)
                .await?
                .len();
        }
        let done = followers.iter().filter(|(_, seen, _)| finished(&seen.borrow())).count();
        if let Some((run_id, seen, _)) = followers.iter().find(|(_, seen, _)| finished(&seen.borrow())) {
            anyhow::bail!(
                "{done} runs ended before replica {replica} was drained: {run_id} {:?}",
                seen.borrow().last()
            );
        }
        let drained = fleet.drain(replica).await?;
        moved += drained
            .logs()
            .iter()
            .filter(|l| l.contains("the run moved to another replica"))
            .count();
        fleet.add().await?;
    }
    assert!(moved >= runs.len(), "each run moved at least once ({moved} moves)");
    let text = format!("{}done", words.repeat(turns));
    all_completed(&fleet, followers, &text).await
}

/// NATS restarted while a drained replica hands its 20 runs over (most are in a tool call when
/// SIGTERM comes, so they reach their safe point while NATS is down).
async fn hand_over_across_a_nats_restart(outage: Duration) -> TestResult {
    let words = "w0 w1 w2 ";
    let turns = 4;
    let mut fleet = Fleet::start(2, scenario(turns, words), 1000).await?;
    let runs: Vec<String> = (0..20).map(|i| format!("nats-restart-{i}")).collect();
    let a = fleet.url(0).ok_or_else(|| anyhow::anyhow!("no replica"))?;
    for run_id in &runs {
        start_detached(&a, run_id).await?;
    }
    let followers = follow_all(&fleet, &runs);
    for (run_id, seen, _) in &followers {
        until(&mut seen.clone(), &format!("{run_id}'s first call"), |e| {
            !in_flight(e).is_empty()
        })
        .await?;
    }
    let draining = fleet.begin_drain(0)?;
    fleet.nats.single()?.stop().await?;
    // Stays: the outage's length is the fault under test.
    tokio::time::sleep(outage).await;
    fleet.nats.single()?.restart().await?;
    drained(draining).await?;
    fleet.add().await?;
    let text = format!("{}done", words.repeat(turns));
    all_completed(&fleet, followers, &text).await
}

/// A short outage: the client holds the replica's writes until NATS is back, within the store
/// timeout, so the hand-overs go through and the runs move at once.
#[tokio::test]
async fn runs_handed_over_across_a_short_nats_restart_complete_elsewhere() -> TestResult {
    hand_over_across_a_nats_restart(Duration::from_millis(500)).await
}

/// An outage longer than the store timeout (5 s): the replica's hand-over writes fail and it
/// exits anyway; another replica takes each run over from its last checkpoint once the lease
/// lapses. Every run still ends COMPLETED with a gap-free stream, and every call ran once.
#[tokio::test]
async fn runs_handed_over_across_a_long_nats_restart_are_taken_over_from_their_checkpoints() -> TestResult {
    hand_over_across_a_nats_restart(Duration::from_secs(6)).await
}

/// What a replica goes through while its runs go on: cut off from NATS, or paused.
enum Fault {
    /// Its traffic to NATS held (a partition) for this long, then let through again.
    CutOff(Duration),
    /// SIGSTOP for this long, then SIGCONT.
    Paused(Duration),
}

/// Three replicas (lease 2 s); replica 0 reaches NATS through a proxy that can cut it off. Twelve
/// runs start on replica 0, are followed across the replicas, and replica 0 goes through `fault`
/// while they run. Replica 0 stops acting for them on its own, before the others take them over:
/// every run completes, every caller's stream is gap-free and equal to GetRun, every call runs
/// once (the one in flight at the move is answered from its record), every signal once, and no
/// call of a run is sent by
/// a replica after another replica ran one (the epochs of each run's calls never go down).
async fn runs_through_a_fault_of_their_replica(fault: Fault, prefix: &str) -> TestResult {
    let (words, turns) = ("w0 w1 w2 w3 ", 4);
    let mut fleet = Fleet::start(0, scenario(turns, words), 800).await?;
    let nats: std::net::SocketAddr = fleet.nats.url().trim_start_matches("nats://").parse()?;
    let proxy = testkit::proxy::CutProxy::start(nats).await?;
    let faulty = fleet.add_on(&format!("nats://{}", proxy.addr())).await?;
    fleet.add().await?;
    fleet.add().await?;
    let first = fleet.url(faulty).ok_or_else(|| anyhow::anyhow!("no replica"))?;
    let runs: Vec<String> = (0..12).map(|i| format!("{prefix}-{i}")).collect();
    for run_id in &runs {
        start_detached(&first, run_id).await?;
    }
    let followers = follow_all(&fleet, &runs);
    for (run_id, seen, _) in &followers {
        let mut seen = seen.clone();
        until(&mut seen, &format!("{run_id}'s first call"), |e| {
            !in_flight(e).is_empty()
        })
        .await?;
    }
    let replica = fleet.replicas[faulty]
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("no replica"))?;
    match fault {
        Fault::CutOff(outage) => {
            proxy.cut();
            // Stays, as the pause below: the fault's length is what is under test.
            tokio::time::sleep(outage).await;
            proxy.heal();
        }
        Fault::Paused(pause) => {
            replica.signal(nix::sys::signal::Signal::SIGSTOP)?;
            // Stays: the pause's length is the fault under test.
            tokio::time::sleep(pause).await;
            replica.signal(nix::sys::signal::Signal::SIGCONT)?;
        }
    }
    let text = format!("{}done", words.repeat(turns));
    let result = all_completed(&fleet, followers, &text).await;
    let stopped = replica
        .logs()
        .iter()
        .filter(|l| l.contains("this replica stops acting for the run"))
        .count();
    result?;
    fleet.one_owner_at_a_time()?;
    assert!(
        stopped >= 1,
        "the faulty replica stopped acting for its runs on its own"
    );
    let moved = fleet.stale_calls_are_refused().await?;
    assert!(moved >= 1, "some runs were taken over, and their fences raised");
    Ok(())
}

/// Cut off from NATS for three leases while it keeps serving its callers, then healed.
#[tokio::test]
async fn a_replica_cut_off_from_nats_stops_acting_before_its_runs_are_taken_over() -> TestResult {
    runs_through_a_fault_of_their_replica(Fault::CutOff(Duration::from_secs(6)), "cut-off").await
}

/// Paused (SIGSTOP) for two leases and a half, then resumed (SIGCONT): its lease ran out while it
/// was stopped, so it acts no more once it runs again.
#[tokio::test]
async fn a_paused_replica_acts_no_more_once_resumed_past_its_lease() -> TestResult {
    runs_through_a_fault_of_their_replica(Fault::Paused(Duration::from_secs(5)), "paused").await
}

/// Waits until the caller of each of `followers` has seen a tool call of its run start.
async fn every_run_called(followers: &[Following]) -> TestResult {
    for (run_id, seen, _) in followers {
        let mut seen = seen.clone();
        until(&mut seen, &format!("{run_id}'s call"), |e| !in_flight(e).is_empty()).await?;
    }
    Ok(())
}

impl Fleet {
    /// Waits until the tool ran a call of each of `runs` in an epoch after the first: another
    /// replica took each over and sent its own calls.
    async fn every_run_called_in_a_newer_epoch(&self, runs: &[String]) -> TestResult {
        testkit::wait::until_sync("every run's call in a newer epoch", Duration::from_secs(60), || {
            let epochs = self.epochs();
            runs.iter()
                .all(|run| epochs.get(run).is_some_and(|e| e.iter().any(|&epoch| epoch >= 2)))
                .then_some(())
        })
        .await
    }
}

/// Waits until a caller of any of `followers` sees a tool call start.
async fn a_call_starts(followers: &[Following]) -> TestResult {
    let waits = followers.iter().map(|(_, seen, _)| {
        let mut seen = seen.clone();
        Box::pin(async move {
            let _ = seen.wait_for(|events| !in_flight(events).is_empty()).await;
        })
    });
    tokio::time::timeout(Duration::from_secs(60), futures::future::select_all(waits))
        .await
        .map(|_| ())
        .map_err(|_| anyhow::anyhow!("no caller saw a tool call start"))
}

/// Four waves of eight runs on replica 0, which sends its calls to runner A through a proxy
/// while the other two replicas send theirs to runner B. Each wave, the moment a caller sees one
/// of the runs' tool calls start, the link to runner A is cut (what replica 0 sends is held, as a
/// slow network or a lazily connected channel holds a request after its lease check), and once
/// each run has a call out replica 0 is paused (SIGSTOP) until the others have taken its runs over
/// and run their calls on runner B. Then the link heals and replica 0 resumes: what it had
/// sent reaches runner A after the new owners' calls ran. Runner A reads each run's fence from
/// the store and refuses those calls: no call of a replaced owner runs (the epochs each run's
/// calls ran in never go down, across both runners), and every run completes as in the other
/// fault tests.
#[tokio::test]
async fn a_paused_replicas_held_calls_reach_another_runner_late_and_run_nothing() -> TestResult {
    let (words, turns) = ("w0 w1 ", 3);
    let mut fleet = Fleet::start(0, scenario(turns, words), 800).await?;
    let nats = fleet.nats.url();
    let runner_a: std::net::SocketAddr = fleet.runner_url.trim_start_matches("http://").parse()?;
    let link = testkit::proxy::CutProxy::start(runner_a).await?;
    let runner_b = fleet.start_runner().await?;
    let paused = fleet.add_with(&nats, &format!("http://{}", link.addr())).await?;
    fleet.add_with(&nats, &runner_b).await?;
    fleet.add_with(&nats, &runner_b).await?;
    let first = fleet.url(paused).ok_or_else(|| anyhow::anyhow!("no replica"))?;
    let mut everyone = Vec::new();
    for wave in 0..4 {
        let runs: Vec<String> = (0..8).map(|i| format!("wave{wave}-{i}")).collect();
        for run_id in &runs {
            start_detached(&first, run_id).await?;
        }
        let followers = follow_all(&fleet, &runs);
        a_call_starts(&followers).await?;
        link.cut();
        let replica = fleet.replicas[paused]
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("no replica"))?;
        // Its other runs' calls go out into the held link meanwhile.
        every_run_called(&followers).await?;
        replica.signal(nix::sys::signal::Signal::SIGSTOP)?;
        fleet.every_run_called_in_a_newer_epoch(&runs).await?;
        link.heal();
        replica.signal(nix::sys::signal::Signal::SIGCONT)?;
        everyone.extend(followers);
    }
    let text = format!("{}done", words.repeat(turns));
    all_completed(&fleet, everyone, &text).await?;
    fleet.one_owner_at_a_time()?;
    let moved = fleet.stale_calls_are_refused().await?;
    assert!(moved >= 4, "runs of every wave were taken over ({moved} were)");
    Ok(())
}

/// The streams and buckets the orchestrator keeps in JetStream, by stream name.
const STREAMS: [&str; 5] = [
    "KV_orchestrator-runs",
    "OBJ_orchestrator-runs-checkpoints",
    "KV_orchestrator-runs-approvals",
    "ORCHESTRATOR_EVENTS",
    "SIGNALS",
];

/// The streams a replica renews and saves runs in: their leaders must live while the event
/// log's is lost.
const BUCKETS: [&str; 3] = [
    "KV_orchestrator-runs",
    "OBJ_orchestrator-runs-checkpoints",
    "KV_orchestrator-runs-approvals",
];

/// Moves the leader of every stream in `others` off the node leading `stream` (a leader
/// stepdown hands it to another peer), so that node can be lost with only `stream` leaderless;
/// the node's name.
async fn lead_alone(
    cluster: &testkit::nats::NatsCluster,
    client: &async_nats::Client,
    stream: &str,
    others: &[&str],
) -> anyhow::Result<String> {
    let alone = cluster.stream_leader(stream).await?;
    for other in others {
        for attempt in 0.. {
            if cluster.stream_leader(other).await? != alone {
                break;
            }
            anyhow::ensure!(attempt < 20, "{other} keeps its leader on {alone}");
            let subject = format!("$JS.API.STREAM.LEADER.STEPDOWN.{other}");
            // Answered once the leader stepped down; the election that follows is waited for.
            let _ = client.request(subject, bytes::Bytes::new()).await;
            testkit::wait::until(
                &format!("{other} to elect a leader"),
                Duration::from_secs(30),
                || async { cluster.stream_leader(other).await.ok() },
            )
            .await?;
        }
    }
    anyhow::ensure!(
        cluster.stream_leader(stream).await? == alone,
        "{stream} moved while the others did"
    );
    Ok(alone)
}

/// The fault the port-level model of the store hid: the node leading the event-log stream is
/// lost (SIGKILL, and it stays down) while the run store's buckets keep their leaders. The stream
/// has no leader for longer than the publisher's retry window (the lease: 2 s; an election takes
/// at least 4 s), so batches are lost. Nothing is published after such a hole: the owner stops,
/// the run is taken over from its checkpoint and numbers on where the log ends. Every caller,
/// re-attaching, reads a gap-free log ending in `run_finished`, and its stream equals `GetRun`.
#[tokio::test]
async fn losing_the_event_logs_leader_leaves_every_runs_log_gap_free() -> TestResult {
    let (words, turns) = ("w0 w1 w2 ", 16);
    let cluster = testkit::nats::NatsCluster::start(3).await?;
    let mut fleet = Fleet::start_on(Broker::Cluster(cluster), 0, scenario(turns, words), 150).await?;
    fleet.flags = ["--nats-replicas", "3", "--max-turns", "20"].map(String::from).to_vec();
    fleet.add().await?;
    fleet.add().await?;
    let client = fleet.nats.connect().await?;
    let Broker::Cluster(cluster) = &fleet.nats else {
        anyhow::bail!("not a cluster");
    };
    let alone = lead_alone(cluster, &client, "ORCHESTRATOR_EVENTS", &BUCKETS).await?;
    let urls = fleet.urls();
    let runs: Vec<String> = (0..12).map(|i| format!("log-lost-{i}")).collect();
    for (i, run_id) in runs.iter().enumerate() {
        start_detached(&urls[i % urls.len()], run_id).await?;
    }
    let followers = follow_all(&fleet, &runs);
    for (run_id, seen, _) in &followers {
        let mut seen = seen.clone();
        until(&mut seen, &format!("{run_id}'s second turn"), |e| {
            e.iter()
                .any(|e| matches!(&e.event, Some(pb::orchestrate_event::Event::TextDelta(t)) if t.turn >= 2))
        })
        .await?;
    }
    let Broker::Cluster(cluster) = &mut fleet.nats else {
        anyhow::bail!("not a cluster");
    };
    let node = cluster
        .index_of(&alone)
        .ok_or_else(|| anyhow::anyhow!("no node {alone}"))?;
    cluster.kill(node).await?;
    let text = format!("{}done", words.repeat(turns));
    all_completed(&fleet, followers, &text).await?;
    anyhow::ensure!(
        fleet.summed("orchestrator_event_log_dropped_total").await? > 0.0,
        "no batch was lost: the fault did not happen"
    );
    fleet.one_owner_at_a_time()
}

/// A three-node JetStream cluster (every write synced before it is acknowledged), two replicas
/// given every node as a seed and `--nats-replicas 3`, and 24 twenty-turn runs. Mid-run the node
/// leading the run store's stream is killed (SIGKILL): JetStream elects another leader, the
/// replicas follow the cluster to the nodes left, the runs whose owner could not renew its lease
/// meanwhile stop and are resumed from their checkpoints, and every run completes with the
/// guarantees of the other fault tests (every call ran once).
#[tokio::test]
async fn a_nats_node_killed_mid_run_loses_no_run_with_three_replicas_of_every_stream() -> TestResult {
    node_lost_mid_run(1).await
}

/// The same with the run store spread over four shards (`--run-store-shards 4`): each shard's
/// bucket, checkpoints and event log has three replicas, the tool-runners read each run's fence
/// in its shard, and the node leading the first shard (the incarnations' too) is the one killed.
#[tokio::test]
async fn a_nats_node_killed_mid_run_loses_no_run_of_a_store_in_four_shards() -> TestResult {
    node_lost_mid_run(4).await
}

/// 24 twenty-turn runs over a store of `shards` shards on a three-node cluster, the node leading
/// the first shard's bucket killed mid-run: every run completes, every call ran once.
async fn node_lost_mid_run(shards: usize) -> TestResult {
    // One at a time: two three-node clusters and four replicas at once overload a 2-core machine.
    static ONE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _alone = ONE_CLUSTER.lock().await;
    let (words, turns) = ("w0 w1 w2 ", 20);
    let cluster = testkit::nats::NatsCluster::start(3).await?;
    let mut fleet = Fleet::start_on(Broker::Cluster(cluster), 0, scenario(turns, words), 150).await?;
    fleet.lease = "3s";
    fleet.flags = [
        "--nats-replicas",
        "3",
        "--max-turns",
        "24",
        "--run-store-shards",
        &shards.to_string(),
    ]
    .map(String::from)
    .to_vec();
    fleet.add().await?;
    fleet.add().await?;
    let js = async_nats::jetstream::new(fleet.nats.connect().await?);
    for name in STREAMS {
        for shard in 0..shards {
            let name = sharded(name, shard);
            let info = js.get_stream(&name).await?.info().await?.clone();
            assert_eq!(info.config.num_replicas, 3, "{name}");
        }
    }
    let urls = fleet.urls();
    let runs: Vec<String> = (0..24).map(|i| format!("node-lost-{shards}-{i}")).collect();
    for (i, run_id) in runs.iter().enumerate() {
        start_detached(&urls[i % urls.len()], run_id).await?;
    }
    let followers = follow_all(&fleet, &runs);
    for (run_id, seen, _) in &followers {
        let mut seen = seen.clone();
        until(&mut seen, &format!("{run_id}'s third turn"), |e| {
            e.iter()
                .any(|e| matches!(&e.event, Some(pb::orchestrate_event::Event::TextDelta(t)) if t.turn >= 3))
        })
        .await?;
    }
    let Broker::Cluster(cluster) = &mut fleet.nats else {
        anyhow::bail!("not a cluster");
    };
    let leader = cluster.stream_leader("KV_orchestrator-runs").await?;
    let node = cluster
        .index_of(&leader)
        .ok_or_else(|| anyhow::anyhow!("no node {leader}"))?;
    cluster.kill(node).await?;
    let text = format!("{}done", words.repeat(turns));
    all_completed(&fleet, followers, &text).await?;
    fleet.one_owner_at_a_time()
}

/// The name of shard `shard` of the stream `name` (the bucket, object store or event log whose
/// stream it is): the first keeps the name, the others are `<name>-shard-<i>`, and an object
/// store's stream ends with its `-checkpoints`.
fn sharded(name: &str, shard: usize) -> String {
    let sharded = |base: &str| shared::jetstream::shards::name(base, shard);
    match name {
        "OBJ_orchestrator-runs-checkpoints" => format!("OBJ_{}-checkpoints", sharded("orchestrator-runs")),
        "KV_orchestrator-runs" | "ORCHESTRATOR_EVENTS" => match name.strip_prefix("KV_") {
            Some(bucket) => format!("KV_{}", sharded(bucket)),
            None => sharded(name),
        },
        // Not sharded: one of each whatever the count.
        other => other.to_owned(),
    }
}

/// A tool-runner process serving `manifest` on `listen`, reading and recording in the run store
/// at `nats` with a runner lease of 3 s.
async fn runner_process(manifest: &std::path::Path, nats: &str, listen: &str) -> anyhow::Result<Service> {
    let mut command = tokio::process::Command::new(testkit::tool_runner_bin!()?);
    command
        .arg("--tools-manifest")
        .arg(manifest)
        .args([
            "--run-store",
            nats,
            "--run-store-timeout",
            "400ms",
            "--runner-lease",
            "3s",
        ])
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT");
    Service::spawn_on(command, listen, "127.0.0.1", "tool-runner serving").await
}

/// One replica on NATS and one tool-runner process whose command tools each log
/// `<run>/<tool>` when they start and take 4 s: the setting of a runner killed mid-call.
struct MidCall {
    nats: Nats,
    _mock: mock_llm::MockLlm,
    manifest: std::path::PathBuf,
    log: std::path::PathBuf,
    runner: Option<Service>,
    /// The replica's gRPC URL.
    url: String,
    _replica: Service,
    _replacement: Option<Service>,
    _dir: tempfile::TempDir,
}

impl MidCall {
    /// `tools` (name, declared idempotent, needs a person's approval) served to a replica whose
    /// model plays `scenario`.
    async fn start(tools: &[(&str, bool, bool)], scenario: mock_llm::Scenario) -> anyhow::Result<Self> {
        let nats = Nats::start().await?;
        let dir = tempfile::tempdir()?;
        let log = dir.path().join("calls.log");
        let tool = |(name, idempotent, approval): &(&str, bool, bool)| {
            let script = format!(
                "echo \"$TOOL_RUN_ID/{name} $TOOL_RUN_EPOCH\" >> {}; sleep 4; printf '{{\"done\":true}}'",
                log.display()
            );
            format!(
                "[[tool]]\nname = {name:?}\ndescription = \"d\"\nidempotent = {idempotent}\nneeds_approval = {approval}\ntimeout = \"1m\"\nargv = [\"sh\", \"-c\", {script:?}]\n"
            )
        };
        let manifest = dir.path().join("tools.toml");
        std::fs::write(&manifest, tools.iter().map(tool).collect::<String>())?;
        let mock = mock_llm::MockLlm::start(scenario).await?;
        let runner = runner_process(&manifest, &nats.url(), "127.0.0.1:0").await?;
        let orchestrator = env!("CARGO_BIN_EXE_orchestrator");
        let runners = format!("http://{}", runner.grpc);
        let mut command = testkit::on_nats(
            testkit::orchestrator_command(orchestrator, &mock.base_url(), &runners),
            &nats.url(),
        );
        command.args(["--tool-call-retries", "8", "--tool-call-retry-backoff", "100ms"]);
        let replica = Service::orchestrator(command).await?;
        Ok(Self {
            url: format!("http://{}", replica.grpc),
            nats,
            _mock: mock,
            manifest,
            log,
            runner: Some(runner),
            _replica: replica,
            _replacement: None,
            _dir: dir,
        })
    }

    /// `<run>/<tool>` of every call the tools started, sorted.
    fn ran(&self) -> Vec<String> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut ran: Vec<String> = text
            .lines()
            .map(|l| l.split(' ').next().unwrap_or_default().to_owned())
            .collect();
        ran.sort_unstable();
        ran
    }

    /// Waits until `calls` calls started, SIGKILLs the runner, and starts another on its port (as
    /// Kubernetes starts a pod in a lost one's place behind the same Service).
    async fn kill_the_runner_once(&mut self, calls: usize) -> TestResult {
        testkit::wait::until_sync("the calls to start on the runner", Duration::from_secs(30), || {
            (self.ran().len() == calls).then_some(())
        })
        .await?;
        let runner = self.runner.take().ok_or_else(|| anyhow::anyhow!("killed already"))?;
        let listen = runner.grpc.clone();
        runner.kill().await?;
        self._replacement = Some(runner_process(&self.manifest, &self.nats.url(), &listen).await?);
        Ok(())
    }

    /// Waits until the run's status is `status`.
    async fn until_status(&self, run_id: &str, done: impl Fn(pb::RunStatus) -> bool) -> anyhow::Result<pb::RunResult> {
        testkit::wait::until("the run's status", Duration::from_secs(60), || async {
            get_run(&self.url, run_id).await.ok().filter(|r| done(r.status()))
        })
        .await
    }

    async fn client(&self) -> anyhow::Result<pb::orchestrator_client::OrchestratorClient<tonic::transport::Channel>> {
        Ok(pb::orchestrator_client::OrchestratorClient::connect(self.url.clone()).await?)
    }

    /// The run's whole event stream, as a caller attaching from its start reads it.
    async fn events(&self, run_id: &str) -> anyhow::Result<Vec<pb::OrchestrateEvent>> {
        let request = pb::AttachRunRequest {
            run_id: run_id.into(),
            after_seq: 0,
        };
        let mut stream = self.client().await?.attach_run(request).await?.into_inner();
        let mut events = Vec::new();
        while let Some(event) = tokio::time::timeout(Duration::from_secs(20), stream.message()).await?? {
            events.push(event);
        }
        Ok(events)
    }

    /// Approves call `call_id` of `run_id`.
    async fn approve(&self, run_id: &str, call_id: &str) -> TestResult {
        let decision = pb::ToolCallDecision {
            call_id: call_id.into(),
            kind: pb::DecisionKind::Approve.into(),
            ..Default::default()
        };
        let request = pb::DecideToolCallsRequest {
            run_id: run_id.into(),
            decisions: vec![decision],
        };
        self.client().await?.decide_tool_calls(request).await?;
        Ok(())
    }
}

/// The record of `name`'s call in `result`.
fn record_of(result: &pb::RunResult, name: &str) -> anyhow::Result<pb::ToolCallRecord> {
    (result.tool_calls.iter().find(|c| c.name == name).cloned())
        .ok_or_else(|| anyhow::anyhow!("no {name} call in {result:?}"))
}

/// A tool-runner SIGKILLed while a run's two calls run on it (the run's replica stays): the
/// replica's calls lose their answers and are sent again, to the runner Kubernetes starts in its
/// place. The refund (not declared idempotent) is in doubt: it does not run again, the model is
/// told it may or may not have taken effect (IN_DOUBT), and GetRun shows it so; the lookup
/// (declared idempotent) runs again and succeeds. The run completes.
#[tokio::test]
async fn a_call_whose_runner_is_killed_mid_call_is_in_doubt_unless_its_tool_is_idempotent() -> TestResult {
    use mock_llm::{Step, Turn};
    let scenario = mock_llm::Scenario::new(vec![
        Turn::text("paying back")
            .then(Step::call("refund", serde_json::json!({})))
            .then(Step::call("lookup", serde_json::json!({}))),
        Turn::text("done"),
    ]);
    let mut fleet = MidCall::start(&[("refund", false, false), ("lookup", true, false)], scenario).await?;
    start_detached(&fleet.url, "doubt-1").await?;
    fleet.kill_the_runner_once(2).await?;

    let result = fleet.until_status("doubt-1", |s| s != pb::RunStatus::Running).await?;
    assert_eq!(result.status(), pb::RunStatus::Completed, "{}", result.failure_detail);
    let refund = record_of(&result, "refund")?;
    assert!(refund.in_doubt && !refund.ok, "{refund:?}");
    let error = refund.error.unwrap_or_default();
    assert_eq!(error.code, "IN_DOUBT");
    assert!(
        error.message.contains("may or may not have taken effect"),
        "{}",
        error.message
    );
    let lookup = record_of(&result, "lookup")?;
    assert!(lookup.ok && !lookup.in_doubt, "{lookup:?}");
    let finished: Vec<(String, bool)> = fleet
        .events("doubt-1")
        .await?
        .into_iter()
        .filter_map(|e| match e.event {
            Some(pb::orchestrate_event::Event::ToolCallFinished(f)) => Some((f.name, f.in_doubt)),
            _ => None,
        })
        .collect();
    assert!(
        finished.contains(&("refund".to_owned(), true)) && finished.contains(&("lookup".to_owned(), false)),
        "the stream shows the refund in doubt: {finished:?}"
    );
    assert_eq!(
        fleet.ran(),
        ["doubt-1/lookup", "doubt-1/lookup", "doubt-1/refund"],
        "the refund ran once, the idempotent lookup again"
    );
    Ok(())
}

/// A refund a person approved, whose runner is SIGKILLed while it runs: in doubt, it goes back to
/// a person (`approval_requested` and `ListPendingApprovals` say it is in doubt) instead of to
/// the model; approved again, it runs again (the runner is told a person chose to) and the run
/// completes with it done.
#[tokio::test]
async fn an_approved_call_in_doubt_goes_back_to_a_person_who_may_run_it_again() -> TestResult {
    use mock_llm::{Step, Turn};
    let scenario = mock_llm::Scenario::new(vec![
        Turn::text("paying back").then(Step::call("refund", serde_json::json!({}))),
        Turn::text("done"),
    ]);
    let mut fleet = MidCall::start(&[("refund", false, true)], scenario).await?;
    start_detached(&fleet.url, "doubt-2").await?;
    let waiting = fleet
        .until_status("doubt-2", |s| s == pb::RunStatus::AwaitingApproval)
        .await?;
    let call_id = waiting
        .pending_approvals
        .first()
        .map(|p| p.call_id.clone())
        .ok_or_else(|| anyhow::anyhow!("nothing pending in {waiting:?}"))?;
    fleet.approve("doubt-2", &call_id).await?;
    fleet.kill_the_runner_once(1).await?;

    let pending = testkit::wait::until(
        "the call back with a person, in doubt",
        Duration::from_secs(60),
        || async {
            let request = pb::ListPendingApprovalsRequest {
                run_id: "doubt-2".into(),
                limit: 0,
            };
            let listed = fleet.client().await.ok()?.list_pending_approvals(request).await.ok()?;
            listed.into_inner().approvals.into_iter().find(|p| p.in_doubt)
        },
    )
    .await?;
    assert_eq!(pending.call_id, call_id);
    assert_eq!(fleet.ran(), ["doubt-2/refund"], "not run again before a person said so");
    fleet.approve("doubt-2", &call_id).await?;

    let result = fleet
        .until_status("doubt-2", |s| {
            !matches!(s, pb::RunStatus::Running | pb::RunStatus::AwaitingApproval)
        })
        .await?;
    assert_eq!(result.status(), pb::RunStatus::Completed, "{}", result.failure_detail);
    let refund = record_of(&result, "refund")?;
    assert!(refund.ok && !refund.in_doubt, "{refund:?}");
    assert_eq!(
        fleet.ran(),
        ["doubt-2/refund", "doubt-2/refund"],
        "run again as a person chose"
    );
    Ok(())
}
