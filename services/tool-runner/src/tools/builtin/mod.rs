//! Built-in tools, compiled into the runner: `echo`, `sleep`, `time_now`, `calculate`, and the
//! opt-in ones `read_file` / `list_dir` (need a sandbox root) and `http_get` (needs an allowlist).
//! A file each (`clock.rs` holds `time_now`, `fs.rs` the two file tools); `shared::egress`
//! decides where `http_get` may connect.

mod calculate;
mod clock;
mod echo;
mod fs;
mod http_get;
mod sleep;

use std::sync::Arc;
use std::time::Duration;

use super::{Tool, ToolSpec};

pub use crate::config::BuiltinSettings as BuiltinConfig;

/// A built-in tool ready to register, or the reason it is off on this runner.
pub enum Builtin {
    /// The tool is available.
    Enabled(ToolSpec, Arc<dyn Tool>),
    /// The tool exists but is switched off; calls get `UNAVAILABLE` with this reason.
    Disabled {
        /// Tool name.
        name: &'static str,
        /// Why it is off and how to switch it on.
        reason: &'static str,
    },
}

/// Every built-in tool, enabled or not, according to `config`.
pub fn all(config: &BuiltinConfig) -> Result<Vec<Builtin>, crate::Error> {
    let mut tools = vec![
        echo::builtin(),
        sleep::builtin(config),
        clock::builtin(),
        calculate::builtin(),
    ];
    match &config.sandbox_root {
        Some(root) => tools.extend(fs::builtins(root, config)?),
        None => tools.extend(["read_file", "list_dir"].map(|name| Builtin::Disabled {
            name,
            reason: "the runner was started without --sandbox-root",
        })),
    }
    tools.push(http_get::builtin(config)?);
    Ok(tools)
}

/// Shorthand for a built-in's spec.
fn spec(name: &str, description: &str, parameters: serde_json::Value, timeout: Duration) -> ToolSpec {
    ToolSpec {
        name: name.to_owned(),
        description: description.to_owned(),
        parameters,
        timeout,
        source: "builtin",
        needs_approval: false,
        mcp_protocol: String::new(),
        // Every built-in reads (or computes, or waits): running it again changes nothing.
        idempotent: true,
    }
}
