//! Durable runs on NATS ([`RunJournal`] of the [`KvStore`]): each live run's checkpoint is an
//! object of a JetStream object store (`<bucket>-checkpoints`, named by the run's key), next to
//! its record in the results bucket. A run whose record says its owner is gone (its incarnation
//! lapsed or is over, or the run was handed over at a drain) is an orphan, found through the
//! owner and wake indexes (`finder.rs`) and claimed by the first replica whose compare-and-set on
//! the record's revision succeeds. Records from before incarnations are found by listing the
//! checkpoint objects ([`KvStore::legacy_orphans`]).

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use prost::Message;
use shared::jetstream::{Consistency, Error, JetStream, Object, Objects};

use super::results::{
    CheckpointName, KvStore, Owned, checkpoint_of, create_record, decode_record, holder, holder_from, key, run_id_of,
};
use crate::domain::ports::{CancelAsk, Claim, Claimed, RemoteCancel, RemoteSteer, RunJournal, SteeringAsk, StoreError};
use crate::domain::steering::UserMessage;
use crate::store::unavailable;

/// The epoch whose object holds a run's start checkpoint (its record names it until its first
/// safe point saves into the object of the run's epoch).
const START: u64 = 0;

/// Records read at once while looking for orphans.
const LIST_CONCURRENCY: usize = 16;
/// Renewals of the incarnation between two writes of the store's shard count (a sharded store).
const KEEP_SHARD_COUNT_EVERY: u64 = 12;

/// A cancel asked of the replica running a run (core NATS request, `<bucket>.cancels`).
#[derive(serde::Serialize, serde::Deserialize)]
struct CancelMessage {
    run_id: String,
    reason: String,
    /// Absent from a replica that predates cancel modes: at once.
    #[serde(default)]
    mode: crate::domain::CancelMode,
}

/// A message sent to the replica running a run (core NATS request, `<bucket>.messages`).
#[derive(serde::Serialize, serde::Deserialize)]
struct SteeringMessage {
    run_id: String,
    message: UserMessage,
}

/// Sends the answer to an ask to the replica that asked.
type Answerer<A> = Box<dyn FnOnce(A) -> BoxFuture<'static, ()> + Send>;

/// Asks `question` of whichever replica answers on `subject` (the one running the run `key`
/// names): its answer, or `None` when none answered in time.
async fn ask<Q: serde::Serialize, A: serde::de::DeserializeOwned>(
    js: Arc<dyn JetStream>,
    subject: String,
    key: String,
    question: Q,
) -> Result<Option<A>, StoreError> {
    let payload = crate::domain::ports::json("a question to the run's replica", &question)?;
    let reply = match js.request(subject.clone(), payload.into()).await {
        Ok(Some(reply)) => reply,
        Ok(None) => return Ok(None),
        Err(e) => return Err(unavailable("request", &format!("{subject} {key}"), e)),
    };
    serde_json::from_slice(&reply)
        .map(Some)
        .map_err(|e| StoreError::Corrupt {
            key,
            reason: format!("the answer on {subject} is not one: {e}"),
        })
}

/// The questions asked on `subject` (`what` names them in logs), each with what answers it; a
/// question this build cannot read is left to the replicas that can.
async fn asks<Q, A>(
    js: Arc<dyn JetStream>,
    subject: String,
    what: &'static str,
) -> futures::stream::BoxStream<'static, (Q, Answerer<A>)>
where
    Q: serde::de::DeserializeOwned + Send + 'static,
    A: serde::Serialize + Send + 'static,
{
    let subscriber = match js.subscribe(subject).await {
        Ok(subscriber) => subscriber,
        Err(e) => {
            tracing::warn!("subscribing to {what} failed (they reach only the runs of the replica asked): {e}");
            return futures::stream::pending().boxed();
        }
    };
    subscriber
        .filter_map(move |message| {
            let js = Arc::clone(&js);
            async move {
                let reply = message.reply?;
                let question: Q = serde_json::from_slice(&message.payload).ok()?;
                let answer: Answerer<A> = Box::new(move |answer: A| {
                    async move {
                        let sent = match crate::domain::ports::json("an answer", &answer) {
                            Ok(bytes) => js.publish(reply, bytes.into()).await.map_err(|e| e.to_string()),
                            Err(e) => Err(e.to_string()),
                        };
                        if let Err(e) = sent {
                            tracing::warn!("answering one of the {what} failed: {e}");
                        }
                    }
                    .boxed()
                });
                Some((question, answer))
            }
        })
        .boxed()
}

