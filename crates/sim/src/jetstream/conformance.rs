//! What any implementation of the seam must answer, exactly as a NATS server does: run over the
//! simulated cluster (a unit test) and over a real `nats-server` (`tests/simulation/jetstream.rs`), so the
//! simulation's JetStream is held to the real one's semantics.

use std::sync::Arc;
use std::time::Duration;

use anyhow::ensure;
use bytes::Bytes;
use futures::StreamExt as _;
use shared::jetstream::{
    BucketConfig, Consistency, Deliver, Error, JetStream, ObjectsConfig, Operation, Publish, Read, StreamConfig,
};

/// Runs every check against `js`, whose buckets and streams are named with `prefix`.
pub async fn check(js: Arc<dyn JetStream>, prefix: &str) -> anyhow::Result<()> {
    buckets(js.as_ref(), prefix).await?;
    streams(js.as_ref(), prefix).await?;
    objects(js.as_ref(), prefix).await?;
    core(js.as_ref(), prefix).await?;
    Ok(())
}

/// Key-value buckets: revisions, create, update and delete at a revision, markers, keys.
async fn buckets(js: &dyn JetStream, prefix: &str) -> anyhow::Result<()> {
    let kv = js
        .bucket(BucketConfig {
            name: format!("{prefix}-kv"),
            description: "conformance".to_owned(),
            max_age: Duration::from_secs(600),
            replicas: 1,
        })
        .await?;
    let first = kv.create("a.1", Bytes::from_static(b"one")).await?;
    ensure!(kv.create("a.1", Bytes::from_static(b"two")).await == Err(Error::Exists));
    ensure!(kv.update("a.1", Bytes::from_static(b"two"), first + 7).await == Err(Error::WrongRevision));
    let second = kv.update("a.1", Bytes::from_static(b"two"), first).await?;
    ensure!(second > first, "revisions grow: {first} then {second}");
    for consistency in [Consistency::Leader, Consistency::Direct] {
        let entry = kv.entry("a.1", consistency).await?;
        ensure!(
            entry.as_ref().map(|e| (e.value.as_ref(), e.revision, e.operation))
                == Some((b"two".as_ref(), second, Operation::Put)),
            "{consistency:?}: {entry:?}"
        );
    }
    ensure!(kv.entry("missing", Consistency::Leader).await?.is_none());
    ensure!(kv.delete("a.1", Some(first)).await == Err(Error::WrongRevision));
    kv.delete("a.1", Some(second)).await?;
    let marker = kv.entry("a.1", Consistency::Leader).await?;
    ensure!(
        marker.as_ref().map(|e| e.operation) == Some(Operation::Delete),
        "{marker:?}"
    );
    ensure!(kv.get("a.1").await?.is_none(), "a marker has no value");
    let again = kv.create("a.1", Bytes::from_static(b"three")).await?;
    ensure!(again > second, "a create over a marker is a new revision");
    kv.put("a.2", Bytes::from_static(b"x")).await?;
    kv.put("b.1", Bytes::from_static(b"y")).await?;
    kv.put("b.2", Bytes::new()).await?;
    kv.delete("b.2", None).await?;
    ensure!(
        kv.keys(">").await? == ["a.1", "a.2", "b.1"],
        "{:?}",
        kv.keys(">").await?
    );
    ensure!(kv.keys("a.>").await? == ["a.1", "a.2"]);
    ensure!(kv.keys("c.>").await?.is_empty());
    let bound = js.bind_bucket(&format!("{prefix}-kv")).await?;
    ensure!(bound.get("b.1").await? == Some(Bytes::from_static(b"y")));
    ensure!(
        js.bind_bucket(&format!("{prefix}-none")).await.is_err(),
        "a missing bucket is not bound"
    );
    Ok(())
}

