//! Each principal's spend per hour window on the NATS store ([`UsageBook`]): a key
//! `<principal>.<window start>` (the principal an encoded token) in the key-value bucket
//! `<bucket>-usage`, whose entries expire after `--usage-keep-for`. Adding is a compare-and-set on
//! the revision read, tried again when another replica added first, so concurrent runs never
//! lose each other's spend. A principal's key is hot (every turn of each of its runs adds to
//! it): this replica's adds to one key take turns ([`Stripes`]), so they never fight each other,
//! only other replicas' adds.

use futures::future::BoxFuture;
use futures::{FutureExt as _, StreamExt as _};
use shared::jetstream::{Bucket, Consistency, JetStream, Operation};

use super::kv::{token, write_at};
use super::results::KvStore;
use crate::domain::ports::{StoreError, UsageBook};
use crate::domain::usage::{Add, Tally, WINDOW_MS, Window};
use crate::store::unavailable;

/// Attempts of one add against other replicas' adds.
const CAS_ATTEMPTS: usize = 32;
/// Windows read at once.
const READ_CONCURRENCY: usize = 16;

/// Locks striped over the keys: an add holds its key's stripe from its read to its write.
const STRIPES: usize = 64;

/// See the module docs.
#[derive(Clone)]
pub struct NatsUsage {
    windows: std::sync::Arc<dyn Bucket>,
    stripes: std::sync::Arc<Stripes>,
}

/// One lock per stripe of the keys.
struct Stripes([tokio::sync::Mutex<()>; STRIPES]);

impl Stripes {
    fn of(&self, key: &str) -> &tokio::sync::Mutex<()> {
        let hash = shared::text::fnv1a(key.as_bytes());
        &self.0[usize::try_from(hash % STRIPES as u64).unwrap_or(0)]
    }
}

impl NatsUsage {
    /// Binds (or creates) the usage bucket beside the results bucket `bucket`, keeping windows
    /// `keep_for`.
    pub async fn open(
        js: &dyn JetStream,
        bucket: &str,
        keep_for: std::time::Duration,
        replicas: usize,
    ) -> Result<Self, StoreError> {
        let name = format!("{bucket}-usage");
        let description = "orchestrator spend of each principal per hour";
        let windows = KvStore::open_bucket(js, &name, keep_for, description, replicas).await?;
        let stripes = std::sync::Arc::new(Stripes(std::array::from_fn(|_| tokio::sync::Mutex::new(()))));
        Ok(Self { windows, stripes })
    }
}

fn key_of(principal: &str, window: u64) -> String {
    format!("{}.{window}", token(principal))
}

/// The window under `key` and its revision (`None`: nothing spent yet).
async fn read(windows: &dyn Bucket, key: &str) -> Result<Option<(Window, u64)>, StoreError> {
    let entry = windows.entry(key, Consistency::Direct).await;
    let Some(entry) = entry.map_err(|e| unavailable("KV entry", key, e))? else {
        return Ok(None);
    };
    if entry.operation != Operation::Put {
        return Ok(None);
    }
    let spend = serde_json::from_slice(&entry.value).map_err(|e| StoreError::Corrupt {
        key: key.to_owned(),
        reason: e.to_string(),
    })?;
    Ok(Some((spend, entry.revision)))
}

impl UsageBook for NatsUsage {
    fn add(&self, principal: &str, window: u64, add: Add) -> BoxFuture<'static, Result<Tally, StoreError>> {
        let (windows, key, stripes, principal) = (
            self.windows.clone(),
            key_of(principal, window),
            std::sync::Arc::clone(&self.stripes),
            principal.to_owned(),
        );
        async move {
            let _turn = stripes.of(&key).lock().await;
            // How far the hour before booked the add's run, read once, when this hour does not
            // know the run yet (an add made again after the hour turned books it once).
            let mut earlier: Option<Option<Window>> = None;
            for _ in 0..CAS_ATTEMPTS {
                let (mut kept, revision) = match read(&*windows, &key).await? {
                    Some((kept, revision)) => (kept, Some(revision)),
                    None => (Window::default(), None),
                };
                let unknown = add.run.as_ref().is_some_and(|run| !kept.knows(&run.run_id));
                if unknown && earlier.is_none() && window >= WINDOW_MS {
                    let before = key_of(&principal, window - WINDOW_MS);
                    earlier = Some(read(&*windows, &before).await?.map(|(window, _)| window));
                }
                let total = kept.apply_after(earlier.as_ref().and_then(Option::as_ref), &add);
                let value = bytes::Bytes::from(crate::domain::ports::json("a usage window", &kept)?);
                if write_at(&*windows, &key, value, revision).await? {
                    return Ok(total);
                }
            }
            Err(unavailable(
                "KV usage add",
                &key,
                format!("{CAS_ATTEMPTS} other writes came first"),
            ))
        }
        .boxed()
    }

    fn read(&self, principal: &str, from: u64, to: u64) -> BoxFuture<'static, Result<Vec<(u64, Tally)>, StoreError>> {
        let (windows, principal) = (self.windows.clone(), principal.to_owned());
        async move {
            let starts: Vec<u64> = (from / WINDOW_MS..=to / WINDOW_MS).map(|n| n * WINDOW_MS).collect();
            let read_one = |start: u64| {
                let (windows, key) = (windows.clone(), key_of(&principal, start));
                async move {
                    read(&*windows, &key)
                        .await
                        .map(|found| found.map(|(kept, _)| (start, kept.total)))
                }
            };
            let found: Vec<Result<Option<(u64, Tally)>, StoreError>> = futures::stream::iter(starts)
                .map(read_one)
                .buffered(READ_CONCURRENCY)
                .collect()
                .await;
            found.into_iter().filter_map(Result::transpose).collect()
        }
        .boxed()
    }
}
