//! The model's time: what the orchestrator sends keeps the model server's prefix cache warm.
//! Each turn's request starts with the previous one byte for byte, so a server with a prefix
//! cache (the stand-in simulates one, and reports it as vLLM and OpenAI do) prefills only the
//! newest messages; the cached tokens it reports reach the turn's usage and the run's totals.

use mock_llm::{Scenario, Step, Turn};
use proto::orchestrator::v1 as pb;
use proto::orchestrator::v1::RunStatus as S;
use proto::orchestrator::v1::orchestrate_event::Event as E;
use serde_json::json;
use testkit::stack::{Stack, request, runner_config};

type TestResult = anyhow::Result<()>;

/// The end of the messages in a request body: what a prefix cache can keep of it.
fn prompt_end(body: &[u8]) -> usize {
    let marker = br#"],"stream":true"#;
    body.windows(marker.len())
        .rposition(|w| w == marker)
        .unwrap_or(body.len())
}

/// Five turns that each call `calculate`, then an answer: six requests.
fn six_turns() -> Scenario {
    let mut turns: Vec<Turn> = (1..=5)
        .map(|n| {
            Turn::text(&format!("Step {n}.\n")).then(Step::call("calculate", json!({"expression": format!("{n} * 7")})))
        })
        .collect();
    turns.push(Turn::text("Done."));
    Scenario::new(turns)
}

#[tokio::test]
async fn each_turn_extends_the_last_request_and_later_turns_are_mostly_cached() -> TestResult {
    let stack = Stack::start(six_turns(), runner_config(None), |_| {}).await?;
    // A first message of about 4,000 tokens (the stand-in counts four bytes a token).
    let long = "Background for the task. ".repeat(640);
    let mut asked = request(&long, &[]);
    asked.limits = Some(pb::RunLimits {
        max_turns: Some(8),
        ..Default::default()
    });
    let out = stack.run(asked).await?;
    assert_eq!(out.status(), S::Completed, "{:?}", out.result);
    assert_eq!(out.result.turns, 6);

    // Byte for byte: each body starts with the previous one up to the end of its messages.
    let bodies = stack.mock.raw_requests();
    assert_eq!(bodies.len(), 6);
    for (n, pair) in bodies.windows(2).enumerate() {
        let kept = &pair[0][..prompt_end(&pair[0])];
        assert!(
            pair[1].starts_with(kept),
            "request {} rewrote request {}:\n{}\n---\n{}",
            n + 2,
            n + 1,
            String::from_utf8_lossy(kept),
            String::from_utf8_lossy(&pair[1])
        );
    }

    // The usage of each turn says how much was cached: nothing the first time, then all but
    // the newest messages (well under a fifth of the prompt).
    let usage: Vec<pb::Usage> = out.of(|e| match e {
        E::TurnFinished(t) => t.usage,
        _ => None,
    });
    assert_eq!(usage.len(), 6);
    assert_eq!(usage[0].cached_prompt_tokens, 0, "{usage:?}");
    assert!(usage[0].prompt_tokens >= 4000, "{usage:?}");
    for later in &usage[1..] {
        let uncached = later.prompt_tokens - later.cached_prompt_tokens;
        assert!(
            uncached * 5 <= later.prompt_tokens,
            "over a fifth of a later turn's prompt was not cached: {later:?}"
        );
    }
    let total = out.result.usage.unwrap_or_default();
    assert_eq!(
        total.cached_prompt_tokens,
        usage.iter().map(|u| u.cached_prompt_tokens).sum::<u64>()
    );
    Ok(())
}
