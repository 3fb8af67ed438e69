//! The fences of a run's shared state against a real `nats-server -js` (started here;
//! `./scripts/test` installs it), at the store's level, where each write can be put in the order
//! a paused or replaced replica would send it: a takeover raises the run's fence (what every
//! tool-runner reads) before the new owner acts, and an approval wait is neither replaced nor
//! deleted by an older owner, while a resumed run opening the same wait keeps its decisions; a
//! late decision and the wake of its run never both land; a parked run claimed is told so, and
//! reads parked until its new owner goes on.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use orchestrator::domain::RunResult;
use orchestrator::domain::approval::{Decider, Decision, DecisionKind, PendingApproval};
use orchestrator::domain::ports::{ApprovalStore, Claim, ResultStore, RunJournal, Wait};
use orchestrator::store::nats::NatsApprovals;
use testkit::nats::Nats;

use crate::common::{keep, replica_store};

type TestResult = anyhow::Result<()>;

/// The run's fence as a tool-runner reads it (0: none).
async fn fence(js: &jetstream::Context, bucket: &str, run_id: &str) -> anyhow::Result<u64> {
    let kv = js.get_key_value(bucket).await?;
    Ok(match kv.get(shared::fence::key(run_id)).await? {
        Some(value) => shared::fence::decode(&value).map_err(anyhow::Error::msg)?,
        None => 0,
    })
}

/// A run admitted in epoch 1 has no fence (no runner has anything to refuse); each takeover
/// raises it to the new owner's epoch before that owner may act, and a raise is never undone.
#[tokio::test]
async fn each_takeover_raises_the_runs_fence_to_its_epoch_before_it_acts() -> TestResult {
    let nats = Nats::start().await?;
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    let lease = Duration::from_millis(500);
    let (a, b, c) = (
        replica_store(&js, "fence-runs", "a", lease).await?,
        replica_store(&js, "fence-runs", "b", lease).await?,
        replica_store(&js, "fence-runs", "c", lease).await?,
    );
    let deadline = shared::sync::unix_ms() + 60_000;
    let run = RunResult::running("fenced.run");
    assert!(matches!(
        a.claim_resumable(run.clone(), deadline, b"start".to_vec()).await,
        Ok(Claim::Claimed)
    ));
    assert_eq!(fence(&js, "fence-runs", "fenced.run").await?, 0);
    for (taker, epoch) in [(&b, 2), (&c, 3)] {
        // Alive while it takes the run over; it dies at the end of its turn.
        let _alive = keep(taker);
        assert!(taker.orphans().await?.is_empty());
        testkit::wait::until("the run's record to lapse", Duration::from_secs(20), || async {
            tokio::time::timeout(Duration::from_secs(5), taker.orphans())
                .await
                .ok()?
                .ok()
                .filter(|orphans| !orphans.is_empty())
        })
        .await?;
        assert!(taker.take_over("fenced.run").await?.is_some());
        assert_eq!(taker.epoch("fenced.run"), epoch);
        assert_eq!(fence(&js, "fence-runs", "fenced.run").await?, epoch);
    }
    Ok(())
}

/// A wait of `calls` of run `run_id`, opened by the owner of `epoch`.
fn wait(run_id: &str, calls: &[&str], epoch: u64) -> Wait {
    let pending = |call_id: &str| PendingApproval {
        run_id: run_id.to_owned(),
        call_id: call_id.to_owned(),
        name: "refund".to_owned(),
        arguments_json: "{}".to_owned(),
        turn: 1,
        requested_at_unix_ms: shared::sync::unix_ms(),
        expires_at_unix_ms: shared::sync::unix_ms() + 600_000,
        principal: String::new(),
        decision: None,
        questions: None,
        in_doubt: false,
        context: Default::default(),
    };
    Wait {
        run_id: run_id.to_owned(),
        principal: String::new(),
        calls: calls
            .iter()
            .map(|c| (pending(c), serde_json::json!({"type": "object"})))
            .collect(),
        epoch,
    }
}

/// The decided calls of the run's wait, and whether one is open.
async fn decided(approvals: &NatsApprovals, run_id: &str) -> anyhow::Result<Option<Vec<String>>> {
    Ok(approvals.parked_calls(run_id).await?.map(|w| {
        w.calls
            .into_iter()
            .filter(|c| c.decision.is_some())
            .map(|c| c.call_id)
            .collect()
    }))
}