impl KvStore {
    /// The orphans among records from before incarnations (they name none), found by listing
    /// every checkpoint object (checkpoints left behind are deleted on the way), and whether any
    /// such record is still held (then the next look scans again).
    pub(super) fn legacy_orphans(&self) -> BoxFuture<'static, Result<(Vec<String>, bool), StoreError>> {
        let (kv, checkpoints, seen) = (self.kv.clone(), self.checkpoints.clone(), self.seen.clone());
        async move {
            let mut objects: std::collections::BTreeMap<String, Vec<(u64, String)>> = std::collections::BTreeMap::new();
            let names = checkpoints.names().await;
            for name in names.map_err(|e| unavailable("checkpoint list", "", e))? {
                let (key, epoch) = checkpoint_of(&name);
                objects.entry(key.to_owned()).or_default().push((epoch, name.clone()));
            }
            seen.keep(&objects.keys().cloned().collect());
            // The records are read a few at a time: one round trip each, one after the other,
            // would outlast the store timeout with hundreds of runs live under load.
            let now = shared::sync::unix_ms();
            let held_legacy = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let orphans = futures::stream::iter(objects)
                .map(|(key, epochs)| {
                    let (kv, checkpoints, seen) = (kv.clone(), checkpoints.clone(), seen.clone());
                    let held_legacy = Arc::clone(&held_legacy);
                    async move {
                        let (record, revision) = holder(kv.as_ref(), &key).await.ok()??;
                        let legacy = record.incarnation.is_empty();
                        if legacy && record.held() {
                            held_legacy.store(true, std::sync::atomic::Ordering::Relaxed);
                        }
                        let lapsed = seen.lapsed_run(&key, &record, revision);
                        let delete = |name: &String| {
                            let (checkpoints, name) = (checkpoints.clone(), name.clone());
                            async move {
                                let _ = remove(checkpoints.as_ref(), &name).await;
                            }
                        };
                        let gone = !record.live() || record.marked_lost();
                        for (epoch, name) in &epochs {
                            // A checkpoint left by a run that ended, or whose replica is gone and
                            // that cannot be resumed any more; or one an owner replaced since.
                            // Not one whose replica lives: its first checkpoint is put before the
                            // record says it exists.
                            if gone || *epoch < record.checkpoint_epoch {
                                delete(name).await;
                            }
                        }
                        let result = record.result.as_ref()?;
                        (legacy && !gone && record.orphaned(now, lapsed)).then(|| result.run_id.clone())
                    }
                })
                .buffer_unordered(LIST_CONCURRENCY)
                .filter_map(std::future::ready)
                .collect()
                .await;
            Ok((orphans, held_legacy.load(std::sync::atomic::Ordering::Relaxed)))
        }
        .boxed()
    }

    /// A name for a new admission of a run on this replica, unique across replicas.
    fn new_claim(&self) -> String {
        static ADMISSIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = ADMISSIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{}/{}/{n}", self.owner, shared::sync::unix_ms())
    }

    /// Puts the checkpoint of this replica's run under `key` into the object of its epoch that
    /// its record does not name (see [`super::results::Record::checkpoint_slot`]), described by
    /// the run's admission: the object it goes to (which the record written next names), and
    /// the put.
    pub(super) fn put_checkpoint(
        &self,
        key: &str,
        checkpoint: Vec<u8>,
    ) -> (CheckpointName, impl Future<Output = Result<(), StoreError>> + use<>) {
        let (target, claim) = self.owned().get(key).map_or_else(
            || (CheckpointName::FIRST, String::new()),
            |o| (o.next_checkpoint(), o.claim.clone()),
        );
        (
            target,
            put_named(self.checkpoints.clone(), target.name(key), claim, checkpoint),
        )
    }
}

