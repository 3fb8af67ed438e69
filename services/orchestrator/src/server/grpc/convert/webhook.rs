//! `CreateWebhook` requests as a registration (every field checked, `INVALID_ARGUMENT` naming
//! it), `ListWebhookDeliveries` requests as a narrowing, and webhooks and their deliveries as
//! the contract shows them.

use proto::orchestrator::v1 as pb;

use super::{invalid, named_id};
use crate::Error;
use crate::domain::webhook::{DeliveryState, Format, Scope, Topic, Webhook, WebhookDelivery};
use crate::webhooks::{Narrowing, Registration};

impl TryFrom<pb::CreateWebhookRequest> for Registration {
    type Error = Error;

    fn try_from(request: pb::CreateWebhookRequest) -> Result<Self, Error> {
        if request.url.is_empty() {
            return Err(invalid("url is required: where deliveries are POSTed"));
        }
        let scope = match (request.run_id.is_empty(), request.thread_id.is_empty()) {
            (true, true) => Scope::Principal,
            (false, true) => Scope::Run(named_id("run_id", request.run_id)?),
            (true, false) => Scope::Thread(named_id("thread_id", request.thread_id)?),
            (false, false) => return Err(invalid("name at most one of run_id and thread_id")),
        };
        let topics = request
            .events
            .iter()
            .map(|name| {
                Topic::named(name).ok_or_else(|| {
                    invalid(format!(
                        "events: {name:?} is not an event; use run.started, run.awaiting or run.finished"
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let format = match pb::WebhookFormat::try_from(request.format) {
            Ok(pb::WebhookFormat::Unspecified | pb::WebhookFormat::Standard) => Format::Standard,
            Ok(pb::WebhookFormat::A2a) => Format::A2a,
            Err(_) => return Err(invalid(format!("format {} is not a webhook format", request.format))),
        };
        Ok(Self {
            url: request.url,
            scope,
            topics,
            secret: Some(request.secret).filter(|s| !s.is_empty()),
            format,
            headers: request.headers.into_iter().collect(),
        })
    }
}

impl TryFrom<pb::ListWebhookDeliveriesRequest> for Narrowing {
    type Error = Error;

    fn try_from(request: pb::ListWebhookDeliveriesRequest) -> Result<Self, Error> {
        let webhook_id = Some(request.webhook_id).filter(|id| !id.is_empty());
        if let Some(id) = &webhook_id
            && !(id.starts_with("wh_") && id.len() <= 64 && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        {
            return Err(invalid(format!(
                "webhook_id {id:?} is not a webhook id (wh_ and hex digits)"
            )));
        }
        let run_id = match request.run_id.is_empty() {
            true => None,
            false => Some(named_id("run_id", request.run_id)?),
        };
        Ok(Self { webhook_id, run_id })
    }
}

/// `hook` as the contract shows it, with its secret when `with_secret`.
pub(crate) fn webhook_pb(hook: Webhook, with_secret: bool) -> pb::Webhook {
    let (run_id, thread_id) = match hook.scope {
        Scope::Run(run_id) => (run_id, String::new()),
        Scope::Thread(thread_id) => (String::new(), thread_id),
        Scope::Principal => (String::new(), String::new()),
    };
    pb::Webhook {
        id: hook.id,
        url: hook.url,
        events: hook.topics.iter().map(|t| t.name().to_owned()).collect(),
        run_id,
        thread_id,
        secret: if with_secret { hook.secret } else { String::new() },
        created_at_unix_ms: hook.created_unix_ms,
        format: match hook.format {
            Format::Standard => pb::WebhookFormat::Standard,
            Format::A2a => pb::WebhookFormat::A2a,
        }
        .into(),
        header_names: hook.headers.into_keys().collect(),
    }
}

/// `delivery` as the contract shows it.
pub(crate) fn delivery_pb(delivery: WebhookDelivery) -> pb::WebhookDelivery {
    let state = match delivery.state {
        DeliveryState::Pending => pb::WebhookDeliveryState::Pending,
        DeliveryState::Delivered => pb::WebhookDeliveryState::Delivered,
        DeliveryState::Failed => pb::WebhookDeliveryState::Failed,
        DeliveryState::Dropped => pb::WebhookDeliveryState::Dropped,
        DeliveryState::Canceled => pb::WebhookDeliveryState::Canceled,
    };
    pb::WebhookDelivery {
        id: delivery.id,
        webhook_id: delivery.webhook_id,
        event: delivery.topic.name().to_owned(),
        run_id: delivery.run_id,
        state: state.into(),
        attempts: delivery.attempts,
        last_status: delivery.last_status.map_or(0, u32::from),
        last_error: delivery.last_error.unwrap_or_default(),
        created_at_unix_ms: delivery.created_unix_ms,
        last_attempt_unix_ms: delivery.last_attempt_unix_ms,
        next_attempt_unix_ms: if delivery.state == DeliveryState::Pending {
            delivery.next_attempt_unix_ms
        } else {
            0
        },
        body: delivery.body,
    }
}
