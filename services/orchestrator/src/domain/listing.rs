//! Finding runs (`ListRuns`): what a query asks ([`RunQuery`]), what a row shows
//! ([`RunSummary`]), a page of rows and the cursor that continues it, and a run's labels and
//! their rules. A query only ever sees the runs its caller may see: the adapters are given the
//! principal to list, never trust an index for it, and check each row against the run's record.

use std::collections::BTreeMap;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use super::chat::Usage;
use super::result::{FailureReason, RunResult, RunStatus};

/// The longest label key: a name as Kubernetes labels spell them.
pub const MAX_LABEL_KEY_LEN: usize = 63;

/// What a run waits for, besides running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WaitingFor {
    /// Nothing: it runs, or it ended.
    #[default]
    Nothing,
    /// A person's decision on its tool calls.
    Approval,
    /// A person's (or the caller's) answer to a tool's question.
    Input,
    /// A task one of its calls became (its tool's server runs the call in the background).
    Task,
    /// Its thread, held by another run.
    Thread,
}

/// One row of a listing: what a person scanning runs needs, not the run's output.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    /// The run.
    pub run_id: String,
    /// Its status.
    pub status: RunStatus,
    /// Why it failed.
    pub failure_reason: Option<FailureReason>,
    /// Its owner.
    pub principal: String,
    /// Its thread (empty: none).
    pub thread_id: String,
    /// Its caller's labels.
    pub labels: BTreeMap<String, String>,
    /// When it was admitted (Unix ms, the admitting replica's clock).
    pub created_at_ms: u64,
    /// When its state was last written (Unix ms).
    pub updated_at_ms: u64,
    /// Turns started.
    pub turns: u32,
    /// Its tokens so far.
    pub usage: Usage,
    /// Normal tool calls so far.
    pub tool_calls: u32,
    /// What it waits for.
    pub waiting_for: WaitingFor,
    /// Its named agent.
    pub agent: Option<super::agent::AgentRef>,
    /// What it was asked (`RunResult::prompt`).
    pub prompt: String,
}

impl From<&RunResult> for RunSummary {
    fn from(run: &RunResult) -> Self {
        Self {
            run_id: run.run_id.clone(),
            status: run.status,
            failure_reason: run.failure_reason,
            principal: run.principal.clone(),
            thread_id: run.thread_id.clone(),
            labels: run.labels.clone(),
            created_at_ms: run.created_at_ms,
            updated_at_ms: run.updated_at_ms,
            turns: run.turns,
            usage: run.usage,
            tool_calls: u32::try_from(run.tool_calls.len()).unwrap_or(u32::MAX),
            waiting_for: match run.status {
                RunStatus::AwaitingApproval => WaitingFor::Approval,
                RunStatus::AwaitingInput => WaitingFor::Input,
                RunStatus::AwaitingTask => WaitingFor::Task,
                _ => WaitingFor::Nothing,
            },
            agent: run.agent.clone(),
            prompt: run.prompt.clone(),
        }
    }
}

/// What a caller asks of `ListRuns`, before it is scoped to what the caller may see.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ListRequest {
    /// Any of these statuses (empty: any).
    pub statuses: Vec<RunStatus>,
    /// Only this thread's runs.
    pub thread_id: Option<String>,
    /// Only this principal's runs.
    pub principal: Option<String>,
    /// Runs carrying every one of these labels.
    pub labels: BTreeMap<String, String>,
    /// Runs admitted at or after this (Unix ms).
    pub created_after_ms: Option<u64>,
    /// Runs admitted before this (Unix ms).
    pub created_before_ms: Option<u64>,
    /// Only this named agent's runs.
    pub agent: Option<String>,
    /// Rows asked for (0: the default).
    pub page_size: usize,
    /// The previous page's token.
    pub page_token: Option<String>,
}

/// What a caller asks of `ListRuns`, already scoped to what it may see.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunQuery {
    /// Any of these statuses (empty: any).
    pub statuses: Vec<RunStatus>,
    /// Only this thread's runs.
    pub thread_id: Option<String>,
    /// Only this principal's runs (`None`: every principal's, for an operator or a server
    /// without authentication).
    pub principal: Option<String>,
    /// Runs carrying every one of these labels.
    pub labels: BTreeMap<String, String>,
    /// Runs admitted at or after this (Unix ms).
    pub created_after_ms: Option<u64>,
    /// Runs admitted before this (Unix ms).
    pub created_before_ms: Option<u64>,
    /// Only this named agent's runs.
    pub agent: Option<String>,
    /// The most rows of the page.
    pub page_size: usize,
    /// Where the previous page ended.
    pub after: Option<Cursor>,
}

