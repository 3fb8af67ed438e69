//! The catalog: every tool the runner offers — its own (built-ins, command tools), fixed at
//! start, and the current tools of its MCP servers — and the checks every call passes before a
//! tool runs: the tool exists, the arguments are within the size and depth limits, are a JSON
//! object and match the tool's JSON Schema; then the call itself under the tool's timeout.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::Value;

use crate::Error;
use crate::tools::builtin::Builtin;
use crate::tools::entry::Entry;
use crate::tools::input::Output;
use crate::tools::mcp::McpServers;
use crate::tools::{CallContext, ErrorCode, Tool, ToolError, ToolSpec};

/// How many schema violations one error message lists.
const MAX_REPORTED_VIOLATIONS: usize = 5;

pub use crate::config::ArgLimits;

/// Every tool of this runner, by name.
pub struct Catalog {
    tools: BTreeMap<String, Arc<Entry>>,
    mcp: Option<McpServers>,
    /// Built-ins switched off by configuration, with the reason (answered as `UNAVAILABLE`).
    disabled: BTreeMap<&'static str, &'static str>,
    limits: ArgLimits,
}

impl Catalog {
    /// Builds the catalog; a name used twice (e.g. a command tool named like a built-in) is an error.
    pub fn new(
        builtins: Vec<Builtin>,
        others: Vec<(ToolSpec, Arc<dyn Tool>)>,
        limits: ArgLimits,
    ) -> Result<Self, Error> {
        let mut catalog = Self {
            tools: BTreeMap::new(),
            mcp: None,
            disabled: BTreeMap::new(),
            limits,
        };
        let mut enabled = Vec::new();
        for builtin in builtins {
            match builtin {
                Builtin::Enabled(spec, tool) => enabled.push((spec, tool)),
                Builtin::Disabled { name, reason } => {
                    catalog.disabled.insert(name, reason);
                }
            }
        }
        for (spec, tool) in enabled.into_iter().chain(others) {
            if catalog.tools.contains_key(&spec.name) || catalog.disabled.contains_key(spec.name.as_str()) {
                return Err(Error::Config(format!(
                    "two tools are named {:?} (built-in and command tool names must be unique)",
                    spec.name
                )));
            }
            let name = spec.name.clone();
            let entry = Entry::new(spec, tool).map_err(Error::Config)?;
            catalog.tools.insert(name, Arc::new(entry));
        }
        Ok(catalog)
    }

    /// Adds the tools of `mcp`'s servers (whose tool names must differ from the runner's own).
    pub fn with_mcp(mut self, mcp: McpServers) -> Self {
        self.mcp = Some(mcp);
        self
    }

    /// The runner's own tool names (built-ins, disabled ones included, and command tools): an
    /// MCP tool may not take one.
    pub fn own_names(&self) -> std::collections::BTreeSet<String> {
        let disabled = self.disabled.keys().map(|n| (*n).to_owned());
        self.tools.keys().cloned().chain(disabled).collect()
    }

    /// The MCP servers, if the runner has any.
    pub fn mcp(&self) -> Option<&McpServers> {
        self.mcp.as_ref()
    }

    /// Whether a tool of this name exists (enabled).
    pub fn has(&self, name: &str) -> bool {
        self.find(name).is_some()
    }

    /// Every tool's spec: the runner's own sorted by name, then each MCP server's.
    pub fn specs(&self) -> Vec<ToolSpec> {
        let own = self.tools.values().map(|e| e.spec.clone());
        own.chain(self.mcp.iter().flat_map(McpServers::specs)).collect()
    }

    /// The spec of the tool of this name, if it exists (enabled).
    pub fn spec(&self, name: &str) -> Option<ToolSpec> {
        self.find(name).map(|e| e.spec.clone())
    }

    fn find(&self, name: &str) -> Option<Arc<Entry>> {
        self.tools
            .get(name)
            .cloned()
            .or_else(|| self.mcp.as_ref().and_then(|m| m.lookup(name)))
    }

