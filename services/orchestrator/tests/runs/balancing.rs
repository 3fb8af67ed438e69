//! Balancing over tool-runner replicas, standing in for pods with runner processes on distinct
//! loopback addresses (127.0.0.2, 127.0.0.3, 127.0.0.4). The orchestrator runs in-process with a
//! DNS resolver whose answers the test controls; each runner's `/metrics` tells where calls went.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use mock_llm::{Scenario, Step, Turn};
use orchestrator::tool_runners::Resolve;
use proto::orchestrator::v1 as pb;
use testkit::{Service, orchestrate, scrape, user};
use tokio::process::Command;

type TestResult = anyhow::Result<()>;

/// A resolver answering whatever the test last set, for `tool-runner.test` and `model.test`,
/// counting the lookups of each (so a test waits for the answer it set to be read).
#[derive(Clone, Default)]
struct Scripted {
    runners: Arc<Mutex<Vec<SocketAddr>>>,
    models: Arc<Mutex<Vec<SocketAddr>>>,
    runner_lookups: Arc<std::sync::atomic::AtomicUsize>,
    model_lookups: Arc<std::sync::atomic::AtomicUsize>,
}

impl Scripted {
    /// Answers `addrs` for `tool-runner.test` from now on, and waits until the orchestrator has
    /// looked it up twice since (a whole re-resolution on the new answer).
    async fn set(&self, addrs: &[SocketAddr]) -> anyhow::Result<()> {
        Self::answer(&self.runners, addrs);
        Self::read_twice(&self.runner_lookups, "tool-runner.test").await
    }

    /// [`Scripted::set`] for `model.test`.
    async fn set_models(&self, addrs: &[SocketAddr]) -> anyhow::Result<()> {
        Self::answer(&self.models, addrs);
        Self::read_twice(&self.model_lookups, "model.test").await
    }

    /// The first answers, before anyone looks them up.
    fn first(self, runners: &[SocketAddr], models: &[SocketAddr]) -> Self {
        Self::answer(&self.runners, runners);
        Self::answer(&self.models, models);
        self
    }

    fn answer(answers: &Mutex<Vec<SocketAddr>>, addrs: &[SocketAddr]) {
        if let Ok(mut a) = answers.lock() {
            *a = addrs.to_vec();
        }
    }

    async fn read_twice(lookups: &std::sync::atomic::AtomicUsize, host: &str) -> anyhow::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        let since = lookups.load(SeqCst);
        let what = format!("two lookups of {host} after its answer changed");
        testkit::wait::until_sync(&what, Duration::from_secs(10), || {
            (lookups.load(SeqCst) >= since + 2).then_some(())
        })
        .await
    }
}

impl Resolve for Scripted {
    fn resolve(&self, host: &str, _port: u16) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> {
        use std::sync::atomic::Ordering::SeqCst;
        let answers = match host {
            "tool-runner.test" => Some((&self.runners, &self.runner_lookups)),
            "model.test" => Some((&self.models, &self.model_lookups)),
            _ => None,
        };
        let answer = if let Some((answers, lookups)) = answers {
            let answer = answers
                .lock()
                .map(|a| a.clone())
                .map_err(|_| std::io::Error::other("poisoned"));
            lookups.fetch_add(1, SeqCst);
            answer
        } else {
            Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("no such host {host}"),
            ))
        };
        futures::future::ready(answer).boxed()
    }
}

/// A turn of `n` parallel calls of `tool` with `args`, then a closing text.
fn burst(n: usize, tool: &str, args: serde_json::Value) -> Scenario {
    let mut turn = Turn::text("Fanning out.\n");
    for _ in 0..n {
        turn = turn.then(Step::call(tool, args.clone()));
    }
    Scenario::new(vec![turn, Turn::text("Done.")])
}

/// Starts the in-process orchestrator against the stand-in model; returns its endpoint.
async fn orchestrator(
    mock: &mock_llm::MockLlm,
    targets: Vec<String>,
    resolver: Scripted,
) -> anyhow::Result<(String, tokio::sync::oneshot::Sender<()>)> {
    let config = orchestrator::Config::new(&mock.base_url(), "stand-in", targets);
    orchestrator_with(config_for(config), resolver).await
}

