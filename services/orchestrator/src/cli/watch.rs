//! `--watch` of `runs` and `approvals`: after the listing, list again at a pace and print what
//! changed (as `kubectl get --watch` does), until interrupted. Only the last listing is kept, so
//! memory stays within one page however long it watches.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use clap::Args;

use crate::Error;

/// The slowest and fastest pace `--watch-every` takes.
const PACE: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(60));

/// Flags of a listing that can be watched.
#[derive(Debug, Clone, Args)]
pub struct WatchArgs {
    /// After the listing, keep listing and print each row that is new or changed (and, for
    /// approvals, each call that no longer waits) until interrupted (Ctrl-C).
    #[arg(long, short = 'w')]
    pub watch: bool,
    /// How often --watch lists again (100ms to 1m).
    #[arg(long, default_value = "2s", value_name = "SPAN", value_parser = watch_every)]
    pub watch_every: Duration,
}

fn watch_every(text: &str) -> Result<Duration, String> {
    let every = shared::config::parse_duration(text)?;
    match every {
        every if every < PACE.0 => Err(format!("{text}: list at most every {:?}", PACE.0)),
        every if every > PACE.1 => Err(format!("{text}: list at least every {:?}", PACE.1)),
        every => Ok(every),
    }
}

/// What one listing shows that the one before did not.
pub enum Change<'a, T> {
    /// A row the listing before did not have, or had otherwise.
    New(&'a T),
    /// A row the listing before had and this one does not.
    Gone(&'a T),
}

/// Lists with `list` every `every`, forever (until `list` fails or the reader goes away), and
/// hands `show` each [`Change`] from the listing before, rows keyed by `key`; `first` is the
/// listing already printed.
pub async fn changes<T, K, L, F>(
    every: Duration,
    first: Vec<T>,
    key: impl Fn(&T) -> K,
    mut list: L,
    mut show: impl FnMut(Change<'_, T>),
) -> Result<(), Error>
where
    T: PartialEq,
    K: Ord,
    L: FnMut() -> F,
    F: Future<Output = Result<Vec<T>, Error>>,
{
    let mut before: BTreeMap<K, T> = first.into_iter().map(|row| (key(&row), row)).collect();
    loop {
        tokio::time::sleep(every).await;
        let now: BTreeMap<K, T> = list().await?.into_iter().map(|row| (key(&row), row)).collect();
        for (k, row) in &now {
            if before.get(k) != Some(row) {
                show(Change::New(row));
            }
        }
        for (k, row) in &before {
            if !now.contains_key(k) {
                show(Change::Gone(row));
            }
        }
        before = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pace_outside_its_bounds_is_refused_and_one_inside_taken() {
        assert!(watch_every("50ms").is_err());
        assert_eq!(watch_every("100ms"), Ok(Duration::from_millis(100)));
        assert_eq!(watch_every("1m"), Ok(Duration::from_secs(60)));
        assert!(watch_every("61s").is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn new_changed_and_gone_rows_are_shown_once_each() {
        // Popped from the end: b changes and c comes, then both go.
        let listings = std::sync::Mutex::new(vec![vec![(1, "a")], vec![(1, "a"), (2, "b2"), (3, "c")]]);
        let mut shown = Vec::new();
        let ended = changes(
            Duration::from_secs(1),
            vec![(1, "a"), (2, "b")],
            |row: &(i32, &str)| row.0,
            || {
                let next = listings.lock().map(|mut l| l.pop());
                async move { next.ok().flatten().ok_or_else(|| Error::Config("done".into())) }
            },
            |change| match change {
                Change::New(row) => shown.push(format!("new {}", row.1)),
                Change::Gone(row) => shown.push(format!("gone {}", row.1)),
            },
        )
        .await;
        assert!(ended.is_err());
        assert_eq!(shown, ["new b2", "new c", "gone b2", "gone c"]);
    }
}
