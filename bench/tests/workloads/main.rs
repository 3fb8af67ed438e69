//! The benchmark's workloads, each run at a small scale so none can rot: every figure measured,
//! every report written (speed itself is never asserted here).

mod admission;
mod approvals;
mod common;
mod fleet;
mod idle_cost;
mod list_runs;
mod long_run;
mod quick;
mod shards;
mod soak;
mod takeover;
