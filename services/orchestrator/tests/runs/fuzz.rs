//! Property tests on the two inputs the orchestrator takes from outside: the LLM's SSE stream
//! (decoder → turn collector: assembler and hold-back) and `Orchestrate` requests (validation,
//! through the real gRPC API). Cases per property: `FUZZ_CASES` (default 128; set e.g. 100000
//! for a long run). A failing case is printed minimised by proptest; keep it as a regression
//! test beside the module it breaks.

use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use orchestrator::domain::model::{LlmError, LlmEvent};
use orchestrator::llm::sse::{DecodeLimits, decode};
use orchestrator::run::turn::TurnCollector;
use proptest::prelude::*;
use proto::orchestrator::v1 as pb;

fn cases() -> u32 {
    std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(128)
}

const LIMITS: DecodeLimits = DecodeLimits {
    idle_timeout: Duration::from_secs(5),
    max_line_bytes: 512,
    max_event_bytes: 2048,
};

/// Pieces an SSE stream from an OpenAI-compatible server (or a broken one) is made of.
fn sse_piece() -> impl Strategy<Value = Vec<u8>> {
    let text = "[a-z {}`\n<>\"\\\\é]{0,40}";
    let chunk = |delta: String| format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{delta}}}]}}\n\n");
    prop_oneof![
        text.prop_map(move |t| chunk(format!("{{\"content\":{}}}", serde_json::Value::from(t)))),
        text.prop_map(move |t| chunk(format!("{{\"reasoning_content\":{}}}", serde_json::Value::from(t)))),
        (0u32..6, proptest::option::of("[a-z_]{1,8}"), "[a-z{}\":,0-9]{0,30}").prop_map(move |(i, name, args)| {
            let name = name.map_or("null".to_owned(), |n| format!("\"{n}\""));
            let args = serde_json::Value::from(args);
            chunk(format!(
                "{{\"tool_calls\":[{{\"index\":{i},\"id\":\"c{i}\",\"function\":{{\"name\":{name},\"arguments\":{args}}}}}]}}"
            ))
        }),
        Just("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\n\n".to_owned()),
        Just("data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n".to_owned()),
        Just("data: [DONE]\n\n".to_owned()),
        Just(": keep-alive\n\n".to_owned()),
        Just("event: message\r\n".to_owned()),
        Just("\r\n".to_owned()),
        Just("data: {not json\n\n".to_owned()),
        Just("data: {\"error\":{\"message\":\"overloaded\"}}\n\n".to_owned()),
        (1usize..40).prop_map(|n| format!("data: {}{}\n\n", "[".repeat(n * 10), "]".repeat(n * 10))),
        (1usize..3).prop_map(|n| format!("data: {}\n", "x".repeat(n * 400))),
    ]
    .prop_map(String::into_bytes)
    .boxed()
    .prop_union(proptest::collection::vec(any::<u8>(), 0..16).boxed())
}

/// Decodes `bytes` delivered in pieces cut at `cuts`; the events up to the first error, and it.
async fn decode_cut(bytes: &[u8], cuts: &[usize]) -> (Vec<LlmEvent>, Option<LlmError>) {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    points.extend([0, bytes.len()]);
    points.sort_unstable();
    points.dedup();
    let pieces: Vec<Result<Bytes, std::io::Error>> = points
        .windows(2)
        .map(|w| Ok(Bytes::copy_from_slice(&bytes[w[0]..w[1]])))
        .collect();
    let mut stream = decode(futures::stream::iter(pieces), LIMITS);
    let mut events = Vec::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => events.push(event),
            Err(e) => return (events, Some(e)),
        }
    }
    (events, None)
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("a test runtime: {e}"))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// However the bytes are cut, the decoder sees the same events and the same error; the turn
    /// made of them stays within its bounds and never panics.
    #[test]
    fn sse_decoding_is_independent_of_how_bytes_arrive_and_turns_stay_bounded(
        pieces in proptest::collection::vec(sse_piece(), 0..40),
        cuts_a in proptest::collection::vec(any::<usize>(), 0..20),
        cuts_b in proptest::collection::vec(any::<usize>(), 0..20),
    ) {
        let bytes: Vec<u8> = pieces.concat();
        let (a, b) = runtime().block_on(async {
            (decode_cut(&bytes, &cuts_a).await, decode_cut(&bytes, &cuts_b).await)
        });
        prop_assert_eq!(&a, &b);
        let mut turn = TurnCollector::new(3, 64);
        let mut shown = String::new();
        for event in a.0 {
            shown.push_str(&turn.push(event).unwrap_or_default());
        }
        let output = turn.finish();
        prop_assert!(output.structured.len() <= 3);
        prop_assert!(output.structured.iter().all(within_bounds), "{:?}", output.structured);
        let _ = shown;
    }
}

/// A call the collector let through: arguments within 64 bytes (or the `{}` put in for none),
/// a name within the longest valid one and a byte.
fn within_bounds(call: &orchestrator::domain::assembly::AssembledCall) -> bool {
    (call.arguments.len() <= 64 || call.arguments == "\u{7b}}") && call.name.len() <= 65
}

