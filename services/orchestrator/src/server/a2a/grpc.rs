//! A2A's gRPC binding (`lf.a2a.v1.A2AService`), served on the orchestrator's gRPC port beside its
//! own service when `--a2a-listen` is set: the caller is the principal the port's authentication
//! found (a bearer token, a client certificate), a request's `tenant` names the named agent, the
//! operations are `calls.rs`'s and refusals A2A's gRPC codes (a task not found, another
//! principal's too, is `NOT_FOUND`).

use std::pin::Pin;

use futures::{Stream, StreamExt};
use proto::lf::a2a::v1 as a2a;
use proto::lf::a2a::v1::a2a_service_server::A2aService;
use tonic::{Request, Response, Status};

use super::A2a;
use super::calls::{Call, TaskStream};
use super::jsonrpc::refused;

type StatusStream = Pin<Box<dyn Stream<Item = Result<a2a::StreamResponse, Status>> + Send>>;

/// The gRPC face of A2A.
pub(crate) struct A2aGrpc {
    server: A2a,
}

impl A2aGrpc {
    pub(super) fn new(server: A2a) -> Self {
        Self { server }
    }

    /// A call of `request`'s principal, as the named agent its `tenant` names (empty: none).
    fn call<T>(&self, request: &Request<T>, tenant: &str) -> Call<'_> {
        Call {
            server: &self.server,
            agent: (!tenant.is_empty()).then(|| tenant.to_owned()),
            principal: shared::auth::caller(request),
        }
    }
}

fn statuses(stream: TaskStream) -> Response<StatusStream> {
    Response::new(stream.map(|item| item.map_err(Status::from)).boxed())
}

fn not_served<T>(method: &str) -> Result<Response<T>, Status> {
    Err(refused(method).into())
}

#[tonic::async_trait]
impl A2aService for A2aGrpc {
    type SendStreamingMessageStream = StatusStream;
    type SubscribeToTaskStream = StatusStream;

    async fn send_message(
        &self,
        request: Request<a2a::SendMessageRequest>,
    ) -> Result<Response<a2a::SendMessageResponse>, Status> {
        let call = self.call(&request, &request.get_ref().tenant);
        Ok(Response::new(call.send_message(request.into_inner()).await?))
    }

    async fn send_streaming_message(
        &self,
        request: Request<a2a::SendMessageRequest>,
    ) -> Result<Response<StatusStream>, Status> {
        let call = self.call(&request, &request.get_ref().tenant);
        Ok(statuses(call.stream_new(request.into_inner()).await?))
    }

    async fn get_task(&self, request: Request<a2a::GetTaskRequest>) -> Result<Response<a2a::Task>, Status> {
        let call = self.call(&request, &request.get_ref().tenant);
        Ok(Response::new(call.get_task(request.into_inner()).await?))
    }

    async fn list_tasks(
        &self,
        request: Request<a2a::ListTasksRequest>,
    ) -> Result<Response<a2a::ListTasksResponse>, Status> {
        let call = self.call(&request, &request.get_ref().tenant);
        Ok(Response::new(call.list_tasks(request.into_inner()).await?))
    }

    async fn cancel_task(&self, request: Request<a2a::CancelTaskRequest>) -> Result<Response<a2a::Task>, Status> {
        let call = self.call(&request, &request.get_ref().tenant);
        Ok(Response::new(call.cancel_task(request.into_inner()).await?))
    }

    async fn subscribe_to_task(
        &self,
        request: Request<a2a::SubscribeToTaskRequest>,
    ) -> Result<Response<StatusStream>, Status> {
        let call = self.call(&request, &request.get_ref().tenant);
        Ok(statuses(call.subscribe(request.into_inner()).await?))
    }

    async fn create_task_push_notification_config(
        &self,
        request: Request<a2a::TaskPushNotificationConfig>,
    ) -> Result<Response<a2a::TaskPushNotificationConfig>, Status> {
        let call = self.call(&request, &request.get_ref().tenant);
        Ok(Response::new(call.create_push(request.into_inner()).await?))
    }

    async fn get_task_push_notification_config(
        &self,
        request: Request<a2a::GetTaskPushNotificationConfigRequest>,
    ) -> Result<Response<a2a::TaskPushNotificationConfig>, Status> {
        let call = self.call(&request, &request.get_ref().tenant);
        Ok(Response::new(call.get_push(request.into_inner()).await?))
    }

    async fn list_task_push_notification_configs(
        &self,
        request: Request<a2a::ListTaskPushNotificationConfigsRequest>,
    ) -> Result<Response<a2a::ListTaskPushNotificationConfigsResponse>, Status> {
        let call = self.call(&request, &request.get_ref().tenant);
        Ok(Response::new(call.list_pushes(request.into_inner()).await?))
    }

    async fn get_extended_agent_card(
        &self,
        _: Request<a2a::GetExtendedAgentCardRequest>,
    ) -> Result<Response<a2a::AgentCard>, Status> {
        not_served("GetExtendedAgentCard")
    }

    async fn delete_task_push_notification_config(
        &self,
        request: Request<a2a::DeleteTaskPushNotificationConfigRequest>,
    ) -> Result<Response<()>, Status> {
        let call = self.call(&request, &request.get_ref().tenant);
        call.delete_push(request.into_inner()).await?;
        Ok(Response::new(()))
    }
}
