//! What a `ListRuns` page costs with many stored runs (`bench --list-runs N`): N ended runs of
//! ten principals are written through the NATS store's own adapter (each entered in the run
//! index, claimed and ended as a replica does it), then an orchestrator process on that NATS
//! answers pages of 50 for the queries people ask: everything (an operator), one principal's,
//! one principal's with a label, the failed ones (1 in 100), the live ones (none: the fleet's
//! checkpoints), and twenty pages deep by cursor. Beside them, the peer a page is read against:
//! one `GetRun` (one record read) through the same server. Writes `list_runs.md` / `.json`.

use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use orchestrator::domain::ports::ResultStore as _;
use orchestrator::domain::{RunResult, RunStatus};
use proto::orchestrator::v1 as pb;
use serde::Serialize;

/// The orchestrators' run bucket.
const BUCKET: &str = "orchestrator-runs";
/// Principals the runs are spread over.
const PRINCIPALS: usize = 10;
/// Label values of `team` (a run of one principal with one label is 1 in 200).
const TEAMS: usize = 20;
/// Calls per query.
const CALLS: usize = 50;
/// Rows per page.
const PAGE: u32 = 50;

/// One query's figures.
#[derive(Debug, Serialize)]
struct Row {
    query: String,
    rows_per_page: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// p50 as a multiple of one `GetRun`'s p50.
    x_get_run: f64,
}

/// See the module docs.
pub(crate) async fn run(bin: &Path, runs: usize, out: &Path) -> anyhow::Result<()> {
    let nats = testkit::nats::Nats::start().await?;
    let filled = fill(&nats.url(), runs).await?;
    eprintln!("bench: {runs} ended runs stored in {:.1} s", filled.as_secs_f64());
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens.toml");
    let mut entries: Vec<(String, String, &str)> = (0..PRINCIPALS)
        .map(|p| (format!("p{p}"), format!("p{p}-token"), ""))
        .collect();
    entries.push(("ops".into(), "ops-token".into(), "roles = [\"operator\"]"));
    let borrowed: Vec<(&str, &str, &str)> = entries.iter().map(|(a, b, c)| (a.as_str(), b.as_str(), *c)).collect();
    std::fs::write(&tokens, testkit::pki::tokens_toml(&borrowed))?;
    let llm = mock_llm::MockLlm::start(mock_llm::Scenario::new(vec![mock_llm::Turn::text("ok")])).await?;
    let runner = testkit::helpers::tool_runner_in_process_with(tool_runner::Config::default()).await?;
    let mut command = testkit::on_nats(
        testkit::orchestrator_command(&bin.display().to_string(), &llm.base_url(), &runner),
        &nats.url(),
    );
    command.args(["--auth-tokens", &tokens.display().to_string()]);
    let orchestrator = testkit::Service::orchestrator(command).await?;
    let mut client =
        pb::orchestrator_client::OrchestratorClient::connect(format!("http://{}", orchestrator.grpc)).await?;

    let get_run = measure(CALLS, || {
        let mut client = client.clone();
        async move {
            let request = authorized("p1-token", pb::GetRunRequest { run_id: "run-1".into() });
            client.get_run(request).await.map(|_| 1usize)
        }
    })
    .await?;
    let mut rows = Vec::new();
    for (name, token, request) in queries() {
        let (rows_per_page, p50, p99) = measure(CALLS, || {
            let (mut client, request) = (client.clone(), request.clone());
            async move {
                let page = client.list_runs(authorized(token, request)).await?.into_inner();
                Ok::<_, tonic::Status>(page.runs.len())
            }
        })
        .await?;
        rows.push(row(name, rows_per_page, p50, p99, get_run.1));
    }
    rows.push(deep_pages(&mut client, get_run.1).await?);
    let report = render(&rows, runs, get_run, filled);
    print!("{report}");
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("list_runs.md"), &report)?;
    std::fs::write(out.join("list_runs.json"), serde_json::to_string_pretty(&rows)?)?;
    Ok(())
}

/// Writes `runs` ended runs as replicas do: entered in the index, claimed, ended.
async fn fill(nats: &str, runs: usize) -> anyhow::Result<Duration> {
    let js = async_nats::jetstream::new(async_nats::connect(nats).await?);
    let ttl = Duration::from_secs(24 * 3600);
    let lease = Duration::from_secs(15);
    let store = orchestrator::store::nats::KvStore::open(&js, BUCKET, ttl, "bench-filler".into(), lease, 1).await?;
    let store = std::sync::Arc::new(store);
    let started = Instant::now();
    let base = shared::sync::unix_ms() - u64::try_from(runs)?;
    let mut written = futures::stream::iter(0..runs)
        .map(|i| {
            let store = std::sync::Arc::clone(&store);
            async move {
                let mut run = RunResult::running(&format!("run-{i}"));
                run.principal = format!("p{}", i % PRINCIPALS);
                run.labels
                    .insert("team".into(), format!("t{}", (i / PRINCIPALS) % TEAMS));
                run.created_at_ms = base + u64::try_from(i).unwrap_or(0);
                store.claim(run.clone()).await?;
                run.status = if i % 100 == 7 {
                    RunStatus::Failed
                } else {
                    RunStatus::Completed
                };
                run.turns = 2;
                run.updated_at_ms = run.created_at_ms;
                store.put(run).await
            }
        })
        .buffer_unordered(256);
    let mut done = 0usize;
    while let Some(result) = written.next().await {
        result?;
        done += 1;
        if done.is_multiple_of(20_000) {
            eprintln!("bench: {done} of {runs} runs stored");
        }
    }
    Ok(started.elapsed())
}