/// Streams: sequences, message ids, expected last subject sequences, reads, purges.
async fn streams(js: &dyn JetStream, prefix: &str) -> anyhow::Result<()> {
    let name = format!("{}_LOG", prefix.to_uppercase());
    let subject = |s: &str| format!("{prefix}.log.{s}");
    let stream = js
        .stream(StreamConfig {
            name: name.clone(),
            description: "conformance".to_owned(),
            subjects: vec![format!("{prefix}.log.>")],
            max_age: Duration::from_secs(600),
            max_bytes: 0,
            discard_old: true,
            duplicate_window: Duration::from_secs(120),
            replicas: 1,
        })
        .await?;
    let message = |s: &str, id: Option<&str>, after: Option<u64>| Publish {
        subject: subject(s),
        payload: Bytes::from(format!("{s}:{id:?}")),
        id: id.map(str::to_owned),
        after,
        headers: vec![("X-Kind".to_owned(), "test".to_owned())],
    };
    let a1 = stream.publish(message("a", Some("a1"), Some(0))).await?;
    ensure!(!a1.duplicate);
    let dup = stream.publish(message("a", Some("a1"), Some(0))).await?;
    ensure!(dup.duplicate && dup.sequence == a1.sequence, "a known id: {dup:?}");
    ensure!(stream.publish(message("a", Some("a2"), Some(0))).await == Err(Error::WrongSequence));
    let b1 = stream.publish(message("b", None, Some(0))).await?;
    let a2 = stream.publish(message("a", Some("a2"), Some(a1.sequence))).await?;
    ensure!(b1.sequence == a1.sequence + 1 && a2.sequence == b1.sequence + 1);
    let last = stream.last(&subject("a"), Consistency::Leader).await?;
    ensure!(last.as_ref().map(|m| m.sequence) == Some(a2.sequence), "{last:?}");
    ensure!(last.as_ref().and_then(|m| m.header("X-Kind")) == Some("test"));
    ensure!(stream.last(&subject("z"), Consistency::Leader).await?.is_none());
    ensure!(
        stream
            .last(&subject("b"), Consistency::Direct)
            .await?
            .map(|m| m.sequence)
            == Some(b1.sequence)
    );

    let mut all = stream
        .read(Read {
            filter: subject("a"),
            deliver: Deliver::All,
            headers_only: false,
            expires: None,
        })
        .await?;
    ensure!(all.pending == 2, "pending {}", all.pending);
    let first = next(&mut all.messages).await?;
    ensure!((first.sequence, first.pending) == (a1.sequence, 1), "{first:?}");
    let second = next(&mut all.messages).await?;
    ensure!((second.sequence, second.pending) == (a2.sequence, 0), "{second:?}");
    let a3 = stream.publish(message("a", None, None)).await?;
    ensure!(
        next(&mut all.messages).await?.sequence == a3.sequence,
        "a read goes on with what comes later"
    );

    let mut lasts = stream
        .read(Read {
            filter: format!("{prefix}.log.>"),
            deliver: Deliver::LastPerSubject,
            headers_only: true,
            expires: None,
        })
        .await?;
    ensure!(lasts.pending == 2);
    let (one, two) = (next(&mut lasts.messages).await?, next(&mut lasts.messages).await?);
    ensure!(
        [one.sequence, two.sequence] == [b1.sequence, a3.sequence],
        "{one:?} {two:?}"
    );
    ensure!(
        one.payload.is_empty() && one.header("X-Kind") == Some("test"),
        "headers only: {one:?}"
    );

    let mut from = stream
        .read(Read {
            filter: format!("{prefix}.log.>"),
            deliver: Deliver::From(a2.sequence),
            headers_only: false,
            expires: None,
        })
        .await?;
    ensure!(from.pending == 2 && next(&mut from.messages).await?.sequence == a2.sequence);
    let mut new = stream
        .read(Read {
            filter: format!("{prefix}.log.>"),
            deliver: Deliver::New,
            headers_only: false,
            expires: None,
        })
        .await?;
    ensure!(new.pending == 0);
    let b2 = stream.publish(message("b", None, None)).await?;
    ensure!(next(&mut new.messages).await?.sequence == b2.sequence);

    let state = stream.state().await?;
    ensure!(
        (state.messages, state.first_sequence, state.last_sequence) == (5, a1.sequence, b2.sequence),
        "{state:?}"
    );
    stream.purge(&subject("a"), 1).await?;
    let state = stream.state().await?;
    ensure!(state.messages == 3 && state.first_sequence == b1.sequence, "{state:?}");
    ensure!(
        stream
            .last(&subject("a"), Consistency::Leader)
            .await?
            .map(|m| m.sequence)
            == Some(a3.sequence)
    );
    stream.purge(&subject("b"), 0).await?;
    ensure!(stream.state().await?.messages == 1);
    Ok(())
}