/// An orchestrator in this process (stand-in model, in-process tool-runner); its endpoint.
fn orchestrator() -> &'static str {
    static ENDPOINT: OnceLock<String> = OnceLock::new();
    ENDPOINT.get_or_init(|| {
        runtime().block_on(async {
            let mock = mock_llm::MockLlm::start(mock_llm::Scenario::new(vec![mock_llm::Turn::text("ok")]))
                .await
                .unwrap_or_else(|e| panic!("the stand-in model: {e}"));
            let runner = testkit::tool_runner_in_process()
                .await
                .unwrap_or_else(|e| panic!("a tool-runner: {e}"));
            let config = orchestrator::Config::new(&mock.base_url(), "stand-in", vec![runner]);
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .unwrap_or_else(|e| panic!("a listener: {e}"));
            let endpoint = format!("http://{}", listener.local_addr().unwrap_or_else(|e| panic!("{e}")));
            tokio::spawn(orchestrator::serve(listener, config, std::future::pending()));
            std::mem::forget(mock);
            endpoint
        })
    })
}

fn message() -> impl Strategy<Value = pb::ChatMessage> {
    (
        prop_oneof![
            Just("user"),
            Just("assistant"),
            Just("system"),
            Just("tool"),
            Just("robot"),
            Just("")
        ],
        ".{0,20}",
        prop_oneof![Just(String::new()), "[a-z0-9]{1,4}".boxed()],
    )
        .prop_map(|(role, content, tool_call_id)| pb::ChatMessage {
            role: role.into(),
            content,
            tool_call_id,
            ..Default::default()
        })
}

fn exit_tool() -> impl Strategy<Value = pb::ExitToolSpec> {
    (
        prop_oneof![Just("done".to_owned()), Just("calculate".to_owned()), ".{0,70}".boxed()],
        prop_oneof![
            Just(String::new()),
            Just("{\"type\":\"object\"}".to_owned()),
            Just("{\"type\":\"object\",\"required\":5}".to_owned()),
            Just("{not json".to_owned()),
            (1usize..200).prop_map(|n| format!("{}{}", "{\"items\":".repeat(n), "}".repeat(n))),
        ],
    )
        .prop_map(|(name, parameters_json_schema)| pb::ExitToolSpec {
            name,
            description: String::new(),
            parameters_json_schema,
        })
}

fn limits() -> impl Strategy<Value = Option<pb::RunLimits>> {
    let n = || proptest::option::of(prop_oneof![Just(0u32), Just(1), Just(u32::MAX), 0u32..2000]);
    proptest::option::of(
        (n(), n(), n(), n(), n(), n(), n()).prop_map(|(a, b, c, d, e, f, g)| pb::RunLimits {
            max_turns: a,
            tool_call_budget: b,
            max_tool_failures: c,
            tool_timeout_ms: d,
            run_timeout_ms: e.map(|ms| ms.min(5_000)),
            approval_timeout_ms: None,
            max_total_tokens: f.map(u64::from),
            input_timeout_ms: g,
        }),
    )
}

fn request() -> impl Strategy<Value = pb::OrchestrateRequest> {
    (
        prop_oneof![Just(String::new()), ".{0,140}".boxed()],
        proptest::collection::vec(message(), 0..4),
        proptest::option::of((
            proptest::collection::vec(prop_oneof![Just("calculate".to_owned()), ".{0,10}".boxed()], 0..3),
            proptest::collection::vec(exit_tool(), 0..3),
        )),
        limits(),
        proptest::collection::btree_map(".{0,8}", ".{0,16}", 0..4),
        any::<i32>(),
        prop_oneof![Just(String::new()), ".{0,10}".boxed()],
    )
        .prop_map(
            |(run_id, messages, tools, limits, metadata, parse_policy, model)| pb::OrchestrateRequest {
                run_id,
                messages,
                tools: tools.map(|(normal, exit)| pb::ToolSelection {
                    normal,
                    exit,
                    approval: None,
                }),
                limits,
                metadata: metadata.into_iter().collect(),
                parse_policy: parse_policy % 4,
                model,
                ..Default::default()
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// Any request is refused with a clear, deliberate code or runs to `run_finished`; the
    /// server never answers INTERNAL or UNKNOWN, and never hangs.
    #[test]
    fn any_request_is_refused_clearly_or_runs_to_its_end(request in request()) {
        let endpoint = orchestrator();
        let outcome: Result<(), String> = runtime().block_on(async {
            let mut client = pb::orchestrator_client::OrchestratorClient::connect(endpoint.to_owned())
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let call = tokio::time::timeout(Duration::from_secs(20), async {
                match client.orchestrate(request).await {
                    Err(status) => Err(status),
                    Ok(stream) => {
                        let mut stream = stream.into_inner();
                        let mut finished = false;
                        while let Some(event) = stream.message().await? {
                            finished |= matches!(event.event, Some(pb::orchestrate_event::Event::RunFinished(_)));
                        }
                        if finished { Ok(()) } else { Err(tonic::Status::data_loss("no run_finished")) }
                    }
                }
            });
            match call.await {
                Err(_) => Err("no answer within 20s".to_owned()),
                Ok(Ok(())) => Ok(()),
                Ok(Err(status)) => match status.code() {
                    tonic::Code::InvalidArgument | tonic::Code::AlreadyExists if !status.message().is_empty() => Ok(()),
                    code => Err(format!("{code:?}: {}", status.message())),
                },
            }
        });
        prop_assert!(outcome.is_ok(), "{:?}", outcome);
    }
}
