//! Coalesced streaming (`--stream-interval`, `params.stream_interval_ms`) through the real
//! orchestrator, tool-runner and stand-in model on loopback: a paced model's text comes a tick's
//! worth per event, the first delta of each turn at once, with the stream invariants intact (the
//! stack checks them on every run); and the interval a request asks for on both sides of the
//! server's ceiling; with the LLM's socket read by the run itself (`--llm-reader run`) and by the
//! shared client (`pooled`). How many events exactly is the unit tests' (`run/tool_loop/tests/`, on a
//! paused clock); here the margins are wide, as the machine may be slow.

use std::time::Duration;

use mock_llm::{Scenario, Step, Turn};
use orchestrator::config::Reader;
use proto::orchestrator::v1 as pb;
use proto::orchestrator::v1::orchestrate_event::Event as E;
use testkit::stack::{Outcome, Stack, request, runner_config};

type TestResult = anyhow::Result<()>;

/// 60 chunks of 4 characters, 10 ms apart (600 ms of text), in each of two turns with a call
/// between them.
fn paced() -> Scenario {
    let words = "abc ".repeat(60);
    let turn = |call: bool| {
        let mut steps = vec![Step::Text {
            text: words.clone(),
            chunk_chars: Some(4),
        }];
        if call {
            steps.push(Step::call("echo", serde_json::json!({"text": "hi"})));
        }
        Turn {
            steps,
            ..Turn::default()
        }
    };
    Scenario {
        token_delay_ms: 10,
        ..Scenario::new(vec![turn(true), turn(false)])
    }
}

fn with_interval(ms: Option<u32>) -> pb::OrchestrateRequest {
    let mut r = request("go", &[]);
    r.params.get_or_insert_default().stream_interval_ms = ms;
    r
}

/// The text events of each turn.
fn text_events(outcome: &Outcome) -> Vec<Vec<String>> {
    let mut turns: Vec<Vec<String>> = Vec::new();
    for event in &outcome.events {
        if let Some(E::TextDelta(d)) = &event.event {
            let turn = d.turn as usize;
            if turns.len() < turn {
                turns.resize(turn, Vec::new());
            }
            turns[turn - 1].push(d.text.clone());
        }
    }
    turns
}

#[tokio::test]
async fn a_paced_models_text_comes_a_tick_at_a_time_with_the_first_delta_at_once() -> TestResult {
    // Read by the run itself (its socket quiet between ticks), and by the shared client.
    for reader in [Reader::Run, Reader::Pooled] {
        ticks_with(reader)
            .await
            .map_err(|e| e.context(format!("with --llm-reader {reader:?}")))?;
    }
    Ok(())
}

async fn ticks_with(reader: Reader) -> TestResult {
    let stack = Stack::start(paced(), runner_config(None), |c| {
        c.runs.stream_interval = Duration::from_millis(150);
        c.llm.reader = reader;
    })
    .await?;
    // The server's default: 600 ms of text per turn in 150 ms ticks.
    let gathered = stack.run(with_interval(None)).await?;
    assert_eq!(gathered.result.status(), pb::RunStatus::Completed);
    assert_eq!(gathered.result.text, "abc ".repeat(120));
    for (turn, texts) in text_events(&gathered).iter().enumerate() {
        assert_eq!(
            texts.first().map(String::as_str),
            Some("abc "),
            "turn {}: the first delta alone",
            turn + 1
        );
        assert!(
            (2..=12).contains(&texts.len()),
            "turn {}: 60 chunks in {} events",
            turn + 1,
            texts.len()
        );
    }
    // A request asking for 0 gets each read's text at once.
    let each = stack.run(with_interval(Some(0))).await?;
    assert_eq!(each.result.text, gathered.result.text);
    for texts in text_events(&each) {
        assert!(texts.len() > 12, "60 chunks 10 ms apart in {} events", texts.len());
    }
    Ok(())
}

#[tokio::test]
async fn a_requested_interval_is_refused_above_the_ceiling_and_taken_at_it() -> TestResult {
    let stack = Stack::start(paced(), runner_config(None), |c| {
        c.runs.stream_interval_ceiling = Duration::from_millis(100);
    })
    .await?;
    let mut client = stack.client().await?;
    let refused = client.orchestrate(with_interval(Some(101))).await.err();
    let refused = refused.ok_or_else(|| anyhow::anyhow!("101 ms above a 100 ms ceiling was accepted"))?;
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused
            .message()
            .contains("params.stream_interval_ms = 101 is above this server's maximum of 100"),
        "{}",
        refused.message()
    );
    let at = stack.run(with_interval(Some(100))).await?;
    assert_eq!(at.result.status(), pb::RunStatus::Completed);
    Ok(())
}
