//! A seeded, deterministic simulation of the run fencing protocol (docs/architecture.md, "Side
//! effects and their fences"): orchestrator replicas acting for durable runs, tool-runners, and
//! a store with the NATS adapters' write semantics, under the faults Kubernetes produces
//! (partitions from the store, pauses, crashes and restarts, a slow or restarting store, lost
//! runners, calls held between the sender's lease check and the send), drawn from the seed.
//! Each history is checked against the invariants in [`check`]; a seed replays exactly.
//!
//! [`world`] models the protocol, not the services' code: the rules each side follows, in the
//! order the services follow them, on a store ([`store`]) that answers as NATS does, with the
//! fault plan of [`plan`] and the lease of [`lease`]. The domain rules it can use as they are,
//! it uses: `shared::fence::stale` at the runners, the thread's membership rules
//! (`orchestrator::domain::thread`), and a lease held against `orchestrator::domain::Ownership`
//! by a test. Each fix can be switched off ([`plan::Rules`]) to show the history that breaks
//! without it. [`ports`] runs the services' own code (the orchestrator's `Core` over the domain
//! ports) under the same kinds of faults, checked against its own invariants. [`jetstream`] is a
//! simulated JetStream beneath the real NATS adapters (the seam `shared::jetstream`), held to a
//! real server's answers by [`jetstream::conformance`].

pub mod check;
pub mod jetstream;
pub mod lease;
pub mod plan;
pub mod ports;
pub mod store;
pub mod world;

/// What one seed did: the invariants its history broke, and a trace when asked for.
#[derive(Debug)]
pub struct Outcome {
    /// The seed (it replays the same history).
    pub seed: u64,
    /// The invariants broken, each with its evidence.
    pub violations: Vec<String>,
    /// Tool calls started.
    pub starts: usize,
    /// Every event handled, one line each, when asked for.
    pub trace: Option<Vec<String>>,
}

/// Runs one seed.
pub fn simulate(seed: u64, settings: &plan::Settings, rules: plan::Rules, trace: bool) -> Outcome {
    let mut world = world::World::new(seed, settings.clone(), rules, trace);
    world.run();
    let violations = check::violations(&world.history, &world.store, settings.turns);
    Outcome {
        seed,
        violations,
        starts: world.history.starts.len(),
        trace: world.trace,
    }
}
