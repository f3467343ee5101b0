//! pd-decode: the decode worker. It owns the paged KV cache, reserves blocks for each request
//! (decode-first), receives the prompt's KV from a prefill worker (pd.v1.KvTransfer on the
//! same port), joins the sequence into the continuously batched decode loop and streams
//! tokens (pd.v1.DecodeWorker). Requests marked `prefill_here` run their prompt in the batch
//! instead (colocated serving, and short prompts under conditional disaggregation), with
//! chunked or naive prefill (`batch::PrefillPolicy`).
//!
//! Layout: `service` (the request's stages: check, reserve, await commit, admit), `batch`
//! (the running batch as synchronous state, unit-tested without a model), `plan` (the pure
//! step planner, which pd-sim also runs), `batcher` (the thread that steps the engine over
//! it), `score` (echo prompts scored in the batch, for colocated serving), `error` (the one
//! mapping to gRPC statuses).
//!
//! `/metrics`, `/health` and `/ready` are served on a second, HTTP port. On shutdown
//! (SIGTERM): readiness fails and new requests are refused; running sequences (and those
//! whose KV is on its way) finish within the grace period, after which the rest end with
//! UNAVAILABLE; the process exits once every KV block is free.

#![warn(clippy::too_many_lines)] // functions stay under 80 lines (clippy.toml)

pub mod batch;
pub mod batcher;
pub mod config;
pub mod error;
pub mod plan;
pub mod score;
pub mod service;

use std::future::Future;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_engine::Engine;
use pd_kv_transfer::grpc::{kv_server_builder, spawn_lease_reaper, KvTransferService};
use pd_kv_transfer::transport::{Transport, UcxServing};
use pd_kv_transfer::KvRegistry;
use pd_proto::v1::decode_worker_server::DecodeWorkerServer;
use pd_telemetry::metrics::DecodeMetrics;
use pd_telemetry::Metrics;
use tokio::net::TcpListener;

pub use config::Config;
pub use error::DecodeError;
pub use service::DecodeService;

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
    let engine = Arc::new(engine);
    let registry = KvRegistry::new(engine.clone());
    let reaper = spawn_lease_reaper(registry.clone(), Duration::from_millis(100));
    let addr = listener.local_addr()?;
    let (kv_endpoint, ucx) = kv_endpoint(&config, addr, &registry)?;
    let decode_metrics = DecodeMetrics::register(&metrics);
    let service = DecodeService {
        batcher: batcher::Batcher::start(
            engine.clone(),
            config.max_batch,
            config.prefill_policy,
            decode_metrics.clone(),
        )?,
        engine,
        registry: registry.clone(),
        kv_endpoint,
        kv_dtype: config.kv_dtype,
        lease: config.lease,
        metrics: decode_metrics,
        stopping: Arc::new(AtomicBool::new(false)),
    };
    let scraped = service.clone();
    metrics.on_scrape(move || scraped.refresh_gauges());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let draining = service.clone();
    let grace = config.grace;
    let ready_flag = endpoints.readiness();
    tokio::spawn(async move {
        shutdown.await;
        ready_flag.send_replace(false);
        draining.stop_accepting();
        drain(&draining, grace).await;
        let _ = stop_tx.send(());
    });
    endpoints.set_ready(true);
    let incoming = pd_proto::nodelay_incoming(listener);
    let mut server = kv_server_builder();
    if let Some(tls) = &config.tls {
        server = server.tls_config(tls.server().map_err(anyhow::Error::msg)?)?;
    }
    let result = server
        .add_service(DecodeWorkerServer::new(service))
        .add_service(KvTransferService::new(registry).into_server())
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stop_rx.await;
        })
        .await;
    reaper.abort();
    if let Some(ucx) = ucx {
        ucx.shutdown().await;
    }
    endpoints.stop().await;
    tracing::info!("stopped");
    Ok(result?)
}

/// The KV endpoint this worker advertises, and the UCX receiver behind it with the UCX
/// transport (the gRPC KvTransfer service is always on the worker's server).
fn kv_endpoint(
    config: &Config,
    addr: std::net::SocketAddr,
    registry: &Arc<KvRegistry>,
) -> anyhow::Result<(String, Option<UcxServing>)> {
    match config.kv_transport {
        Transport::Grpc => Ok((config.advertise.clone().unwrap_or_else(|| addr.to_string()), None)),
        Transport::Ucx => {
            let bind = config.kv_ucx_listen.unwrap_or_else(|| std::net::SocketAddr::new(addr.ip(), 0));
            let ucx =
                UcxServing::start(registry.clone(), bind).map_err(|e| anyhow::anyhow!("--kv-transport ucx: {e}"))?;
            let host = match &config.advertise {
                Some(a) => a.rsplit_once(':').map_or(a.as_str(), |(h, _)| h).to_string(),
                None => addr.ip().to_string(),
            };
            let endpoint = Transport::Ucx.endpoint(&format!("{host}:{}", ucx.local_addr().port()));
            tracing::info!(%endpoint, "KV over UCX");
            Ok((endpoint, Some(ucx)))
        }
    }
}

/// Waits for every KV block to be free: first for `grace` while sequences finish on their
/// own, then after ending the rest (bounded: ended sequences free their blocks within a step).
async fn drain(service: &DecodeService, grace: Duration) {
    let blocks = service.engine.blocks();
    let busy = || blocks.free_blocks() < blocks.total_blocks();
    tracing::info!(
        running = service.batcher.running(),
        grace_ms = grace.as_millis() as u64,
        "shutting down: refusing new requests"
    );
    let deadline = Instant::now() + grace;
    while busy() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if busy() {
        let reservations = service.registry.abort_all("the decode worker is shutting down");
        service.batcher.end_all();
        tracing::warn!(
            running = service.batcher.running(),
            reservations,
            "grace period over: ending the remaining sequences"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while busy() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    tracing::info!(kv_cache_usage = blocks.usage_ratio(), "drained");
}
