//! What a turn may spend: the token budgets' rules. Before each model request the run counts its
//! prompt against what is left (the last turn's prompt and completion, which the next prompt
//! holds: a count that never errs high) and asks for at most what remains after it, under the
//! run's `max_total_tokens` and its caller's `tokens_per_hour`. For the hourly budget the prompt
//! and that `max_tokens` are first *held* in the caller's hour, in the usage book every replica
//! shares, so runs asking at once cannot together spend past the budget; the turn's booking gives
//! the hold back as it adds what the turn spent. A hold whose run died before booking stays
//! counted until its hour ends.

use shared::sync::lock;

use super::{Driver, End, LoopDeps, Step};
use crate::domain::FailureReason;
use crate::domain::params::UNASKED_MAX_TOKENS_BOUND;
use crate::domain::ports::within;
use crate::domain::usage::{Add, HourlyBudget, Tally, WINDOW_MS, window_of};

/// Tokens held in a caller's hour for a turn under way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Hold {
    /// The hour (its start) holding them.
    window: u64,
    tokens: u64,
}

/// How many tokens a turn's completion may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Allowance {
    /// At most this many, by the run's own budget (a large one sets no `max_tokens`).
    Within(u64),
    /// Exactly this many were held in the caller's hour: `max_tokens` is set to at most them.
    Held(u64),
}

