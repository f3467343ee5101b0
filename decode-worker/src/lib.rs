//! pd-decode: the decode worker. It owns the paged KV cache, reserves blocks for each request
//! (decode-first), receives the prompt's KV from a prefill worker (pd.v1.KvTransfer on the
//! same port), joins the sequence into the continuously batched decode loop and streams
//! tokens (pd.v1.DecodeWorker).

pub mod batcher;
pub mod config;
pub mod service;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use pd_engine::Engine;
use pd_kv_transfer::grpc::{spawn_lease_reaper, KvTransferService};
use pd_kv_transfer::KvRegistry;
use pd_proto::v1::decode_worker_server::DecodeWorkerServer;
use tokio::net::TcpListener;

pub use config::Config;
pub use service::DecodeService;

/// Loads the model and serves until `shutdown` resolves.
pub async fn run(config: Config, listener: TcpListener, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
    let engine = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || Engine::load(&config.model, config.load, config.cache)).await??
    };
    let engine = Arc::new(engine);
    let registry = KvRegistry::new(engine.clone());
    let reaper = spawn_lease_reaper(registry.clone(), Duration::from_millis(100));
    let addr = listener.local_addr()?;
    let service = DecodeService {
        batcher: batcher::Batcher::start(engine.clone(), config.max_batch),
        engine,
        registry: registry.clone(),
        kv_endpoint: config.advertise.clone().unwrap_or_else(|| addr.to_string()),
        kv_dtype: config.kv_dtype,
        lease: config.lease,
    };
    let incoming = pd_kv_transfer::grpc::nodelay_incoming(listener);
    let result = tonic::transport::Server::builder()
        .initial_stream_window_size(16 << 20)
        .initial_connection_window_size(64 << 20)
        .add_service(DecodeWorkerServer::new(service))
        .add_service(KvTransferService::new(registry).into_server())
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    reaper.abort();
    Ok(result?)
}
