//! The orchestrator against real model servers, installed by `./scripts/model-servers` (which
//! `./scripts/test` runs): llama.cpp's `llama-server` with SmolLM2-135M-Instruct, and the LiteLLM
//! proxy. Everything else is the real stack in process (orchestrator, tool-runner).
//!
//! What the model writes is its own: greedy sampling gives the same text on one machine, but
//! another CPU's arithmetic may change it. So the tests assert only what holds on every machine:
//! token counts under `ignore_eos`, the server's own grammars keeping text free of calls
//! ([`PLAIN_TEXT_BODY`]) or making a structured call ([`FORCED_CALL_BODY`]), and what the
//! orchestrator does with them; never the model's words.

use std::time::Duration;

use futures::StreamExt;
use mock_llm::Scenario;
use proto::orchestrator::v1 as pb;
use proto::orchestrator::v1::orchestrate_event::Event as E;
use proto::orchestrator::v1::{FailureReason as R, RunStatus as S};
use testkit::model_servers::{
    FORCED_CALL_BODY, LITELLM_MASTER_KEY, ModelServer, PLAIN_TEXT_BODY, Relay, TEMPLATE_FILE, installed, one_at_a_time,
};
use testkit::stack::{Outcome, Stack, request, runner_config};

type TestResult = anyhow::Result<()>;

/// The orchestrator and a tool-runner in front of the model server at `base_url`, asking for
/// `model` (the stand-in model the stack also starts is not used).
async fn stack_on(
    base_url: String,
    model: &str,
    tweak: impl FnOnce(&mut orchestrator::Config),
) -> anyhow::Result<Stack> {
    Stack::start(Scenario::new(Vec::new()), runner_config(None), |config| {
        config.llm.base_urls = vec![base_url];
        config.llm.model = model.into();
        config.llm.idle_timeout = Duration::from_secs(120);
        tweak(config);
    })
    .await
}

/// A request for `prompt` with greedy sampling and `params` on top.
fn greedy(prompt: &str, params: pb::ModelParams) -> pb::OrchestrateRequest {
    let mut asked = request(prompt, &[]);
    asked.params = Some(pb::ModelParams {
        temperature: Some(0.0),
        ..params
    });
    asked
}

/// llama-server with one slot and the Llama 3.2 chat template (its tool calls and tool messages).
async fn llama_with_tool_template() -> anyhow::Result<ModelServer> {
    llama_with_template(&installed(&format!("templates/{TEMPLATE_FILE}"))?).await
}

/// llama-server with one slot and the chat template in `template`.
async fn llama_with_template(template: &std::path::Path) -> anyhow::Result<ModelServer> {
    let template = template.to_string_lossy();
    ModelServer::llama(&[
        "--parallel",
        "1",
        "--ctx-size",
        "4096",
        "--jinja",
        "--chat-template-file",
        &template,
    ])
    .await
}

/// The run failed `LLM_ERROR` with a detail holding `message` (the server's words).
fn assert_llm_error(out: &Outcome, message: &str) {
    assert_eq!(
        (out.status(), out.reason()),
        (S::Failed, R::LlmError),
        "{:?}",
        out.result
    );
    assert!(
        out.result.failure_detail.contains(message),
        "{}",
        out.result.failure_detail
    );
}

/// [`PLAIN_TEXT_BODY`] with `extra` merged in, as `extra_body_json`.
fn plain_text(extra: serde_json::Value) -> String {
    let mut body: serde_json::Value = serde_json::from_str(PLAIN_TEXT_BODY).unwrap_or_default();
    if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
        body.extend(extra.clone());
    }
    body.to_string()
}

fn text_deltas(out: &Outcome) -> usize {
    out.of(|e| matches!(e, E::TextDelta(_)).then_some(())).len()
}

