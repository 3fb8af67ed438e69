//! A2A's push-notification configs as webhooks: a config of a task is a webhook of the caller told
//! of that run in A2A's shape (a `StreamResponse` holding the task's status update), its token
//! and credentials sent as the `X-A2A-Notification-Token` and `Authorization` headers, so pushes
//! come from the webhooks' outbox (at least once, retried, under the egress rules, signed too).
//! A config's id is its webhook's; a token or credentials are never shown again.

use proto::lf::a2a::v1 as a2a;
use proto::orchestrator::v1 as pb;
use proto::orchestrator::v1::orchestrator_server::Orchestrator;

use super::calls::Call;
use super::error::RpcError;

/// The config `hook` stands for (without its token and credentials).
fn config_of(hook: pb::Webhook) -> a2a::TaskPushNotificationConfig {
    a2a::TaskPushNotificationConfig {
        id: hook.id,
        task_id: hook.run_id,
        url: hook.url,
        ..Default::default()
    }
}

fn no_config(task_id: &str, id: &str) -> RpcError {
    RpcError::new(
        -32001,
        format!("task {task_id:?} has no push notification config {id:?}"),
    )
}

impl Call<'_> {
    /// `CreateTaskPushNotificationConfig` (and `SendMessage`'s config, for the task it started).
    pub(super) async fn create_push(
        &self,
        config: a2a::TaskPushNotificationConfig,
    ) -> Result<a2a::TaskPushNotificationConfig, RpcError> {
        if config.task_id.is_empty() {
            return Err(RpcError::invalid_params("params.taskId is required"));
        }
        // Another principal's task is not found, as for every task operation.
        self.get_run(&config.task_id).await?;
        let mut headers = std::collections::HashMap::new();
        if !config.token.is_empty() {
            headers.insert("X-A2A-Notification-Token".to_owned(), config.token.clone());
        }
        if let Some(auth) = &config.authentication
            && !auth.scheme.is_empty()
            && !auth.credentials.is_empty()
        {
            headers.insert(
                "Authorization".to_owned(),
                format!("{} {}", auth.scheme, auth.credentials),
            );
        }
        let request = pb::CreateWebhookRequest {
            url: config.url.clone(),
            run_id: config.task_id.clone(),
            format: pb::WebhookFormat::A2a.into(),
            headers,
            ..Default::default()
        };
        let service = &self.server.service;
        let hook = self.unary(request, |r| service.create_webhook(r)).await?;
        Ok(a2a::TaskPushNotificationConfig { id: hook.id, ..config })
    }

    /// The caller's configs of task `task_id`.
    async fn pushes(&self, task_id: &str) -> Result<Vec<pb::Webhook>, RpcError> {
        self.get_run(task_id).await?;
        let service = &self.server.service;
        let listed = self
            .unary(pb::ListWebhooksRequest {}, |r| service.list_webhooks(r))
            .await?;
        Ok(listed
            .webhooks
            .into_iter()
            .filter(|h| h.run_id == task_id && h.format() == pb::WebhookFormat::A2a)
            .collect())
    }

    /// `GetTaskPushNotificationConfig`.
    pub(super) async fn get_push(
        &self,
        asked: a2a::GetTaskPushNotificationConfigRequest,
    ) -> Result<a2a::TaskPushNotificationConfig, RpcError> {
        let found = self
            .pushes(&asked.task_id)
            .await?
            .into_iter()
            .find(|h| h.id == asked.id);
        found.map(config_of).ok_or_else(|| no_config(&asked.task_id, &asked.id))
    }

    /// `ListTaskPushNotificationConfigs`: every config of the task, on one page.
    pub(super) async fn list_pushes(
        &self,
        asked: a2a::ListTaskPushNotificationConfigsRequest,
    ) -> Result<a2a::ListTaskPushNotificationConfigsResponse, RpcError> {
        let configs = self.pushes(&asked.task_id).await?.into_iter().map(config_of).collect();
        Ok(a2a::ListTaskPushNotificationConfigsResponse {
            configs,
            next_page_token: String::new(),
        })
    }

    /// `DeleteTaskPushNotificationConfig`.
    pub(super) async fn delete_push(
        &self,
        asked: a2a::DeleteTaskPushNotificationConfigRequest,
    ) -> Result<(), RpcError> {
        if !self.pushes(&asked.task_id).await?.iter().any(|h| h.id == asked.id) {
            return Err(no_config(&asked.task_id, &asked.id));
        }
        let service = &self.server.service;
        let delete = pb::DeleteWebhookRequest { webhook_id: asked.id };
        self.unary(delete, |r| service.delete_webhook(r)).await?;
        Ok(())
    }
}