impl Driver<'_> {
    /// The tokens turn `number`'s completion may use once its prompt is counted, held in the
    /// caller's hour when it has a `tokens_per_hour`; `TOKEN_BUDGET` when nothing is left for a
    /// completion (the run ends before asking the model).
    pub(super) async fn allow_turn(&mut self, number: u32) -> Step<Allowance> {
        let prompt = self.progress.last_turn_tokens;
        let run_left = self.run_tokens_left();
        if run_left <= prompt {
            return Err(self.run_spent(number, prompt));
        }
        let Some(budget) = self.spec.hourly_budget else {
            return Ok(Allowance::Within(run_left - prompt));
        };
        let asked = self.spec.params.max_tokens.map_or(UNASKED_MAX_TOKENS_BOUND, u64::from);
        let completion = (run_left - prompt).min(asked);
        self.hold_in_hour(budget, prompt, completion).await.map(Allowance::Held)
    }

    /// Holds `prompt` and `completion` tokens in the caller's hour: the completion tokens the
    /// turn may use once what others spent and hold is counted. A book that cannot be reached
    /// lets the turn ask for `completion` unheld (logged), as it lets the run in.
    async fn hold_in_hour(&mut self, budget: HourlyBudget, prompt: u64, completion: u64) -> Step<u64> {
        let window = window_of(shared::sync::unix_ms());
        let tokens = prompt.saturating_add(completion);
        let mut change = Tally::hold(i64::try_from(tokens).unwrap_or(i64::MAX));
        let earlier = self.held.take();
        if let Some(earlier) = earlier {
            change.held_tokens += give_back(self.deps, &self.spec.principal, earlier, window).await;
        }
        let add = self.deps.usage.add(&self.spec.principal, window, change.into());
        let total = match within(self.deps.store_timeout, add).await {
            Ok(total) => total,
            Err(e) => {
                tracing::warn!(principal = %self.spec.principal, "the turn's tokens could not be held in the caller's hour: {e}");
                self.held = earlier.filter(|h| h.window == window);
                return Ok(completion);
            }
        };
        self.held = Some(Hold { window, tokens });
        let before = total.counted().saturating_sub(tokens);
        let left = budget.tokens_per_hour.saturating_sub(before);
        if left <= prompt {
            return Err(self.hour_spent(budget, window, before));
        }
        Ok(completion.min(left - prompt))
    }

    /// Adds the run's tokens not booked yet (the turn's, and any an earlier add failed to
    /// book) to the caller's spend this hour, giving back what the turn held; the hour as it
    /// then stands is judged once the turn's calls ran ([`Driver::within_hour`]). A store that
    /// does not take the add leaves the run going (logged): the next add books them. Only
    /// while this replica acts for the run.
    pub(super) async fn account_turn(&mut self) {
        // A replaced owner books nothing: the replica that took the run over books what its
        // checkpoint did not hold.
        if !self.acting() {
            return;
        }
        let now = lock(self.state).usage;
        let window = window_of(shared::sync::unix_ms());
        let mut change = Tally::of_tokens(&now.since(&self.progress.booked));
        let held = self.held.take();
        if let Some(held) = held {
            change.held_tokens += give_back(self.deps, &self.spec.principal, held, window).await;
        }
        let add = Add::of_run(change, &self.spec.run_id, now, false);
        let add = self.deps.usage.add(&self.spec.principal, window, add);
        let total = match within(self.deps.store_timeout, add).await {
            Ok(total) => total,
            Err(e) => {
                tracing::warn!(principal = %self.spec.principal, "the turn's tokens were not added to the caller's usage yet: {e}");
                self.held = held.filter(|h| h.window == window);
                return;
            }
        };
        self.progress.booked = now;
        self.hour_booked = Some((window, total));
    }

    /// `TOKEN_BUDGET` once the turn's booking went over the caller's `tokens_per_hour` (the
    /// turn that crossed it was the run's last: its output and tool results are kept).
    pub(super) fn within_hour(&mut self) -> Step<()> {
        match (self.hour_booked.take(), self.spec.hourly_budget) {
            (Some((window, total)), Some(budget)) if budget.left(&total) == 0 => {
                Err(self.hour_spent(budget, window, total.counted()))
            }
            _ => Ok(()),
        }
    }

    /// `TOKEN_BUDGET` once the run's tokens went over its `max_total_tokens`: the turn that
    /// crossed it was its last (its output and tool results are kept).
    pub(super) fn within_token_budget(&self) -> Step<()> {
        if self.run_tokens_left() > 0 {
            return Ok(());
        }
        let used = lock(self.state).usage;
        Err(End::Failed(
            FailureReason::TokenBudget,
            format!(
                "the run spent {} tokens ({} prompt, {} completion), over its limits.max_total_tokens of {}",
                used.prompt_tokens + used.completion_tokens,
                used.prompt_tokens,
                used.completion_tokens,
                self.spec.limits.max_total_tokens
            ),
        ))
    }

    /// The tokens the run may still spend: its `max_total_tokens` less its usage so far.
    fn run_tokens_left(&self) -> u64 {
        self.spec.limits.tokens_left(&lock(self.state).usage)
    }

    /// The end of a run whose `max_total_tokens` leaves nothing after turn `number`'s prompt.
    fn run_spent(&self, number: u32, prompt: u64) -> End {
        let used = lock(self.state).usage;
        End::Failed(
            FailureReason::TokenBudget,
            format!(
                "the run spent {} tokens of its limits.max_total_tokens of {}: turn {number}'s prompt, at least {prompt} tokens, leaves nothing for an answer",
                used.prompt_tokens + used.completion_tokens,
                self.spec.limits.max_total_tokens
            ),
        )
    }

    /// The end of a run whose caller's hour has `counted` tokens spent or held.
    fn hour_spent(&self, budget: HourlyBudget, window: u64, counted: u64) -> End {
        let resets = std::time::UNIX_EPOCH + std::time::Duration::from_millis(window + WINDOW_MS);
        End::Failed(
            FailureReason::TokenBudget,
            format!(
                "the caller {:?} spent or holds {counted} tokens this hour, which leaves nothing for this turn of its tokens_per_hour of {}; the budget resets at {}",
                self.spec.principal,
                budget.tokens_per_hour,
                humantime::format_rfc3339_seconds(resets)
            ),
        )
    }
}

/// Gives `held` back: the change to `window`'s next add's `held_tokens` (minus the tokens, when
/// they were held in that hour); else 0, given back by an add of their own to their hour (logged
/// when that fails: the hold then stays counted until its hour ends).
pub(super) async fn give_back(deps: &LoopDeps, principal: &str, held: Hold, window: u64) -> i64 {
    let back = -i64::try_from(held.tokens).unwrap_or(i64::MAX);
    if held.window == window {
        return back;
    }
    if let Err(e) = within(
        deps.store_timeout,
        deps.usage.add(principal, held.window, Tally::hold(back).into()),
    )
    .await
    {
        tracing::warn!(%principal, "the tokens held in the last hour were not given back: {e}");
    }
    0
}
