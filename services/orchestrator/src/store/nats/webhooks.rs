//! The webhooks' two key-value buckets beside the runs: `<bucket>-webhooks` (the registrations,
//! kept until deleted) and `<bucket>-webhook-deliveries` (the outbox and the records of
//! deliveries, each kept `--webhook-keep` after its last change). Every replica opens both, so
//! any of them delivers what another left.

use std::sync::Arc;
use std::time::Duration;

use shared::jetstream::{Bucket, JetStream};

use super::results::KvStore;
use crate::domain::ports::StoreError;

/// Opens (or creates) the registrations' bucket and the outbox's, beside the results bucket
/// `bucket`.
pub async fn open(
    js: &dyn JetStream,
    bucket: &str,
    keep: Duration,
    replicas: usize,
) -> Result<(Arc<dyn Bucket>, Arc<dyn Bucket>), StoreError> {
    let name = format!("{bucket}-webhooks");
    let registrations =
        KvStore::open_bucket(js, &name, Duration::ZERO, "webhooks callers registered", replicas).await?;
    let name = format!("{bucket}-webhook-deliveries");
    let outbox = KvStore::open_bucket(
        js,
        &name,
        keep,
        "webhook deliveries: waiting, and their records",
        replicas,
    )
    .await?;
    Ok((registrations, outbox))
}
