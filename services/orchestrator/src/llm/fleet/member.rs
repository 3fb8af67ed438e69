//! One model endpoint of the fleet: its client, the completions in flight on it, and its
//! passive health (failures in a row eject it for a while, longer each time in a row; once let
//! back in, it is on probation until a completion succeeds).

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use shared::sync::lock;
use tokio::time::Instant;

use crate::llm::HttpLlm;
use crate::telemetry::metric;

/// Longest ejection.
const MAX_EJECTION: Duration = Duration::from_secs(300);

/// A model endpoint.
pub(super) struct Member {
    /// The base URL as logs, errors and metrics show it (no credentials).
    pub(super) name: String,
    pub(super) client: HttpLlm,
    in_flight: AtomicUsize,
    health: Mutex<Health>,
}

#[derive(Default)]
struct Health {
    failures_in_a_row: u32,
    ejected_until: Option<Instant>,
    /// Ejections since the last success: each doubles the next one.
    ejections_in_a_row: u32,
}

/// What the fleet's health rules are.
#[derive(Debug, Clone, Copy)]
pub(super) struct HealthRules {
    pub(super) eject_after: u32,
    pub(super) eject_for: Duration,
}

impl Member {
    pub(super) fn new(client: HttpLlm) -> Arc<Self> {
        let name = client.shown_url().trim_end_matches("/chat/completions").to_owned();
        // Listed on /metrics from the start, so a rate over it starts at zero.
        metrics::counter!(metric::LLM_EJECTIONS, "endpoint" => name.clone()).absolute(0);
        Arc::new(Self {
            name,
            client,
            in_flight: AtomicUsize::new(0),
            health: Mutex::default(),
        })
    }

    /// Ejected now.
    pub(super) fn ejected(&self, now: Instant) -> bool {
        lock(&self.health).ejected_until.is_some_and(|until| now < until)
    }

    /// As many completions in flight as `limit`.
    pub(super) fn saturated(&self, limit: usize) -> bool {
        self.in_flight.load(Ordering::Relaxed) >= limit
    }

    /// Counts a completion in flight until the guard is dropped.
    pub(super) fn enter(self: &Arc<Self>) -> InFlight {
        let now = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        metrics::gauge!(metric::LLM_IN_FLIGHT, "endpoint" => self.name.clone()).set(now as f64);
        InFlight(Arc::clone(self))
    }

    /// A completion streamed to its end here.
    pub(super) fn succeeded(&self) {
        *lock(&self.health) = Health::default();
        metrics::counter!(metric::LLM_REQUESTS, "endpoint" => self.name.clone(), "outcome" => "ok").increment(1);
    }

    /// A completion failed here (`outcome` names how). Returns whether this failure ejected the
    /// endpoint; `may_eject` says whether the fleet has room for one more ejected endpoint.
    pub(super) fn failed(&self, outcome: &'static str, rules: HealthRules, may_eject: bool) -> bool {
        metrics::counter!(metric::LLM_REQUESTS, "endpoint" => self.name.clone(), "outcome" => outcome).increment(1);
        let mut health = lock(&self.health);
        health.failures_in_a_row += 1;
        if health.failures_in_a_row < rules.eject_after || !may_eject {
            return false;
        }
        let doubling = 1u32 << health.ejections_in_a_row.min(16);
        let ejection = rules.eject_for.saturating_mul(doubling).min(MAX_EJECTION);
        health.ejected_until = Some(Instant::now() + ejection);
        health.ejections_in_a_row += 1;
        // Let back in, one more failure ejects it again.
        health.failures_in_a_row = rules.eject_after - 1;
        drop(health);
        metrics::counter!(metric::LLM_EJECTIONS, "endpoint" => self.name.clone()).increment(1);
        tracing::warn!(
            endpoint = %self.name,
            for_ms = ejection.as_millis() as u64,
            "model endpoint ejected after failures in a row"
        );
        true
    }

    /// Adds a completion's prompt tokens, and those of them the server had cached.
    pub(super) fn count_prompt(&self, usage: crate::domain::chat::Usage) {
        let endpoint = self.name.clone();
        metrics::counter!(metric::LLM_PROMPT_TOKENS, "endpoint" => endpoint.clone()).increment(usage.prompt_tokens);
        metrics::counter!(metric::LLM_CACHED_PROMPT_TOKENS, "endpoint" => endpoint)
            .increment(usage.cached_prompt_tokens.min(usage.prompt_tokens));
    }
}

/// A completion in flight on a member.
pub(super) struct InFlight(Arc<Member>);

impl InFlight {
    pub(super) fn member(&self) -> &Arc<Member> {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let now = self.0.in_flight.fetch_sub(1, Ordering::Relaxed).saturating_sub(1);
        metrics::gauge!(metric::LLM_IN_FLIGHT, "endpoint" => self.0.name.clone()).set(now as f64);
    }
}