/// Puts `checkpoint` under the object `name`, its description naming the admission `claim`.
async fn put_named(
    checkpoints: Arc<dyn Objects>,
    name: String,
    claim: String,
    checkpoint: Vec<u8>,
) -> Result<(), StoreError> {
    checkpoints
        .put(&name, (!claim.is_empty()).then_some(claim), checkpoint)
        .await
        .map_err(|e| unavailable("checkpoint put", &name, e))
}

/// Removes the checkpoint object `name`.
async fn remove(checkpoints: &dyn Objects, name: &str) -> Result<(), StoreError> {
    checkpoints
        .remove(name)
        .await
        .map_err(|e| unavailable("checkpoint delete", name, e))
}

/// The checkpoint a run taken over resumes from: exactly the object its record names (never
/// another: an object the record does not name may be a replaced owner's), with its name; `None`
/// when it is gone.
async fn named_checkpoint(
    checkpoints: &dyn Objects,
    key: &str,
    record: &super::results::Record,
) -> Result<Option<Object>, StoreError> {
    let name = CheckpointName::of(record).name(key);
    checkpoints
        .get(&name)
        .await
        .map_err(|e| unavailable("checkpoint get", &name, e))
}

impl RunJournal for KvStore {
    fn save(
        &self,
        result: crate::domain::RunResult,
        deadline_unix_ms: u64,
        checkpoint: Vec<u8>,
    ) -> BoxFuture<'static, Result<(), StoreError>> {
        let key = key(&result.run_id);
        let before = match self.owned().get_mut(&key) {
            Some(owned) => {
                owned.resumable_until_unix_ms = deadline_unix_ms;
                owned.checkpoint_epoch
            }
            None => 1,
        };
        let (target, put) = self.put_checkpoint(&key, checkpoint);
        let record = target.named_by(self.record(&result, deadline_unix_ms));
        let write = self.write(key.clone(), record);
        let checkpoints = self.checkpoints.clone();
        let claiming = super::results::Claiming::of(&key, &self.owned, &self.incarnation);
        async move {
            // The checkpoint first, into the object the record does not name; then the record
            // names it, by compare-and-set: a record that says the run can be resumed always
            // has one, and a replaced owner (whose record write is then refused) never
            // overwrites the object the new owner resumes from.
            // Should it not finish (refused, unanswered, dropped at a timeout) the run stops
            // here while its record may still name this incarnation: the keeper then hands it
            // over, to be resumed from its last good checkpoint.
            put.await?;
            write.await?;
            claiming.finished();
            if before < target.epoch {
                // The previous epoch's objects are not read any more.
                for name in CheckpointName::both(&key, before) {
                    let _ = remove(checkpoints.as_ref(), &name).await;
                }
            }
            Ok(())
        }
        .boxed()
    }

    fn claim_resumable(
        &self,
        result: crate::domain::RunResult,
        deadline_unix_ms: u64,
        checkpoint: Vec<u8>,
    ) -> BoxFuture<'static, Result<Claim, StoreError>> {
        let hold = self.hold(&result.run_id);
        let key = key(&result.run_id);
        let mut record = self.record(&result, deadline_unix_ms);
        record.claim = self.new_claim();
        let (kv, checkpoints, seen) = (self.kv.clone(), self.checkpoints.clone(), self.seen.clone());
        let owned = std::sync::Arc::clone(&self.owned);
        let enter = self.index.enter(&result);
        async move {
            record.incarnation = hold.await?;
            // An id taken already is answered without putting anything under its key: the run
            // holding it (live, or parked for hours) keeps its checkpoint. Read from the leader:
            // a follower that lacks a claim whose answer was lost would let this admission's
            // start object replace the claimed run's, which then could never be resumed.
            if let Some((taken, revision)) = holder_from(kv.as_ref(), &key, Consistency::Leader).await? {
                if !taken.never_started(seen.owner_lapsed(kv.as_ref(), &key, &taken, revision).await?) {
                    return Ok(Claim::Taken(Box::new(taken.read(&key)?)));
                }
                record.epoch = taken.epoch.saturating_add(1);
            } else {
                record.epoch = 1;
            }
            // Entered before it is claimed: a claimed run is always found (an entry whose claim
            // then loses is skipped by the listing: the record is another admission's).
            enter.await?;
            // The start checkpoint first, so a record that says the run can be resumed always
            // has one. It goes to the start object (epoch 0), never to the object of the run's
            // epoch, which its safe points write: a duplicate admission of the id that loses the
            // race for the record may have its put land late, and it then overwrites only a start
            // object the winner no longer reads once it saved.
            let name = CheckpointName { epoch: START, slot: 0 }.name(&key);
            put_named(checkpoints, name, record.claim.clone(), checkpoint).await?;
            record.checkpoint_epoch = START;
            create_record(kv, owned, seen, key, record).await
        }
        .boxed()
    }

    fn keeps_segments(&self) -> bool {
        true
    }

    fn keep_segment(&self, run_id: &str, segment: Vec<u8>) -> BoxFuture<'static, Result<Option<u64>, StoreError>> {
        self.segments.keep(&key(run_id), segment)
    }

    fn segments(&self, run_id: &str, positions: Vec<u64>) -> BoxFuture<'static, Result<Vec<Vec<u8>>, StoreError>> {
        self.segments.read(&key(run_id), positions)
    }

    fn forget(&self, run_id: &str) -> BoxFuture<'static, Result<(), StoreError>> {
        let (kv, checkpoints, key) = (self.kv.clone(), self.checkpoints.clone(), key(run_id));
        self.owned().remove(&key);
        let segments = self.segments.forget(&key);
        async move {
            segments.await?;
            let mut epochs = match holder(kv.as_ref(), &key).await? {
                Some((record, _)) => vec![0, record.checkpoint_epoch, record.epoch],
                None => vec![0],
            };
            epochs.sort_unstable();
            epochs.dedup();
            for name in epochs.into_iter().flat_map(|epoch| CheckpointName::both(&key, epoch)) {
                remove(checkpoints.as_ref(), &name).await?;
            }
            Ok(())
        }
        .boxed()
    }

    fn orphans(&self) -> BoxFuture<'static, Result<Vec<String>, StoreError>> {
        let look = super::finder::Look {
            kv: self.kv.clone(),
            seen: self.seen.clone(),
            finder: Arc::clone(&self.finder),
        };
        let legacy = self.legacy_orphans();
        async move { look.find_orphans(legacy).await }.boxed()
    }

    fn take_over(&self, run_id: &str) -> BoxFuture<'static, Result<Option<Claimed>, StoreError>> {
        let hold = self.hold(run_id);
        let (kv, checkpoints, key) = (self.kv.clone(), self.checkpoints.clone(), key(run_id));
        let (owned, owner, seen) = (
            std::sync::Arc::clone(&self.owned),
            self.owner.clone(),
            self.seen.clone(),
        );
        let lease_ms = u64::try_from(self.lease.as_millis()).unwrap_or(u64::MAX);
        let claiming = super::results::Claiming::of(&key, &self.owned, &self.incarnation);
        let taking = async move {
            let Some((record, read_revision)) = holder(kv.as_ref(), &key).await? else {
                return Ok(None);
            };
            let lapsed = seen.owner_lapsed(kv.as_ref(), &key, &record, read_revision).await?;
            if !record.orphaned(shared::sync::unix_ms(), lapsed) {
                return Ok(None);
            }
            // Entered under this replica's incarnation before its record names it.
            let incarnation = hold.await?;
            super::owners::enter_owner(kv.as_ref(), &incarnation, &key, record.epoch.saturating_add(1)).await?;
            // The fence first: once the record is this replica's its calls may go out, and by
            // then every runner refuses the replaced owner's (a raise is never undone; should the
            // claim below lose, the winner holds the same epoch).
            super::fence::raise(kv.as_ref(), &key, record.epoch.saturating_add(1)).await?;
            // A parked run (or one taken over from the approval store that was waiting for a slot) keeps
            // reading parked, holding no slot, until its new owner, holding one again, writes it
            // running.
            let parked = record.result.as_ref().is_some_and(|r| {
                [
                    proto::orchestrator::v1::RunStatus::AwaitingApproval as i32,
                    proto::orchestrator::v1::RunStatus::AwaitingInput as i32,
                    proto::orchestrator::v1::RunStatus::AwaitingTask as i32,
                ]
                .contains(&r.status)
            });
            // What pointed the run out is not needed any more (left behind, it is removed when read).
            let (previous, wake) = (
                super::owners::owner_key(&record.incarnation, &key),
                super::owners::wake_key(record.wake_at_unix_ms, &key),
            );
            let was_held = record.held() && !record.incarnation.is_empty() && record.incarnation != incarnation;
            let was_parked = record.parked;
            // The record as read, now this replica's in the next epoch with a fresh lease.
            let claimed = super::results::Record {
                owner,
                incarnation,
                lease_expires_unix_ms: shared::sync::unix_ms().saturating_add(lease_ms),
                handed_over: false,
                parked: false,
                ready: false,
                wake_at_unix_ms: 0,
                epoch: record.epoch.saturating_add(1),
                ..record
            };
            let revision = match kv.update(&key, claimed.encode_to_vec().into(), read_revision).await {
                Ok(revision) => revision,
                Err(Error::WrongRevision) => return Ok(None),
                Err(e) => return Err(unavailable("KV update", &key, e)),
            };
            shared::sync::lock(&owned).insert(key.clone(), Owned::of(revision, &claimed));
            if was_held {
                super::owners::leave(kv.as_ref(), &previous).await;
            }
            if was_parked {
                super::owners::leave(kv.as_ref(), &wake).await;
            }
            let named = named_checkpoint(checkpoints.as_ref(), &key, &claimed).await?;
            let admission = named.as_ref().map(|o| o.description.clone().unwrap_or_default());
            let Some(object) = named.filter(|_| admission.as_deref() == Some(claimed.claim.as_str())) else {
                // The checkpoint its record names is gone, or is another admission's (a duplicate
                // that lost the race for the id): this run cannot be resumed, and reads as lost
                // at once.
                tracing::warn!(run_id = %run_id_of(&key), found = admission.is_some(), "the run's record names no checkpoint of its admission; the run is lost");
                shared::sync::lock(&owned).remove(&key);
                let lost = super::results::Record {
                    resumable_until_unix_ms: 0,
                    lease_expires_unix_ms: 0,
                    ..claimed
                };
                kv.update(&key, lost.encode_to_vec().into(), revision)
                    .await
                    .map_err(|e| unavailable("KV update", &key, e))?;
                return Ok(None);
            };
            Ok(Some(Claimed {
                checkpoint: object.bytes,
                parked,
                ends_after_turn: Some(claimed.ends_after_turn).filter(|why| !why.is_empty()),
            }))
        };
        async move {
            // Should the claim not finish (its answer lost, the checkpoint not read, dropped at a
            // timeout) the run does not start here, and the keeper hands it over if its record
            // names this incarnation.
            let taken = taking.await;
            if taken.is_ok() {
                claiming.finished();
            }
            taken
        }
        .boxed()
    }

    fn hand_overs(&self) -> BoxFuture<'static, futures::stream::BoxStream<'static, ()>> {
        let (js, subject) = (Arc::clone(&self.js), self.hand_over_subject.clone());
        async move {
            match js.subscribe(subject).await {
                Ok(subscriber) => subscriber.map(|_| ()).boxed(),
                Err(e) => {
                    tracing::warn!(
                        "subscribing to hand-overs failed (the takeover looks every third of the lease): {e}"
                    );
                    futures::stream::pending().boxed()
                }
            }
        }
        .boxed()
    }

    fn cancel_elsewhere(
        &self,
        run_id: &str,
        reason: &str,
        mode: crate::domain::CancelMode,
    ) -> BoxFuture<'static, Result<Option<RemoteCancel>, StoreError>> {
        let message = CancelMessage {
            run_id: run_id.to_owned(),
            reason: reason.to_owned(),
            mode,
        };
        ask(Arc::clone(&self.js), self.cancel_subject.clone(), key(run_id), message).boxed()
    }

    fn cancel_asks(&self) -> BoxFuture<'static, futures::stream::BoxStream<'static, CancelAsk>> {
        let asked = asks::<CancelMessage, RemoteCancel>(Arc::clone(&self.js), self.cancel_subject.clone(), "cancels");
        async move {
            asked
                .await
                .map(|(CancelMessage { run_id, reason, mode }, answer)| CancelAsk {
                    run_id,
                    reason,
                    mode,
                    answer,
                })
                .boxed()
        }
        .boxed()
    }

    fn steer_elsewhere(
        &self,
        run_id: &str,
        message: UserMessage,
    ) -> BoxFuture<'static, Result<Option<RemoteSteer>, StoreError>> {
        let message = SteeringMessage {
            run_id: run_id.to_owned(),
            message,
        };
        ask(
            Arc::clone(&self.js),
            self.steering_subject.clone(),
            key(run_id),
            message,
        )
        .boxed()
    }

    fn steering_asks(&self) -> BoxFuture<'static, futures::stream::BoxStream<'static, SteeringAsk>> {
        let asked =
            asks::<SteeringMessage, RemoteSteer>(Arc::clone(&self.js), self.steering_subject.clone(), "messages");
        async move {
            asked
                .await
                .map(|(SteeringMessage { run_id, message }, answer)| SteeringAsk {
                    run_id,
                    message,
                    answer,
                })
                .boxed()
        }
        .boxed()
    }

    fn keep_alive(&self) -> BoxFuture<'static, ()> {
        let (kv, incarnation, owned) = (self.kv.clone(), Arc::clone(&self.incarnation), Arc::clone(&self.owned));
        let (js, subject) = (Arc::clone(&self.js), self.hand_over_subject.clone());
        let (every, acting) = (self.lease / 3, self.lease.saturating_sub(self.margin));
        let shards = self.shards;
        async move {
            for renewal in 1_u64.. {
                tokio::time::sleep(every).await;
                incarnation.renew(kv.as_ref(), acting).await;
                if shards > 1 && renewal % KEEP_SHARD_COUNT_EVERY == 0 {
                    // Written again now and then, so it never ages out while the store has runs.
                    if let Err(e) = shared::jetstream::shards::keep(kv.as_ref(), shards).await {
                        tracing::warn!("writing the run store's shard count again failed: {e}");
                    }
                }
                let held = |key: &str| shared::sync::lock(&owned).contains_key(key);
                for key in hand_over_abandoned(kv.as_ref(), &incarnation, held).await {
                    let _ = js.publish(subject.clone(), key.into_bytes().into()).await;
                }
            }
        }
        .boxed()
    }

    fn retire(&self) -> BoxFuture<'static, ()> {
        let (kv, incarnation) = (self.kv.clone(), Arc::clone(&self.incarnation));
        async move { incarnation.retire(kv.as_ref()).await }.boxed()
    }

    fn hand_over(&self, run_id: &str) -> BoxFuture<'static, Result<(), StoreError>> {
        let (kv, key) = (self.kv.clone(), key(run_id));
        let (js, subject) = (Arc::clone(&self.js), self.hand_over_subject.clone());
        let last = self.owned().remove(&key);
        let claiming = super::results::Claiming::of(&key, &self.owned, &self.incarnation);
        async move {
            let Some(last) = last else {
                claiming.finished();
                return Ok(());
            };
            // Should it not finish, its record may still name this incarnation: the keeper
            // hands it over.
            hand_over_owned(kv.as_ref(), &key, &last).await?;
            claiming.finished();
            let _ = js.publish(subject, key.into_bytes().into()).await;
            Ok(())
        }
        .boxed()
    }
}

