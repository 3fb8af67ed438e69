//! The client against the real orchestrator, tool-runner and stand-in model in this process
//! (loopback): typed events and the collected result, retries of refused calls (no run slot; no
//! server yet), cancel on drop, TLS with a bearer token, and bad settings refused clearly.

use std::time::Duration;

use mock_llm::{Scenario, Scenarios, Step, Turn};
use orchestrator_client::{ClientBuilder, Error, Event, Retry, RunRequest, v1 as pb};
use serde_json::json;
use testkit::stack::{Stack, runner_config};

type TestResult = anyhow::Result<()>;

/// The demo by default; model `slow` naps `ms` in its one tool call.
fn scenarios(ms: u64) -> Scenarios {
    let slow = Scenario::new(vec![
        Turn::text("Napping.\n").then(Step::call("sleep", json!({"ms": ms}))),
        Turn::text("Rested."),
    ]);
    Scenarios {
        default: Scenario::demo(),
        named: [("slow".to_owned(), slow)].into_iter().collect(),
    }
}

fn demo() -> RunRequest {
    RunRequest::prompt("check the tools").exit_tool("submit_report", "File the report")
}

fn patient() -> Retry {
    Retry {
        attempts: 40,
        first_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(250),
    }
}

#[tokio::test]
async fn a_run_streams_typed_events_and_collects_its_result() -> TestResult {
    let stack = Stack::start(scenarios(10), runner_config(None), |_| {}).await?;
    let client = ClientBuilder::new(format!("http://{}", stack.addr)).connect().await?;

    let mut run = client.orchestrate(demo().run_id("typed-1")).await?;
    let mut events = Vec::new();
    while let Some(event) = run.next_event().await? {
        events.push(event);
    }
    assert_eq!(run.run_id(), Some("typed-1"));
    assert!(matches!(events.first(), Some(Event::Started(s)) if s.exit_tools == ["submit_report"]));
    let started = events.iter().filter(|e| matches!(e, Event::ToolCallStarted(_))).count();
    let first_finished = events.iter().position(|e| matches!(e, Event::ToolCallFinished(_)));
    let last_started = events.iter().rposition(|e| matches!(e, Event::ToolCallStarted(_)));
    assert_eq!(started, 3);
    assert!(last_started < first_finished, "dispatched together: {events:?}");
    assert!(
        events
            .iter()
            .any(|e| matches!(e, Event::Signal(s) if s.tool_name == "submit_report"))
    );
    let text: String = events
        .iter()
        .filter_map(|e| {
            if let Event::Text { text, .. } = e {
                Some(text.as_str())
            } else {
                None
            }
        })
        .collect();
    let Some(Event::Finished(result)) = events.last() else {
        anyhow::bail!("the last event is not Finished: {events:?}");
    };
    assert_eq!(result.status(), pb::RunStatus::Completed);
    assert_eq!(result.text, text);
    assert_eq!(client.get_run("typed-1").await?, **result);

    // The helper: a run straight to its result; canceling a finished run is a no-op.
    let result = client.run(demo()).await?;
    assert_eq!(
        (result.status(), result.tool_calls.len(), result.signals.len()),
        (pb::RunStatus::Completed, 3, 1)
    );
    assert!(!client.cancel_run(&result.run_id).await?);
    let missing = client.get_run("no-such-run").await.err().and_then(|e| e.code());
    assert_eq!(missing, Some(tonic::Code::NotFound));
    Ok(())
}

/// `start` returns the id of a run it started in the background while the run goes on (a slow
/// one, here); `attach` follows it from its first event to its result, and dropping that stream
/// leaves the run alone.
#[tokio::test]
async fn a_run_started_in_the_background_is_followed_by_its_id() -> TestResult {
    let stack = Stack::start(scenarios(300), runner_config(None), |_| {}).await?;
    let client = ClientBuilder::new(format!("http://{}", stack.addr)).connect().await?;
    let started = client.start(demo().model("slow")).await?;
    assert_eq!(started.status(), pb::RunStatus::Running, "{started:?}");
    let live = client.get_run(&started.run_id).await?;
    assert_eq!(live.status(), pb::RunStatus::Running, "{live:?}");
    drop(client.attach(&started.run_id, 0).await?);
    let result = client.attach(&started.run_id, 0).await?.result().await?;
    assert_eq!(
        (result.status(), result.text.as_str()),
        (pb::RunStatus::Completed, "Napping.\nRested."),
        "{result:?}"
    );
    let again = client
        .start(demo().model("slow").run_id(started.run_id.clone()))
        .await?;
    assert_eq!(
        again.status(),
        pb::RunStatus::Completed,
        "an ended run is not started again"
    );
    Ok(())
}

