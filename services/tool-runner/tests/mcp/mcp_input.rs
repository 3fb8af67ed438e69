//! MCP tools that ask a person before they finish (protocol 2026-07-28, `input_required`), at
//! the tool-runner: a Python `mcp` 2.x server written for the tests
//! (`tests/fixtures/mcp/refund_server.py`, installed by `./scripts/mcp-servers`) over stdio. The
//! runner negotiates the protocol per server and shows it in `ListTools`; a call that asks comes
//! back as `input_required` with its questions, and its retry with the answers (on another
//! runner: the questions' state travels with the call, not in a runner) finishes it; over
//! streamable HTTP, a stateless server of two processes behind one URL takes the retry on the
//! process that did not ask.

use std::collections::HashMap;

use proto::toolrunner::v1 as pb;
use serde_json::json;
use testkit::mcp_servers::{REFUND_STATE_KEY, python, refund_server, refund_server_table, time_server};
use testkit::{Outcome, Runner, run_tool};
use tool_runner::Config;

type TestResult = anyhow::Result<()>;

/// A runner with the refund server (its refunds logged to `refunds.log` in `dir`; its
/// `request_state` sealed with a key every runner's server process shares) and the time server,
/// spoken to with the 2025-11-25 handshake (`protocol`).
async fn runner(dir: &tempfile::TempDir) -> anyhow::Result<Runner> {
    let manifest = format!(
        "{shop}\n[[mcp_servers]]\nname = \"time\"\ncommand = \"{time}\"\nprotocol = \"2025-11-25\"\nrequired = true\n",
        shop = refund_server_table(&dir.path().join("refunds.log"))?,
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
    let result = done.unwrap_ok()["result"].as_str().unwrap_or_default().to_owned();
    assert!(result.starts_with("refunded 5.0 for order A-7 (process "), "{result}");
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

/// Two processes of the refund server over stateless streamable HTTP behind one URL: a proxy
/// that sends each new connection to the process `to` names (and asks the server to close each
/// connection after its answer, so every request picks anew). The question is asked by one
/// process, the answer taken by the other (the server names its process in both), and the refund
/// happens once.
#[tokio::test]
async fn a_stateless_http_server_takes_the_answer_on_another_process() -> TestResult {
    let dir = tempfile::tempdir()?;
    let server = refund_server();
    let mut processes = Vec::new();
    let mut ports = Vec::new();
    for _ in 0..2 {
        let port = tokio::net::TcpListener::bind("127.0.0.1:0").await?.local_addr()?.port();
        let child = tokio::process::Command::new(python()?)
            .arg("-u")
            .arg(&server)
            .args(["http", &port.to_string()])
            .env("REQUEST_STATE_KEY", REFUND_STATE_KEY)
            .env("REFUND_LOG", dir.path().join("refunds.log"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        testkit::wait::until(
            "the server process to listen",
            std::time::Duration::from_secs(30),
            || async move { tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok() },
        )
        .await?;
        processes.push(child);
        ports.push(port);
    }
    let to = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let proxy = switching_proxy(ports, std::sync::Arc::clone(&to)).await?;
    let manifest =
        format!("[[mcp_servers]]\nname = \"shop\"\nurl = \"http://127.0.0.1:{proxy}/mcp\"\nrequired = true\n");
    let path = dir.path().join("tools.toml");
    std::fs::write(&path, manifest)?;
    let runner = Runner::start(Config {
        tools_manifest: Some(path),
        ..Config::default()
    })
    .await?;
    let protocol = runner
        .tools()
        .await?
        .into_iter()
        .find(|t| t.name == "shop__refund")
        .map(|t| t.mcp_protocol);
    assert_eq!(protocol.as_deref(), Some("2026-07-28"));

    let args = json!({"order": "K-9", "amount": 6.0});
    let asked = send(&runner, run_tool("shop__refund", &args.to_string()))
        .await?
        .unwrap_asked();
    let asker = process_of(&asked.requests[0].message);
    to.store(1, std::sync::atomic::Ordering::SeqCst);
    let yes = json!({"action": "accept", "content": {"confirm": true}});
    let done = send(&runner, answered("shop__refund", &args, &asked, &[("confirm", yes)])).await?;
    let result = done.unwrap_ok()["result"].as_str().unwrap_or_default().to_owned();
    assert!(result.starts_with("refunded 6.0 for order K-9"), "{result}");
    let finisher = process_of(&result);
    assert!(
        asker.is_some() && finisher.is_some() && asker != finisher,
        "asked by {asker:?}, answered by {finisher:?}"
    );
    assert_eq!(refunds(&dir), ["K-9 6.0"]);
    drop(processes);
    Ok(())
}

/// The process id a refund server's text names (`… (process N)`).
fn process_of(text: &str) -> Option<u32> {
    text.rsplit_once("(process ")?.1.trim_end_matches(')').parse().ok()
}

/// A TCP proxy on a free port: each connection goes to `upstreams[to]` as `to` reads when it
/// comes, its request head given `Connection: close`.
async fn switching_proxy(
    upstreams: Vec<u16>,
    to: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> anyhow::Result<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let upstream = upstreams[to.load(std::sync::atomic::Ordering::SeqCst) % upstreams.len()];
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && head.len() < 64 * 1024 {
                    match client.read(&mut byte).await {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                head.truncate(head.len().saturating_sub(2));
                head.extend_from_slice(b"Connection: close\r\n\r\n");
                let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await else {
                    return;
                };
                if server.write_all(&head).await.is_ok() {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    Ok(port)
}
