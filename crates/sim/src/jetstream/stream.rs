//! One simulated stream as a JetStream server keeps it: messages numbered by the stream sequence,
//! the last sequence of each subject, message ids remembered for the duplicate window, messages
//! dropped past their age, past the stream's bytes (the oldest, or the new one refused) and past
//! the messages kept per subject (a key-value bucket keeps one). Time is the runtime's clock (the
//! simulation's virtual one).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bytes::Bytes;
use shared::jetstream::{Ack, Error, Message, Publish, State};
use tokio::time::Instant;

/// How a stream keeps its messages.
#[derive(Debug, Clone)]
pub struct Limits {
    /// The subjects it stores (wildcards allowed).
    pub subjects: Vec<String>,
    /// Messages older than this go (zero: kept).
    pub max_age: Duration,
    /// Bytes kept in all (0: no limit).
    pub max_bytes: u64,
    /// Past `max_bytes`, the oldest go (else the new message is refused).
    pub discard_old: bool,
    /// Messages kept per subject (0: all).
    pub per_subject: usize,
    /// How long a message id is remembered.
    pub duplicate_window: Duration,
}

/// A stored message.
#[derive(Debug, Clone)]
pub struct Stored {
    /// Where it was published.
    pub subject: String,
    /// Its headers.
    pub headers: Vec<(String, String)>,
    /// What it says.
    pub payload: Bytes,
    /// When it was stored (its age runs from there).
    pub at: Instant,
}

impl Stored {
    fn bytes(&self) -> u64 {
        let headers: usize = self.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
        (self.subject.len() + headers + self.payload.len()) as u64
    }
}

/// A stream's state (cloned whole for a follower that lags).
#[derive(Debug, Clone)]
pub struct StreamState {
    /// How it keeps its messages.
    pub limits: Limits,
    messages: BTreeMap<u64, Stored>,
    /// The sequences of each subject's messages, oldest first.
    by_subject: HashMap<String, Vec<u64>>,
    /// Message ids and the sequence each was stored at, with when.
    ids: HashMap<String, (u64, Instant)>,
    /// The same ids in the order stored, so those past the window go without a walk of all.
    ids_by_age: std::collections::VecDeque<(Instant, String)>,
    last_sequence: u64,
    bytes: u64,
}

