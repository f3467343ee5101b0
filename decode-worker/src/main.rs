//! pd-decode: flags -> Config -> `pd_decode::run`.

use anyhow::Context;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use pd_engine::{set_compute_threads, CacheConfig, DeviceKind, KvCacheDType, LoadOptions, WeightFormat, WireDType};

pd_engine::model_allocator!();

/// pd decode worker.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Address to listen on (DecodeWorker and KvTransfer services).
    #[arg(long, env = "PD_DECODE_LISTEN", default_value = "127.0.0.1:0")]
    listen: String,
    /// host:port prefill workers should send KV to (default: the listening address; with
    /// `--kv-transport ucx` its host and the UCX listener's port).
    #[arg(long, env = "PD_DECODE_ADVERTISE")]
    advertise: Option<String>,
    /// How prefill workers send KV here: `grpc` (the KvTransfer service on --listen, under
    /// the gRPC TLS when set) or `ucx` (UCX active messages on --kv-ucx-listen, with UCX_TLS
    /// and UCX_NET_DEVICES from the environment; not covered by the gRPC TLS). Advertised in
    /// every reservation answer.
    #[arg(long, env = "PD_KV_TRANSPORT", default_value = "grpc")]
    kv_transport: pd_kv_transfer::transport::Transport,
    /// Address of the UCX KV listener with `--kv-transport ucx` (default: --listen's host, a
    /// free port).
    #[arg(long, env = "PD_KV_UCX_LISTEN")]
    kv_ucx_listen: Option<std::net::SocketAddr>,
    /// GGUF file or Hugging Face folder.
    #[arg(long, env = "PD_MODEL", default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// Weights in memory: f16, f32, q8, stored or wq (the file's Q4_1/Q8_0 values, f32 activations).
    #[arg(long, default_value = "wq")]
    weights: WeightFormat,
    /// Turn off the prefix cache (every prompt computed and shipped from its first token).
    #[arg(long, env = "PD_NO_PREFIX_CACHE")]
    no_prefix_cache: bool,
    /// KV cache blocks (of 16 tokens).
    #[arg(long, env = "PD_KV_BLOCKS", default_value_t = 2048)]
    kv_blocks: usize,
    /// How the KV cache stores K and V: f16 (half the memory and attention reads; what the
    /// KV wire carries by default) or f32.
    #[arg(long, env = "PD_KV_CACHE_DTYPE", default_value = "f16")]
    kv_cache_dtype: KvCacheDType,
    /// KV wire dtype asked of prefill workers: f16 or f32.
    #[arg(long, default_value = "f16")]
    kv_dtype: String,
    /// Lease of a KV reservation in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    lease_ms: u64,
    /// Most sequences per decode step.
    #[arg(long, default_value_t = 64)]
    max_batch: usize,
    /// Prompts prefilled here (colocated or short ones): `chunked` (256 tokens per step
    /// shared with the decode rows), `chunked:N`, or `naive` (a whole prompt in one step).
    #[arg(long, env = "PD_PREFILL_POLICY", default_value = "chunked")]
    prefill_policy: pd_decode::batch::PrefillPolicy,
    /// Compute threads.
    #[arg(long, env = "PD_THREADS", default_value_t = 1)]
    threads: usize,
    /// Address of the HTTP endpoints /metrics, /health and /ready.
    #[arg(long, env = "PD_METRICS_LISTEN", default_value = "127.0.0.1:0")]
    metrics_listen: String,
    /// On SIGTERM, how long running sequences may take to finish, in milliseconds.
    #[arg(long, env = "PD_GRACE_MS", default_value_t = 30_000)]
    grace_ms: u64,
    /// Log lines: human or json.
    #[arg(long, env = "PD_LOG_FORMAT", default_value = "human")]
    log_format: pd_telemetry::LogFormat,
    /// Where the model runs: cpu, cuda or cuda:N (CUDA needs a build with the `cuda` feature).
    #[arg(long, env = "PD_DEVICE", default_value = "cpu")]
    device: DeviceKind,
    #[command(flatten)]
    tls: pd_proto::tls::TlsArgs,
    /// Check the flags and environment, print the settings and exit (loads nothing, opens
    /// no socket): for deployment checks.
    #[arg(long)]
    check_config: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = config(&args)?;
    if args.check_config {
        println!("pd-decode config ok: {config:?}");
        return Ok(());
    }
    // Before any other thread exists: the compute pools read this once.
    set_compute_threads(args.threads)?;
    if args.kv_transport == pd_kv_transfer::transport::Transport::Ucx
        && std::env::var_os("UCX_TCP_CM_REUSEADDR").is_none()
    {
        // A worker restarted on its UCX port (a restarted pod) must listen again while the
        // killed process's connections linger in TIME_WAIT. UCX reads this from the
        // environment only; set before any thread exists.
        std::env::set_var("UCX_TCP_CM_REUSEADDR", "y");
    }
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(serve(args, config))
}

fn config(args: &Args) -> anyhow::Result<pd_decode::Config> {
    let kv_dtype = match args.kv_dtype.as_str() {
        "f16" => WireDType::F16,
        "f32" => WireDType::F32,
        other => anyhow::bail!("--kv-dtype `{other}` is not f16 or f32"),
    };
    let config = pd_decode::Config {
        model: args.model.clone(),
        load: LoadOptions { weights: args.weights, device: args.device },
        cache: CacheConfig {
            prefix_cache: !args.no_prefix_cache,
            dtype: args.kv_cache_dtype,
            ..CacheConfig::with_blocks(args.kv_blocks)
        },
        kv_dtype,
        lease: Duration::from_millis(args.lease_ms),
        advertise: args.advertise.clone(),
        kv_transport: args.kv_transport,
        kv_ucx_listen: args.kv_ucx_listen,
        max_batch: args.max_batch,
        prefill_policy: args.prefill_policy,
        grace: Duration::from_millis(args.grace_ms),
        tls: args.tls.files().map_err(anyhow::Error::msg)?,
    };
    config.cache.validate()?;
    Ok(config)
}

async fn serve(args: Args, config: pd_decode::Config) -> anyhow::Result<()> {
    let telemetry = pd_telemetry::init("pd-decode", args.log_format, "decode", &pd_telemetry::instance_name());
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("--listen {}: cannot listen there", args.listen))?;
    let http = tokio::net::TcpListener::bind(&args.metrics_listen)
        .await
        .with_context(|| format!("--metrics-listen {}: cannot listen there", args.metrics_listen))?;
    // The lines launchers and tests wait for.
    println!("pd-decode metrics on {}", http.local_addr()?);
    println!("pd-decode listening on {}", listener.local_addr()?);
    let result = pd_decode::run(config, listener, http, pd_telemetry::shutdown_signal()).await;
    if let Err(e) = &result {
        tracing::error!(error = %e, "pd-decode failed");
    }
    drop(telemetry);
    result
}
