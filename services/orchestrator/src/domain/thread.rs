//! Threads: conversations that continue across runs. A thread keeps the messages of the runs that
//! ran on it (each run's request messages, then its turns: assistant messages with their tool
//! calls, tool results, status notes and messages sent to it), which the next run on the thread
//! sees before its own. One run holds a thread at a time; a run that finds it held follows the
//! request's [`BusyPolicy`]. The rules are here, on the record as every store keeps it; the stores
//! only read and write the record atomically.
//!
//! A thread's messages are measured in *turns*: a turn begins at a user message (a person's
//! message, or the status note the orchestrator writes after each turn's tool results) and holds
//! everything up to the next one, so dropping whole turns from the oldest keeps every tool result
//! with the call it answers. The thread's limits drop whole turns (and runs left empty) from the
//! oldest; a request's `thread_history` shows only the newest turns.

use super::RunStatus;
use super::chat::Message;

/// What a run does when the thread it names is held by another run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum BusyPolicy {
    /// Refused (`ABORTED`, naming the live run).
    #[default]
    Reject,
    /// Waits, in the thread's bounded queue, until the runs before it have ended.
    Enqueue,
    /// The live run ends `CANCELED` once its turn in progress has ended, its output kept in the
    /// thread; then this run starts from there.
    Interrupt,
    /// The live run is canceled at once and its messages are not added to the thread; then this
    /// run starts.
    Rollback,
}

impl BusyPolicy {
    /// Every policy, in the order people are shown them.
    pub const ALL: [Self; 4] = [Self::Reject, Self::Enqueue, Self::Interrupt, Self::Rollback];

    /// The name the agents file and the command line spell it by.
    pub fn name(self) -> &'static str {
        match self {
            Self::Reject => "reject",
            Self::Enqueue => "enqueue",
            Self::Interrupt => "interrupt",
            Self::Rollback => "rollback",
        }
    }

    /// Reads an optional policy by its [`name`](Self::name) (`deserialize_with` of a file's field).
    pub fn deserialize_name<'de, D: serde::Deserializer<'de>>(from: D) -> Result<Option<Self>, D::Error> {
        let name: Option<String> = serde::Deserialize::deserialize(from)?;
        name.map(|name| name.parse().map_err(serde::de::Error::custom))
            .transpose()
    }

    /// Writes an optional policy by its [`name`](Self::name) (`serialize_with` of a file's field).
    pub fn serialize_name<S: serde::Serializer>(policy: &Option<Self>, to: S) -> Result<S::Ok, S::Error> {
        match policy {
            Some(policy) => to.serialize_some(policy.name()),
            None => to.serialize_none(),
        }
    }
}

impl std::str::FromStr for BusyPolicy {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|policy| policy.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.into_iter().map(Self::name).collect();
                format!("unknown variant `{name}`, expected one of {}", names.join(", "))
            })
    }
}

/// A run's thread: which, how much of it the model is to see, and (once the run holds it) what
/// it sees.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunThread {
    /// The thread.
    pub thread_id: String,
    /// What the run does when another run holds the thread.
    pub on_busy: BusyPolicy,
    /// The most turns of the thread the model sees (`None`: all it keeps).
    pub window: Option<u32>,
    /// The thread's messages the model sees before the request's (filled once the run holds
    /// the thread).
    #[serde(default)]
    pub history: Vec<Message>,
    /// Turns of the thread the window left out.
    #[serde(default)]
    pub turns_left_out: u32,
}

impl RunThread {
    /// What `run_started` says of the thread.
    pub fn start(&self) -> ThreadStart {
        ThreadStart {
            thread_id: self.thread_id.clone(),
            turns: u32::try_from(turns(&self.history).len()).unwrap_or(u32::MAX),
            turns_left_out: self.turns_left_out,
        }
    }
}

/// What `run_started` says of a run's thread.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ThreadStart {
    /// The thread.
    pub thread_id: String,
    /// Turns of it the model sees.
    pub turns: u32,
    /// Older turns left out by the request's window.
    pub turns_left_out: u32,
}

/// A thread's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadLimits {
    /// Runs kept; older ones are dropped.
    pub max_runs: usize,
    /// Bytes of messages kept; older turns are dropped.
    pub max_bytes: usize,
    /// Runs waiting for the thread at once.
    pub max_queue: usize,
}

