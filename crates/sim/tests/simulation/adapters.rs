//! The real NATS adapters over the simulated cluster, one fault at a time: what a sweep found,
//! pinned as a sequence of the adapters' own calls (a lagging follower of a bucket serving the
//! direct reads).

use std::time::Duration;

use orchestrator::domain::RunResult;
use orchestrator::domain::ports::{Claim, RunJournal};
use sim::jetstream::Cluster;
use sim::ports::adapters::{Stores, open};
use sim::ports::condition::Condition;
use tokio::time::Instant;

type TestResult = anyhow::Result<()>;

fn config() -> orchestrator::Config {
    let mut config = orchestrator::Config::default();
    config.store.lease = Duration::from_millis(500);
    config.store.lease_margin = Some(Duration::from_millis(100));
    config.store.timeout = Duration::from_secs(1);
    config
}

async fn replica(cluster: &Cluster, owner: &str) -> Stores {
    let connection = cluster.connect(Condition::default(), config().store.timeout);
    open(&connection, owner, &config()).await
}

/// Keeps `stores`' incarnation alive as a serving replica's keeper does, until dropped (a replica
/// without one lapses after a lease and claims nothing more).
fn alive(stores: &Stores) -> shared::runtime::AbortOnDrop {
    shared::runtime::AbortOnDrop(tokio::spawn(stores.journal.keep_alive()))
}

/// The runs bucket's follower serves the direct reads from what it holds now, for two seconds.
fn lag_runs(cluster: &Cluster) {
    let runs = format!("KV_{}", config().store.bucket);
    cluster.lag(&runs, Instant::now() + Duration::from_secs(2));
}

/// The checkpoint `journal` takes `run_id` over from, once it reads orphaned (its owner's lease
/// lapsed, or it was handed over) and a takeover wins (one losing to a follower's older record
/// is tried again, as the takeover's rounds do); an error when none won within 10 s.
async fn taken_over(journal: &dyn RunJournal, run_id: &str) -> anyhow::Result<Vec<u8>> {
    testkit::wait::until("a takeover", Duration::from_secs(10), || async {
        let orphaned = journal.orphans().await.ok()?.iter().any(|id| id == run_id);
        let claimed = match orphaned {
            true => journal.take_over(run_id).await.ok()??,
            false => return None,
        };
        Some(claimed.checkpoint)
    })
    .await
}

/// An admission of an id retried while a follower lacks the first claim (its answer lost) is
/// answered "taken" and leaves the claimed run's start checkpoint as it was: the run is resumed
/// from it. Read from the follower, the id looked free, the retry's start checkpoint replaced
/// the claimed run's, and the takeover wrote the run lost, its log holding no end.
#[tokio::test]
async fn a_retried_admission_never_replaces_a_claimed_runs_start_checkpoint() -> TestResult {
    let cluster = Cluster::new(1);
    let (a, b, c) = (
        replica(&cluster, "a").await,
        replica(&cluster, "b").await,
        replica(&cluster, "c").await,
    );
    let _alive = (alive(&b), alive(&c));
    lag_runs(&cluster);
    let deadline = shared::sync::unix_ms() + 60_000;
    let run = RunResult::running("run-1");
    let first = a
        .journal
        .claim_resumable(run.clone(), deadline, b"a's start".to_vec())
        .await;
    assert!(matches!(first, Ok(Claim::Claimed)), "{first:?}");
    let again = b.journal.claim_resumable(run, deadline, b"b's start".to_vec()).await;
    assert!(matches!(again, Ok(Claim::Taken(_))), "{again:?}");
    // a's replica dies: its run is resumed from a's start.
    drop(a);
    assert_eq!(taken_over(&*c.journal, "run-1").await?, b"a's start".to_vec());
    Ok(())
}

/// A run handed over at a drain is resumed from its owner's last checkpoint: the hand-over reads
/// the record it marks from the leader. Read from a follower that lacked the last save, the
/// record written back named an older checkpoint, and the next owner lost the run's progress
/// (or, once that object was gone, the run).
#[tokio::test]
async fn a_hand_over_never_writes_back_a_followers_older_record() -> TestResult {
    let cluster = Cluster::new(2);
    let (a, c) = (replica(&cluster, "a").await, replica(&cluster, "c").await);
    let _alive = (alive(&a), alive(&c));
    let deadline = shared::sync::unix_ms() + 60_000;
    let run = RunResult::running("run-1");
    let claimed = a
        .journal
        .claim_resumable(run.clone(), deadline, b"start".to_vec())
        .await;
    assert!(matches!(claimed, Ok(Claim::Claimed)), "{claimed:?}");
    lag_runs(&cluster);
    a.journal.save(run.clone(), deadline, b"turn 1".to_vec()).await?;
    a.journal.save(run, deadline, b"turn 2".to_vec()).await?;
    a.journal.hand_over("run-1").await?;
    assert_eq!(taken_over(&*c.journal, "run-1").await?, b"turn 2".to_vec());
    Ok(())
}

