//! What letting a run in costs (`bench --admission N`): N one-turn runs one after the other,
//! with the memory store and with the NATS store (a `nats-server` on loopback), by a caller with
//! no `max_runs` and by one with a `max_runs` (so each run takes and gives back a slot of the
//! caller's across the fleet). For each: the time from the `Orchestrate` call to its
//! `run_started` event (admission: the slot, the quota, the index entry and the claim), and the
//! orchestrator's CPU per run. The first row (memory, no `max_runs`) is the baseline the others
//! are read against. Writes `admission.md` / `admission.json`.

use std::path::Path;
use std::time::Instant;

use proto::orchestrator::v1 as pb;
use serde::Serialize;

use crate::procstat;

/// One store and caller's figures.
#[derive(Debug, Serialize)]
struct Row {
    store: String,
    caller: String,
    admission_p50_ms: f64,
    admission_p99_ms: f64,
    cpu_per_run_us: f64,
    /// p50 admission over the baseline's.
    x_baseline: f64,
}

/// See the module docs.
pub(crate) async fn run(bin: &Path, runs: usize, out: &Path) -> anyhow::Result<()> {
    let nats = testkit::nats::Nats::start().await?;
    let mut rows = Vec::new();
    for store in ["memory", "nats"] {
        let dir = tempfile::tempdir()?;
        let tokens = dir.path().join("tokens.toml");
        std::fs::write(
            &tokens,
            testkit::pki::tokens_toml(&[
                ("free", "free-token", ""),
                ("capped", "capped-token", "max_runs = 1000"),
            ]),
        )?;
        let llm = mock_llm::MockLlm::start(mock_llm::Scenario::new(vec![mock_llm::Turn::text("ok")])).await?;
        let runner = testkit::helpers::tool_runner_in_process_with(tool_runner::Config::default()).await?;
        let mut command = testkit::orchestrator_command(&bin.display().to_string(), &llm.base_url(), &runner);
        if store == "nats" {
            command = testkit::on_nats(command, &nats.url());
        }
        command.args(["--auth-tokens", &tokens.display().to_string()]);
        let orchestrator = testkit::Service::orchestrator(command).await?;
        let pid = orchestrator
            .pid()
            .ok_or_else(|| anyhow::anyhow!("the orchestrator exited"))?;
        let client =
            pb::orchestrator_client::OrchestratorClient::connect(format!("http://{}", orchestrator.grpc)).await?;
        for (caller, token) in [("no max_runs", "free-token"), ("max_runs 1000", "capped-token")] {
            eprintln!("bench: admission, {store} store, caller with {caller}: {runs} runs");
            let cpu_before = procstat::cpu_time(pid)?;
            let mut samples = Vec::with_capacity(runs);
            for _ in 0..runs {
                samples.push(admit_one(&client, token).await?);
            }
            let cpu = procstat::cpu_time(pid)?.saturating_sub(cpu_before);
            samples.sort_by(f64::total_cmp);
            let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
            rows.push(Row {
                store: store.to_owned(),
                caller: caller.to_owned(),
                admission_p50_ms: at(0.5),
                admission_p99_ms: at(0.99),
                cpu_per_run_us: cpu.as_secs_f64() * 1e6 / runs as f64,
                x_baseline: 0.0,
            });
        }
    }
    let baseline = rows.first().map_or(1.0, |r| r.admission_p50_ms);
    for row in &mut rows {
        row.x_baseline = row.admission_p50_ms / baseline;
    }
    let report = render(&rows, runs);
    print!("{report}");
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("admission.md"), &report)?;
    std::fs::write(out.join("admission.json"), serde_json::to_string_pretty(&rows)?)?;
    Ok(())
}

/// One run as `token`, read to its end: ms from the call to its `run_started`.
async fn admit_one(
    client: &pb::orchestrator_client::OrchestratorClient<tonic::transport::Channel>,
    token: &str,
) -> anyhow::Result<f64> {
    let mut request = tonic::Request::new(testkit::user("hi"));
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse()?);
    let started = Instant::now();
    let mut stream = client.clone().orchestrate(request).await?.into_inner();
    let mut admitted = None;
    while let Some(event) = stream.message().await? {
        if admitted.is_none() && matches!(event.event, Some(pb::orchestrate_event::Event::RunStarted(_))) {
            admitted = Some(started.elapsed().as_secs_f64() * 1000.0);
        }
    }
    admitted.ok_or_else(|| anyhow::anyhow!("a run ended without run_started"))
}

fn render(rows: &[Row], runs: usize) -> String {
    let mut text = format!(
        "# Admission: what letting a run in costs\n\n{runs} one-turn runs one after the other per row, from the Orchestrate call to run_started; the orchestrator's CPU per run (the whole run, admission included).\n\n| store | caller | p50 (ms) | p99 (ms) | p50 × memory, no max_runs | CPU per run (µs) |\n|---|---|---:|---:|---:|---:|\n"
    );
    for r in rows {
        text.push_str(&format!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.0} |\n",
            r.store, r.caller, r.admission_p50_ms, r.admission_p99_ms, r.x_baseline, r.cpu_per_run_us
        ));
    }
    text
}
