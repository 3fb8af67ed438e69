//! The agents file: TOML, one `[[agent]]` table per agent, read and checked whole. A definition
//! holds what a request would otherwise spell (model, system message, tools, exit tools,
//! approval rules, parameters, limits, busy policy), who may use it and what a request naming it
//! may override. Its version is a digest of the definition as read, so it changes whenever the
//! definition does.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::domain::agent::Override;
use crate::domain::ids;
use crate::domain::thread::BusyPolicy;

/// The most agents one file may define.
pub(crate) const MAX_AGENTS: usize = 1024;
/// The largest agents file read.
pub(crate) const MAX_FILE_BYTES: u64 = 4 * 1024 * 1024;

/// One exit tool of an agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ExitTool {
    /// Its name.
    pub(crate) name: String,
    /// What it does, for the model.
    #[serde(default)]
    pub(crate) description: String,
    /// Its arguments' JSON Schema, as JSON text (empty: any object).
    #[serde(default)]
    pub(crate) parameters_json_schema: String,
}

/// An agent's sampling parameters (unset: the server's).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Params {
    pub(crate) temperature: Option<f32>,
    pub(crate) top_p: Option<f32>,
    pub(crate) max_tokens: Option<u32>,
    pub(crate) tool_choice: Option<String>,
}

/// An agent's limits (unset: the server's defaults), as `RunLimits` names them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Limits {
    pub(crate) max_turns: Option<u32>,
    pub(crate) tool_call_budget: Option<u32>,
    pub(crate) max_tool_failures: Option<u32>,
    pub(crate) tool_timeout_ms: Option<u32>,
    pub(crate) run_timeout_ms: Option<u32>,
    pub(crate) approval_timeout_ms: Option<u32>,
    pub(crate) input_timeout_ms: Option<u32>,
    pub(crate) max_total_tokens: Option<u64>,
}

/// One `[[agent]]` of the file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Definition {
    /// What requests name it by.
    pub(crate) name: String,
    /// What it is for, for people choosing one.
    #[serde(default)]
    pub(crate) description: String,
    /// Its model (unset: the server's).
    pub(crate) model: Option<String>,
    /// Its system message.
    #[serde(default)]
    pub(crate) system: String,
    /// Its normal tools, by name (unset: every tool its caller may use).
    pub(crate) tools: Option<Vec<String>>,
    #[serde(default)]
    pub(crate) exit_tools: Vec<ExitTool>,
    /// Tools whose calls wait for a person's approval (`*` for every normal tool).
    #[serde(default)]
    pub(crate) needs_approval: Vec<String>,
    #[serde(default)]
    pub(crate) params: Params,
    #[serde(default)]
    pub(crate) limits: Limits,
    /// Its busy policy on a thread (unset: reject).
    #[serde(
        default,
        deserialize_with = "BusyPolicy::deserialize_name",
        serialize_with = "BusyPolicy::serialize_name"
    )]
    pub(crate) on_busy: Option<BusyPolicy>,
    /// The principals that may use it (`*` globs; unset: every caller).
    pub(crate) principals: Option<Vec<String>>,
    /// What a request naming it may set besides its messages.
    #[serde(default)]
    pub(crate) overridable: Vec<Override>,
}

impl Definition {
    /// A digest of the definition (16 hexadecimal digits): the same definition, the same version
    /// on every replica.
    pub(crate) fn version(&self) -> String {
        let canonical = serde_json::to_vec(self).unwrap_or_default();
        let digest = Sha256::digest(&canonical);
        digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
    }

    /// Whether `principal` may use it (`anonymous`: a server without authentication).
    pub(crate) fn open_to(&self, principal: &str, anonymous: bool) -> bool {
        anonymous
            || self
                .principals
                .as_ref()
                .is_none_or(|patterns| patterns.iter().any(|p| shared::auth::glob_match(p, principal)))
    }

    /// Whether a request naming it may set `what`.
    pub(crate) fn allows(&self, what: Override) -> bool {
        self.overridable.contains(&what)
    }

    /// What is wrong with it, if anything.
    fn check(&self) -> Result<(), String> {
        ids::check("agent name", &self.name)?;
        for tool in &self.exit_tools {
            if tool.name.is_empty() {
                return Err(format!("agent {:?}: an exit tool without a name", self.name));
            }
            if !tool.parameters_json_schema.is_empty() {
                serde_json::from_str::<serde_json::Value>(&tool.parameters_json_schema).map_err(|e| {
                    format!(
                        "agent {:?}: exit tool {:?}: parameters_json_schema is not JSON: {e}",
                        self.name, tool.name
                    )
                })?;
            }
        }
        if self.model.as_deref() == Some("") {
            return Err(format!(
                "agent {:?}: model is empty (leave it out for the server's)",
                self.name
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AgentsFile {
    #[serde(default)]
    agent: Vec<Definition>,
}

/// The agents of `source` (the file at `path`) by name, each checked; the first problem found
/// otherwise, naming the agent.
pub(crate) fn parse(path: &Path, source: &[u8]) -> Result<BTreeMap<String, Definition>, String> {
    let at = |reason: String| format!("agents file {}: {reason}", path.display());
    let text = std::str::from_utf8(source).map_err(|e| at(format!("not UTF-8: {e}")))?;
    let file: AgentsFile = toml::from_str(text).map_err(|e| at(e.to_string()))?;
    if file.agent.len() > MAX_AGENTS {
        return Err(at(format!("more than {MAX_AGENTS} [[agent]] tables")));
    }
    let mut agents = BTreeMap::new();
    for agent in file.agent {
        agent.check().map_err(at)?;
        let name = agent.name.clone();
        if agents.insert(name.clone(), agent).is_some() {
            return Err(at(format!("agent {name:?} is defined twice")));
        }
    }
    Ok(agents)
}

/// The bytes of the agents file at `path`, refused past [`MAX_FILE_BYTES`].
pub(crate) fn read(path: &Path) -> Result<Vec<u8>, String> {
    let at = |reason: String| format!("agents file {}: {reason}", path.display());
    let meta = std::fs::metadata(path).map_err(|e| at(e.to_string()))?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(at(format!("larger than {MAX_FILE_BYTES} bytes")));
    }
    std::fs::read(path).map_err(|e| at(e.to_string()))
}
