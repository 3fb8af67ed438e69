//! The time the stand-in model serves each conversation (what the benchmark subtracts from a
//! run's wall time) is measured per conversation and cleared when taken.

use std::time::Duration;

use mock_llm::{MockLlm, Scenario, Turn};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One streamed completion over a raw HTTP/1 connection; returns the response.
async fn complete(base_url: &str, user: &str) -> anyhow::Result<String> {
    let authority = base_url
        .strip_prefix("http://")
        .and_then(|rest| rest.strip_suffix("/v1"))
        .ok_or_else(|| anyhow::anyhow!("unexpected base URL {base_url}"))?;
    let body =
        serde_json::json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": user}]}).to_string();
    let mut tcp = tokio::net::TcpStream::connect(authority).await?;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await?;
    tcp.write_all(body.as_bytes()).await?;
    let mut response = String::new();
    tcp.read_to_string(&mut response).await?;
    Ok(response)
}

#[tokio::test]
async fn served_time_is_tallied_per_conversation_and_cleared_when_taken() -> anyhow::Result<()> {
    let scenario = Scenario {
        ttft_ms: 60,
        ..Scenario::new(vec![Turn::text("hello")])
    };
    let mock = MockLlm::start_timed(scenario).await?;
    let base = mock.base_url();
    let (a1, a2, b) = tokio::join!(complete(&base, "a"), complete(&base, "a"), complete(&base, "b"));
    for response in [a1?, a2?, b?] {
        assert!(
            response.ends_with("0\r\n\r\n") && response.contains("\"usage\""),
            "the whole stream: {response}"
        );
    }
    let served = mock.take_served();
    assert_eq!(served.len(), 2, "{served:?}");
    let (a, b) = (served["a"], served["b"]);
    assert!(a >= Duration::from_millis(120), "two requests of ≥ 60 ms: {a:?}");
    assert!(b >= Duration::from_millis(60) && b < a, "one request: {b:?}");
    assert!(mock.take_served().is_empty(), "taking clears the tally");

    // Without timing nothing is tallied.
    let untimed = MockLlm::start_unrecorded(Scenario::new(vec![Turn::text("hello")])).await?;
    complete(&untimed.base_url(), "a").await?;
    assert!(untimed.take_served().is_empty());
    Ok(())
}
