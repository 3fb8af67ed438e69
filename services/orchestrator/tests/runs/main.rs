//! The orchestrator's runs through the real service: approvals, steering and threads, cancel
//! modes, tools' inputs and tasks, fair shares and quotas, balancing over runners and models, the
//! model transport and real model servers, and the stream decoder fuzzed; and the waits that time
//! ends, with the stack in one process on the paused clock (`paused_clock`).

mod approvals;
mod balancing;
mod cancel_modes;
mod fuzz;
mod llm_transport;
mod model_fleet;
mod model_servers;
mod paused_clock;
mod sharing;
mod steering;
mod threads;
mod tool_input;
mod tool_tasks;
