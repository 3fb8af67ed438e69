//! What spreading the run store over shards buys (`bench --shards 1,4`): for each shard count
//! and each cluster of [`CLUSTERS`], a fresh JetStream cluster and one replica with
//! `--run-store-shards N` run the same durable workload (eight turns a run, a tool call in seven
//! of them). Reported: turns per second, the orchestrator's and every nats-server node's CPU per
//! turn, which node leads each shard's streams, and the ceiling the busiest node sets (turns a
//! second one of its cores carries). On one machine the nodes share its cores, so the absolute
//! throughput says little; how the nodes' CPU per turn is spread is what shards change. Writes
//! `shards.md` / `.json`.

use std::path::Path;
use std::time::Instant;

use serde::Serialize;
use shared::jetstream::shards;

use crate::measure::{fresh_stack, measure};
use crate::procstat;
use crate::workload::Workload;

/// The clusters measured: nodes, and copies of each stream. Three copies on three nodes is the
/// HA overlay (every node stores every write); six nodes hold three copies each of half the
/// streams; one copy on three nodes puts each stream on one node.
const CLUSTERS: [(usize, usize); 3] = [(3, 3), (6, 3), (3, 1)];

/// The run store's names as the orchestrator makes them by default.
const BUCKET: &str = "orchestrator-runs";
const EVENTS: &str = "ORCHESTRATOR_EVENTS";

/// The figures of one shard count.
#[derive(Debug, Serialize)]
pub(crate) struct ShardCost {
    pub shards: usize,
    /// Nodes of the cluster.
    pub nodes: usize,
    /// Copies of each stream (`--nats-replicas`).
    pub replicas: usize,
    pub runs_ok: usize,
    pub turns: usize,
    pub turns_per_s: f64,
    pub orchestrator_cpu_per_turn_us: f64,
    /// Every node's CPU per turn, summed.
    pub nats_cpu_per_turn_us: f64,
    /// Each node's CPU per turn, in node order.
    pub node_cpu_per_turn_us: Vec<f64>,
    /// Streams each node leads (of the shards' buckets, checkpoint stores and event logs).
    pub leaders_per_node: Vec<usize>,
    /// The busiest node's share of the cluster's CPU.
    pub busiest_share: f64,
    /// Turns per second one core of the busiest node carries (1 s over its CPU per turn).
    pub ceiling_turns_per_core_s: f64,
}

/// The workload every count runs.
fn workload(runs: usize) -> Workload {
    Workload {
        name: "shards_turns8".into(),
        concurrency: 64.min(runs),
        runs,
        tool_turns: 7,
        calls_per_turn: 1,
        ..Workload::base()
    }
}

/// `bench --shards`: each of `counts` measured on a cluster of its own with `runs` runs.
pub(crate) async fn run(bin: &Path, counts: &[usize], runs: usize, out: &Path) -> anyhow::Result<()> {
    let mut costs = Vec::with_capacity(counts.len() * CLUSTERS.len());
    for (nodes, replicas) in CLUSTERS {
        for &count in counts {
            anyhow::ensure!(
                (1..=shards::MAX_SHARDS).contains(&count),
                "--shards {count}: from 1 to {}",
                shards::MAX_SHARDS
            );
            eprint!("bench: {count} shard(s) of {replicas} cop(ies) on a {nodes}-node cluster, {runs} runs … ");
            let cost = measure_count(bin, count, (nodes, replicas), runs).await?;
            eprintln!("{:.0} turns/s", cost.turns_per_s);
            costs.push(cost);
        }
    }
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("shards.json"), serde_json::to_string_pretty(&costs)?)?;
    std::fs::write(out.join("shards.md"), markdown(&costs))?;
    eprintln!("bench: wrote {}", out.join("shards.md").display());
    Ok(())
}

