//! The tool-runner's MCP servers against the official reference servers: tools, a person's
//! inputs, and tools run as tasks.

mod mcp;
mod mcp_input;
mod mcp_tasks;
