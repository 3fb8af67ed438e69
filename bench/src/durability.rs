//! What durability costs: the same workloads on a fresh orchestrator with the in-memory store,
//! then with the NATS store (results in a key-value bucket, every run's events in a JetStream
//! event log), against a `nats-server -js` this benchmark starts. The orchestrator's CPU per turn
//! and per text chunk (one chunk is one `text_delta` the model streamed) on both sides, and the
//! NATS server's own CPU per turn with the store on (its threads' scheduled time).

use std::path::Path;

use serde::Serialize;

use crate::measure::{fresh_stack, measure, measure_each};
use crate::procstat;
use crate::workload::Workload;

/// The workloads measured both ways: text streamed in many chunks, and the paced end-to-end run
/// with a tool turn.
pub(crate) const WORKLOADS: [&str; 2] = ["text_only", "e2e_200ms_20ms"];

/// One workload with the store off and on.
#[derive(Debug, Serialize)]
pub(crate) struct DurabilityCost {
    pub workload: String,
    pub cpu_per_turn_memory_us: f64,
    pub cpu_per_turn_nats_us: f64,
    pub cpu_per_chunk_memory_us: f64,
    pub cpu_per_chunk_nats_us: f64,
    /// The NATS server's CPU per turn while the workload ran.
    pub nats_server_cpu_per_turn_us: f64,
    pub overhead_p50_memory_us: f64,
    pub overhead_p50_nats_us: f64,
}

/// Measures each of `workloads` named in [`WORKLOADS`] with `--run-store memory`, then with the
/// NATS store. `Ok(None)` with the reason when nats-server is not installed.
pub(crate) async fn costs(
    bin: &Path,
    workloads: &[Workload],
    channels: usize,
) -> anyhow::Result<Result<Vec<DurabilityCost>, String>> {
    let measured: Vec<&Workload> = workloads
        .iter()
        .filter(|w| WORKLOADS.contains(&w.name.as_str()))
        .collect();
    if measured.is_empty() {
        return Ok(Ok(Vec::new()));
    }
    let nats = match testkit::nats::Nats::start().await {
        Ok(nats) => nats,
        Err(e) => return Ok(Err(format!("not measured: {e}"))),
    };
    let nats_pid = nats
        .pid()
        .ok_or_else(|| anyhow::anyhow!("nats-server exited at once"))?;
    let memory = fresh_stack(bin, &measured, channels, None, "warn", &[]).await?;
    let off = measure_each(memory, &measured, "memory store").await?;
    let url = nats.url();
    let durable = fresh_stack(bin, &measured, channels, None, "warn", &["--run-store", &url]).await?;
    let mut costs = Vec::new();
    for (workload, off) in measured.iter().zip(off) {
        eprint!("bench: {:<20} NATS store … ", workload.name);
        // Scheduled time (ns) rather than 10 ms ticks: the server's share of a quick run is small.
        let nats_before = procstat::scheduled_time(nats_pid)?;
        let on = measure(&durable, workload).await?;
        let nats_cpu = procstat::scheduled_time(nats_pid)?.saturating_sub(nats_before);
        eprintln!("{} errors", on.errors);
        anyhow::ensure!(
            on.errors == 0,
            "{}: {} runs failed with the NATS store",
            workload.name,
            on.errors
        );
        let turns = (on.runs_ok as f64 * f64::from(workload.turns())).max(1.0);
        let chunks_per_turn = workload.text_words.max(1) as f64;
        costs.push(DurabilityCost {
            workload: workload.name.clone(),
            cpu_per_turn_memory_us: off.cpu_per_turn_us,
            cpu_per_turn_nats_us: on.cpu_per_turn_us,
            cpu_per_chunk_memory_us: off.cpu_per_turn_us / chunks_per_turn,
            cpu_per_chunk_nats_us: on.cpu_per_turn_us / chunks_per_turn,
            nats_server_cpu_per_turn_us: nats_cpu.as_secs_f64() * 1e6 / turns,
            overhead_p50_memory_us: off.overhead_per_turn_us.p50,
            overhead_p50_nats_us: on.overhead_per_turn_us.p50,
        });
    }
    durable.stop().await;
    Ok(Ok(costs))
}

/// The report's section.
pub(crate) fn markdown(costs: &Result<Vec<DurabilityCost>, String>) -> String {
    let mut s = String::from("\n## Durability (result store and event log: memory → NATS)\n\n");
    let costs = match costs {
        Err(reason) => return s + reason + "\n",
        Ok(costs) if costs.is_empty() => return String::new(),
        Ok(costs) => costs,
    };
    s.push_str("| workload | CPU/turn memory (µs) | CPU/turn NATS (µs) | CPU/chunk memory (µs) | CPU/chunk NATS (µs) | nats-server CPU/turn (µs) | overhead p50 memory → NATS (µs) |\n|---|---:|---:|---:|---:|---:|---:|\n");
    for c in costs {
        s.push_str(&format!(
            "| {} | {:.0} | {:.0} | {:.1} | {:.1} | {:.0} | {:.0} → {:.0} |\n",
            c.workload,
            c.cpu_per_turn_memory_us,
            c.cpu_per_turn_nats_us,
            c.cpu_per_chunk_memory_us,
            c.cpu_per_chunk_nats_us,
            c.nats_server_cpu_per_turn_us,
            c.overhead_p50_memory_us,
            c.overhead_p50_nats_us
        ));
    }
    s.push_str("\nA chunk is one piece of text the model streamed (the workloads stream word by word); the orchestrator's figures are its own process's CPU, the NATS server's its own. With the NATS store each run claims its id and renews its lease in the key-value bucket, writes its result there, and publishes its events to the JetStream event log in messages gathered over `--event-log-flush-interval`.\n");
    s
}
