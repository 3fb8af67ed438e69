//! Webhooks: callers register where to be told that their runs started, wait for a person or
//! finished ([`Webhooks::register`]), and every replica delivers what its runs' emitters notice
//! ([`Webhooks::notice`]) at least once, from a durable outbox: the record of a delivery is
//! written before it is tried, tried at once, retried with a doubling backoff by whichever
//! replica's sweep finds it due (one that died holding it included), and kept with its attempts
//! and last status for `ListWebhookDeliveries`.
//!
//! * `outbox.rs`: the delivery records in a key-value bucket, held by one replica at a time;
//! * `send.rs`: one attempt — the signed POST, under the egress rules of `http_get`;
//! * `happenings.rs`: which events of a run's stream webhooks are told of.
//!
//! The registrations and the outbox are two key-value buckets: NATS's with the NATS store (they
//! outlive the replica), this process's otherwise (`store::memory::MemoryBucket`).

mod happenings;
mod outbox;
mod send;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt as _;
use futures::future::BoxFuture;
use shared::jetstream::Bucket;
use tokio_util::sync::CancellationToken;

pub(crate) use self::outbox::Narrowing;
use self::outbox::Outbox;
use self::send::{Post, Sender};
use crate::Error;
use crate::config::WebhookSettings;
use crate::domain::ports::Notices;
use crate::domain::webhook::{self, DeliveryState, Format, Happening, Scope, Topic, Webhook, WebhookDelivery};
use crate::domain::{NumberedEvent, RunResult};
use crate::store::nats::kv::token;
use crate::store::unavailable;

/// Where webhooks are kept.
pub struct Buckets {
    /// The registrations.
    pub registrations: Arc<dyn Bucket>,
    /// The outbox and the records of deliveries.
    pub outbox: Arc<dyn Bucket>,
}

impl Buckets {
    /// Buckets in this process: at most 100 times `--max-webhooks` registrations and 100 times
    /// `--webhook-max-pending` deliveries (waiting or recorded), lost on restart.
    pub fn in_memory(settings: &WebhookSettings) -> Self {
        use crate::store::memory::MemoryBucket;
        Self {
            registrations: Arc::new(MemoryBucket::new(settings.max_webhooks * 100, Duration::ZERO)),
            outbox: Arc::new(MemoryBucket::new(
                settings.webhook_max_pending * 100,
                settings.webhook_keep,
            )),
        }
    }
}

/// What a caller registers.
#[derive(Debug, Clone)]
pub(crate) struct Registration {
    pub url: String,
    pub scope: Scope,
    pub topics: Vec<Topic>,
    /// The caller's own secret (`whsec_…`); one is made when `None`.
    pub secret: Option<String>,
    pub format: Format,
    /// Headers sent with every delivery.
    pub headers: std::collections::BTreeMap<String, String>,
}

/// See the module docs.
pub(crate) struct Webhooks {
    registrations: Arc<dyn Bucket>,
    outbox: Outbox,
    sender: Sender,
    settings: WebhookSettings,
    /// Attempts under way here, at most `--webhook-max-in-flight`.
    in_flight: Arc<tokio::sync::Semaphore>,
    /// Longest wait for one read or write of the buckets.
    store_timeout: Duration,
}

impl Notices for Arc<Webhooks> {
    /// Cheap when the batch holds nothing webhooks are told of; else done once the deliveries
    /// are written, within four store timeouts.
    fn notice(&self, run: &std::sync::Mutex<RunResult>, batch: &[NumberedEvent]) -> BoxFuture<'static, ()> {
        let happenings = happenings::happenings(run, batch);
        if happenings.is_empty() {
            return futures::future::ready(()).boxed();
        }
        let (this, bound) = (Arc::clone(self), self.store_timeout * 4);
        async move {
            if tokio::time::timeout(bound, this.deliver(happenings)).await.is_err() {
                tracing::warn!("writing webhook deliveries took too long; some may not be delivered");
            }
        }
        .boxed()
    }
}

/// Most deliveries one listing returns.
pub(crate) const MAX_LISTED: usize = 500;

