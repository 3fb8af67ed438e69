//! The registry's rules, without a network: slots, principals, replays, bounds, cancels.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use shared::auth::Principal;

use super::*;
use crate::domain::{CancelMode, RunResult, RunStatus};

fn anon() -> Principal {
    Principal::anonymous()
}

fn named(name: &str, max_runs: Option<usize>) -> Principal {
    Principal {
        max_runs,
        ..Principal::unrestricted(name)
    }
}

/// A run that leaves its slot to wait for approvals has not moved away: its caller, following its
/// log, is not told to attach elsewhere (it once was, when the decision came before the caller
/// looked); a run handed over has.
#[tokio::test]
async fn a_run_parked_for_approvals_has_not_moved_from_here() {
    let runs = runs(8, 10, Duration::from_secs(60));
    for (status, moved) in [(RunStatus::AwaitingApproval, false), (RunStatus::Running, true)] {
        let admitted = runs.admit("p", &anon(), None).await.unwrap();
        let left = runs.moved_from_here("p");
        shared::sync::lock(&admitted.state).status = status;
        drop(admitted);
        let resolved = tokio::time::timeout(Duration::from_millis(200), left).await.is_ok();
        assert_eq!(resolved, moved, "{status:?}");
    }
}

#[tokio::test]
async fn runs_belong_to_their_principal_and_max_runs_holds_per_principal() {
    let runs = runs(8, 10, Duration::from_secs(60));
    let (alice, bob) = (named("alice", Some(2)), named("bob", None));
    let a1 = runs.admit("a1", &alice, None).await.unwrap();
    let _a2 = runs.admit("a2", &alice, None).await.unwrap();
    assert!(matches!(
        runs.admit("a3", &alice, None).await,
        Err(Refusal::CallerFull(2))
    ));
    // Another principal is not held back by alice's limit, and cannot use her ids.
    let _b1 = runs.admit("b1", &bob, None).await.unwrap();
    assert!(matches!(runs.admit("a1", &bob, None).await, Err(Refusal::Foreign)));
    assert!(runs.get("a1", &bob).await.unwrap().is_none());
    assert_eq!(
        runs.cancel("a1", &bob, "test", CancelMode::Immediate).await,
        Ok(CancelOutcome::NotFound)
    );
    assert_eq!(
        runs.get("a1", &alice).await.unwrap().map(|r| r.principal),
        Some("alice".into())
    );
    // The anonymous caller (no authentication) sees every run.
    assert!(runs.get("a1", &anon()).await.unwrap().is_some());
    drop(a1);
    assert!(runs.admit("a3", &alice, None).await.is_ok());
}
use crate::store::memory::MemoryStore;

fn runs(max_runs: usize, keep: usize, keep_for: Duration) -> Arc<Runs> {
    Runs::new(
        (max_runs, 2, 4, 8),
        keeping(keep, keep_for),
        Duration::from_secs(1),
        100,
    )
}

/// In-memory stores keeping `keep` results for `keep_for`.
fn keeping(keep: usize, keep_for: Duration) -> Keeping {
    let bounds = crate::store::LogBounds {
        per_run_bytes: 1 << 20,
        total_bytes: 1 << 24,
        keep,
        keep_for,
    };
    let store = Arc::new(MemoryStore::new(keep, keep_for));
    Keeping {
        store: Arc::clone(&store) as Arc<dyn crate::domain::ports::ResultStore>,
        index: store,
        quotas: None,
        log: Arc::new(crate::store::memory::MemoryLog::new(bounds)),
        journal: None,
        approvals: Arc::new(crate::store::memory::MemoryApprovals::new(100)),
    }
}

use futures::future::BoxFuture;

/// A journal that counts the claims it is asked for, and grants none unless it holds an
/// orphan's checkpoint.
#[derive(Default)]
struct CountingJournal {
    claims: std::sync::atomic::AtomicUsize,
    /// The checkpoint every take-over claims.
    orphan: Option<Vec<u8>>,
}

