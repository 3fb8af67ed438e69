//! Where `./scripts/mcp-servers` (run by `./scripts/test`) installs the official MCP reference
//! servers the tests run against: `@modelcontextprotocol/server-everything` (npm) and
//! `mcp-server-time` (PyPI, in a venv).

use std::path::PathBuf;

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