fn registration_key(principal: &str, id: &str) -> String {
    format!("w.{}.{id}", token(principal))
}

/// 12 random bytes in hex, after `prefix`.
fn random_id(prefix: &str) -> Result<String, Error> {
    let mut bytes = [0u8; 12];
    aws_lc_rs::rand::fill(&mut bytes).map_err(|_| Error::Dependency("the system gave no randomness".into()))?;
    Ok(format!(
        "{prefix}{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    ))
}

impl Webhooks {
    /// Webhooks kept in `buckets`.
    pub(crate) fn new(buckets: Buckets, settings: WebhookSettings, store_timeout: Duration) -> Self {
        Self {
            registrations: buckets.registrations,
            outbox: Outbox::new(buckets.outbox),
            sender: Sender::new(&settings),
            in_flight: Arc::new(tokio::sync::Semaphore::new(settings.webhook_max_in_flight)),
            settings,
            store_timeout,
        }
    }

    /// Waits at most the store's timeout for `step`.
    async fn within<T>(
        &self,
        what: &'static str,
        step: impl Future<Output = Result<T, crate::domain::ports::StoreError>>,
    ) -> Result<T, Error> {
        match tokio::time::timeout(self.store_timeout, step).await {
            Ok(result) => result.map_err(Error::Store),
            Err(_) => Err(Error::Store(unavailable(what, "webhooks", "no answer in time"))),
        }
    }

    /// Registers `registration` for `principal`: the webhook, with its secret (shown this once).
    pub(crate) async fn register(&self, principal: &str, registration: Registration) -> Result<Webhook, Error> {
        if let Some(why) = self.sender.refusal(&registration.url) {
            return Err(Error::PermissionDenied(format!("webhook URL refused: {why}")));
        }
        if let Some(why) = webhook::headers_refusal(&registration.headers) {
            return Err(Error::InvalidArgument(why));
        }
        if registration.format == Format::A2a && !matches!(registration.scope, Scope::Run(_)) {
            return Err(Error::InvalidArgument(
                "an A2A webhook is told of one task: name its run_id".into(),
            ));
        }
        let secret = match registration.secret {
            Some(secret) => {
                webhook::check_secret(&secret).map_err(|e| Error::InvalidArgument(e.to_string()))?;
                secret
            }
            None => {
                let mut random = [0u8; 32];
                aws_lc_rs::rand::fill(&mut random)
                    .map_err(|_| Error::Dependency("the system gave no randomness".into()))?;
                webhook::new_secret(random)
            }
        };
        if self.registered(principal).await?.len() >= self.settings.max_webhooks {
            return Err(Error::TooManyWebhooks {
                principal: principal.to_owned(),
                max: self.settings.max_webhooks,
            });
        }
        let mut topics = registration.topics;
        topics.sort();
        topics.dedup();
        let hook = Webhook {
            id: random_id("wh_")?,
            principal: principal.to_owned(),
            scope: registration.scope,
            url: registration.url,
            topics,
            secret,
            created_unix_ms: shared::sync::unix_ms(),
            format: registration.format,
            headers: registration.headers,
        };
        let key = registration_key(principal, &hook.id);
        let value = serde_json::to_vec(&hook).unwrap_or_default().into();
        self.within("KV create", async {
            self.registrations
                .create(&key, value)
                .await
                .map_err(|e| unavailable("KV create", &key, e))
        })
        .await?;
        tracing::info!(webhook = %hook.id, principal, url = %hook.url, "webhook registered");
        Ok(hook)
    }

    /// The keys of `principal`'s webhooks: what counting them needs, without reading each.
    async fn registered(&self, principal: &str) -> Result<Vec<String>, Error> {
        let filter = format!("w.{}.*", token(principal));
        self.within("KV keys", async {
            self.registrations
                .keys(&filter)
                .await
                .map_err(|e| unavailable("KV keys", &filter, e))
        })
        .await
    }

    /// `principal`'s webhooks, oldest first.
    pub(crate) async fn list(&self, principal: &str) -> Result<Vec<Webhook>, Error> {
        let keys = self.registered(principal).await?;
        let mut hooks = Vec::with_capacity(keys.len());
        for key in keys {
            if let Some(hook) = self.read(&key).await? {
                hooks.push(hook);
            }
        }
        hooks.sort_by(|a, b| a.created_unix_ms.cmp(&b.created_unix_ms).then_with(|| a.id.cmp(&b.id)));
        Ok(hooks)
    }

    /// The webhook under `key`, if it is there.
    async fn read(&self, key: &str) -> Result<Option<Webhook>, Error> {
        let value = self
            .within("KV get", async {
                self.registrations
                    .get(key)
                    .await
                    .map_err(|e| unavailable("KV get", key, e))
            })
            .await?;
        let Some(value) = value else { return Ok(None) };
        let hook = serde_json::from_slice(&value).map_err(|e| unavailable("decode a webhook", key, e))?;
        Ok(Some(hook))
    }

    /// Deletes `principal`'s webhook `id` (its waiting deliveries are then canceled):
    /// `NOT_FOUND` when it has none by that id.
    pub(crate) async fn remove(&self, principal: &str, id: &str) -> Result<(), Error> {
        let key = registration_key(principal, id);
        if self.read(&key).await?.is_none() {
            return Err(Error::NotFound(format!("no webhook {id:?} of yours")));
        }
        self.within("KV delete", async {
            self.registrations
                .delete(&key, None)
                .await
                .map_err(|e| unavailable("KV delete", &key, e))
        })
        .await?;
        tracing::info!(webhook = %id, principal, "webhook deleted");
        Ok(())
    }

    /// `principal`'s deliveries `narrowing` names, newest first, at most `limit`.
    pub(crate) async fn deliveries(
        &self,
        principal: &str,
        narrowing: &Narrowing,
        limit: usize,
    ) -> Result<Vec<WebhookDelivery>, Error> {
        let max_read = self.settings.webhook_max_listed;
        let limit = limit.clamp(1, MAX_LISTED);
        self.within(
            "list deliveries",
            self.outbox.list(principal, narrowing, limit, max_read),
        )
        .await
    }

    /// Writes the deliveries of `happenings` (all of one run) to the outbox, and tries each at
    /// once.
    async fn deliver(self: &Arc<Self>, happenings: Vec<Happening>) {
        let Some(first) = happenings.first() else { return };
        let hooks = match self.list(&first.principal).await {
            Ok(hooks) => hooks,
            Err(e) => {
                tracing::warn!(run_id = %first.run_id, error = %e, "cannot read the webhooks; the run's happenings are not delivered");
                return;
            }
        };
        for happening in &happenings {
            for hook in hooks.iter().filter(|h| h.reaches(happening)) {
                if let Err(e) = self.enqueue(hook, happening).await {
                    tracing::warn!(run_id = %happening.run_id, webhook = %hook.id, error = %e, "a webhook delivery was not written");
                }
            }
        }
    }

    /// Writes `hook`'s delivery of `happening` (dropped when the hook has as many waiting as it
    /// may) and tries it at once when an attempt slot is free.
    async fn enqueue(self: &Arc<Self>, hook: &Webhook, happening: &Happening) -> Result<(), Error> {
        let now = shared::sync::unix_ms();
        let permit = Arc::clone(&self.in_flight).try_acquire_owned().ok();
        let waiting = self
            .within("KV keys", self.outbox.waiting(&hook.principal, &hook.id))
            .await?;
        let full = waiting >= self.settings.webhook_max_pending;
        let mut delivery = WebhookDelivery {
            id: webhook::delivery_id(&hook.id, &happening.run_id, happening.seq),
            webhook_id: hook.id.clone(),
            principal: hook.principal.clone(),
            topic: happening.topic,
            run_id: happening.run_id.clone(),
            body: webhook::body(hook.format, happening, now),
            state: DeliveryState::Pending,
            attempts: 0,
            last_status: None,
            last_error: None,
            next_attempt_unix_ms: now,
            held_until_unix_ms: 0,
            created_unix_ms: now,
            last_attempt_unix_ms: 0,
        };
        if full {
            delivery.state = DeliveryState::Dropped;
            delivery.last_error = Some(format!(
                "{waiting} deliveries of this webhook were waiting, as many as may (--webhook-max-pending)"
            ));
            metrics::counter!(crate::telemetry::metric::WEBHOOK_DELIVERIES, "outcome" => "dropped").increment(1);
        } else if permit.is_some() {
            delivery.held_until_unix_ms = now.saturating_add(self.hold_ms());
        }
        let added = self.within("KV create", self.outbox.add(&delivery)).await?;
        if let (Some(revision), Some(permit), false) = (added, permit, full) {
            let this = Arc::clone(self);
            shared::tasks::spawn(async move {
                this.attempt(delivery, revision).await;
                drop(permit);
            });
        }
        Ok(())
    }

    /// How long a replica holds a delivery it tries: the attempt's timeout and some room.
    fn hold_ms(&self) -> u64 {
        u64::try_from((self.settings.webhook_timeout + Duration::from_secs(5)).as_millis()).unwrap_or(u64::MAX)
    }

    /// Makes one attempt of `delivery`, held at `revision`, and records how it went.
    async fn attempt(&self, mut delivery: WebhookDelivery, revision: u64) {
        let key = registration_key(&delivery.principal, &delivery.webhook_id);
        let hook = match self.read(&key).await {
            Ok(hook) => hook,
            Err(e) => {
                tracing::warn!(delivery = %delivery.id, error = %e, "cannot read the webhook; the delivery is tried later");
                return;
            }
        };
        let now = shared::sync::unix_ms();
        match hook {
            None => {
                delivery.state = DeliveryState::Canceled;
                delivery.last_error = Some("the webhook was deleted".into());
                delivery.held_until_unix_ms = 0;
            }
            Some(hook) => {
                let tried = self
                    .sender
                    .post(Post {
                        url: &hook.url,
                        secret: &hook.secret,
                        id: &delivery.id,
                        timestamp_s: now / 1000,
                        body: &delivery.body,
                        headers: &hook.headers,
                    })
                    .await;
                let (max_attempts, max_backoff) =
                    (self.settings.webhook_max_attempts, self.settings.webhook_max_backoff);
                delivery.record(tried, shared::sync::unix_ms(), max_attempts, max_backoff);
            }
        }
        let outcome = delivery.state.name();
        metrics::counter!(crate::telemetry::metric::WEBHOOK_DELIVERIES, "outcome" => outcome).increment(1);
        tracing::debug!(delivery = %delivery.id, attempts = delivery.attempts, outcome, "webhook attempt");
        if let Err(e) = self
            .within("settle a delivery", self.outbox.settle(&delivery, revision))
            .await
        {
            tracing::warn!(delivery = %delivery.id, error = %e, "the attempt's record was not written; the delivery may be tried again");
        }
    }

    /// Looks for deliveries due every `--webhook-sweep-interval` until `stop`, and tries them.
    pub(crate) async fn sweep(self: Arc<Self>, stop: CancellationToken) {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(self.settings.webhook_sweep_interval) => {}
            }
            if let Err(e) = self.sweep_once().await {
                tracing::debug!(error = %e, "the webhook sweep found the outbox unavailable");
            }
        }
    }

    /// One look: holds and tries each delivery due, while attempt slots are free.
    pub(crate) async fn sweep_once(self: &Arc<Self>) -> Result<(), Error> {
        let keys = self.within("KV keys", self.outbox.pending_keys()).await?;
        for key in keys {
            let Ok(permit) = Arc::clone(&self.in_flight).try_acquire_owned() else {
                return Ok(());
            };
            let now = shared::sync::unix_ms();
            let held = self
                .within("hold a delivery", self.outbox.hold(&key, now, now + self.hold_ms()))
                .await?;
            if let Some((delivery, revision)) = held {
                let this = Arc::clone(self);
                shared::tasks::spawn(async move {
                    this.attempt(delivery, revision).await;
                    drop(permit);
                });
            }
        }
        Ok(())
    }
}
