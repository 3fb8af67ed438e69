//! Waiting for a condition with a deadline, never for a fixed time: a test polls what it waits
//! for (a log line, a status, a count) and fails naming it when the deadline passes.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// How often a condition is looked at.
const POLL: Duration = Duration::from_millis(50);

/// Polls `probe` until it gives a value, for up to `limit`; then fails saying what was awaited.
pub async fn until<T, F: Future<Output = Option<T>>>(
    what: &str,
    limit: Duration,
    probe: impl FnMut() -> F,
) -> anyhow::Result<T> {
    until_paced(what, limit, POLL, probe).await
}

/// [`until`], looking every `pace`: for a probe that costs (a process per look, a cluster asked
/// again while it elects its leaders).
pub async fn until_paced<T, F: Future<Output = Option<T>>>(
    what: &str,
    limit: Duration,
    pace: Duration,
    mut probe: impl FnMut() -> F,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = probe().await {
            return Ok(value);
        }
        anyhow::ensure!(Instant::now() < deadline, "gave up waiting for {what} after {limit:?}");
        tokio::time::sleep(pace).await;
    }
}

/// [`until`] with a probe that does not wait.
pub async fn until_sync<T>(what: &str, limit: Duration, mut probe: impl FnMut() -> Option<T>) -> anyhow::Result<T> {
    until(what, limit, || std::future::ready(probe())).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_condition_that_comes_true_is_returned_and_one_that_never_does_fails_naming_it() {
        let mut polls = 0;
        let value = until_sync("the third poll", Duration::from_secs(5), || {
            polls += 1;
            (polls == 3).then_some(polls)
        })
        .await;
        assert_eq!(value.ok(), Some(3));
        let never = until_sync::<()>("nothing", Duration::from_millis(120), || None).await;
        let message = never.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(message.contains("waiting for nothing"), "{message}");
    }
}
