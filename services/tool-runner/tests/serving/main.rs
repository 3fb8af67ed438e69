//! The tool-runner as a service: its RPCs on a loopback port, the run fence at the receiver, and
//! the process itself (signals, drain, exit codes, flags).

mod fence;
mod process;
mod service;
