//! What each tool-runner listed last. Runners behind one `--tool-runner` that serve different
//! tools make the catalog follow whichever answered its refresh, and a call of a tool one of
//! them lacks fails there: each change of the catalog this causes is said in a warning. A
//! refresh asks another runner than the last one first, so a disagreement shows within a few
//! refreshes rather than by chance.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

/// How many names of a difference a warning shows.
const SHOWN: usize = 8;

/// Each endpoint's tool names as its last `ListTools` answered (endpoints of the pool only).
#[derive(Default)]
pub(super) struct Listings {
    by_endpoint: Mutex<BTreeMap<String, BTreeSet<String>>>,
    last: Mutex<Option<String>>,
}

impl Listings {
    /// The endpoint that answered the last fetch.
    pub(super) fn last_answerer(&self) -> Option<String> {
        shared::sync::lock(&self.last).clone()
    }

    /// Keeps `names` as `endpoint`'s listing (forgetting endpoints not among `members`); the
    /// warning when another member listed other tools.
    pub(super) fn record(&self, endpoint: &str, names: BTreeSet<String>, members: &[String]) -> Option<String> {
        *shared::sync::lock(&self.last) = Some(endpoint.to_owned());
        let mut by_endpoint = shared::sync::lock(&self.by_endpoint);
        by_endpoint.retain(|uri, _| members.contains(uri));
        let warning = by_endpoint
            .iter()
            .find(|(uri, listed)| uri.as_str() != endpoint && **listed != names)
            .map(|(other, listed)| disagreement(endpoint, &names, other, listed));
        by_endpoint.insert(endpoint.to_owned(), names);
        warning
    }
}

/// The warning for `a` listing `ours` where `b` listed `theirs`.
fn disagreement(a: &str, ours: &BTreeSet<String>, b: &str, theirs: &BTreeSet<String>) -> String {
    let only = |x: &BTreeSet<String>, y: &BTreeSet<String>| {
        let names: Vec<&str> = x.difference(y).map(String::as_str).collect();
        let more = names.len().saturating_sub(SHOWN);
        let mut shown = names.into_iter().take(SHOWN).collect::<Vec<_>>().join(", ");
        if more > 0 {
            shown.push_str(&format!(" and {more} more"));
        }
        if shown.is_empty() { "none".to_owned() } else { shown }
    };
    format!(
        "tool-runners serve different tools: only {a} lists {}; only {b} lists {}. The tool \
         catalog follows whichever runner answers its refresh (--tool-refresh-interval), and a \
         call of a tool one runner lacks fails there: serve the same tools on every runner \
         behind --tool-runner",
        only(ours, theirs),
        only(theirs, ours)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn runners_that_list_other_tools_are_named_with_what_only_each_lists() {
        let listings = Listings::default();
        let members = ["http://a".to_owned(), "http://b".to_owned()];
        assert_eq!(listings.record("http://a", names(&["echo", "sleep"]), &members), None);
        assert_eq!(listings.record("http://a", names(&["echo", "sleep"]), &members), None);
        let warning = listings.record("http://b", names(&["echo", "refund"]), &members);
        let warning = warning.unwrap_or_default();
        assert!(
            warning.contains("only http://b lists refund; only http://a lists sleep"),
            "{warning}"
        );
        assert_eq!(listings.last_answerer().as_deref(), Some("http://b"));
        // A runner gone from the pool is forgotten.
        assert_eq!(
            listings.record("http://b", names(&["echo", "refund"]), &members[1..]),
            None
        );
    }
}
