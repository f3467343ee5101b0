//! Decode worker settings: flags (clap, in main.rs) become this plain, validated `Config`.

use std::path::PathBuf;
use std::time::Duration;

use pd_engine::{CacheConfig, LoadOptions, WireDType};

/// Everything `run` needs.
#[derive(Debug, Clone)]
pub struct Config {
    pub model: PathBuf,
    pub load: LoadOptions,
    pub cache: CacheConfig,
    /// Element type the worker asks prefill workers to send KV in.
    pub kv_dtype: WireDType,
    /// Default lease of a KV reservation.
    pub lease: Duration,
    /// host:port prefill workers use to reach this worker's KvTransfer service (defaults to
    /// the listener's address).
    pub advertise: Option<String>,
    /// How prefill workers send KV here (advertised in reservation answers).
    pub kv_transport: pd_kv_transfer::transport::Transport,
    /// The UCX listener's address with the UCX transport (None: the listener's host, port 0).
    pub kv_ucx_listen: Option<std::net::SocketAddr>,
    /// Most sequences in one decode step.
    pub max_batch: usize,
    /// How prompts prefilled here share steps with running streams.
    pub prefill_policy: crate::batch::PrefillPolicy,
    /// On shutdown, how long running sequences may take to finish before they are ended
    /// with UNAVAILABLE.
    pub grace: Duration,
    /// Mutual TLS on the gRPC server (DecodeWorker and KvTransfer); None: plaintext.
    pub tls: Option<pd_proto::tls::TlsFiles>,
}
