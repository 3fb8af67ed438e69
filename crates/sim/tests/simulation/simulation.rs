//! The fencing simulation as CI runs it: many seeds under every fix (about a minute on two
//! cores), the seeds that broke each invariant before its fix (they break it again with the fix
//! off, and hold with it on), and a seed's history replayed exactly.

use std::time::{Duration, Instant};

use sim::plan::{Rules, Settings};

/// Seeds run under the current rules, or as many as fit in [`BUDGET`].
const SEEDS: u64 = 80_000;
const BUDGET: Duration = Duration::from_secs(75);

/// A replica cut off from NATS with its calls held between its lease check and the send: its
/// call of epoch 1 reaches a runner after the new owner's call of epoch 2 ran (the soak's and
/// the paused-replica test's "epochs in the order run [2, 2, 2, 1, 2]").
const STALE_CALL_AFTER_THE_NEW_OWNERS: u64 = 2980;
/// A run's end shown by its replica before its log and its store held it.
const END_SHOWN_BEFORE_IT_WAS_KEPT: u64 = 1;
/// A runner's fence read answered slowly, just before a takeover raised the fence: its stale
/// call starts after the new owner's first call unless the new owner waits out the grace.
const STALE_CALL_THROUGH_A_SLOW_FENCE_READ: u64 = 19_582;

#[test]
fn every_invariant_holds_over_many_seeds() {
    let settings = Settings::default();
    let started = Instant::now();
    let mut run = 0;
    for seed in 0..SEEDS {
        // The floor of seeds however long they take (a busy machine); a fast one tries more.
        if started.elapsed() > BUDGET && run >= 5000 {
            break;
        }
        let outcome = sim::simulate(seed, &settings, Rules::current(), false);
        assert!(
            outcome.violations.is_empty(),
            "seed {seed} (replay: cargo run --release -p sim -- --seed {seed} --trace):\n{}",
            outcome.violations.join("\n")
        );
        run += 1;
    }
    eprintln!("{run} seeds, every invariant held ({:.1?})", started.elapsed());
    assert!(run >= 5000, "only {run} seeds in {BUDGET:?}");
}

/// Each fix is what holds its invariant: its seed breaks it with the fix off, not with it on.
#[test]
fn each_fix_holds_the_seed_that_broke_without_it() {
    let settings = Settings::default();
    for (seed, fix, broken) in [
        (STALE_CALL_AFTER_THE_NEW_OWNERS, "receiver-fence", "after call"),
        (END_SHOWN_BEFORE_IT_WAS_KEPT, "end-after-log", "read as ended"),
        (STALE_CALL_THROUGH_A_SLOW_FENCE_READ, "fence-grace", "after call"),
    ] {
        let without = Rules::without(fix).unwrap_or_else(|e| panic!("{e}"));
        let before = sim::simulate(seed, &settings, without, false);
        assert!(
            before.violations.iter().any(|v| v.contains(broken)),
            "seed {seed} without {fix} broke nothing like {broken:?}: {:?}",
            before.violations
        );
        let after = sim::simulate(seed, &settings, Rules::current(), false);
        assert_eq!(after.violations, Vec::<String>::new(), "seed {seed} with every fix");
    }
}

/// A seed is its history: run twice, every event comes at the same time in the same order.
#[test]
fn a_seed_replays_the_same_history() {
    let settings = Settings::default();
    let once = sim::simulate(STALE_CALL_AFTER_THE_NEW_OWNERS, &settings, Rules::current(), true);
    let again = sim::simulate(STALE_CALL_AFTER_THE_NEW_OWNERS, &settings, Rules::current(), true);
    assert!(once.trace.as_ref().is_some_and(|t| t.len() > 1000));
    assert_eq!(once.trace, again.trace);
}