/// One run's part of a thread.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ThreadRun {
    /// The run.
    pub run_id: String,
    /// How it ended.
    pub status: RunStatus,
    /// Its messages kept (whole turns; the oldest may have been dropped).
    pub messages: Vec<Message>,
    /// When it ended (Unix ms).
    pub ended_at_unix_ms: u64,
}

/// A run waiting for the thread.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Waiter {
    /// The run.
    pub run_id: String,
    /// Its caller's deadline (Unix ms): past it, the wait is dropped by whoever sees it.
    pub until_unix_ms: u64,
}

/// A thread as the store keeps it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Thread {
    /// The thread.
    pub thread_id: String,
    /// The principal that started it; others are told it does not exist.
    pub principal: String,
    /// The runs that ended on it, oldest first.
    pub runs: Vec<ThreadRun>,
    /// The run holding the thread, if any.
    pub live: Option<String>,
    /// Since when it holds it (Unix ms): a run that took the thread and never started (its
    /// replica stopped in between) is let go after a while.
    #[serde(default)]
    pub live_since_unix_ms: u64,
    /// Runs waiting for it, in order.
    #[serde(default)]
    pub queue: Vec<Waiter>,
    /// Live runs whose messages are not to be added when they end (rolled back).
    #[serde(default)]
    pub rolled_back: Vec<String>,
    /// Turns dropped from the oldest by the thread's limits.
    #[serde(default)]
    pub dropped_turns: u64,
    /// When it was started (Unix ms).
    pub created_at_unix_ms: u64,
    /// When it last changed (Unix ms).
    pub updated_at_unix_ms: u64,
}

/// What a run asking for a thread was told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begin {
    /// The run holds the thread now.
    Started,
    /// The run held the thread already (a request repeated, or a run that never let it go).
    Holding,
    /// Another run holds it (or runs wait before this one): `policy` says reject.
    Busy(String),
    /// The run waits (it is in the queue): `live` holds the thread.
    Wait {
        /// The run holding the thread (`None`: the thread is free, runs queued before this one go
        /// first).
        live: Option<String>,
    },
    /// The queue is full.
    QueueFull(usize),
}

impl Thread {
    /// A new thread of `principal`.
    pub fn new(thread_id: &str, principal: &str, now: u64) -> Self {
        Self {
            thread_id: thread_id.to_owned(),
            principal: principal.to_owned(),
            runs: Vec::new(),
            live: None,
            live_since_unix_ms: 0,
            queue: Vec::new(),
            rolled_back: Vec::new(),
            dropped_turns: 0,
            created_at_unix_ms: now,
            updated_at_unix_ms: now,
        }
    }

    /// `run_id` asks for the thread (again, while it waits), under `policy`, its caller's
    /// deadline `until`: it takes the thread when it is free and no run waits before it;
    /// otherwise it is refused (`Reject`) or waits in the queue.
    pub fn begin(
        &mut self,
        run_id: &str,
        policy: BusyPolicy,
        (now, until): (u64, u64),
        limits: &ThreadLimits,
    ) -> Begin {
        self.queue.retain(|w| w.until_unix_ms > now || w.run_id == run_id);
        if self.live.as_deref() == Some(run_id) {
            return Begin::Holding;
        }
        let first = self.queue.first().map(|w| w.run_id.as_str());
        if self.live.is_none() && first.is_none_or(|f| f == run_id) {
            self.queue.retain(|w| w.run_id != run_id);
            self.live = Some(run_id.to_owned());
            self.live_since_unix_ms = now;
            self.updated_at_unix_ms = now;
            return Begin::Started;
        }
        let holder = self.live.clone().or_else(|| first.map(str::to_owned));
        if policy == BusyPolicy::Reject {
            return Begin::Busy(holder.unwrap_or_default());
        }
        if !self.queue.iter().any(|w| w.run_id == run_id) {
            if self.queue.len() >= limits.max_queue {
                return Begin::QueueFull(limits.max_queue);
            }
            self.queue.push(Waiter {
                run_id: run_id.to_owned(),
                until_unix_ms: until,
            });
        }
        Begin::Wait {
            live: self.live.clone(),
        }
    }

    /// The live run is rolled back: its messages are not added when it ends.
    pub fn roll_back(&mut self, run_id: &str) {
        if !self.rolled_back.iter().any(|r| r == run_id) {
            self.rolled_back.push(run_id.to_owned());
        }
    }

