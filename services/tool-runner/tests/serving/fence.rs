//! The run fence at the receiver, against a real `nats-server -js`: two runners given the run
//! store refuse a call sent in an older epoch than the run's fence before its tool runs, each
//! reading the fence from the store (neither has seen the newer epoch's calls), say which epochs
//! met, and refuse a durable call `UNAVAILABLE`, unrun, while the store cannot be read.
//!
//! And a durable call runs once: sent again (a retry, or a new owner in a newer epoch, to either
//! runner) it is answered from its record; started by a runner that went away it is in doubt (a
//! tool not declared idempotent does not run again; an idempotent one does); running on a runner
//! that is alive it is waited for; an outcome over the bound is answered once and kept as an
//! error naming the bound.

use std::time::Duration;

use proto::toolrunner::v1 as pb;
use testkit::Runner;
use testkit::nats::Nats;

type TestResult = anyhow::Result<()>;

/// The orchestrators' run-store bucket, as they create it.
const BUCKET: &str = "orchestrator-runs";

/// Command tools that append `<run id>/<call id> <epoch>` to `log` (what ran) and answer the
/// epoch they ran in: `record` (not idempotent), `record_again` (declared idempotent) and `big`
/// (answers 2 KiB more).
fn manifest(dir: &std::path::Path, log: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    let path = dir.join("tools.toml");
    let script = |extra: &str| {
        format!(
            "echo \"$TOOL_RUN_ID/$TOOL_CALL_ID $TOOL_RUN_EPOCH\" >> {}; printf '{{\"epoch\": %s{extra}}}' $TOOL_RUN_EPOCH",
            log.display()
        )
    };
    let tool = |name: &str, extra: &str, idempotent: bool| {
        format!(
            "[[tool]]\nname = {name:?}\ndescription = \"records its call\"\nidempotent = {idempotent}\nargv = [\"sh\", \"-c\", {:?}]\n",
            script(extra)
        )
    };
    let padding = format!(", \"padding\": \"{}\"", "x".repeat(2048));
    std::fs::write(
        &path,
        [
            tool("record", "", false),
            tool("record_again", "", true),
            tool("big", &padding, false),
        ]
        .concat(),
    )?;
    Ok(path)
}

/// Two runners reading the run store at `nats`, with the `record` tool logging to `log`.
async fn runners(nats: &Nats, manifest: &std::path::Path) -> anyhow::Result<[Runner; 2]> {
    let config = || {
        let mut config = testkit::stack::runner_config(Some(manifest.to_owned()));
        config.fence.run_store = Some(nats.url());
        config.fence.timeout = Duration::from_millis(500);
        config
    };
    Ok([Runner::start(config()).await?, Runner::start(config()).await?])
}

/// The run store's bucket, and a way to set a run's fence as a replica taking it over does.
async fn bucket(nats: &Nats) -> anyhow::Result<async_nats::jetstream::kv::Store> {
    let url = shared::secrets::NatsUrl::parse(&nats.url()).map_err(anyhow::Error::msg)?;
    let access = shared::nats::Access {
        tls_required: false,
        credentials: None,
        ca_file: None,
    };
    let options = shared::nats::options(&url, "test", access)
        .await
        .map_err(anyhow::Error::msg)?;
    let js = async_nats::jetstream::new(options.connect(url.seeds()).await?);
    testkit::nats::run_bucket(&js, BUCKET).await
}

/// Writes a record of `run` claimed in `epoch`, as an orchestrator's claim does (a runner reads
/// only the epoch of it).
async fn claim(kv: &async_nats::jetstream::kv::Store, run: &str, epoch: u64) -> TestResult {
    let record = shared::fence::RecordEpoch { epoch }.to_bytes();
    kv.put(shared::fence::record_key(run), record.into()).await?;
    Ok(())
}

/// `record` for `call` of `run` sent in `epoch`: whether the runner took it.
async fn call(runner: &Runner, run: &str, call: &str, epoch: u64) -> anyhow::Result<Result<(), tonic::Status>> {
    Ok(answer(runner, "record", run, call, epoch).await?.map(|_| ()))
}

