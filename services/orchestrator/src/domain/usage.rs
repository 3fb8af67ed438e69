//! What each principal spends, added up in the store per hour ([`Tally`] per window): tokens
//! (prompt, of them cached, completion), tool calls, runs ended and their time. A run adds each
//! turn's tokens as the turn ends and its calls, itself and its time as it ends, so a
//! principal's `tokens_per_hour` (tokens file) is held across the fleet. A turn run twice (a run
//! taken over redoes the turn its old owner did not checkpoint) is counted twice: its tokens were
//! spent twice.

/// The length of a usage window: an hour.
pub const WINDOW_MS: u64 = 3_600_000;

/// The start of the window holding `unix_ms`.
pub fn window_of(unix_ms: u64) -> u64 {
    unix_ms - unix_ms % WINDOW_MS
}

/// A principal's spend in a window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Tally {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Of them, taken from the model server's prefix cache.
    pub cached_prompt_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// Normal tool calls.
    pub tool_calls: u64,
    /// Runs that ended.
    pub runs: u64,
    /// Their time, admission to end (ms).
    pub run_ms: u64,
    /// Tokens held for turns under way (each its prompt and its `max_tokens`) and not yet given
    /// back by the turn booking what it spent: a budget counts them, so runs asking at once
    /// cannot together spend past it. In a change, negative gives a hold back; a total never
    /// goes below 0 ([`Tally::add`] clamps, so a change is made by setting this field).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub held_tokens: i64,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

impl Tally {
    /// A turn's tokens.
    pub fn of_tokens(usage: &super::chat::Usage) -> Self {
        Self {
            prompt_tokens: usage.prompt_tokens,
            cached_prompt_tokens: usage.cached_prompt_tokens,
            completion_tokens: usage.completion_tokens,
            ..Self::default()
        }
    }

    /// Adds `other`.
    pub fn add(&mut self, other: &Self) {
        self.prompt_tokens = self.prompt_tokens.saturating_add(other.prompt_tokens);
        self.cached_prompt_tokens = self.cached_prompt_tokens.saturating_add(other.cached_prompt_tokens);
        self.completion_tokens = self.completion_tokens.saturating_add(other.completion_tokens);
        self.tool_calls = self.tool_calls.saturating_add(other.tool_calls);
        self.runs = self.runs.saturating_add(other.runs);
        self.run_ms = self.run_ms.saturating_add(other.run_ms);
        self.held_tokens = self.held_tokens.saturating_add(other.held_tokens).max(0);
    }

    /// A change holding `tokens` (negative: giving them back).
    pub fn hold(tokens: i64) -> Self {
        Self {
            held_tokens: tokens,
            ..Self::default()
        }
    }

    /// Tokens a budget counts as gone: those spent and those held.
    pub fn counted(&self) -> u64 {
        self.tokens()
            .saturating_add(u64::try_from(self.held_tokens).unwrap_or(0))
    }

    /// Tokens a budget counts: prompt and completion.
    pub fn tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }
}

/// A principal's budget of tokens per window, as a run carries it (the tokens file is not read
/// again on the replica that takes the run over).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HourlyBudget {
    /// Tokens per window.
    pub tokens_per_hour: u64,
}

impl HourlyBudget {
    /// Tokens left in a window that has spent (or holds) `spent`.
    pub fn left(&self, spent: &Tally) -> u64 {
        self.tokens_per_hour.saturating_sub(spent.counted())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_count_against_a_budget_and_give_back_no_more_than_they_hold() {
        let budget = HourlyBudget { tokens_per_hour: 100 };
        let mut hour = Tally::of_tokens(&crate::domain::chat::Usage {
            prompt_tokens: 30,
            completion_tokens: 10,
            cached_prompt_tokens: 0,
        });
        hour.add(&Tally::hold(50));
        assert_eq!((hour.tokens(), hour.counted(), budget.left(&hour)), (40, 90, 10));
        hour.add(&Tally::hold(-80));
        assert_eq!((hour.held_tokens, budget.left(&hour)), (0, 60));
        let text = serde_json::to_string(&Tally::default()).unwrap();
        assert!(
            !text.contains("held"),
            "a window without holds is written as before: {text}"
        );
    }

    #[test]
    fn windows_are_hours_and_spend_adds_up() {
        assert_eq!(window_of(7_199_999), 3_600_000);
        assert_eq!(window_of(7_200_000), 7_200_000);
        let mut spend = Tally::of_tokens(&crate::domain::chat::Usage {
            prompt_tokens: 10,
            completion_tokens: 5,
            cached_prompt_tokens: 4,
        });
        spend.add(&Tally {
            tool_calls: 2,
            runs: 1,
            run_ms: 30,
            ..Tally::default()
        });
        assert_eq!((spend.tokens(), spend.tool_calls, spend.runs), (15, 2, 1));
        let budget = HourlyBudget { tokens_per_hour: 20 };
        assert_eq!(budget.left(&spend), 5);
        spend.add(&spend.clone());
        assert_eq!(budget.left(&spend), 0);
    }
}
