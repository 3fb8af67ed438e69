//! Calls a server turned into tasks (the MCP tasks extension, `io.modelcontextprotocol/tasks`):
//! the server alone decides that a `tools/call` becomes a task and answers with its handle; the
//! call is then gone on with by its next attempts, on whichever runner takes them (a stdio
//! server's task lives in one runner's child process: its attempts must come back to that
//! runner, which [`TaskState::pinned`] says). Each attempt is `tasks/update` with the answers to
//! the task's questions, if any, then `tasks/get`; or `tasks/cancel`, then `tasks/get`.

/// A task as its server last described it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskState {
    /// The server's id of the task.
    pub id: String,
    /// `working` (the other statuses end the call or ask questions).
    pub status: String,
    /// What the server says of its progress (may be empty).
    pub message: String,
    /// How long the server keeps the task from its creation (`None`: unlimited).
    pub ttl_ms: Option<u64>,
    /// How often the server would be asked (`None`: it did not say).
    pub poll_interval_ms: Option<u64>,
    /// The task lives in this runner's child process (a stdio server): only this runner can
    /// go on with it, and it does not survive this runner.
    pub pinned: bool,
}

/// What an attempt does with the task its call became.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskRef {
    /// The server's id of the task.
    pub id: String,
    /// Ask the server to cancel it (`tasks/cancel`) before reading it.
    pub cancel: bool,
}

impl TaskState {
    /// The state an MCP task (as JSON: `taskId`, `status`, `statusMessage`, `ttlMs`,
    /// `pollIntervalMs`) describes.
    pub fn of_mcp(task: &serde_json::Value, pinned: bool) -> Self {
        Self {
            id: task["taskId"].as_str().unwrap_or_default().to_owned(),
            status: task["status"].as_str().unwrap_or("working").to_owned(),
            message: task["statusMessage"].as_str().unwrap_or_default().to_owned(),
            ttl_ms: task["ttlMs"].as_u64(),
            poll_interval_ms: task["pollIntervalMs"].as_u64(),
            pinned,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_task_reads_its_handle_and_hints() {
        let task = json!({"taskId": "t-1", "status": "working", "statusMessage": "half way",
            "createdAt": "2026-11-27T00:00:00Z", "lastUpdatedAt": "2026-11-27T00:00:01Z",
            "ttlMs": 60000, "pollIntervalMs": 500});
        let state = TaskState::of_mcp(&task, true);
        assert_eq!(state.id, "t-1");
        assert_eq!((state.ttl_ms, state.poll_interval_ms), (Some(60000), Some(500)));
        assert_eq!(
            (state.status.as_str(), state.message.as_str(), state.pinned),
            ("working", "half way", true)
        );
        let unlimited = TaskState::of_mcp(&json!({"taskId": "t-2", "status": "working", "ttlMs": null}), false);
        assert_eq!((unlimited.ttl_ms, unlimited.poll_interval_ms), (None, None));
    }
}
