//! pd-prefill: the prefill worker. It runs each prompt through its own engine in chunks,
//! ships every layer's KV to the decode worker named in the request's KV target as soon as
//! the layer is computed, commits with the first token and returns that token with the
//! timings measured here (pd.v1.PrefillWorker). One prefill runs at a time per engine; the
//! others wait in a FIFO queue whose size is reported as waiting prefill tokens.

pub mod service;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pd_engine::{CacheConfig, Engine, LoadOptions};
use pd_proto::v1::prefill_worker_server::PrefillWorkerServer;
use tokio::net::TcpListener;

pub use service::PrefillService;

/// Everything `run` needs.
#[derive(Debug, Clone)]
pub struct Config {
    pub model: PathBuf,
    pub load: LoadOptions,
    /// Blocks for the prompt being prefilled (the longest prompt, plus slack).
    pub cache: CacheConfig,
    /// Prefill chunk in tokens.
    pub chunk: usize,
    /// Longest wait on a decode worker's KV service (connect, window, commit).
    pub kv_timeout: Duration,
}

/// Loads the model and serves until `shutdown` resolves.
pub async fn run(config: Config, listener: TcpListener, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
    let engine = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || Engine::load(&config.model, config.load, config.cache)).await??
    };
    let service = PrefillService::new(Arc::new(engine), config.chunk, config.kv_timeout);
    let incoming = pd_kv_transfer::grpc::nodelay_incoming(listener);
    tonic::transport::Server::builder()
        .add_service(PrefillWorkerServer::new(service))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}
