//! gRPC plumbing both services serve the same way: reflection, and [`Gate`], the tower layer
//! shape of every check that admits or refuses a request before its route.

use std::task::{Context, Poll};

use futures::future::BoxFuture;
use tonic::codegen::http;
use tonic_reflection::server::v1::{ServerReflection, ServerReflectionServer};
use tonic_reflection::server::v1alpha;
use tower::{Layer, Service};

/// The reflection service v1 (so `grpcurl` works without .proto files), knowing our contracts,
/// gRPC health and reflection itself, and listing `served` (the service's own gRPC service),
/// health and reflection: not the other contract's service, which this process does not serve.
pub fn reflection_service(
    served: &str,
) -> Result<ServerReflectionServer<impl ServerReflection>, tonic_reflection::server::Error> {
    reflection_builder(served).build_v1()
}

/// The same reflection as v1alpha, which older clients speak only (Python's
/// `grpc_reflection.v1alpha`, older grpcurl, grpcui and Postman).
pub fn reflection_service_v1alpha(
    served: &str,
) -> Result<v1alpha::ServerReflectionServer<impl v1alpha::ServerReflection>, tonic_reflection::server::Error> {
    reflection_builder(served).build_v1alpha()
}

fn reflection_builder(served: &str) -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
        .with_service_name(served)
        .with_service_name("grpc.health.v1.Health")
        .with_service_name("grpc.reflection.v1.ServerReflection")
        .with_service_name("grpc.reflection.v1alpha.ServerReflection")
}

/// A check in front of the gRPC routes that lets a request through or answers it at once with a
/// status, as a tower layer ([`GateLayer`]). What it lets through may carry a pass, held until
/// the call is done (a concurrency permit, say).
pub trait Gate: Clone + Send + Sync + 'static {
    /// Held for the duration of an admitted call.
    type Pass: Send + 'static;
    /// Admits `request` (and may add to its extensions), or refuses it with a status.
    fn admit<B>(&self, request: &mut http::Request<B>) -> Result<Self::Pass, tonic::Status>;
}

/// The tower layer applying a [`Gate`].
#[derive(Clone, Debug)]
pub struct GateLayer<G>(pub G);

impl<S, G: Clone> Layer<S> for GateLayer<G> {
    type Service = GateService<S, G>;
    fn layer(&self, inner: S) -> Self::Service {
        GateService {
            inner,
            gate: self.0.clone(),
        }
    }
}

/// See [`GateLayer`].
#[derive(Clone, Debug)]
pub struct GateService<S, G> {
    inner: S,
    gate: G,
}

impl<S, G, ReqBody, ResBody> Service<http::Request<ReqBody>> for GateService<S, G>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    G: Gate,
    ReqBody: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<ReqBody>) -> Self::Future {
        // Take the service that was polled ready, leave a fresh clone behind (tower's idiom).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        match self.gate.admit(&mut request) {
            Err(status) => Box::pin(futures::future::ready(Ok(status.into_http()))),
            Ok(pass) => Box::pin(async move {
                let response = inner.call(request).await;
                drop(pass);
                response
            }),
        }
    }
}
