//! A minimal OTLP/gRPC trace sink: counts the spans the orchestrator exports, so the benchmark can
//! compare a run with export on against one with export off.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};

#[derive(Clone, Default)]
struct Counter(Arc<AtomicUsize>);

#[tonic::async_trait]
impl TraceService for Counter {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans: usize = request
            .into_inner()
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum();
        self.0.fetch_add(spans, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// The running sink.
pub(crate) struct Sink {
    /// `http://127.0.0.1:port`, for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub endpoint: String,
    counter: Counter,
}

impl Sink {
    /// Serves on a free loopback port.
    pub(crate) async fn start() -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let counter = Counter::default();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(counter.clone()))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        Ok(Self { endpoint, counter })
    }

    /// Spans received so far.
    pub(crate) fn spans(&self) -> usize {
        self.counter.0.load(Ordering::Relaxed)
    }
}
