//! Trying a call again when the orchestrator refused it before it started: `UNAVAILABLE` (no
//! connection, or the server is draining) and `RESOURCE_EXHAUSTED` (no run slot free) say the
//! call did nothing, so it is safe to repeat.

use std::time::Duration;

/// How often and how patiently to retry. The wait doubles after each attempt, from
/// `first_backoff` up to `max_backoff`, with up to a quarter of jitter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retry {
    /// Attempts in all (1: no retry).
    pub attempts: u32,
    /// Wait before the second attempt.
    pub first_backoff: Duration,
    /// Longest wait between two attempts.
    pub max_backoff: Duration,
}

impl Default for Retry {
    /// Five attempts, waiting 100 ms, 200 ms, 400 ms, 800 ms (about 1.5 s in all).
    fn default() -> Self {
        Self {
            attempts: 5,
            first_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
        }
    }
}

impl Retry {
    /// One attempt: refusals are returned at once.
    pub fn none() -> Self {
        Self {
            attempts: 1,
            ..Self::default()
        }
    }

    /// Whether a refusal with `code` may be retried.
    pub fn retryable(code: tonic::Code) -> bool {
        matches!(code, tonic::Code::Unavailable | tonic::Code::ResourceExhausted)
    }

    /// Runs `call` until it succeeds, fails for good, or the attempts are spent.
    pub(crate) async fn run<T, F, Fut>(&self, mut call: F) -> Result<T, tonic::Status>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>>,
    {
        let mut backoff = self.first_backoff;
        let mut attempt = 1;
        loop {
            match call().await {
                Err(status) if Self::retryable(status.code()) && attempt < self.attempts.max(1) => {
                    tokio::time::sleep(jittered(backoff)).await;
                    backoff = (backoff * 2).min(self.max_backoff);
                    attempt += 1;
                }
                other => return other,
            }
        }
    }
}

/// `wait` plus up to a quarter of it, so many clients refused together do not return together.
fn jittered(wait: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    wait + wait / 4 * (nanos % 1000) / 1000
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    fn fast(attempts: u32) -> Retry {
        Retry {
            attempts,
            first_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(2),
        }
    }

    #[tokio::test]
    async fn refusals_are_retried_up_to_the_attempts_and_other_errors_never() {
        let calls = AtomicU32::new(0);
        let refused = fast(3)
            .run(|| async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(tonic::Status::resource_exhausted("no slot"))
            })
            .await;
        assert_eq!(refused.map_err(|s| s.code()), Err(tonic::Code::ResourceExhausted));
        assert_eq!(calls.swap(0, Ordering::SeqCst), 3);

        let invalid = fast(3)
            .run(|| async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(tonic::Status::invalid_argument("bad"))
            })
            .await;
        assert_eq!(invalid.map_err(|s| s.code()), Err(tonic::Code::InvalidArgument));
        assert_eq!(calls.swap(0, Ordering::SeqCst), 1);

        let second = fast(3)
            .run(|| async {
                match calls.fetch_add(1, Ordering::SeqCst) {
                    0 => Err(tonic::Status::unavailable("draining")),
                    _ => Ok(7),
                }
            })
            .await;
        assert_eq!(second.map_err(|s| s.code()), Ok(7));
        assert_eq!(Retry::none().attempts, 1);
    }

    #[test]
    fn jitter_adds_at_most_a_quarter() {
        let wait = Duration::from_millis(400);
        let jittered = jittered(wait);
        assert!(jittered >= wait && jittered <= wait + wait / 4, "{jittered:?}");
    }
}
