//! A run as a test of the orchestrator's binary drives it through the Rust client: the
//! orchestrator process (on the memory store, or on NATS), a client of it, the moment a run's
//! call runs, and the run's end.

use std::time::Duration;

use orchestrator_client::{Client, ClientBuilder, Event};
use proto::orchestrator::v1 as pb;

use crate::Service;

/// The orchestrator binary `bin` on the model at `llm` and the tool-runner `runner`, with
/// `flags`, keeping its runs in the NATS at `nats` when given.
pub async fn orchestrator(
    bin: &str,
    (llm, runner): (&str, &str),
    nats: Option<&str>,
    flags: &[&str],
) -> anyhow::Result<Service> {
    let mut command = crate::orchestrator_command(bin, llm, runner);
    command.args(flags);
    let command = match nats {
        Some(nats) => crate::on_nats(command, nats),
        None => command,
    };
    Service::orchestrator(command).await
}

/// A client of `service` (plaintext, no token).
pub async fn client(service: &Service) -> anyhow::Result<Client> {
    Ok(ClientBuilder::new(format!("http://{}", service.grpc)).connect().await?)
}

/// Waits until the run's call is running: its `tool_call_started` is in the run's log.
pub async fn until_the_call_runs(client: &Client, run_id: &str) -> anyhow::Result<()> {
    let mut stream = client.attach(run_id, 0).await?;
    loop {
        match tokio::time::timeout(Duration::from_secs(20), stream.next_event()).await?? {
            Some(Event::ToolCallStarted(_)) => return Ok(()),
            Some(_) => {}
            None => anyhow::bail!("{run_id} ended before its call started"),
        }
    }
}

/// The run's result once it has ended (polled on `client`, within 30 s).
pub async fn ended(client: &Client, run_id: &str) -> anyhow::Result<pb::RunResult> {
    crate::wait::until(&format!("{run_id} to end"), Duration::from_secs(30), || async {
        let run = client.get_run(run_id).await.ok()?;
        (run.status() != pb::RunStatus::Running).then_some(run)
    })
    .await
}

/// Reads a run's gRPC event `stream` until an event `stop` picks (each within 30 s), returning
/// the events read, that one included.
pub async fn read_until(
    stream: &mut tonic::Streaming<pb::OrchestrateEvent>,
    stop: impl Fn(&pb::orchestrate_event::Event) -> bool,
) -> anyhow::Result<Vec<pb::OrchestrateEvent>> {
    use futures::StreamExt as _;
    let mut events = Vec::new();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("the stream ended after {events:?}"))??;
        let hit = event.event.as_ref().is_some_and(&stop);
        events.push(event);
        if hit {
            return Ok(events);
        }
    }
}

/// Waits (at most 40 s) until run `run_id` reads `status` on `client` (the generated client);
/// the run as it read then.
pub async fn wait_status(
    client: &pb::orchestrator_client::OrchestratorClient<tonic::transport::Channel>,
    run_id: &str,
    status: pb::RunStatus,
) -> anyhow::Result<pb::RunResult> {
    crate::wait::until(
        &format!("run {run_id} to read {status:?}"),
        Duration::from_secs(40),
        || {
            let mut client = client.clone();
            let run_id = run_id.to_owned();
            async move {
                let run = client.get_run(pb::GetRunRequest { run_id }).await.ok()?.into_inner();
                (run.status == status as i32).then_some(run)
            }
        },
    )
    .await
}

/// Orchestrator binaries (several on one NATS store, or one in memory) on a tool-runner in this
/// process serving a tools manifest, and the stand-in model: what the tests of tools that talk
/// back (questions, tasks, progress) run on.
pub struct Fleet {
    /// The replicas (`None` once a test killed one).
    pub replicas: Vec<Option<Service>>,
    /// The stand-in model (its requests show what the model was fed).
    pub llm: mock_llm::MockLlm,
    /// Where the manifest and the servers' logs are.
    pub dir: tempfile::TempDir,
    _nats: Option<crate::nats::Nats>,
}

impl Fleet {
    /// `replicas` of the orchestrator binary `bin` with `flags` (and a 2 s lease on `nats`, when
    /// given), the runner serving `manifest` (written into `dir`), the model playing `scenario`.
    pub async fn start(
        (bin, dir, manifest): (&str, tempfile::TempDir, &str),
        scenario: mock_llm::Scenario,
        (flags, replicas): (&[&str], usize),
        nats: Option<crate::nats::Nats>,
    ) -> anyhow::Result<Self> {
        let path = dir.path().join("tools.toml");
        std::fs::write(&path, manifest)?;
        let runner = crate::helpers::tool_runner_in_process_with(tool_runner::Config {
            tools_manifest: Some(path),
            ..tool_runner::Config::default()
        })
        .await?;
        let llm = mock_llm::MockLlm::start(scenario).await?;
        let (llm_url, nats_url) = (llm.base_url(), nats.as_ref().map(crate::nats::Nats::url));
        let lease: &[&str] = if nats_url.is_some() {
            &["--run-store-lease", "2s"]
        } else {
            &[]
        };
        let flags: Vec<&str> = lease.iter().chain(flags).copied().collect();
        let mut started = Vec::with_capacity(replicas);
        for _ in 0..replicas {
            started.push(Some(
                orchestrator(bin, (&llm_url, &runner), nats_url.as_deref(), &flags).await?,
            ));
        }
        Ok(Self {
            replicas: started,
            llm,
            dir,
            _nats: nats,
        })
    }

    /// A generated client of replica `i`.
    pub async fn client_of(
        &self,
        i: usize,
    ) -> anyhow::Result<pb::orchestrator_client::OrchestratorClient<tonic::transport::Channel>> {
        let replica = self.replicas[i]
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("replica {i} is gone"))?;
        Ok(pb::orchestrator_client::OrchestratorClient::connect(format!("http://{}", replica.grpc)).await?)
    }

    /// The lines of `file` in the fleet's directory (a server's log; none before it wrote one).
    pub fn lines_of(&self, file: &str) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join(file))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// The tool messages the model was fed in its last request, joined.
    pub fn fed_back(&self) -> String {
        self.llm
            .requests()
            .last()
            .and_then(|r| r["messages"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter(|m| m["role"] == "tool")
            .filter_map(|m| m["content"].as_str().map(str::to_owned))
            .collect::<Vec<_>>()
            .join("\n")
    }
}
