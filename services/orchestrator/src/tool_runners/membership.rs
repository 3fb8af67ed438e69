//! Which runner endpoints the pool holds, and how they are reached, kept current in the
//! background: the static endpoints plus every address the DNS targets resolve to (again every
//! `--tool-runner-resolve-interval`), reached with the transport of the `--tool-runner-*` files
//! (checked for changes every `--tls-reload-interval`). Changed files give every endpoint a new
//! channel, so new connections present the new certificate; calls in flight finish on the old one.
//! Files that cannot be used are logged and the previous transport stays.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use shared::runtime::AbortOnDrop;
use tokio::time::MissedTickBehavior;

use super::pool::Pool;
use super::transport::{SharedTransport, Transport, files, files_digest};
use super::{Resolve, Target};
use crate::Error;
use crate::config::ToolRunnerSettings;

/// The targets and the latest DNS answers; see the module docs.
pub(super) struct Membership {
    pool: Arc<Pool>,
    transport: SharedTransport,
    statics: BTreeSet<String>,
    dns: Vec<(String, u16)>,
    /// The latest answer for each of `dns` (a failed lookup keeps the previous one).
    answers: Vec<BTreeSet<String>>,
    resolver: Arc<dyn Resolve>,
}

impl Membership {
    /// Parses the targets (a bad one is an error naming it), resolves the DNS ones and fills
    /// the pool.
    pub(super) async fn start(
        settings: &ToolRunnerSettings,
        resolver: Arc<dyn Resolve>,
        pool: Arc<Pool>,
        transport: SharedTransport,
    ) -> Result<Self, Error> {
        let mut statics = BTreeSet::new();
        let mut dns = Vec::new();
        for target in &settings.endpoints {
            match target
                .parse::<Target>()
                .map_err(|e| Error::Config(format!("--tool-runner {e}")))?
            {
                Target::Static(uri) => {
                    transport.current().endpoint(&uri, None)?;
                    statics.insert(uri);
                }
                Target::Dns { host, port } => dns.push((host, port)),
            }
        }
        let mut membership = Self {
            pool,
            transport,
            statics,
            answers: vec![BTreeSet::new(); dns.len()],
            dns,
            resolver,
        };
        membership.resolve().await;
        membership.update(false);
        Ok(membership)
    }

    /// Keeps the membership current until the returned task is dropped; `None` when there is
    /// nothing to follow (no DNS target, no file).
    pub(super) fn follow(mut self, settings: ToolRunnerSettings, reload_interval: Duration) -> Option<AbortOnDrop> {
        let files = Arc::new(files(&settings));
        let mut digest = files_digest(&files);
        if self.dns.is_empty() && digest.is_none() {
            return None;
        }
        Some(AbortOnDrop(shared::tasks::spawn(async move {
            let mut resolve = tokio::time::interval(settings.resolve_interval);
            let mut reload = tokio::time::interval(reload_interval);
            for ticker in [&mut resolve, &mut reload] {
                ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
                ticker.reset();
            }
            loop {
                tokio::select! {
                    biased;
                    _ = resolve.tick(), if !self.dns.is_empty() => {
                        self.resolve().await;
                        self.update(false);
                    }
                    _ = reload.tick(), if digest.is_some() => {
                        // File reads, off the runtime's threads.
                        let files = Arc::clone(&files);
                        let Ok(now) = tokio::task::spawn_blocking(move || files_digest(&files)).await else {
                            continue;
                        };
                        if now != digest {
                            digest = now;
                            self.reload(&settings);
                        }
                    }
                }
            }
        })))
    }

    /// Resolves every DNS target; a lookup that fails keeps its previous answer.
    async fn resolve(&mut self) {
        let scheme = self.transport.current().dns_scheme();
        for ((host, port), answer) in self.dns.iter().zip(&mut self.answers) {
            match self.resolver.resolve(host, *port).await {
                Ok(addrs) => *answer = addrs.iter().map(|a| format!("{scheme}://{a}")).collect(),
                Err(e) => {
                    tracing::warn!(name = %host, "resolving tool-runners failed (keeping the previous endpoints): {e}");
                }
            }
        }
    }

    /// Builds the transport from the changed files and renews every endpoint with it; files
    /// that cannot be used leave everything as it was.
    fn reload(&self, settings: &ToolRunnerSettings) {
        match Transport::from_settings(settings) {
            Ok(transport) => {
                self.transport.replace(transport);
                self.update(true);
                tracing::info!("tool-runner TLS or token files changed; new connections to the runners use them");
            }
            Err(e) => tracing::warn!("tool-runner files changed but cannot be used ({e}); keeping the previous ones"),
        }
    }

    /// Puts the static endpoints plus the latest DNS answers into the pool; `renew` gives the
    /// endpoints that stay a new channel too (after a transport change).
    fn update(&self, renew: bool) {
        let transport = self.transport.current();
        let found = self
            .answers
            .iter()
            .zip(&self.dns)
            .flat_map(|(uris, (host, _))| uris.iter().map(move |uri| (uri, Some(host.as_str()))));
        let wanted: BTreeMap<&String, Option<&str>> = self.statics.iter().map(|uri| (uri, None)).chain(found).collect();
        let endpoints = wanted
            .into_iter()
            .filter_map(|(uri, server_name)| match transport.endpoint(uri, server_name) {
                Ok(e) => Some((uri.clone(), e)),
                Err(e) => {
                    tracing::warn!("{e}");
                    None
                }
            })
            .collect();
        let (added, removed) = self.pool.set(endpoints, renew);
        for uri in &added {
            tracing::info!(endpoint = %uri, "tool-runner endpoint added");
        }
        for uri in &removed {
            tracing::info!(endpoint = %uri, "tool-runner endpoint removed");
        }
        metrics::gauge!(crate::telemetry::metric::TOOL_RUNNER_ENDPOINTS).set(self.pool.uris().len() as f64);
    }
}
