//! `webhooks`: register where you are told of your runs (`add`), list and delete your webhooks,
//! and see each delivery's attempts and the receiver's last answer (`deliveries`).

use clap::{Args, Subcommand};
use proto::orchestrator::v1 as pb;

use super::Connection;
use super::output::{Table, print_json, refused, utc};
use crate::Error;

/// Flags of `webhooks`.
#[derive(Debug, Clone, Args)]
pub struct WebhooksArgs {
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connection: Connection,
    #[allow(missing_docs)]
    #[command(subcommand)]
    pub action: Option<Action>,
}

/// What `webhooks` does (`list` when none is named).
#[derive(Debug, Clone, Subcommand)]
pub enum Action {
    /// Register a webhook (CreateWebhook) and print its id and secret (shown this once).
    Add {
        /// Where deliveries are POSTed (http or https).
        url: String,
        /// Only these events: run.started, run.awaiting, run.finished (repeatable; default all).
        #[arg(long = "event", value_name = "EVENT")]
        events: Vec<String>,
        /// Only this run.
        #[arg(long, value_parser = super::run_id, conflicts_with = "thread_id")]
        run_id: Option<String>,
        /// Only the runs of this thread.
        #[arg(long, value_parser = super::thread_id)]
        thread_id: Option<String>,
        /// Your own signing secret (whsec_ and base64); one is made when not given.
        #[arg(long, env = "ORCHESTRATOR_WEBHOOK_SECRET", hide_env_values = true)]
        secret: Option<String>,
        /// A header sent with every delivery, NAME=VALUE (repeatable; e.g. the receiver's own
        /// token).
        #[arg(long = "header", value_name = "NAME=VALUE", value_parser = super::key_value)]
        headers: Vec<(String, String)>,
    },
    /// List your webhooks (ListWebhooks).
    List,
    /// Delete a webhook (DeleteWebhook): its deliveries still waiting are canceled.
    #[command(visible_alias = "rm")]
    Delete {
        /// The webhook's id (wh_…).
        webhook_id: String,
    },
    /// Your deliveries, newest first (ListWebhookDeliveries): state, attempts, last answer.
    Deliveries {
        /// Of this webhook only.
        #[arg(long)]
        webhook: Option<String>,
        /// About this run only.
        #[arg(long, value_parser = super::run_id)]
        run_id: Option<String>,
        /// At most this many (1..=500).
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=500))]
        limit: u32,
    },
}

impl WebhooksArgs {
    /// Does what was asked.
    pub async fn run(&self) -> Result<bool, Error> {
        let client = self.connection.client().await?;
        match self.action.clone().unwrap_or(Action::List) {
            Action::Add {
                url,
                events,
                run_id,
                thread_id,
                secret,
                headers,
            } => {
                let request = pb::CreateWebhookRequest {
                    url,
                    events,
                    run_id: run_id.unwrap_or_default(),
                    thread_id: thread_id.unwrap_or_default(),
                    secret: secret.unwrap_or_default(),
                    headers: headers.into_iter().collect(),
                    ..Default::default()
                };
                let hook = client
                    .create_webhook(request)
                    .await
                    .map_err(|e| refused("register the webhook", e))?;
                if self.connection.json {
                    return print_json(&hook, "orchestrator.v1.Webhook").map(|()| true);
                }
                say!("webhook {} registered for {}", hook.id, hook.url);
                say!("secret: {}", hook.secret);
                say!("(shown this once: verify each delivery's webhook-signature with it)");
                Ok(true)
            }
            Action::List => self.list(&client).await,
            Action::Delete { webhook_id } => {
                client
                    .delete_webhook(&webhook_id)
                    .await
                    .map_err(|e| refused("delete the webhook", e))?;
                say!("webhook {webhook_id} deleted");
                Ok(true)
            }
            Action::Deliveries { webhook, run_id, limit } => {
                let request = pb::ListWebhookDeliveriesRequest {
                    webhook_id: webhook.unwrap_or_default(),
                    run_id: run_id.unwrap_or_default(),
                    limit,
                };
                self.deliveries(&client, request).await
            }
        }
    }

    async fn list(&self, client: &orchestrator_client::Client) -> Result<bool, Error> {
        let webhooks = client
            .list_webhooks()
            .await
            .map_err(|e| refused("list the webhooks", e))?;
        if self.connection.json {
            let answer = pb::ListWebhooksResponse { webhooks };
            return print_json(&answer, "orchestrator.v1.ListWebhooksResponse").map(|()| true);
        }
        let mut table = Table::new(&["WEBHOOK", "URL", "EVENTS", "SCOPE", "CREATED"]);
        for hook in &webhooks {
            let scope = match (hook.run_id.as_str(), hook.thread_id.as_str()) {
                ("", "") => "all runs".to_owned(),
                (run, "") => format!("run {run}"),
                (_, thread) => format!("thread {thread}"),
            };
            table.row(vec![
                hook.id.clone(),
                hook.url.clone(),
                if hook.events.is_empty() {
                    "(all)".to_owned()
                } else {
                    hook.events.join(",")
                },
                scope,
                utc(i64::try_from(hook.created_at_unix_ms).unwrap_or(0)),
            ]);
        }
        table.print();
        if webhooks.is_empty() {
            say!("no webhooks; `orchestrator webhooks add URL` registers one");
        }
        Ok(true)
    }

    async fn deliveries(
        &self,
        client: &orchestrator_client::Client,
        request: pb::ListWebhookDeliveriesRequest,
    ) -> Result<bool, Error> {
        let deliveries = client
            .list_webhook_deliveries(request)
            .await
            .map_err(|e| refused("list the webhook deliveries", e))?;
        if self.connection.json {
            let answer = pb::ListWebhookDeliveriesResponse { deliveries };
            return print_json(&answer, "orchestrator.v1.ListWebhookDeliveriesResponse").map(|()| true);
        }
        let mut table = Table::new(&[
            "DELIVERY", "WEBHOOK", "EVENT", "RUN", "STATE", "ATTEMPTS", "LAST", "CREATED",
        ]);
        for delivery in &deliveries {
            let state = pb::WebhookDeliveryState::try_from(delivery.state)
                .map(|s| {
                    s.as_str_name()
                        .trim_start_matches("WEBHOOK_DELIVERY_STATE_")
                        .to_lowercase()
                })
                .unwrap_or_else(|_| delivery.state.to_string());
            let last = match (delivery.last_status, delivery.last_error.as_str()) {
                (0, "") => "-".to_owned(),
                (status, "") => status.to_string(),
                (_, error) => error.to_owned(),
            };
            table.row(vec![
                delivery.id.clone(),
                delivery.webhook_id.clone(),
                delivery.event.clone(),
                delivery.run_id.clone(),
                state,
                delivery.attempts.to_string(),
                last,
                utc(i64::try_from(delivery.created_at_unix_ms).unwrap_or(0)),
            ]);
        }
        table.print();
        if deliveries.is_empty() {
            say!("no deliveries");
        }
        Ok(true)
    }
}
