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
    /// Tokens left in a window that has spent `spent`.
    pub fn left(&self, spent: &Tally) -> u64 {
        self.tokens_per_hour.saturating_sub(spent.tokens())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
