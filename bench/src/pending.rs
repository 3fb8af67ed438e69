//! What one principal's `ListPendingApprovals` costs the store (`bench --pending-approvals N`):
//! N waits of other principals (ten of them) and one of alice's are opened through the NATS
//! approval store's own adapter, then alice's listing (her waits, found by their markers) is
//! measured beside an approver's (every wait: what every caller's listing read before the
//! markers). Per listing: the messages this client sent to and got from the NATS server, the bytes
//! it got, and the time, the median of several calls. Writes `pending_approvals.md` / `.json`.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use orchestrator::domain::approval::{Decider, PendingApproval};
use orchestrator::domain::ports::{ApprovalStore as _, Wait};
use orchestrator::store::nats::{KvStore, NatsApprovals};
use serde::Serialize;

/// The orchestrators' run bucket.
const BUCKET: &str = "orchestrator-runs";
/// Principals the other waits are spread over.
const OTHERS: usize = 10;
/// Listings measured per row.
const CALLS: usize = 9;
/// Waits opened at once.
const CONCURRENCY: usize = 32;

/// One listing's figures (medians over [`CALLS`]).
#[derive(Debug, Serialize)]
struct Row {
    who: String,
    listed: usize,
    messages_sent: u64,
    messages_received: u64,
    kib_received: f64,
    ms: f64,
}

/// See the module docs.
pub(crate) async fn run(waits: usize, out: &Path) -> anyhow::Result<()> {
    let nats = testkit::nats::Nats::start().await?;
    let client = async_nats::connect(nats.url()).await?;
    let js = jetstream::new(client.clone());
    let store = KvStore::open(
        &js,
        BUCKET,
        Duration::from_secs(3600),
        "bench".into(),
        Duration::from_secs(15),
        1,
    )
    .await
    .map_err(anyhow::Error::msg)?;
    let approvals = Arc::new(
        NatsApprovals::open(&js, BUCKET, Duration::from_secs(3600), Arc::new(store))
            .await
            .map_err(anyhow::Error::msg)?,
    );
    let started = Instant::now();
    open_waits(&approvals, waits).await?;
    eprintln!(
        "bench: {waits} other waits and alice's opened in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let mut rows = Vec::new();
    for (who, approver) in [("alice (her own waits)", false), ("an approver (every wait)", true)] {
        let decider = Decider {
            name: "alice".into(),
            anonymous: false,
            approver,
            approver_required: false,
        };
        rows.push(measure(&client, &approvals, who, &decider).await?);
    }
    let report = report(waits, &rows);
    print!("{report}");
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("pending_approvals.md"), &report)?;
    std::fs::write(out.join("pending_approvals.json"), serde_json::to_string_pretty(&rows)?)?;
    Ok(())
}

/// Opens `waits` waits of the other principals and one of alice's, each one call.
async fn open_waits(approvals: &Arc<NatsApprovals>, waits: usize) -> anyhow::Result<()> {
    use futures::StreamExt as _;
    let opened: Vec<Result<(), String>> = futures::stream::iter(0..=waits)
        .map(|i| {
            let approvals = Arc::clone(approvals);
            let principal = match i {
                0 => "alice".to_owned(),
                i => format!("p{}", i % OTHERS),
            };
            async move { approvals.open(wait(&format!("run-{i:06}"), &principal)).await }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    opened
        .into_iter()
        .collect::<Result<Vec<()>, String>>()
        .map_err(anyhow::Error::msg)?;
    Ok(())
}

/// A wait of one call of `principal`'s run `run_id`.
fn wait(run_id: &str, principal: &str) -> Wait {
    let now = shared::sync::unix_ms();
    let call = PendingApproval {
        run_id: run_id.to_owned(),
        call_id: "call_1_0".to_owned(),
        name: "refund".to_owned(),
        arguments_json: r#"{"order": "A-7", "amount": 5.0}"#.to_owned(),
        turn: 1,
        requested_at_unix_ms: now,
        expires_at_unix_ms: now + 3_600_000,
        principal: principal.to_owned(),
        decision: None,
        questions: None,
        in_doubt: false,
        context: Default::default(),
    };
    Wait {
        run_id: run_id.to_owned(),
        principal: principal.to_owned(),
        calls: vec![(call, serde_json::json!({"type": "object"}))],
        epoch: 1,
    }
}

/// The medians of [`CALLS`] listings of `decider`.
async fn measure(
    client: &async_nats::Client,
    approvals: &NatsApprovals,
    who: &str,
    decider: &Decider,
) -> anyhow::Result<Row> {
    let stats = client.statistics();
    let mut samples = Vec::with_capacity(CALLS);
    let mut listed = 0;
    for _ in 0..CALLS {
        let (sent, received, bytes) = (
            stats.out_messages.load(Ordering::Relaxed),
            stats.in_messages.load(Ordering::Relaxed),
            stats.in_bytes.load(Ordering::Relaxed),
        );
        let started = Instant::now();
        let (calls, _) = approvals.pending(decider, None, 100).await?;
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        listed = calls.len();
        samples.push((
            stats.out_messages.load(Ordering::Relaxed) - sent,
            stats.in_messages.load(Ordering::Relaxed) - received,
            stats.in_bytes.load(Ordering::Relaxed) - bytes,
            ms,
        ));
    }
    let median = |key: fn(&(u64, u64, u64, f64)) -> f64| {
        let mut values: Vec<f64> = samples.iter().map(key).collect();
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    eprintln!("bench: {who}: {listed} listed");
    Ok(Row {
        who: who.to_owned(),
        listed,
        messages_sent: median(|s| s.0 as f64) as u64,
        messages_received: median(|s| s.1 as f64) as u64,
        kib_received: median(|s| s.2 as f64) / 1024.0,
        ms: median(|s| s.3),
    })
}

fn report(waits: usize, rows: &[Row]) -> String {
    let mut s = format!(
        "# One principal's pending approvals among {waits} other parked runs\n\n`cargo run --release -p bench -- --pending-approvals {waits}`: {waits} waits of {OTHERS} other principals and one of alice's, opened through the NATS approval store's adapter (one nats-server on loopback); each listing the median of {CALLS}. Messages and bytes are this client's, to and from the NATS server.\n\n| listing | calls listed | messages sent | messages received | KiB received | ms |\n|---|---:|---:|---:|---:|---:|\n"
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} | {:.1} |\n",
            r.who, r.listed, r.messages_sent, r.messages_received, r.kib_received, r.ms
        ));
    }
    if let [own, every] = rows {
        s.push_str(&format!(
            "\nAlice's own listing takes {:.4}× the messages and {:.4}× the time of a listing of every wait (what each caller's listing read before the markers).\n",
            (own.messages_sent + own.messages_received) as f64 / (every.messages_sent + every.messages_received).max(1) as f64,
            own.ms / every.ms.max(f64::MIN_POSITIVE)
        ));
    }
    s
}