impl RunJournal for CountingJournal {
    fn save(&self, _: RunResult, _: u64, _: Vec<u8>) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }
    fn claim_resumable(
        &self,
        _: RunResult,
        _: u64,
        _: Vec<u8>,
    ) -> BoxFuture<'static, Result<crate::domain::ports::Claim, StoreError>> {
        Box::pin(async { Ok(crate::domain::ports::Claim::Claimed) })
    }
    fn forget(&self, _: &str) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }
    fn orphans(&self) -> BoxFuture<'static, Result<Vec<String>, StoreError>> {
        Box::pin(async { Ok(Vec::new()) })
    }
    fn take_over(&self, _: &str) -> BoxFuture<'static, Result<Option<crate::domain::ports::Claimed>, StoreError>> {
        self.claims.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let claimed = self.orphan.clone().map(|checkpoint| crate::domain::ports::Claimed {
            checkpoint,
            parked: false,
            ends_after_turn: None,
        });
        Box::pin(async { Ok(claimed) })
    }

    fn hand_over(&self, _: &str) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }
    fn hand_overs(&self) -> BoxFuture<'static, futures::stream::BoxStream<'static, ()>> {
        Box::pin(async { futures::StreamExt::boxed(futures::stream::pending()) })
    }
    fn cancel_elsewhere(
        &self,
        _: &str,
        _: &str,
        _: crate::domain::CancelMode,
    ) -> BoxFuture<'static, Result<Option<crate::domain::ports::RemoteCancel>, StoreError>> {
        Box::pin(async { Ok(None) })
    }
    fn cancel_asks(&self) -> BoxFuture<'static, futures::stream::BoxStream<'static, crate::domain::ports::CancelAsk>> {
        Box::pin(async { futures::StreamExt::boxed(futures::stream::pending()) })
    }
}

