//! pd-prefill: the prefill worker. It runs prompts through its engine in steps, ships every
//! layer's KV to the decode worker named in the request's KV target as soon as the layer is
//! computed, commits with the first token and returns that token with the timings measured
//! here (pd.v1.PrefillWorker). Request-parallel prefill: one step runs chunks of several
//! prompts in one forward (`step` plans it within a time budget, `steps` is the loop), so a
//! short prompt does not wait behind a long document; what waits is reported as waiting
//! prefill tokens (`gauges`), with the measured tokens/s, in the load the router reads.
//!
//! Stages of one request: `service` checks it and reports its spans and metrics; `pipeline`
//! follows it through the steps and ships (its last step layer by layer, the first token and
//! the commit); `error` is the one mapping of failures to gRPC statuses.
//!
//! `/metrics`, `/health` and `/ready` are served on a second, HTTP port. On shutdown
//! (SIGTERM) readiness fails, new prefills are refused, and the process exits once the
//! accepted ones are answered (or the grace period ends).

#![warn(clippy::too_many_lines)] // functions stay under 80 lines (clippy.toml)

pub mod error;
pub mod gauges;
pub mod pipeline;
pub mod score;
pub mod senders;
pub mod service;
pub mod step;
pub mod steps;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_engine::{CacheConfig, Engine, LoadOptions};
use pd_proto::v1::prefill_worker_server::PrefillWorkerServer;
use pd_telemetry::metrics::PrefillMetrics;
use pd_telemetry::Metrics;
use tokio::net::TcpListener;

pub use error::PrefillError;
pub use service::{PrefillService, ServiceConfig};

/// Everything `run` needs.
#[derive(Debug, Clone)]
pub struct Config {
    pub model: PathBuf,
    pub load: LoadOptions,
    /// Blocks for the prompt being prefilled (the longest prompt, plus slack).
    pub cache: CacheConfig,
    /// What one prefill step runs.
    pub step: step::StepConfig,
    /// Longest wait on a decode worker's KV service (connect, window, commit).
    pub kv_timeout: Duration,
    /// On shutdown, the longest wait for accepted prefills to finish.
    pub grace: Duration,
    /// Mutual TLS on the gRPC server and on the KV links to decode workers; None: plaintext.
    pub tls: Option<pd_proto::tls::TlsFiles>,
}

/// Loads the model and serves gRPC on `listener` and the HTTP endpoints on `http` until
/// `shutdown` resolves, then drains.
pub async fn run(
    config: Config,
    listener: TcpListener,
    http: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    let endpoints = pd_telemetry::http::Endpoints::start(http, metrics.clone());
    let engine = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || Engine::load(&config.model, config.load, config.cache)).await??
    };
    let kv_tls = config.tls.as_ref().map(|t| t.client()).transpose().map_err(anyhow::Error::msg)?;
    let service_config = ServiceConfig { step: config.step, kv_timeout: config.kv_timeout, kv_tls };
    let service = PrefillService::new(Arc::new(engine), service_config, PrefillMetrics::register(&metrics))?;
    let scraped = service.clone();
    metrics.on_scrape(move || scraped.refresh_gauges());
    let draining = service.clone();
    let grace = config.grace;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let ready_flag = endpoints.readiness();
    tokio::spawn(async move {
        shutdown.await;
        ready_flag.send_replace(false);
        draining.stop_accepting();
        let deadline = Instant::now() + grace;
        tracing::info!(
            in_flight = draining.in_flight(),
            grace_ms = grace.as_millis() as u64,
            "shutting down: refusing new prefills"
        );
        while draining.in_flight() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if draining.in_flight() > 0 {
            tracing::warn!(in_flight = draining.in_flight(), "grace period over with prefills still running");
        }
        let _ = stop_tx.send(());
    });
    endpoints.set_ready(true);
    let incoming = pd_proto::nodelay_incoming(listener);
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = &config.tls {
        server = server.tls_config(tls.server().map_err(anyhow::Error::msg)?)?;
    }
    let result = server
        .add_service(PrefillWorkerServer::new(service))
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stop_rx.await;
        })
        .await;
    endpoints.stop().await;
    tracing::info!("stopped");
    Ok(result?)
}