/// The next message of a read, within a deadline.
async fn next(
    messages: &mut futures::stream::BoxStream<'static, Result<shared::jetstream::Message, Error>>,
) -> anyhow::Result<shared::jetstream::Message> {
    match tokio::time::timeout(Duration::from_secs(10), messages.next()).await {
        Ok(Some(message)) => Ok(message?),
        Ok(None) => anyhow::bail!("the read ended"),
        Err(_) => anyhow::bail!("no message within 10 s"),
    }
}

/// Object stores: put, get, replace, remove, list.
async fn objects(js: &dyn JetStream, prefix: &str) -> anyhow::Result<()> {
    let objects = js
        .objects(ObjectsConfig {
            name: format!("{prefix}-objects"),
            description: "conformance".to_owned(),
            max_age: Duration::from_secs(600),
            replicas: 1,
        })
        .await?;
    ensure!(objects.names().await?.is_empty());
    ensure!(objects.get("none").await?.is_none());
    objects.put("one", Some("first".to_owned()), vec![1; 300_000]).await?;
    objects.put("two", None, Vec::new()).await?;
    objects.put("one", Some("again".to_owned()), vec![2; 10]).await?;
    let one = objects.get("one").await?;
    ensure!(
        one.as_ref().map(|o| (o.description.as_deref(), o.bytes.as_slice()))
            == Some((Some("again"), [2u8; 10].as_slice())),
        "{:?}",
        one.map(|o| o.description)
    );
    let mut names = objects.names().await?;
    names.sort();
    ensure!(names == ["one", "two"], "{names:?}");
    objects.remove("one").await?;
    objects.remove("never").await?;
    ensure!(objects.get("one").await?.is_none());
    ensure!(objects.names().await? == ["two"]);
    Ok(())
}

/// Core NATS: a request nobody answers, a request answered, a publish heard.
async fn core(js: &dyn JetStream, prefix: &str) -> anyhow::Result<()> {
    ensure!(js.request(format!("{prefix}.nobody"), Bytes::new()).await?.is_none());
    let mut asked = js.subscribe(format!("{prefix}.ask.*")).await?;
    let answerer = js.handle();
    let answering = tokio::spawn(async move {
        let inbound = asked.next().await?;
        let reply = inbound.reply?;
        answerer
            .publish(reply, Bytes::from([b"re:".as_ref(), &inbound.payload].concat()))
            .await
            .ok()
    });
    let answer = js.request(format!("{prefix}.ask.x"), Bytes::from_static(b"q")).await?;
    ensure!(answer.as_deref() == Some(b"re:q".as_ref()), "{answer:?}");
    ensure!(answering.await?.is_some());
    let mut heard = js.subscribe(format!("{prefix}.told")).await?;
    js.publish(format!("{prefix}.told"), Bytes::from_static(b"hi")).await?;
    let told = tokio::time::timeout(Duration::from_secs(10), heard.next()).await?;
    ensure!(told.map(|m| m.payload) == Some(Bytes::from_static(b"hi")));
    Ok(())
}
