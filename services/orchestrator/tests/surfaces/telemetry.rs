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

use testkit::otlp::{Collector, attr, string_attr};
use testkit::{Service, delta, orchestrate, scrape, user};

type TestResult = anyhow::Result<()>;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A scraped series' metric name (before its labels).
fn series_name(series: &str) -> String {
    series.split('{').next().unwrap_or_default().to_owned()
}

/// Every metric name the Grafana dashboard and the Prometheus rules in `deploy/k8s/monitoring`
/// query.
fn metrics_used_in_deploy() -> anyhow::Result<std::collections::BTreeSet<String>> {
    let dir = testkit::repo_root().join("deploy/k8s/monitoring");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("grafana-dashboard.json"))?)?;
    let mut queries: Vec<String> = dashboard["panels"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|panel| panel["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|target| target["expr"].as_str().map(str::to_owned))
        .collect();
    anyhow::ensure!(queries.len() >= 20, "the dashboard has {} queries", queries.len());
    queries.push(std::fs::read_to_string(dir.join("prometheus-rules.yaml"))?);
    let names = queries
        .iter()
        .flat_map(|text| text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')))
        .filter(|word| word.starts_with("orchestrator_") || word.starts_with("tool_runner_"))
        .map(str::to_owned)
        .collect();
    Ok(names)
}

/// The two runs' world: the stand-in model (the demo by default, and `failing`, a run whose
/// calls all fail), two tool-runner replicas and the orchestrator, all exporting to `collector`.
struct World {
    collector: Collector,
    _mock: mock_llm::MockLlm,
    runners: Vec<Service>,
    orchestrator: Service,
}

type Spans = Vec<(String, opentelemetry_proto::tonic::trace::v1::Span)>;

impl World {
    async fn start() -> anyhow::Result<Self> {
        let (collector, otlp) = Collector::start().await?;
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
        let runner_bin = testkit::tool_runner_bin!()?;
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
        let orchestrator = Service::orchestrator(command).await?;
        Ok(Self {
            collector,
            _mock: mock,
            runners,
            orchestrator,
        })
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.orchestrator.grpc)
    }

    /// Stops every process (spans are flushed on shutdown) and returns the spans collected.
    async fn stop(self) -> anyhow::Result<Spans> {
        self.orchestrator.stop().await?;
        for runner in self.runners {
            runner.stop().await?;
        }
        Ok(self
            .collector
            .0
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .clone())
    }
}

const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// One demo run continuing the caller's trace and one whose two calls fail; `/metrics` of every
/// process moves by exactly what they did, the deploy's dashboard and rules query only exported
/// metrics, and the traced run arrives as one trace across both services.
#[tokio::test]
async fn one_trace_across_both_services_and_exact_metrics() -> TestResult {
    let world = World::start().await?;
    let endpoint = world.endpoint();
    let before_orch = scrape(&world.orchestrator.metrics).await?;
    let before_runners = [
        scrape(&world.runners[0].metrics).await?,
        scrape(&world.runners[1].metrics).await?,
    ];
    let mut request = tonic::Request::new(user("go"));
    request
        .metadata_mut()
        .insert("traceparent", format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01").parse()?);
    let traced = orchestrate(&endpoint, request).await?;
    assert_eq!(traced.status(), pb::RunStatus::Completed);
    let failing = pb::OrchestrateRequest {
        model: "failing".into(),
        ..user("nap")
    };
    let failed = orchestrate(&endpoint, tonic::Request::new(failing)).await?;
    assert_eq!((failed.status(), failed.failed_turns), (pb::RunStatus::Completed, 1));

    let after_orch = scrape(&world.orchestrator.metrics).await?;
    the_orchestrators_metrics_move_by_what_the_runs_did(&before_orch, &after_orch);
    let mut exported: std::collections::BTreeSet<String> = after_orch.keys().map(|k| series_name(k)).collect();
    let mut after_runners = Vec::new();
    for runner in &world.runners {
        let after = scrape(&runner.metrics).await?;
        exported.extend(after.keys().map(|k| series_name(k)));
        after_runners.push(after);
    }
    the_runners_metrics_summed_move_by_what_the_runs_did(&before_runners, &after_runners);
    the_deploys_dashboard_and_rules_query_only_exported_metrics(&exported)?;

    let spans = world.stop().await?;
    let traced_spans: Vec<_> = spans.iter().filter(|(_, s)| hex(&s.trace_id) == CALLER_TRACE).collect();
    let agent = invoke_agent_continues_the_callers_span(&traced_spans, &traced.run_id)?;
    let first_turn = two_chat_turns_are_under_it(&traced_spans, agent)?;
    each_call_of_turn_1_is_the_parent_of_a_runners_span(&traced_spans, first_turn)
}

type Scraped = std::collections::HashMap<String, f64>;

fn the_orchestrators_metrics_move_by_what_the_runs_did(before: &Scraped, after: &Scraped) {
    let o = |series: &str| delta(before, after, series);
    assert_eq!(
        o("orchestrator_runs_total{principal=\"\",reason=\"none\",status=\"completed\"}"),
        2.0,
        "{after:?}"
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
    assert_eq!(after.get("orchestrator_runs_in_flight{}").copied(), Some(0.0));
    assert_eq!(after.get("orchestrator_tool_calls_in_flight{}").copied(), Some(0.0));
}

fn the_runners_metrics_summed_move_by_what_the_runs_did(before: &[Scraped], after: &[Scraped]) {
    let mut summed: BTreeMap<String, f64> = BTreeMap::new();
    for (before, after) in before.iter().zip(after) {
        for series in [
            "tool_runner_executions_total{outcome=\"ok\",tool=\"calculate\"}",
            "tool_runner_executions_total{outcome=\"ok\",tool=\"sleep\"}",
            "tool_runner_executions_total{outcome=\"INVALID_ARGUMENTS\",tool=\"sleep\"}",
            "tool_runner_execution_duration_seconds_count{tool=\"sleep\"}",
            "tool_runner_rejected_total{reason=\"concurrency_limit\"}",
        ] {
            *summed.entry(series.to_owned()).or_default() += delta(before, after, series);
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
    assert_eq!(summed, expected, "summed over both replicas");
}

fn the_deploys_dashboard_and_rules_query_only_exported_metrics(
    exported: &std::collections::BTreeSet<String>,
) -> TestResult {
    let used = metrics_used_in_deploy()?;
    assert!(used.len() >= 15, "{used:?}");
    let missing: Vec<&String> = used.iter().filter(|m| !exported.contains(*m)).collect();
    assert!(
        missing.is_empty(),
        "not on /metrics: {missing:?}\nexported: {exported:?}"
    );
    Ok(())
}

type Traced<'a> = [&'a (String, opentelemetry_proto::tonic::trace::v1::Span)];

fn named<'a>(spans: &Traced<'a>, prefix: &str) -> Vec<&'a (String, opentelemetry_proto::tonic::trace::v1::Span)> {
    spans
        .iter()
        .copied()
        .filter(|(_, s)| s.name.starts_with(prefix))
        .collect()
}

/// `invoke_agent` is the orchestrator's, a child of the caller's span, with the run's attributes
/// and its signal as an event.
fn invoke_agent_continues_the_callers_span<'a>(
    spans: &Traced<'a>,
    run_id: &str,
) -> anyhow::Result<&'a opentelemetry_proto::tonic::trace::v1::Span> {
    let agents = named(spans, "invoke_agent");
    assert_eq!(
        agents.len(),
        1,
        "spans of the caller's trace: {:?}",
        spans.iter().map(|(svc, s)| (svc, &s.name)).collect::<Vec<_>>()
    );
    let (service, agent) = agents[0];
    assert_eq!(service, "orchestrator");
    assert_eq!(hex(&agent.parent_span_id), CALLER_SPAN);
    for (key, value) in [
        ("gen_ai.operation.name", "invoke_agent"),
        ("orchestrator.run.id", run_id),
        ("orchestrator.run.status", "completed"),
        ("orchestrator.run.turns", "2"),
        ("orchestrator.run.signals", "1"),
    ] {
        assert_eq!(string_attr(&agent.attributes, key).as_deref(), Some(value), "{key}");
    }
    let signal = agent
        .events
        .iter()
        .find(|e| e.name == "signal")
        .ok_or_else(|| anyhow::anyhow!("no signal event"))?;
    assert_eq!(
        string_attr(&signal.attributes, "gen_ai.tool.name").as_deref(),
        Some("submit_report")
    );
    Ok(agent)
}

