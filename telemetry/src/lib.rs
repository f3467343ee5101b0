//! pd-telemetry: what every pd process shares to be observable.
//!
//! - `logs`: tracing-subscriber setup, human or JSON lines.
//! - `otel`: OpenTelemetry traces exported over OTLP/gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT`
//!   is set (nothing connects otherwise), W3C trace context carried in gRPC metadata and in
//!   plain string maps (the KV transfer header), and `StageSpan`, one span per request stage
//!   with the start and end times measured where the stage happens.
//! - `metrics`: the Prometheus registry, docs/design.md's metric names, latency buckets from
//!   milliseconds to minutes, traffic class and input-length bucket labels.
//! - `http`: `/metrics`, `/health` and `/ready` for processes that have no HTTP server of
//!   their own (the workers speak gRPC).

pub mod http;
pub mod logs;
pub mod metrics;
pub mod otel;

/// Nearest-rank percentile (`q` in 0..=1) of sorted values: the one definition behind the
/// router's per-request ITL percentiles and pd-bench's reports.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted.get(rank.min(sorted.len()) - 1).copied()
}

pub use logs::LogFormat;
pub use metrics::{input_bucket, Metrics, RequestClass, StageLabels};
pub use otel::{StageSpan, Telemetry};

/// Re-exported so the binaries name OpenTelemetry types through one version.
pub use opentelemetry;

/// Initializes logs and (when configured) trace export for the process `service`
/// (`pd-router`, `pd-prefill`, `pd-decode`). Call inside the tokio runtime; keep the
/// returned guard alive until shutdown, when dropping it flushes pending spans.
pub fn init(service: &'static str, format: LogFormat, pool: &str, instance: &str) -> Telemetry {
    logs::init(format);
    otel::init(service, pool, instance)
}

/// Resolves on SIGTERM (Kubernetes stopping the pod) or SIGINT (Ctrl-C).
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The instance name for traces and logs: `POD_NAME` under Kubernetes, else host and pid.
pub fn instance_name() -> String {
    std::env::var("POD_NAME").ok().filter(|s| !s.is_empty()).unwrap_or_else(|| {
        let host = std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
        format!("{host}:{}", std::process::id())
    })
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(50.0));
        assert_eq!(percentile(&v, 0.95), Some(95.0));
        assert_eq!(percentile(&v, 1.0), Some(100.0));
        assert_eq!(percentile(&[7.0], 0.95), Some(7.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0], 0.5), Some(2.0));
        assert_eq!(percentile(&[], 0.5), None);
    }
}
