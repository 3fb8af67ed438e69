//! The relay's floor (`bench --paced`'s "floor" row): the least a relay of a model's stream into
//! a gRPC stream can do. `Orchestrate` opens one streamed chat completion (HTTP/1.1, the same
//! client library as the orchestrator), and writes each SSE event's text as one `text_delta`,
//! then `run_finished` at its end; nothing else — no run, no loop, no bounds, no log, no metrics. The
//! benchmark measures its CPU per token beside the orchestrator's on the same stand-in model.
//!
//! `relay_floor --listen 127.0.0.1:0 --model-url http://…/v1` (an OpenAI base URL): prints `listening on <address>` once
//! it serves.

use std::pin::Pin;

use futures::{Stream, StreamExt as _};
use proto::orchestrator::v1 as pb;
use tonic::{Request, Response, Status};

type Events = Pin<Box<dyn Stream<Item = Result<pb::OrchestrateEvent, Status>> + Send>>;

struct Floor {
    http: reqwest::Client,
    completions: String,
}

/// The bounds of what the floor holds: one event queued per stream.
const QUEUED: usize = 1;

fn unimplemented<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented("the relay floor only relays Orchestrate"))
}

#[tonic::async_trait]
impl pb::orchestrator_server::Orchestrator for Floor {
    type OrchestrateStream = Events;
    type AttachRunStream = Events;
    type SubscribeSignalsStream = Pin<Box<dyn Stream<Item = Result<pb::SignalEvent, Status>> + Send>>;

    async fn orchestrate(&self, request: Request<pb::OrchestrateRequest>) -> Result<Response<Events>, Status> {
        let request = request.into_inner();
        let messages: Vec<serde_json::Value> = request
            .messages
            .iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
            .collect();
        let body = serde_json::json!({"model": request.model, "messages": messages, "stream": true});
        let response = self
            .http
            .post(&self.completions)
            .json(&body)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let (tx, rx) = tokio::sync::mpsc::channel(QUEUED);
        tokio::spawn(relay(response, tx));
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(rx).boxed()))
    }

    async fn attach_run(&self, _: Request<pb::AttachRunRequest>) -> Result<Response<Events>, Status> {
        unimplemented()
    }
    async fn start_run(&self, _: Request<pb::OrchestrateRequest>) -> Result<Response<pb::StartRunResponse>, Status> {
        unimplemented()
    }
    async fn list_agents(&self, _: Request<pb::ListAgentsRequest>) -> Result<Response<pb::ListAgentsResponse>, Status> {
        unimplemented()
    }
    async fn create_webhook(&self, _: Request<pb::CreateWebhookRequest>) -> Result<Response<pb::Webhook>, Status> {
        unimplemented()
    }
    async fn list_webhooks(
        &self,
        _: Request<pb::ListWebhooksRequest>,
    ) -> Result<Response<pb::ListWebhooksResponse>, Status> {
        unimplemented()
    }
    async fn delete_webhook(
        &self,
        _: Request<pb::DeleteWebhookRequest>,
    ) -> Result<Response<pb::DeleteWebhookResponse>, Status> {
        unimplemented()
    }
    async fn list_webhook_deliveries(
        &self,
        _: Request<pb::ListWebhookDeliveriesRequest>,
    ) -> Result<Response<pb::ListWebhookDeliveriesResponse>, Status> {
        unimplemented()
    }
    async fn get_run(&self, _: Request<pb::GetRunRequest>) -> Result<Response<pb::RunResult>, Status> {
        unimplemented()
    }
    async fn list_runs(&self, _: Request<pb::ListRunsRequest>) -> Result<Response<pb::ListRunsResponse>, Status> {
        unimplemented()
    }
    async fn get_usage(&self, _: Request<pb::GetUsageRequest>) -> Result<Response<pb::GetUsageResponse>, Status> {
        unimplemented()
    }
    async fn cancel_run(&self, _: Request<pb::CancelRunRequest>) -> Result<Response<pb::CancelRunResponse>, Status> {
        unimplemented()
    }
    async fn send_message(
        &self,
        _: Request<pb::SendMessageRequest>,
    ) -> Result<Response<pb::SendMessageResponse>, Status> {
        unimplemented()
    }
    async fn get_thread(&self, _: Request<pb::GetThreadRequest>) -> Result<Response<pb::Thread>, Status> {
        unimplemented()
    }
    async fn delete_thread(
        &self,
        _: Request<pb::DeleteThreadRequest>,
    ) -> Result<Response<pb::DeleteThreadResponse>, Status> {
        unimplemented()
    }
    async fn decide_tool_calls(
        &self,
        _: Request<pb::DecideToolCallsRequest>,
    ) -> Result<Response<pb::DecideToolCallsResponse>, Status> {
        unimplemented()
    }
    async fn answer_tool_input(
        &self,
        _: Request<pb::AnswerToolInputRequest>,
    ) -> Result<Response<pb::AnswerToolInputResponse>, Status> {
        unimplemented()
    }
    async fn list_pending_approvals(
        &self,
        _: Request<pb::ListPendingApprovalsRequest>,
    ) -> Result<Response<pb::ListPendingApprovalsResponse>, Status> {
        unimplemented()
    }
    async fn subscribe_signals(
        &self,
        _: Request<pb::SubscribeSignalsRequest>,
    ) -> Result<Response<Self::SubscribeSignalsStream>, Status> {
        unimplemented()
    }
}

