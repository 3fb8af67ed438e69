//! The simulated cluster answers as a NATS server does (the conformance checks), and its faults
//! do what a cluster's do.

use std::time::Duration;

use bytes::Bytes;
use shared::jetstream::{BucketConfig, Consistency, Error, JetStream, Publish, StreamConfig};
use tokio::time::Instant;

use super::Cluster;
use crate::ports::condition::{Condition, Mode};

const TIMEOUT: Duration = Duration::from_secs(1);

#[tokio::test(start_paused = true)]
async fn the_simulated_cluster_answers_the_conformance_checks() -> anyhow::Result<()> {
    let cluster = Cluster::new(7);
    super::conformance::check(cluster.connect(Condition::default(), TIMEOUT).handle(), "sim").await
}

async fn bucket(js: &dyn JetStream) -> anyhow::Result<std::sync::Arc<dyn shared::jetstream::Bucket>> {
    Ok(js
        .bucket(BucketConfig {
            name: "runs".to_owned(),
            description: String::new(),
            max_age: Duration::from_secs(60),
            replicas: 3,
        })
        .await?)
}

#[tokio::test(start_paused = true)]
async fn a_leaderless_stream_times_out_unapplied_while_followers_serve_direct_reads() -> anyhow::Result<()> {
    let cluster = Cluster::new(1);
    let js = cluster.connect(Condition::default(), TIMEOUT);
    let kv = bucket(&js).await?;
    let revision = kv.put("k", Bytes::from_static(b"1")).await?;
    cluster.lose_leader("KV_runs", Instant::now() + Duration::from_secs(5));
    let started = Instant::now();
    assert_eq!(
        kv.update("k", Bytes::from_static(b"2"), revision).await,
        Err(Error::TimedOut)
    );
    assert!(started.elapsed() >= TIMEOUT, "a request waits its timeout");
    assert_eq!(kv.entry("k", Consistency::Leader).await, Err(Error::TimedOut));
    let direct = kv.entry("k", Consistency::Direct).await?;
    assert_eq!(
        direct.map(|e| e.revision),
        Some(revision),
        "a follower answers, and nothing landed"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        kv.update("k", Bytes::from_static(b"2"), revision).await.is_ok(),
        "a new leader answers"
    );
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_lagging_follower_serves_old_direct_reads_and_the_leader_the_newest() -> anyhow::Result<()> {
    let cluster = Cluster::new(2);
    let js = cluster.connect(Condition::default(), TIMEOUT);
    let kv = bucket(&js).await?;
    let old = kv.put("epoch", Bytes::from_static(b"1")).await?;
    cluster.lag("KV_runs", Instant::now() + Duration::from_secs(10));
    let new = kv.put("epoch", Bytes::from_static(b"2")).await?;
    assert_eq!(
        kv.entry("epoch", Consistency::Direct).await?.map(|e| e.revision),
        Some(old)
    );
    assert_eq!(
        kv.entry("epoch", Consistency::Leader).await?.map(|e| e.revision),
        Some(new)
    );
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        kv.entry("epoch", Consistency::Direct).await?.map(|e| e.revision),
        Some(new),
        "caught up"
    );
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn an_answer_lost_hides_a_write_that_landed() -> anyhow::Result<()> {
    let cluster = Cluster::new(3);
    let js = cluster.connect(Condition::default(), TIMEOUT);
    let stream = js
        .stream(StreamConfig {
            name: "LOG".to_owned(),
            description: String::new(),
            subjects: vec!["log.>".to_owned()],
            max_age: Duration::from_secs(60),
            max_bytes: 0,
            discard_old: true,
            duplicate_window: Duration::from_secs(60),
            replicas: 3,
        })
        .await?;
    cluster.lose_answers(Instant::now() + Duration::from_secs(600));
    let (mut lost, mut heard) = (0, 0);
    for n in 0..30 {
        let message = Publish {
            subject: "log.run".to_owned(),
            payload: Bytes::from(format!("{n}")),
            id: Some(format!("m{n}")),
            ..Publish::default()
        };
        match stream.publish(message).await {
            Ok(_) => heard += 1,
            Err(Error::TimedOut) => lost += 1,
            Err(e) => anyhow::bail!("{e}"),
        }
    }
    assert!(lost > 0 && heard > 0, "lost {lost}, heard {heard}");
    assert_eq!(
        cluster.messages("LOG", ">").len(),
        30,
        "every write landed, heard or not"
    );
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_paused_process_waits_and_one_cut_off_times_out() -> anyhow::Result<()> {
    let cluster = Cluster::new(4);
    let condition = Condition::default();
    let js = cluster.connect(condition.clone(), TIMEOUT);
    let kv = bucket(&js).await?;
    condition.set(Mode::CutOff);
    assert_eq!(kv.put("k", Bytes::new()).await, Err(Error::TimedOut));
    assert!(
        cluster.entry("runs", "k").is_none(),
        "a cut-off process's request never left"
    );
    condition.set(Mode::Paused);
    let put = tokio::spawn({
        let kv = std::sync::Arc::clone(&kv);
        async move { kv.put("k", Bytes::new()).await }
    });
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(
        cluster.entry("runs", "k").is_none() && !put.is_finished(),
        "a paused process sends nothing"
    );
    condition.set(Mode::Up);
    // Resumed past its timeout, it sends the write and gives up on the answer (SIGCONT fires
    // the timers that ran out meanwhile): the write lands, unheard.
    assert_eq!(put.await?, Err(Error::TimedOut));
    assert!(cluster.entry("runs", "k").is_some());
    Ok(())
}