fn config_for(mut config: orchestrator::Config) -> orchestrator::Config {
    config.tool_runners.resolve_interval = Duration::from_millis(100);
    config.llm.endpoint_resolve_interval = Duration::from_millis(100);
    config
}

/// Starts the in-process orchestrator with `config`; returns its endpoint.
async fn orchestrator_with(
    mut config: orchestrator::Config,
    resolver: Scripted,
) -> anyhow::Result<(String, tokio::sync::oneshot::Sender<()>)> {
    config.limits.max_tool_failures = 10;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}", listener.local_addr()?);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(orchestrator::server::serve_with_resolver(
        listener,
        config,
        Arc::new(resolver),
        async move {
            let _ = stopped.await;
        },
    ));
    Ok((endpoint, stop))
}

/// Runs `n` runs at once.
async fn runs(endpoint: &str, n: usize) -> anyhow::Result<Vec<pb::RunResult>> {
    futures::future::join_all((0..n).map(|_| orchestrate(endpoint, user("go"))))
        .await
        .into_iter()
        .collect()
}

async fn executed(runner: &Service, tool: &str, outcome: &str) -> anyhow::Result<f64> {
    let series = format!("tool_runner_executions_total{{outcome=\"{outcome}\",tool=\"{tool}\"}}");
    Ok(scrape(&runner.metrics).await?.get(&series).copied().unwrap_or(0.0))
}

fn runner(extra: &[&str]) -> anyhow::Result<Command> {
    let mut command = Command::new(testkit::tool_runner_bin!()?);
    command.args(extra).env_remove("OTEL_EXPORTER_OTLP_ENDPOINT");
    Ok(command)
}

/// Three runners on 127.0.0.2-4, all on the same port (as pods behind one headless Service).
async fn three_on_one_port(extra: &[&str]) -> anyhow::Result<Vec<Service>> {
    let first = Service::spawn(runner(extra)?, "127.0.0.2", "tool-runner serving").await?;
    let port = first
        .grpc
        .rsplit_once(':')
        .map(|(_, p)| p.to_owned())
        .unwrap_or_default();
    let mut all = vec![first];
    for ip in ["127.0.0.3", "127.0.0.4"] {
        all.push(Service::spawn_on(runner(extra)?, &format!("{ip}:{port}"), ip, "tool-runner serving").await?);
    }
    Ok(all)
}

fn addr(service: &Service) -> anyhow::Result<SocketAddr> {
    Ok(service.grpc.parse()?)
}

#[tokio::test]
async fn dns_answers_add_and_remove_replicas_and_calls_spread_over_them() -> TestResult {
    let runners = three_on_one_port(&[]).await?;
    let port = addr(&runners[0])?.port();
    let resolver = Scripted::default().first(&[addr(&runners[0])?, addr(&runners[1])?], &[]);
    let mock = mock_llm::MockLlm::start(burst(12, "echo", serde_json::json!({"x": 1}))).await?;
    let (endpoint, _stop) =
        orchestrator(&mock, vec![format!("dns:///tool-runner.test:{port}")], resolver.clone()).await?;

    for result in runs(&endpoint, 2).await? {
        assert_eq!((result.status(), result.failed_turns), (pb::RunStatus::Completed, 0));
    }
    let counts = [
        executed(&runners[0], "echo", "ok").await?,
        executed(&runners[1], "echo", "ok").await?,
        executed(&runners[2], "echo", "ok").await?,
    ];
    assert_eq!(counts.iter().sum::<f64>(), 24.0, "{counts:?}");
    assert!(
        counts[0] > 0.0 && counts[1] > 0.0,
        "both resolved replicas got calls: {counts:?}"
    );
    assert_eq!(counts[2], 0.0, "a replica not in the answer gets nothing: {counts:?}");

    // A new pod appears in the answer: after re-resolution it receives traffic.
    resolver
        .set(&[addr(&runners[0])?, addr(&runners[1])?, addr(&runners[2])?])
        .await?;
    runs(&endpoint, 2).await?;
    assert!(
        executed(&runners[2], "echo", "ok").await? > 0.0,
        "the new replica receives calls"
    );

    // A pod leaves the answer: no call goes to it any more.
    resolver.set(&[addr(&runners[1])?, addr(&runners[2])?]).await?;
    let before = executed(&runners[0], "echo", "ok").await?;
    runs(&endpoint, 2).await?;
    assert_eq!(
        executed(&runners[0], "echo", "ok").await?,
        before,
        "the removed replica gets nothing"
    );
    for runner in runners {
        runner.stop().await?;
    }
    Ok(())
}