#[tokio::test]
async fn llama_server_streams_text_and_usage_and_honours_max_tokens_and_stop() -> TestResult {
    let _serial = one_at_a_time().await;
    let llama = ModelServer::llama(&["--parallel", "1", "--ctx-size", "2048"]).await?;
    let stack = stack_on(llama.base_url(), "smollm2", |_| {}).await?;
    let none = || pb::ModelParams {
        tool_choice: "none".into(),
        ..Default::default()
    };

    // max_tokens: the turn ends `length` after exactly that many tokens (`ignore_eos`), streamed as
    // they come; 20 tokens hold fewer lines than the repeated-line detector's threshold.
    let out = stack
        .run(greedy(
            "Write a short poem about the sea.",
            pb::ModelParams {
                max_tokens: Some(20),
                extra_body_json: plain_text(serde_json::json!({"ignore_eos": true})),
                ..none()
            },
        ))
        .await?;
    assert_eq!(out.status(), S::Completed, "{:?}", out.result);
    assert_eq!(out.result.finish_reason, "length");
    let usage = out.result.usage.unwrap_or_default();
    assert_eq!(usage.completion_tokens, 20);
    assert!(usage.prompt_tokens > 0);
    assert!(text_deltas(&out) > 1, "streamed in pieces: {:?}", out.events);
    assert!(!out.result.text.trim().is_empty());

    // stop: the text ends before the stop sequence, which the server does not return. The
    // grammar puts a line break within the first 40 characters, so the stop sequence comes.
    let out = stack
        .run(greedy(
            "Write a short poem about the sea.",
            pb::ModelParams {
                max_tokens: Some(64),
                stop: vec!["\n".into()],
                extra_body_json: r#"{"grammar": "root ::= [^{<`\\n]{1,40} \"\\n\" [^{<`]*"}"#.into(),
                ..none()
            },
        ))
        .await?;
    assert_eq!(
        (out.status(), out.result.finish_reason.as_str()),
        (S::Completed, "stop")
    );
    assert!(!out.result.text.contains('\n'), "{:?}", out.result.text);
    assert!(out.result.usage.unwrap_or_default().completion_tokens < 64);
    Ok(())
}

