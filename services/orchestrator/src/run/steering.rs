//! Steering: user messages sent to a live run (`SendMessage`) wait in the run's [`Inbox`] until
//! its next turn boundary, where the loop takes them into the conversation (`message_added`).
//!
//! The inbox is bounded by the count of messages a run may be sent over its life. It closes when
//! no boundary is left to take a message at: the model answered without calling a tool and
//! nothing waited (the run completes), or the run entered its last turn. Closing and the check
//! for waiting messages are one step under the inbox's lock, so a message is either taken by a
//! turn or refused, never accepted and dropped by a run that completes.

use std::sync::{Arc, Mutex};

pub use crate::domain::steering::{Closed, Refused, UserMessage};

/// A live run's waiting messages (cloned handles share them).
#[derive(Clone, Debug, Default)]
pub struct Inbox {
    inner: Arc<Mutex<Messages>>,
}

#[derive(Debug, Default)]
struct Messages {
    messages: Vec<UserMessage>,
    /// Messages accepted over the run's life (against `max`).
    accepted: u32,
    max: u32,
    closed: Option<Closed>,
}

/// What a checkpoint keeps of the inbox, so a replica that takes the run over still has the
/// messages accepted and not yet taken, and counts against the same bound.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Kept {
    /// Accepted, not yet taken by a turn.
    pub waiting: Vec<UserMessage>,
    /// Accepted over the run's life.
    pub accepted: u32,
}

impl Kept {
    /// Whether nothing was ever accepted (left out of a checkpoint).
    pub fn is_empty(&self) -> bool {
        self.accepted == 0
    }
}

impl Inbox {
    /// An open inbox taking at most `max` messages over the run's life (0: none).
    pub fn new(max: u32) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Messages {
                max,
                ..Messages::default()
            })),
        }
    }

    /// Accepts `message` for the next turn boundary: how many messages wait now.
    pub fn send(&self, message: UserMessage) -> Result<u32, Refused> {
        let mut inbox = shared::sync::lock(&self.inner);
        if let Some(closed) = inbox.closed {
            return Err(Refused::Closed(closed));
        }
        if inbox.accepted >= inbox.max {
            return Err(Refused::Full(inbox.max));
        }
        inbox.accepted += 1;
        inbox.messages.push(message);
        Ok(u32::try_from(inbox.messages.len()).unwrap_or(u32::MAX))
    }

    /// Takes the waiting messages (a turn boundary); with `close`, the inbox closes in the same
    /// step (the next turn is the run's last).
    pub(crate) fn take(&self, close: Option<Closed>) -> Vec<UserMessage> {
        let mut inbox = shared::sync::lock(&self.inner);
        if close.is_some() {
            inbox.closed = close;
        }
        std::mem::take(&mut inbox.messages)
    }

    /// The model answered without calling a tool: whether messages wait (the run takes one more
    /// turn for them); when none does, the inbox closes in the same step.
    pub(crate) fn close_unless_waiting(&self) -> bool {
        let mut inbox = shared::sync::lock(&self.inner);
        if inbox.messages.is_empty() {
            inbox.closed = Some(Closed::Answered);
            return false;
        }
        true
    }

    /// What a checkpoint keeps.
    pub(crate) fn kept(&self) -> Kept {
        let inbox = shared::sync::lock(&self.inner);
        Kept {
            waiting: inbox.messages.clone(),
            accepted: inbox.accepted,
        }
    }

    /// Takes back what a checkpoint kept (a run resumed here), before anything sent here.
    pub(crate) fn restore(&self, kept: Kept) {
        let mut inbox = shared::sync::lock(&self.inner);
        let Kept { mut waiting, accepted } = kept;
        waiting.append(&mut inbox.messages);
        inbox.accepted = inbox.accepted.saturating_add(accepted);
        inbox.messages = waiting;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(text: &str) -> UserMessage {
        UserMessage {
            content: text.to_owned(),
            name: None,
        }
    }

    #[test]
    fn messages_wait_until_taken_and_count_against_the_bound_for_the_run_s_life() {
        let inbox = Inbox::new(2);
        assert_eq!(inbox.send(message("a")), Ok(1));
        assert_eq!(inbox.take(None), vec![message("a")]);
        assert_eq!(inbox.send(message("b")), Ok(1));
        assert_eq!(
            inbox.send(message("c")),
            Err(Refused::Full(2)),
            "two over the run's life"
        );
        assert_eq!(Inbox::new(0).send(message("a")), Err(Refused::Full(0)));
    }

    #[test]
    fn an_answer_closes_the_inbox_only_when_nothing_waits() {
        let inbox = Inbox::new(4);
        inbox.send(message("a")).unwrap();
        assert!(inbox.close_unless_waiting(), "a message waits: one more turn");
        assert_eq!(inbox.send(message("b")), Ok(2), "still open");
        assert_eq!(inbox.take(None).len(), 2);
        assert!(!inbox.close_unless_waiting());
        assert_eq!(inbox.send(message("c")), Err(Refused::Closed(Closed::Answered)));
    }

    #[test]
    fn the_last_turn_takes_what_waits_and_closes() {
        let inbox = Inbox::new(4);
        inbox.send(message("a")).unwrap();
        assert_eq!(inbox.take(Some(Closed::LastTurn)), vec![message("a")]);
        assert_eq!(inbox.send(message("b")), Err(Refused::Closed(Closed::LastTurn)));
    }

    #[test]
    fn a_resumed_inbox_keeps_its_waiting_messages_and_its_count() {
        let inbox = Inbox::new(2);
        inbox.send(message("a")).unwrap();
        let kept = inbox.kept();
        let resumed = Inbox::new(2);
        resumed.restore(kept);
        assert_eq!(resumed.send(message("b")), Ok(2));
        assert_eq!(resumed.send(message("c")), Err(Refused::Full(2)), "the first counts");
        assert_eq!(resumed.take(None), vec![message("a"), message("b")]);
    }
}