/// A thread is read from the leader: it is read to be written by compare-and-set on the revision
/// read. Read from a follower that lacked the last write, every attempt to add a run's messages
/// failed on the revision and the run ended off its thread.
#[tokio::test]
async fn a_thread_read_while_a_follower_lags_is_the_newest() -> TestResult {
    use orchestrator::domain::thread::Thread;
    let cluster = Cluster::new(3);
    let a = replica(&cluster, "a").await;
    let thread = Thread::new("thread-0", "team", 1);
    anyhow::ensure!(a.threads.write(thread.clone(), 0).await?, "created");
    let threads = format!("KV_{}-threads", config().store.bucket);
    cluster.lag(&threads, Instant::now() + Duration::from_secs(2));
    let (read, revision) = a
        .threads
        .read("thread-0")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no thread"))?;
    let updated = Thread {
        dropped_turns: 1,
        ..read
    };
    anyhow::ensure!(a.threads.write(updated, revision).await?, "updated");
    let (newest, revision) = a
        .threads
        .read("thread-0")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no thread"))?;
    assert_eq!(newest.dropped_turns, 1, "the newest write is read");
    assert!(
        a.threads.write(newest, revision).await?,
        "a write at the revision read lands"
    );
    Ok(())
}

/// A turn's tokens booked again after the hour turned (the takeover's catch-up from a checkpoint
/// that did not hold the first booking, or an add whose answer was lost) are booked once: the new
/// hour takes the run as booked as far as the hour before it booked it. Without the earlier
/// hour's reading, the turn was booked twice (the simulation's seeds 392, 454, 490 and 906 once
/// seeds started anywhere in an hour).
#[tokio::test]
async fn a_turn_booked_again_after_the_hour_turned_is_booked_once() -> TestResult {
    use orchestrator::domain::chat::Usage;
    use orchestrator::domain::usage::{Add, Tally, WINDOW_MS};
    let cluster = Cluster::new(4);
    let (a, b) = (replica(&cluster, "a").await, replica(&cluster, "b").await);
    let tokens = |prompt_tokens| Usage {
        prompt_tokens,
        ..Usage::default()
    };
    let hour = 500_000 * WINDOW_MS;
    let first = Add::of_run(Tally::of_tokens(&tokens(100)), "run-0", tokens(100), false);
    let second = Add::of_run(Tally::of_tokens(&tokens(30)), "run-0", tokens(130), false);
    a.usage.add("team", hour, first).await?;
    a.usage.add("team", hour, second.clone()).await?;
    // The next owner's checkpoint held 100 booked: it books the turn again, in the next hour.
    let again = b.usage.add("team", hour + WINDOW_MS, second).await?;
    assert_eq!(again.prompt_tokens, 0, "the turn is booked once");
    let next = Add::of_run(Tally::of_tokens(&tokens(40)), "run-0", tokens(170), false);
    let after = b.usage.add("team", hour + WINDOW_MS, next).await?;
    assert_eq!(after.prompt_tokens, 40, "the run's next turn is booked whole");
    Ok(())
}

/// A listing of a store in four shards, each call walking at most 100 index positions and
/// reading at most 40 records, pages through 300 runs newest first with each run once, whatever
/// calls the bounds cut short; the cursor holds a position per shard.
#[tokio::test]
async fn a_bounded_listing_over_four_shards_pages_through_every_run_once_newest_first() -> TestResult {
    use orchestrator::domain::listing::{Cursor, RunQuery};
    let cluster = Cluster::new(1);
    let mut config = config();
    (
        config.store.shards,
        config.store.list_scan_max,
        config.store.list_read_max,
    ) = (4, 100, 40);
    let connection = cluster.connect(Condition::default(), config.store.timeout);
    let stores = open(&connection, "a", &config).await;
    let _alive = alive(&stores);
    let runs: Vec<String> = (0..300).map(|i| format!("listed-{i}")).collect();
    for (i, run_id) in (1_000u64..).zip(&runs) {
        let mut run = RunResult::running(run_id);
        run.created_at_ms = i;
        run.principal = "alice".into();
        assert!(matches!(stores.store.claim(run).await, Ok(Claim::Claimed)), "{run_id}");
    }
    let (mut listed, mut calls, mut query) = (
        Vec::new(),
        0,
        RunQuery {
            page_size: 25,
            ..RunQuery::default()
        },
    );
    loop {
        calls += 1;
        assert!(
            calls <= 100,
            "300 runs listed in 100 calls at most: {} so far",
            listed.len()
        );
        let page = stores.index.list(query.clone(), Vec::new()).await?;
        assert!(page.runs.len() <= 40, "a call reads 40 records at most");
        listed.extend(page.runs.into_iter().map(|r| r.run_id));
        match page.next {
            Some(Cursor::Positions(positions)) => {
                assert_eq!(positions.len(), 4, "a position per shard");
                query.after = Some(Cursor::Positions(positions));
            }
            Some(other) => anyhow::bail!("a cursor of the index is positions: {other:?}"),
            None => break,
        }
    }
    let newest_first: Vec<String> = runs.iter().rev().cloned().collect();
    assert_eq!(listed, newest_first);
    assert!(
        calls >= 300 / 40,
        "the bounds cut calls short ({calls} calls for 5 pages)"
    );
    Ok(())
}