/// Reads the completion's SSE events and writes each one's text as a `text_delta`, then
/// `run_finished` (completed) at `[DONE]` or the stream's end; stops when the caller goes away.
async fn relay(response: reqwest::Response, tx: tokio::sync::mpsc::Sender<Result<pb::OrchestrateEvent, Status>>) {
    use eventsource_stream::Eventsource as _;
    let mut events = response.bytes_stream().eventsource();
    let event = |event| pb::OrchestrateEvent {
        event: Some(event),
        ..Default::default()
    };
    while let Some(sse) = events.next().await {
        let sse = match sse {
            Ok(sse) => sse,
            Err(e) => {
                let _ = tx
                    .send(Err(Status::unavailable(format!("the model's stream: {e}"))))
                    .await;
                return;
            }
        };
        if sse.data == "[DONE]" {
            break;
        }
        let Ok(chunk) = serde_json::from_str::<serde_json::Value>(&sse.data) else {
            continue;
        };
        let Some(text) = chunk["choices"][0]["delta"]["content"]
            .as_str()
            .filter(|t| !t.is_empty())
        else {
            continue;
        };
        let delta = pb::orchestrate_event::Event::TextDelta(pb::TextDelta {
            text: text.to_owned(),
            turn: 1,
        });
        if tx.send(Ok(event(delta))).await.is_err() {
            return;
        }
    }
    let result = pb::RunResult {
        status: pb::RunStatus::Completed as i32,
        ..Default::default()
    };
    let finished = pb::orchestrate_event::Event::RunFinished(pb::RunFinished { result: Some(result) });
    let _ = tx.send(Ok(event(finished))).await;
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (mut listen, mut model_url) = ("127.0.0.1:0".to_owned(), None);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--listen" => {
                listen = args
                    .next()
                    .ok_or_else(|| anyhow::anyhow!("--listen needs an address"))?
            }
            "--model-url" => model_url = args.next(),
            other => anyhow::bail!("unknown flag {other}: relay_floor --listen ADDR --model-url URL"),
        }
    }
    let model_url = model_url.ok_or_else(|| anyhow::anyhow!("--model-url is required"))?;
    let floor = Floor {
        http: reqwest::Client::builder().http1_only().build()?,
        completions: format!("{}/chat/completions", model_url.trim_end_matches('/')),
    };
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("listening on {}", listener.local_addr()?);
    tonic::transport::Server::builder()
        .add_service(pb::orchestrator_server::OrchestratorServer::new(floor))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
        .await?;
    Ok(())
}
