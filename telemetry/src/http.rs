//! A small HTTP server for processes whose API is gRPC: `/metrics` (Prometheus text),
//! `/health` (the process is alive) and `/ready` (it takes new work; false while starting or
//! draining), so Kubernetes probes and Prometheus scrapes need no gRPC client.

use std::future::Future;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::Metrics;

#[derive(Clone)]
struct Served {
    metrics: Arc<Metrics>,
    ready: watch::Receiver<bool>,
}

/// The Prometheus text response for `metrics`.
pub fn metrics_response(metrics: &Metrics) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], metrics.render()).into_response()
}

async fn metrics(State(e): State<Served>) -> Response {
    metrics_response(&e.metrics)
}

async fn ready(State(e): State<Served>) -> Response {
    if *e.ready.borrow() {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready").into_response()
    }
}

/// Serves the three endpoints on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    metrics_registry: Arc<Metrics>,
    ready_flag: watch::Receiver<bool>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .with_state(Served { metrics: metrics_registry, ready: ready_flag });
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

/// A worker's HTTP endpoints, served in the background from `start` until `stop`; `/ready`
/// fails until `set_ready(true)` (model loaded) and again from `set_ready(false)` (draining).
#[derive(Debug)]
pub struct Endpoints {
    ready: watch::Sender<bool>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Endpoints {
    pub fn start(listener: TcpListener, metrics: Arc<Metrics>) -> Self {
        let (ready, ready_rx) = watch::channel(false);
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, metrics, ready_rx, async {
            let _ = stop_rx.await;
        }));
        Endpoints { ready, stop, task }
    }

    /// A handle that sets readiness (for a drain task).
    pub fn readiness(&self) -> watch::Sender<bool> {
        self.ready.clone()
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.send_replace(ready);
    }

    /// Stops serving and waits for the server to end.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn serves_metrics_health_and_readiness() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let m = Arc::new(Metrics::new());
        m.gauge("pd_waiting_prefill_tokens", "test").set(3.0);
        let (ready_tx, ready_rx) = watch::channel(false);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, m, ready_rx, async {
            let _ = stop_rx.await;
        }));
        let client = reqwest::Client::new();
        let get = |p: &str| client.get(format!("http://{addr}{p}")).send();
        assert_eq!(get("/ready").await.expect("ready").status(), 503);
        ready_tx.send_replace(true);
        assert_eq!(get("/ready").await.expect("ready").status(), 200);
        assert_eq!(get("/health").await.expect("health").status(), 200);
        let text = get("/metrics").await.expect("metrics").text().await.expect("body");
        assert!(text.contains("pd_waiting_prefill_tokens 3"), "{text}");
        let _ = stop_tx.send(());
        server.await.expect("join").expect("serve");
    }
}