impl StreamState {
    /// An empty stream.
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            messages: BTreeMap::new(),
            by_subject: HashMap::new(),
            ids: HashMap::new(),
            ids_by_age: std::collections::VecDeque::new(),
            last_sequence: 0,
            bytes: 0,
        }
    }

    /// Whether `subject` is one this stream stores.
    pub fn stores(&self, subject: &str) -> bool {
        self.limits.subjects.iter().any(|pattern| matches(pattern, subject))
    }

    /// Drops what aged out by now: messages past the stream's age, ids past the window.
    pub fn expire(&mut self) {
        let now = Instant::now();
        if !self.limits.max_age.is_zero() {
            let old: Vec<u64> = self
                .messages
                .iter()
                .take_while(|(_, m)| now.duration_since(m.at) >= self.limits.max_age)
                .map(|(seq, _)| *seq)
                .collect();
            for seq in old {
                self.remove(seq);
            }
        }
        let window = self.limits.duplicate_window;
        while let Some((at, _)) = self.ids_by_age.front()
            && now.duration_since(*at) >= window
        {
            if let Some((at, id)) = self.ids_by_age.pop_front()
                && self.ids.get(&id).is_some_and(|(_, stored)| *stored == at)
            {
                self.ids.remove(&id);
            }
        }
    }

    fn remove(&mut self, seq: u64) {
        let Some(message) = self.messages.remove(&seq) else {
            return;
        };
        self.bytes = self.bytes.saturating_sub(message.bytes());
        if let Some(seqs) = self.by_subject.get_mut(&message.subject) {
            seqs.retain(|s| *s != seq);
            if seqs.is_empty() {
                self.by_subject.remove(&message.subject);
            }
        }
    }

    /// The last sequence of `subject` (0: none kept).
    fn subject_last(&self, subject: &str) -> u64 {
        self.by_subject
            .get(subject)
            .and_then(|seqs| seqs.last())
            .copied()
            .unwrap_or(0)
    }

    /// Stores `message` as JetStream does: a known id within the window is a duplicate; an
    /// expected last subject sequence that is not the subject's refuses it.
    pub fn publish(&mut self, message: Publish) -> Result<Ack, Error> {
        self.expire();
        if !self.stores(&message.subject) {
            return Err(Error::Failed(format!("no stream stores subject {}", message.subject)));
        }
        if let Some((sequence, _)) = message.id.as_ref().and_then(|id| self.ids.get(id)) {
            return Ok(Ack {
                sequence: *sequence,
                duplicate: true,
            });
        }
        if let Some(after) = message.after
            && self.subject_last(&message.subject) != after
        {
            return Err(Error::WrongSequence);
        }
        let stored = Stored {
            subject: message.subject,
            headers: message.headers,
            payload: message.payload,
            at: Instant::now(),
        };
        self.make_room(stored.bytes())?;
        self.last_sequence += 1;
        let sequence = self.last_sequence;
        if let Some(id) = message.id {
            self.ids_by_age.push_back((stored.at, id.clone()));
            self.ids.insert(id, (sequence, stored.at));
        }
        self.bytes += stored.bytes();
        let seqs = self.by_subject.entry(stored.subject.clone()).or_default();
        seqs.push(sequence);
        let extra = match self.limits.per_subject {
            0 => Vec::new(),
            keep => seqs.iter().rev().skip(keep).copied().collect(),
        };
        self.messages.insert(sequence, stored);
        for seq in extra {
            self.remove(seq);
        }
        Ok(Ack {
            sequence,
            duplicate: false,
        })
    }

    /// Room for `bytes` more: the oldest messages dropped, or a refusal.
    fn make_room(&mut self, bytes: u64) -> Result<(), Error> {
        let max = self.limits.max_bytes;
        if max == 0 {
            return Ok(());
        }
        while self.bytes + bytes > max {
            if !self.limits.discard_old {
                return Err(Error::Failed("maximum bytes exceeded".to_owned()));
            }
            let Some(oldest) = self.messages.keys().next().copied() else {
                break;
            };
            self.remove(oldest);
        }
        Ok(())
    }

    /// The last message of `subject`.
    pub fn last(&self, subject: &str) -> Option<Message> {
        let seq = self.subject_last(subject);
        self.messages.get(&seq).map(|m| message(seq, m, false, 0))
    }

    /// Drops `subject`'s messages but its newest `keep` (a wildcard subject: of each subject).
    pub fn purge(&mut self, subject: &str, keep: u64) {
        let keep = usize::try_from(keep).unwrap_or(usize::MAX);
        let doomed: Vec<u64> = self
            .by_subject
            .iter()
            .filter(|(s, _)| matches(subject, s))
            .flat_map(|(_, seqs)| seqs.iter().rev().skip(keep).copied().collect::<Vec<_>>())
            .collect();
        for seq in doomed {
            self.remove(seq);
        }
    }

    /// What it holds.
    pub fn state(&self) -> State {
        State {
            messages: self.messages.len() as u64,
            first_sequence: self.messages.keys().next().copied().unwrap_or(self.last_sequence + 1),
            last_sequence: self.last_sequence,
        }
    }

    /// The newest sequence.
    pub fn last_sequence(&self) -> u64 {
        self.last_sequence
    }

    /// The messages matching `filter` from sequence `from` on: a subject's own from its
    /// sequences (a run's log in a stream of every run's), a wildcard's by walking the stream.
    pub fn from<'a>(&'a self, filter: &'a str, from: u64) -> Box<dyn Iterator<Item = (u64, &'a Stored)> + 'a> {
        if filter.split('.').any(|token| token == "*" || token == ">") {
            return Box::new(
                self.messages
                    .range(from..)
                    .filter(move |(_, m)| matches(filter, &m.subject))
                    .map(|(seq, m)| (*seq, m)),
            );
        }
        let seqs = self.by_subject.get(filter).map_or(&[][..], Vec::as_slice);
        let first = seqs.partition_point(|seq| *seq < from);
        Box::new(
            seqs[first..]
                .iter()
                .filter_map(|seq| self.messages.get(seq).map(|m| (*seq, m))),
        )
    }

    /// The sequences of the last message of each subject matching `filter`, in stream order.
    pub fn last_per_subject(&self, filter: &str) -> Vec<u64> {
        let mut seqs: Vec<u64> = self
            .by_subject
            .iter()
            .filter(|(s, _)| matches(filter, s))
            .filter_map(|(_, seqs)| seqs.last().copied())
            .collect();
        seqs.sort_unstable();
        seqs
    }

    /// The message at `seq`, if kept.
    pub fn at(&self, seq: u64) -> Option<&Stored> {
        self.messages.get(&seq)
    }
}