/// Tool `tool` for `call` of `run` sent in `epoch`: what the runner answered.
async fn answer(
    runner: &Runner,
    tool: &str,
    run: &str,
    call: &str,
    epoch: u64,
) -> anyhow::Result<Result<testkit::Outcome, tonic::Status>> {
    let request = pb::RunToolRequest {
        run_id: run.to_owned(),
        call_id: call.to_owned(),
        tool_name: tool.to_owned(),
        arguments_json: "{}".to_owned(),
        epoch,
        ..Default::default()
    };
    match runner.client().await?.run_tool(request).await {
        Ok(response) => Ok(Ok(testkit::Outcome::of(response.into_inner())?)),
        Err(status) => Ok(Err(status)),
    }
}

/// The lines the tool wrote: the calls that ran.
fn ran(log: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn header(status: &tonic::Status, name: &str) -> Option<String> {
    status.metadata().get(name)?.to_str().ok().map(str::to_owned)
}

/// A replaced owner's call is refused by whichever runner it reaches, before its tool runs, and
/// the refusal names both epochs; the owner's calls, calls of runs never taken over and calls of
/// no durable run run. Raising the fence again refuses the epoch that just ran. The store wants a
/// password, given in `--run-store`'s URL as the orchestrators' is.
#[tokio::test]
async fn a_call_older_than_its_runs_fence_is_refused_by_every_runner_before_its_tool_runs() -> TestResult {
    let nats = Nats::start_authenticated("runner", "fence-pw").await?;
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("calls.log");
    let [a, b] = runners(&nats, &manifest(dir.path(), &log)?).await?;
    let kv = bucket(&nats).await?;
    claim(&kv, "run.1", 1).await?;
    claim(&kv, "never-moved", 1).await?;
    kv.put(shared::fence::key("run.1"), shared::fence::encode(2).into())
        .await?;

    let refused = call(&a, "run.1", "call_1", 1)
        .await?
        .expect_err("epoch 1 under a fence of 2");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(
        refused.message().contains("epoch 1") && refused.message().contains("epoch 2"),
        "{}",
        refused.message()
    );
    assert_eq!(header(&refused, "x-run-epoch-current").as_deref(), Some("2"));
    call(&b, "run.1", "call_1", 2).await?.map_err(anyhow::Error::msg)?;
    call(&a, "run.1", "call_2", 3).await?.map_err(anyhow::Error::msg)?;
    call(&a, "never-moved", "call_1", 1)
        .await?
        .map_err(anyhow::Error::msg)?;
    call(&b, "local-run", "local", 0).await?.map_err(anyhow::Error::msg)?;

    // Another takeover: runner b refuses the epoch it ran a moment ago, learnt from the store.
    kv.put(shared::fence::key("run.1"), shared::fence::encode(4).into())
        .await?;
    let refused = call(&b, "run.1", "call_3", 3)
        .await?
        .expect_err("epoch 3 under a fence of 4");
    assert_eq!(header(&refused, "x-run-epoch-current").as_deref(), Some("4"));
    assert_eq!(
        ran(&log),
        [
            "run.1/call_1 2",
            "run.1/call_2 3",
            "never-moved/call_1 1",
            "local-run/local 0"
        ],
        "only the calls of the run's current owner (or of no durable run) ran"
    );
    Ok(())
}

/// While the store cannot be read a durable call is refused `UNAVAILABLE`, unrun, marked as
/// refused (the orchestrator sends it to another runner); a call of no durable run still runs,
/// and durable calls run again once the store is back.
#[tokio::test]
async fn a_durable_call_is_refused_unrun_while_the_run_store_cannot_be_read() -> TestResult {
    let mut nats = Nats::start().await?;
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("calls.log");
    let [a, _b] = runners(&nats, &manifest(dir.path(), &log)?).await?;
    claim(&bucket(&nats).await?, "run.2", 1).await?;
    call(&a, "run.2", "before", 1).await?.map_err(anyhow::Error::msg)?;

    nats.stop().await?;
    let refused = call(&a, "run.2", "during", 1)
        .await?
        .expect_err("no store, no durable call");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{}", refused.message());
    assert_eq!(header(&refused, "x-tool-runner-refused").as_deref(), Some("run-store"));
    assert!(refused.message().contains("run fence"), "{}", refused.message());
    call(&a, "run.2", "local", 0).await?.map_err(anyhow::Error::msg)?;

    nats.restart().await?;
    testkit::wait::until(
        "the runner to read the store again",
        Duration::from_secs(30),
        || async { call(&a, "run.2", "after", 1).await.ok()?.ok() },
    )
    .await?;
    let ran = ran(&log);
    assert!(!ran.iter().any(|l| l.contains("during")), "{ran:?}");
    assert_eq!(&ran[..2], ["run.2/before 1", "run.2/local 0"]);
    Ok(())
}

/// The fence key is never read alone: with it gone (aged out) the run's record still holds the
/// epoch of its current claim, and a call older than that is refused; a durable call of a run the
/// store holds nothing of is refused, unrun; a call with no epoch of a run the store shows durable
/// is refused as its owner's. All before the tool runs.
#[tokio::test]
async fn a_missing_fence_is_never_read_as_no_fence() -> TestResult {
    let nats = Nats::start().await?;
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("calls.log");
    let [a, _b] = runners(&nats, &manifest(dir.path(), &log)?).await?;
    let kv = bucket(&nats).await?;
    claim(&kv, "moved", 3).await?;

    let refused = call(&a, "moved", "old", 2)
        .await?
        .expect_err("epoch 2 of a run claimed in 3");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert_eq!(header(&refused, "x-run-epoch-current").as_deref(), Some("3"));
    let unknown = call(&a, "nowhere", "c", 1)
        .await?
        .expect_err("a run the store does not hold");
    assert_eq!(unknown.code(), tonic::Code::FailedPrecondition);
    assert_eq!(
        header(&unknown, "x-tool-runner-refused").as_deref(),
        Some("unknown-run")
    );
    assert!(
        unknown.message().contains("holds no run nowhere"),
        "{}",
        unknown.message()
    );
    let unfenced = call(&a, "moved", "no-epoch", 0)
        .await?
        .expect_err("no epoch, durable run");
    assert_eq!(header(&unfenced, "x-run-epoch-current").as_deref(), Some("3"));
    assert!(
        unfenced.message().contains("carries no epoch"),
        "{}",
        unfenced.message()
    );

    call(&a, "moved", "current", 3).await?.map_err(anyhow::Error::msg)?;
    call(&a, "nowhere", "local", 0).await?.map_err(anyhow::Error::msg)?;
    assert_eq!(ran(&log), ["moved/current 3", "nowhere/local 0"]);
    Ok(())
}

/// A runner whose fence read could outlast the orchestrators' grace refuses every durable call,
/// naming both settings; one whose read fits runs them.
#[tokio::test]
async fn a_fence_read_longer_than_the_grace_refuses_durable_calls_naming_both() -> TestResult {
    let nats = Nats::start().await?;
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("calls.log");
    let kv = bucket(&nats).await?;
    claim(&kv, "run.3", 1).await?;
    kv.put(shared::fence::GRACE_KEY, "400".into()).await?;
    let [slow, _] = runners(&nats, &manifest(dir.path(), &log)?).await?;
    let refused = call(&slow, "run.3", "c", 1)
        .await?
        .expect_err("500ms reads, 400ms grace");
    assert_eq!(refused.code(), tonic::Code::Unavailable);
    assert!(
        refused.message().contains("--run-store-timeout (500ms)")
            && refused.message().contains("--run-fence-grace (400ms)"),
        "{}",
        refused.message()
    );
    call(&slow, "run.3", "local", 0).await?.map_err(anyhow::Error::msg)?;

    kv.put(shared::fence::GRACE_KEY, "2000".into()).await?;
    let [fits, _] = runners(&nats, &manifest(dir.path(), &log)?).await?;
    call(&fits, "run.3", "c", 1).await?.map_err(anyhow::Error::msg)?;
    assert_eq!(ran(&log), ["run.3/local 0", "run.3/c 1"]);
    Ok(())
}

/// A JetStream handle on `nats`'s run store, as a runner's own record keeper reaches it.
async fn store(nats: &Nats) -> anyhow::Result<std::sync::Arc<dyn shared::jetstream::JetStream>> {
    let client = async_nats::connect(nats.url()).await?;
    Ok(shared::jetstream::JetStream::handle(&shared::jetstream::nats::context(
        client, None,
    )))
}

/// Another runner's record keeper (incarnation `id`, its lease 3 s): it starts calls the test
/// then finishes, or leaves unanswered.
async fn ghost(nats: &Nats, id: &str) -> anyhow::Result<std::sync::Arc<tool_runner::record::CallRecords>> {
    let fence = tool_runner::fence::RunFence::over(store(nats).await?, BUCKET, Duration::from_millis(500));
    let records = tool_runner::record::CallRecords::new(std::sync::Arc::new(fence), id, Duration::from_secs(3), 4096);
    records.renew().await;
    Ok(std::sync::Arc::new(records))
}

/// `call` of `run` in epoch 1, started by `records` (as its runner does before the tool runs).
async fn start(
    records: &tool_runner::record::CallRecords,
    run: &str,
    call: &str,
) -> anyhow::Result<tool_runner::record::Started> {
    let begun = records
        .begin(&tool_runner::record::Call {
            run_id: run,
            call_id: call,
            round: None,
            epoch: 1,
            idempotent: false,
            rerun_in_doubt: false,
            wait: Duration::from_secs(1),
        })
        .await;
    match begun {
        tool_runner::record::Begun::Run(started) => Ok(started),
        other => anyhow::bail!("{call} was not started: {other:?}"),
    }
}

/// Two runners with a 3 s runner lease and a 1 KiB bound on kept outcomes.
async fn recording_runners(nats: &Nats, manifest: &std::path::Path) -> anyhow::Result<[Runner; 2]> {
    let config = || {
        let mut config = testkit::stack::runner_config(Some(manifest.to_owned()));
        config.fence.run_store = Some(nats.url());
        config.fence.timeout = Duration::from_millis(500);
        config.fence.runner_lease = Duration::from_secs(3);
        config.fence.record_max_bytes = 1024;
        config
    };
    Ok([Runner::start(config()).await?, Runner::start(config()).await?])
}

/// The epoch a `record` tool's answer says it ran in.
fn ran_in(outcome: testkit::Outcome) -> serde_json::Value {
    outcome.unwrap_ok()["epoch"].clone()
}

/// A durable call sent again (a retry to the same runner, then a new owner's call in a newer
/// epoch to the other) is answered from its record: the answer of the run in epoch 1, the tool
/// run once. A call of no durable run is not recorded: it runs each time.
#[tokio::test]
async fn a_durable_call_sent_again_is_answered_from_its_record_and_runs_once() -> TestResult {
    let nats = Nats::start().await?;
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("calls.log");
    let [a, b] = recording_runners(&nats, &manifest(dir.path(), &log)?).await?;
    let kv = bucket(&nats).await?;
    claim(&kv, "once", 1).await?;

    let first = answer(&a, "record", "once", "c1", 1)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(ran_in(first), 1);
    let retried = answer(&a, "record", "once", "c1", 1)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(ran_in(retried), 1, "answered from the record");
    claim(&kv, "once", 2).await?;
    let moved = answer(&b, "record", "once", "c1", 2)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(ran_in(moved), 1, "the new owner is answered with what ran in epoch 1");
    for _ in 0..2 {
        answer(&b, "record", "local", "c1", 0)
            .await?
            .map_err(anyhow::Error::msg)?;
    }
    assert_eq!(ran(&log), ["once/c1 1", "local/c1 0", "local/c1 0"]);
    Ok(())
}

/// A call started by a runner that went away (it deleted its liveness leaving, or stopped
/// renewing it for a whole lease) is in doubt: a tool not declared idempotent does not run again
/// (asked again, still in doubt) unless a person chose to rerun it; an idempotent one runs again.
/// A call running on a runner that is alive is waited for, and answered with its outcome.
#[tokio::test]
async fn a_call_whose_runner_went_away_is_in_doubt_and_one_still_running_is_waited_for() -> TestResult {
    let nats = Nats::start().await?;
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("calls.log");
    let [a, _b] = recording_runners(&nats, &manifest(dir.path(), &log)?).await?;
    claim(&bucket(&nats).await?, "doubt", 1).await?;

    let left = ghost(&nats, "left").await?;
    start(&left, "doubt", "c1").await?;
    start(&left, "doubt", "c2").await?;
    left.leave().await;
    for _ in 0..2 {
        match answer(&a, "record", "doubt", "c1", 1)
            .await?
            .map_err(anyhow::Error::msg)?
        {
            testkit::Outcome::InDoubt(doubt) => {
                assert_eq!(doubt.runner, "left");
                assert!(
                    doubt.message.contains("may or may not have taken effect"),
                    "{}",
                    doubt.message
                );
            }
            other => anyhow::bail!("expected c1 in doubt, got {other:?}"),
        }
    }
    let idempotent = answer(&a, "record_again", "doubt", "c2", 1)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(ran_in(idempotent), 1, "an idempotent tool runs again");
    let mut rerun = pb::RunToolRequest {
        run_id: "doubt".into(),
        call_id: "c1".into(),
        tool_name: "record".into(),
        arguments_json: "{}".into(),
        epoch: 1,
        rerun_in_doubt: true,
        ..Default::default()
    };
    let response = a.client().await?.run_tool(rerun.clone()).await?.into_inner();
    assert_eq!(
        ran_in(testkit::Outcome::of(response)?),
        1,
        "a person chose to run it again"
    );

    // A runner paused (or cut off) past its lease: its call is in doubt once a lease passed.
    let paused = ghost(&nats, "paused").await?;
    start(&paused, "doubt", "c3").await?;
    rerun.call_id = "c3".into();
    rerun.rerun_in_doubt = false;
    let response = a.client().await?.run_tool(rerun.clone()).await?.into_inner();
    assert!(matches!(testkit::Outcome::of(response)?, testkit::Outcome::InDoubt(_)));

    // A runner that is alive: the call is waited for and answered with its outcome.
    let alive = ghost(&nats, "alive").await?;
    let _renewing = shared::runtime::AbortOnDrop(tokio::spawn(std::sync::Arc::clone(&alive).keep_alive()));
    let running = start(&alive, "doubt", "c4").await?;
    rerun.call_id = "c4".into();
    let mut client = a.client().await?;
    let waiting = tokio::spawn(async move { client.run_tool(rerun).await });
    // The call is answered only once the other runner keeps its outcome: answered with that
    // outcome (epoch 7, which no tool here writes), it waited for it.
    let outcome = pb::RunToolResponse {
        outcome: Some(pb::run_tool_response::Outcome::ContentJson("{\"epoch\": 7}".into())),
        duration_ms: 3,
    };
    let kept = prost::Message::encode_to_vec(&outcome).into();
    alive.finish(running, kept, |_, _| bytes::Bytes::new()).await?;
    let response = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await???
        .into_inner();
    assert_eq!(
        ran_in(testkit::Outcome::of(response)?),
        7,
        "answered with the other runner's outcome"
    );
    assert_eq!(
        ran(&log),
        ["doubt/c2 1", "doubt/c1 1"],
        "c1 ran only when a person chose to"
    );
    Ok(())
}

/// An outcome larger than --call-record-max-bytes is answered in full to its caller, and an
/// error naming the bound is kept: the call sent again gets that error and does not run again.
#[tokio::test]
async fn an_outcome_over_the_bound_is_answered_once_and_kept_as_an_error_naming_it() -> TestResult {
    let nats = Nats::start().await?;
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("calls.log");
    let [a, b] = recording_runners(&nats, &manifest(dir.path(), &log)?).await?;
    claim(&bucket(&nats).await?, "large", 1).await?;
    let first = answer(&a, "big", "large", "c1", 1).await?.map_err(anyhow::Error::msg)?;
    assert_eq!(first.unwrap_ok()["padding"].as_str().map(str::len), Some(2048));
    let again = answer(&b, "big", "large", "c1", 1).await?.map_err(anyhow::Error::msg)?;
    let (code, message) = again.unwrap_err();
    assert_eq!(code, pb::ToolErrorCode::Failed);
    assert!(message.contains("--call-record-max-bytes (1024)"), "{message}");
    assert_eq!(ran(&log), ["large/c1 1"]);
    Ok(())
}

/// A connection to the run store with [`Faults`] (a store that answers nothing for a while,
/// seen from one runner).
struct Unanswering {
    inner: std::sync::Arc<dyn shared::jetstream::JetStream>,
    faults: Faults,
}

/// What an [`Unanswering`] store does, switched on and off by a test: while `lost` is set, a
/// create lands but its answer is lost and every read fails; while `deletes_refused` is set, no
/// delete lands; while `hangs` is set, a create lands and its answer never comes.
#[derive(Clone, Default)]
struct Faults {
    lost: std::sync::Arc<std::sync::atomic::AtomicBool>,
    deletes_refused: std::sync::Arc<std::sync::atomic::AtomicBool>,
    hangs: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// The bucket of an [`Unanswering`] connection.
struct UnansweringBucket {
    inner: std::sync::Arc<dyn shared::jetstream::Bucket>,
    faults: Faults,
}

fn no_answer<T: Send + 'static>() -> shared::jetstream::Reply<T> {
    Box::pin(async { Err(shared::jetstream::Error::failed("no answer in time")) })
}

impl shared::jetstream::JetStream for Unanswering {
    fn handle(&self) -> std::sync::Arc<dyn shared::jetstream::JetStream> {
        std::sync::Arc::new(Self {
            inner: self.inner.handle(),
            faults: self.faults.clone(),
        })
    }
    fn bucket(
        &self,
        config: shared::jetstream::BucketConfig,
    ) -> shared::jetstream::Reply<std::sync::Arc<dyn shared::jetstream::Bucket>> {
        let (bucket, faults) = (self.inner.bucket(config), self.faults.clone());
        Box::pin(async move { Ok(faults.wrap(bucket.await?)) })
    }
    fn bind_bucket(&self, name: &str) -> shared::jetstream::Reply<std::sync::Arc<dyn shared::jetstream::Bucket>> {
        let (bucket, faults) = (self.inner.bind_bucket(name), self.faults.clone());
        Box::pin(async move { Ok(faults.wrap(bucket.await?)) })
    }
    fn stream(
        &self,
        config: shared::jetstream::StreamConfig,
    ) -> shared::jetstream::Reply<std::sync::Arc<dyn shared::jetstream::Stream>> {
        self.inner.stream(config)
    }
    fn objects(
        &self,
        config: shared::jetstream::ObjectsConfig,
    ) -> shared::jetstream::Reply<std::sync::Arc<dyn shared::jetstream::Objects>> {
        self.inner.objects(config)
    }
    fn max_payload(&self) -> usize {
        self.inner.max_payload()
    }
    fn publish(&self, subject: String, payload: bytes::Bytes) -> shared::jetstream::Reply<()> {
        self.inner.publish(subject, payload)
    }
    fn request(&self, subject: String, payload: bytes::Bytes) -> shared::jetstream::Reply<Option<bytes::Bytes>> {
        self.inner.request(subject, payload)
    }
    fn subscribe(
        &self,
        subject: String,
    ) -> shared::jetstream::Reply<futures::stream::BoxStream<'static, shared::jetstream::Inbound>> {
        self.inner.subscribe(subject)
    }
}