/// A replaced owner (epoch 1) neither replaces nor deletes the wait the new owner (epoch 2)
/// opened; the new owner, opening the same wait again (resumed), keeps the decisions made on it;
/// its own close deletes it.
#[tokio::test]
async fn an_approval_wait_is_fenced_by_the_epoch_that_opened_it() -> TestResult {
    let nats = Nats::start().await?;
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    let store = Arc::new(replica_store(&js, "waits-runs", "a", Duration::from_secs(5)).await?);
    let approvals = NatsApprovals::open(&js, "waits-runs", Duration::from_secs(60), store)
        .await
        .map_err(anyhow::Error::msg)?;
    let person = Decider {
        name: String::new(),
        anonymous: true,
        approver: true,
        approver_required: false,
    };
    approvals
        .open(wait("r", &["call_1", "call_2"], 2))
        .await
        .map_err(anyhow::Error::msg)?;
    let approve = Decision {
        call_id: "call_1".to_owned(),
        kind: DecisionKind::Approve,
        round: None,
    };
    approvals.decide("r", &person, &[approve]).await?;

    let refused = approvals
        .open(wait("r", &["call_9"], 1))
        .await
        .expect_err("a replaced owner's wait");
    assert!(refused.contains("epoch 2") && refused.contains("epoch 1"), "{refused}");
    approvals.close("r", 1).await;
    assert_eq!(
        decided(&approvals, "r").await?,
        Some(vec!["call_1".to_owned()]),
        "the wait stands, decided"
    );

    approvals
        .open(wait("r", &["call_1", "call_2"], 2))
        .await
        .map_err(anyhow::Error::msg)?;
    assert_eq!(
        decided(&approvals, "r").await?,
        Some(vec!["call_1".to_owned()]),
        "opened again, its decision kept"
    );
    approvals
        .open(wait("r", &["call_3"], 3))
        .await
        .map_err(anyhow::Error::msg)?;
    assert_eq!(
        decided(&approvals, "r").await?,
        Some(Vec::new()),
        "a newer owner's next turn replaces it"
    );
    approvals.close("r", 3).await;
    assert_eq!(decided(&approvals, "r").await?, None);
    approvals
        .open(wait("r", &["call_4"], 3))
        .await
        .map_err(anyhow::Error::msg)?;
    assert!(
        decided(&approvals, "r").await?.is_some(),
        "a closed wait is opened again"
    );
    Ok(())
}

/// A parked run that wakes past its calls' expiry decides them so in the approval store first: a person's
/// answer that lands after that is refused (it names the timeout), and one that landed before
/// it is what the run goes on with. Each call is decided once, by whichever came first.
#[tokio::test]
async fn a_late_decision_and_the_wake_never_both_land() -> TestResult {
    use orchestrator::domain::approval::{DecideError, TIMEOUT_PRINCIPAL};
    let nats = Nats::start().await?;
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    let store = Arc::new(replica_store(&js, "late-runs", "a", Duration::from_secs(5)).await?);
    let approvals = NatsApprovals::open(&js, "late-runs", Duration::from_secs(60), store)
        .await
        .map_err(anyhow::Error::msg)?;
    let person = Decider {
        name: "ana".to_owned(),
        anonymous: false,
        approver: true,
        approver_required: false,
    };
    let approve = |call: &str| Decision {
        call_id: call.to_owned(),
        kind: DecisionKind::Approve,
        round: None,
    };
    let mut late = wait("late", &["call_1", "call_2"], 1);
    late.calls[0].0.expires_at_unix_ms = shared::sync::unix_ms();
    approvals.open(late).await.map_err(anyhow::Error::msg)?;

    approvals.decide("late", &person, &[approve("call_2")]).await?;
    let woken = approvals
        .wake("late", shared::sync::unix_ms())
        .await?
        .expect("the wait");
    let by: Vec<Option<String>> = woken
        .calls
        .iter()
        .map(|c| c.decision.as_ref().map(|d| d.principal.clone()))
        .collect();
    assert_eq!(
        by,
        [Some(TIMEOUT_PRINCIPAL.to_owned()), Some("ana".to_owned())],
        "the expired call is decided by the timeout, the answered one by the person"
    );
    match approvals.decide("late", &person, &[approve("call_1")]).await {
        Err(DecideError::AlreadyDecided { principal, .. }) => assert_eq!(principal, TIMEOUT_PRINCIPAL),
        other => panic!("a decision after the wake is refused as decided by the timeout: {other:?}"),
    }
    let again = approvals
        .wake("late", shared::sync::unix_ms())
        .await?
        .expect("the wait");
    assert_eq!(again.calls, woken.calls, "a second wake changes nothing");
    Ok(())
}

