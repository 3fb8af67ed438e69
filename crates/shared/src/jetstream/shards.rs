//! One run store spread over N shards: each of its buckets, object stores and streams is N of
//! them (the first under the configured name, the others `<name>-shard-<i>`), and everything kept
//! of one run goes to the shard a stable hash of the run's id picks. On a cluster each shard has a
//! leader of its own, so the fleet's writes spread over the nodes instead of one node carrying
//! them all.
//!
//! A key's run is read from the key itself, by the layout both services write: `run.<run>` (a
//! run's record), `epoch.<run>` (its fence), `owner.<incarnation>.<run>` and `wake.<minute>.<run>`
//! (the orphan indexes), `call.<run>.<call>` (a tool-runner's call record); a checkpoint object is
//! named `run.<run>` with a `#` suffix. Every other key (incarnations, runners' liveness, the fence
//! grace, the shard count itself) is the fleet's, and lives in shard 0. A listing asks every shard.
//!
//! The number of shards is fixed when the store is made: it is recorded in shard 0 under
//! [`COUNT_KEY`] ([`agree`]), and a process started with another number refuses to start, naming
//! both, rather than look for runs where they are not.

use std::sync::Arc;

use bytes::Bytes;

use super::{Bucket, Consistency, Entry, Error, Object, Objects, Operation, Reply};

/// Where the store's shard count is kept (shard 0).
pub const COUNT_KEY: &str = "store.shards";
/// Most shards a store may have.
pub const MAX_SHARDS: usize = 64;

/// The name of shard `shard` of the bucket, stream or object store named `name`.
pub fn name(name: &str, shard: usize) -> String {
    match shard {
        0 => name.to_owned(),
        n => format!("{name}-shard-{n}"),
    }
}

/// The shard of the run whose escaped id is `run` (FNV-1a: stable across versions and machines).
pub fn of_run(run: &str, shards: usize) -> usize {
    let hash = run.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    usize::try_from(hash % shards.max(1) as u64).unwrap_or(0)
}

/// One shard of a stream kept per shard beside a sharded bucket.
pub struct ShardStream {
    /// `<kind>_<bucket shard>`.
    pub name: String,
    /// `orchestrator.<bucket shard>.<part>.`: a run's subject is this and its key.
    pub prefix: String,
    /// The stream.
    pub stream: Arc<dyn super::Stream>,
}

/// Binds (or creates) a stream per shard beside the bucket `bucket`: `<kind>_<bucket shard>`,
/// taking the subjects `orchestrator.<bucket shard>.<part>.>`, described as `description`, each
/// message kept for `max_age` in `replicas` copies. The name of a stream that could not be made,
/// with why.
pub async fn streams(
    js: &dyn super::JetStream,
    (bucket, shards): (&str, usize),
    (kind, part, description): (&str, &str, &str),
    (max_age, replicas): (std::time::Duration, usize),
) -> Result<Vec<ShardStream>, (String, Error)> {
    let mut opened = Vec::with_capacity(shards.max(1));
    for shard in 0..shards.max(1) {
        let bucket = name(bucket, shard);
        let (name, prefix) = (format!("{kind}_{bucket}"), format!("orchestrator.{bucket}.{part}."));
        let config = super::StreamConfig {
            name: name.clone(),
            description: description.to_owned(),
            subjects: vec![format!("{prefix}>")],
            max_age,
            max_bytes: 0,
            discard_old: true,
            duplicate_window: std::time::Duration::from_secs(120),
            replicas,
        };
        let stream = js.stream(config).await.map_err(|e| (name.clone(), e))?;
        opened.push(ShardStream { name, prefix, stream });
    }
    Ok(opened)
}

/// The escaped run id a key or object name holds (see the module docs), if it is a run's.
pub fn run_of(key: &str) -> Option<&str> {
    let mut tokens = key.split('.');
    let token = match tokens.next()? {
        "run" | "epoch" | "call" => tokens.next(),
        "owner" | "wake" => tokens.nth(1),
        _ => None,
    }?;
    let run = token.split('#').next().unwrap_or(token);
    (!run.is_empty() && run != "*" && run != ">").then_some(run)
}

/// The shard of `key` among `shards`.
pub fn of_key(key: &str, shards: usize) -> usize {
    run_of(key).map_or(0, |run| of_run(run, shards))
}