/// A look for orphans (a hand-over announced, a record seen unchanged) never claims a run
/// live on this replica: the claim would fence the run out of its own record.
#[tokio::test]
async fn a_replica_does_not_claim_a_run_live_on_it() {
    let runs = runs(4, 10, Duration::from_secs(60));
    let journal = Arc::new(CountingJournal::default());
    let runs = Arc::new(Runs {
        journal: Some(Arc::clone(&journal) as Arc<dyn RunJournal>),
        ..Arc::into_inner(runs).unwrap()
    });
    let _live = runs.admit("live", &anon(), None).await.unwrap();
    assert!(runs.take_over("live").await.unwrap().is_none());
    assert_eq!(journal.claims.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert!(runs.take_over("elsewhere").await.unwrap().is_none());
    assert_eq!(
        journal.claims.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "a run live elsewhere is claimed"
    );
}

/// A run taken over reads as it was admitted from the moment it is live here, while its
/// resumption still reads the store: a listing shows a run only when its index entry agrees
/// with it (same admission time), so a fresh admission time would hide the run.
#[tokio::test]
async fn a_run_taken_over_keeps_its_admission_time_while_it_resumes() {
    let mut spec = crate::run::tool_loop::tests::spec(crate::run::tool_loop::tests::limits());
    spec.run_id = "t".into();
    let mut admitted_as = RunResult::running("t");
    admitted_as.created_at_ms = 1_000;
    let checkpoint = crate::run::tool_loop::Checkpoint::at_start(&spec, admitted_as)
        .snapshot()
        .and_then(|s| crate::domain::ports::json("a checkpoint", &s.checkpoint))
        .expect("a checkpoint of this process's own making encodes");
    let journal = Arc::new(CountingJournal {
        orphan: Some(checkpoint),
        ..CountingJournal::default()
    });
    // The take-over looks at the run's wait after the run is live here: it answers when told.
    let wait_read = Arc::new(tokio::sync::Notify::new());
    let approvals = crate::store::memory::approvals::HookedApprovals {
        slow_waiting: Some(Arc::clone(&wait_read)),
        ..crate::store::memory::approvals::HookedApprovals::new()
    };
    let keeping = Keeping {
        approvals: Arc::new(approvals),
        ..keeping(10, Duration::from_secs(60))
    };
    let runs = Arc::new(Runs {
        journal: Some(journal as Arc<dyn RunJournal>),
        ..Arc::into_inner(Runs::new((4, 2, 4, 8), keeping, Duration::from_secs(1), 100)).unwrap()
    });
    let taking = tokio::spawn({
        let runs = Arc::clone(&runs);
        async move { runs.take_over("t").await.map(|taken| taken.is_some()) }
    });
    let live = async {
        while !runs.lock().contains_key("t") {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), live).await.unwrap();
    let query = crate::domain::listing::RunQuery {
        page_size: 10,
        ..crate::domain::listing::RunQuery::default()
    };
    let page = runs.list(query).await.unwrap();
    let created: Vec<(String, u64)> = page.runs.iter().map(|r| (r.run_id.clone(), r.created_at_ms)).collect();
    assert_eq!(
        created,
        [("t".to_owned(), 1_000)],
        "the run as a listing finds it mid-resumption"
    );
    wait_read.notify_one();
    assert!(taking.await.unwrap().unwrap(), "the run is taken over");
}

async fn finish(runs: &Arc<Runs>, id: &str) {
    let admitted = runs.admit(id, &anon(), None).await.unwrap();
    admitted.state.lock().unwrap().status = RunStatus::Completed;
    admitted.persister.write_final().await;
}

#[tokio::test]
async fn slots_on_both_sides_of_the_limit_and_released_on_drop() {
    let runs = runs(2, 10, Duration::from_secs(60));
    let a = runs.admit("a", &anon(), None).await.unwrap();
    let _b = runs.admit("b", &anon(), None).await.unwrap();
    assert!(matches!(runs.admit("c", &anon(), None).await, Err(Refusal::Full(2))));
    assert!(matches!(runs.admit("a", &anon(), None).await, Err(Refusal::Duplicate)));
    drop(a);
    assert!(runs.admit("c", &anon(), None).await.is_ok());
}

/// An end is shown once it is kept: a run whose end is settled but not stored reads running
/// (GetRun, and a retry of its id is refused as live); once stored, while its task has not let
/// go of its slot yet, a retry is a replay.
#[tokio::test]
async fn a_retry_just_after_the_end_is_a_replay_once_the_end_is_kept() {
    let runs = runs(2, 10, Duration::from_secs(60));
    let ending = runs.admit("a", &anon(), None).await.unwrap();
    {
        let mut state = ending.state.lock().unwrap();
        state.status = RunStatus::Failed;
        state.failure_reason = Some(crate::domain::FailureReason::LlmStreamStalled);
    }
    assert!(matches!(runs.admit("a", &anon(), None).await, Err(Refusal::Duplicate)));
    let shown = runs.get("a", &anon()).await.unwrap().unwrap();
    assert_eq!((shown.status, shown.failure_reason), (RunStatus::Running, None));
    ending.persister.write_final().await;
    assert!(matches!(
        runs.admit("a", &anon(), None).await,
        Err(Refusal::Finished(result)) if result.status == RunStatus::Failed
    ));
    assert!(matches!(
        runs.admit("a", &named("mallory", None), None).await,
        Err(Refusal::Foreign)
    ));
}

#[tokio::test]
async fn results_are_bounded_by_count() {
    let runs = runs(10, 2, Duration::from_secs(60));
    for id in ["a", "b", "c"] {
        finish(&runs, id).await;
    }
    assert!(runs.get("a", &anon()).await.unwrap().is_none());
    assert!(runs.get("b", &anon()).await.unwrap().is_some() && runs.get("c", &anon()).await.unwrap().is_some());
    assert!(matches!(
        runs.admit("c", &anon(), None).await,
        Err(Refusal::Finished(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn results_are_bounded_by_age() {
    let runs = runs(10, 10, Duration::from_secs(60));
    finish(&runs, "a").await;
    tokio::time::advance(Duration::from_secs(59)).await;
    assert!(runs.get("a", &anon()).await.unwrap().is_some());
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(runs.get("a", &anon()).await.unwrap().is_none());
}

#[tokio::test]
async fn attached_callers_are_bounded_and_see_only_their_own_runs() {
    let runs = runs(10, 10, Duration::from_secs(60));
    let (alice, bob) = (named("alice", None), named("bob", None));
    let _run = runs.admit("a", &alice, None).await.unwrap();
    assert!(matches!(runs.attach("a", 0, &bob).await, Err(AttachError::NotFound)));
    assert!(matches!(
        runs.attach("zzz", 0, &alice).await,
        Err(AttachError::NotFound)
    ));
    let first = runs.attach("a", 0, &alice).await.unwrap();
    let _second = runs.attach("a", 0, &alice).await.unwrap();
    assert!(matches!(runs.attach("a", 0, &alice).await, Err(AttachError::Full(2))));
    drop(first);
    assert!(
        runs.attach("a", 0, &alice).await.is_ok(),
        "a finished feed frees its place"
    );
}

#[tokio::test]
async fn live_state_and_cancel() {
    let runs = runs(10, 10, Duration::from_secs(60));
    let admitted = runs.admit("a", &anon(), None).await.unwrap();
    admitted.state.lock().unwrap().text.push_str("so far");
    assert_eq!(
        runs.get("a", &anon()).await.unwrap().map(|r| (r.status, r.text)),
        Some((RunStatus::Running, "so far".into()))
    );
    assert_eq!(
        runs.cancel("a", &anon(), "test", CancelMode::Immediate).await,
        Ok(CancelOutcome::Canceled)
    );
    assert!(admitted.cancel.is_canceled());
    assert_eq!(
        runs.cancel("zzz", &anon(), "test", CancelMode::Immediate).await,
        Ok(CancelOutcome::NotFound)
    );
}

/// A drain asks every run to move, the runs let in after it began too (a takeover that
/// raced it): such a run would otherwise run on until the grace ends and be handed over
/// mid-call, running that call twice.
#[tokio::test]
async fn a_run_let_in_while_the_replica_drains_is_asked_to_hand_over_too() {
    let runs = runs(10, 10, Duration::from_secs(60));
    let before = runs.admit("before", &anon(), None).await.unwrap();
    assert!(!before.hand_over.at_safe_point.is_cancelled());
    assert_eq!(runs.hand_over_all(false), 1);
    let after = runs.admit("after", &anon(), None).await.unwrap();
    for run in [&before, &after] {
        assert!(run.hand_over.at_safe_point.is_cancelled() && !run.hand_over.now.is_cancelled());
    }
    runs.hand_over_all(true);
    let last = runs.admit("last", &anon(), None).await.unwrap();
    assert!(before.hand_over.now.is_cancelled() && last.hand_over.now.is_cancelled());
}

fn said(text: &str) -> crate::domain::steering::UserMessage {
    crate::domain::steering::UserMessage {
        content: text.to_owned(),
        name: None,
    }
}

/// `SendMessage` reaches a run for its owner only: another principal is told the run does not
/// exist, as for `GetRun`; a run waiting for approvals or ended refuses the message.
#[tokio::test]
async fn a_message_reaches_a_run_for_its_owner_only() {
    let runs = runs(8, 10, Duration::from_secs(60));
    let (alice, bob) = (named("alice", None), named("bob", None));
    let admitted = runs.admit("r", &alice, None).await.unwrap();
    assert_eq!(
        runs.send_message("r", &bob, said("hi")).await,
        Ok(SteeringOutcome::NotFound)
    );
    assert_eq!(
        runs.send_message("r", &alice, said("hi")).await,
        Ok(SteeringOutcome::Accepted(1))
    );
    assert_eq!(admitted.inbox.kept().waiting, [said("hi")]);
    shared::sync::lock(&admitted.state).status = RunStatus::AwaitingApproval;
    assert_eq!(
        runs.send_message("r", &alice, said("wait")).await,
        Ok(SteeringOutcome::Refused(
            crate::domain::steering::Refused::AwaitingApproval
        ))
    );
    shared::sync::lock(&admitted.state).status = RunStatus::Completed;
    assert_eq!(
        runs.send_message("r", &alice, said("late")).await,
        Ok(SteeringOutcome::Finished(RunStatus::Completed))
    );
}

/// A store that answers no claim (and holds nothing).
struct Unclaiming;

impl ResultStore for Unclaiming {
    fn put(&self, _: RunResult) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }
    fn claim(&self, result: RunResult) -> BoxFuture<'static, Result<crate::domain::ports::Claim, StoreError>> {
        Box::pin(async move {
            Err(StoreError::Unavailable {
                operation: "KV create",
                key: result.run_id,
                reason: "timed out".to_owned(),
            })
        })
    }
    fn get(&self, _: &str) -> BoxFuture<'static, Result<Option<RunResult>, StoreError>> {
        Box::pin(async { Ok(None) })
    }
    fn lease(&self) -> Option<crate::domain::LeaseTerms> {
        Some(crate::domain::LeaseTerms {
            length: Duration::from_secs(3),
            margin: Duration::from_secs(1),
            fence_grace: Duration::ZERO,
        })
    }
}

/// A claim the store did not answer does not start the run (it would run unclaimed, at epoch 0,
/// maybe twice): the caller is refused, retryably, and the slot is free again.
#[tokio::test]
async fn a_claim_the_store_did_not_answer_starts_nothing() {
    let runs = runs(1, 10, Duration::from_secs(60));
    let runs = Arc::new(Runs {
        store: Arc::new(Unclaiming),
        ..Arc::into_inner(runs).unwrap()
    });
    for _ in 0..2 {
        match runs.admit("u", &anon(), None).await {
            Err(Refusal::Unclaimed(StoreError::Unavailable { key, .. })) => assert_eq!(key, "u"),
            Err(other) => panic!("refused otherwise: {other:?}"),
            Ok(_) => panic!("an unclaimed run was let in"),
        }
    }
    assert!(
        runs.get("u", &anon()).await.unwrap().is_none(),
        "no live entry was left"
    );
}

/// A store other replicas read (it has lease terms) that says run `r` has `status`.
struct Says(RunStatus);

impl ResultStore for Says {
    fn put(&self, _: RunResult) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }
    fn claim(&self, _: RunResult) -> BoxFuture<'static, Result<crate::domain::ports::Claim, StoreError>> {
        Box::pin(async { Ok(crate::domain::ports::Claim::Claimed) })
    }
    fn get(&self, run_id: &str) -> BoxFuture<'static, Result<Option<RunResult>, StoreError>> {
        let mut result = RunResult::running(run_id);
        result.status = self.0;
        Box::pin(async move { Ok(Some(result)) })
    }
    fn lease(&self) -> Option<crate::domain::LeaseTerms> {
        Some(crate::domain::LeaseTerms {
            length: Duration::from_secs(3),
            margin: Duration::from_secs(1),
            fence_grace: Duration::ZERO,
        })
    }
}