/// `stored` at `seq` as a reader gets it.
pub fn message(seq: u64, stored: &Stored, headers_only: bool, pending: u64) -> Message {
    Message {
        subject: stored.subject.clone(),
        sequence: seq,
        headers: stored.headers.clone(),
        payload: match headers_only {
            true => Bytes::new(),
            false => stored.payload.clone(),
        },
        pending,
    }
}

/// Whether `subject` matches `pattern` (NATS wildcards: `*` one token, `>` the rest).
pub fn matches(pattern: &str, subject: &str) -> bool {
    let mut subject = subject.split('.');
    for token in pattern.split('.') {
        match (token, subject.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (token, Some(s)) if token == s => {}
            _ => return false,
        }
    }
    subject.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            subjects: vec!["s.>".to_owned()],
            max_age: Duration::from_secs(60),
            max_bytes: 0,
            discard_old: true,
            per_subject: 0,
            duplicate_window: Duration::from_secs(10),
        }
    }

    fn publish(subject: &str, id: Option<&str>, after: Option<u64>) -> Publish {
        Publish {
            subject: subject.to_owned(),
            payload: Bytes::from_static(b"x"),
            id: id.map(str::to_owned),
            after,
            headers: Vec::new(),
        }
    }

    #[test]
    fn wildcards_match_as_nats_does() {
        assert!(matches("a.>", "a.b.c"));
        assert!(!matches("a.>", "a"));
        assert!(matches("a.*.c", "a.b.c"));
        assert!(!matches("a.*", "a.b.c"));
        assert!(matches("a.b", "a.b"));
        assert!(!matches("a.b", "a.b.c"));
    }

    #[tokio::test(start_paused = true)]
    async fn duplicates_and_expected_sequences_are_kept_as_jetstream_keeps_them() {
        let mut stream = StreamState::new(limits());
        let first = stream.publish(publish("s.a", Some("m1"), Some(0))).unwrap();
        assert_eq!((first.sequence, first.duplicate), (1, false));
        let again = stream.publish(publish("s.a", Some("m1"), Some(0))).unwrap();
        assert_eq!(
            (again.sequence, again.duplicate),
            (1, true),
            "a known id is a duplicate first"
        );
        assert_eq!(stream.publish(publish("s.a", None, Some(0))), Err(Error::WrongSequence));
        assert_eq!(stream.publish(publish("s.b", None, Some(0))).unwrap().sequence, 2);
        assert_eq!(stream.publish(publish("s.a", None, Some(1))).unwrap().sequence, 3);
        tokio::time::advance(Duration::from_secs(11)).await;
        let later = stream.publish(publish("s.a", Some("m1"), None)).unwrap();
        assert_eq!(
            (later.sequence, later.duplicate),
            (4, false),
            "past the window an id is new"
        );
        tokio::time::advance(Duration::from_secs(60)).await;
        stream.expire();
        assert_eq!(stream.state().messages, 0, "past the age nothing is kept");
        assert_eq!(stream.state().first_sequence, 5);
    }

    #[test]
    fn a_stream_keeps_its_bytes_and_subjects_within_their_limits() {
        let mut stream = StreamState::new(Limits {
            max_bytes: 6,
            per_subject: 1,
            ..limits()
        });
        stream.publish(publish("s.a", None, None)).unwrap();
        stream.publish(publish("s.a", None, None)).unwrap();
        assert_eq!(stream.state().messages, 1, "one message per subject");
        stream.publish(publish("s.b", None, None)).unwrap();
        assert_eq!(
            stream.state().first_sequence,
            3,
            "the oldest went for the new one's bytes"
        );
        let mut refusing = StreamState::new(Limits {
            max_bytes: 4,
            discard_old: false,
            ..limits()
        });
        refusing.publish(publish("s.a", None, None)).unwrap();
        assert!(refusing.publish(publish("s.b", None, None)).is_err());
    }
}
