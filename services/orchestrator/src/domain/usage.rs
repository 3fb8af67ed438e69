//! What each principal spends, added up in the store per hour ([`Tally`] per window): tokens
//! (prompt, of them cached, completion), tool calls, runs ended and their time. A run adds each
//! turn's tokens as the turn ends and its calls, itself and its time as it ends, so a
//! principal's `tokens_per_hour` (tokens file) is held across the fleet. An add names the run it
//! books and the run's tokens through it ([`RunMark`]), and a window keeps the runs that booked
//! into it last ([`Window`]): an add made again (its answer lost, or a takeover booking what its
//! checkpoint did not hold) adds only what the window has not had of that run, so a run's spend
//! is what its result counts, not what its owners together booked.

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

/// The runs a window remembers: an add of a run it forgot books at least once (never less).
pub const RECENT_RUNS: usize = 32;

/// The run an add books, as far as it then stood.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunMark {
    /// The run: the window remembers how far it booked each.
    pub run_id: String,
    /// The run's tokens through this add, over its whole life (its state's count).
    pub through: super::chat::Usage,
    /// The add is the run's end (its calls, itself and its time, booked once).
    pub ended: bool,
}

/// One add to a window: a change, and the run whose booking it moves on (none for a hold).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Add {
    /// What the add adds, before what the window already had of its run is taken off.
    pub change: Tally,
    /// The run it books, if it books one (a hold, or its giving back, books none).
    pub run: Option<RunMark>,
}

impl Add {
    /// `change`, booking run `run_id` through `through` (`ended`: the run's end).
    pub fn of_run(change: Tally, run_id: &str, through: super::chat::Usage, ended: bool) -> Self {
        let run = RunMark {
            run_id: run_id.to_owned(),
            through,
            ended,
        };
        Self { change, run: Some(run) }
    }
}

impl From<Tally> for Add {
    fn from(change: Tally) -> Self {
        Self { change, run: None }
    }
}

/// A window as the book keeps it: its total, and how far each run that booked into it last
/// (at most [`RECENT_RUNS`], oldest first) was booked.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Window {
    /// What the window spent: its value before adds named their run, so it still reads.
    #[serde(flatten)]
    pub total: Tally,
    /// How far the runs that booked into it last were booked.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub booked: Vec<Booked>,
}

/// How far one run was booked into a window.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Booked {
    /// The run.
    pub run_id: String,
    /// The furthest an add booked it through.
    pub through: super::chat::Usage,
    /// Its end was booked.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ended: bool,
}

impl Window {
    /// Whether the window keeps how far run `run_id` was booked.
    pub fn knows(&self, run_id: &str) -> bool {
        self.booked.iter().any(|b| b.run_id == run_id)
    }

    /// Applies `add` as [`Window::apply`] does, a run this window does not know yet taken as
    /// booked as far as the window before it (`earlier`) booked it: an add made again after the
    /// hour turned (its answer lost, or a takeover's catch-up from an older checkpoint) adds
    /// only what neither window had, and a run's end counts once across both.
    pub fn apply_after(&mut self, earlier: Option<&Window>, add: &Add) -> Tally {
        if let Some(run) = &add.run
            && !self.knows(&run.run_id)
            && let Some(before) = earlier.and_then(|e| e.booked.iter().find(|b| b.run_id == run.run_id))
        {
            // `apply` takes the entry out and keeps it again within `RECENT_RUNS`.
            self.booked.push(before.clone());
        }
        self.apply(add)
    }

    /// Applies `add`: its change, less what the window already had of its run (tokens past the
    /// furthest this window booked the run through; its end once); the total after it.
    pub fn apply(&mut self, add: &Add) -> Tally {
        let mut change = add.change;
        if let Some(run) = &add.run {
            let booked = self.take_booked(run);
            change.prompt_tokens = past(
                run.through.prompt_tokens,
                change.prompt_tokens,
                booked.through.prompt_tokens,
            );
            change.completion_tokens = past(
                run.through.completion_tokens,
                change.completion_tokens,
                booked.through.completion_tokens,
            );
            change.cached_prompt_tokens = past(
                run.through.cached_prompt_tokens,
                change.cached_prompt_tokens,
                booked.through.cached_prompt_tokens,
            );
            if booked.ended {
                (change.tool_calls, change.runs, change.run_ms) = (0, 0, 0);
            }
            self.keep_booked(run, booked);
        }
        self.total.add(&change);
        self.total
    }

    /// The run's entry, out of the list (one not kept: nothing booked, so the add counts whole).
    fn take_booked(&mut self, run: &RunMark) -> Booked {
        match self.booked.iter().position(|b| b.run_id == run.run_id) {
            Some(at) => self.booked.remove(at),
            None => Booked {
                run_id: run.run_id.clone(),
                ..Booked::default()
            },
        }
    }