/// The registry of a replica whose store says run `r` has `status`, and whose log holds two of
/// its events and not its end; with the log's writer, still there (a writer dropped is a loss
/// the memory log tells of itself).
fn runs_of_a_quiet_run(status: RunStatus) -> (Arc<Runs>, Box<dyn crate::domain::ports::LogWriter>) {
    let runs = runs(4, 10, Duration::from_secs(60));
    let runs = Arc::into_inner(runs).unwrap();
    let mut writer = runs.log.writer("r", 0);
    let text = |seq| crate::domain::NumberedEvent {
        seq,
        event: crate::domain::Event::TextDelta {
            text: "so far ".into(),
            turn: 1,
        },
    };
    writer.append(&[text(1), text(2)]);
    let runs = Arc::new(Runs {
        store: Arc::new(Says(status)),
        ..runs
    });
    (runs, writer)
}

/// A follower whose feed goes quiet is told `DATA_LOSS` only when the store says the run ended
/// and the log's last event is neither its end nor past the follower, naming the log's last seq;
/// while the store says the run goes on (a paused or starved replica), silence is only silence.
#[tokio::test(start_paused = true)]
async fn loss_is_read_from_the_store_and_the_log_never_from_silence() {
    use futures::StreamExt;
    let (live, _writer) = runs_of_a_quiet_run(RunStatus::Running);
    let mut feed = live.follow("r", 2, &anon()).await.unwrap();
    let quiet = tokio::time::timeout(Duration::from_secs(60), feed.next()).await;
    assert!(
        quiet.is_err(),
        "twenty quiet renewal periods of a live run are no loss: {quiet:?}"
    );

    let (ended, _writer) = runs_of_a_quiet_run(RunStatus::Completed);
    let mut feed = ended.follow("r", 2, &anon()).await.unwrap();
    let lost = tokio::time::timeout(Duration::from_secs(60), feed.next())
        .await
        .unwrap();
    match lost {
        Some(Err(crate::domain::ports::LogError::Lost { after_seq, reason, .. })) => {
            assert_eq!(after_seq, 2);
            assert!(reason.contains("ends at seq 2"), "{reason}");
        }
        other => panic!("not told of the loss: {other:?}"),
    }
}