#[tokio::test]
async fn a_call_refused_for_want_of_a_run_slot_is_retried_with_backoff() -> TestResult {
    let stack = Stack::start(scenarios(1500), runner_config(None), |config| {
        config.runs.max_runs = 1;
        config.runs.max_queued_runs = 0;
    })
    .await?;
    let endpoint = format!("http://{}", stack.addr);
    let client = ClientBuilder::new(&endpoint).retry(Retry::none()).connect().await?;
    let mut slow = client.orchestrate(RunRequest::prompt("nap").model("slow")).await?;
    assert!(matches!(slow.next_event().await?, Some(Event::Started(_))));

    // The one slot is taken: without retries the call is refused at once …
    let refused = client.run(demo()).await.err().and_then(|e| e.code());
    assert_eq!(refused, Some(tonic::Code::ResourceExhausted));
    // … with them it runs once the slot is free.
    let patient_client = ClientBuilder::new(&endpoint).retry(patient()).connect().await?;
    let (waited, slow_result) = tokio::join!(patient_client.run(demo()), slow.result());
    assert_eq!(slow_result?.status(), pb::RunStatus::Completed);
    assert_eq!(waited?.status(), pb::RunStatus::Completed);
    Ok(())
}

#[tokio::test]
async fn a_server_that_is_not_up_yet_is_retried_until_it_is() -> TestResult {
    let stack = Stack::start(scenarios(10), runner_config(None), |_| {}).await?;
    // A free port, and an orchestrator that starts listening on it only after 500 ms.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let config = orchestrator::Config::new(
        &stack.mock.base_url(),
        "test-model",
        vec![format!("http://{}", stack.runner.addr)],
    );
    let late = tokio::spawn(async move {
        // Stays: the server must come up late (after the client's first attempts), which is the
        // case under test.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        orchestrator::serve(listener, config, std::future::pending()).await?;
        anyhow::Ok(())
    });
    let endpoint = format!("http://127.0.0.1:{port}");
    let impatient = ClientBuilder::new(&endpoint).retry(Retry::none()).connect_lazy()?;
    assert_eq!(
        impatient.run(demo()).await.err().and_then(|e| e.code()),
        Some(tonic::Code::Unavailable)
    );
    let client = ClientBuilder::new(&endpoint).retry(patient()).connect_lazy()?;
    assert_eq!(client.run(demo()).await?.status(), pb::RunStatus::Completed);
    late.abort();
    Ok(())
}

#[tokio::test]
async fn dropping_the_stream_cancels_the_run_even_a_detached_one() -> TestResult {
    let stack = Stack::start(scenarios(8000), runner_config(None), |_| {}).await?;
    let client = ClientBuilder::new(format!("http://{}", stack.addr)).connect().await?;
    let request = RunRequest::prompt("nap")
        .model("slow")
        .run_id("dropped-1")
        .detached(true);
    let mut run = client.orchestrate(request).await?;
    while let Some(event) = run.next_event().await? {
        if matches!(event, Event::ToolCallStarted(_)) {
            break;
        }
    }
    drop(run);
    let result = testkit::wait::until("the dropped run to be canceled", Duration::from_secs(10), || async {
        let result = client.get_run("dropped-1").await.ok()?;
        (result.status() == pb::RunStatus::Canceled).then_some(result)
    })
    .await?;
    assert_eq!(result.text, "Napping.\n", "the output so far is kept");
    Ok(())
}

