//! Named agents: the agents file (`--agents`, TOML) names agent configurations that a request
//! names (`OrchestrateRequest.agent`) instead of spelling them, overriding only what the agent
//! allows. The file is read again when it changes (every `--tls-reload-interval`, as the tokens
//! file is); one that does not read or check leaves the agents in place, said in the log.
//! `file.rs` reads and checks the file; what a request makes of an agent is the gRPC adapter's
//! (`server/grpc/convert/agent.rs`).

pub(crate) mod file;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use shared::auth::Principal;
use shared::runtime::AbortOnDrop;

pub(crate) use self::file::Definition;
use crate::domain::agent::AgentRef;

/// One agent as the server serves it: its definition and that definition's version.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Agent {
    pub(crate) definition: Definition,
    pub(crate) version: String,
}

impl Agent {
    /// What a run of it records.
    pub(crate) fn reference(&self) -> AgentRef {
        AgentRef {
            name: self.definition.name.clone(),
            version: self.version.clone(),
        }
    }
}

/// The agents as last read, and the bytes they were read from (a file that did not change is
/// not parsed again).
#[derive(Default)]
struct Table {
    source: Vec<u8>,
    agents: BTreeMap<String, Arc<Agent>>,
}

/// The agents of the server: none without `--agents`.
pub(crate) struct Agents {
    path: Option<PathBuf>,
    table: RwLock<Arc<Table>>,
}

impl Agents {
    /// The agents of the file at `path` (`None`: no agents); a file that does not read or check
    /// is a startup error.
    pub(crate) fn load(path: Option<&Path>) -> Result<Self, String> {
        let table = match path {
            Some(path) => table(path, file::read(path)?)?,
            None => Table::default(),
        };
        Ok(Self {
            path: path.map(Path::to_owned),
            table: RwLock::new(Arc::new(table)),
        })
    }

    /// No agents: a request naming one is told so.
    pub(crate) fn none() -> Self {
        Self {
            path: None,
            table: RwLock::default(),
        }
    }

    fn table(&self) -> Arc<Table> {
        Arc::clone(&shared::sync::read(&self.table))
    }

    /// Reads the file again and uses it when it changed (`Ok(true)`); on an error the agents
    /// stay as they were.
    pub(crate) fn reload_if_changed(&self) -> Result<bool, String> {
        let Some(path) = &self.path else { return Ok(false) };
        let source = file::read(path)?;
        if source == self.table().source {
            return Ok(false);
        }
        let table = table(path, source)?;
        *shared::sync::write(&self.table) = Arc::new(table);
        Ok(true)
    }

    /// Checks the file every `interval` until the handle is dropped (`None` without a file).
    pub(crate) fn watch(self: &Arc<Self>, interval: Duration) -> Option<AbortOnDrop> {
        self.path.as_ref()?;
        let agents = Arc::clone(self);
        Some(AbortOnDrop(shared::tasks::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                ticker.tick().await;
                match agents.reload_if_changed() {
                    Ok(true) => tracing::info!("--agents changed; new runs take the new definitions"),
                    Ok(false) => {}
                    Err(e) => tracing::warn!("keeping the previous agents: {e}"),
                }
            }
        })))
    }

    /// The agent `name` when `caller` may use it; `None` for an unknown one and for one not open
    /// to the caller alike, so a caller learns nothing of agents it may not use.
    pub(crate) fn for_caller(&self, name: &str, caller: &Principal) -> Option<Arc<Agent>> {
        self.table()
            .agents
            .get(name)
            .filter(|agent| agent.definition.open_to(&caller.name, caller.is_anonymous()))
            .cloned()
    }

    /// The agents `caller` may use, by name.
    pub(crate) fn open_to(&self, caller: &Principal) -> Vec<Arc<Agent>> {
        self.table()
            .agents
            .values()
            .filter(|agent| agent.definition.open_to(&caller.name, caller.is_anonymous()))
            .cloned()
            .collect()
    }
}

/// The table of the file at `path` holding `source`.
fn table(path: &Path, source: Vec<u8>) -> Result<Table, String> {
    let agents = file::parse(path, &source)?
        .into_iter()
        .map(|(name, definition)| {
            let version = definition.version();
            (name, Arc::new(Agent { definition, version }))
        })
        .collect();
    Ok(Table { source, agents })
}

#[cfg(test)]
mod tests;
