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

/// The first user message of each request a stand-in served: which runs it served.
fn runs_served(mock: &mock_llm::MockLlm) -> Vec<String> {
    mock.requests()
        .iter()
        .filter_map(|r| {
            r["messages"].as_array()?.iter().find(|m| m["role"] == "user")?["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// Runs of the spread test.
const RUNS: usize = 30;

#[tokio::test]
async fn a_runs_turns_stay_on_one_endpoint_and_runs_spread_over_the_fleet() -> TestResult {
    let scenario = Scenario {
        prefill_us_per_token: 20,
        ..six_turns()
    };
    let second = mock_llm::MockLlm::start(scenario.clone()).await?;
    let stack = Stack::start(scenario, runner_config(None), |config| {
        config.llm.base_urls.push(second.base_url());
    })
    .await?;
    // Thirty runs at once: twenty-six alone, and two conversations of two runs that share an
    // affinity key. Runs go where their (random) keys hash: with 28 keys, all of them on one of
    // two endpoints is a chance of 2 in 2^28, not the 2 in 2^10 of twelve runs.
    let runs = (0..RUNS).map(|n| {
        let mut asked = request(&format!("run {n}: {}", "Background. ".repeat(800)), &[]);
        asked.limits = Some(pb::RunLimits {
            max_turns: Some(8),
            ..Default::default()
        });
        if n >= RUNS - 4 {
            asked.affinity_key = format!("conversation-{}", n % 2);
        }
        stack.run(asked)
    });
    let outcomes = futures::future::try_join_all(runs).await?;
    for out in &outcomes {
        assert_eq!(out.status(), S::Completed, "{:?}", out.result);
        let usage: Vec<pb::Usage> = out.of(|e| match e {
            E::TurnFinished(t) => t.usage,
            _ => None,
        });
        for later in &usage[1..] {
            let uncached = later.prompt_tokens - later.cached_prompt_tokens;
            assert!(uncached * 5 <= later.prompt_tokens, "{usage:?}");
        }
    }
    // Every request of a run went to one endpoint, and both endpoints served runs.
    let (a, b) = (runs_served(&stack.mock), runs_served(&second));
    let run_of = |text: &String| text.split(':').next().unwrap_or_default().to_owned();
    let on_a: std::collections::BTreeSet<String> = a.iter().map(run_of).collect();
    let on_b: std::collections::BTreeSet<String> = b.iter().map(run_of).collect();
    assert_eq!(a.len() + b.len(), RUNS * 6);
    assert!(
        on_a.is_disjoint(&on_b),
        "a run's turns on both endpoints: {on_a:?} {on_b:?}"
    );
    assert!(!on_a.is_empty() && !on_b.is_empty(), "{on_a:?} {on_b:?}");
    // Runs with the same affinity key went to the same endpoint.
    for pair in [["run 26", "run 28"], ["run 27", "run 29"]] {
        assert_eq!(on_a.contains(pair[0]), on_a.contains(pair[1]), "{pair:?}: {on_a:?}");
    }
    Ok(())
}

/// A one-turn answer; the server it is played on refuses its first `refusals` requests with 503.
fn refusing(refusals: usize) -> Scenario {
    Scenario::new(vec![Turn {
        fail_first: vec![503; refusals],
        ..Turn::text("Fine.")
    }])
}

#[tokio::test]
async fn a_failing_endpoint_is_failed_over_ejected_and_let_back_in() -> TestResult {
    let failing = mock_llm::MockLlm::start(refusing(2)).await?;
    let stack = Stack::start(refusing(0), runner_config(None), |config| {
        config.llm.base_urls.push(failing.base_url());
        config.llm.eject_after = 2;
        config.llm.eject_for = std::time::Duration::from_secs(4);
        config.llm.max_retries = 0;
    })
    .await?;
    let stack = &stack;
    let one_by_one = |round: &'static str| async move {
        for n in 0..24 {
            let out = stack.run(request(&format!("{round} {n}"), &[])).await?;
            assert_eq!(out.status(), S::Completed, "{:?}", out.result);
        }
        anyhow::Ok(())
    };
    // Of 24 runs about half prefer the failing endpoint: its two refusals go over to the other
    // at once, and eject it, so it is not asked again while ejected.
    one_by_one("first").await?;
    assert_eq!(runs_served(&failing).len(), 2, "{:?}", runs_served(&failing));
    // Let back in, it serves the runs that prefer it. Stays: the ejection lasts a time (its
    // setting), which is what is under test.
    tokio::time::sleep(std::time::Duration::from_millis(4500)).await;
    one_by_one("second").await?;
    let served_later = runs_served(&failing).iter().filter(|r| r.starts_with("second")).count();
    assert!(served_later > 0, "{:?}", runs_served(&failing));
    Ok(())
}

#[tokio::test]
async fn a_server_that_says_nothing_within_the_idle_timeout_is_failed_over() -> TestResult {
    let stalling = mock_llm::MockLlm::start(Scenario::new(vec![Turn::default().then(Step::Stall)])).await?;
    let stack = Stack::start(refusing(0), runner_config(None), |config| {
        config.llm.base_urls.push(stalling.base_url());
        config.llm.idle_timeout = std::time::Duration::from_millis(300);
    })
    .await?;
    let outcomes = futures::future::try_join_all((0..12).map(|n| stack.run(request(&format!("run {n}"), &[])))).await?;
    for out in &outcomes {
        assert_eq!(out.status(), S::Completed, "{:?}", out.result);
    }
    assert!(
        !runs_served(&stalling).is_empty(),
        "no run preferred the stalling server"
    );
    assert_eq!(
        runs_served(&stack.mock).len(),
        12,
        "every run was answered by the other"
    );
    Ok(())
}

#[tokio::test]
async fn a_model_server_that_dies_mid_stream_costs_a_turn_restart_not_the_run() -> TestResult {
    let cutting = Scenario::new(vec![Turn::text("Half an answer that").then(Step::Cut)]);
    let cutting = mock_llm::MockLlm::start(cutting).await?;
    let answer = Scenario::new(vec![
        Turn::text("Checking.\n").then(Step::call("calculate", json!({"expression": "6 * 7"}))),
        Turn::text("It is 42."),
    ]);
    let stack = Stack::start(answer, runner_config(None), |config| {
        config.llm.base_urls.push(cutting.base_url());
    })
    .await?;
    let outcomes = futures::future::try_join_all((0..12).map(|n| stack.run(request(&format!("run {n}"), &[])))).await?;
    let mut restarted = 0;
    for out in &outcomes {
        assert_eq!(out.status(), S::Completed, "{:?}", out.result);
        assert_eq!(
            out.result.text, "Checking.\nIt is 42.",
            "the cut attempt's text is taken back"
        );
        let restarts: Vec<pb::TurnRestarted> = out.of(|e| match e {
            E::TurnRestarted(r) => Some(r.clone()),
            _ => None,
        });
        for restart in &restarts {
            assert!(restart.reason.contains(&cutting.base_url()), "{restart:?}");
        }
        restarted += restarts.len();
    }
    assert!(restarted > 0, "no run went to the server that cuts");
    assert_eq!(
        runs_served(&cutting).len(),
        restarted,
        "each cut turn went elsewhere once"
    );
    Ok(())
}

#[tokio::test]
async fn a_slow_first_tool_runs_while_the_model_writes_the_rest_of_the_turn() -> TestResult {
    // The first call's tool takes 800 ms; the model takes about 800 ms more to write the
    // second call's arguments (20 pieces, 40 ms apart).
    let second = Step::ToolCall {
        name: "calculate".into(),
        arguments: json!({"expression": "1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1"}),
        id: None,
        fragments: Some(20),
    };
    let scenario = Scenario {
        token_delay_ms: 40,
        ..Scenario::new(vec![
            Turn::text("Two things.\n")
                .then(Step::call("sleep", json!({"ms": 800})))
                .then(second),
            Turn::text("Done."),
        ])
    };
    let stack = Stack::start(scenario, runner_config(None), |_| {}).await?;
    let turn_time = |out: &testkit::stack::Outcome| out.elapsed;
    let early = stack.run(request("early", &[])).await?;
    let mut asked = request("at the end", &[]);
    asked.eager_tool_dispatch = Some(false);
    let at_end = stack.run(asked).await?;
    for out in [&early, &at_end] {
        assert_eq!(out.status(), S::Completed, "{:?}", out.result);
        let calls: Vec<(&str, bool)> = out.result.tool_calls.iter().map(|c| (c.name.as_str(), c.ok)).collect();
        assert_eq!(calls, [("sleep", true), ("calculate", true)]);
    }
    eprintln!(
        "run wall time with the slow tool started early: {:?}; at the stream's end: {:?}",
        turn_time(&early),
        turn_time(&at_end)
    );
    // Structurally about 800 ms apart; half of it is the margin for a busy machine.
    assert!(
        turn_time(&at_end) >= turn_time(&early) + std::time::Duration::from_millis(400),
        "early {:?}, at the end {:?}",
        turn_time(&early),
        turn_time(&at_end)
    );
    Ok(())
}

#[tokio::test]
async fn a_saturated_endpoint_passes_its_runs_to_the_next_in_their_order() -> TestResult {
    // Slow answers (about 1 s), one completion in flight per endpoint.
    let slow = || Scenario {
        token_delay_ms: 100,
        ..Scenario::new(vec![Turn::text("one two three four five six seven eight nine ten")])
    };
    let second = mock_llm::MockLlm::start(slow()).await?;
    let stack = Stack::start(slow(), runner_config(None), |config| {
        config.llm.base_urls.push(second.base_url());
        config.llm.max_inflight_per_endpoint = 1;
    })
    .await?;
    // Two runs at once with one affinity key: they prefer the same endpoint, which is full while
    // the first streams, so the second goes to the other.
    let runs = (0..2).map(|n| {
        let mut asked = request(&format!("run {n}"), &[]);
        asked.affinity_key = "one-conversation".into();
        stack.run(asked)
    });
    for out in futures::future::try_join_all(runs).await? {
        assert_eq!(out.status(), S::Completed, "{:?}", out.result);
    }
    assert_eq!(
        (runs_served(&stack.mock).len(), runs_served(&second).len()),
        (1, 1),
        "one run on each endpoint"
    );
    Ok(())
}