/// Marks the run under `key`, which this replica wrote `last`, handed over: entered in the wake
/// index under this minute first (the next look finds it), then its record by compare-and-set.
async fn hand_over_owned(kv: &dyn shared::jetstream::Bucket, key: &str, last: &Owned) -> Result<(), StoreError> {
    // From the leader: the update below is compared against the revision this replica
    // wrote last, so a follower's older record (naming an older checkpoint) would be
    // written back over the newest one, and the next owner would find that checkpoint gone.
    let entry = kv.entry(key, Consistency::Leader).await;
    let entry = entry.map_err(|e| unavailable("KV get", key, e))?;
    let Some(entry) = entry else { return Ok(()) };
    let mut record = decode_record(key, &entry.value)?;
    // Written since by this replica's own write whose answer was lost (same incarnation, claim
    // and epoch) it is still this replica's; written by another, or gone, it is not.
    let own = record.incarnation == last.incarnation && record.claim == last.claim && record.epoch == last.epoch;
    if entry.revision != last.revision && !(own && record.held()) {
        return Ok(());
    }
    record.handed_over = true;
    record.lease_expires_unix_ms = shared::sync::unix_ms();
    super::owners::enter(kv, &super::owners::wake_key(record.lease_expires_unix_ms, key)).await?;
    kv.update(key, record.encode_to_vec().into(), entry.revision)
        .await
        .map_err(|e| unavailable("KV update", key, e))?;
    super::owners::leave(kv, &super::owners::owner_key(&last.incarnation, key)).await;
    Ok(())
}