#[tokio::test]
async fn a_runner_at_its_limit_sheds_calls_to_the_others() -> TestResult {
    let busy = Service::spawn(runner(&["--max-concurrency", "1"])?, "127.0.0.2", "tool-runner serving").await?;
    let others = [
        Service::spawn(runner(&[])?, "127.0.0.3", "tool-runner serving").await?,
        Service::spawn(runner(&[])?, "127.0.0.4", "tool-runner serving").await?,
    ];
    let targets = [&busy, &others[0], &others[1]]
        .iter()
        .map(|s| format!("http://{}", s.grpc))
        .collect();
    let mock = mock_llm::MockLlm::start(burst(24, "sleep", serde_json::json!({"ms": 300}))).await?;
    let (endpoint, _stop) = orchestrator(&mock, targets, Scripted::default()).await?;

    let result = orchestrate(&endpoint, user("go")).await?;
    assert_eq!(
        (result.status(), result.failed_turns),
        (pb::RunStatus::Completed, 0),
        "{:?}",
        result.tool_calls.iter().filter(|c| !c.ok).collect::<Vec<_>>()
    );
    assert!(result.tool_calls.iter().all(|c| c.ok));
    let metrics = scrape(&busy.metrics).await?;
    let refused = metrics
        .get("tool_runner_rejected_total{reason=\"concurrency_limit\"}")
        .copied()
        .unwrap_or(0.0);
    assert!(refused >= 1.0, "the full runner refused calls: {refused}");
    let ran: f64 = executed(&busy, "sleep", "ok").await?
        + executed(&others[0], "sleep", "ok").await?
        + executed(&others[1], "sleep", "ok").await?;
    assert_eq!(ran, 24.0, "every call ran exactly once");
    busy.stop().await?;
    for runner in others {
        runner.stop().await?;
    }
    Ok(())
}

#[tokio::test]
async fn killing_a_runner_mid_burst_fails_only_its_calls_in_flight() -> TestResult {
    let mut runners = three_on_one_port(&[]).await?;
    let targets = runners.iter().map(|s| format!("http://{}", s.grpc)).collect();
    let mock = mock_llm::MockLlm::start(burst(6, "sleep", serde_json::json!({"ms": 1000}))).await?;
    let (endpoint, _stop) = orchestrator(&mock, targets, Scripted::default()).await?;

    let burst = tokio::spawn({
        let endpoint = endpoint.clone();
        async move { runs(&endpoint, 3).await }
    });
    let victim = runners.remove(0);
    testkit::wait::until(
        "calls in flight on the runner to kill",
        Duration::from_secs(10),
        || async {
            let metrics = testkit::scrape(&victim.metrics).await.ok()?;
            let in_flight = metrics.get("tool_runner_executions_in_flight{}").copied()?;
            (in_flight > 0.0).then_some(())
        },
    )
    .await?;
    victim.kill().await?;
    let results = burst.await??;
    let mut lost = 0;
    for result in &results {
        // The runs go on under the normal rules: a failed call is fed back, the turn counts once.
        assert_eq!(result.status(), pb::RunStatus::Completed);
        for call in result.tool_calls.iter().filter(|c| !c.ok) {
            assert_eq!(
                call.error.as_ref().map(|e| e.code.as_str()),
                Some("UNAVAILABLE"),
                "{call:?}"
            );
            lost += 1;
        }
    }
    assert!(lost > 0, "some calls were in flight on the killed runner");
    let ran = executed(&runners[0], "sleep", "ok").await? + executed(&runners[1], "sleep", "ok").await?;
    assert_eq!(ran + f64::from(lost), 18.0, "every other call ran on a survivor");

    // Every later call goes to the survivors, and none is lost: the dead endpoint is still in the
    // static list, and a call that cannot reach it is retried elsewhere.
    for result in runs(&endpoint, 3).await? {
        assert_eq!(
            (result.status(), result.failed_turns),
            (pb::RunStatus::Completed, 0),
            "{:?}",
            result.tool_calls
        );
    }
    for runner in runners {
        runner.stop().await?;
    }
    Ok(())
}

