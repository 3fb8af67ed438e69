//! Where `./scripts/mcp-servers` (run by `./scripts/test`) installs the official MCP reference
//! servers the tests run against: `@modelcontextprotocol/server-everything` (npm) and
//! `mcp-server-time` (PyPI, in a venv, with the Python SDK `mcp` the tests' own refund server
//! is written with, and `fastmcp-tasks`, which the tests' own tasks server is written with).

use std::path::{Path, PathBuf};

use crate::model_servers::cache_dir;

/// `relative` under the MCP install directory, or an error saying how to install it.
pub fn installed(relative: &str) -> anyhow::Result<PathBuf> {
    let path = cache_dir().join("mcp").join(relative);
    anyhow::ensure!(
        path.exists(),
        "{} is missing: ./scripts/mcp-servers installs it (./scripts/test runs it first)",
        path.display()
    );
    Ok(path)
}

/// server-everything's entry point (run with `node <it> stdio|streamableHttp`).
pub fn everything_js() -> anyhow::Result<PathBuf> {
    installed("npm/node_modules/@modelcontextprotocol/server-everything/dist/index.js")
}

/// The `mcp-server-time` program.
pub fn time_server() -> anyhow::Result<PathBuf> {
    installed("time/bin/mcp-server-time")
}

/// The Python of the venv the time server is in (for the tests' small stdio filters).
pub fn python() -> anyhow::Result<PathBuf> {
    installed("time/bin/python")
}

/// The tests' own MCP server (`tests/fixtures/mcp/refund_server.py`): a refund that asks a
/// person to confirm, a payment page, a closing asked twice.
pub fn refund_server() -> PathBuf {
    crate::repo_root().join("tests/fixtures/mcp/refund_server.py")
}

/// The key every process of the refund server seals its `requestState` with.
pub const REFUND_STATE_KEY: &str = "refund-server-state-key-of-the-tests-000000";

/// A tools-manifest table that serves the refund server as `shop` over stdio (required), its
/// refunds logged to `log`, its state sealed with [`REFUND_STATE_KEY`].
pub fn refund_server_table(log: &Path) -> anyhow::Result<String> {
    let env = format!(
        "REFUND_LOG = \"{}\", REQUEST_STATE_KEY = \"{REFUND_STATE_KEY}\"",
        log.display()
    );
    python_server_table("shop", &refund_server(), &env)
}

/// A tools-manifest table that serves the tests' Python server `script` as `name` over stdio
/// (required, unbuffered, in the venv's Python), with the environment `env` (TOML inline-table
/// entries).
fn python_server_table(name: &str, script: &Path, env: &str) -> anyhow::Result<String> {
    Ok(format!(
        "[[mcp_servers]]\nname = \"{name}\"\ncommand = \"{python}\"\nargs = [\"-u\", \"{script}\"]\nenv = {{ {env} }}\nrequired = true\n",
        python = python()?.display(),
        script = script.display(),
    ))
}

/// The tests' own tasks server (`tests/fixtures/mcp/tasks_server.py`, FastMCP with
/// `fastmcp-tasks`): `crunch` always runs as a task.
pub fn tasks_server() -> PathBuf {
    crate::repo_root().join("tests/fixtures/mcp/tasks_server.py")
}

/// A tools-manifest table that serves the tasks server as `batch` over stdio (required), the
/// start, end and cancellation of each task's work logged to `log`.
pub fn tasks_server_table(log: &Path) -> anyhow::Result<String> {
    python_server_table("batch", &tasks_server(), &format!("TASK_LOG = \"{}\"", log.display()))
}
