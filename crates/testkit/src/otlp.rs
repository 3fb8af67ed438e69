//! An in-process OTLP trace collector (the `opentelemetry-proto` tonic service) the spawned
//! services export their spans to.

use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;

/// Stores every exported span with its resource's `service.name`.
#[derive(Default, Clone)]
pub struct Collector(pub Arc<Mutex<Vec<(String, opentelemetry_proto::tonic::trace::v1::Span)>>>);

impl Collector {
    /// A collector serving on a loopback port; its URL for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub async fn start() -> anyhow::Result<(Self, String)> {
        let collector = Self::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(collector.clone()))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        Ok((collector, url))
    }
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.0.lock().map_err(|_| tonic::Status::internal("poisoned"))?;
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .as_ref()
                .and_then(|r| string_attr(&r.attributes, "service.name"))
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                spans.extend(scope.spans.into_iter().map(|s| (service.clone(), s)));
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// The attribute `key` of a span or resource, if set.
pub fn attr<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a AnyValue> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

/// The string attribute `key`, if set and a string.
pub fn string_attr(attributes: &[KeyValue], key: &str) -> Option<String> {
    match attr(attributes, key)? {
        AnyValue::StringValue(s) => Some(s.clone()),
        AnyValue::IntValue(i) => Some(i.to_string()),
        AnyValue::BoolValue(b) => Some(b.to_string()),
        AnyValue::DoubleValue(d) => Some(d.to_string()),
        _ => None,
    }
}
