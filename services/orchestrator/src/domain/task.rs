//! A call its tool's server runs as a task (the MCP tasks extension): the server answers the
//! call with a handle at once and does the work in the background; the run follows the task,
//! each poll one more attempt of the call carrying the handle, until the task ends. What a run
//! keeps of it (in its checkpoint) and the rules of following it: how often to ask, and when
//! the task is past the time its server keeps it.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A task as its server last described it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolTask {
    /// The server's id of the task.
    pub id: String,
    /// The server's word for where it is (`working`).
    pub status: String,
    /// What the server says of its progress (may be empty).
    pub message: String,
    /// How long the server keeps the task from its creation (`None`: unlimited).
    pub ttl_ms: Option<u64>,
    /// How often the server would be asked (`None`: it did not say).
    pub poll_interval_ms: Option<u64>,
    /// The tool-runner endpoint that holds the task, when only it can go on with it (the task
    /// lives in that runner's child process: a stdio MCP server).
    pub runner: Option<String>,
}

/// How often a run asks after its tasks: the server's interval, held within these bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollBounds {
    /// Never more often than this.
    pub min: Duration,
    /// Never less often than this.
    pub max: Duration,
}

impl ToolTask {
    /// When to ask again: the server's interval held within `bounds` (the lower bound when the
    /// server named none).
    pub fn next_poll_in(&self, bounds: PollBounds) -> Duration {
        self.poll_interval_ms
            .map_or(bounds.min, Duration::from_millis)
            .clamp(bounds.min, bounds.max.max(bounds.min))
    }

    /// Whether the task is past the time its server keeps it, counted from `seen_at_unix_ms`
    /// (when the run first heard of it, no earlier than its creation).
    pub fn outlived_ttl(&self, seen_at_unix_ms: u64, now_unix_ms: u64) -> bool {
        self.ttl_ms
            .is_some_and(|ttl| now_unix_ms.saturating_sub(seen_at_unix_ms) > ttl)
    }

    /// The task's status and message in a line a person reads.
    pub fn describe(&self) -> String {
        if self.message.is_empty() {
            format!("task {} is {}", self.id, self.status)
        } else {
            format!("task {} is {}: {}", self.id, self.status, self.message)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(poll: Option<u64>, ttl: Option<u64>) -> ToolTask {
        ToolTask {
            id: "t".into(),
            status: "working".into(),
            message: String::new(),
            ttl_ms: ttl,
            poll_interval_ms: poll,
            runner: None,
        }
    }

    #[test]
    fn the_servers_interval_is_held_within_the_bounds() {
        let bounds = PollBounds {
            min: Duration::from_millis(500),
            max: Duration::from_secs(30),
        };
        assert_eq!(task(Some(2000), None).next_poll_in(bounds), Duration::from_secs(2));
        assert_eq!(task(Some(10), None).next_poll_in(bounds), Duration::from_millis(500));
        assert_eq!(
            task(Some(3_600_000), None).next_poll_in(bounds),
            Duration::from_secs(30)
        );
        assert_eq!(task(None, None).next_poll_in(bounds), Duration::from_millis(500));
    }

    #[test]
    fn a_task_outlives_its_ttl_only_past_it() {
        assert!(!task(None, Some(1000)).outlived_ttl(5000, 6000));
        assert!(task(None, Some(1000)).outlived_ttl(5000, 6001));
        assert!(!task(None, None).outlived_ttl(0, u64::MAX));
    }
}
