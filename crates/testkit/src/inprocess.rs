//! The real services started in this process on loopback port 0 (one build, fast), with the
//! generated clients connected: a served service ([`Served`]), a tool-runner ([`Runner`]), and an
//! orchestrator with the stand-in model and a tool-runner ([`stack::Stack`]).

use std::net::SocketAddr;
use std::time::Duration;

use proto::toolrunner::v1 as pb;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

/// A service's `serve(listener, config, shutdown)` spawned in this process on 127.0.0.1:0, with its
/// shutdown future under the test's control; aborted when dropped.
pub struct Served<E> {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), E>>>,
}

impl<E: std::error::Error + Send + Sync + 'static> Served<E> {
    /// Binds 127.0.0.1:0 and spawns `serve(listener, shutdown)`.
    pub async fn spawn<Fut>(
        run: impl FnOnce(tokio::net::TcpListener, std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>) -> Fut,
    ) -> anyhow::Result<Self>
    where
        Fut: std::future::Future<Output = Result<(), E>> + Send + 'static,
    {
        crate::arm_watchdog();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(run(
            listener,
            Box::pin(async move {
                let _ = stopped.await;
            }),
        ));
        Ok(Self {
            addr,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Triggers the drain (as SIGTERM would) without waiting for it.
    pub fn begin_shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Triggers the drain and waits until the server has stopped.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        self.begin_shutdown();
        match self.task.take() {
            Some(task) => Ok(tokio::time::timeout(Duration::from_secs(30), task).await???),
            None => Ok(()),
        }
    }
}

impl<E> Drop for Served<E> {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A tool-runner serving in this process.
pub struct Runner {
    /// Where it listens.
    pub addr: SocketAddr,
    server: Served<tool_runner::Error>,
}

impl Runner {
    /// Starts `tool_runner::serve` on 127.0.0.1:0 with `config`.
    pub async fn start(config: tool_runner::Config) -> anyhow::Result<Self> {
        let server = Served::spawn(|listener, shutdown| tool_runner::serve(listener, config, shutdown)).await?;
        Ok(Self {
            addr: server.addr,
            server,
        })
    }

    /// A channel to it.
    pub async fn channel(&self) -> anyhow::Result<Channel> {
        Ok(Channel::from_shared(format!("http://{}", self.addr))?.connect().await?)
    }

    /// A tool-runner client.
    pub async fn client(&self) -> anyhow::Result<pb::tool_runner_client::ToolRunnerClient<Channel>> {
        Ok(pb::tool_runner_client::ToolRunnerClient::new(self.channel().await?))
    }

    /// The tools it lists (`ListTools`).
    pub async fn tools(&self) -> anyhow::Result<Vec<pb::ToolSpec>> {
        Ok(self
            .client()
            .await?
            .list_tools(pb::ListToolsRequest {})
            .await?
            .into_inner()
            .tools)
    }

    /// Triggers the drain (as SIGTERM would) without waiting for it.
    pub fn begin_shutdown(&mut self) {
        self.server.begin_shutdown();
    }

    /// Triggers the drain and waits until the server has stopped.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        self.server.shutdown().await
    }
}

/// The services reflection lists on `channel`, asked through reflection v1 and then v1alpha.
pub async fn reflected_services(channel: Channel) -> anyhow::Result<[Vec<String>; 2]> {
    // The two versions are the same messages in two packages.
    macro_rules! list_services {
        ($version:ident) => {{
            use tonic_reflection::pb::$version as pb;
            let request = pb::ServerReflectionRequest {
                host: String::new(),
                message_request: Some(pb::server_reflection_request::MessageRequest::ListServices(
                    String::new(),
                )),
            };
            let answer = pb::server_reflection_client::ServerReflectionClient::new(channel.clone())
                .server_reflection_info(tokio_stream::iter([request]))
                .await?
                .into_inner()
                .message()
                .await?
                .and_then(|r| r.message_response);
            let Some(pb::server_reflection_response::MessageResponse::ListServicesResponse(list)) = answer else {
                anyhow::bail!(
                    "reflection {} did not list the services: {answer:?}",
                    stringify!($version)
                );
            };
            list.service.into_iter().map(|s| s.name).collect::<Vec<String>>()
        }};
    }
    Ok([list_services!(v1), list_services!(v1alpha)])
}

/// A `RunTool` request with empty ids and metadata.
pub fn run_tool(tool: &str, arguments_json: &str) -> pb::RunToolRequest {
    pb::RunToolRequest {
        run_id: "test-run".into(),
        call_id: "test-call".into(),
        tool_name: tool.into(),
        arguments_json: arguments_json.into(),
        ..Default::default()
    }
}

/// What a `RunTool` answered, flattened for assertions.
#[derive(Debug)]
pub enum Outcome {
    /// The result, parsed.
    Ok(serde_json::Value),
    /// The tool error: code and message.
    Err(pb::ToolErrorCode, String),
    /// The tool's questions for a person.
    Asked(pb::ToolInputRequired),
    /// The task the server made of the call, still working.
    Task(pb::ToolTask),
    /// The call is in doubt: it started on a runner that went away before its outcome was kept.
    InDoubt(pb::ToolInDoubt),
}

impl Outcome {
    /// From a response.
    pub fn of(response: pb::RunToolResponse) -> anyhow::Result<Self> {
        Ok(match response.outcome {
            Some(pb::run_tool_response::Outcome::ContentJson(json)) => Self::Ok(serde_json::from_str(&json)?),
            Some(pb::run_tool_response::Outcome::Error(e)) => {
                Self::Err(pb::ToolErrorCode::try_from(e.code)?, e.message)
            }
            Some(pb::run_tool_response::Outcome::InputRequired(asked)) => Self::Asked(asked),
            Some(pb::run_tool_response::Outcome::Task(task)) => Self::Task(task),
            Some(pb::run_tool_response::Outcome::InDoubt(doubt)) => Self::InDoubt(doubt),
            None => anyhow::bail!("response has no outcome"),
        })
    }

    /// The result, or a test failure naming the error.
    pub fn unwrap_ok(self) -> serde_json::Value {
        match self {
            Self::Ok(v) => v,
            Self::Err(code, message) => panic!("expected a result, got {code:?}: {message}"),
            Self::Asked(asked) => panic!("expected a result, got questions: {asked:?}"),
            Self::Task(task) => panic!("expected a result, got a task: {task:?}"),
            Self::InDoubt(doubt) => panic!("expected a result, got a call in doubt: {doubt:?}"),
        }
    }

    /// The task, or a test failure naming what came instead.
    pub fn unwrap_task(self) -> pb::ToolTask {
        match self {
            Self::Task(task) => task,
            other => panic!("expected a task, got {other:?}"),
        }
    }

    /// The questions, or a test failure naming what came instead.
    pub fn unwrap_asked(self) -> pb::ToolInputRequired {
        match self {
            Self::Asked(asked) => asked,
            Self::Ok(v) => panic!("expected questions, got {v}"),
            Self::Err(code, message) => panic!("expected questions, got {code:?}: {message}"),
            other => panic!("expected questions, got {other:?}"),
        }
    }

    /// The error, or a test failure naming the result.
    pub fn unwrap_err(self) -> (pb::ToolErrorCode, String) {
        match self {
            Self::Err(code, message) => (code, message),
            Self::Ok(v) => panic!("expected an error, got {v}"),
            Self::Asked(asked) => panic!("expected an error, got questions: {asked:?}"),
            other => panic!("expected an error, got {other:?}"),
        }
    }
}

/// An orchestrator serving in this process, with the stand-in model and a tool-runner.
pub mod stack {
    use std::time::Duration;

    use futures::StreamExt;
    use mock_llm::{MockLlm, Scenarios};
    use proto::orchestrator::v1 as pb;
    use tonic::transport::Channel;

    use super::{Runner, Served};

    /// Orchestrator + stand-in model + tool-runner, all on loopback.
    pub struct Stack {
        /// The orchestrator's address.
        pub addr: std::net::SocketAddr,
        /// The stand-in model (its recorded requests are inspected by tests).
        pub mock: MockLlm,
        /// The tool-runner.
        pub runner: Runner,
        server: Served<orchestrator::Error>,
    }

    /// The tool-runner configuration the stacks use: built-ins plus `manifest` when given.
    pub fn runner_config(manifest: Option<std::path::PathBuf>) -> tool_runner::Config {
        tool_runner::Config {
            tools_manifest: manifest,
            ..tool_runner::Config::default()
        }
    }

    impl Stack {
        /// Starts everything; `tweak` adjusts the orchestrator's configuration.
        pub async fn start(
            scenarios: impl Into<Scenarios>,
            runner: tool_runner::Config,
            tweak: impl FnOnce(&mut orchestrator::Config),
        ) -> anyhow::Result<Self> {
            let mock = MockLlm::start(scenarios).await?;
            let runner = Runner::start(runner).await?;
            let mut config =
                orchestrator::Config::new(&mock.base_url(), "test-model", vec![format!("http://{}", runner.addr)]);
            config.llm.retry_backoff = Duration::from_millis(10);
            config.server.shutdown_grace = Duration::from_secs(5);
            tweak(&mut config);
            let server = Served::spawn(|listener, shutdown| orchestrator::serve(listener, config, shutdown)).await?;
            Ok(Self {
                addr: server.addr,
                mock,
                runner,
                server,
            })
        }

        /// A client.
        pub async fn client(&self) -> anyhow::Result<pb::orchestrator_client::OrchestratorClient<Channel>> {
            let channel = Channel::from_shared(format!("http://{}", self.addr))?.connect().await?;
            Ok(pb::orchestrator_client::OrchestratorClient::new(channel))
        }

        /// Starts the drain (as SIGTERM would).
        pub fn begin_shutdown(&mut self) {
            self.server.begin_shutdown();
        }

        /// Drains and waits for the server to stop.
        pub async fn shutdown(self) -> anyhow::Result<()> {
            self.server.shutdown().await
        }

        /// Runs `request` to its end and checks the run invariants (docs/architecture.md, "Invariants") on it.
        pub async fn run(&self, request: pb::OrchestrateRequest) -> anyhow::Result<Outcome> {
            let mut client = self.client().await?;
            let started = std::time::Instant::now();
            let mut stream = client.orchestrate(request).await?.into_inner();
            let mut events = Vec::new();
            while let Some(event) = stream.next().await {
                events.push(event?);
            }
            let elapsed = started.elapsed();
            let outcome = Outcome::new(events, elapsed)?;
            let stored = client
                .get_run(pb::GetRunRequest {
                    run_id: outcome.result.run_id.clone(),
                })
                .await?
                .into_inner();
            anyhow::ensure!(
                stored == outcome.result,
                "GetRun differs from run_finished:\n{stored:?}\nvs\n{:?}",
                outcome.result
            );
            Ok(outcome)
        }
    }

    /// A finished run's events and result.
    #[derive(Debug)]
    pub struct Outcome {
        /// Every event, in order.
        pub events: Vec<pb::OrchestrateEvent>,
        /// The result of `run_finished`.
        pub result: pb::RunResult,
        /// Wall time of the whole call.
        pub elapsed: Duration,
    }

    impl Outcome {
        /// Checks the stream invariants and extracts the result.
        pub fn new(events: Vec<pb::OrchestrateEvent>, elapsed: Duration) -> anyhow::Result<Self> {
            use pb::orchestrate_event::Event as E;
            for (i, event) in events.iter().enumerate() {
                anyhow::ensure!(
                    event.seq == i as u64 + 1,
                    "seq {} at position {i}: seqs must be 1, 2, 3 … without gaps",
                    event.seq
                );
            }
            let finished: Vec<&pb::OrchestrateEvent> = events
                .iter()
                .filter(|e| matches!(e.event, Some(E::RunFinished(_))))
                .collect();
            anyhow::ensure!(finished.len() == 1, "{} run_finished events", finished.len());
            let Some(E::RunFinished(last)) = events.last().and_then(|e| e.event.clone()) else {
                anyhow::bail!("the last event is not run_finished: {:?}", events.last());
            };
            let result = last
                .result
                .ok_or_else(|| anyhow::anyhow!("run_finished without a result"))?;
            anyhow::ensure!(
                matches!(
                    pb::RunStatus::try_from(result.status),
                    Ok(pb::RunStatus::Completed | pb::RunStatus::Failed | pb::RunStatus::Canceled)
                ),
                "status {} is not terminal",
                result.status
            );
            // A turn that starts again takes back what it streamed before (`turn_restarted`).
            let streamed = |pick: fn(&E) -> Option<(u32, &str)>| -> String {
                let mut pieces: Vec<(u32, &str)> = Vec::new();
                for event in events.iter().filter_map(|e| e.event.as_ref()) {
                    if let E::TurnRestarted(restart) = event {
                        pieces.retain(|(turn, _)| *turn != restart.turn);
                    }
                    pieces.extend(pick(event));
                }
                pieces.into_iter().map(|(_, piece)| piece).collect()
            };
            let text = streamed(|e| {
                if let E::TextDelta(t) = e {
                    Some((t.turn, &t.text))
                } else {
                    None
                }
            });
            anyhow::ensure!(
                text == result.text,
                "streamed text {text:?} differs from the result's {:?}",
                result.text
            );
            let reasoning = streamed(|e| {
                if let E::ReasoningDelta(r) = e {
                    Some((r.turn, &r.text))
                } else {
                    None
                }
            });
            anyhow::ensure!(
                reasoning == result.reasoning,
                "streamed reasoning {reasoning:?} differs from the result's {:?}",
                result.reasoning
            );
            anyhow::ensure!(
                events.iter().all(|e| e.run_id == result.run_id),
                "an event has another run_id"
            );
            Ok(Self {
                events,
                result,
                elapsed,
            })
        }

        /// The run's status.
        pub fn status(&self) -> pb::RunStatus {
            pb::RunStatus::try_from(self.result.status).unwrap_or(pb::RunStatus::Unspecified)
        }

        /// The failure reason.
        pub fn reason(&self) -> pb::FailureReason {
            pb::FailureReason::try_from(self.result.failure_reason).unwrap_or(pb::FailureReason::Unspecified)
        }

        /// Events of one kind.
        pub fn of<T>(&self, pick: impl Fn(&pb::orchestrate_event::Event) -> Option<T>) -> Vec<T> {
            self.events
                .iter()
                .filter_map(|e| e.event.as_ref().and_then(&pick))
                .collect()
        }
    }

    /// A request with one user message, offering `exit` as exit tools.
    pub fn request(prompt: &str, exit: &[&str]) -> pb::OrchestrateRequest {
        pb::OrchestrateRequest {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: prompt.into(),
                ..Default::default()
            }],
            tools: Some(pb::ToolSelection {
                normal: Vec::new(),
                exit: exit
                    .iter()
                    .map(|name| pb::ExitToolSpec {
                        name: (*name).into(),
                        description: format!("signal {name}"),
                        parameters_json_schema: String::new(),
                    })
                    .collect(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}
