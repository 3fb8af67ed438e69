//! Tasks in the loop (docs/architecture.md, "Tasks"): a call whose tool's server runs it as a
//! task comes back with the task's handle instead of a result. The handle is followed at once
//! (and goes into the checkpoint with the call's outcome, safe point (b)), so a replica that
//! takes the run over follows the same task: the tool never runs twice. Each poll is one more
//! attempt of the call carrying the handle, at the server's interval held within
//! `--task-poll-min` and `--task-poll-max`; what the server says of the task is streamed when it
//! changes (`tool_call_progress`, never fed to the model). Past `--task-park-after` the run parks
//! like a run waiting for approval (no slot, status `AWAITING_TASK`) and the approval store wakes it for its
//! next poll on whichever replica takes it. A task past its `ttlMs` fails its call; a task that
//! asks questions waits for a person like any call that asks, and the answers go to the task.
//! A run that ends before its tasks (canceled either way, its deadline, a limit) asks their
//! servers to cancel them.

use std::time::Duration;

use futures::future::join_all;
use shared::sync::unix_ms;

use super::durable::TurnCalls;
use super::pending::Following;
use super::{CallOutcome, Driver, ModelCall, Step};
use crate::domain::ToolCallError;
use crate::domain::event::Event;
use crate::domain::ports::Wait;
use crate::domain::task::{PollBounds, ToolTask};

/// The calls whose tasks the run gave up (`--task-max-follow`), to cancel at their servers.
pub(super) type GivenUp = Vec<(ModelCall, ToolTask)>;

/// How long asking a server to cancel a task may take once the run has ended.
const CANCEL_LIMIT: Duration = Duration::from_secs(5);

/// How the loop follows its tools' tasks.
#[derive(Debug, Clone, Copy)]
pub struct TaskSettings {
    /// How often a task is polled.
    pub poll: PollBounds,
    /// How long a run follows its tasks in place before it parks.
    pub park_after: Duration,
    /// How long a run follows one task at most, whatever its server says.
    pub max_follow: Duration,
}

impl TurnCalls {
    /// Takes an outcome into the calls as a checkpoint records it: a task is followed, a
    /// finished call's outcome kept (it follows no task any more). A call that asked questions
    /// keeps nothing here: the next safe point holds its questions, and a run resumed before
    /// that calls again and is asked again.
    pub(super) fn record(&mut self, outcome: &CallOutcome, poll: PollBounds, now: u64) {
        if outcome.asked.is_some() {
            return;
        }
        if let Some(task) = &outcome.task {
            self.follow(outcome.index, task.clone(), poll, now);
            return;
        }
        self.tasks.retain(|f| f.index != outcome.index);
        self.finished.push(outcome.clone());
    }

    /// Follows `task` for the call at `index` (a newer state replaces the older); whether what
    /// the server says of it is new.
    pub(super) fn follow(&mut self, index: usize, task: ToolTask, poll: PollBounds, now: u64) -> bool {
        let wait = u64::try_from(task.next_poll_in(poll).as_millis()).unwrap_or(u64::MAX);
        let poll_at_unix_ms = now.saturating_add(wait);
        match self.tasks.iter_mut().find(|f| f.index == index) {
            Some(following) => {
                let changed = following.task.status != task.status || following.task.message != task.message;
                following.task = task;
                following.poll_at_unix_ms = poll_at_unix_ms;
                changed
            }
            None => {
                self.tasks.push(Following {
                    index,
                    task,
                    seen_at_unix_ms: now,
                    poll_at_unix_ms,
                });
                true
            }
        }
    }

    /// The task the call at `index` became, if it follows one.
    pub(super) fn following(&self, index: usize) -> Option<&Following> {
        self.tasks.iter().find(|f| f.index == index)
    }

    /// When the turn's next task poll is due (`None`: it follows no task it may poll now). A
    /// task whose questions wait for a person is not polled: the answer goes on with it.
    pub(super) fn next_poll_at(&self) -> Option<u64> {
        let waits = |index: usize| self.approvals.iter().any(|a| a.index == index && a.decision.is_none());
        self.tasks
            .iter()
            .filter(|f| !waits(f.index))
            .map(|f| f.poll_at_unix_ms)
            .min()
    }