#[tokio::test]
async fn canceling_mid_generation_frees_the_servers_slot() -> TestResult {
    let _serial = one_at_a_time().await;
    let llama = ModelServer::llama(&["--parallel", "1", "--ctx-size", "2048"]).await?;
    let stack = stack_on(llama.base_url(), "smollm2", |config| {
        config.runs.loop_detector.threshold = config.runs.loop_detector.window;
    })
    .await?;
    // ignore_eos keeps the model generating until max_tokens: far longer than the test waits.
    let asked = greedy(
        "Count from 1 to 1000, one number per line.",
        pb::ModelParams {
            tool_choice: "none".into(),
            max_tokens: Some(1500),
            extra_body_json: plain_text(serde_json::json!({"ignore_eos": true})),
            ..Default::default()
        },
    );
    let mut client = stack.client().await?;
    let mut stream = client.orchestrate(asked).await?.into_inner();
    let mut run_id = String::new();
    while let Some(event) = tokio::time::timeout(Duration::from_secs(60), stream.next()).await? {
        let event = event?;
        if matches!(event.event, Some(E::TextDelta(_))) {
            run_id = event.run_id;
            break;
        }
    }
    anyhow::ensure!(!run_id.is_empty(), "the stream ended before any text");
    let slots = llama.get_json("/slots").await?;
    assert_eq!(slots[0]["is_processing"], true, "generating: {slots}");

    let canceled = client
        .cancel_run(pb::CancelRunRequest {
            run_id: run_id.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert!(canceled.canceled);
    let mut events = Vec::new();
    while let Some(event) = tokio::time::timeout(Duration::from_secs(30), stream.next()).await? {
        events.push(event?);
    }
    let Some(E::RunFinished(finished)) = events.last().and_then(|e| e.event.clone()) else {
        anyhow::bail!("no run_finished: {events:?}");
    };
    let result = finished.result.unwrap_or_default();
    assert_eq!(result.status, S::Canceled as i32);
    assert!(!result.text.is_empty(), "the text so far is kept");

    // Closing the stream tells llama-server to stop: its one slot is free again, well before
    // max_tokens would have freed it.
    let slots = testkit::wait::until("llama-server's slot to be free", Duration::from_secs(10), || async {
        let slots = llama.get_json("/slots").await.ok()?;
        (slots[0]["is_processing"] == false).then_some(slots)
    })
    .await?;
    let decoded = slots[0]["next_token"][0]["n_decoded"].as_u64().unwrap_or(0);
    assert!(decoded < 1500, "stopped at {decoded} tokens: {slots}");
    Ok(())
}

#[tokio::test]
async fn a_context_overflow_is_an_llm_error_carrying_the_servers_message() -> TestResult {
    let _serial = one_at_a_time().await;
    let llama = ModelServer::llama(&["--parallel", "1", "--ctx-size", "256"]).await?;
    let stack = stack_on(llama.base_url(), "smollm2", |_| {}).await?;
    let long = "Tell me about the sea. ".repeat(100);
    let out = stack.run(greedy(&long, pb::ModelParams::default())).await?;
    assert_llm_error(&out, "exceeds the available context size");
    Ok(())
}

#[tokio::test]
async fn more_concurrent_runs_than_server_slots_all_complete() -> TestResult {
    let _serial = one_at_a_time().await;
    let llama = ModelServer::llama(&["--parallel", "2", "--ctx-size", "4096"]).await?;
    let stack = stack_on(llama.base_url(), "smollm2", |_| {}).await?;
    let runs = (0..5).map(|i| {
        stack.run(greedy(
            &format!("Name {} colours.", i + 2),
            pb::ModelParams {
                tool_choice: "none".into(),
                max_tokens: Some(12),
                extra_body_json: plain_text(serde_json::json!({"ignore_eos": true})),
                ..Default::default()
            },
        ))
    });
    for out in futures::future::join_all(runs).await {
        let out = out?;
        assert_eq!(out.status(), S::Completed, "{:?}", out.result);
        assert_eq!(out.result.usage.unwrap_or_default().completion_tokens, 12);
    }
    Ok(())
}

/// The second chat request (of `sent`) carried the call `call_id` and its `result` back (with
/// `tool_choice` back to auto), starts with the first request byte for byte (the BIOS is the
/// same), and ends with the status note as a user message (which the Llama 3.2 template takes).
fn the_second_request_extends_the_first_with_the_call_and_its_result(
    sent: &[String],
    call_id: &str,
    result: &str,
) -> TestResult {
    // The second request carried the call and its result back to llama-server.
    assert_eq!(sent.len(), 2, "two chat requests: {sent:?}");
    let second: serde_json::Value = serde_json::from_str(&sent[1])?;
    let messages = second["messages"].as_array().cloned().unwrap_or_default();
    let tool = messages
        .iter()
        .find(|m| m["role"] == "tool")
        .cloned()
        .unwrap_or_default();
    assert_eq!(tool["tool_call_id"], call_id);
    assert_eq!(tool["content"].as_str(), Some(result), "{tool}");
    assert_eq!(second["tool_choice"], "auto", "required forces the first turn only");

    // The second request starts with the first byte for byte (the BIOS is the same; the status
    // note follows the tool message as a user message, which the Llama 3.2 template takes).
    let first_body = sent[0].as_bytes();
    let marker = br#"],"stream":true,"#;
    let end = first_body
        .windows(marker.len())
        .rposition(|w| w == marker)
        .unwrap_or(first_body.len());
    assert!(
        sent[1].as_bytes().starts_with(&first_body[..end]),
        "{}\n{}",
        sent[0],
        sent[1]
    );
    let note = messages.last().cloned().unwrap_or_default();
    assert_eq!(note["role"], "user", "{note}");
    assert!(
        note["content"]
            .as_str()
            .is_some_and(|c| c.starts_with("[orchestrator status] Turn 2")),
        "{note}"
    );
    Ok(())
}

/// A structured call made by llama-server's own tool-call grammar and parser (SmolLM2-135M with
/// the Llama 3.2 template; [`FORCED_CALL_BODY`] makes the call certain on every CPU), executed on
/// a tool-runner, its result sent back in the next request (seen by a relay in front of the
/// server). The second turn is the model's own; `max_turns: 2` ends the run there.
#[tokio::test]
async fn a_structured_tool_call_from_llama_server_runs_on_a_tool_runner_and_goes_back() -> TestResult {
    let _serial = one_at_a_time().await;
    let llama = llama_with_tool_template().await?;
    let relay = Relay::start(&llama.origin).await?;
    let stack = stack_on(relay.base_url(), "smollm2", |_| {}).await?;
    let mut asked = greedy(
        "What time is it? Call time_now.",
        pb::ModelParams {
            tool_choice: "required".into(),
            parallel_tool_calls: Some(false),
            max_tokens: Some(64),
            extra_body_json: FORCED_CALL_BODY.into(),
            ..Default::default()
        },
    );
    if let Some(tools) = asked.tools.as_mut() {
        tools.normal = vec!["time_now".into()];
    }
    asked.limits = Some(pb::RunLimits {
        max_turns: Some(2),
        ..Default::default()
    });
    let out = stack.run(asked).await?;

    // Turn 1: the call, with empty arguments (the grammar admits whitespace inside).
    let first = out.result.tool_calls.first().cloned().unwrap_or_default();
    assert_eq!(
        (first.name.as_str(), first.ok, first.turn),
        ("time_now", true, 1),
        "{:?}\n{}",
        out.result,
        llama.logs()
    );
    let arguments: serde_json::Value = serde_json::from_str(&first.arguments_json)?;
    assert_eq!(arguments, serde_json::json!({}));
    let finished = out.of(|e| match e {
        E::ToolCallFinished(f) => Some(f.content_json.clone()),
        _ => None,
    });
    assert!(finished[0].contains("unix_ms"), "{finished:?}");

    the_second_request_extends_the_first_with_the_call_and_its_result(&relay.requests(), &first.call_id, &finished[0])?;

    // Turn 2 is the model's own (text, another call, or output the server's parser refuses);
    // `max_turns: 2` ends the run there whatever it is, with turn 1's call kept.
    assert_eq!(out.result.turns, 2, "{:?}", out.result);
    Ok(())
}

/// `extra_body` whose grammar makes every turn write the same call in its text, which the
/// fallback parser runs: the same on every CPU, and every turn ends with its usage.
const TEXT_CALL_BODY: &str =
    r#"{"grammar": "root ::= \"<tool_call>{\\\"name\\\": \\\"time_now\\\", \\\"arguments\\\": {}}</tool_call>\""}"#;

/// A run's later turns find their prefix in llama-server's prompt cache (one slot, so the
/// slot that served turn 1 serves turn 2): the server reports the cached prompt tokens in its
/// usage, and they reach the turn's `turn_finished`.
#[tokio::test]
async fn llama_servers_prompt_cache_holds_a_runs_earlier_turns() -> TestResult {
    let _serial = one_at_a_time().await;
    let llama = llama_with_tool_template().await?;
    let stack = stack_on(llama.base_url(), "smollm2", |_| {}).await?;
    let mut asked = greedy(
        "What time is it?",
        pb::ModelParams {
            tool_choice: "none".into(),
            max_tokens: Some(64),
            extra_body_json: TEXT_CALL_BODY.into(),
            ..Default::default()
        },
    );
    if let Some(tools) = asked.tools.as_mut() {
        tools.normal = vec!["time_now".into()];
    }
    asked.limits = Some(pb::RunLimits {
        max_turns: Some(3),
        ..Default::default()
    });
    let out = stack.run(asked).await?;
    assert_eq!(
        (out.status(), out.reason(), out.result.tool_calls.len()),
        (S::Failed, R::MaxTurnsExceeded, 3),
        "{:?}\n{}",
        out.result,
        llama.logs()
    );
    let usage: Vec<pb::Usage> = out.of(|e| match e {
        E::TurnFinished(t) => t.usage,
        _ => None,
    });
    assert_eq!(usage.len(), 3, "{usage:?}");
    assert_eq!(usage[0].cached_prompt_tokens, 0, "{usage:?}");
    for (before, later) in usage.iter().zip(&usage[1..]) {
        // All of the previous prompt was cached (llama.cpp may re-evaluate its last token).
        assert!(
            later.cached_prompt_tokens + 1 >= before.prompt_tokens && later.cached_prompt_tokens < later.prompt_tokens,
            "{usage:?}"
        );
    }
    let total = out.result.usage.unwrap_or_default();
    assert_eq!(
        total.cached_prompt_tokens,
        usage.iter().map(|u| u.cached_prompt_tokens).sum::<u64>()
    );
    Ok(())
}

#[tokio::test]
async fn a_full_run_with_parallel_calls_and_a_signal_through_the_litellm_proxy() -> TestResult {
    let _serial = one_at_a_time().await;
    let litellm = ModelServer::litellm_test_proxy().await?;
    let stack = stack_on(litellm.base_url(), "stand-in", |config| {
        config.llm.api_key = Some(LITELLM_MASTER_KEY.into());
    })
    .await?;
    let out = stack.run(request("check both tools", &["submit_report"])).await?;
    assert_eq!(out.status(), S::Completed, "{:?}\n{}", out.result, litellm.logs());
    let calls: Vec<(&str, bool, u32)> = out
        .result
        .tool_calls
        .iter()
        .map(|c| (c.name.as_str(), c.ok, c.turn))
        .collect();
    assert_eq!(calls, [("calculate", true, 1), ("time_now", true, 1)]);
    let signals = &out.result.signals;
    assert_eq!(signals.len(), 1);
    assert_eq!((signals[0].tool_name.as_str(), signals[0].turn), ("submit_report", 1));
    assert!(out.result.text.contains("7006652"), "{}", out.result.text);
    assert_eq!(out.result.turns, 2);
    assert!(out.result.usage.unwrap_or_default().prompt_tokens > 0);

    // A key that is not the master key: LiteLLM (without a key database) refuses it with a 400
    // "No connected db."; its message is in the result, the key nowhere.
    let stack = stack_on(litellm.base_url(), "stand-in", |config| {
        config.llm.api_key = Some("sk-wrong-key-1234".into());
        config.llm.max_retries = 0;
    })
    .await?;
    let out = stack.run(request("check both tools", &[])).await?;
    assert_llm_error(&out, "400 Bad Request: No connected db");
    assert!(
        !format!("{:?}", out.events).contains("sk-wrong-key-1234"),
        "{}",
        out.result.failure_detail
    );
    Ok(())
}

/// A chat template that refuses two user messages in a row, as Mistral's and Gemma's do: the
/// Llama 3.2 template with that check in front.
fn alternating_template(dir: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    let llama = std::fs::read_to_string(installed(&format!("templates/{TEMPLATE_FILE}"))?)?;
    let check = "{%- for message in messages -%}\
        {%- if loop.index0 > 0 and message['role'] == 'user' and messages[loop.index0 - 1]['role'] == 'user' -%}\
        {{- raise_exception('Conversation roles must alternate: two user messages in a row') -}}\
        {%- endif -%}{%- endfor -%}";
    let path = dir.join("alternating.jinja");
    std::fs::write(&path, format!("{check}{llama}"))?;
    Ok(path)
}

/// `run_id`'s request on `thread`: `prompt`, greedy, with `params` on top.
fn on_thread(thread: &str, run_id: &str, prompt: &str, params: pb::ModelParams) -> pb::OrchestrateRequest {
    let mut asked = greedy(prompt, params);
    asked.run_id = run_id.into();
    asked.thread_id = thread.into();
    asked
}

/// A short plain answer (the tools offered, the server's tool grammar off).
fn short_answer() -> pb::ModelParams {
    pb::ModelParams {
        tool_choice: "none".into(),
        max_tokens: Some(8),
        extra_body_json: PLAIN_TEXT_BODY.into(),
        ..Default::default()
    }
}

/// The roles of each message of a request body the relay saw.
fn roles(body: &str) -> Vec<String> {
    let body: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    messages
        .iter()
        .map(|m| m["role"].as_str().unwrap_or("").to_owned())
        .collect()
}

/// A thread as a model server whose chat template refuses two user messages in a row sees it:
/// a run interrupted by the next run while its call runs leaves no status note for the turn it
/// never ran, and a run canceled mid-generation leaves its prompt, which the next run's prompt
/// joins as one user message. Every run after them completes on the real server.
#[tokio::test]
async fn a_thread_interrupted_mid_run_stays_acceptable_to_a_template_that_wants_turns_to_alternate() -> TestResult {
    let _serial = one_at_a_time().await;
    let dir = tempfile::tempdir()?;
    let template = alternating_template(dir.path())?;
    let llama = llama_with_template(&template).await?;
    let relay = Relay::start(&llama.origin).await?;
    let stack = stack_on(relay.base_url(), "smollm2", |_| {}).await?;
    let thread = "alternating";

    // The first run's turn calls `sleep`; while it sleeps the second run interrupts it.
    let mut napping = on_thread(
        thread,
        "napping",
        "Rest a while.",
        pb::ModelParams {
            // The server's tool grammar off, so the call is the text the grammar below makes.
            tool_choice: "none".into(),
            max_tokens: Some(64),
            extra_body_json: SLEEP_CALL_BODY.into(),
            ..Default::default()
        },
    );
    if let Some(tools) = napping.tools.as_mut() {
        tools.normal = vec!["sleep".into()];
    }
    let mut client = stack.client().await?;
    let mut first = client.orchestrate(napping).await?.into_inner();
    let until_the_call = async {
        let mut seen = Vec::new();
        while let Some(event) = first.message().await? {
            if matches!(event.event, Some(E::ToolCallStarted(_))) {
                return anyhow::Ok(());
            }
            seen.push(event);
        }
        anyhow::bail!("the first run ended before its call: {seen:?}\n{}", llama.logs())
    };
    tokio::time::timeout(Duration::from_secs(60), until_the_call).await??;
    let mut interrupting = on_thread(thread, "interrupting", "Actually, never mind.", short_answer());
    interrupting.on_busy = pb::ThreadBusyPolicy::Interrupt.into();
    let second = stack.run(interrupting).await?;
    assert_eq!(second.status(), S::Completed, "{:?}\n{}", second.result, llama.logs());

    // The third run is canceled while it writes; the fourth follows it.
    let mut writing = on_thread(
        thread,
        "writing",
        "Write a long story.",
        pb::ModelParams {
            tool_choice: "none".into(),
            max_tokens: Some(2000),
            extra_body_json: plain_text(serde_json::json!({"ignore_eos": true})),
            ..Default::default()
        },
    );
    writing.on_busy = pb::ThreadBusyPolicy::Enqueue.into();
    let mut third = client.orchestrate(writing).await?.into_inner();
    let until_text = async {
        while let Some(event) = third.message().await? {
            if matches!(event.event, Some(E::TextDelta(_))) {
                return anyhow::Ok(());
            }
        }
        anyhow::bail!("the third run ended before it wrote")
    };
    tokio::time::timeout(Duration::from_secs(60), until_text).await??;
    client
        .cancel_run(pb::CancelRunRequest {
            run_id: "writing".into(),
            ..Default::default()
        })
        .await?;
    let mut last = on_thread(thread, "last", "Say hello.", short_answer());
    last.on_busy = pb::ThreadBusyPolicy::Enqueue.into();
    let fourth = stack.run(last).await?;
    assert_eq!(fourth.status(), S::Completed, "{:?}\n{}", fourth.result, llama.logs());

    // No request had two user messages in a row, nor a status note for a turn that did not run.
    for body in relay.requests() {
        let roles = roles(&body);
        let paired = roles.windows(2).any(|w| w[0] == "user" && w[1] == "user");
        assert!(!paired, "{roles:?}");
    }
    let kept = stack
        .client()
        .await?
        .get_thread(pb::GetThreadRequest {
            thread_id: thread.into(),
        })
        .await?
        .into_inner();
    let notes = kept
        .messages
        .iter()
        .filter(|m| m.content.starts_with("[orchestrator status]"));
    assert_eq!(notes.count(), 0, "{:?}", kept.messages);
    let runs: Vec<_> = kept.runs.iter().map(|r| (r.run_id.as_str(), r.status())).collect();
    assert_eq!(
        runs,
        [
            ("napping", S::Canceled),
            ("interrupting", S::Completed),
            ("writing", S::Canceled),
            ("last", S::Completed)
        ]
    );
    Ok(())
}

/// `extra_body` whose grammar makes a turn call `sleep` for three seconds in its text, which the
/// fallback parser runs: the same on every CPU.
const SLEEP_CALL_BODY: &str = r#"{"grammar": "root ::= \"<tool_call>{\\\"name\\\": \\\"sleep\\\", \\\"arguments\\\": {\\\"ms\\\": 3000}}</tool_call>\""}"#;
