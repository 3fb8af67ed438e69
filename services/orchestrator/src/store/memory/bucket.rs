//! A key-value bucket in this process ([`MemoryBucket`]), with the semantics of the JetStream
//! seam's [`Bucket`] (revisions, create and update at a revision, delete markers, keys by subject
//! filter): the webhooks keep their registrations and deliveries in one whichever the store, and
//! without NATS this is it. Bounded by a count of keys (a create or put past it is refused) and
//! by age since a key's last write.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::FutureExt as _;
use shared::jetstream::{Bucket, Consistency, Entry, Error, Operation, Reply};

/// See the module docs.
pub struct MemoryBucket {
    inner: Mutex<Inner>,
    max_keys: usize,
    max_age: Duration,
}

struct Inner {
    revision: u64,
    entries: BTreeMap<String, (Entry, Instant)>,
}

impl MemoryBucket {
    /// An empty bucket of at most `max_keys` keys, each kept `max_age` after its last write
    /// (zero: kept until deleted).
    pub fn new(max_keys: usize, max_age: Duration) -> Self {
        Self {
            inner: Mutex::new(Inner {
                revision: 0,
                entries: BTreeMap::new(),
            }),
            max_keys,
            max_age: if max_age.is_zero() { Duration::MAX } else { max_age },
        }
    }

    /// Writes `key` when `allowed` says the entry now there (if any) may be written over.
    fn write(
        &self,
        key: &str,
        value: Bytes,
        operation: Operation,
        allowed: impl FnOnce(Option<&Entry>) -> Result<(), Error>,
    ) -> Result<u64, Error> {
        let mut inner = shared::sync::lock(&self.inner);
        let now = Instant::now();
        let max_age = self.max_age;
        inner
            .entries
            .retain(|_, (_, written)| now.duration_since(*written) < max_age);
        let current = inner.entries.get(key).map(|(entry, _)| entry);
        allowed(current)?;
        if current.is_none() && inner.entries.len() >= self.max_keys {
            return Err(Error::Failed(format!(
                "the bucket holds {} keys, as many as it may",
                self.max_keys
            )));
        }
        inner.revision += 1;
        let revision = inner.revision;
        inner.entries.insert(
            key.to_owned(),
            (
                Entry {
                    value,
                    revision,
                    operation,
                },
                now,
            ),
        );
        Ok(revision)
    }

    fn reply<T: Send + 'static>(result: Result<T, Error>) -> Reply<T> {
        async move { result }.boxed()
    }
}

fn live(entry: Option<&Entry>) -> bool {
    entry.is_some_and(|e| e.operation == Operation::Put)
}

/// Whether the subject `key` matches `filter` (`*` one token, `>` the rest).
fn matches(filter: &str, key: &str) -> bool {
    let mut keys = key.split('.');
    for part in filter.split('.') {
        match (part, keys.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (part, Some(token)) if part == token => {}
            _ => return false,
        }
    }
    keys.next().is_none()
}

impl Bucket for MemoryBucket {
    fn entry(&self, key: &str, _: Consistency) -> Reply<Option<Entry>> {
        let inner = shared::sync::lock(&self.inner);
        let entry = inner
            .entries
            .get(key)
            .filter(|(_, written)| written.elapsed() < self.max_age)
            .map(|(entry, _)| entry.clone());
        Self::reply(Ok(entry))
    }

    fn create(&self, key: &str, value: Bytes) -> Reply<u64> {
        let result = self.write(key, value, Operation::Put, |current| match live(current) {
            true => Err(Error::Exists),
            false => Ok(()),
        });
        Self::reply(result)
    }

    fn update(&self, key: &str, value: Bytes, revision: u64) -> Reply<u64> {
        let result = self.write(key, value, Operation::Put, |current| match current {
            Some(entry) if entry.revision == revision => Ok(()),
            _ => Err(Error::WrongRevision),
        });
        Self::reply(result)
    }

    fn put(&self, key: &str, value: Bytes) -> Reply<u64> {
        Self::reply(self.write(key, value, Operation::Put, |_| Ok(())))
    }

    fn delete(&self, key: &str, revision: Option<u64>) -> Reply<()> {
        let result = self.write(key, Bytes::new(), Operation::Delete, |current| {
            match (revision, current) {
                (Some(expected), Some(entry)) if entry.revision != expected => Err(Error::WrongRevision),
                (Some(_), None) => Err(Error::WrongRevision),
                _ => Ok(()),
            }
        });
        Self::reply(result.map(|_| ()))
    }

    fn keys(&self, filter: &str) -> Reply<Vec<String>> {
        let inner = shared::sync::lock(&self.inner);
        let keys = inner
            .entries
            .iter()
            .filter(|(key, (entry, written))| {
                entry.operation == Operation::Put && written.elapsed() < self.max_age && matches(filter, key)
            })
            .map(|(key, _)| key.clone())
            .collect();
        Self::reply(Ok(keys))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn it_keeps_the_seams_semantics_and_its_bound() {
        let bucket = MemoryBucket::new(2, Duration::from_secs(60));
        let first = bucket.create("a.x.1", "1".into()).await.unwrap();
        assert_eq!(bucket.create("a.x.1", "again".into()).await, Err(Error::Exists));
        assert_eq!(
            bucket.update("a.x.1", "2".into(), first + 5).await,
            Err(Error::WrongRevision)
        );
        let second = bucket.update("a.x.1", "2".into(), first).await.unwrap();
        bucket.create("b.y", "3".into()).await.unwrap();
        assert!(matches!(bucket.create("c", "4".into()).await, Err(Error::Failed(_))));
        assert_eq!(bucket.keys("a.>").await.unwrap(), vec!["a.x.1".to_owned()]);
        assert_eq!(bucket.keys("*.y").await.unwrap(), vec!["b.y".to_owned()]);
        assert_eq!(bucket.keys("a.*").await.unwrap(), Vec::<String>::new());
        assert_eq!(bucket.delete("a.x.1", Some(first)).await, Err(Error::WrongRevision));
        bucket.delete("a.x.1", Some(second)).await.unwrap();
        assert_eq!(bucket.keys(">").await.unwrap(), vec!["b.y".to_owned()]);
        // A delete marker is not live: the key may be created again.
        bucket.create("a.x.1", "5".into()).await.unwrap();
    }

    #[tokio::test]
    async fn keys_expire_after_their_age() {
        let bucket = MemoryBucket::new(10, Duration::from_nanos(1));
        bucket.put("k", "v".into()).await.unwrap();
        assert_eq!(bucket.entry("k", Consistency::Direct).await.unwrap(), None);
        assert!(bucket.keys(">").await.unwrap().is_empty());
    }
}
