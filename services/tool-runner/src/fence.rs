//! The receiver's half of the run fence (see `shared::fence`): before a durable call's tool
//! runs, the runner reads the run's fence from the orchestrators' run store and refuses a call
//! sent in an older epoch. Any check on the sender's side can be paused between the check and the
//! send; this one runs where the tool starts, against the store every runner reads, so a
//! replaced owner's call is refused whichever runner it reaches and however late.
//!
//! The store is read only. Its bucket is bound on first use (the orchestrators create it), so a
//! runner may start before them or before NATS is up; until the store answers, durable calls are
//! refused `UNAVAILABLE` unrun, which the orchestrator retries on another runner. A call of no
//! durable run (epoch 0) is never checked.

use std::time::Duration;

use async_nats::jetstream;
use tokio::sync::OnceCell;

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
    /// The fence could not be read: whether the call is stale is unknown, so it does not run.
    #[error("the run fence of {run_id} could not be read ({why}); the call was not run")]
    #[allow(missing_docs, reason = "named by the message")]
    Unreadable { run_id: String, why: String },
}

/// The fence reader of a runner given `--run-store` (see the module docs).
pub struct RunFence {
    client: async_nats::Client,
    bucket: String,
    timeout: Duration,
    kv: OnceCell<jetstream::kv::Store>,
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
        Ok(Some(Self {
            client,
            bucket: settings.bucket.clone(),
            timeout: settings.timeout,
            kv: OnceCell::new(),
        }))
    }

    /// Refuses call `call_id` of `run_id` sent in `epoch` when the run's fence stands higher, or
    /// cannot be read in time; a call of no durable run (epoch 0) passes unread.
    pub async fn admit(&self, run_id: &str, call_id: &str, epoch: u64) -> Result<(), Refusal> {
        if epoch == 0 {
            return Ok(());
        }
        let unreadable = |why: String| Refusal::Unreadable {
            run_id: run_id.to_owned(),
            why,
        };
        let current = tokio::time::timeout(self.timeout, self.current(run_id))
            .await
            .map_err(|_| unreadable(format!("no answer within {}", humantime::format_duration(self.timeout))))?
            .map_err(unreadable)?;
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

    /// The run's epoch as its fence holds it (0: never taken over).
    async fn current(&self, run_id: &str) -> Result<u64, String> {
        let kv = self
            .kv
            .get_or_try_init(|| async {
                jetstream::new(self.client.clone())
                    .get_key_value(&self.bucket)
                    .await
                    .map_err(|e| format!("binding the bucket {}: {e}", self.bucket))
            })
            .await?;
        let key = shared::fence::key(run_id);
        match kv.entry(&key).await.map_err(|e| format!("reading {key}: {e}"))? {
            Some(entry) if entry.operation == async_nats::jetstream::kv::Operation::Put => {
                shared::fence::decode(&entry.value)
            }
            _ => Ok(0),
        }
    }
}