/// Requests a stand-in served.
fn served(mock: &mock_llm::MockLlm) -> usize {
    mock.requests().len()
}

#[tokio::test]
async fn model_endpoints_follow_the_dns_answer() -> TestResult {
    let answer = || Scenario::new(vec![Turn::text("Hello.")]);
    let a = mock_llm::MockLlm::start_on("127.0.0.2:0".parse()?, answer()).await?;
    let port = a
        .base_url()
        .rsplit_once(':')
        .map(|(_, p)| p.trim_end_matches("/v1").to_owned());
    let port = port.unwrap_or_default();
    let b = mock_llm::MockLlm::start_on(format!("127.0.0.3:{port}").parse()?, answer()).await?;
    let (a_addr, b_addr): (SocketAddr, SocketAddr) = (
        format!("127.0.0.2:{port}").parse()?,
        format!("127.0.0.3:{port}").parse()?,
    );
    let resolver = Scripted::default().first(&[], &[a_addr]);
    let runner = testkit::inprocess::Runner::start(testkit::stack::runner_config(None)).await?;
    let mut config = orchestrator::Config::new(
        &format!("dns:///model.test:{port}/v1"),
        "stand-in",
        vec![format!("http://{}", runner.addr)],
    );
    config.llm.max_retries = 0;
    let (endpoint, _stop) = orchestrator_with(config_for(config), resolver.clone()).await?;
    let all_completed = |results: Vec<pb::RunResult>| {
        assert!(
            results.iter().all(|r| r.status == pb::RunStatus::Completed as i32),
            "{results:?}"
        );
    };
    all_completed(runs(&endpoint, 8).await?);
    assert_eq!((served(&a), served(&b)), (8, 0));
    // A second address: new runs spread over both.
    resolver.set_models(&[a_addr, b_addr]).await?;
    all_completed(runs(&endpoint, 24).await?);
    assert!(served(&b) > 0, "b served none of 24 runs");
    // The first address gone: nothing more goes there.
    resolver.set_models(&[b_addr]).await?;
    let on_a = served(&a);
    all_completed(runs(&endpoint, 8).await?);
    assert_eq!(served(&a), on_a);
    Ok(())
}

/// Two tool-runners behind one orchestrator that serve different tools make its catalog follow
/// whichever answers a refresh: the orchestrator says so in a warning naming what only each
/// one lists, and the flag that lists the runners.
#[tokio::test]
async fn runners_serving_different_tools_are_warned_of() -> TestResult {
    let dir = tempfile::tempdir()?;
    let manifest = dir.path().join("tools.toml");
    std::fs::write(
        &manifest,
        "[[tool]]\nname = \"refund\"\ndescription = \"refunds\"\nargv = [\"true\"]\n",
    )?;
    let plain = Service::spawn(runner(&[])?, "127.0.0.2", "tool-runner serving").await?;
    let manifest = manifest.display().to_string();
    let more = runner(&["--tools-manifest", &manifest])?;
    let more = Service::spawn(more, "127.0.0.3", "tool-runner serving").await?;
    let mock = mock_llm::MockLlm::start(Scenario::new(vec![Turn::text("Hi.")])).await?;
    let runners = format!("http://{},http://{}", plain.grpc, more.grpc);
    let mut command = testkit::orchestrator_command(env!("CARGO_BIN_EXE_orchestrator"), &mock.base_url(), &runners);
    command.args(["--tool-refresh-interval", "1s"]);
    let orchestrator = Service::orchestrator(command).await?;
    let warned = orchestrator
        .logged("tool-runners serve different tools", Duration::from_secs(30))
        .await;
    let logs = orchestrator.logs().join("\n");
    assert!(warned, "{logs}");
    let line = logs
        .lines()
        .find(|l| l.contains("tool-runners serve different tools"))
        .unwrap_or_default();
    assert!(
        line.contains("lists refund") && line.contains("--tool-runner"),
        "{line}"
    );
    orchestrator.stop().await?;
    plain.stop().await?;
    more.stop().await
}