/// A parked run, decided, is claimed by one replica's takeover, which is told it read parked (it
/// gave its slot back and must take one again): its record keeps reading parked until its new
/// owner writes it, and that owner's renewals keep it owned; a run claimed while it ran is not.
#[tokio::test]
async fn a_parked_run_claimed_reads_parked_until_its_new_owner_goes_on() -> TestResult {
    use orchestrator::domain::RunStatus;
    use orchestrator::domain::ports::{ParkOutcome, Parked};
    let nats = Nats::start().await?;
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    let lease = Duration::from_millis(500);
    let a = Arc::new(replica_store(&js, "parked-runs", "a", lease).await?);
    let b = replica_store(&js, "parked-runs", "b", lease).await?;
    let (a_alive, b_alive) = (keep(&a), keep(&b));
    let approvals = NatsApprovals::open(&js, "parked-runs", Duration::from_secs(60), Arc::clone(&a))
        .await
        .map_err(anyhow::Error::msg)?;
    let deadline = shared::sync::unix_ms() + 60_000;
    let running = RunResult::running("parked.run");
    assert!(matches!(
        a.claim_resumable(running.clone(), deadline, b"start".to_vec()).await,
        Ok(Claim::Claimed)
    ));
    approvals
        .open(wait("parked.run", &["call_1"], 1))
        .await
        .map_err(anyhow::Error::msg)?;
    let parked = Parked {
        checkpoint: b"parked".to_vec(),
        result: RunResult {
            status: RunStatus::AwaitingApproval,
            ..running
        },
        wake_at_unix_ms: deadline,
        parked_at_unix_ms: shared::sync::unix_ms(),
        deadline_unix_ms: deadline,
        log: None,
    };
    assert!(matches!(
        approvals.park("parked.run", parked).await?,
        ParkOutcome::Parked
    ));
    assert!(b.orphans().await?.is_empty(), "undecided, it waits");
    let person = Decider {
        name: String::new(),
        anonymous: true,
        approver: true,
        approver_required: false,
    };
    let approve = Decision {
        call_id: "call_1".to_owned(),
        kind: DecisionKind::Approve,
        round: None,
    };
    approvals.decide("parked.run", &person, &[approve]).await?;
    let claimed = b.take_over("parked.run").await?.expect("the decided run claimed");
    assert!(claimed.parked, "the claim says it read parked");
    assert_eq!(claimed.checkpoint, b"parked");
    let read = b.get("parked.run").await?.expect("its record");
    assert_eq!(
        read.status,
        RunStatus::AwaitingApproval,
        "it reads parked until it goes on"
    );
    // Its new owner's incarnation keeps it owned while it reads parked; that lapsing (the owner
    // gone) makes it an orphan again.
    b.put(read.clone()).await?;
    drop(b_alive);
    testkit::wait::until("the parked run's lease to lapse", Duration::from_secs(20), || async {
        tokio::time::timeout(Duration::from_secs(5), a.orphans())
            .await
            .ok()?
            .ok()
            .filter(|o| o.iter().any(|id| id == "parked.run"))
    })
    .await?;
    let again = a.take_over("parked.run").await?.expect("claimed again");
    assert!(again.parked, "still parked: it never went on");
    a.put(RunResult::running("parked.run")).await?;
    drop(a_alive);
    // b, started again (a new incarnation), takes it once more.
    let b = replica_store(&js, "parked-runs", "b", lease).await?;
    let _b_alive = keep(&b);
    testkit::wait::until("the running run's lease to lapse", Duration::from_secs(20), || async {
        tokio::time::timeout(Duration::from_secs(5), b.orphans())
            .await
            .ok()?
            .ok()
            .filter(|o| o.iter().any(|id| id == "parked.run"))
    })
    .await?;
    let running = b.take_over("parked.run").await?.expect("claimed once more");
    assert!(!running.parked, "a run claimed while it ran holds its slot");
    Ok(())
}

