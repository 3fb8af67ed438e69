//! Both services and the stand-in model on loopback, end to end: runs, re-attaching, coalesced
//! streaming, a changed MCP catalog, and the model's prefix cache.

mod attach;
mod mcp_catalog;
mod model_time;
mod orchestrator;
mod streaming;
