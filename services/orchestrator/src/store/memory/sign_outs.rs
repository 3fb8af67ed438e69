//! Console sessions people ended, in this process ([`SignOuts`]): one replica's, each kept until
//! it would have expired, at most [`MAX_ENDED`] at once (the soonest to expire make room).

use std::collections::HashMap;
use std::sync::Mutex;

use futures::FutureExt as _;
use futures::future::BoxFuture;
use shared::sync::lock;

use crate::domain::ports::{SignOuts, StoreError};

/// The most ended sessions kept.
pub const MAX_ENDED: usize = 100_000;

/// See the module docs.
#[derive(Default)]
pub struct MemorySignOuts {
    /// Until when each ended session would have been good (Unix seconds), by id.
    ended: Mutex<HashMap<String, u64>>,
}

impl SignOuts for MemorySignOuts {
    fn end(&self, id: &str, until_unix_s: u64) -> BoxFuture<'static, Result<(), StoreError>> {
        let now = shared::sync::unix_ms() / 1000;
        let mut ended = lock(&self.ended);
        ended.retain(|_, until| *until > now);
        if ended.len() >= MAX_ENDED
            && let Some(soonest) = ended.iter().min_by_key(|(_, until)| **until).map(|(id, _)| id.clone())
        {
            ended.remove(&soonest);
        }
        ended.insert(id.to_owned(), until_unix_s);
        futures::future::ready(Ok(())).boxed()
    }

    fn ended(&self, id: &str) -> BoxFuture<'static, Result<bool, StoreError>> {
        let ended = lock(&self.ended).contains_key(id);
        futures::future::ready(Ok(ended)).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_ended_session_stays_ended_until_it_would_have_expired() {
        let sign_outs = MemorySignOuts::default();
        let later = shared::sync::unix_ms() / 1000 + 3600;
        sign_outs.end("a", later).await.unwrap();
        sign_outs.end("old", 1).await.unwrap();
        assert!(sign_outs.ended("a").await.unwrap());
        assert!(!sign_outs.ended("b").await.unwrap());
        sign_outs.end("c", later).await.unwrap();
        assert!(!sign_outs.ended("old").await.unwrap(), "an expired one is forgotten");
    }
}
