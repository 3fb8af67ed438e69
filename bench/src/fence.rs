//! What the run fence and the call records cost a call (`bench --fence N`): `RunTool` (the `echo`
//! built-in, a durable call of epoch 1, each with a call id of its own) sent N times to a runner
//! that checks nothing, to one that reads the run's fence from a NATS on loopback first, and to
//! one that also records each call there (a create before the tool, an update after), one call
//! at a time (latency) and 16 at a time (throughput), with the CPU this process spent (client
//! and runner both run in it, the same for every row) and the writes the run store's stream took
//! per call (its last sequence before and after). Beside them, the peer: one key-value read of
//! the fence on loopback, as the runner makes it. Writes `fence.md` / `fence.json`.

use std::path::Path;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use proto::toolrunner::v1 as pb;
use serde::Serialize;

use crate::procstat;

/// The orchestrators' run bucket.
const BUCKET: &str = "orchestrator-runs";
/// Calls in flight at once in the throughput pass.
const CONCURRENCY: usize = 16;

/// One runner's (or the bare read's) figures.
#[derive(Debug, Serialize)]
struct Row {
    what: String,
    p50_us: f64,
    p99_us: f64,
    /// Calls per second with 16 in flight (none for the bare read).
    throughput: Option<f64>,
    /// CPU of this process per call in the throughput pass, µs.
    cpu_per_call_us: Option<f64>,
    /// Writes the run store's stream took per call (none for the bare read).
    writes_per_call: Option<f64>,
}

/// See the module docs.
pub(crate) async fn run(calls: usize, out: &Path) -> anyhow::Result<()> {
    let nats = testkit::nats::Nats::start().await?;
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    let kv = testkit::nats::run_bucket(&js, BUCKET).await?;
    kv.put(shared::fence::key("bench"), shared::fence::encode(1).into())
        .await?;

    let plain = testkit::Runner::start(tool_runner::Config::default()).await?;
    let mut config = tool_runner::Config::default();
    config.fence.run_store = Some(nats.url());
    config.fence.records = false;
    let fenced = testkit::Runner::start(config.clone()).await?;
    config.fence.records = true;
    let recording = testkit::Runner::start(config).await?;
    let stream = js.get_stream(format!("KV_{BUCKET}")).await?;
    let rows = vec![
        measure_runner("runner, no fence", &plain, calls, &stream).await?,
        measure_runner("runner reading the run fence", &fenced, calls, &stream).await?,
        measure_runner(
            "runner reading the fence and recording calls",
            &recording,
            calls,
            &stream,
        )
        .await?,
        measure_read(&kv, calls).await?,
    ];
    let report = render(&rows, calls);
    print!("{report}");
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("fence.md"), &report)?;
    std::fs::write(out.join("fence.json"), serde_json::to_string_pretty(&rows)?)?;
    Ok(())
}

/// Call ids, each used once (a recording runner answers a call id it ran from its record).
static NEXT_CALL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn call() -> pb::RunToolRequest {
    let id = NEXT_CALL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    pb::RunToolRequest {
        run_id: "bench".into(),
        call_id: format!("c{id}"),
        tool_name: "echo".into(),
        arguments_json: r#"{"a":1}"#.into(),
        epoch: 1,
        ..Default::default()
    }
}

