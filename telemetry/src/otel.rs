//! Traces: OTLP/gRPC export, W3C context propagation and one span per request stage.
//!
//! Spans are made with the OpenTelemetry API directly (not through `tracing`), because a
//! stage's span is often opened on one task or thread and closed on another (the decode
//! batch thread), and some stages are measured by a component that only reports durations
//! (the KV receiver): `StageSpan::start_at` gives such a span its measured start time.
//!
//! Without `OTEL_EXPORTER_OTLP_ENDPOINT` the global tracer stays OpenTelemetry's no-op one:
//! nothing is recorded and nothing connects, but incoming trace context still passes through
//! to the next hop. With an endpoint that cannot be reached, serving goes on; the first
//! failed export logs one warning, later ones only at debug level.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{Status, TraceContextExt, Tracer};
use opentelemetry::{global, Context, KeyValue, Value};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use opentelemetry_sdk::Resource;

/// The environment variable that turns trace export on (OpenTelemetry's standard name).
pub const ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// Keeps trace export running; dropping it flushes and stops the exporter.
#[derive(Debug)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// True when spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports every finished span now (waits up to the exporter's timeout).
    pub fn flush(&self) {
        if let Some(p) = &self.provider {
            let _ = p.force_flush();
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.force_flush();
            let _ = p.shutdown();
        }
    }
}

/// Sets up propagation and, when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, OTLP export with the
/// resource attributes `service.name`, `service.instance.id` and `pd.pool`.
pub fn init(service: &'static str, pool: &str, instance: &str) -> Telemetry {
    global::set_text_map_propagator(TraceContextPropagator::new());
    let endpoint = match std::env::var(ENDPOINT_ENV) {
        Ok(e) if !e.trim().is_empty() => e.trim().to_string(),
        _ => return Telemetry { provider: None },
    };
    let exporter = match opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint.clone())
        .with_timeout(Duration::from_secs(3))
        .build()
    {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!(endpoint, error = %e, "trace export is off: the OTLP exporter could not be built");
            return Telemetry { provider: None };
        }
    };
    let resource = Resource::builder()
        .with_service_name(service)
        .with_attributes([
            KeyValue::new("service.instance.id", instance.to_string()),
            KeyValue::new("pd.pool", pool.to_string()),
        ])
        .build();
    let provider = SdkTracerProvider::builder()
        .with_resource(resource)
        .with_batch_exporter(WarnOnce::new(exporter, endpoint.clone()))
        .build();
    global::set_tracer_provider(provider.clone());
    tracing::info!(endpoint, service, "exporting traces over OTLP/gRPC");
    Telemetry { provider: Some(provider) }
}

/// Forwards to the OTLP exporter; logs the first failure as a warning, later ones at debug.
#[derive(Debug)]
struct WarnOnce<E> {
    inner: E,
    endpoint: String,
    warned: Arc<AtomicBool>,
}

impl<E> WarnOnce<E> {
    fn new(inner: E, endpoint: String) -> Self {
        WarnOnce { inner, endpoint, warned: Arc::new(AtomicBool::new(false)) }
    }
}

impl<E: SpanExporter> SpanExporter for WarnOnce<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        if let Err(e) = &result {
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(endpoint = %self.endpoint, spans, error = %e, "exporting spans failed; serving goes on (further failures are logged at debug level)");
            } else {
                tracing::debug!(endpoint = %self.endpoint, spans, error = %e, "exporting spans failed");
            }
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

// --- propagation --------------------------------------------------------------------------

struct HeaderInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct HeaderExtractor<'a>(&'a axum::http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Writes `cx`'s trace context (`traceparent`, `tracestate`) into gRPC request metadata.
pub fn inject_metadata(cx: &Context, metadata: &mut tonic::metadata::MetadataMap) {
    TraceContextPropagator::new().inject_context(cx, &mut HeaderInjector(metadata));
}

/// The trace context of incoming gRPC metadata (an empty context when there is none).
pub fn extract_metadata(metadata: &tonic::metadata::MetadataMap) -> Context {
    let headers = metadata.clone().into_headers();
    extract_headers(&headers)
}

/// The trace context of incoming HTTP headers (an empty context when there is none).
pub fn extract_headers(headers: &axum::http::HeaderMap) -> Context {
    TraceContextPropagator::new().extract(&HeaderExtractor(headers))
}

/// `cx`'s trace context as a string map (carried in the KV transfer header).
pub fn inject_map(cx: &Context) -> HashMap<String, String> {
    let mut map = HashMap::new();
    TraceContextPropagator::new().inject_context(cx, &mut map);
    map
}

