//! The receiver's half of the run fence (see `shared::fence`): before a durable call's tool
//! runs, the runner reads the run's fence from the orchestrators' run store and refuses a call
//! sent in an older epoch. Any check on the sender's side can be paused between the check and the
//! send; this one runs where the tool starts, against the store every runner reads, so a
//! replaced owner's call is refused whichever runner it reaches and however late.
//!
//! Every read goes to the stream's leader (never a direct read a lagging follower may answer):
//! the run's epoch is the higher of its fence key and the epoch its record carries (the fence key
//! is written at takeovers only and expires with the bucket's age; the record lives as long as the
//! run). A durable call of a run neither holds is refused, and so is a call that carries no epoch
//! for a run whose record shows it durable; while the store cannot be read such a call runs (a
//! durable run's owner never sends epoch 0).
//!
//! The fence only reads the store (the call records, `crate::record`, write their own keys). Its
//! bucket is bound on first use (the orchestrators create it), so a runner may start before them
//! or before NATS is up; until the store answers, durable calls are
//! refused `UNAVAILABLE` unrun, which the orchestrator retries on another runner. Binding, the
//! runner checks its read timeout against the orchestrators' fence grace kept in the bucket: a
//! timeout that does not end within the grace refuses every durable call, naming both settings.
//! A store spread over shards (`--run-store-shards` of the orchestrators) records how many in its
//! first bucket: the runner binds them all and reads each run's keys in its run's shard. A store
//! that records no count (one shard, or one whose first orchestrator has not written it yet when
//! the runner binds) is bound as one shard, and bound again when a run is not found in it.

use std::time::Duration;

use std::sync::Arc;

use shared::jetstream::{Bucket, Consistency, JetStream, Operation, shards};

use crate::Error;
use crate::config::FenceSettings;

/// Why a call may not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The run is in a newer epoch: the call comes from a replaced owner.
    #[error(
        "call {call_id} of run {run_id} was sent in epoch {epoch}, and the run is in epoch {current}: another orchestrator replica took it over, so it is not run"
    )]
    #[allow(missing_docs, reason = "named by the message")]
    Stale {
        run_id: String,
        call_id: String,
        epoch: u64,
        current: u64,
    },
    /// The call carries no epoch, yet the store shows its run durable: its sender lost track of
    /// its claim, so it is not run.
    #[error(
        "call {call_id} of run {run_id} carries no epoch, yet the run is durable (in epoch {current}): a durable run's calls are fenced, so it is not run"
    )]
    #[allow(missing_docs, reason = "named by the message")]
    NoEpoch {
        run_id: String,
        call_id: String,
        current: u64,
    },
    /// The store holds neither a fence nor a record of the run: whether the call is stale is
    /// unknown (its record expired, or the run was never claimed in this store), so it does not
    /// run.
    #[error(
        "the run store holds no run {run_id} (its record expired, or it was claimed in another store); durable call {call_id} was not run"
    )]
    #[allow(missing_docs, reason = "named by the message")]
    Unknown { run_id: String, call_id: String },
    /// The fence could not be read: whether the call is stale is unknown, so it does not run.
    #[error("the run fence of {run_id} could not be read ({why}); the call was not run")]
    #[allow(missing_docs, reason = "named by the message")]
    Unreadable { run_id: String, why: String },
}

/// The fence reader of a runner given `--run-store` (see the module docs).
pub struct RunFence {
    js: Arc<dyn JetStream>,
    bucket: String,
    timeout: Duration,
    /// The bound bucket, or why it cannot be used (bound on first use).
    bound: tokio::sync::RwLock<Option<Result<Bound, String>>>,
}

/// The bucket as bound.
struct Bound {
    bucket: Arc<dyn Bucket>,
    /// The store recorded its shard count when bound (with none, a run not found may live in a
    /// shard the count written since names).
    counted: bool,
}

/// What the run store holds of a run: its fence and its record's epoch, each if there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Standing {
    fence: Option<u64>,
    record: Option<u64>,
}