/// One count: a fresh cluster, one replica, the workload, every node's CPU.
async fn measure_count(
    bin: &Path,
    count: usize,
    (nodes, replicas): (usize, usize),
    runs: usize,
) -> anyhow::Result<ShardCost> {
    let cluster = testkit::nats::NatsCluster::start(nodes).await?;
    let pids: Vec<u32> = cluster.nodes().iter().filter_map(|(_, pid)| *pid).collect();
    anyhow::ensure!(pids.len() == nodes, "a node of the cluster exited");
    let (urls, count_flag, replicas_flag) = (cluster.urls(), count.to_string(), replicas.to_string());
    let flags = [
        "--run-store",
        &urls,
        "--nats-replicas",
        &replicas_flag,
        "--run-store-shards",
        &count_flag,
    ];
    let workload = workload(runs);
    let stack = fresh_stack(bin, &[&workload], 2, None, "warn", &flags).await?;
    let before = pids
        .iter()
        .map(|&pid| procstat::scheduled_time(pid))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let started = Instant::now();
    let measured = measure(&stack, &workload).await?;
    let wall = started.elapsed().as_secs_f64();
    let node_cpu: Vec<f64> = pids
        .iter()
        .zip(&before)
        .map(|(&pid, before)| Ok(procstat::scheduled_time(pid)?.saturating_sub(*before).as_secs_f64()))
        .collect::<anyhow::Result<_>>()?;
    stack.stop().await;
    anyhow::ensure!(
        measured.errors == 0,
        "{count} shard(s): {} runs failed",
        measured.errors
    );
    let turns = measured.runs_ok * workload.turns() as usize;
    let per_turn = |cpu_s: f64| cpu_s * 1e6 / turns.max(1) as f64;
    let node_cpu_per_turn_us: Vec<f64> = node_cpu.iter().map(|&s| per_turn(s)).collect();
    let busiest = node_cpu_per_turn_us.iter().copied().fold(0.0, f64::max);
    let total: f64 = node_cpu_per_turn_us.iter().sum();
    Ok(ShardCost {
        shards: count,
        nodes,
        replicas,
        runs_ok: measured.runs_ok,
        turns,
        turns_per_s: turns as f64 / wall,
        orchestrator_cpu_per_turn_us: measured.cpu_per_turn_us,
        nats_cpu_per_turn_us: total,
        node_cpu_per_turn_us,
        leaders_per_node: leaders(&cluster, count).await?,
        busiest_share: busiest / total.max(f64::MIN_POSITIVE),
        ceiling_turns_per_core_s: 1e6 / busiest.max(f64::MIN_POSITIVE),
    })
}

/// How many of the shards' streams each node leads.
async fn leaders(cluster: &testkit::nats::NatsCluster, count: usize) -> anyhow::Result<Vec<usize>> {
    let mut led = vec![0; cluster.nodes().len()];
    for shard in 0..count {
        let bucket = shards::name(BUCKET, shard);
        for stream in [
            format!("KV_{bucket}"),
            format!("OBJ_{bucket}-checkpoints"),
            shards::name(EVENTS, shard),
        ] {
            let leader = cluster.stream_leader(&stream).await?;
            if let Some(i) = cluster.index_of(&leader) {
                led[i] += 1;
            }
        }
    }
    Ok(led)
}

fn markdown(costs: &[ShardCost]) -> String {
    let mut s = String::from(
        "# The run store in shards\n\nOne replica on a JetStream cluster, the same durable \
         workload for each shard count (eight turns a run, a tool call in seven of them, 64 runs at once), all on this \
         machine's cores: the throughput is this machine's, the spread of the nodes' CPU is what shards change.\n\n\
         | shards | nodes | copies of each | turns | turns/s | orchestrator CPU/turn (µs) | nats-server CPU/turn, all nodes (µs) | per node (µs) | streams led per node | busiest node's share | ceiling: turns/s per core of the busiest node |\n\
         |---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|\n",
    );
    for c in costs {
        let per_node: Vec<String> = c.node_cpu_per_turn_us.iter().map(|us| format!("{us:.0}")).collect();
        let led: Vec<String> = c.leaders_per_node.iter().map(ToString::to_string).collect();
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {} | {} | {:.0} % | {:.0} |\n",
            c.shards,
            c.nodes,
            c.replicas,
            c.turns,
            c.turns_per_s,
            c.orchestrator_cpu_per_turn_us,
            c.nats_cpu_per_turn_us,
            per_node.join(" / "),
            led.join(" / "),
            c.busiest_share * 100.0,
            c.ceiling_turns_per_core_s
        ));
    }
    s.push_str(
        "\nEvery turn writes the run's record, checkpoint and events: with one shard all of them go through one \
         bucket, one object store and one stream, whose nodes carry every turn of the fleet; with N shards each \
         shard's streams carry the turns of 1/N of the runs. A shard's streams cost what one shard's do per turn \
         (the nats-server CPU per turn above, summed over the nodes), so the ceiling per core of the busiest node \
         (one second over its CPU per turn) is what one shard's nodes sustain, and N shards placed on different \
         nodes sustain up to N times it. Where JetStream places them is its own choice: read the streams led per \
         node. With three copies on three nodes every node stores every write whatever N is.\n",
    );
    s
}
