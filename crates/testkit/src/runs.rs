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
