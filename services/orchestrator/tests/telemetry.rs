//! Telemetry across real processes: an orchestrator and two tool-runner replicas export spans
//! over OTLP to an in-process collector (the `opentelemetry-proto` tonic service). One run with
//! parallel tool calls, started with a caller-supplied `traceparent`, must arrive as one trace:
//! `invoke_agent` → `chat {model}` → `execute_tool {name}` (client) → `execute_tool {name}`
//! (server, from the runners' resource), with the GenAI attributes. Then `/metrics` of both
//! services is scraped around scripted runs and the counters must move by exactly the expected
//! amounts.

use std::collections::BTreeMap;

use mock_llm::{Scenario, Scenarios, Step, Turn};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use proto::orchestrator::v1 as pb;
use tokio::process::Command;

mod common;

use common::otlp::{Collector, attr, string_attr};
use common::{Service, delta, orchestrate, scrape, tool_runner_bin, user};

type TestResult = anyhow::Result<()>;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn one_trace_across_both_services_and_exact_metrics() -> TestResult {
    let (collector, otlp) = Collector::start().await?;

    // The stand-in model: the demo by default, and a run whose calls all fail.
    let failing = Scenario::new(vec![
        Turn::text("Bad naps.\n")
            .then(Step::call("sleep", serde_json::json!({"ms": -1})))
            .then(Step::call("sleep", serde_json::json!({"ms": -2}))),
        Turn::text("Gave up napping."),
    ]);
    let mock = mock_llm::MockLlm::start(Scenarios {
        default: Scenario::demo(),
        named: [("failing".to_owned(), failing)].into_iter().collect(),
    })
    .await?;

    // Two tool-runner replicas and the orchestrator, exporting to the collector.
    let runner_bin = tool_runner_bin()?;
    let mut runners = Vec::new();
    for _ in 0..2 {
        let mut command = Command::new(&runner_bin);
        command
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp)
            .env_remove("OTEL_SERVICE_NAME");
        runners.push(Service::spawn(command, "127.0.0.1", "tool-runner serving").await?);
    }
    let endpoints: Vec<String> = runners.iter().map(|r| format!("http://{}", r.grpc)).collect();
    let mut command = Command::new(env!("CARGO_BIN_EXE_orchestrator"));
    command
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp)
        .env_remove("OTEL_SERVICE_NAME")
        .env("LLM_BASE_URL", mock.base_url())
        .env("LLM_MODEL", "stand-in")
        .env("TOOL_RUNNER_ENDPOINTS", endpoints.join(","))
        .env("ORCHESTRATOR_EXIT_TOOLS", "submit_report");
    let orchestrator = Service::spawn(command, "127.0.0.1", "orchestrator serving").await?;
    let endpoint = format!("http://{}", orchestrator.grpc);

    // The traced run, continuing the caller's trace.
    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let mut request = tonic::Request::new(user("go"));
    request
        .metadata_mut()
        .insert("traceparent", format!("00-{caller_trace}-{caller_span}-01").parse()?);
    let before_orch = scrape(&orchestrator.metrics).await?;
    let before_runners = [scrape(&runners[0].metrics).await?, scrape(&runners[1].metrics).await?];
    let traced = orchestrate(&endpoint, request).await?;
    assert_eq!(traced.status(), pb::RunStatus::Completed);

    // A run whose two calls fail, for the metric deltas.
    let failed = orchestrate(
        &endpoint,
        tonic::Request::new(pb::OrchestrateRequest {
            model: "failing".into(),
            ..user("nap")
        }),
    )
    .await?;
    assert_eq!((failed.status(), failed.failed_turns), (pb::RunStatus::Completed, 1));

    // Metrics move by exactly what the two runs did.
    let after_orch = scrape(&orchestrator.metrics).await?;
    let o = |series: &str| delta(&before_orch, &after_orch, series);
    assert_eq!(
        o("orchestrator_runs_total{principal=\"\",reason=\"none\",status=\"completed\"}"),
        2.0,
        "{after_orch:?}"
    );
    assert_eq!(
        o("orchestrator_tool_calls_total{outcome=\"ok\",tool=\"calculate\"}"),
        1.0
    );
    assert_eq!(
        o("orchestrator_tool_calls_total{outcome=\"ok\",tool=\"time_now\"}"),
        1.0
    );
    assert_eq!(o("orchestrator_tool_calls_total{outcome=\"ok\",tool=\"sleep\"}"), 1.0);
    assert_eq!(
        o("orchestrator_tool_calls_total{outcome=\"INVALID_ARGUMENTS\",tool=\"sleep\"}"),
        2.0
    );
    assert_eq!(o("orchestrator_signals_published_total{}"), 1.0);
    assert_eq!(o("orchestrator_run_duration_seconds_count{status=\"completed\"}"), 2.0);
    assert_eq!(o("orchestrator_turn_duration_seconds_count{}"), 4.0);
    assert_eq!(o("orchestrator_time_to_first_token_seconds_count{}"), 4.0);
    assert_eq!(after_orch.get("orchestrator_runs_in_flight{}").copied(), Some(0.0));
    assert_eq!(
        after_orch.get("orchestrator_tool_calls_in_flight{}").copied(),
        Some(0.0)
    );
    let mut runner_deltas: BTreeMap<String, f64> = BTreeMap::new();
    for (runner, before) in runners.iter().zip(&before_runners) {
        let after = scrape(&runner.metrics).await?;
        for series in [
            "tool_runner_executions_total{outcome=\"ok\",tool=\"calculate\"}",
            "tool_runner_executions_total{outcome=\"ok\",tool=\"sleep\"}",
            "tool_runner_executions_total{outcome=\"INVALID_ARGUMENTS\",tool=\"sleep\"}",
            "tool_runner_execution_duration_seconds_count{tool=\"sleep\"}",
            "tool_runner_rejected_total{reason=\"concurrency_limit\"}",
        ] {
            *runner_deltas.entry(series.to_owned()).or_default() += delta(before, &after, series);
        }
        assert_eq!(after.get("tool_runner_executions_in_flight{}").copied(), Some(0.0));
    }
    let expected: BTreeMap<String, f64> = [
        ("tool_runner_executions_total{outcome=\"ok\",tool=\"calculate\"}", 1.0),
        ("tool_runner_executions_total{outcome=\"ok\",tool=\"sleep\"}", 1.0),
        (
            "tool_runner_executions_total{outcome=\"INVALID_ARGUMENTS\",tool=\"sleep\"}",
            2.0,
        ),
        ("tool_runner_execution_duration_seconds_count{tool=\"sleep\"}", 3.0),
        ("tool_runner_rejected_total{reason=\"concurrency_limit\"}", 0.0),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    assert_eq!(runner_deltas, expected, "summed over both replicas");

    // Stop everything: spans are flushed on shutdown.
    orchestrator.stop().await?;
    for runner in runners {
        runner.stop().await?;
    }
    let spans = collector.0.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.clone();
    let traced_spans: Vec<&(String, opentelemetry_proto::tonic::trace::v1::Span)> =
        spans.iter().filter(|(_, s)| hex(&s.trace_id) == caller_trace).collect();
    let named = |prefix: &str| -> Vec<&(String, opentelemetry_proto::tonic::trace::v1::Span)> {
        traced_spans
            .iter()
            .copied()
            .filter(|(_, s)| s.name.starts_with(prefix))
            .collect()
    };

    // invoke_agent continues the caller's span.
    let agents = named("invoke_agent");
    assert_eq!(
        agents.len(),
        1,
        "spans of the caller's trace: {:?}",
        traced_spans.iter().map(|(svc, s)| (svc, &s.name)).collect::<Vec<_>>()
    );
    let (service, agent) = agents[0];
    assert_eq!(service, "orchestrator");
    assert_eq!(hex(&agent.parent_span_id), caller_span);
    assert_eq!(
        string_attr(&agent.attributes, "gen_ai.operation.name").as_deref(),
        Some("invoke_agent")
    );
    assert_eq!(
        string_attr(&agent.attributes, "orchestrator.run.id").as_deref(),
        Some(traced.run_id.as_str())
    );
    assert_eq!(
        string_attr(&agent.attributes, "orchestrator.run.status").as_deref(),
        Some("completed")
    );
    assert_eq!(
        string_attr(&agent.attributes, "orchestrator.run.turns").as_deref(),
        Some("2")
    );
    assert_eq!(
        string_attr(&agent.attributes, "orchestrator.run.signals").as_deref(),
        Some("1")
    );
    let signal = agent
        .events
        .iter()
        .find(|e| e.name == "signal")
        .ok_or_else(|| anyhow::anyhow!("no signal event"))?;
    assert_eq!(
        string_attr(&signal.attributes, "gen_ai.tool.name").as_deref(),
        Some("submit_report")
    );

    // Two chat turns under it.
    let chats = named("chat stand-in");
    assert_eq!(chats.len(), 2);
    for (_, chat) in &chats {
        assert_eq!(chat.parent_span_id, agent.span_id);
        assert_eq!(chat.kind, SpanKind::Client as i32);
        assert_eq!(
            string_attr(&chat.attributes, "gen_ai.operation.name").as_deref(),
            Some("chat")
        );
        assert_eq!(
            string_attr(&chat.attributes, "gen_ai.request.model").as_deref(),
            Some("stand-in")
        );
        for key in [
            "gen_ai.usage.input_tokens",
            "gen_ai.usage.output_tokens",
            "gen_ai.response.finish_reasons",
            "gen_ai.response.time_to_first_token",
        ] {
            assert!(attr(&chat.attributes, key).is_some(), "chat span lacks {key}");
        }
    }
    let first_turn = chats
        .iter()
        .find(|(_, c)| string_attr(&c.attributes, "orchestrator.turn").as_deref() == Some("1"))
        .ok_or_else(|| anyhow::anyhow!("no turn 1"))?;

    // Three client calls under turn 1, each the parent of a server span from a runner.
    let clients: Vec<_> = named("execute_tool")
        .into_iter()
        .filter(|(svc, _)| svc == "orchestrator")
        .collect();
    let servers: Vec<_> = named("execute_tool")
        .into_iter()
        .filter(|(svc, _)| svc == "tool-runner")
        .collect();
    assert_eq!((clients.len(), servers.len()), (3, 3));
    for (_, client) in &clients {
        assert_eq!(client.parent_span_id, first_turn.1.span_id);
        assert_eq!(client.kind, SpanKind::Client as i32);
        let tool = string_attr(&client.attributes, "gen_ai.tool.name").unwrap_or_default();
        assert_eq!(client.name, format!("execute_tool {tool}"));
        assert!(
            attr(&client.attributes, "gen_ai.tool.call.arguments").is_none(),
            "payloads are off by default"
        );
        let call_id = string_attr(&client.attributes, "gen_ai.tool.call.id");
        let (_, server) = servers
            .iter()
            .find(|(_, s)| string_attr(&s.attributes, "gen_ai.tool.call.id") == call_id)
            .ok_or_else(|| anyhow::anyhow!("no server span for {call_id:?}"))?;
        assert_eq!(
            server.parent_span_id, client.span_id,
            "the runner's span is a child of the orchestrator's call"
        );
        assert_eq!(server.kind, SpanKind::Server as i32);
        assert_eq!(server.name, client.name);
    }
    Ok(())
}