    /// Checks the call and runs it under the tool's timeout.
    pub async fn run(&self, tool_name: &str, arguments_json: &str, ctx: &CallContext) -> Result<Output, ToolError> {
        let entry = self.lookup(tool_name)?;
        let args = self.parse_arguments(arguments_json)?;
        check_schema(tool_name, &entry.validator, &args)?;
        let Value::Object(args) = args else {
            return Err(ToolError::invalid("arguments must be a JSON object"));
        };
        let timeout = entry.spec.timeout;
        match tokio::time::timeout(timeout, entry.tool.run(args, ctx)).await {
            Ok(result) => result,
            Err(_) => Err(ToolError::retryable(
                ErrorCode::Timeout,
                format!(
                    "{tool_name} did not finish within {} and was stopped",
                    humantime::format_duration(timeout)
                ),
            )),
        }
    }

    fn lookup(&self, name: &str) -> Result<Arc<Entry>, ToolError> {
        if let Some(entry) = self.find(name) {
            return Ok(entry);
        }
        if let Some(reason) = self.disabled.get(name) {
            return Err(ToolError::new(
                ErrorCode::Unavailable,
                format!("tool {name:?} is disabled: {reason}"),
            ));
        }
        let known: Vec<String> = self.specs().into_iter().map(|s| s.name).collect();
        Err(ToolError::new(
            ErrorCode::NotFound,
            format!("no tool named {name:?} (available: {})", known.join(", ")),
        ))
    }

    fn parse_arguments(&self, json: &str) -> Result<Value, ToolError> {
        let ArgLimits { max_bytes, max_depth } = self.limits;
        if json.len() > max_bytes {
            return Err(ToolError::invalid(format!(
                "arguments are {} bytes, above the limit of {max_bytes} bytes",
                json.len()
            )));
        }
        // An empty string is what some models send for "no arguments".
        let json = if json.trim().is_empty() { "{}" } else { json };
        if let Some(depth) = nesting_exceeds(json, max_depth) {
            return Err(ToolError::invalid(format!(
                "arguments nest deeper than {max_depth} levels (at least {depth})"
            )));
        }
        let value: Value =
            serde_json::from_str(json).map_err(|e| ToolError::invalid(format!("arguments are not valid JSON: {e}")))?;
        if !value.is_object() {
            return Err(ToolError::invalid(format!(
                "arguments must be a JSON object, not {}",
                type_name(&value)
            )));
        }
        Ok(value)
    }
}

fn check_schema(tool: &str, validator: &jsonschema::Validator, args: &Value) -> Result<(), ToolError> {
    let violations: Vec<String> = validator
        .iter_errors(args)
        .take(MAX_REPORTED_VIOLATIONS)
        .map(|e| {
            let path = e.instance_path().to_string();
            let at = if path.is_empty() { "(root)".to_owned() } else { path };
            format!("at {at}: {e}")
        })
        .collect();
    if violations.is_empty() {
        return Ok(());
    }
    Err(ToolError::invalid(format!(
        "arguments do not match the schema of {tool:?}: {}",
        violations.join("; ")
    )))
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Scans JSON text (without parsing it) and returns the depth reached once it passes `max`.
/// Runs before the parser so hostile nesting never reaches a recursive algorithm.
pub fn nesting_exceeds(json: &str, max: usize) -> Option<usize> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for b in json.bytes() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                if depth > max {
                    return Some(depth);
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(depth: usize) -> String {
        format!("{}{}", "{\"a\":".repeat(depth), "1".to_owned() + &"}".repeat(depth))
    }

    #[test]
    fn nesting_limit_on_both_sides() {
        assert_eq!(nesting_exceeds(&nested(64), 64), None);
        assert_eq!(nesting_exceeds(&nested(65), 64), Some(65));
        // Brackets inside strings do not count.
        assert_eq!(nesting_exceeds(r#"{"a":"[[[[[[\"[[["}"#, 1), None);
    }
}