    /// Puts the run's entry back, newest, moved on to `run`, forgetting the oldest past
    /// [`RECENT_RUNS`].
    fn keep_booked(&mut self, run: &RunMark, mut booked: Booked) {
        let (was, now) = (booked.through, run.through);
        booked.through = super::chat::Usage {
            prompt_tokens: was.prompt_tokens.max(now.prompt_tokens),
            completion_tokens: was.completion_tokens.max(now.completion_tokens),
            cached_prompt_tokens: was.cached_prompt_tokens.max(now.cached_prompt_tokens),
        };
        booked.ended |= run.ended;
        self.booked.push(booked);
        if self.booked.len() > RECENT_RUNS {
            self.booked.remove(0);
        }
    }
}

/// Of an add of `change` tokens bringing a run to `through`, those past `booked` (where the
/// window had the run already).
fn past(through: u64, change: u64, booked: u64) -> u64 {
    through.saturating_sub(booked.max(through.saturating_sub(change)))
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
    fn an_add_made_again_after_the_hour_turned_books_only_what_neither_window_had() {
        let mut earlier = Window::default();
        earlier.apply(&Add::of_run(Tally::of_tokens(&prompt(100)), "r", prompt(100), false));
        earlier.apply(&Add::of_run(Tally::of_tokens(&prompt(50)), "r", prompt(150), false));
        // A takeover from the checkpoint that held 100 books the turn again, in the next hour.
        let again = Add::of_run(Tally::of_tokens(&prompt(50)), "r", prompt(150), false);
        let mut next = Window::default();
        assert_eq!(next.apply_after(Some(&earlier), &again).prompt_tokens, 0);
        // Its next turn books whole, and a run the earlier window never had books whole too.
        let turn = Add::of_run(Tally::of_tokens(&prompt(60)), "r", prompt(210), false);
        assert_eq!(next.apply_after(Some(&earlier), &turn).prompt_tokens, 60);
        let other = Add::of_run(Tally::of_tokens(&prompt(30)), "s", prompt(30), false);
        assert_eq!(next.apply_after(Some(&earlier), &other).prompt_tokens, 90);
        // Without the earlier window (what the book did before), the turn was booked twice.
        let mut blind = Window::default();
        assert_eq!(blind.apply(&again).prompt_tokens, 50);
    }

    fn prompt(tokens: u64) -> crate::domain::chat::Usage {
        crate::domain::chat::Usage {
            prompt_tokens: tokens,
            ..crate::domain::chat::Usage::default()
        }
    }

    fn turn(run_id: &str, through: u64, change: u64) -> Add {
        Add::of_run(Tally::of_tokens(&prompt(change)), run_id, prompt(through), false)
    }

    #[test]
    fn an_add_made_again_books_only_what_the_window_has_not_had_of_its_run() {
        let mut window = Window::default();
        // Turn 1 (100) booked, its answer lost; the next add books turns 1 and 2 (100 + 50).
        window.apply(&turn("r", 100, 100));
        assert_eq!(window.apply(&turn("r", 150, 150)).prompt_tokens, 150);
        // A takeover from the checkpoint before turn 1 books both again, then turn 3 (30).
        assert_eq!(window.apply(&turn("r", 150, 150)).prompt_tokens, 150);
        assert_eq!(window.apply(&turn("r", 180, 30)).prompt_tokens, 180);
        // Another run's adds are its own.
        assert_eq!(window.apply(&turn("s", 40, 40)).prompt_tokens, 220);
        // The end is booked once, however often it is added.
        let ended = Tally {
            runs: 1,
            tool_calls: 3,
            ..Tally::default()
        };
        let end = Add::of_run(ended, "r", prompt(180), true);
        window.apply(&end);
        let total = window.apply(&end);
        assert_eq!((total.runs, total.tool_calls, total.prompt_tokens), (1, 3, 220));
    }

    #[test]
    fn a_window_forgets_its_oldest_runs_and_then_books_them_at_least_once() {
        let mut window = Window::default();
        for n in 0..=RECENT_RUNS {
            window.apply(&turn(&format!("r{n}"), 10, 10));
        }
        assert_eq!(window.booked.len(), RECENT_RUNS);
        assert!(window.booked.iter().all(|b| b.run_id != "r0"));
        let before = window.total.prompt_tokens;
        assert_eq!(window.apply(&turn("r0", 10, 10)).prompt_tokens, before + 10);
        // An old window's value (a bare total) still reads.
        let old: Window = serde_json::from_str(
            r#"{"prompt_tokens":5,"cached_prompt_tokens":0,"completion_tokens":1,"tool_calls":0,"runs":0,"run_ms":0}"#,
        )
        .unwrap_or_default();
        assert_eq!(old.total.prompt_tokens, 5);
    }

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
