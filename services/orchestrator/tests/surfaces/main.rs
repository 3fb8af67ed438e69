//! How people and programs reach the orchestrator: the clients in other languages, the command
//! line, the console in a real browser, the sessions the docs show, security, secrets and
//! telemetry.

mod cli;
mod clients;
mod console;
mod doc_sessions;
mod secrets;
mod security;
mod telemetry;
