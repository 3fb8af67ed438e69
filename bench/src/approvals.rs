//! What runs waiting for approvals cost (`bench --approvals N`): N runs parked at once on an
//! orchestrator with 16 run slots (so they hold none), with the in-memory store and with the NATS
//! store, then every call approved. Per store: the orchestrator's RSS per parked run (its growth
//! from a warmed-up baseline, divided by N), the NATS server's, how long parking and deciding
//! took, and how long the approved runs took to complete. Writes `approvals.md` / `.json`.

use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt;
use mock_llm::{Scenario, Scenarios, Step, Turn};
use proto::orchestrator::v1 as pb;
use serde::Serialize;

use crate::procstat;
use crate::stack::{Stack, start_runs};

/// Run slots of the orchestrator measured: far fewer than the runs parked.
const SLOTS: &str = "16";
/// Requests in flight at once while starting and deciding.
const CONCURRENCY: usize = 16;
/// Runs warmed up (started, parked, decided, completed) before the baseline is read.
const WARM_UP: usize = 32;

/// One store's figures.
#[derive(Debug, Serialize)]
pub(crate) struct ParkedRuns {
    pub store: String,
    pub runs: usize,
    pub slots: usize,
    /// Orchestrator RSS growth per parked run.
    pub rss_per_parked_run_kib: f64,
    /// The NATS server's RSS growth per parked run (NATS store only).
    pub nats_rss_per_parked_run_kib: Option<f64>,
    pub park_all_s: f64,
    pub decide_all_s: f64,
    pub complete_all_s: f64,
    pub completed: usize,
}

/// Every run's one call waits for approval; turn 2 answers.
fn scenario() -> Scenario {
    Scenario::new(vec![
        Turn::text("Asking first.").then(Step::call("echo", serde_json::json!({"order": 7}))),
        Turn::text("Done."),
    ])
}

