//! The model fleet through the real binaries: the orchestrator in front of two stand-in model
//! server processes (`mock-llm`), one of them SIGKILLed while it streams.

use std::process::Stdio;
use std::time::Duration;

use proto::orchestrator::v1 as pb;
use proto::orchestrator::v1::orchestrate_event::Event as E;
use testkit::{Service, user};
use tokio::process::{Child, Command};

type TestResult = anyhow::Result<()>;

/// A `mock-llm` process serving `scenario` on a free loopback port.
struct ModelProcess {
    child: Child,
    base_url: String,
    _scenario: tempfile::NamedTempFile,
}

impl ModelProcess {
    async fn start(scenario: &mock_llm::Scenario) -> anyhow::Result<Self> {
        let file = tempfile::NamedTempFile::new()?;
        std::fs::write(file.path(), serde_json::to_vec(scenario)?)?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let child = Command::new(testkit::sibling_bin(env!("CARGO_BIN_EXE_orchestrator"), "mock-llm")?)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--scenarios")
            .arg(file.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        testkit::wait::until("mock-llm to listen", Duration::from_secs(20), || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok().map(drop)
        })
        .await?;
        Ok(Self {
            child,
            base_url: format!("http://127.0.0.1:{port}/v1"),
            _scenario: file,
        })
    }
}

/// Streams a run to its end: its result, its turn restarts, and its text as the caller keeps it
/// (a turn that starts again takes back what it streamed).
async fn watch(service: &Service, request: pb::OrchestrateRequest) -> anyhow::Result<(pb::RunResult, usize, String)> {
    let mut client = pb::orchestrator_client::OrchestratorClient::connect(format!("http://{}", service.grpc)).await?;
    let mut stream = client.orchestrate(request).await?.into_inner();
    let (mut pieces, mut restarts) = (Vec::<(u32, String)>::new(), 0);
    while let Some(event) = stream.message().await? {
        match event.event {
            Some(E::TextDelta(d)) => pieces.push((d.turn, d.text)),
            Some(E::TurnRestarted(r)) => {
                restarts += 1;
                pieces.retain(|(turn, _)| *turn != r.turn);
            }
            Some(E::RunFinished(f)) => {
                let result = f.result.unwrap_or_default();
                let text = pieces.into_iter().map(|(_, t)| t).collect();
                return Ok((result, restarts, text));
            }
            _ => {}
        }
    }
    anyhow::bail!("the stream ended without run_finished")
}

#[tokio::test]
async fn a_model_server_killed_mid_stream_costs_its_runs_a_turn_restart_not_the_run() -> TestResult {
    // A slow answer: about 2 s of words, so the kill lands mid-stream.
    let words: String = (0..100).map(|i| format!("word{i} ")).collect();
    let scenario = mock_llm::Scenario {
        token_delay_ms: 20,
        ..mock_llm::Scenario::new(vec![mock_llm::Turn::text(&words)])
    };
    let mut a = ModelProcess::start(&scenario).await?;
    let b = ModelProcess::start(&scenario).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let models = format!("{},{}", a.base_url, b.base_url);
    let mut command = testkit::orchestrator_command(env!("CARGO_BIN_EXE_orchestrator"), &models, &runner);
    command.env("LLM_IDLE_TIMEOUT", "2s");
    let service = Service::orchestrator(command).await?;
    let runs: Vec<_> = (0..10)
        .map(|n| {
            let service = &service;
            async move { watch(service, user(&format!("run {n}"))).await }
        })
        .collect();
    let kill = async {
        // Stays: the kill lands wherever the ten runs are then (mid-stream for some, between
        // turns for others); every outcome is checked, so no moment is wrong.
        tokio::time::sleep(Duration::from_millis(700)).await;
        a.child.start_kill()
    };
    let (outcomes, killed) = tokio::join!(futures::future::try_join_all(runs), kill);
    killed?;
    let mut restarted = 0;
    for (result, restarts, text) in outcomes? {
        assert_eq!(result.status(), pb::RunStatus::Completed, "{result:?}");
        assert_eq!(result.text, words, "the whole answer, once");
        assert_eq!(text, result.text, "the caller's text equals the result's");
        restarted += restarts;
    }
    assert!(restarted > 0, "no run was streaming from the killed server");
    service.stop().await
}