impl RunQuery {
    /// Whether the query asks only for live runs: the fleet's live runs are few, and are
    /// listed from where they are kept rather than from every run ever stored.
    pub fn live_only(&self) -> bool {
        !self.statuses.is_empty() && self.statuses.iter().all(|s| s.is_live())
    }

    /// Whether `run` is one the query asks for (its cursor aside).
    pub fn matches(&self, run: &RunSummary) -> bool {
        (self.statuses.is_empty() || self.statuses.contains(&run.status))
            && self.principal.as_ref().is_none_or(|p| *p == run.principal)
            && self.thread_id.as_ref().is_none_or(|t| *t == run.thread_id)
            && self
                .agent
                .as_ref()
                .is_none_or(|a| run.agent.as_ref().is_some_and(|run| run.name == *a))
            && self.admits(run.created_at_ms, &run.labels)
    }

    /// Whether a run admitted at `created_at_ms` with `labels` may match (what an index entry
    /// holds of a run: its status is read from its record).
    pub fn admits(&self, created_at_ms: u64, labels: &BTreeMap<String, String>) -> bool {
        self.created_after_ms.is_none_or(|after| created_at_ms >= after)
            && self.created_before_ms.is_none_or(|before| created_at_ms < before)
            && self.labels.iter().all(|(k, v)| labels.get(k) == Some(v))
    }

    /// What a cursor of this query is bound to: its filters, not its page size. A token made by
    /// one query never continues another (any replica computes the same fingerprint).
    pub fn fingerprint(&self) -> u64 {
        let mut statuses: Vec<String> = self.statuses.iter().map(|s| format!("{s:?}")).collect();
        statuses.sort();
        let mut text = format!(
            "{statuses:?}|{:?}|{:?}|{:?}|{:?}",
            self.thread_id, self.principal, self.created_after_ms, self.created_before_ms
        );
        // Added after the others, so that the tokens of a listing without it stay as they were.
        if let Some(agent) = &self.agent {
            text.push_str(&format!("|agent={agent}"));
        }
        for (k, v) in &self.labels {
            text.push_str(&format!("|{k}={v}"));
        }
        shared::text::fnv1a(text.as_bytes())
    }

    /// The rows of a page out of `rows` (any order; each run once): those matching the query
    /// after its cursor, newest first (by admission, then run id), at most a page; and the
    /// cursor after the last when more remain.
    pub fn page_of(&self, rows: impl IntoIterator<Item = RunSummary>) -> RunPage {
        let after = match &self.after {
            Some(Cursor::Created { created_at_ms, run_id }) => Some((*created_at_ms, run_id.as_str())),
            _ => None,
        };
        let mut rows: Vec<RunSummary> = rows
            .into_iter()
            .filter(|r| self.matches(r))
            .filter(|r| after.is_none_or(|a| (r.created_at_ms, r.run_id.as_str()) < a))
            .collect();
        rows.sort_by(|a, b| (b.created_at_ms, &b.run_id).cmp(&(a.created_at_ms, &a.run_id)));
        let more = rows.len() > self.page_size;
        rows.truncate(self.page_size);
        let next = match (more, rows.last()) {
            (true, Some(last)) => Some(Cursor::Created {
                created_at_ms: last.created_at_ms,
                run_id: last.run_id.clone(),
            }),
            _ => None,
        };
        RunPage { runs: rows, next }
    }
}

/// A page of runs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunPage {
    /// Its rows, newest first.
    pub runs: Vec<RunSummary>,
    /// Where the next page starts (`None`: this was the last).
    pub next: Option<Cursor>,
}

/// Where a page ended, as the backend that listed it continues: after a row in admission order,
/// or below a position in each shard of a store's index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cursor {
    /// After the run admitted at `created_at_ms` with `run_id` (newest first).
    Created {
        /// Its admission time.
        created_at_ms: u64,
        /// Its id (orders runs admitted in the same millisecond).
        run_id: String,
    },
    /// Below these positions of the store's index, one per shard in shard order.
    Positions(Vec<u64>),
}

/// Positions a page token may hold: one per shard of a store, whose shards are at most this many.
const MAX_CURSOR_POSITIONS: usize = 64;

/// Why a page token is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CursorError {
    /// Not a token this server made.
    #[error("page_token is not a token ListRuns returned")]
    Malformed,
    /// A token of a query with other filters.
    #[error("page_token belongs to a listing with other filters; send the same filters with it, or start without it")]
    OtherQuery,
}