/// A follower is handed `run_finished` only once the store holds the end too: while the store
/// says the run goes on (its owner logged the end and died before storing it), the end is held
/// back, and after two leases the follower is told to attach again after its last seq
/// (`UNAVAILABLE`), never shown an end the store does not hold; once the store holds it, it is
/// handed out.
#[tokio::test(start_paused = true)]
async fn an_end_is_handed_to_a_follower_only_once_the_store_holds_it() {
    use futures::StreamExt;
    let finished = crate::domain::NumberedEvent {
        seq: 3,
        event: crate::domain::Event::RunFinished(Box::new(RunResult::running("r"))),
    };
    let (unstored, mut writer) = runs_of_a_quiet_run(RunStatus::Running);
    writer.append(std::slice::from_ref(&finished));
    let mut feed = unstored.follow("r", 2, &anon()).await.unwrap();
    let held = tokio::time::timeout(Duration::from_secs(60), feed.next())
        .await
        .unwrap();
    match held {
        Some(Err(crate::domain::ports::LogError::Unavailable { reason, .. })) => {
            assert!(reason.contains("attach again after seq 2"), "{reason}");
        }
        other => panic!("an end the store does not hold was handed out: {other:?}"),
    }

    let (stored, mut writer) = runs_of_a_quiet_run(RunStatus::Completed);
    writer.append(std::slice::from_ref(&finished));
    let mut feed = stored.follow("r", 2, &anon()).await.unwrap();
    let end = tokio::time::timeout(Duration::from_secs(60), feed.next())
        .await
        .unwrap();
    assert!(matches!(&end, Some(Ok(e)) if e.seq == 3 && e.is_last()), "{end:?}");
}

