//! Telemetry shared by both binaries: `tracing` logs (text or one JSON object per line, each
//! carrying `trace_id` / `span_id`), OpenTelemetry traces exported over OTLP, and W3C trace-context
//! propagation over gRPC metadata.
//!
//! Configuration is the standard OpenTelemetry environment:
//! * `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`: where to export; nothing
//!   is exported when neither is set (or `OTEL_TRACES_EXPORTER=none`);
//! * `OTEL_EXPORTER_OTLP_PROTOCOL` / `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`: `grpc` (default, port
//!   4317) or `http/protobuf` (port 4318);
//! * `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`: the resource;
//! * `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`: sampling (default parent-based always-on).
//!
//! `RUST_LOG` sets the log filter. Spans are flushed by [`Telemetry::shutdown`].

use std::fmt;
use std::str::FromStr;

use opentelemetry::propagation::{Extractor, Injector, TextMapCompositePropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing::Subscriber;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable, for terminals.
    #[default]
    Text,
    /// One JSON object per line, for machines.
    Json,
}

impl FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(format!("unknown log format {other:?} (expected text or json)")),
        }
    }
}

/// Installs only the log subscriber (no OpenTelemetry); for helpers and tests. A second call does
/// nothing.
pub fn init_logging(format: LogFormat, default_filter: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _already_set = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
    };
}

/// Why telemetry could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("telemetry: {0}")]
pub struct TelemetryError(String);

/// The installed telemetry; call [`Telemetry::shutdown`] before exiting to flush spans.
pub struct Telemetry {
    provider: SdkTracerProvider,
    /// Where spans go, for the startup log line (`None` when not exported).
    pub exporting_to: Option<String>,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

impl Telemetry {
    /// Installs logs and traces for `service_name` (used unless `OTEL_SERVICE_NAME` or
    /// `OTEL_RESOURCE_ATTRIBUTES` names the service).
    pub fn init(service_name: &str, format: LogFormat, default_filter: &str) -> Result<Self, TelemetryError> {
        let endpoint = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"));
        let disabled = env("OTEL_TRACES_EXPORTER").is_some_and(|e| e == "none");
        let mut resource = opentelemetry_sdk::Resource::builder();
        let named_by_env = env("OTEL_SERVICE_NAME").is_some()
            || env("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| a.contains("service.name="));
        if !named_by_env {
            resource = resource.with_service_name(service_name.to_owned());
        }
        let mut builder = SdkTracerProvider::builder().with_resource(resource.build());
        let exporting_to = match endpoint.filter(|_| !disabled) {
            Some(endpoint) => {
                let protocol = env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    .or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
                    .unwrap_or_else(|| "grpc".to_owned());
                let exporter = match protocol.as_str() {
                    "grpc" => opentelemetry_otlp::SpanExporter::builder().with_tonic().build(),
                    "http/protobuf" => opentelemetry_otlp::SpanExporter::builder().with_http().build(),
                    other => {
                        return Err(TelemetryError(format!(
                            "OTEL_EXPORTER_OTLP_PROTOCOL={other:?} is not supported (use grpc or http/protobuf)"
                        )));
                    }
                }
                .map_err(|e| TelemetryError(format!("cannot build the OTLP exporter for {endpoint}: {e}")))?;
                builder = builder.with_batch_exporter(exporter);
                Some(format!("{endpoint} ({protocol})"))
            }
            // Nothing is exported: keep trace ids for logs and propagation, record nothing.
            None => {
                builder = builder.with_sampler(Sampler::AlwaysOff);
                None
            }
        };
        let provider = builder.build();
        opentelemetry::global::set_text_map_propagator(TextMapCompositePropagator::new(vec![
            Box::new(TraceContextPropagator::new()),
            Box::new(BaggagePropagator::new()),
        ]));
        let tracer = provider.tracer(service_name.to_owned());
        let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
        // Spans carry the attributes the code gives them, nothing per poll: the layer's default
        // busy/idle timings and context activation cost two clock reads and a context switch-in
        // on every poll of every instrumented future (every token of a run), and its code
        // location, module and thread attributes (a thread name copied per span) were memory
        // per held run that no dashboard reads. Parents come from the tracing span tree.
        let otel = tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_tracked_inactivity(false)
            .with_context_activation(false)
            .with_location(false)
            .with_threads(false)
            .with_target(false);
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let fmt = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(ansi);
        let registry = tracing_subscriber::registry().with(filter).with(otel);
        let installed = match format {
            LogFormat::Text => registry.with(fmt.event_format(WithTraceIds::text())).try_init(),
            LogFormat::Json => registry
                .with(
                    fmt.event_format(WithTraceIds::json())
                        .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new()),
                )
                .try_init(),
        };
        installed.map_err(|e| TelemetryError(format!("a log subscriber is already installed: {e}")))?;
        Ok(Self { provider, exporting_to })
    }

