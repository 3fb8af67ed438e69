//! MCP tools that ask a person before they finish (protocol 2026-07-28, `input_required`), at
//! the tool-runner: a Python `mcp` 2.x server written for the tests
//! (`tests/fixtures/mcp/refund_server.py`, installed by `./scripts/mcp-servers`) over stdio. The
//! runner negotiates the protocol per server and shows it in `ListTools`; a call that asks comes
//! back as `input_required` with its questions, and its retry with the answers (on another
//! runner: the questions' state travels with the call, not in a runner) finishes it.

use std::collections::HashMap;

use proto::toolrunner::v1 as pb;
use serde_json::json;
use testkit::mcp_servers::{python, time_server};
use testkit::{Outcome, Runner, run_tool};
use tool_runner::Config;

type TestResult = anyhow::Result<()>;

/// A runner with the refund server (its refunds logged to `refunds.log` in `dir`; its
/// `request_state` sealed with a key every runner's server process shares) and the time server,
/// spoken to with the 2025-11-25 handshake (`protocol`).
async fn runner(dir: &tempfile::TempDir) -> anyhow::Result<Runner> {
    let server = testkit::repo_root().join("tests/fixtures/mcp/refund_server.py");
    let manifest = format!(
        r#"
[[mcp_servers]]
name = "shop"
command = "{python}"
args = ["-u", "{server}"]
env = {{ REFUND_LOG = "{log}", REQUEST_STATE_KEY = "{key}" }}
required = true

[[mcp_servers]]
name = "time"
command = "{time}"
protocol = "2025-11-25"
required = true
"#,
        python = python()?.display(),
        server = server.display(),
        log = dir.path().join("refunds.log").display(),
        key = "k".repeat(40),
        time = time_server()?.display(),
    );
    let path = dir.path().join("tools.toml");
    std::fs::write(&path, manifest)?;
    Runner::start(Config {
        tools_manifest: Some(path),
        ..Config::default()
    })
    .await
}

/// The call `tool` with `args`, answered with `answers` (key → the MCP result JSON) to the
/// questions `asked`.
fn answered(
    tool: &str,
    args: &serde_json::Value,
    asked: &pb::ToolInputRequired,
    answers: &[(&str, serde_json::Value)],
) -> pb::RunToolRequest {
    let responses_json: HashMap<String, String> =
        answers.iter().map(|(k, v)| ((*k).to_owned(), v.to_string())).collect();
    pb::RunToolRequest {
        input: Some(pb::ToolInputAnswers {
            request_state: asked.request_state.clone(),
            responses_json,
        }),
        ..run_tool(tool, &args.to_string())
    }
}

async fn send(runner: &Runner, request: pb::RunToolRequest) -> anyhow::Result<Outcome> {
    Outcome::of(runner.client().await?.run_tool(request).await?.into_inner())
}

fn refunds(dir: &tempfile::TempDir) -> Vec<String> {
    std::fs::read_to_string(dir.path().join("refunds.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn the_protocol_is_negotiated_per_server_and_shown_in_list_tools() -> TestResult {
    let dir = tempfile::tempdir()?;
    let runner = runner(&dir).await?;
    let tools = runner.tools().await?;
    let protocol = |name: &str| tools.iter().find(|t| t.name == name).map(|t| t.mcp_protocol.clone());
    assert_eq!(protocol("shop__refund").as_deref(), Some("2026-07-28"), "{tools:?}");
    assert_eq!(protocol("time__get_current_time").as_deref(), Some("2025-11-25"));
    assert_eq!(protocol("echo").as_deref(), Some(""), "a builtin speaks no MCP");
    // Both answer calls.
    let now = send(&runner, run_tool("time__get_current_time", r#"{"timezone": "UTC"}"#)).await?;
    assert_eq!(now.unwrap_ok()["timezone"], "UTC");
    Ok(())
}

#[tokio::test]
async fn a_question_comes_back_and_the_answer_finishes_the_call_on_another_runner() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (first, second) = (runner(&dir).await?, runner(&dir).await?);
    let args = json!({"order": "A-7", "amount": 5.0});
    let asked = send(&first, run_tool("shop__refund", &args.to_string()))
        .await?
        .unwrap_asked();
    assert_eq!(asked.requests.len(), 1, "{asked:?}");
    let question = &asked.requests[0];
    assert_eq!((question.key.as_str(), question.mode.as_str()), ("confirm", "form"));
    assert!(question.message.contains("A-7"), "{question:?}");
    let schema: serde_json::Value = serde_json::from_str(&question.schema_json)?;
    assert_eq!(schema["properties"]["confirm"]["type"], "boolean", "{schema}");
    assert!(refunds(&dir).is_empty(), "nothing is refunded before the answer");

    // Accepted, on the other runner: the refund is done, once.
    let yes = json!({"action": "accept", "content": {"confirm": true}});
    let done = send(&second, answered("shop__refund", &args, &asked, &[("confirm", yes)])).await?;
    // (The SDK answers a `str` tool with structured content `{"result": …}`.)
    assert_eq!(done.unwrap_ok()["result"], "refunded 5.0 for order A-7");
    assert_eq!(refunds(&dir), ["A-7 5.0"]);

    // Declined: the tool says so, and nothing is refunded.
    let asked = send(&first, run_tool("shop__refund", &args.to_string()))
        .await?
        .unwrap_asked();
    let no = send(
        &first,
        answered(
            "shop__refund",
            &args,
            &asked,
            &[("confirm", json!({"action": "decline"}))],
        ),
    )
    .await?;
    assert_eq!(
        no.unwrap_ok()["result"],
        "refund of 5.0 not done: the person answered decline"
    );
    assert_eq!(refunds(&dir).len(), 1);
    Ok(())
}

#[tokio::test]
async fn a_url_question_carries_its_page_and_bad_answers_are_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let runner = runner(&dir).await?;
    let asked = send(&runner, run_tool("shop__pay", r#"{"order": "B-1"}"#))
        .await?
        .unwrap_asked();
    let question = &asked.requests[0];
    assert_eq!(
        (question.mode.as_str(), question.url.as_str()),
        ("url", "https://pay.example/B-1")
    );
    assert!(question.schema_json.is_empty(), "{question:?}");
    // An answer that is not JSON is the request's fault, named.
    let mut bad = answered("shop__pay", &json!({"order": "B-1"}), &asked, &[]);
    if let Some(input) = bad.input.as_mut() {
        input.responses_json.insert("visit".into(), "{not json".into());
    }
    let refused = runner.client().await?.run_tool(bad).await;
    let status = refused.err().ok_or_else(|| anyhow::anyhow!("a bad answer was taken"))?;
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("visit"), "{status:?}");
    Ok(())
}
