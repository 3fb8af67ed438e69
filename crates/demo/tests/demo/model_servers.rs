//! The demo against real model servers, with the commands README gives: llama.cpp's
//! `llama-server` with SmolLM2-135M-Instruct, and the LiteLLM proxy (installed by
//! `./scripts/model-servers`, which `./scripts/test` runs).

use testkit::model_servers::{
    FORCED_CALL_BODY, LITELLM_MASTER_KEY, ModelServer, PLAIN_TEXT_BODY, TEMPLATE_FILE, installed, one_at_a_time,
};
use tokio::process::Command;

type TestResult = anyhow::Result<()>;

const BIN: &str = env!("CARGO_BIN_EXE_demo");

async fn demo(env: &[(&str, &str)]) -> anyhow::Result<(Option<i32>, String, String)> {
    let mut command = Command::new(BIN);
    for name in [
        "LLM_API_KEY",
        "LLM_TOOL_CHOICE",
        "LLM_TEMPERATURE",
        "LLM_MAX_TOKENS",
        "LLM_EXTRA_BODY",
        "LLM_PARALLEL_TOOL_CALLS",
        "ORCHESTRATOR_MAX_TURNS",
        "DEMO_PROMPT",
        "DEMO_TOOLS",
    ] {
        command.env_remove(name);
    }
    testkit::run_to_end(command, &[], env).await
}

/// README's commands for llama-server. What the 135M model writes is its own and differs from one
/// CPU to another, so each run is held by llama-server's grammars to what can be asserted: plain
/// text without a call ([`PLAIN_TEXT_BODY`]), then a structured call ([`FORCED_CALL_BODY`]).
#[tokio::test]
async fn the_demo_on_llama_server_streams_text_and_makes_a_real_tool_call() -> TestResult {
    let _serial = one_at_a_time().await;
    let template = installed(&format!("templates/{TEMPLATE_FILE}"))?;
    let template = template.to_string_lossy();
    let llama = ModelServer::llama(&["--parallel", "1", "--jinja", "--chat-template-file", &template]).await?;
    let base_url = llama.base_url();
    let real = |extra: &[(&'static str, &'static str)]| {
        let mut env = vec![
            ("LLM_BASE_URL", base_url.as_str()),
            ("LLM_MODEL", "smollm2"),
            ("LLM_TEMPERATURE", "0"),
        ];
        env.extend_from_slice(extra);
        env
    };

    // Text only: the small model answers and the run completes. 16 tokens hold fewer lines than
    // the repeated-line detector's threshold.
    let (code, stdout, stderr) = demo(&real(&[
        ("LLM_TOOL_CHOICE", "none"),
        ("LLM_MAX_TOKENS", "16"),
        ("LLM_EXTRA_BODY", PLAIN_TEXT_BODY),
        ("DEMO_PROMPT", "Write a haiku about the sea."),
    ]))
    .await?;
    assert_eq!(code, Some(0), "{stdout}\n{stderr}\n{}", llama.logs());
    assert!(stdout.contains("model \"smollm2\" at http://127.0.0.1:"), "{stdout}");
    assert!(stdout.contains("■ COMPLETED · 1 turn(s) · 0 tool call(s)"), "{stdout}");

    // A structured call, run on the tool-runner, its result sent back with turn 2; what turn 2
    // does is the model's own, and ORCHESTRATOR_MAX_TURNS=2 ends the run there.
    let (code, stdout, stderr) = demo(&real(&[
        ("LLM_TOOL_CHOICE", "required"),
        ("LLM_PARALLEL_TOOL_CALLS", "false"),
        ("LLM_MAX_TOKENS", "64"),
        ("LLM_EXTRA_BODY", FORCED_CALL_BODY),
        ("ORCHESTRATOR_MAX_TURNS", "2"),
        ("DEMO_TOOLS", "time_now"),
        ("DEMO_PROMPT", "What time is it? Call time_now."),
    ]))
    .await?;
    assert!(matches!(code, Some(0 | 1)), "{stdout}\n{stderr}\n{}", llama.logs());
    for expected in ["⚙ time_now", "\"unix_ms\":", " · 2 turn(s) · "] {
        assert!(stdout.contains(expected), "{expected:?} missing from:\n{stdout}");
    }
    Ok(())
}

#[tokio::test]
async fn the_demo_through_the_litellm_proxy_completes_with_parallel_calls_and_a_signal() -> TestResult {
    let _serial = one_at_a_time().await;
    let litellm = ModelServer::litellm_test_proxy().await?;
    let base_url = litellm.base_url();
    let (code, stdout, stderr) = demo(&[
        ("LLM_BASE_URL", base_url.as_str()),
        ("LLM_MODEL", "stand-in"),
        ("LLM_API_KEY", LITELLM_MASTER_KEY),
    ])
    .await?;
    assert_eq!(code, Some(0), "{stdout}\n{stderr}\n{}", litellm.logs());
    for expected in [
        "⚙ calculate",
        "⚙ time_now",
        "⚑ signal submit_report",
        "■ COMPLETED · 2 turn(s) · 2 tool call(s) · 1 signal(s)",
    ] {
        assert!(stdout.contains(expected), "{expected:?} missing from:\n{stdout}");
    }
    assert!(!stdout.contains(LITELLM_MASTER_KEY) && !stderr.contains(LITELLM_MASTER_KEY));
    Ok(())
}