    /// Runs `work` with logs and traces installed for `service_name` (see [`Telemetry::init`]),
    /// then flushes the spans whatever `work` returned: a binary's whole serving life.
    pub async fn around<T, E: From<TelemetryError>>(
        service_name: &str,
        format: LogFormat,
        default_filter: &str,
        work: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let telemetry = Self::init(service_name, format, default_filter)?;
        if let Some(to) = &telemetry.exporting_to {
            tracing::info!(otlp = %to, "exporting traces");
        }
        let result = work.await;
        telemetry.shutdown().await;
        result
    }

    /// Flushes and stops the exporter (blocking work runs off the async threads).
    pub async fn shutdown(self) {
        let provider = self.provider;
        let _ = tokio::task::spawn_blocking(move || {
            if let Err(e) = provider.shutdown() {
                eprintln!("telemetry: flushing spans failed: {e}");
            }
        })
        .await;
    }
}

/// Formats events with the inner formatter and adds the current span's `trace_id` and `span_id`.
struct WithTraceIds<F> {
    inner: F,
    json: bool,
}

impl WithTraceIds<tracing_subscriber::fmt::format::Format> {
    fn text() -> Self {
        Self {
            inner: tracing_subscriber::fmt::format::Format::default(),
            json: false,
        }
    }
}

impl WithTraceIds<tracing_subscriber::fmt::format::Format<tracing_subscriber::fmt::format::Json>> {
    fn json() -> Self {
        Self {
            inner: tracing_subscriber::fmt::format::Format::default()
                .json()
                .flatten_event(true)
                .with_current_span(true),
            json: true,
        }
    }
}

impl<S, N, F> FormatEvent<S, N> for WithTraceIds<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> fmt::Result {
        let mut line = String::new();
        self.inner.format_event(ctx, Writer::new(&mut line), event)?;
        let ids = if ctx.lookup_current().is_some() {
            let cx = tracing::Span::current().context();
            let span = cx.span();
            let sc = span.span_context();
            sc.is_valid()
                .then(|| (sc.trace_id().to_string(), sc.span_id().to_string()))
        } else {
            None
        };
        let Some((trace_id, span_id)) = ids else {
            return writer.write_str(&line);
        };
        let body = line.trim_end_matches('\n');
        if self.json && body.ends_with('}') {
            let open = &body[..body.len() - 1];
            writeln!(writer, "{open},\"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\"}}")
        } else {
            writeln!(writer, "{body} trace_id={trace_id} span_id={span_id}")
        }
    }
}

/// Reads W3C trace context (`traceparent`, `tracestate`, `baggage`) from gRPC metadata.
struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Writes W3C trace context into gRPC metadata.
struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(key, value);
        }
    }
}

/// Makes `span` continue the trace the caller sent in `metadata` (if any).
pub fn continue_trace(span: &tracing::Span, metadata: &tonic::metadata::MetadataMap) {
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&MetadataExtractor(metadata)));
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// Writes the current span's trace context into outgoing `metadata`.
pub fn inject_current(metadata: &mut tonic::metadata::MetadataMap) {
    let cx = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut MetadataInjector(metadata)));
}

/// The current span's W3C `traceparent`, if it has a valid context (e.g. for message headers).
pub fn current_traceparent() -> Option<String> {
    let mut metadata = tonic::metadata::MetadataMap::new();
    inject_current(&mut metadata);
    metadata
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// At most `max` bytes of `text` (cut on a character boundary), for span attributes and logs.
pub use crate::text::truncate;