impl Cursor {
    /// The opaque token a caller sends back for the next page of `query`.
    pub fn token(&self, query: &RunQuery) -> String {
        let fingerprint = query.fingerprint();
        let text = match self {
            Self::Created { created_at_ms, run_id } => format!("1|{fingerprint:x}|c|{created_at_ms}|{run_id}"),
            Self::Positions(positions) => {
                let positions: Vec<String> = positions.iter().map(u64::to_string).collect();
                format!("1|{fingerprint:x}|p|{}", positions.join(","))
            }
        };
        URL_SAFE_NO_PAD.encode(text)
    }

    /// The cursor in `token`, which must have been made for a query with `query`'s filters.
    pub fn parse(token: &str, query: &RunQuery) -> Result<Self, CursorError> {
        let bytes = URL_SAFE_NO_PAD.decode(token).map_err(|_| CursorError::Malformed)?;
        let text = String::from_utf8(bytes).map_err(|_| CursorError::Malformed)?;
        let mut parts = text.splitn(5, '|');
        let (Some("1"), Some(fingerprint), Some(kind)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(CursorError::Malformed);
        };
        if u64::from_str_radix(fingerprint, 16).map_err(|_| CursorError::Malformed)? != query.fingerprint() {
            return Err(CursorError::OtherQuery);
        }
        let number = |part: Option<&str>| part.and_then(|p| p.parse::<u64>().ok()).ok_or(CursorError::Malformed);
        match kind {
            "c" => {
                let created_at_ms = number(parts.next())?;
                let run_id = parts.next().filter(|id| !id.is_empty()).ok_or(CursorError::Malformed)?;
                Ok(Self::Created {
                    created_at_ms,
                    run_id: run_id.to_owned(),
                })
            }
            "p" => {
                let positions = parts.next().ok_or(CursorError::Malformed)?.split(',');
                let positions = positions.map(|p| number(Some(p))).collect::<Result<Vec<_>, _>>()?;
                match positions.len() {
                    1..=MAX_CURSOR_POSITIONS => Ok(Self::Positions(positions)),
                    _ => Err(CursorError::Malformed),
                }
            }
            _ => Err(CursorError::Malformed),
        }
    }
}

/// Why a run's labels are refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    /// Too many.
    #[error("{count} labels; at most {max} (--max-labels)")]
    TooMany {
        /// Given.
        count: usize,
        /// Allowed.
        max: usize,
    },
    /// A key that is not a name.
    #[error(
        "label key {0:?} must be 1-63 characters of letters, digits, '-', '_', '.', '/', starting and ending with a letter or digit"
    )]
    Key(String),
    /// A value too long or with control characters.
    #[error("the value of label {key:?} must be at most {max} bytes without control characters (--max-label-bytes)")]
    Value {
        /// Its key.
        key: String,
        /// Allowed bytes.
        max: usize,
    },
}

/// Checks a run's (or a query's) labels: at most `max_labels`, each key a name, each value at
/// most `max_value_bytes` without control characters.
pub fn check_labels(
    labels: &BTreeMap<String, String>,
    max_labels: usize,
    max_value_bytes: usize,
) -> Result<(), LabelError> {
    if labels.len() > max_labels {
        return Err(LabelError::TooMany {
            count: labels.len(),
            max: max_labels,
        });
    }
    for (key, value) in labels {
        if !label_key(key) {
            return Err(LabelError::Key(key.clone()));
        }
        if value.len() > max_value_bytes || value.chars().any(char::is_control) {
            return Err(LabelError::Value {
                key: key.clone(),
                max: max_value_bytes,
            });
        }
    }
    Ok(())
}