/// Reads of the count tried while the store does not answer (a bucket just made or brought to
/// more replicas elects its leader first), a second apart.
const AGREE_ATTEMPTS: u32 = 10;

/// Why the count could not be agreed on.
enum Disagreed {
    /// The store holds another count (or runs without one): final.
    Refused(String),
    /// The store did not answer: tried again.
    Unavailable(String),
}

/// Records `shards` as the store's shard count in its first shard `home`, or checks it against
/// the one recorded: an error naming both when they differ. A store made before shards were
/// recorded has one; it is refused more only if it holds runs. A store that does not answer is
/// asked again for a while ([`AGREE_ATTEMPTS`]).
pub async fn agree(home: &dyn Bucket, shards: usize) -> Result<(), String> {
    let mut last = String::new();
    for attempt in 0..AGREE_ATTEMPTS {
        if attempt > 0 {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
        match try_agree(home, shards).await {
            Ok(()) => return Ok(()),
            Err(Disagreed::Refused(why)) => return Err(why),
            Err(Disagreed::Unavailable(why)) => last = why,
        }
    }
    Err(last)
}

/// One attempt of [`agree`].
async fn try_agree(home: &dyn Bucket, shards: usize) -> Result<(), Disagreed> {
    let unavailable = |e: Error| Disagreed::Unavailable(e.to_string());
    for _ in 0..3 {
        let entry = home.entry(COUNT_KEY, Consistency::Leader).await.map_err(unavailable)?;
        if let Some(entry) = entry.filter(|e| e.operation == Operation::Put) {
            return check(&entry.value, shards).map_err(Disagreed::Refused);
        }
        if shards > 1 && !home.keys("run.>").await.map_err(unavailable)?.is_empty() {
            return Err(Disagreed::Refused(format!(
                "the run store holds runs but no shard count: it was made with 1 shard, and this \
                 process was started with {shards} (--run-store-shards): start it with 1"
            )));
        }
        match home.create(COUNT_KEY, Bytes::from(shards.to_string())).await {
            Ok(_) => return Ok(()),
            // Another process recorded it first: read it again.
            Err(Error::Exists | Error::WrongRevision) => {}
            Err(e) => return Err(unavailable(e)),
        }
    }
    Err(Disagreed::Unavailable(
        "the run store's shard count kept changing while it was read".to_owned(),
    ))
}

/// Writes the store's shard count again, so it never ages out of a bucket whose keys expire.
pub async fn keep(home: &dyn Bucket, shards: usize) -> Result<(), String> {
    home.put(COUNT_KEY, Bytes::from(shards.to_string()))
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The shard count recorded in `home`, if any (a reader that must not record one: a tool-runner),
/// read from the leader (as the fence is: a reader's permissions may allow no direct read).
pub async fn recorded(home: &dyn Bucket) -> Result<Option<usize>, String> {
    let entry = home
        .entry(COUNT_KEY, Consistency::Leader)
        .await
        .map_err(|e| e.to_string())?;
    entry
        .filter(|e| e.operation == Operation::Put)
        .map(|e| parse(&e.value))
        .transpose()
}

fn parse(value: &[u8]) -> Result<usize, String> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|n| (1..=MAX_SHARDS).contains(n))
        .ok_or_else(|| {
            format!(
                "the run store's shard count is not one: {:?}",
                String::from_utf8_lossy(value)
            )
        })
}

fn check(value: &[u8], shards: usize) -> Result<(), String> {
    let recorded = parse(value)?;
    if recorded == shards {
        return Ok(());
    }
    Err(format!(
        "the run store was made with {} and this process was started with {shards} \
         (--run-store-shards): start it with {recorded}",
        counted(recorded)
    ))
}

fn counted(shards: usize) -> String {
    match shards {
        1 => "1 shard".to_owned(),
        n => format!("{n} shards"),
    }
}

/// A key-value bucket spread over shards by the run each key belongs to.
pub struct ShardedBucket {
    shards: Vec<Arc<dyn Bucket>>,
}

impl ShardedBucket {
    /// The bucket over `shards` (the first is shard 0); one shard is that bucket itself.
    pub fn over(mut shards: Vec<Arc<dyn Bucket>>) -> Arc<dyn Bucket> {
        match shards.len() {
            1 => shards.remove(0),
            _ => Arc::new(Self { shards }),
        }
    }