    /// `run_id` stops waiting (its caller left, or its start failed) or lets the thread go
    /// without adding anything (it never ran).
    pub fn leave(&mut self, run_id: &str, now: u64) {
        self.queue.retain(|w| w.run_id != run_id);
        if self.live.as_deref() == Some(run_id) {
            self.live = None;
        }
        self.rolled_back.retain(|r| r != run_id);
        self.updated_at_unix_ms = now;
    }

    /// `run` ended: its messages join the thread (unless it was rolled back, or joined already:
    /// the end of a run taken over may be written twice) without a status note for a turn it did
    /// not run, it lets the thread go, and the limits drop whole turns from the oldest.
    pub fn end(&mut self, mut run: ThreadRun, limits: &ThreadLimits) {
        // A status note never outlives its turn: one for a turn that did not run goes.
        super::chat::drop_trailing_note(&mut run.messages);
        let rolled_back = self.rolled_back.contains(&run.run_id);
        let joined = self.runs.iter().any(|r| r.run_id == run.run_id);
        self.leave(&run.run_id, run.ended_at_unix_ms);
        if !rolled_back && !joined {
            self.runs.push(run);
        }
        self.keep_within(limits);
    }

    /// Bytes of the messages kept.
    pub fn bytes(&self) -> usize {
        self.runs.iter().flat_map(|r| &r.messages).map(message_bytes).sum()
    }

    /// Drops whole turns from the oldest (and runs left with none) until the thread holds at most
    /// `max_runs` runs and `max_bytes` bytes.
    fn keep_within(&mut self, limits: &ThreadLimits) {
        while self.runs.len() > limits.max_runs {
            let run = self.runs.remove(0);
            self.dropped_turns += turns(&run.messages).len() as u64;
        }
        let mut bytes = self.bytes();
        while bytes > limits.max_bytes && !self.runs.is_empty() {
            let oldest = &mut self.runs[0];
            let first = turns(&oldest.messages)
                .first()
                .map_or(oldest.messages.len(), |t| t.len());
            bytes -= oldest.messages.drain(..first).map(|m| message_bytes(&m)).sum::<usize>();
            self.dropped_turns += 1;
            if oldest.messages.is_empty() {
                self.runs.remove(0);
            }
        }
    }

    /// The thread's messages the model sees: at most the newest `window` turns (all without
    /// one), and how many turns the window left out.
    pub fn transcript(&self, window: Option<u32>) -> (Vec<Message>, usize) {
        let all: Vec<&Message> = self.runs.iter().flat_map(|r| &r.messages).collect();
        let owned: Vec<Message> = all.into_iter().cloned().collect();
        let spans = turns(&owned);
        let keep = window.map_or(spans.len(), |w| spans.len().min(w as usize));
        let dropped = spans.len() - keep;
        let start: usize = spans[..dropped].iter().map(|t| t.len()).sum();
        (owned[start..].to_vec(), dropped)
    }

    /// Every message kept, oldest first.
    pub fn messages(&self) -> impl Iterator<Item = &Message> {
        self.runs.iter().flat_map(|r| &r.messages)
    }
}

/// The turns of `messages`: slices that each begin at a user message (the first may begin with
/// another role, when the messages do).
pub fn turns(messages: &[Message]) -> Vec<&[Message]> {
    let mut spans = Vec::new();
    let mut start = 0;
    for (i, message) in messages.iter().enumerate() {
        if i > start && matches!(message, Message::User { .. }) {
            spans.push(&messages[start..i]);
            start = i;
        }
    }
    if start < messages.len() {
        spans.push(&messages[start..]);
    }
    spans
}