#[tokio::test]
async fn tls_and_a_token_reach_a_secured_orchestrator() -> TestResult {
    let pki = testkit::pki::Pki::new()?;
    pki.ca("ca").await?;
    pki.leaf("ca", "server").await?;
    pki.ca("other").await?;
    let tokens = pki.path("tokens.toml");
    std::fs::write(
        &tokens,
        format!(
            "[[token]]\nprincipal = \"rust\"\nsha256 = \"{}\"\n",
            shared::auth::token_sha256("rust-token")
        ),
    )?;
    let stack = Stack::start(scenarios(10), runner_config(None), |config| {
        config.security.tls_cert = Some(pki.path("server.pem"));
        config.security.tls_key = Some(pki.path("server.key"));
        config.security.auth_tokens = Some(tokens.clone());
    })
    .await?;
    let endpoint = format!("https://localhost:{}", stack.addr.port());
    let ca = std::fs::read(pki.path("ca.pem"))?;

    let client = ClientBuilder::new(&endpoint)
        .tls_ca_pem(ca.clone())
        .token("rust-token")
        .connect()
        .await?;
    let result = client.run(demo()).await?;
    assert_eq!(
        (result.status(), result.principal.as_str()),
        (pb::RunStatus::Completed, "rust")
    );

    let anonymous = ClientBuilder::new(&endpoint).tls_ca_pem(ca).connect().await?;
    assert_eq!(
        anonymous.run(demo()).await.err().and_then(|e| e.code()),
        Some(tonic::Code::Unauthenticated)
    );

    // A server certificate from another CA is not trusted.
    let other = std::fs::read(pki.path("other.pem"))?;
    let untrusted = ClientBuilder::new(&endpoint)
        .tls_ca_pem(other)
        .token("rust-token")
        .connect()
        .await;
    assert!(untrusted.is_err(), "connected to a server the CA did not sign");
    Ok(())
}

#[tokio::test]
async fn a_client_certificate_reaches_an_orchestrator_that_requires_one() -> TestResult {
    let pki = testkit::pki::Pki::new()?;
    pki.ca("ca").await?;
    pki.leaf("ca", "server").await?;
    pki.leaf("ca", "service-a").await?;
    let stack = Stack::start(scenarios(10), runner_config(None), |config| {
        config.security.tls_cert = Some(pki.path("server.pem"));
        config.security.tls_key = Some(pki.path("server.key"));
        config.security.tls_client_ca = Some(pki.path("ca.pem"));
        config.security.auth_principal_from_cert = true;
    })
    .await?;
    let endpoint = format!("https://{}", stack.addr);
    let ca = std::fs::read(pki.path("ca.pem"))?;
    let client = ClientBuilder::new(&endpoint)
        .tls_ca_pem(ca.clone())
        .tls_identity_pem(
            std::fs::read(pki.path("service-a.pem"))?,
            std::fs::read(pki.path("service-a.key"))?,
        )
        .tls_domain("localhost")
        .connect()
        .await?;
    let result = client.run(demo()).await?;
    assert_eq!(
        (result.status(), result.principal.as_str()),
        (pb::RunStatus::Completed, "service-a"),
        "the certificate is the principal"
    );
    // Without a certificate the handshake is refused.
    let anonymous = ClientBuilder::new(&endpoint)
        .tls_ca_pem(ca)
        .retry(Retry::none())
        .connect()
        .await;
    let refused = match anonymous {
        Err(error) => error.to_string(),
        Ok(client) => client
            .run(demo())
            .await
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default(),
    };
    assert!(!refused.is_empty(), "a client without a certificate was served");
    Ok(())
}