/// The queries measured: a name, the caller's token, the request.
fn queries() -> Vec<(&'static str, &'static str, pb::ListRunsRequest)> {
    let page = |request: pb::ListRunsRequest| pb::ListRunsRequest {
        page_size: PAGE,
        ..request
    };
    let status = |s: pb::RunStatus| pb::ListRunsRequest {
        statuses: vec![s as i32],
        ..Default::default()
    };
    vec![
        (
            "every run (operator), first page",
            "ops-token",
            page(Default::default()),
        ),
        (
            "one principal's runs (1 in 10), first page",
            "p3-token",
            page(Default::default()),
        ),
        (
            "one principal's with a label (1 in 200)",
            "p3-token",
            page(pb::ListRunsRequest {
                labels: [("team".to_owned(), "t5".to_owned())].into(),
                ..Default::default()
            }),
        ),
        (
            "failed runs (1 in 100, operator)",
            "ops-token",
            page(status(pb::RunStatus::Failed)),
        ),
        (
            "live runs (none; the fleet's checkpoints)",
            "ops-token",
            page(status(pb::RunStatus::Running)),
        ),
    ]
}

/// Twenty pages from the top by cursor (an operator's), each page timed.
async fn deep_pages(
    client: &mut pb::orchestrator_client::OrchestratorClient<tonic::transport::Channel>,
    get_run_p50: f64,
) -> anyhow::Result<Row> {
    let mut samples = Vec::new();
    let mut request = pb::ListRunsRequest {
        page_size: PAGE,
        ..Default::default()
    };
    let mut listed = 0usize;
    for _ in 0..20 {
        let started = Instant::now();
        let page = client
            .list_runs(authorized("ops-token", request.clone()))
            .await?
            .into_inner();
        samples.push(started.elapsed().as_secs_f64() * 1000.0);
        listed += page.runs.len();
        request.page_token = page.next_page_token;
    }
    let (p50, p99) = quantiles(&mut samples);
    Ok(row(
        "pages 1-20 by cursor (operator)",
        listed as f64 / 20.0,
        p50,
        p99,
        get_run_p50,
    ))
}

fn row(query: &str, rows_per_page: f64, p50: f64, p99: f64, get_run_p50: f64) -> Row {
    Row {
        query: query.to_owned(),
        rows_per_page,
        p50_ms: p50,
        p99_ms: p99,
        x_get_run: p50 / get_run_p50,
    }
}

/// `calls` calls one after the other: rows per call, p50 and p99 in ms.
async fn measure<F, E>(calls: usize, mut call: impl FnMut() -> F) -> anyhow::Result<(f64, f64, f64)>
where
    F: Future<Output = Result<usize, E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    let (mut samples, mut rows) = (Vec::with_capacity(calls), 0usize);
    for _ in 0..calls {
        let started = Instant::now();
        rows += call().await?;
        samples.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    let (p50, p99) = quantiles(&mut samples);
    Ok((rows as f64 / calls as f64, p50, p99))
}

fn quantiles(samples: &mut [f64]) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

fn authorized<T>(token: &str, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Ok(value) = format!("Bearer {token}").parse() {
        request.metadata_mut().insert("authorization", value);
    }
    request
}

fn render(rows: &[Row], runs: usize, get_run: (f64, f64, f64), filled: Duration) -> String {
    let mut text = format!(
        "# ListRuns with {runs} stored runs (NATS store, one replica)\n\n{runs} ended runs of {PRINCIPALS} principals written in {:.1} s; pages of {PAGE}, {CALLS} calls each, one after the other. The peer: one GetRun (one record read) through the same server, p50 {:.2} ms, p99 {:.2} ms.\n\n| query | rows per page | p50 (ms) | p99 (ms) | p50 × GetRun |\n|---|---:|---:|---:|---:|\n",
        filled.as_secs_f64(),
        get_run.1,
        get_run.2
    );
    for row in rows {
        text.push_str(&format!(
            "| {} | {:.1} | {:.2} | {:.2} | {:.1} |\n",
            row.query, row.rows_per_page, row.p50_ms, row.p99_ms, row.x_get_run
        ));
    }
    text
}
