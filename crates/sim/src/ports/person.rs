//! The person who answers the tools' questions: now and then they list the calls waiting (on
//! any replica alive) and answer each new round of questions after a while, from any replica —
//! go, or decline; sometimes first with content the question's schema refuses, sometimes twice
//! at once from two replicas (two people racing), sometimes just as the question expires (a
//! race with the run waking), and sometimes never (the question expires and its call is
//! answered `cancel`). What the approval store took is kept for the invariants.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use orchestrator::domain::approval::{DecideError, Decision, DecisionKind, PendingApproval};
use orchestrator::domain::input::{InputAction, InputAnswer};
use orchestrator::server::harness::Replica;

use super::actors::QUESTION;

/// An answer sent to a replica (one the schema takes).
#[derive(Debug, Clone)]
pub struct Given {
    /// The replica answered that it took it (else it may have, unheard: the store applied the
    /// write and its answer was lost).
    pub taken: bool,
    /// The run.
    pub run_id: String,
    /// The call.
    pub call_id: String,
    /// The round of questions it answered (their state).
    pub request_state: String,
    /// The answer, as the tool must read it.
    pub response: serde_json::Value,
}

/// What the person did that the invariants read.
#[derive(Default)]
pub struct Record {
    /// Every answer sent, in order.
    pub given: Vec<Given>,
    /// Answers a replica took that it must have refused.
    pub wrongly_taken: Vec<String>,
}

/// The person, shared by their answers in flight.
pub type Person = Arc<Mutex<Record>>;

/// What the person does with one round of questions.
#[derive(Debug, Clone, Copy)]
enum Fate {
    /// Nobody answers: it expires.
    Never,
    Decline,
    /// First content the schema refuses, then go.
    RefusedFirst,
    Go,
    /// Go, a moment before the question expires.
    Late,
}

/// Starts the person: every few hundred ms they look at what waits on a replica of `living`.
/// With `rounds`, each answer names the round of questions it answers (off: only the call, what
/// breaks without it).
pub fn spawn(
    living: Arc<Mutex<Vec<Arc<Replica>>>>,
    person: Person,
    seed: u64,
    rounds: bool,
) -> tokio::task::JoinHandle<()> {
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x9e45);
    tokio::spawn(async move {
        let mut seen = BTreeSet::new();
        let mut answers = 0u64;
        loop {
            tokio::time::sleep(Duration::from_millis(rng.u64(200..1000))).await;
            let Some(replica) = super::pick(&living, rng.usize(..64)) else {
                continue;
            };
            let Ok(Ok(pending)) = tokio::time::timeout(Duration::from_secs(2), replica.pending(100)).await else {
                continue;
            };
            for call in pending {
                let Some(questions) = &call.questions else { continue };
                if !seen.insert(questions.request_state.clone()) {
                    continue;
                }
                let fate = match rng.u8(..10) {
                    0 | 1 => Fate::Never,
                    2 => Fate::Decline,
                    3 => Fate::RefusedFirst,
                    4 => Fate::Late,
                    _ => Fate::Go,
                };
                let racers = if rng.u8(..4) == 0 { 2 } else { 1 };
                for _ in 0..racers {
                    answers += 1;
                    let after = match fate {
                        Fate::Late => {
                            let at = shared::sync::unix_ms() + rng.u64(0..300);
                            Duration::from_millis(call.expires_at_unix_ms.saturating_sub(at))
                        }
                        _ => Duration::from_millis(rng.u64(100..5000)),
                    };
                    let at = rng.usize(..64);
                    let answer = Answer {
                        call: call.clone(),
                        fate,
                        nonce: format!("p{answers}"),
                        rounds,
                    };
                    tokio::spawn(answer.give(Arc::clone(&living), Arc::clone(&person), after, at));
                }
            }
        }
    })
}

/// One answer on its way.
struct Answer {
    call: PendingApproval,
    fate: Fate,
    /// Tells this answer from a racing one.
    nonce: String,
    /// It names the round it answers.
    rounds: bool,
}

impl Answer {
    fn decision(&self, action: InputAction, content: Option<serde_json::Value>) -> (Decision, InputAnswer) {
        let answer = InputAnswer {
            key: QUESTION.to_owned(),
            action,
            content,
        };
        // The answer names the round the person read: a call asked again since (its run moved)
        // refuses it rather than take it for the new round.
        let decision = Decision {
            call_id: self.call.call_id.clone(),
            kind: DecisionKind::Answer(vec![answer.clone()]),
            round: self
                .call
                .questions
                .as_ref()
                .filter(|_| self.rounds)
                .map(orchestrator::domain::input::Questions::round),
        };
        (decision, answer)
    }

    /// Sends the answer (after `after`, to the `at`-th replica alive) and keeps what was taken.
    async fn give(self, living: Arc<Mutex<Vec<Arc<Replica>>>>, person: Person, after: Duration, at: usize) {
        tokio::time::sleep(after).await;
        let Some(replica) = super::pick(&living, at) else {
            return;
        };
        let run_id = &self.call.run_id;
        if matches!(self.fate, Fate::RefusedFirst) {
            let refused = serde_json::json!({ "go": "yes", "by": self.nonce });
            let (decision, _) = self.decision(InputAction::Accept, Some(refused));
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(5), replica.decide(run_id, &[decision])).await {
                lock(&person).wrongly_taken.push(format!(
                    "{run_id}/{}: an answer whose `go` is a string was taken",
                    self.call.call_id
                ));
            }
        }
        let (decision, answer) = match self.fate {
            Fate::Never => return,
            Fate::Decline => self.decision(InputAction::Decline, None),
            Fate::RefusedFirst | Fate::Go | Fate::Late => {
                let content = serde_json::json!({ "go": true, "by": self.nonce });
                self.decision(InputAction::Accept, Some(content))
            }
        };
        let decided = tokio::time::timeout(Duration::from_secs(5), replica.decide(run_id, &[decision])).await;
        let taken = match decided {
            Ok(Ok(_)) => true,
            // Refused: nothing was written.
            Ok(Err(orchestrator::Error::Decide(e))) if !matches!(e, DecideError::Unavailable(_)) => return,
            // Unheard or unavailable: it may have landed.
            _ => false,
        };
        lock(&person).given.push(Given {
            taken,
            run_id: run_id.clone(),
            call_id: self.call.call_id.clone(),
            request_state: self.call.questions.map(|q| q.request_state).unwrap_or_default(),
            response: answer.response(),
        });
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