/// A result larger than gRPC's usual 4 MiB (the server allows 6 MiB of output here) reaches the
/// client under its default message limit, by the stream and by `GetRun`; a client that sets a
/// lower limit gets `OUT_OF_RANGE` naming it.
#[tokio::test]
async fn a_result_larger_than_grpcs_usual_4_mib_is_received() -> TestResult {
    // Distinct lines, so the repeated-line detector has nothing to stop.
    let text: String = (0..5 * 1024 * 1024 / 32)
        .map(|i| format!("line {i:>10} of a long answer\n"))
        .collect();
    let turn = Turn::default().then(Step::Text {
        text: text.clone(),
        chunk_chars: Some(64 * 1024),
    });
    let stack = Stack::start(Scenario::new(vec![turn]), runner_config(None), |c| {
        c.runs.output.max_output_bytes = 6 * 1024 * 1024;
    })
    .await?;
    let address = format!("http://{}", stack.addr);
    let client = ClientBuilder::new(&address).connect().await?;
    let result = client.run(RunRequest::prompt("write a lot").run_id("large-1")).await?;
    assert_eq!(
        (result.status(), result.text.len()),
        (pb::RunStatus::Completed, text.len())
    );
    assert_eq!(client.get_run("large-1").await?.text.len(), text.len());

    let small = ClientBuilder::new(&address)
        .max_message_bytes(4 * 1024 * 1024)
        .connect()
        .await?;
    let refused = small.get_run("large-1").await.err().and_then(|e| e.code());
    assert_eq!(refused, Some(tonic::Code::OutOfRange));
    let refused = small.run(RunRequest::prompt("write a lot")).await.err();
    assert!(
        refused.as_ref().is_some_and(|e| e.to_string().contains("4194304")),
        "{refused:?}"
    );
    Ok(())
}

/// A stand-in orchestrator whose `Orchestrate` sends `run_started` and `run_finished`, then
/// holds the call open for `hold` before its trailers, and records whether the caller reset the
/// call before them (its receiving end closed early).
struct LateTrailers {
    hold: Duration,
    reset_early: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

#[tonic::async_trait]
impl pb::orchestrator_server::Orchestrator for LateTrailers {
    type OrchestrateStream = tokio_stream::wrappers::ReceiverStream<Result<pb::OrchestrateEvent, tonic::Status>>;
    type AttachRunStream = Self::OrchestrateStream;
    type SubscribeSignalsStream = tokio_stream::wrappers::ReceiverStream<Result<pb::SignalEvent, tonic::Status>>;