fn request(run_id: String) -> pb::OrchestrateRequest {
    pb::OrchestrateRequest {
        run_id,
        detached: true,
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "refund order 7".into(),
            ..Default::default()
        }],
        tools: Some(pb::ToolSelection {
            normal: vec!["echo".into()],
            approval: Some(pb::ApprovalPolicy {
                all_normal: true,
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Measures both stores; the NATS one is left out, with the reason, without nats-server.
pub(crate) async fn run(bin: &Path, runs: usize, out: &Path) -> anyhow::Result<()> {
    let mut measured = vec![measure(bin, runs, None).await?];
    let nats_skipped = match testkit::nats::Nats::start().await {
        Ok(nats) => {
            measured.push(measure(bin, runs, Some(&nats)).await?);
            None
        }
        Err(e) => Some(format!("NATS store not measured: {e}")),
    };
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("approvals.json"), serde_json::to_string_pretty(&measured)?)?;
    std::fs::write(out.join("approvals.md"), markdown(&measured, nats_skipped.as_deref()))?;
    eprintln!("bench: wrote {}", out.join("approvals.md").display());
    anyhow::ensure!(
        measured.iter().all(|m| m.completed == m.runs),
        "not every approved run completed: {measured:?}"
    );
    Ok(())
}

async fn measure(bin: &Path, runs: usize, nats: Option<&testkit::nats::Nats>) -> anyhow::Result<ParkedRuns> {
    let store = if nats.is_some() { "nats" } else { "memory" };
    let url = nats.map(testkit::nats::Nats::url);
    let mut extra = vec!["--max-runs", SLOTS, "--max-parked-runs", "1000000"];
    if let Some(url) = &url {
        extra.extend(["--run-store", url.as_str()]);
    }
    let stack = Stack::start(bin, Scenarios::from(scenario()), 4, None, "warn", &extra, &[]).await?;
    let nats_pid = nats.and_then(testkit::nats::Nats::pid);
    // Warm up: as many runs as will be measured would grow the allocator's pools; a few suffice
    // to load the code paths and the connections.
    cycle(&stack, "warm", WARM_UP).await?;
    let base = procstat::rss(stack.pid)?;
    let nats_base = nats_pid.map(procstat::rss).transpose()?;

    eprint!("bench: approvals {store:<7} parking {runs} runs … ");
    let started = Instant::now();
    start_runs(&stack, ("parked", runs, CONCURRENCY), request).await?;
    wait_pending(&stack, runs).await?;
    let park_all = started.elapsed();
    let parked_rss = procstat::rss(stack.pid)?;
    let nats_parked = nats_pid.map(procstat::rss).transpose()?;
    eprintln!("{:.1} s", park_all.as_secs_f64());

    let started = Instant::now();
    decide_all(&stack, runs).await?;
    let decide_all = started.elapsed();
    let completed = wait_completed(&stack, "parked", runs).await?;
    let complete_all = started.elapsed();
    stack.stop().await;
    let per_run = |after: u64, before: u64| after.saturating_sub(before) as f64 / 1024.0 / runs as f64;
    Ok(ParkedRuns {
        store: store.to_owned(),
        runs,
        slots: SLOTS.parse().unwrap_or(0),
        rss_per_parked_run_kib: per_run(parked_rss, base),
        nats_rss_per_parked_run_kib: nats_parked.zip(nats_base).map(|(after, before)| per_run(after, before)),
        park_all_s: park_all.as_secs_f64(),
        decide_all_s: decide_all.as_secs_f64(),
        complete_all_s: complete_all.as_secs_f64(),
        completed,
    })
}

/// Starts, parks, approves and completes `n` runs.
async fn cycle(stack: &Stack, prefix: &str, n: usize) -> anyhow::Result<()> {
    start_runs(stack, (prefix, n, CONCURRENCY), request).await?;
    wait_pending(stack, n).await?;
    decide_all(stack, n).await?;
    wait_completed(stack, prefix, n).await?;
    Ok(())
}

/// Waits (at most 10 min) until `n` calls wait for approval (a listing holds at most 1,000:
/// past that, a full page that says more wait).
async fn wait_pending(stack: &Stack, n: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let page = stack
            .client(0)
            .list_pending_approvals(pb::ListPendingApprovalsRequest {
                run_id: String::new(),
                limit: 0,
            })
            .await?
            .into_inner();
        if page.approvals.len() >= n.min(PAGE) && (n <= PAGE || page.truncated) {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {} of {n} calls wait",
            page.approvals.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The most pending approvals one listing gives.
const PAGE: usize = 1000;

/// Approves every pending approval, a page at a time.
async fn decide_all(stack: &Stack, n: usize) -> anyhow::Result<()> {
    let mut decided = 0;
    while decided < n {
        let mut client = stack.client(0);
        let page = client
            .list_pending_approvals(pb::ListPendingApprovalsRequest {
                run_id: String::new(),
                limit: 0,
            })
            .await?
            .into_inner();
        anyhow::ensure!(
            !page.approvals.is_empty(),
            "{decided} of {n} decided, and nothing waits"
        );
        let results: Vec<anyhow::Result<()>> = futures::stream::iter(page.approvals)
            .enumerate()
            .map(|(i, pending)| {
                let mut client = stack.client(i);
                async move {
                    let request = pb::DecideToolCallsRequest {
                        run_id: pending.run_id.clone(),
                        decisions: vec![pb::ToolCallDecision {
                            call_id: pending.call_id,
                            kind: pb::DecisionKind::Approve.into(),
                            ..Default::default()
                        }],
                    };
                    client
                        .decide_tool_calls(request)
                        .await
                        .map(|_| ())
                        .map_err(|s| anyhow::anyhow!("{}: {s}", pending.run_id))
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        decided += results.len();
        results.into_iter().collect::<anyhow::Result<Vec<()>>>()?;
    }
    Ok(())
}

/// Waits (at most 10 min) until runs `<prefix>-0` … completed; how many did.
async fn wait_completed(stack: &Stack, prefix: &str, n: usize) -> anyhow::Result<usize> {
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut completed = 0;
    for i in 0..n {
        let mut client = stack.client(i);
        loop {
            let result = client
                .get_run(pb::GetRunRequest {
                    run_id: format!("{prefix}-{i}"),
                })
                .await?
                .into_inner();
            if result.status() == pb::RunStatus::Completed {
                completed += 1;
                break;
            }
            if !matches!(
                result.status(),
                pb::RunStatus::Running | pb::RunStatus::AwaitingApproval
            ) || Instant::now() > deadline
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(completed)
}

fn markdown(measured: &[ParkedRuns], nats_skipped: Option<&str>) -> String {
    let mut md = String::from(
        "# Runs waiting for approvals\n\n`bench --approvals N`: N runs parked at once (each one tool call waiting) on an orchestrator with 16 run slots, then every call approved. RSS per parked run is the growth from a warmed-up baseline divided by N.\n\n| store | runs parked | run slots | orchestrator RSS per parked run (KiB) | NATS server RSS per parked run (KiB) | parking all (s) | deciding all (s) | decided → all completed (s) | completed |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for m in measured {
        md.push_str(&format!(
            "| {} | {} | {} | {:.1} | {} | {:.2} | {:.2} | {:.2} | {} |\n",
            m.store,
            m.runs,
            m.slots,
            m.rss_per_parked_run_kib,
            m.nats_rss_per_parked_run_kib
                .map_or("—".to_owned(), |k| format!("{k:.1}")),
            m.park_all_s,
            m.decide_all_s,
            m.complete_all_s,
            m.completed
        ));
    }
    if let Some(reason) = nats_skipped {
        md.push_str(&format!("\n{reason}\n"));
    }
    md
}