/// A replica that no longer acts for a run publishes none of its signals (its retries included):
/// the signal stream holds only what the run's owner published.
#[tokio::test]
async fn a_replaced_owner_publishes_no_signal() -> TestResult {
    use orchestrator::domain::ports::SignalTopic;
    use orchestrator::domain::{Delivery, Ownership, Signal, Stop};
    use orchestrator::signals::nats::{NatsTopic, TopicOptions};
    let nats = Nats::start().await?;
    let client = async_nats::connect(nats.url()).await?;
    let settings = orchestrator::config::SignalSettings {
        subject_prefix: "stale".to_owned(),
        stream: "STALE_SIGNALS".to_owned(),
        ..orchestrator::Config::default().signals
    };
    let js = jetstream::new(client);
    let topic = NatsTopic::open(&js, TopicOptions::from(&settings))
        .await
        .map_err(anyhow::Error::msg)?;
    let signal = |call: &str| Signal {
        run_id: "moved".to_owned(),
        call_id: call.to_owned(),
        tool_name: "submit_report".to_owned(),
        arguments_json: "{}".to_owned(),
        arguments_valid: true,
        turn: 1,
        emitted_at_unix_ms: shared::sync::unix_ms(),
        metadata: Default::default(),
        delivery: Delivery::Pending,
        principal: String::new(),
    };
    let replaced = Ownership::local();
    replaced.stop(Stop::Fenced("taken over".to_owned()));
    let (stale_tx, mut stale_rx) = tokio::sync::oneshot::channel();
    topic.publish(
        &signal("stale_call"),
        Some(replaced),
        Box::new(move |d| {
            let _ = stale_tx.send(d);
        }),
    );
    let (tx, rx) = tokio::sync::oneshot::channel();
    topic.publish(
        &signal("owners_call"),
        Some(Ownership::local()),
        Box::new(move |d| {
            let _ = tx.send(d);
        }),
    );
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(30), rx).await??,
        Delivery::Delivered
    );
    assert_eq!(js.get_stream("STALE_SIGNALS").await?.info().await?.state.messages, 1);
    let last = js
        .get_stream("STALE_SIGNALS")
        .await?
        .get_last_raw_message_by_subject("stale.submit_report")
        .await?;
    let last: serde_json::Value = serde_json::from_slice(&last.payload)?;
    assert_eq!(last["call_id"], "owners_call");
    // Its publisher gave up unreported: the report's sender is dropped unused.
    let stale = tokio::time::timeout(Duration::from_secs(30), &mut stale_rx).await?;
    assert!(stale.is_err(), "the replaced owner's signal was reported: {stale:?}");
    Ok(())
}

/// A principal's pending approvals are found by the markers of its waits: its listing holds its
/// own waits only, however many other principals' wait (an approver's holds them all), and a
/// closed wait leaves both.
#[tokio::test]
async fn a_principals_pending_approvals_are_read_from_its_own_waits() -> TestResult {
    let nats = Nats::start().await?;
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    let store = Arc::new(replica_store(&js, "marked-runs", "a", Duration::from_secs(5)).await?);
    let approvals = NatsApprovals::open(&js, "marked-runs", Duration::from_secs(60), store)
        .await
        .map_err(anyhow::Error::msg)?;
    for (run_id, principal) in [("a1", "alice"), ("b1", "bob"), ("b2", "bob"), ("c1", "carol.x")] {
        let mut opened = wait(run_id, &["call_1"], 1);
        opened.principal = principal.to_owned();
        approvals.open(opened).await.map_err(anyhow::Error::msg)?;
    }
    let as_ = |name: &str, approver: bool| Decider {
        name: name.to_owned(),
        anonymous: false,
        approver,
        approver_required: false,
    };
    let listed = |decider: Decider| {
        let approvals = &approvals;
        async move {
            let (calls, _) = approvals.pending(&decider, None, 100).await?;
            let mut runs: Vec<String> = calls.into_iter().map(|c| c.run_id).collect();
            runs.sort();
            anyhow::Ok(runs)
        }
    };
    assert_eq!(listed(as_("alice", false)).await?, ["a1"]);
    assert_eq!(listed(as_("bob", false)).await?, ["b1", "b2"]);
    assert_eq!(listed(as_("carol.x", false)).await?, ["c1"], "a principal with a dot");
    assert_eq!(listed(as_("ann", true)).await?, ["a1", "b1", "b2", "c1"], "an approver");
    approvals.close("b1", 1).await;
    assert_eq!(listed(as_("bob", false)).await?, ["b2"]);
    assert_eq!(listed(as_("ann", true)).await?, ["a1", "b2", "c1"]);
    Ok(())
}