    async fn attach_run(
        &self,
        _: tonic::Request<pb::AttachRunRequest>,
    ) -> Result<tonic::Response<Self::AttachRunStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn start_run(
        &self,
        _: tonic::Request<pb::OrchestrateRequest>,
    ) -> Result<tonic::Response<pb::StartRunResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn list_agents(
        &self,
        _: tonic::Request<pb::ListAgentsRequest>,
    ) -> Result<tonic::Response<pb::ListAgentsResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn create_webhook(
        &self,
        _: tonic::Request<pb::CreateWebhookRequest>,
    ) -> Result<tonic::Response<pb::Webhook>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn list_webhooks(
        &self,
        _: tonic::Request<pb::ListWebhooksRequest>,
    ) -> Result<tonic::Response<pb::ListWebhooksResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn delete_webhook(
        &self,
        _: tonic::Request<pb::DeleteWebhookRequest>,
    ) -> Result<tonic::Response<pb::DeleteWebhookResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn list_webhook_deliveries(
        &self,
        _: tonic::Request<pb::ListWebhookDeliveriesRequest>,
    ) -> Result<tonic::Response<pb::ListWebhookDeliveriesResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn orchestrate(
        &self,
        _: tonic::Request<pb::OrchestrateRequest>,
    ) -> Result<tonic::Response<Self::OrchestrateStream>, tonic::Status> {
        use pb::orchestrate_event::Event as E;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let event = |seq, event| pb::OrchestrateEvent {
            run_id: "late-1".into(),
            seq,
            event: Some(event),
        };
        let result = pb::RunResult {
            run_id: "late-1".into(),
            status: pb::RunStatus::Completed.into(),
            text: "done".into(),
            ..Default::default()
        };
        let _ = tx.send(Ok(event(1, E::RunStarted(pb::RunStarted::default())))).await;
        let _ = tx
            .send(Ok(event(2, E::RunFinished(pb::RunFinished { result: Some(result) }))))
            .await;
        let (hold, reset_early) = (self.hold, std::sync::Arc::clone(&self.reset_early));
        tokio::spawn(async move {
            if tokio::time::timeout(hold, tx.closed()).await.is_ok() {
                reset_early.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        });
        Ok(tonic::Response::new(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }

    async fn get_run(
        &self,
        _: tonic::Request<pb::GetRunRequest>,
    ) -> Result<tonic::Response<pb::RunResult>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn decide_tool_calls(
        &self,
        _: tonic::Request<pb::DecideToolCallsRequest>,
    ) -> Result<tonic::Response<pb::DecideToolCallsResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn list_pending_approvals(
        &self,
        _: tonic::Request<pb::ListPendingApprovalsRequest>,
    ) -> Result<tonic::Response<pb::ListPendingApprovalsResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn cancel_run(
        &self,
        _: tonic::Request<pb::CancelRunRequest>,
    ) -> Result<tonic::Response<pb::CancelRunResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn send_message(
        &self,
        _: tonic::Request<pb::SendMessageRequest>,
    ) -> Result<tonic::Response<pb::SendMessageResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn get_thread(
        &self,
        _: tonic::Request<pb::GetThreadRequest>,
    ) -> Result<tonic::Response<pb::Thread>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn delete_thread(
        &self,
        _: tonic::Request<pb::DeleteThreadRequest>,
    ) -> Result<tonic::Response<pb::DeleteThreadResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn list_runs(
        &self,
        _: tonic::Request<pb::ListRunsRequest>,
    ) -> Result<tonic::Response<pb::ListRunsResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn get_usage(
        &self,
        _: tonic::Request<pb::GetUsageRequest>,
    ) -> Result<tonic::Response<pb::GetUsageResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn answer_tool_input(
        &self,
        _: tonic::Request<pb::AnswerToolInputRequest>,
    ) -> Result<tonic::Response<pb::AnswerToolInputResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn subscribe_signals(
        &self,
        _: tonic::Request<pb::SubscribeSignalsRequest>,
    ) -> Result<tonic::Response<Self::SubscribeSignalsStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }
}

/// Serves a stand-in orchestrator on a loopback port: its address and the serving task.
async fn serve_stand_in<S: pb::orchestrator_server::Orchestrator>(
    service: pb::orchestrator_server::OrchestratorServer<S>,
) -> anyhow::Result<(
    std::net::SocketAddr,
    tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    Ok((address, server))
}

/// After `run_finished` the client reads the call to its trailers instead of dropping it: a
/// dropped call is reset on the wire, and an HTTP/2 peer closes the whole connection after about
/// 1,024 such resets (the soak found it). The server here holds its trailers 300 ms; the client
/// must not have reset the call by then, and `result()` returns once they arrive.
#[tokio::test]
async fn the_client_reads_each_call_to_its_trailers() -> TestResult {
    let reset_early = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let service = LateTrailers {
        hold: Duration::from_millis(300),
        reset_early: std::sync::Arc::clone(&reset_early),
    };
    let (address, server) = serve_stand_in(pb::orchestrator_server::OrchestratorServer::new(service)).await?;
    let client = ClientBuilder::new(format!("http://{address}")).connect().await?;
    let result = client.run(RunRequest::prompt("x")).await?;
    assert_eq!(result.text, "done");
    // Stays: a reset, had there been one, is given time to reach the server; what is asserted is
    // that none came.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !reset_early.load(std::sync::atomic::Ordering::SeqCst),
        "the client reset the call before its trailers"
    );
    server.abort();
    Ok(())
}

type EventSender = tokio::sync::mpsc::Sender<Result<pb::OrchestrateEvent, tonic::Status>>;

/// A stand-in orchestrator whose run "moves": `Orchestrate` sends events 1-3 and ends
/// `UNAVAILABLE` (a draining replica); the first `AttachRun` sends event 4 and ends `UNKNOWN` (a
/// connection that died); the second sends event 4 again (a replica that has it) and the end.
/// It records the `after_seq` of each `AttachRun`.
#[derive(Default)]
struct Mover {
    attaches: std::sync::Mutex<Vec<u64>>,
}

impl Mover {
    fn event(seq: u64) -> pb::OrchestrateEvent {
        use pb::orchestrate_event::Event as E;
        let event = if seq == 5 {
            E::RunFinished(pb::RunFinished {
                result: Some(pb::RunResult {
                    run_id: "moving-1".into(),
                    status: pb::RunStatus::Completed.into(),
                    text: "a b c".into(),
                    ..Default::default()
                }),
            })
        } else {
            let text = ["", "a", " b", " c", ""][usize::try_from(seq).unwrap_or(0) % 5];
            E::TextDelta(pb::TextDelta {
                text: text.into(),
                turn: 1,
            })
        };
        pb::OrchestrateEvent {
            run_id: "moving-1".into(),
            seq,
            event: Some(event),
        }
    }

