//! Raising a run's fence (see `shared::fence`): the newest epoch any replica claimed the run in,
//! under `epoch.<id>` beside its record. A replica taking a run over raises the fence to its new
//! epoch before it claims the record, so every runner refuses the replaced owner's calls from
//! before the new owner's first one. Raising never lowers it, and is safe to repeat: a raise
//! whose answer was lost (it may have landed) is just done again.

use shared::jetstream::{Bucket, Consistency, Error};

use crate::domain::ports::StoreError;
use crate::store::unavailable;

/// Compare-and-set rounds lost to other raisers before a raise gives up (each loss means the
/// fence moved, so a few are plenty).
const ATTEMPTS: usize = 8;

/// The fence's key of the run whose record is under `record_key` (`run.<escaped id>`).
pub(super) fn fence_key(record_key: &str) -> String {
    format!("epoch.{}", record_key.strip_prefix("run.").unwrap_or(record_key))
}

/// Raises the fence of the run under `record_key` to `epoch` unless it stands there or higher.
pub(super) async fn raise(kv: &dyn Bucket, record_key: &str, epoch: u64) -> Result<(), StoreError> {
    let key = fence_key(record_key);
    for _ in 0..ATTEMPTS {
        let entry = kv.entry(&key, Consistency::Leader).await;
        let raised = match entry.map_err(|e| unavailable("KV entry", &key, e))? {
            Some(entry) if entry.operation == shared::jetstream::Operation::Put => {
                let current = shared::fence::decode(&entry.value).unwrap_or_else(|why| {
                    tracing::warn!(%key, "{why}; raising it over that");
                    0
                });
                if current >= epoch {
                    return Ok(());
                }
                kv.update(&key, shared::fence::encode(epoch).into(), entry.revision)
                    .await
                    .map_err(|e| (e != Error::WrongRevision).then_some(e.to_string()))
            }
            _ => kv
                .create(&key, shared::fence::encode(epoch).into())
                .await
                .map_err(|e| (e != Error::Exists).then_some(e.to_string())),
        };
        match raised {
            Ok(_) => return Ok(()),
            // Another raiser moved it meanwhile: read it again.
            Err(None) => continue,
            Err(Some(e)) => return Err(unavailable("fence raise", &key, e)),
        }
    }
    Err(unavailable(
        "fence raise",
        &key,
        format!("it moved {ATTEMPTS} times while raised"),
    ))
}

#[cfg(test)]
mod tests {
    /// The orchestrator finds a run's fence under the key a tool-runner reads it from.
    #[test]
    fn the_fence_key_of_a_record_is_the_one_runners_read() {
        for id in ["plain-id_7", "a.b:c", "ü/x y"] {
            assert_eq!(
                super::fence_key(&super::super::results::key(id)),
                shared::fence::key(id)
            );
        }
    }
}