/// About how many bytes a message holds (its text, calls and results).
pub fn message_bytes(message: &Message) -> usize {
    match message {
        Message::System(text) => text.len(),
        Message::User { content, name } => content.len() + name.as_ref().map_or(0, String::len),
        Message::Assistant {
            content,
            tool_calls,
            reasoning,
        } => {
            content.len()
                + reasoning.as_ref().map_or(0, String::len)
                + tool_calls
                    .iter()
                    .map(|c| c.id.len() + c.name.len() + c.arguments.len())
                    .sum::<usize>()
        }
        Message::Tool { tool_call_id, content } => tool_call_id.len() + content.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::chat::ToolCall;

    const LIMITS: ThreadLimits = ThreadLimits {
        max_runs: 3,
        max_bytes: 10_000,
        max_queue: 2,
    };

    fn user(text: &str) -> Message {
        Message::User {
            content: text.into(),
            name: None,
        }
    }

    fn assistant(text: &str, calls: &[&str]) -> Message {
        Message::Assistant {
            content: text.into(),
            tool_calls: calls
                .iter()
                .map(|id| ToolCall {
                    id: (*id).into(),
                    name: "t".into(),
                    arguments: "{}".into(),
                })
                .collect(),
            reasoning: None,
        }
    }

    fn tool(id: &str) -> Message {
        Message::Tool {
            tool_call_id: id.into(),
            content: "{}".into(),
        }
    }

    /// A run of two turns: the prompt, a call and its result; the note, the answer.
    fn run(id: &str, prompt: &str) -> ThreadRun {
        ThreadRun {
            run_id: id.into(),
            status: RunStatus::Completed,
            messages: vec![
                user(prompt),
                assistant("", &[&format!("{id}-c")]),
                tool(&format!("{id}-c")),
                user("[note]"),
                assistant(&format!("answer {id}"), &[]),
            ],
            ended_at_unix_ms: 1,
        }
    }

    fn started(thread: &mut Thread, run_id: &str) {
        assert_eq!(
            thread.begin(run_id, BusyPolicy::Reject, (1, 100), &LIMITS),
            Begin::Started
        );
    }

    #[test]
    fn a_busy_policy_is_read_by_its_name_and_an_unknown_name_lists_them() {
        for policy in BusyPolicy::ALL {
            assert_eq!(policy.name().parse::<BusyPolicy>(), Ok(policy));
        }
        let error = "wait".parse::<BusyPolicy>().unwrap_err();
        assert!(error.contains("reject, enqueue, interrupt, rollback"), "{error}");
    }

    #[test]
    fn turns_begin_at_user_messages_and_keep_results_with_their_calls() {
        let messages = run("a", "hi").messages;
        let spans = turns(&messages);
        assert_eq!(spans.len(), 2);
        assert_eq!(spans[0].len(), 3, "the prompt, the call, its result");
        assert!(turns(&[]).is_empty());
        let opening_assistant = [assistant("earlier", &[]), user("q")];
        assert_eq!(turns(&opening_assistant).len(), 2);
    }

    #[test]
    fn one_run_holds_a_thread_and_the_next_sees_its_messages() {
        let mut thread = Thread::new("t", "alice", 0);
        started(&mut thread, "a");
        assert_eq!(
            thread.begin("b", BusyPolicy::Reject, (1, 100), &LIMITS),
            Begin::Busy("a".into())
        );
        thread.end(run("a", "first"), &LIMITS);
        assert_eq!(thread.live, None);
        started(&mut thread, "b");
        let (messages, dropped) = thread.transcript(None);
        assert_eq!((messages.len(), dropped), (5, 0));
        thread.end(run("b", "second"), &LIMITS);
        let (window, dropped) = thread.transcript(Some(3));
        assert_eq!(dropped, 1, "four turns, three shown");
        assert_eq!(window[0], user("[note]"), "whole turns: the window starts at a's note");
        assert_eq!(window[1], assistant("answer a", &[]));
    }

    #[test]
    fn a_window_starts_at_a_user_message() {
        let mut thread = Thread::new("t", "alice", 0);
        for id in ["a", "b"] {
            started(&mut thread, id);
            thread.end(run(id, id), &LIMITS);
        }
        let (window, dropped) = thread.transcript(Some(2));
        assert_eq!(dropped, 2);
        assert_eq!(window[0], user("b"));
    }

    #[test]
    fn waiters_queue_in_order_bounded_and_expire_with_their_deadline() {
        let mut thread = Thread::new("t", "alice", 0);
        started(&mut thread, "a");
        let wait = |t: &mut Thread, id: &str, until: u64| t.begin(id, BusyPolicy::Enqueue, (10, until), &LIMITS);
        assert_eq!(wait(&mut thread, "b", 100), Begin::Wait { live: Some("a".into()) });
        assert_eq!(wait(&mut thread, "c", 100), Begin::Wait { live: Some("a".into()) });
        assert_eq!(wait(&mut thread, "d", 100), Begin::QueueFull(2));
        thread.end(run("a", "x"), &LIMITS);
        assert_eq!(wait(&mut thread, "c", 100), Begin::Wait { live: None }, "b goes first");
        assert_eq!(wait(&mut thread, "b", 100), Begin::Started);
        thread.end(run("b", "y"), &LIMITS);
        assert_eq!(
            thread.begin("e", BusyPolicy::Reject, (10, 100), &LIMITS),
            Begin::Busy("c".into()),
            "a run waits: the thread is not free for a newcomer"
        );
        // c's caller is gone past its deadline: its place is dropped by whoever looks.
        assert_eq!(
            thread.begin("e", BusyPolicy::Enqueue, (200, 300), &LIMITS),
            Begin::Started
        );
    }

    #[test]
    fn a_rolled_back_run_adds_nothing_and_an_end_written_twice_adds_once() {
        let mut thread = Thread::new("t", "alice", 0);
        started(&mut thread, "a");
        thread.roll_back("a");
        thread.end(run("a", "x"), &LIMITS);
        assert!(thread.runs.is_empty() && thread.live.is_none() && thread.rolled_back.is_empty());
        started(&mut thread, "b");
        thread.end(run("b", "y"), &LIMITS);
        thread.end(run("b", "y"), &LIMITS);
        assert_eq!(thread.runs.len(), 1);
    }

    /// A run that ended between turns (interrupted, canceled after its turn) joins its thread
    /// without the status note of the turn it did not run, whether the note stood alone or
    /// joined a user message; a note of a turn that ran stays.
    #[test]
    fn a_status_note_never_outlives_its_turn() {
        use crate::domain::chat::STATUS_MARK;
        let note = |turn: u32| user(&format!("{STATUS_MARK} Turn {turn} of at most 4 begins."));
        let mut thread = Thread::new("t", "alice", 0);
        started(&mut thread, "a");
        let mut a = run("a", "Find flights.");
        a.messages = vec![
            user("Find flights."),
            assistant("", &["c1"]),
            tool("c1"),
            note(2),
            assistant("Two.", &[]),
            note(3),
        ];
        thread.end(a, &LIMITS);
        let kept: Vec<&Message> = thread.messages().collect();
        assert_eq!(kept.len(), 5, "{kept:?}");
        assert!(matches!(kept[3], Message::User { content, .. } if content.starts_with(STATUS_MARK)));
        assert!(
            matches!(kept[4], Message::Assistant { .. }),
            "ends with the answer: {kept:?}"
        );

        started(&mut thread, "b");
        let mut b = run("b", "And Bergen?");
        let joined = format!("Only direct ones.\n\n{STATUS_MARK} Turn 2 of at most 4 begins.");
        b.messages = vec![user("And Bergen?"), assistant("", &["c2"]), tool("c2"), user(&joined)];
        thread.end(b, &LIMITS);
        let last = thread.messages().last().cloned();
        assert!(
            matches!(&last, Some(Message::User { content, .. }) if content == "Only direct ones."),
            "{last:?}"
        );
    }

    /// The limits on both sides: at the bound nothing is dropped; one over drops the oldest.
    #[test]
    fn the_limits_drop_whole_turns_and_runs_from_the_oldest() {
        let mut thread = Thread::new("t", "alice", 0);
        for id in ["a", "b", "c"] {
            started(&mut thread, id);
            thread.end(run(id, id), &LIMITS);
        }
        assert_eq!((thread.runs.len(), thread.dropped_turns), (3, 0), "at max_runs");
        started(&mut thread, "d");
        thread.end(run("d", "d"), &LIMITS);
        assert_eq!(thread.runs[0].run_id, "b");
        assert_eq!(thread.dropped_turns, 2, "a's two turns");

        let bytes = thread.bytes();
        let tight = ThreadLimits {
            max_bytes: bytes,
            ..LIMITS
        };
        thread.keep_within(&tight);
        assert_eq!(thread.bytes(), bytes, "at max_bytes nothing goes");
        let tighter = ThreadLimits {
            max_bytes: bytes - 1,
            ..LIMITS
        };
        thread.keep_within(&tighter);
        assert_eq!(thread.runs[0].messages[0], user("[note]"), "b's first turn went");
        assert_eq!(thread.dropped_turns, 3);
    }
}
