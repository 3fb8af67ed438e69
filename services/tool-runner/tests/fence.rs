//! The run fence at the receiver, against a real `nats-server -js`: two runners given the run
//! store refuse a call sent in an older epoch than the run's fence before its tool runs, each
//! reading the fence from the store (neither has seen the newer epoch's calls), say which epochs
//! met, and refuse a durable call `UNAVAILABLE`, unrun, while the store cannot be read.

use std::time::Duration;

use proto::toolrunner::v1 as pb;
use testkit::Runner;
use testkit::nats::Nats;

type TestResult = anyhow::Result<()>;

/// The orchestrators' run-store bucket, as they create it.
const BUCKET: &str = "orchestrator-runs";

/// A command tool `record` that appends `<run id>/<call id> <epoch>` to `log`: what ran.
fn manifest(dir: &std::path::Path, log: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    let path = dir.join("tools.toml");
    let script = format!(
        "echo \"$TOOL_RUN_ID/$TOOL_CALL_ID $TOOL_RUN_EPOCH\" >> {}; printf '{{}}'",
        log.display()
    );
    std::fs::write(
        &path,
        format!(
            "[[tool]]\nname = \"record\"\ndescription = \"records its call\"\nargv = [\"sh\", \"-c\", {script:?}]\n"
        ),
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

/// `record` for `call` of `run` sent in `epoch`: what the runner answered.
async fn call(runner: &Runner, run: &str, call: &str, epoch: u64) -> anyhow::Result<Result<(), tonic::Status>> {
    let request = pb::RunToolRequest {
        run_id: run.to_owned(),
        call_id: call.to_owned(),
        tool_name: "record".to_owned(),
        arguments_json: "{}".to_owned(),
        epoch,
        ..Default::default()
    };
    Ok(runner.client().await?.run_tool(request).await.map(|_| ()))
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
