//! What the faults do to a replica's own tasks, one fault at a time.

use super::*;

/// Two replicas, no faults drawn, a run started on the first.
async fn two_replicas_and_a_run() -> anyhow::Result<(World, Arc<Replica>)> {
    let settings = Settings {
        replicas: 2,
        runs: 1,
        faults: 0,
        messages: 0,
        ..Settings::default()
    };
    let mut world = World::new(1, settings);
    let a = world.spawn_replica().await;
    world.spawn_replica().await;
    let replica = world.processes[a]
        .replica
        .clone()
        .ok_or_else(|| anyhow::anyhow!("no replica"))?;
    replica.start(spec("run-0", false), caller("run-0", false)).await?;
    anyhow::ensure!(replica.live() == 1, "the run is not live on its replica");
    Ok((world, replica))
}

/// A replica stopped (SIGSTOP) right after it took a run runs none of its tasks: long after its
/// lease lapsed (and the other replica took the run over) it still holds the run, as a stopped
/// process knows nothing of the time passing; once it continues, its timers fire and it finds
/// the run lost at once.
#[test]
fn a_stopped_replica_notices_nothing_until_it_continues() -> anyhow::Result<()> {
    on_virtual_clock(START_OF_AN_HOUR, || async {
        let (world, replica) = two_replicas_and_a_run().await?;
        let condition = world.processes[0].condition.clone();
        condition.set(Mode::Paused);
        tokio::time::sleep(LEASE * 4).await;
        assert_eq!(replica.live(), 1, "a stopped replica let its run go");
        condition.set(Mode::Up);
        testkit::wait::until("the continued replica lets its run go", LEASE * 4, || async {
            (replica.live() == 0).then_some(())
        })
        .await
    })?
}

/// A replica killed (SIGKILL) drops every task at once: its run is gone from it long before its
/// lease could lapse (no task of it waits to see that), and the other replica takes the run over
/// and ends it.
#[test]
fn a_killed_replica_runs_nothing_again() -> anyhow::Result<()> {
    on_virtual_clock(START_OF_AN_HOUR, || async {
        let (world, replica) = two_replicas_and_a_run().await?;
        world.processes[0].condition.set(Mode::Dead);
        testkit::wait::until("the killed replica's run task is dropped", LEASE / 3, || async {
            (replica.live() == 0).then_some(())
        })
        .await?;
        testkit::wait::until(
            "the run ends on the other replica",
            Duration::from_secs(120),
            || async {
                let view = world.store.view();
                let run = view.records.get("run-0")?;
                (run.epoch > 1 && !run.result.status.is_live()).then_some(())
            },
        )
        .await
    })?
}