impl Faults {
    fn wrap(
        self,
        inner: std::sync::Arc<dyn shared::jetstream::Bucket>,
    ) -> std::sync::Arc<dyn shared::jetstream::Bucket> {
        std::sync::Arc::new(UnansweringBucket { inner, faults: self })
    }

    fn on(flag: &std::sync::atomic::AtomicBool) -> bool {
        flag.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl shared::jetstream::Bucket for UnansweringBucket {
    fn entry(
        &self,
        key: &str,
        consistency: shared::jetstream::Consistency,
    ) -> shared::jetstream::Reply<Option<shared::jetstream::Entry>> {
        if Faults::on(&self.faults.lost) {
            return no_answer();
        }
        self.inner.entry(key, consistency)
    }
    fn create(&self, key: &str, value: bytes::Bytes) -> shared::jetstream::Reply<u64> {
        let (created, lost, hangs) = (
            self.inner.create(key, value),
            Faults::on(&self.faults.lost),
            Faults::on(&self.faults.hangs),
        );
        Box::pin(async move {
            let revision = created.await?;
            if hangs {
                return std::future::pending().await;
            }
            match lost {
                true => Err(shared::jetstream::Error::failed("no answer in time")),
                false => Ok(revision),
            }
        })
    }
    fn update(&self, key: &str, value: bytes::Bytes, revision: u64) -> shared::jetstream::Reply<u64> {
        self.inner.update(key, value, revision)
    }
    fn put(&self, key: &str, value: bytes::Bytes) -> shared::jetstream::Reply<u64> {
        self.inner.put(key, value)
    }
    fn delete(&self, key: &str, revision: Option<u64>) -> shared::jetstream::Reply<()> {
        if Faults::on(&self.faults.deletes_refused) {
            return no_answer();
        }
        self.inner.delete(key, revision)
    }
    fn keys(&self, filter: &str) -> shared::jetstream::Reply<Vec<String>> {
        self.inner.keys(filter)
    }
}

/// A runner whose start of a call landed while the store's answers were lost (the tool did not
/// run, and the record of that start could not be removed) runs the call when it is sent again:
/// the record is its own start that never ran, not a call in flight, nor one in doubt. (It once
/// waited for it, then answered the call in doubt: a call that never ran was never run.)
#[tokio::test]
async fn a_start_whose_answer_was_lost_is_run_when_the_call_comes_again() -> TestResult {
    let nats = Nats::start().await?;
    let faults = Faults::default();
    faults.deletes_refused.store(true, std::sync::atomic::Ordering::SeqCst);
    let (records, call) = unanswered_call(&nats, "lost", &faults).await?;
    faults.lost.store(true, std::sync::atomic::Ordering::SeqCst);
    let first = records.begin(&call).await;
    assert!(matches!(first, tool_runner::record::Begun::Unavailable(_)), "{first:?}");
    faults.lost.store(false, std::sync::atomic::Ordering::SeqCst);
    let kv = bucket(&nats).await?;
    assert!(kv.get("call.lost.c1").await?.is_some(), "the start landed, and stayed");
    run_when_it_comes_again(&records, &call).await
}

/// A runner whose caller left while the start of its call was being written (the write landed,
/// its answer had not come) runs the call when it is sent again: the start never ran. (It once
/// waited for it as a call in flight, then answered it in doubt, and the call never ran at all:
/// seen when a run's replica lost its lease mid-call during a NATS leader election.)
#[tokio::test]
async fn a_start_whose_caller_left_before_it_was_written_is_run_when_the_call_comes_again() -> TestResult {
    let nats = Nats::start().await?;
    let faults = Faults::default();
    let (records, call) = unanswered_call(&nats, "left", &faults).await?;
    faults.hangs.store(true, std::sync::atomic::Ordering::SeqCst);
    let left = tokio::time::timeout(Duration::from_millis(300), records.begin(&call)).await;
    assert!(left.is_err(), "the caller left before the start was answered");
    faults.hangs.store(false, std::sync::atomic::Ordering::SeqCst);
    run_when_it_comes_again(&records, &call).await
}

/// Call records of run `run_id` (claimed in epoch 1) over a store with `faults`, renewed, and
/// its durable call `c1` (not idempotent).
async fn unanswered_call(
    nats: &Nats,
    run_id: &'static str,
    faults: &Faults,
) -> anyhow::Result<(tool_runner::record::CallRecords, tool_runner::record::Call<'static>)> {
    claim(&bucket(nats).await?, run_id, 1).await?;
    let js: std::sync::Arc<dyn shared::jetstream::JetStream> = std::sync::Arc::new(Unanswering {
        inner: store(nats).await?,
        faults: faults.clone(),
    });
    let fence = tool_runner::fence::RunFence::over(js, BUCKET, Duration::from_millis(500));
    let records =
        tool_runner::record::CallRecords::new(std::sync::Arc::new(fence), "here", Duration::from_secs(3), 4096);
    records.renew().await;
    let call = tool_runner::record::Call {
        run_id,
        call_id: "c1",
        round: None,
        epoch: 1,
        idempotent: false,
        rerun_in_doubt: false,
        wait: Duration::from_secs(1),
    };
    Ok((records, call))
}

/// `call`, sent again, is run at once by `records`: not waited for, nor in doubt.
async fn run_when_it_comes_again(
    records: &tool_runner::record::CallRecords,
    call: &tool_runner::record::Call<'_>,
) -> TestResult {
    let again = records.begin(call).await;
    assert!(
        matches!(again, tool_runner::record::Begun::Run(_)),
        "run now, not waited for nor in doubt: {again:?}"
    );
    Ok(())
}