async fn measure_runner(
    what: &str,
    runner: &testkit::Runner,
    calls: usize,
    stream: &jetstream::stream::Stream,
) -> anyhow::Result<Row> {
    let client = runner.client().await?;
    for _ in 0..calls.min(200) {
        client.clone().run_tool(call()).await?;
    }
    let written_before = stream.clone().info().await?.state.last_sequence;
    let mut latencies = Vec::with_capacity(calls);
    for _ in 0..calls {
        let started = Instant::now();
        client.clone().run_tool(call()).await?;
        latencies.push(started.elapsed());
    }
    let cpu = procstat::cpu_time(std::process::id())?;
    let started = Instant::now();
    let per_task = calls.div_ceil(CONCURRENCY);
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                for _ in 0..per_task {
                    client.clone().run_tool(call()).await?;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    let (wall, cpu) = (started.elapsed(), procstat::cpu_time(std::process::id())? - cpu);
    let written = stream.clone().info().await?.state.last_sequence - written_before;
    let sent = (per_task * CONCURRENCY) as f64;
    let (p50, p99) = percentiles(&mut latencies);
    Ok(Row {
        what: what.to_owned(),
        p50_us: p50,
        p99_us: p99,
        throughput: Some(sent / wall.as_secs_f64()),
        cpu_per_call_us: Some(cpu.as_secs_f64() * 1e6 / sent),
        writes_per_call: Some(written as f64 / (sent + calls as f64)),
    })
}

async fn measure_read(kv: &jetstream::kv::Store, calls: usize) -> anyhow::Result<Row> {
    let key = shared::fence::key("bench");
    let mut latencies = Vec::with_capacity(calls);
    for _ in 0..calls {
        let started = Instant::now();
        kv.entry(&key).await?;
        latencies.push(started.elapsed());
    }
    let (p50, p99) = percentiles(&mut latencies);
    Ok(Row {
        what: "one key-value read of the fence (the peer)".to_owned(),
        p50_us: p50,
        p99_us: p99,
        throughput: None,
        cpu_per_call_us: None,
        writes_per_call: None,
    })
}

fn percentiles(latencies: &mut [Duration]) -> (f64, f64) {
    latencies.sort_unstable();
    let at = |q: f64| {
        let i = ((latencies.len() as f64 - 1.0) * q).round() as usize;
        latencies.get(i).map_or(0.0, |d| d.as_secs_f64() * 1e6)
    };
    (at(0.5), at(0.99))
}

fn render(rows: &[Row], calls: usize) -> String {
    let mut s = format!(
        "# The run fence's and the call records' cost per call\n\n{calls} `RunTool` calls (`echo`, a durable call, each its own call id) one at a time, then {calls} with {CONCURRENCY} in flight, on loopback (client, runners and NATS on this machine). Writes: what the run store's stream took per call (a runner's liveness renewals, one every 5 s, included).\n\n| | p50 (µs) | p99 (µs) | calls/s at {CONCURRENCY} | CPU per call (µs, client + runner) | store writes per call |\n|---|---:|---:|---:|---:|---:|\n"
    );
    for row in rows {
        let or_dash = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.0}"));
        s.push_str(&format!(
            "| {} | {:.0} | {:.0} | {} | {} | {} |\n",
            row.what,
            row.p50_us,
            row.p99_us,
            or_dash(row.throughput),
            or_dash(row.cpu_per_call_us),
            row.writes_per_call.map_or("–".to_owned(), |w| format!("{w:.2}"))
        ));
    }
    if let [plain, fenced, recording, read] = rows {
        s.push_str(&format!(
            "\nThe fence adds {:.0} µs to a call's p50 (×{:.2} of the call without it); the bare read is {:.0} µs: the fence costs {:.2} reads. Recording the call adds {:.0} µs more (×{:.2} of the fenced call, {:.2} reads' worth) and {:.2} writes per call; at {CONCURRENCY} in flight it keeps {:.0} % of the fenced runner's calls/s.\n",
            fenced.p50_us - plain.p50_us,
            fenced.p50_us / plain.p50_us.max(1.0),
            read.p50_us,
            (fenced.p50_us - plain.p50_us) / read.p50_us.max(1.0),
            recording.p50_us - fenced.p50_us,
            recording.p50_us / fenced.p50_us.max(1.0),
            (recording.p50_us - fenced.p50_us) / read.p50_us.max(1.0),
            recording.writes_per_call.unwrap_or(0.0),
            100.0 * recording.throughput.unwrap_or(0.0) / fenced.throughput.unwrap_or(1.0).max(1.0),
        ));
    }
    s
}