/// Whether `key` is a label name.
fn label_key(key: &str) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    (1..=MAX_LABEL_KEY_LEN).contains(&key.len())
        && edge(key.chars().next())
        && edge(key.chars().last())
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, created: u64, status: RunStatus) -> RunSummary {
        let mut run = RunResult::running(id);
        run.created_at_ms = created;
        run.status = status;
        run.principal = "alice".into();
        RunSummary::from(&run)
    }

    #[test]
    fn a_page_is_newest_first_and_its_cursor_continues_without_gaps_or_repeats() {
        let rows: Vec<RunSummary> = (0..7)
            .map(|i| row(&format!("r{i}"), 100 + i / 2, RunStatus::Completed))
            .collect();
        let mut query = RunQuery {
            page_size: 3,
            ..RunQuery::default()
        };
        let mut seen = Vec::new();
        loop {
            let page = query.page_of(rows.clone());
            seen.extend(page.runs.iter().map(|r| r.run_id.clone()));
            let Some(next) = page.next else { break };
            let token = next.token(&query);
            query.after = Some(Cursor::parse(&token, &query).unwrap());
        }
        assert_eq!(seen, ["r6", "r5", "r4", "r3", "r2", "r1", "r0"]);
    }

    #[test]
    fn a_cursor_of_positions_round_trips_and_a_bad_one_is_refused() {
        let query = RunQuery::default();
        for positions in [vec![7], vec![12, 0, 40, 3]] {
            let cursor = Cursor::Positions(positions);
            assert_eq!(Cursor::parse(&cursor.token(&query), &query), Ok(cursor));
        }
        let fingerprint = query.fingerprint();
        let many = vec!["1"; MAX_CURSOR_POSITIONS + 1].join(",");
        for text in ["p|", "p|1,,2", "p|1,x", &format!("p|{many}")] {
            let token = URL_SAFE_NO_PAD.encode(format!("1|{fingerprint:x}|{text}"));
            assert_eq!(Cursor::parse(&token, &query), Err(CursorError::Malformed), "{text}");
        }
    }

    #[test]
    fn filters_match_every_field_they_name() {
        let mut labeled = row("a", 5, RunStatus::AwaitingApproval);
        labeled.labels.insert("team".into(), "refunds".into());
        labeled.thread_id = "t".into();
        labeled.agent = Some(crate::domain::agent::AgentRef {
            name: "refunds".into(),
            version: "0123456789abcdef".into(),
        });
        let query = RunQuery {
            statuses: vec![RunStatus::AwaitingApproval],
            thread_id: Some("t".into()),
            principal: Some("alice".into()),
            labels: [("team".to_owned(), "refunds".to_owned())].into(),
            created_after_ms: Some(5),
            created_before_ms: Some(6),
            agent: Some("refunds".into()),
            page_size: 10,
            after: None,
        };
        assert!(query.matches(&labeled));
        assert!(query.live_only());
        for other in [
            RunQuery {
                principal: Some("bob".into()),
                ..query.clone()
            },
            RunQuery {
                thread_id: Some("u".into()),
                ..query.clone()
            },
            RunQuery {
                statuses: vec![RunStatus::Running],
                ..query.clone()
            },
            RunQuery {
                created_after_ms: Some(6),
                ..query.clone()
            },
            RunQuery {
                created_before_ms: Some(5),
                ..query.clone()
            },
            RunQuery {
                labels: [("team".to_owned(), "sales".to_owned())].into(),
                ..query.clone()
            },
            RunQuery {
                agent: Some("sales".into()),
                ..query.clone()
            },
        ] {
            assert!(!other.matches(&labeled), "{other:?}");
        }
    }

    #[test]
    fn a_token_continues_only_its_own_query() {
        let query = RunQuery::default();
        let token = Cursor::Positions(vec![42]).token(&query);
        assert_eq!(Cursor::parse(&token, &query), Ok(Cursor::Positions(vec![42])));
        let other = RunQuery {
            principal: Some("bob".into()),
            ..RunQuery::default()
        };
        assert_eq!(Cursor::parse(&token, &other), Err(CursorError::OtherQuery));
        assert_eq!(Cursor::parse("not a token", &query), Err(CursorError::Malformed));
        assert_eq!(Cursor::parse("", &query), Err(CursorError::Malformed));
        // A page size is no filter: a caller may change it between pages.
        let bigger = RunQuery {
            page_size: 99,
            ..RunQuery::default()
        };
        assert!(Cursor::parse(&token, &bigger).is_ok());
    }

    #[test]
    fn labels_are_bounded_on_both_sides() {
        let labels = |n: usize| {
            (0..n)
                .map(|i| (format!("k{i}"), "v".to_owned()))
                .collect::<BTreeMap<_, _>>()
        };
        assert!(check_labels(&labels(4), 4, 8).is_ok());
        assert_eq!(
            check_labels(&labels(5), 4, 8),
            Err(LabelError::TooMany { count: 5, max: 4 })
        );
        let long = [("k".to_owned(), "x".repeat(9))].into();
        assert!(matches!(check_labels(&long, 4, 8), Err(LabelError::Value { .. })));
        let fits = [("k".to_owned(), "x".repeat(8))].into();
        assert!(check_labels(&fits, 4, 8).is_ok());
        for key in ["", "-a", "a-", "a b", "ü", &"k".repeat(64)] {
            let bad = [(key.to_owned(), "v".to_owned())].into();
            assert!(matches!(check_labels(&bad, 4, 8), Err(LabelError::Key(_))), "{key:?}");
        }
        let good = [("app.kubernetes.io/name".to_owned(), "v".to_owned())].into();
        assert!(check_labels(&good, 4, 8).is_ok());
    }
}