/// A parked run that resumes is, for a reader (GetRun), in the approval store or live, never in neither:
/// it leaves the approval store under the registry's lock (in CI a reader once found it nowhere, and the
/// caller was told the run did not exist).
#[tokio::test]
async fn a_parked_run_resuming_is_never_out_of_sight() {
    use crate::domain::ports::{Parked, Wait};
    let (taken, taken_rx) = std::sync::mpsc::sync_channel(1);
    let (read_tx, read) = std::sync::mpsc::sync_channel(1);
    let read = Mutex::new(read);
    // Once a ready run is handed out, a reader looks for it before the registry goes on (or
    // until a deadline, when the reader waits for the registry's lock).
    let approvals = Arc::new(crate::store::memory::approvals::HookedApprovals {
        after_take: Some(Box::new(move || {
            let _ = taken.send(());
            let _ = shared::sync::lock(&read).recv_timeout(Duration::from_millis(300));
        })),
        ..crate::store::memory::approvals::HookedApprovals::new()
    });
    let keeping = Keeping {
        approvals: Arc::clone(&approvals) as Arc<dyn ApprovalStore>,
        ..keeping(10, Duration::from_secs(60))
    };
    let runs = Runs::new((8, 2, 4, 8), keeping, Duration::from_secs(1), 100);
    let mut spec = crate::run::tool_loop::tests::spec(crate::run::tool_loop::tests::limits());
    spec.run_id = "p".into();
    let mut state = RunResult::running("p");
    state.status = RunStatus::AwaitingApproval;
    let checkpoint = crate::run::tool_loop::Checkpoint::at_start(&spec, state.clone())
        .snapshot()
        .and_then(|s| crate::domain::ports::json("a checkpoint", &s.checkpoint))
        .expect("a checkpoint of this process's own making encodes");
    let wait = Wait {
        run_id: "p".into(),
        principal: String::new(),
        calls: vec![(
            crate::domain::approval::PendingApproval {
                run_id: "p".into(),
                call_id: "c".into(),
                name: "refund".into(),
                arguments_json: "{}".into(),
                turn: 1,
                requested_at_unix_ms: 0,
                expires_at_unix_ms: u64::MAX,
                principal: String::new(),
                decision: None,
                questions: None,
                in_doubt: false,
                context: Default::default(),
            },
            serde_json::json!({"type": "object"}),
        )],
        epoch: 0,
    };
    approvals.open(wait).await.unwrap();
    let parked = Parked {
        checkpoint,
        result: state,
        wake_at_unix_ms: u64::MAX,
        parked_at_unix_ms: 0,
        deadline_unix_ms: u64::MAX,
        log: None,
    };
    assert!(matches!(
        approvals.park("p", parked).await.unwrap(),
        crate::domain::ports::ParkOutcome::Parked
    ));
    assert!(
        approvals.cancel("p", "test").await.unwrap(),
        "a canceled parked run is ready"
    );

    let reader = {
        let runs = Arc::clone(&runs);
        std::thread::spawn(move || {
            taken_rx.recv_timeout(Duration::from_secs(10)).unwrap();
            let found = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .unwrap()
                .block_on(runs.get("p", &anon()));
            let _ = read_tx.send(());
            found.unwrap()
        })
    };
    let Unparked::Resumed(resumed) = runs.resume_parked().await else {
        panic!("the ready run did not resume");
    };
    let found = reader.join().unwrap();
    assert_eq!(
        found.map(|r| r.status),
        Some(RunStatus::Running),
        "seen while it resumed"
    );
    drop(resumed);
}