    fn stream(
        seqs: &[u64],
        end: Option<tonic::Status>,
    ) -> tokio_stream::wrappers::ReceiverStream<Result<pb::OrchestrateEvent, tonic::Status>> {
        let (tx, rx): (EventSender, _) = tokio::sync::mpsc::channel(8);
        for &seq in seqs {
            let _ = tx.try_send(Ok(Self::event(seq)));
        }
        if let Some(status) = end {
            let _ = tx.try_send(Err(status));
        }
        tokio_stream::wrappers::ReceiverStream::new(rx)
    }
}

#[tonic::async_trait]
impl pb::orchestrator_server::Orchestrator for Mover {
    type OrchestrateStream = tokio_stream::wrappers::ReceiverStream<Result<pb::OrchestrateEvent, tonic::Status>>;
    type AttachRunStream = Self::OrchestrateStream;
    type SubscribeSignalsStream = tokio_stream::wrappers::ReceiverStream<Result<pb::SignalEvent, tonic::Status>>;

    async fn orchestrate(
        &self,
        _: tonic::Request<pb::OrchestrateRequest>,
    ) -> Result<tonic::Response<Self::OrchestrateStream>, tonic::Status> {
        let draining = tonic::Status::unavailable("draining; attach to run \"moving-1\" again after seq 3");
        Ok(tonic::Response::new(Self::stream(&[1, 2, 3], Some(draining))))
    }

    async fn start_run(
        &self,
        _: tonic::Request<pb::OrchestrateRequest>,
    ) -> Result<tonic::Response<pb::StartRunResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn list_agents(
        &self,
        _: tonic::Request<pb::ListAgentsRequest>,
    ) -> Result<tonic::Response<pb::ListAgentsResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn create_webhook(
        &self,
        _: tonic::Request<pb::CreateWebhookRequest>,
    ) -> Result<tonic::Response<pb::Webhook>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn list_webhooks(
        &self,
        _: tonic::Request<pb::ListWebhooksRequest>,
    ) -> Result<tonic::Response<pb::ListWebhooksResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn delete_webhook(
        &self,
        _: tonic::Request<pb::DeleteWebhookRequest>,
    ) -> Result<tonic::Response<pb::DeleteWebhookResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn list_webhook_deliveries(
        &self,
        _: tonic::Request<pb::ListWebhookDeliveriesRequest>,
    ) -> Result<tonic::Response<pb::ListWebhookDeliveriesResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn attach_run(
        &self,
        request: tonic::Request<pb::AttachRunRequest>,
    ) -> Result<tonic::Response<Self::AttachRunStream>, tonic::Status> {
        let after = request.into_inner().after_seq;
        let nth = {
            let mut attaches = self.attaches.lock().map_err(|_| tonic::Status::internal("poisoned"))?;
            attaches.push(after);
            attaches.len()
        };
        Ok(tonic::Response::new(match nth {
            1 => Self::stream(
                &[4],
                Some(tonic::Status::unknown("h2 protocol error: connection reset")),
            ),
            2 => Self::stream(&[], Some(tonic::Status::cancelled("operation was canceled"))),
            _ => Self::stream(&[4, 5], None),
        }))
    }

    async fn get_run(
        &self,
        _: tonic::Request<pb::GetRunRequest>,
    ) -> Result<tonic::Response<pb::RunResult>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn decide_tool_calls(
        &self,
        _: tonic::Request<pb::DecideToolCallsRequest>,
    ) -> Result<tonic::Response<pb::DecideToolCallsResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn list_pending_approvals(
        &self,
        _: tonic::Request<pb::ListPendingApprovalsRequest>,
    ) -> Result<tonic::Response<pb::ListPendingApprovalsResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn cancel_run(
        &self,
        _: tonic::Request<pb::CancelRunRequest>,
    ) -> Result<tonic::Response<pb::CancelRunResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn send_message(
        &self,
        _: tonic::Request<pb::SendMessageRequest>,
    ) -> Result<tonic::Response<pb::SendMessageResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn get_thread(
        &self,
        _: tonic::Request<pb::GetThreadRequest>,
    ) -> Result<tonic::Response<pb::Thread>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn delete_thread(
        &self,
        _: tonic::Request<pb::DeleteThreadRequest>,
    ) -> Result<tonic::Response<pb::DeleteThreadResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn list_runs(
        &self,
        _: tonic::Request<pb::ListRunsRequest>,
    ) -> Result<tonic::Response<pb::ListRunsResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn get_usage(
        &self,
        _: tonic::Request<pb::GetUsageRequest>,
    ) -> Result<tonic::Response<pb::GetUsageResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn answer_tool_input(
        &self,
        _: tonic::Request<pb::AnswerToolInputRequest>,
    ) -> Result<tonic::Response<pb::AnswerToolInputResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }

