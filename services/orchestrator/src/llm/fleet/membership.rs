//! Which endpoints the fleet holds: the static base URLs, and `http://ADDRESS:port/path` for
//! every address each `dns:///name:port/path` resolves to, resolved again every
//! `--llm-resolve-interval`. An endpoint that stays keeps its member (its health and the
//! completions in flight on it); a failed lookup keeps the previous answer.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};

use shared::runtime::AbortOnDrop;
use tokio::time::MissedTickBehavior;

use super::Inner;
use super::member::Member;
use crate::config::{LlmSettings, LlmTarget};
use crate::llm::HttpLlm;
use shared::dns::Resolve;

/// The fleet's targets and the latest answers.
pub(super) struct Membership {
    settings: LlmSettings,
    /// `--llm-ca-file`'s certificates, read once.
    trusted: Vec<reqwest::Certificate>,
    statics: Vec<Arc<Member>>,
    dns: Vec<(String, u16, String)>,
    /// The latest members of each DNS target, by base URL.
    answers: Vec<BTreeMap<String, Arc<Member>>>,
    resolver: Arc<dyn Resolve>,
}

impl Membership {
    /// Builds the static members and resolves the DNS targets once.
    pub(super) async fn start(
        settings: &LlmSettings,
        targets: Vec<LlmTarget>,
        resolver: Arc<dyn Resolve>,
    ) -> Result<Self, String> {
        let trusted = settings.ca_certificates()?;
        let mut statics = Vec::new();
        let mut dns = Vec::new();
        for target in targets {
            match target {
                LlmTarget::Static(url) => statics.push(Member::new(HttpLlm::new(settings.clone(), &url, &trusted)?)),
                LlmTarget::Dns { host, port, path } => dns.push((host, port, path)),
            }
        }
        let mut membership = Self {
            settings: settings.clone(),
            trusted,
            statics,
            answers: vec![BTreeMap::new(); dns.len()],
            dns,
            resolver,
        };
        membership.resolve().await;
        Ok(membership)
    }

    /// Every member now: the static ones, then each DNS target's.
    pub(super) fn members(&self) -> Arc<[Arc<Member>]> {
        let dns = self.answers.iter().flat_map(|answer| answer.values());
        self.statics.iter().chain(dns).cloned().collect()
    }

    /// Follows the DNS targets until the fleet is gone or the task is dropped; `None` when
    /// there is none.
    pub(super) fn follow(mut self, fleet: Weak<Inner>) -> Option<AbortOnDrop> {
        if self.dns.is_empty() {
            return None;
        }
        Some(AbortOnDrop(shared::tasks::spawn(async move {
            let mut ticks = tokio::time::interval(self.settings.endpoint_resolve_interval);
            ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
            ticks.tick().await;
            loop {
                ticks.tick().await;
                self.resolve().await;
                let Some(fleet) = fleet.upgrade() else {
                    return;
                };
                fleet.set_members(self.members());
            }
        })))
    }

    /// Resolves every DNS target; a target whose lookup fails keeps its previous answer.
    async fn resolve(&mut self) {
        for (i, (host, port, path)) in self.dns.iter().enumerate() {
            let addresses = match self.resolver.resolve(host, *port).await {
                Ok(addresses) => addresses,
                Err(e) => {
                    tracing::warn!(%host, "cannot resolve the model endpoints' name: {e}; keeping the last answer");
                    continue;
                }
            };
            let mut answer = BTreeMap::new();
            for address in addresses {
                let url = format!("http://{address}{path}");
                let member = match self.answers[i].get(&url) {
                    Some(member) => Arc::clone(member),
                    None => match HttpLlm::new(self.settings.clone(), &url, &self.trusted) {
                        Ok(client) => Member::new(client),
                        Err(e) => {
                            tracing::warn!(%host, "model endpoint {address} left out: {e}");
                            continue;
                        }
                    },
                };
                answer.insert(url, member);
            }
            if answer.keys().ne(self.answers[i].keys()) {
                tracing::info!(%host, endpoints = answer.len(), "model endpoints of the name changed");
            }
            self.answers[i] = answer;
        }
    }
}