/// Two `chat` client spans under `invoke_agent`, with the GenAI request and usage attributes;
/// returns turn 1's.
fn two_chat_turns_are_under_it<'a>(
    spans: &Traced<'a>,
    agent: &opentelemetry_proto::tonic::trace::v1::Span,
) -> anyhow::Result<&'a opentelemetry_proto::tonic::trace::v1::Span> {
    let chats = named(spans, "chat stand-in");
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
    chats
        .into_iter()
        .map(|(_, c)| c)
        .find(|c| string_attr(&c.attributes, "orchestrator.turn").as_deref() == Some("1"))
        .ok_or_else(|| anyhow::anyhow!("no turn 1"))
}

/// Turn 1's three `execute_tool` client spans, each the parent of a runner's server span of the
/// same call (payloads off by default).
fn each_call_of_turn_1_is_the_parent_of_a_runners_span(
    spans: &Traced<'_>,
    first_turn: &opentelemetry_proto::tonic::trace::v1::Span,
) -> TestResult {
    let calls = named(spans, "execute_tool");
    let clients: Vec<_> = calls.iter().filter(|(svc, _)| svc == "orchestrator").collect();
    let servers: Vec<_> = calls.iter().filter(|(svc, _)| svc == "tool-runner").collect();
    assert_eq!((clients.len(), servers.len()), (3, 3));
    for (_, client) in clients {
        assert_eq!(client.parent_span_id, first_turn.span_id);
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
    let mut command = Command::new(testkit::tool_runner_bin!()?);
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
    let orchestrator = Service::orchestrator(command).await?;
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

/// One trace: invoke_agent → chat → execute_tool (client, both tools, same turn) → execute_tool
/// (server) → tools/call (the MCP call), whose context reached the MCP server in `_meta` (`sent`
/// is what the runner wrote to the server's stdin) with the call id and run id.
fn the_mcp_call_is_one_trace_down_to_the_server(
    spans: &Spans,
    caller_trace: &str,
    sent: &str,
    result: &pb::RunResult,
) -> TestResult {
    let traced: Vec<_> = spans.iter().filter(|(_, s)| hex(&s.trace_id) == caller_trace).collect();
    let one = |service: &str, name: &str| -> anyhow::Result<&opentelemetry_proto::tonic::trace::v1::Span> {
        let found: Vec<_> = traced
            .iter()
            .filter(|(svc, s)| svc == service && s.name == name)
            .collect();
        anyhow::ensure!(
            found.len() == 1,
            "{} spans {service}/{name} in {:?}",
            found.len(),
            traced.iter().map(|(svc, s)| (svc, &s.name)).collect::<Vec<_>>()
        );
        Ok(&found[0].1)
    };
    let mcp_client = one("orchestrator", "execute_tool time__get_current_time")?;
    let builtin_client = one("orchestrator", "execute_tool calculate")?;
    assert_eq!(
        mcp_client.parent_span_id, builtin_client.parent_span_id,
        "both calls belong to the same turn"
    );
    let mcp_server = one("tool-runner", "execute_tool time__get_current_time")?;
    assert_eq!(mcp_server.parent_span_id, mcp_client.span_id);
    assert_eq!(
        one("tool-runner", "execute_tool calculate")?.parent_span_id,
        builtin_client.span_id
    );
    let mcp_call = one("tool-runner", "tools/call get_current_time")?;
    assert_eq!(mcp_call.parent_span_id, mcp_server.span_id);
    assert_eq!(mcp_call.kind, SpanKind::Client as i32);
    assert_eq!(string_attr(&mcp_call.attributes, "mcp.server").as_deref(), Some("time"));
    let call_line = sent
        .lines()
        .find(|l| l.contains("\"tools/call\""))
        .ok_or_else(|| anyhow::anyhow!("no tools/call in {sent}"))?;
    let call: serde_json::Value = serde_json::from_str(call_line)?;
    assert_eq!(
        call["params"]["_meta"]["traceparent"],
        format!("00-{caller_trace}-{}-01", hex(&mcp_call.span_id)),
        "{call}"
    );
    // The call id travels as the idempotency key, with the run id.
    let mcp_record = result
        .tool_calls
        .iter()
        .find(|c| c.name == "time__get_current_time")
        .ok_or_else(|| anyhow::anyhow!("no MCP call in {result:?}"))?;
    assert_eq!(
        call["params"]["_meta"]["orchestrator/call_id"],
        mcp_record.call_id.as_str(),
        "{call}"
    );
    assert_eq!(
        call["params"]["_meta"]["orchestrator/run_id"],
        result.run_id.as_str(),
        "{call}"
    );
    Ok(())
}

#[tokio::test]
async fn an_mcp_tool_and_a_built_in_called_in_one_turn_make_one_trace_down_to_the_mcp_server() -> TestResult {
    use testkit::mcp_servers::time_server;
    let (collector, otlp) = Collector::start().await?;
    let mock = mock_llm::MockLlm::start(Scenario::new(vec![
        Turn::text("Both at once.\n")
            .then(Step::call(
                "time__get_current_time",
                serde_json::json!({"timezone": "UTC"}),
            ))
            .then(Step::call("calculate", serde_json::json!({"expression": "6 * 7"}))),
        Turn::text("It is now, and 42."),
    ]))
    .await?;

    // A runner hosting mcp-server-time over stdio, its stdin copied to a log (to read what the
    // runner sent it).
    let dir = tempfile::tempdir()?;
    let sent_log = dir.path().join("stdin.log");
    let manifest = dir.path().join("tools.toml");
    std::fs::write(
        &manifest,
        format!(
            "[[mcp_servers]]\nname = \"time\"\ncommand = \"sh\"\nargs = [\"-c\", \"tee -a '{log}' | exec '{time}'\"]\nrequired = true\n",
            log = sent_log.display(),
            time = time_server()?.display(),
        ),
    )?;
    let mut command = Command::new(testkit::tool_runner_bin!()?);
    command
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp)
        .env_remove("OTEL_SERVICE_NAME")
        .arg("--tools-manifest")
        .arg(&manifest);
    let runner = Service::spawn(command, "127.0.0.1", "tool-runner serving").await?;
    let mut command = Command::new(env!("CARGO_BIN_EXE_orchestrator"));
    command
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp)
        .env_remove("OTEL_SERVICE_NAME")
        .env("LLM_BASE_URL", mock.base_url())
        .env("TOOL_RUNNER_ENDPOINTS", format!("http://{}", runner.grpc));
    let orchestrator = Service::orchestrator(command).await?;

    let caller_trace = "0af7651916cd43dd8448eb211c80319c";
    let mut request = tonic::Request::new(user("time and sum"));
    request
        .metadata_mut()
        .insert("traceparent", format!("00-{caller_trace}-b7ad6b7169203331-01").parse()?);
    let result = orchestrate(&format!("http://{}", orchestrator.grpc), request).await?;
    assert_eq!(result.status(), pb::RunStatus::Completed, "{result:?}");
    assert_eq!(result.tool_calls.len(), 2, "{result:?}");
    assert!(
        result.tool_calls.iter().all(|c| c.ok && c.turn == 1),
        "both calls answered in turn 1: {result:?}"
    );
    // The MCP tool's answer went back to the model.
    let fed_back = mock.requests().last().map(ToString::to_string).unwrap_or_default();
    assert!(fed_back.contains("\\\"timezone\\\":\\\"UTC\\\""), "{fed_back}");
    // The runner logs the connection, not the MCP library's INFO handshake dump.
    let logs = runner.logs();
    assert!(logs.iter().any(|l| l.contains("MCP server connected")), "{logs:?}");
    assert!(!logs.iter().any(|l| l.contains("rmcp")), "{logs:?}");
    orchestrator.stop().await?;
    runner.stop().await?;

    let spans = collector.0.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.clone();
    let sent = std::fs::read_to_string(&sent_log)?;
    the_mcp_call_is_one_trace_down_to_the_server(&spans, caller_trace, &sent, &result)
}