/// A store other replicas read whose writes all fail (NATS down), and which says every run is
/// still running (its last renewal).
struct TakesNoWrite;

impl ResultStore for TakesNoWrite {
    fn put(&self, result: RunResult) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async move {
            Err(StoreError::Unavailable {
                operation: "KV update",
                key: result.run_id,
                reason: "no responders".to_owned(),
            })
        })
    }
    fn claim(&self, _: RunResult) -> BoxFuture<'static, Result<crate::domain::ports::Claim, StoreError>> {
        Box::pin(async { Ok(crate::domain::ports::Claim::Claimed) })
    }
    fn get(&self, run_id: &str) -> BoxFuture<'static, Result<Option<RunResult>, StoreError>> {
        let running = RunResult::running(run_id);
        Box::pin(async move { Ok(Some(running)) })
    }
    fn lease(&self) -> Option<crate::domain::LeaseTerms> {
        Says(RunStatus::Running).lease()
    }
}

/// An end the store did not take waits in the backlog, and until the store keeps it `GetRun`
/// reads the run as running, with its output so far: every other replica reads the store, which
/// says running (the simulation over the ports once saw `COMPLETED` here and `RUNNING` there).
#[tokio::test(start_paused = true)]
async fn an_end_in_the_backlog_reads_unended_until_the_store_keeps_it() {
    let store: Arc<dyn ResultStore> = Arc::new(TakesNoWrite);
    let backlog =
        crate::run::backlog::Backlog::new(Arc::clone(&store), 16, Duration::from_secs(1), Duration::from_secs(1));
    let runs = Arc::new(Runs {
        store,
        backlog,
        ..Arc::into_inner(runs(4, 10, Duration::from_secs(60))).unwrap()
    });
    let ended = RunResult {
        status: RunStatus::Completed,
        text: "all done".into(),
        ..RunResult::running("r")
    };
    runs.backlog.push(ended);
    let read = runs.get("r", &anon()).await.unwrap().unwrap();
    assert_eq!((read.status, read.text.as_str()), (RunStatus::Running, "all done"));
}

/// The memory store, each claim answered after 50 ms (a store far away, or a loaded machine).
struct SlowClaims(MemoryStore);

impl ResultStore for SlowClaims {
    fn put(&self, result: RunResult) -> BoxFuture<'static, Result<(), StoreError>> {
        self.0.put(result)
    }
    fn claim(&self, result: RunResult) -> BoxFuture<'static, Result<crate::domain::ports::Claim, StoreError>> {
        let claim = self.0.claim(result);
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            claim.await
        })
    }
    fn get(&self, run_id: &str) -> BoxFuture<'static, Result<Option<RunResult>, StoreError>> {
        self.0.get(run_id)
    }
    fn lease(&self) -> Option<crate::domain::LeaseTerms> {
        None
    }
}

/// A run let in at once says it waited for nothing, however long its admission took; one that
/// waited in its principal's queue says how long.
#[tokio::test(start_paused = true)]
async fn only_time_in_the_queue_counts_as_waiting() {
    let runs = runs(1, 10, Duration::from_secs(60));
    let runs = Arc::new(Runs {
        store: Arc::new(SlowClaims(MemoryStore::new(10, Duration::from_secs(60)))),
        ..Arc::into_inner(runs).unwrap()
    });
    let until = tokio::time::Instant::now() + Duration::from_secs(60);
    let first = runs.admit_queued("first", &anon(), None, until).await.unwrap();
    assert_eq!(first.waited, Duration::ZERO);
    let second = tokio::spawn({
        let runs = Arc::clone(&runs);
        async move {
            runs.admit_queued("second", &anon(), None, until)
                .await
                .map(|q| q.waited)
        }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    drop(first);
    let waited = second.await.unwrap().unwrap();
    assert!(waited >= Duration::from_secs(2), "{waited:?}");
}
