//! The simulations as CI runs them: the fencing model over many seeds, the services' own code over
//! the simulated ports, the real NATS adapters over the simulated cluster, and the simulated
//! JetStream checked against a real one.

mod adapters;
mod jetstream;
mod over_ports;
mod simulation;
