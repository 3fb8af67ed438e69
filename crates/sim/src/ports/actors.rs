//! The model and the tool-runners the simulated replicas call through their ports. The model
//! answers each run the same way whichever replica asks (the same conversation gives the same
//! call ids, as a turn replayed after a takeover does); a tool-runner reads the run's fence
//! from the store before it starts a tool, as the real one does, and the start it records is
//! what the tools saw.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use orchestrator::domain::chat::Message;
use orchestrator::domain::ports::{ToolExecutor, ToolInvocation};
use orchestrator::domain::{Stop, ToolCallError};
use orchestrator::llm::{ChatModel, ChatRequest, LlmError, LlmEvent};
use tokio::time::Instant;

use super::gate::Gate;
use super::store::Store;

/// The turns every run plays: two calls a turn (one in every third), then the answer.
pub const TURNS: usize = 8;

/// The model, as one replica reaches it (a paused replica hears nothing).
pub struct Model {
    gate: Gate,
    rng: Mutex<fastrand::Rng>,
}

impl Model {
    /// The model for the replica behind `gate`.
    pub fn new(gate: Gate, seed: u64) -> Self {
        Self {
            gate,
            rng: Mutex::new(fastrand::Rng::with_seed(seed)),
        }
    }
}

/// The turn the model answers: how many of the conversation's messages it wrote.
fn turn_of(request: &ChatRequest) -> usize {
    request
        .messages
        .iter()
        .filter(|m| matches!(m, Message::Assistant { .. }))
        .count()
}

/// A tool call's piece of the stream.
fn call(index: u32, id: String) -> Result<LlmEvent, LlmError> {
    Ok(LlmEvent::ToolCallFragment {
        index: Some(index),
        id: Some(id),
        name: Some("work".to_owned()),
        arguments: Some("{}".to_owned()),
    })
}

impl ChatModel for Model {
    fn stream(
        &self,
        request: ChatRequest,
    ) -> BoxFuture<'static, Result<BoxStream<'static, Result<LlmEvent, LlmError>>, LlmError>> {
        let turn = turn_of(&request);
        let think = Duration::from_millis(lock(&self.rng).u64(20..1500));
        let gate = self.gate.clone();
        async move {
            tokio::time::sleep(think).await;
            gate.running().await;
            let mut events = vec![Ok(LlmEvent::TextDelta(format!("turn {}. ", turn + 1)))];
            match turn {
                t if t + 1 == TURNS => events.push(Ok(LlmEvent::TextDelta("done.".to_owned()))),
                t if t % 3 == 2 => events.push(call(0, format!("t{turn}a"))),
                _ => events.extend([call(0, format!("t{turn}a")), call(1, format!("t{turn}b"))]),
            }
            let finish = if turn + 1 < TURNS { "tool_calls" } else { "stop" };
            events.extend([Ok(LlmEvent::Finish(finish.to_owned())), Ok(LlmEvent::Done)]);
            Ok(futures::stream::iter(events).boxed())
        }
        .boxed()
    }
}

/// A tool call as a tool-runner started it.
#[derive(Debug, Clone)]
pub struct Start {
    /// The run.
    pub run_id: String,
    /// The call.
    pub call_id: String,
    /// The epoch the call carried.
    pub epoch: u64,
    /// The run's fence when the runner read it.
    pub fence: u64,
    /// When the tool started.
    pub at: Instant,
}

/// The tool-runners, shared by the replicas: what they started.
pub struct Runners {
    store: Store,
    /// Every tool start, in order.
    pub starts: Mutex<Vec<Start>>,
    /// The runners' gates (one lost: a call to it is refused before it runs).
    pub gates: Vec<Gate>,
    rng: Mutex<fastrand::Rng>,
}

impl Runners {
    /// `count` runners reading fences from `store`.
    pub fn new(store: Store, count: usize, seed: u64) -> Arc<Self> {
        Arc::new(Self {
            store,
            starts: Mutex::default(),
            gates: (0..count).map(|_| Gate::default()).collect(),
            rng: Mutex::new(fastrand::Rng::with_seed(seed ^ 0x7001)),
        })
    }

    /// Runner `r` answers again (a new pod in the lost one's place).
    pub fn revive(&self, r: usize) {
        if let Some(gate) = self.gates.get(r) {
            gate.set(super::gate::Mode::Up);
        }
    }

    /// The run's fence as a runner reads it (0: none).
    fn fence(&self, run_id: &str) -> u64 {
        self.store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .fences
            .get(run_id)
            .copied()
            .unwrap_or(0)
    }
}

/// A replica's client of the runners: it checks its lease before every attempt, as the
/// service's does, and a paused replica may be paused between that check and the send.
pub struct Client {
    /// The replica's gate.
    pub gate: Gate,
    /// The runners.
    pub runners: Arc<Runners>,
}

/// Attempts at a call no runner ran before it gives up.
const ATTEMPTS: u32 = 3;

impl ToolExecutor for Client {
    fn execute(&self, call: ToolInvocation) -> BoxFuture<'static, Result<String, ToolCallError>> {
        let (gate, runners) = (self.gate.clone(), Arc::clone(&self.runners));
        async move {
            if let Some(owner) = &call.owner {
                owner.calls_allowed().await;
            }
            for attempt in 0..ATTEMPTS {
                if call.owner.as_ref().is_some_and(|o| !o.holds()) {
                    return Err(ToolCallError::new(
                        "UNAVAILABLE",
                        "not sent: this replica no longer acts for the run",
                    ));
                }
                // Checked, then sent: a pause falls in between as often as anywhere else.
                gate.running().await;
                let (runner, wire, work) = {
                    let mut rng = lock(&runners.rng);
                    let runner = rng.usize(..runners.gates.len());
                    (
                        runner,
                        Duration::from_micros(rng.u64(100..20_000)),
                        Duration::from_millis(rng.u64(10..2000)),
                    )
                };
                tokio::time::sleep(wire).await;
                if runners.gates[runner].mode() != super::gate::Mode::Up {
                    tokio::time::sleep(Duration::from_millis(50) * (attempt + 1)).await;
                    continue;
                }
                // The fence is read, and its answer takes a moment to come back.
                let fence = runners.fence(&call.run_id);
                tokio::time::sleep(wire / 4).await;
                if call.epoch != 0 && shared::fence::stale(call.epoch, fence) {
                    let why = format!(
                        "runner {runner} refused call {} of epoch {}: the run is in epoch {fence}",
                        call.call_id, call.epoch
                    );
                    if let Some(owner) = &call.owner {
                        owner.stop(Stop::Fenced(why.clone()));
                    }
                    return Err(ToolCallError::new("UNAVAILABLE", why));
                }
                lock(&runners.starts).push(Start {
                    run_id: call.run_id.clone(),
                    call_id: call.call_id.clone(),
                    epoch: call.epoch,
                    fence,
                    at: Instant::now(),
                });
                tokio::time::sleep(work).await;
                gate.running().await;
                return Ok(format!("{{\"done\": \"{}\"}}", call.call_id));
            }
            Err(ToolCallError::new("UNAVAILABLE", "no tool-runner answered"))
        }
        .boxed()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
