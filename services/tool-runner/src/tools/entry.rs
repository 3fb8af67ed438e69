//! A tool as the catalog keeps it: its spec, its compiled argument schema and its
//! implementation. Built by the catalog for the runner's own tools and by the MCP servers for
//! theirs.

use std::sync::Arc;

use super::{Tool, ToolSpec};

/// A tool with its compiled argument schema.
pub(crate) struct Entry {
    pub(crate) spec: ToolSpec,
    pub(crate) validator: jsonschema::Validator,
    pub(crate) tool: Arc<dyn Tool>,
}

impl Entry {
    /// Compiles the tool's schema.
    pub(crate) fn new(spec: ToolSpec, tool: Arc<dyn Tool>) -> Result<Self, String> {
        let validator = jsonschema::validator_for(&spec.parameters)
            .map_err(|e| format!("tool {:?} has an unusable JSON Schema: {e}", spec.name))?;
        Ok(Self { spec, validator, tool })
    }
}