#[tokio::test]
async fn tool_payloads_are_recorded_only_when_asked_and_capped() -> TestResult {
    let (collector, otlp) = Collector::start().await?;
    let mock = mock_llm::MockLlm::start(Scenario::demo()).await?;
    let mut command = Command::new(tool_runner_bin()?);
    command.env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp).args([
        "--trace-tool-payloads",
        "--trace-payload-max-bytes",
        "12",
    ]);
    let runner = Service::spawn(command, "127.0.0.1", "tool-runner serving").await?;
    let mut command = Command::new(env!("CARGO_BIN_EXE_orchestrator"));
    command
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp)
        .env("OTEL_SERVICE_NAME", "orchestrator-payloads")
        .env("LLM_BASE_URL", mock.base_url())
        .env("TOOL_RUNNER_ENDPOINTS", format!("http://{}", runner.grpc))
        .env("ORCHESTRATOR_EXIT_TOOLS", "submit_report")
        .args(["--trace-tool-payloads", "--trace-payload-max-bytes", "12"]);
    let orchestrator = Service::spawn(command, "127.0.0.1", "orchestrator serving").await?;
    let result = orchestrate(
        &format!("http://{}", orchestrator.grpc),
        tonic::Request::new(user("go")),
    )
    .await?;
    assert_eq!(result.status(), pb::RunStatus::Completed);
    orchestrator.stop().await?;
    runner.stop().await?;

    let spans = collector.0.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.clone();
    let calculate: Vec<_> = spans
        .iter()
        .filter(|(_, s)| s.name == "execute_tool calculate")
        .collect();
    assert_eq!(calculate.len(), 2, "client and server");
    for (service, span) in calculate {
        assert!(
            service == "orchestrator-payloads" || service == "tool-runner",
            "{service}"
        );
        let arguments = string_attr(&span.attributes, "gen_ai.tool.call.arguments").unwrap_or_default();
        assert_eq!(arguments, "{\"expression", "the first 12 bytes ({service})");
        let result = string_attr(&span.attributes, "gen_ai.tool.call.result").unwrap_or_default();
        assert_eq!(result.len(), 12, "{result:?} ({service})");
    }
    // Above its cap the flag is refused at startup.
    let output = Command::new(env!("CARGO_BIN_EXE_orchestrator"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--trace-tool-payloads",
            "--trace-payload-max-bytes",
            "65537",
        ])
        .output()
        .await?;
    assert_eq!(output.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("--trace-payload-max-bytes = 65537 is above its cap of 65536")
    );
    Ok(())
}