impl Standing {
    /// The run's epoch: the higher of the two (`None`: the store holds neither).
    fn epoch(self) -> Option<u64> {
        self.fence.max(self.record)
    }
}

impl RunFence {
    /// Connects to the run store `settings` names, if it names one. The connection is made in
    /// the background (retried while NATS is down); a bad credentials file fails here.
    pub async fn connect(settings: &FenceSettings) -> Result<Option<Self>, Error> {
        let Some(url) = settings.store()? else {
            return Ok(None);
        };
        let access = shared::nats::Access {
            tls_required: settings.tls_required,
            credentials: settings.credentials.as_deref(),
            ca_file: settings.ca_file.as_deref(),
        };
        let options = shared::nats::options(&url, "tool-runner", access)
            .await
            .map_err(Error::Config)?
            .retry_on_initial_connect()
            .connection_timeout(settings.timeout);
        let client = options
            .connect(url.seeds())
            .await
            .map_err(|e| Error::Config(format!("--run-store {url}: {e}")))?;
        tracing::info!(run_store = %url, bucket = %settings.bucket, "durable calls are checked against the run fence");
        Ok(Some(Self::over(
            shared::jetstream::nats::context(client, None).handle(),
            &settings.bucket,
            settings.timeout,
        )))
    }

    /// The fence of the runs in bucket `bucket` of `js`, each read within `timeout`.
    pub fn over(js: Arc<dyn JetStream>, bucket: &str, timeout: Duration) -> Self {
        Self {
            js,
            bucket: bucket.to_owned(),
            timeout,
            bound: tokio::sync::RwLock::new(None),
        }
    }

    /// Refuses call `call_id` of `run_id` sent in `epoch` when the run stands in a higher epoch,
    /// when the store holds no run of that id, or when the store cannot be read in time; a call
    /// with no epoch is refused only when the store shows its run durable.
    pub async fn admit(&self, run_id: &str, call_id: &str, epoch: u64) -> Result<(), Refusal> {
        // A call with no epoch needs only the record (is its run durable?): one read, not two.
        let read = self.read_in_time(run_id, epoch > 0).await;
        if epoch == 0 {
            return match read {
                Ok(Standing {
                    record: Some(current), ..
                }) if current > 0 => Err(Refusal::NoEpoch {
                    run_id: run_id.to_owned(),
                    call_id: call_id.to_owned(),
                    current,
                }),
                _ => Ok(()),
            };
        }
        let read = match read {
            // Bound before the store recorded its shards: read again in the run's shard.
            Ok(standing) if standing.epoch().is_none() && self.rebound().await => self.read_in_time(run_id, true).await,
            other => other,
        };
        let Some(current) = read?.epoch() else {
            return Err(Refusal::Unknown {
                run_id: run_id.to_owned(),
                call_id: call_id.to_owned(),
            });
        };
        if shared::fence::stale(epoch, current) {
            return Err(Refusal::Stale {
                run_id: run_id.to_owned(),
                call_id: call_id.to_owned(),
                epoch,
                current,
            });
        }
        Ok(())
    }

    /// [`RunFence::standing`] within the read timeout; a read that fails or takes longer is
    /// unreadable.
    async fn read_in_time(&self, run_id: &str, with_fence: bool) -> Result<Standing, Refusal> {
        let unreadable = |why: String| Refusal::Unreadable {
            run_id: run_id.to_owned(),
            why,
        };
        tokio::time::timeout(self.timeout, self.standing(run_id, with_fence))
            .await
            .map_err(|_| unreadable(format!("no answer within {}", humantime::format_duration(self.timeout))))
            .and_then(|read| read.map_err(unreadable))
    }