    async fn subscribe_signals(
        &self,
        _: tonic::Request<pb::SubscribeSignalsRequest>,
    ) -> Result<tonic::Response<Self::SubscribeSignalsStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this stand-in"))
    }
}

/// A stream that ends UNAVAILABLE (drained) or breaks off (UNKNOWN, or CANCELLED as a stream the
/// server reset reads) before run_finished is followed by AttachRun from the last seq the caller
/// saw; the caller sees 1..=5 once each. With
/// re-attaching off (one attempt of the retry policy spent on nothing) the same break is an error.
#[tokio::test]
async fn a_stream_that_breaks_off_reattaches_from_its_last_seq_without_gaps_or_duplicates() -> TestResult {
    let mover = std::sync::Arc::new(Mover::default());
    let stand_in = pb::orchestrator_server::OrchestratorServer::from_arc(std::sync::Arc::clone(&mover));
    let (address, server) = serve_stand_in(stand_in).await?;
    let client = ClientBuilder::new(format!("http://{address}")).connect().await?;
    let mut stream = client.orchestrate(RunRequest::prompt("x")).await?;
    let mut seqs = Vec::new();
    let mut text = String::new();
    while let Some(event) = stream.next_event().await? {
        seqs.push(stream.last_seq());
        if let Event::Text { text: piece, .. } = event {
            text.push_str(&piece);
        }
    }
    assert_eq!(seqs, [1, 2, 3, 4, 5]);
    assert_eq!(text, "a b c");
    assert_eq!(stream.reattached(), 3);
    assert_eq!(
        *mover.attaches.lock().map_err(|_| anyhow::anyhow!("poisoned"))?,
        [3, 4, 4]
    );

    // Attached by hand from seq 3: the same rest of the run.
    let attached = client.attach("moving-1", 3).await?;
    let result = attached.result().await?;
    assert_eq!(result.text, "a b c");

    let once = ClientBuilder::new(format!("http://{address}"))
        .retry(Retry::none())
        .connect()
        .await?;
    let mut run = once.orchestrate(RunRequest::prompt("x")).await?;
    let mut broke = None;
    while broke.is_none() {
        match run.next_event().await {
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(e) => broke = e.code(),
        }
    }
    assert_eq!(broke, Some(tonic::Code::Unavailable), "one attempt: no re-attach");
    server.abort();
    Ok(())
}

#[tokio::test]
async fn unusable_settings_are_refused_without_echoing_the_token() {
    let error = |builder: ClientBuilder| builder.connect_lazy().err().map(|e| e.to_string()).unwrap_or_default();
    let message = error(ClientBuilder::new("https://x:1"));
    assert!(message.contains("tls_ca_pem"), "{message}");
    let message = error(ClientBuilder::new("http://x:1").tls_ca_pem(b"pem".to_vec()));
    assert!(message.contains("needs an https:// endpoint"), "{message}");
    let message = error(ClientBuilder::new("http://x:1").token("sécret\n"));
    assert!(
        message.contains("printable ASCII") && !message.contains("sécret"),
        "{message}"
    );
    let message = error(ClientBuilder::new("not a url"));
    assert!(message.contains("endpoint"), "{message}");
    assert!(!format!("{:?}", ClientBuilder::new("http://x:1").token("hidden")).contains("hidden"));
    assert!(ClientBuilder::new("http://x:1").connect_lazy().is_ok());
    assert_eq!(Error::Protocol("x".into()).code(), None);
}