    /// Since when the turn has followed tasks.
    fn followed_since(&self) -> Option<u64> {
        self.tasks.iter().map(|f| f.seen_at_unix_ms).min()
    }
}

/// The calls whose tasks the run follows, kept beside the loop so that a run that ends while it
/// follows them (its loop dropped mid-wait) can still cancel them.
#[derive(Default)]
pub(super) struct Followed(Vec<(ModelCall, ToolTask)>);

impl Followed {
    /// The tasks `calls` follow.
    pub(super) fn of(calls: Option<&TurnCalls>) -> Self {
        let Some(calls) = calls else { return Self::default() };
        Self(
            calls
                .tasks
                .iter()
                .filter_map(|f| Some((calls.sorted.calls.get(f.index)?.clone(), f.task.clone())))
                .collect(),
        )
    }
}

impl Driver<'_> {
    /// Sorts what the calls that `ran` gave back as to tasks: a call its server runs as a task
    /// is followed (announced when it is new or the server says something new of it), or fails
    /// once past its ttl or `--task-max-follow`; a followed call that finished is followed no
    /// more. Returns the others, and the tasks given up that their servers are to cancel.
    pub(super) fn take_tasks(&mut self, calls: &mut TurnCalls, ran: Vec<CallOutcome>) -> (Vec<CallOutcome>, GivenUp) {
        let now = unix_ms();
        let mut rest = Vec::with_capacity(ran.len());
        let mut given_up = Vec::new();
        for mut outcome in ran {
            let index = outcome.index;
            let Some(task) = outcome.task.take() else {
                if outcome.asked.is_none() {
                    calls.tasks.retain(|f| f.index != index);
                }
                rest.push(outcome);
                continue;
            };
            let seen = calls.following(index).map_or(now, |f| f.seen_at_unix_ms);
            if let Some((why, cancel)) = self.given_up(&task, seen, now) {
                calls.tasks.retain(|f| f.index != index);
                if let Some(call) = calls.sorted.calls.get(index).filter(|_| cancel) {
                    given_up.push((call.clone(), task));
                }
                outcome.result = Err(ToolCallError::new("FAILED", why));
                rest.push(outcome);
                continue;
            }
            if calls.follow(index, task, self.deps.tasks.poll, now) {
                self.announce_task(calls, index);
            }
        }
        self.followed = Followed::of(Some(calls));
        (rest, given_up)
    }

    /// Why the run gives `task` up, followed since `seen`, and whether its server is asked to
    /// cancel it: it outlived the ttl its server keeps it (the server dropped it already), or the
    /// run followed it for `--task-max-follow` (canceled).
    fn given_up(&self, task: &ToolTask, seen: u64, now: u64) -> Option<(String, bool)> {
        if task.outlived_ttl(seen, now) {
            let ttl = Duration::from_millis(task.ttl_ms.unwrap_or_default());
            let why = format!(
                "the tool's task {} still ran past the {} its server keeps it (ttlMs); it is given up",
                task.id,
                humantime::format_duration(ttl)
            );
            return Some((why, false));
        }
        let followed = Duration::from_millis(now.saturating_sub(seen));
        (followed > self.deps.tasks.max_follow).then(|| {
            let why = format!(
                "the tool's task {} still ran after the run followed it for {} (--task-max-follow); it is given up and canceled",
                task.id,
                humantime::format_duration(self.deps.tasks.max_follow)
            );
            (why, true)
        })
    }

    /// `tool_call_progress` with what the server says of the task the call at `index` became.
    fn announce_task(&mut self, calls: &TurnCalls, index: usize) {
        let (Some(call), Some(following)) = (calls.sorted.calls.get(index), calls.following(index)) else {
            return;
        };
        tracing::info!(gen_ai.tool.call.id = %call.id, gen_ai.tool.name = %call.name, mcp.task.id = %following.task.id, status = %following.task.status, "the tool runs the call as a task");
        self.emitter.queue(Event::ToolCallProgress {
            call_id: call.id.clone(),
            name: call.name.clone(),
            turn: calls.turn.number,
            progress: 0.0,
            total: 0.0,
            message: following.task.describe(),
        });
    }

    /// Waits for the turn's next task poll: in place until the turn has followed tasks for
    /// `--task-park-after`, then parked (no slot) until the poll is due. A cancel that lets the
    /// turn finish polls at once (the polls cancel the tasks).
    pub(super) async fn await_tasks(&mut self, calls: &mut TurnCalls) -> Step<()> {
        let (Some(poll_at), Some(since)) = (calls.next_poll_at(), calls.followed_since()) else {
            return Ok(());
        };
        if self.cancel.after_turn().is_some() {
            return Ok(());
        }
        let now = unix_ms();
        let park_after = u64::try_from(self.deps.tasks.park_after.as_millis()).unwrap_or(u64::MAX);
        if now.saturating_sub(since) >= park_after && poll_at > now && self.open_task_wait().await {
            return self.await_decisions(calls).await;
        }
        tokio::time::sleep(Duration::from_millis(poll_at.saturating_sub(now))).await;
        Ok(())
    }

    /// Opens the run's wait in the approval store with no call for a person: it parks until its next poll.
    /// Whether the approval store took it (one that takes no more runs leaves the run following in place).
    async fn open_task_wait(&mut self) -> bool {
        let wait = Wait {
            run_id: self.spec.run_id.clone(),
            principal: self.spec.principal.clone(),
            calls: Vec::new(),
            epoch: self.epoch(),
        };
        match self.deps.approvals.open(wait).await {
            Ok(()) => true,
            Err(reason) => {
                tracing::warn!("{reason}; the run follows its tasks in place");
                false
            }
        }
    }

    /// Asks the servers of the tasks the run still follows to cancel them (`tasks/cancel`), each
    /// within [`CANCEL_LIMIT`]: the run ended before them.
    pub(super) async fn cancel_followed_tasks(&mut self) {
        let followed = std::mem::take(&mut self.followed.0);
        self.cancel_tasks(followed, "the run ended before its tool's task; the task was canceled")
            .await;
    }

    /// Asks the servers of the tasks the run gave up (`--task-max-follow`) to cancel them.
    pub(super) async fn cancel_given_up_tasks(&mut self, given_up: GivenUp) {
        self.cancel_tasks(given_up, "the run gave its tool's task up; the task was canceled")
            .await;
    }

    async fn cancel_tasks(&mut self, tasks: GivenUp, done: &'static str) {
        let sends = tasks.into_iter().map(|(call, task)| {
            let mut invocation = self.invocation(&call, CANCEL_LIMIT, None);
            let task_id = task.id.clone();
            invocation.task = Some(task);
            invocation.cancel_task = true;
            let send = self.deps.tools.execute(invocation);
            async move {
                match tokio::time::timeout(CANCEL_LIMIT, send).await {
                    Ok(answer) => tracing::info!(gen_ai.tool.call.id = %call.id, mcp.task.id = %task_id, ok = answer.is_ok(), "{done}"),
                    Err(_) => tracing::warn!(gen_ai.tool.call.id = %call.id, mcp.task.id = %task_id, "canceling the task of the run's tool did not finish in time"),
                }
            }
        });
        join_all(sends).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(status: &str, message: &str) -> ToolTask {
        ToolTask {
            id: "t-1".into(),
            status: status.into(),
            message: message.into(),
            ttl_ms: None,
            poll_interval_ms: Some(2000),
            runner: None,
        }
    }

    const POLL: PollBounds = PollBounds {
        min: Duration::from_millis(500),
        max: Duration::from_secs(30),
    };

    #[test]
    fn a_followed_task_is_polled_at_its_interval_and_says_only_what_is_new() {
        let mut calls = TurnCalls::for_tests(2);
        assert!(calls.follow(1, task("working", ""), POLL, 1000));
        assert_eq!(calls.next_poll_at(), Some(3000));
        assert!(!calls.follow(1, task("working", ""), POLL, 3000));
        assert!(calls.follow(1, task("working", "half way"), POLL, 5000));
        assert_eq!((calls.next_poll_at(), calls.followed_since()), (Some(7000), Some(1000)));
    }
}
