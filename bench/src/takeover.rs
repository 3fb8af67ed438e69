//! What taking over a dead replica's quiet runs costs (`bench --takeover-quiet 5000`): replica
//! *a* holds N durable runs, each waiting on a tool call that outlasts the bench, and replica *b*
//! runs beside it with nothing to do, both on one monitored `nats-server -js`. *a* is SIGKILLed;
//! the bench reports the time until *b* runs the first of them again (their calls in flight
//! there) and every one of them, and the store requests per run taken over (nats-server's `/varz`, less what the fleet cost per second before the kill).
//! Writes `takeover.md` / `.json`.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::quiet::{all_in_flight, counters, gauge, launch, rates, request, stack};
use crate::stack::{spawn, start_runs};

/// Requests in flight at once while starting runs.
const CONCURRENCY: usize = 32;
/// The window the fleet's cost before the kill is measured over.
const BEFORE: Duration = Duration::from_secs(5);

/// The figures of one takeover.
#[derive(Debug, Serialize)]
pub(crate) struct Takeover {
    pub runs: usize,
    pub lease_s: f64,
    /// From the SIGKILL until every run's call was in flight on b (s).
    pub all_running_s: f64,
    /// From the SIGKILL until the first run's call was in flight on b (s): a's incarnation
    /// seen lapsed, at most a lease and a third after its last renewal.
    pub first_running_s: f64,
    /// Runs running again per second from the first to the last.
    pub runs_per_s: f64,
    /// Messages into nats-server per run taken over, less the fleet's rate before the kill.
    pub requests_per_run: f64,
    /// Messages into nats-server per second before the kill (both replicas, the runs quiet).
    pub before_in_per_s: f64,
}

/// Since `from`: until the first of `runs` calls was in flight at `metrics`, and until all were,
/// waited for until `limit`.
async fn first_and_all(
    metrics: &str,
    runs: usize,
    from: Instant,
    limit: Duration,
) -> anyhow::Result<(Duration, Duration)> {
    let first = std::sync::Mutex::new(None);
    let all = testkit::wait::until("every run's call in flight on b", limit, || {
        let first = &first;
        async move {
            let in_flight = gauge(metrics, "orchestrator_tool_calls_in_flight").await.ok()?;
            if in_flight > 0.0 {
                shared::sync::lock(first).get_or_insert_with(|| from.elapsed());
            }
            (in_flight >= runs as f64).then(|| from.elapsed())
        }
    })
    .await?;
    let first = shared::sync::lock(&first).unwrap_or(all);
    Ok((first, all))
}

/// One takeover of `runs` quiet runs with `lease`.
async fn measure(bin: &Path, runs: usize, lease: Duration) -> anyhow::Result<Takeover> {
    let nats = testkit::nats::Nats::start_monitored().await?;
    let lease_flag = format!("{}ms", lease.as_millis());
    let extra = ["--run-store-lease", lease_flag.as_str()];
    let call = Duration::from_secs(3600);
    let mut a = stack(bin, &nats.url(), runs, call, &extra).await?;
    let b = spawn(
        &launch(bin, (&a.mock.base_url(), &a.runner), &nats.url(), runs, &extra),
        "127.0.0.1:0",
    )
    .await?;
    let (a_metrics, b_metrics) = match (a.metrics.clone(), b.metrics.clone()) {
        (Some(a), Some(b)) => (a, b),
        _ => anyhow::bail!("an orchestrator serves no /metrics"),
    };
    eprint!("bench: takeover of {runs} quiet runs … ");
    start_runs(&a, ("quiet", runs, CONCURRENCY), request).await?;
    let starting = Duration::from_secs(120 + runs as u64 / 10);
    all_in_flight(&a_metrics, runs, starting, "every run's call in flight on a").await?;
    let (before_in, _) = rates(&nats, BEFORE).await?;

    let before = counters(&nats).await?;
    a.child.kill().await?;
    let killed = Instant::now();
    let (first, elapsed) = first_and_all(&b_metrics, runs, killed, lease * 3 + starting).await?;
    let after = counters(&nats).await?;
    let mut b_child = b.child;
    let _ = b_child.kill().await;
    a.stop().await;

    let spread = elapsed.saturating_sub(first).as_secs_f64();
    let takeover = Takeover {
        runs,
        lease_s: lease.as_secs_f64(),
        all_running_s: elapsed.as_secs_f64(),
        first_running_s: first.as_secs_f64(),
        runs_per_s: runs as f64 / spread.max(0.001),
        requests_per_run: ((after.0 - before.0) - before_in * elapsed.as_secs_f64()).max(0.0) / runs as f64,
        before_in_per_s: before_in,
    };
    eprintln!(
        "the first run again in {:.1} s, every run in {:.1} s, {:.1} requests per run",
        takeover.first_running_s, takeover.all_running_s, takeover.requests_per_run
    );
    Ok(takeover)
}

/// Measures a takeover of `runs` quiet runs; writes the report.
pub(crate) async fn run(bin: &Path, runs: usize, lease: Duration, out: &Path) -> anyhow::Result<()> {
    let takeover = measure(bin, runs, lease).await?;
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("takeover.json"), serde_json::to_string_pretty(&takeover)?)?;
    std::fs::write(out.join("takeover.md"), markdown(&takeover))?;
    eprintln!("bench: wrote {}", out.join("takeover.md").display());
    Ok(())
}

fn markdown(t: &Takeover) -> String {
    format!(
        "# Taking over a dead replica's quiet runs\n\n`cargo run --release -p bench -- --takeover-quiet <runs>`: \
         replica a holds the runs (each waiting on a tool call), replica b runs beside it idle, one \
         nats-server; a is SIGKILLed. Requests are nats-server's `/varz` `in_msgs` from the kill until \
         every run's call is in flight on b, less the fleet's rate before the kill.\n\n\
         | runs | lease (s) | first running again (s) | all running again (s) | runs/s from first to last | requests/run | fleet in/s before |\n\
         |---:|---:|---:|---:|---:|---:|---:|\n\
         | {} | {:.0} | {:.1} | {:.1} | {:.0} | {:.1} | {:.1} |\n",
        t.runs, t.lease_s, t.first_running_s, t.all_running_s, t.runs_per_s, t.requests_per_run, t.before_in_per_s
    )
}