    fn of(&self, key: &str) -> &Arc<dyn Bucket> {
        &self.shards[of_key(key, self.shards.len())]
    }
}

impl Bucket for ShardedBucket {
    fn entry(&self, key: &str, consistency: Consistency) -> Reply<Option<Entry>> {
        self.of(key).entry(key, consistency)
    }

    fn create(&self, key: &str, value: Bytes) -> Reply<u64> {
        self.of(key).create(key, value)
    }

    fn update(&self, key: &str, value: Bytes, revision: u64) -> Reply<u64> {
        self.of(key).update(key, value, revision)
    }

    fn put(&self, key: &str, value: Bytes) -> Reply<u64> {
        self.of(key).put(key, value)
    }

    fn delete(&self, key: &str, revision: Option<u64>) -> Reply<()> {
        self.of(key).delete(key, revision)
    }

    fn keys(&self, filter: &str) -> Reply<Vec<String>> {
        if run_of(filter).is_some() {
            return self.of(filter).keys(filter);
        }
        gathered(self.shards.iter().map(|shard| shard.keys(filter)).collect())
    }
}

/// Every shard's listing, asked at once, as one (an error if any shard's is).
fn gathered(listings: Vec<Reply<Vec<String>>>) -> Reply<Vec<String>> {
    Box::pin(async move {
        let mut all = Vec::new();
        for listing in futures::future::join_all(listings).await {
            all.extend(listing?);
        }
        Ok(all)
    })
}

/// An object store spread over shards by the run each object belongs to.
pub struct ShardedObjects {
    shards: Vec<Arc<dyn Objects>>,
}

impl ShardedObjects {
    /// The object store over `shards` (the first is shard 0); one shard is that store itself.
    pub fn over(mut shards: Vec<Arc<dyn Objects>>) -> Arc<dyn Objects> {
        match shards.len() {
            1 => shards.remove(0),
            _ => Arc::new(Self { shards }),
        }
    }

    fn of(&self, name: &str) -> &Arc<dyn Objects> {
        &self.shards[of_key(name, self.shards.len())]
    }
}

impl Objects for ShardedObjects {
    fn put(&self, name: &str, description: Option<String>, bytes: Vec<u8>) -> Reply<()> {
        self.of(name).put(name, description, bytes)
    }

    fn get(&self, name: &str) -> Reply<Option<Object>> {
        self.of(name).get(name)
    }

    fn remove(&self, name: &str) -> Reply<()> {
        self.of(name).remove(name)
    }

    fn names(&self) -> Reply<Vec<String>> {
        gathered(self.shards.iter().map(|shard| shard.names()).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_of_a_run_goes_to_the_runs_shard() {
        let run = crate::fence::escaped_key("", "run-7.a");
        let shard = of_run(&run, 4);
        for key in [
            format!("run.{run}"),
            format!("epoch.{run}"),
            format!("owner.host~1a.{run}"),
            format!("wake.29000000.{run}"),
            format!("call.{run}.call-1"),
            format!("run.{run}#3~1"),
        ] {
            assert_eq!(of_key(&key, 4), shard, "{key}");
        }
        assert_eq!(run_of("replica.host~1a"), None);
        assert_eq!(run_of("owner.host~1a.>"), None);
        assert_eq!(of_key(crate::fence::GRACE_KEY, 4), 0);
        assert_eq!(of_key(COUNT_KEY, 4), 0);
    }

    #[test]
    fn the_hash_is_stable_and_spreads() {
        // Fixed: a store's runs must be found where another version put them.
        assert_eq!(of_run("run-1", 4), of_run("run-1", 4));
        assert_eq!(of_run("abc", 1), 0);
        let mut counts = [0_usize; 4];
        for i in 0..4000 {
            counts[of_run(&format!("run-{i}"), 4)] += 1;
        }
        assert!(counts.iter().all(|&n| (800..=1200).contains(&n)), "{counts:?}");
    }

    #[test]
    fn a_count_other_than_the_recorded_one_is_refused_naming_both() {
        assert!(check(b"4", 4).is_ok());
        let refused = check(b"4", 1).unwrap_err();
        assert!(refused.contains('4') && refused.contains("started with 1"), "{refused}");
        assert!(check(b"x", 1).is_err());
        assert!(check(b"0", 1).is_err());
    }
}
