//! What survives: the durable adapters on a real NATS (`stores`), replicas sharing them
//! (`replicas`: take-over, re-attach, drain, cancel, checkpoints), runs through the faults
//! Kubernetes produces (`durable`: SIGKILL, SIGTERM, SIGSTOP, NATS cut off or restarted, a node
//! lost), fencing (`fencing`), the model's, runners' and callers' faults (`faults`), and the
//! process itself (`process`: flags, signals, exit codes). `common` holds what they share.

mod common;
mod durable;
mod faults;
mod fencing;
mod process;
mod replicas;
mod stores;