/// Hands over every run abandoned under `incarnation` whose record still names one of its
/// process's incarnations (and that no run here holds, as `held` says): the keys handed over;
/// those the store did not answer for are tried again next time.
async fn hand_over_abandoned(
    kv: &dyn shared::jetstream::Bucket,
    incarnation: &super::incarnation::Incarnation,
    held: impl Fn(&str) -> bool,
) -> Vec<String> {
    let mut handed = Vec::new();
    for key in incarnation.take_abandoned() {
        if held(&key) {
            continue;
        }
        match hand_over_abandoned_one(kv, incarnation, &key).await {
            Ok(true) => handed.push(key),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(key = %key, "handing over a run no longer run here failed (tried again): {e}");
                incarnation.abandon(&key);
            }
        }
    }
    handed
}

/// Marks the run under `key` handed over if its record names one of `incarnation`'s process's
/// incarnations and is still held; whether it did.
async fn hand_over_abandoned_one(
    kv: &dyn shared::jetstream::Bucket,
    incarnation: &super::incarnation::Incarnation,
    key: &str,
) -> Result<bool, StoreError> {
    let Some((mut record, revision)) = holder_from(kv, key, Consistency::Leader).await? else {
        return Ok(false);
    };
    if !record.held() || record.handed_over || !incarnation.is_mine(&record.incarnation) {
        return Ok(false);
    }
    record.handed_over = true;
    record.lease_expires_unix_ms = shared::sync::unix_ms();
    super::owners::enter(kv, &super::owners::wake_key(record.lease_expires_unix_ms, key)).await?;
    match kv.update(key, record.encode_to_vec().into(), revision).await {
        Ok(_) => Ok(true),
        Err(Error::WrongRevision) => Ok(false),
        Err(e) => Err(unavailable("KV update", key, e)),
    }
}
