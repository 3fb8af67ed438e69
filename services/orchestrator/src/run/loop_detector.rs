//! The repeated-line detector (docs/architecture.md, "The rules of the loop"): models sometimes loop, printing the same line
//! forever. The detector keeps the last `window` complete lines of the run's visible output and
//! trips when one trimmed, non-trivial line occurs `threshold` times among them.
//!
//! Non-trivial: at least [`MIN_LINE_CHARS`] characters after trimming, of which at least
//! [`MIN_ALNUM`] letters or digits — so code braces, Markdown rules and table separators never
//! count.

use std::collections::{HashMap, VecDeque};

use crate::domain::LoopDetection;

/// Shortest line (trimmed, in characters) that counts.
pub const MIN_LINE_CHARS: usize = 8;
/// Fewest letters or digits in a line that counts.
pub const MIN_ALNUM: usize = 4;
/// Longest line kept for comparison (longer lines are compared by their prefix).
const MAX_LINE_BYTES: usize = 4096;

/// The detector's state for one run.
#[derive(Debug, Clone)]
pub struct LoopDetector {
    config: LoopDetection,
    partial: String,
    window: VecDeque<Option<String>>,
    counts: HashMap<String, usize>,
}

impl LoopDetector {
    /// A detector with no history.
    pub fn new(config: LoopDetection) -> Self {
        Self {
            config,
            partial: String::new(),
            window: VecDeque::new(),
            counts: HashMap::new(),
        }
    }

    /// Feeds visible text; once a line reaches the threshold, returns it with the length of the
    /// prefix of `text` that ends with it (the output to keep).
    pub fn feed(&mut self, text: &str) -> Option<(String, usize)> {
        let mut consumed = 0;
        for piece in text.split_inclusive('\n') {
            consumed += piece.len();
            if self.partial.len() < MAX_LINE_BYTES {
                let room = MAX_LINE_BYTES - self.partial.len();
                self.partial.push_str(shared::text::truncate(piece, room));
            }
            if piece.ends_with('\n') {
                let line = std::mem::take(&mut self.partial);
                if let Some(hit) = self.complete_line(&line) {
                    return Some((hit, consumed));
                }
            }
        }
        None
    }

    fn complete_line(&mut self, line: &str) -> Option<String> {
        let trimmed = line.trim();
        let counted = (trimmed.chars().count() >= MIN_LINE_CHARS
            && trimmed.chars().filter(|c| c.is_alphanumeric()).count() >= MIN_ALNUM)
            .then(|| trimmed.to_owned());
        if self.window.len() == self.config.window
            && let Some(Some(old)) = self.window.pop_front()
            && let Some(n) = self.counts.get_mut(&old)
        {
            *n -= 1;
            if *n == 0 {
                self.counts.remove(&old);
            }
        }
        self.window.push_back(counted.clone());
        let line = counted?;
        let n = self.counts.entry(line.clone()).or_insert(0);
        *n += 1;
        (*n >= self.config.threshold).then_some(line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detector(window: usize, threshold: usize) -> LoopDetector {
        LoopDetector::new(LoopDetection { window, threshold })
    }

    #[test]
    fn trips_exactly_at_the_threshold() {
        let mut d = detector(10, 3);
        assert_eq!(d.feed("I will check the weather.\n"), None);
        assert_eq!(d.feed("I will check the weather.\nI will check"), None);
        assert_eq!(
            d.feed(" the weather.\nmore"),
            Some(("I will check the weather.".into(), 14))
        );
    }

    #[test]
    fn lines_falling_out_of_the_window_stop_counting() {
        let mut d = detector(3, 3);
        let line = "the same line again\n";
        assert_eq!(d.feed(line), None);
        assert_eq!(d.feed(line), None);
        assert_eq!(d.feed("something different here\n"), None);
        assert_eq!(d.feed("and something else too\n"), None);
        assert_eq!(d.feed(line), None, "the first two fell out of the window");
    }

    #[test]
    fn trivial_lines_never_count() {
        let mut d = detector(100, 2);
        for line in [
            "}\n",
            "}\n",
            "---------\n",
            "---------\n",
            "| --- | --- |\n",
            "| --- | --- |\n",
            "\n",
            "\n",
        ] {
            assert_eq!(d.feed(line), None);
        }
    }

    #[test]
    fn an_endless_line_uses_bounded_memory() {
        let mut d = detector(10, 2);
        for _ in 0..1000 {
            assert_eq!(d.feed(&"x".repeat(1000)), None);
        }
        assert!(d.partial.len() <= MAX_LINE_BYTES);
    }
}
