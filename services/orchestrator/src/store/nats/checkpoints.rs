//! The checkpoint objects of durable runs (`<bucket>-checkpoints`, an object store). The takeover
//! lists the store every third of the lease, so removing a checkpoint leaves nothing a listing
//! meets (see [`shared::jetstream::Objects::remove`]): a listing costs the live runs only, not
//! every run that ended within `--run-store-ttl`.

use std::sync::Arc;
use std::time::Duration;

use shared::jetstream::{JetStream, Objects, ObjectsConfig};

use crate::domain::ports::StoreError;
use crate::store::unavailable;

/// Binds (or creates) the object store of the checkpoints beside the results bucket `bucket`,
/// with `replicas` copies.
pub(crate) async fn open(
    js: &dyn JetStream,
    bucket: &str,
    ttl: Duration,
    replicas: usize,
) -> Result<Arc<dyn Objects>, StoreError> {
    let name = format!("{bucket}-checkpoints");
    let config = ObjectsConfig {
        name: name.clone(),
        description: "orchestrator checkpoints of live runs".to_owned(),
        max_age: ttl,
        replicas,
    };
    js.objects(config)
        .await
        .map_err(|e| unavailable("creating the checkpoint object store", &name, e))
}