/// The trace context of a string map written by `inject_map`.
pub fn extract_map(map: &HashMap<String, String>) -> Context {
    TraceContextPropagator::new().extract(map)
}

/// A tonic request carrying `cx`'s trace context.
pub fn request_with_context<T>(message: T, cx: &Context) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    inject_metadata(cx, request.metadata_mut());
    request
}

// --- stage spans --------------------------------------------------------------------------

/// One stage of one request, as an OpenTelemetry span; ends when dropped (or by `end*`).
#[derive(Debug)]
pub struct StageSpan {
    cx: Context,
}

impl StageSpan {
    /// Starts `name` now, as a child of the span in `parent` (a root if there is none).
    pub fn start(name: &'static str, parent: &Context) -> Self {
        let span = global::tracer("pd").start_with_context(name, parent);
        StageSpan { cx: parent.with_span(span) }
    }

    /// Starts `name` at `start`, measured earlier by whatever ran the stage.
    pub fn start_at(name: &'static str, parent: &Context, start: SystemTime) -> Self {
        let tracer = global::tracer("pd");
        let span = tracer.span_builder(name).with_start_time(start).start_with_context(&tracer, parent);
        StageSpan { cx: parent.with_span(span) }
    }

    /// The context whose active span is this one (parent of the next stages, and what
    /// travels to the next process).
    pub fn context(&self) -> &Context {
        &self.cx
    }

    /// The trace id in hex (empty when nothing is recorded and no parent came in).
    pub fn trace_id(&self) -> String {
        let sc = self.cx.span().span_context().clone();
        if sc.is_valid() {
            sc.trace_id().to_string()
        } else {
            String::new()
        }
    }

    pub fn set(&self, key: &'static str, value: impl Into<Value>) {
        self.cx.span().set_attribute(KeyValue::new(key, value));
    }

    /// A timestamped event on the span.
    pub fn event(&self, name: &'static str, attributes: Vec<KeyValue>) {
        self.cx.span().add_event(name, attributes);
    }

    /// An event at `at`, measured by whatever ran the stage.
    pub fn event_at(&self, name: &'static str, at: SystemTime, attributes: Vec<KeyValue>) {
        self.cx.span().add_event_with_timestamp(name, at, attributes);
    }

    /// Marks the span failed with `message` (OpenTelemetry status Error plus an exception
    /// event), where the failure happened.
    pub fn error(&self, message: impl Into<String>) {
        let message = message.into();
        let span = self.cx.span();
        span.add_event("exception", vec![KeyValue::new("exception.message", message.clone())]);
        span.set_status(Status::error(message));
    }

    pub fn end(self) {
        self.cx.span().end();
    }

    /// Ends the span at `end`, measured by whatever ran the stage.
    pub fn end_at(self, end: SystemTime) {
        self.cx.span().end_with_timestamp(end);
    }
}

impl Drop for StageSpan {
    fn drop(&mut self) {
        // Ending twice is a no-op: `end`/`end_at` won already if they ran.
        self.cx.span().end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

    fn remote_parent() -> Context {
        let sc = SpanContext::new(
            TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap_or(TraceId::INVALID),
            SpanId::from_hex("b7ad6b7169203331").unwrap_or(SpanId::INVALID),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        Context::new().with_remote_span_context(sc)
    }

    #[test]
    fn context_round_trips_through_maps_and_metadata() {
        let cx = remote_parent();
        let map = inject_map(&cx);
        assert_eq!(
            map.get("traceparent").map(String::as_str),
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        );
        let back = extract_map(&map);
        assert_eq!(back.span().span_context().trace_id(), cx.span().span_context().trace_id());

        let mut md = tonic::metadata::MetadataMap::new();
        inject_metadata(&cx, &mut md);
        let back = extract_metadata(&md);
        assert_eq!(back.span().span_context().span_id(), cx.span().span_context().span_id());
    }

    #[test]
    fn without_a_provider_spans_pass_the_parent_through() {
        // No exporter: the no-op tracer keeps the incoming trace id for the next hop.
        let span = StageSpan::start("test.stage", &remote_parent());
        assert_eq!(span.trace_id(), "0af7651916cd43dd8448eb211c80319c");
        assert!(StageSpan::start("test.root", &Context::new()).trace_id().is_empty());
    }

    #[test]
    fn nothing_exports_without_the_endpoint_variable() {
        if std::env::var_os(ENDPOINT_ENV).is_none() {
            assert!(!init("pd-test", "test", "0").exporting());
        }
    }
}
