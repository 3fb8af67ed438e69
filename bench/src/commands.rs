//! The measurements a flag asks for instead of the grid: the soak, the paced relay and its
//! peers, the fleet, approvals, tasks, the fence, admission, and the durable store's (a long run,
//! listing, quiet runs, shards, takeover, pending approvals).

use std::path::Path;
use std::time::Duration;

use crate::cli::Cli;
use crate::{
    admission, approvals, fence, fleet, listing, long_run, paced, pending, quiet, replicas, shards, soak, stack,
    takeover, tasks,
};

/// Runs the measurement a flag asks for instead of the grid (soak, relay, fleet, parking, fence,
/// admission); whether one did.
pub(crate) async fn one_measurement(cli: &Cli, bin: &Path) -> anyhow::Result<bool> {
    let out = &cli.out;
    if let Some(runs) = cli.soak {
        soak(cli, bin, runs).await?;
    } else if cli.paced || cli.peers {
        paced::run(bin, cli.quick, cli.peers, out).await?;
    } else if cli.fleet {
        fleet::run(bin, cli.quick, out).await?;
    } else if let Some(runs) = cli.approvals {
        approvals::run(bin, usize::try_from(runs)?, out).await?;
    } else if let Some(runs) = cli.tasks {
        tasks::run(bin, usize::try_from(runs)?, out).await?;
    } else if let Some(calls) = cli.fence {
        fence::run(usize::try_from(calls)?, out).await?;
    } else if let Some(runs) = cli.admission {
        admission::run(bin, usize::try_from(runs)?, out).await?;
    } else {
        return Ok(false);
    }
    Ok(true)
}

/// Runs the durable-store measurement a flag asks for instead of the grid (a long run, listing,
/// quiet runs, shards, takeover, pending approvals); whether one did.
pub(crate) async fn one_store_measurement(cli: &Cli, bin: &Path) -> anyhow::Result<bool> {
    let out = &cli.out;
    let counts = |values: &[u64]| {
        values
            .iter()
            .map(|&n| usize::try_from(n))
            .collect::<Result<Vec<_>, _>>()
    };
    if let Some(turns) = cli.long_run {
        long_run::run(bin, usize::try_from(turns)?, usize::try_from(cli.long_run_page)?, out).await?;
    } else if let Some(runs) = cli.list_runs {
        listing::run(bin, usize::try_from(runs)?, out).await?;
    } else if !cli.idle_cost.is_empty() {
        quiet::run(bin, &counts(&cli.idle_cost)?, cli.idle_window, out).await?;
    } else if !cli.shards.is_empty() {
        shards::run(bin, &counts(&cli.shards)?, usize::try_from(cli.shard_runs)?, out).await?;
    } else if let Some(runs) = cli.takeover_quiet {
        takeover::run(bin, usize::try_from(runs)?, cli.takeover_lease, out).await?;
    } else if let Some(waits) = cli.pending_approvals {
        pending::run(usize::try_from(waits)?, out).await?;
    } else {
        return Ok(false);
    }
    Ok(true)
}

/// `--soak`: the soak instead of the grid; exits 1 when a check fails.
pub(crate) async fn soak(cli: &Cli, bin: &std::path::Path, runs: u64) -> anyhow::Result<()> {
    anyhow::ensure!(
        (0.0..=1.0).contains(&cli.soak_fault_rate),
        "--soak-fault-rate {} must be from 0 to 1",
        cli.soak_fault_rate
    );
    let concurrency = usize::try_from(cli.soak_concurrency)?;
    let nats = match cli.soak_store.as_str() {
        "nats" => Some(testkit::nats::Nats::start().await?),
        _ => None,
    };
    let mut flags: Vec<String> = soak::FLAGS.iter().map(|f| (*f).to_owned()).collect();
    if cli.soak_shards > 1 {
        anyhow::ensure!(nats.is_some(), "--soak-shards needs --soak-store nats");
        flags.extend(["--run-store-shards".to_owned(), cli.soak_shards.to_string()]);
    }
    let settings = soak::Soak {
        runs,
        store: cli.soak_store.clone(),
        fault_rate: cli.soak_fault_rate,
        concurrency,
    };
    let passed = match cli.soak_replica_faults {
        None => {
            let mut flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            let url = nats.as_ref().map(testkit::nats::Nats::url);
            if let Some(url) = &url {
                flags.extend(["--run-store", url]);
            }
            let stack = stack::Stack::start(
                bin,
                soak::scenarios(runs),
                concurrency.div_ceil(50),
                None,
                "warn,shared::metrics=info",
                &flags,
                &[],
            )
            .await?;
            eprintln!(
                "bench: soak of {runs} runs, {} at once, {} store, orchestrator pid {}",
                concurrency, cli.soak_store, stack.pid
            );
            let passed = settings.run(soak::Target::One(&stack), &cli.out).await;
            stack.stop().await;
            passed
        }
        Some(every) => {
            let Some(nats) = &nats else {
                anyhow::bail!("--soak-replica-faults needs --soak-store nats");
            };
            let nats: std::net::SocketAddr = nats.url().trim_start_matches("nats://").parse()?;
            anyhow::ensure!(
                every >= Duration::from_millis(100),
                "--soak-replica-faults {} is too often (at least 100ms)",
                humantime::format_duration(every)
            );
            let channels = concurrency.div_ceil(50);
            let fleet = replicas::Replicas::start(bin, soak::scenarios(runs), 3, channels, &flags, nats).await?;
            eprintln!(
                "bench: soak of {runs} runs, {concurrency} at once, on 3 replicas (NATS store, {} shard(s)), one killed, drained, cut off from NATS or paused every {}",
                cli.soak_shards,
                humantime::format_duration(every)
            );
            let passed = settings.run(soak::Target::Fleet(&fleet, every), &cli.out).await;
            fleet.stop().await;
            passed
        }
    };
    // Stopped before exiting: `exit` would skip its drop and leave it running.
    drop(nats);
    if !passed? {
        eprintln!("bench: the soak FAILED (see {})", cli.out.join("soak.md").display());
        std::process::exit(1);
    }
    Ok(())
}