    /// The run's record (and its fence, `with_fence`) as the stream's leader holds them now.
    async fn standing(&self, run_id: &str, with_fence: bool) -> Result<Standing, String> {
        let bucket = self.bucket().await?;
        let (fence_key, record_key) = (shared::fence::key(run_id), shared::fence::record_key(run_id));
        let fence = async {
            match with_fence {
                true => last(bucket.as_ref(), &fence_key).await,
                false => Ok(None),
            }
        };
        let (fence, record) = tokio::join!(fence, last(bucket.as_ref(), &record_key));
        Ok(Standing {
            fence: fence?.map(|v| shared::fence::decode(&v)).transpose()?,
            record: record?.map(|v| shared::fence::record_epoch(&v)).transpose()?,
        })
    }

    /// The bucket, bound on first use with its grace checked against the read timeout.
    pub(crate) async fn bucket(&self) -> Result<Arc<dyn Bucket>, String> {
        if let Some(bound) = self.bound.read().await.as_ref() {
            return bound.as_ref().map(|b| Arc::clone(&b.bucket)).map_err(Clone::clone);
        }
        let mut slot = self.bound.write().await;
        // A store that cannot be bound yet is tried again at the next call; a grace the read
        // timeout does not fit is kept.
        let bound = match slot.take() {
            Some(bound) => bound,
            None => self.bind().await?,
        };
        let bucket = bound.as_ref().map(|b| Arc::clone(&b.bucket)).map_err(Clone::clone);
        *slot = Some(bound);
        bucket
    }

    /// Binds the bucket again when it was bound before the store recorded a shard count and one
    /// is recorded now; whether it did.
    async fn rebound(&self) -> bool {
        let mut slot = self.bound.write().await;
        let uncounted = matches!(slot.as_ref(), Some(Ok(bound)) if !bound.counted);
        if !uncounted {
            return false;
        }
        match self.bind().await {
            Ok(Ok(bound)) if bound.counted => {
                tracing::info!(bucket = %self.bucket, "the run store recorded its shards since it was bound: bound again");
                *slot = Some(Ok(bound));
                true
            }
            _ => false,
        }
    }

    /// The bucket over its shards (`Err`: it cannot be bound now), its grace checked against the
    /// read timeout (the inner `Err`: it does not fit).
    async fn bind(&self) -> Result<Result<Bound, String>, String> {
        let bound = self.bind_shards().await?;
        let grace = match last(bound.bucket.as_ref(), shared::fence::GRACE_KEY).await? {
            Some(grace) => grace_of(&grace)?,
            None => shared::fence::DEFAULT_GRACE,
        };
        let checked = shared::fence::check_grace(self.timeout, grace);
        if let Err(e) = &checked {
            tracing::error!("{e}");
        }
        Ok(checked.map(|()| bound))
    }

    /// The bucket over all its shards: as many as the orchestrators recorded in the first.
    async fn bind_shards(&self) -> Result<Bound, String> {
        let bind = |name: String| async move {
            self.js
                .bind_bucket(&name)
                .await
                .map_err(|e| format!("binding the bucket {name}: {e}"))
        };
        let home = bind(self.bucket.clone()).await?;
        let recorded = shards::recorded(home.as_ref())
            .await
            .map_err(|e| format!("reading the shard count of {}: {e}", self.bucket))?;
        let mut buckets = vec![home];
        for shard in 1..recorded.unwrap_or(1) {
            buckets.push(bind(shards::name(&self.bucket, shard)).await?);
        }
        Ok(Bound {
            bucket: shards::ShardedBucket::over(buckets),
            counted: recorded.is_some(),
        })
    }
}

/// The value under `key`, read from the bucket's leader (a delete marker reads as none).
async fn last(bucket: &dyn Bucket, key: &str) -> Result<Option<bytes::Bytes>, String> {
    match bucket.entry(key, Consistency::Leader).await {
        Ok(entry) => Ok(entry.filter(|e| e.operation == Operation::Put).map(|e| e.value)),
        Err(e) => Err(format!("reading {key}: {e}")),
    }
}

fn grace_of(value: &[u8]) -> Result<Duration, String> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|ms| ms.trim().parse().ok())
        .map(Duration::from_millis)
        .ok_or_else(|| {
            format!(
                "the orchestrators' fence grace reads {:?}, not milliseconds",
                String::from_utf8_lossy(value)
            )
        })
}
