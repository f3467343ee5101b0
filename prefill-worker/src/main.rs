//! pd-prefill: flags -> Config -> `pd_prefill::run`.

use anyhow::Context;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use pd_engine::{set_compute_threads, CacheConfig, DeviceKind, KvCacheDType, LoadOptions, WeightFormat};

pd_engine::model_allocator!();

/// pd prefill worker.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Address to listen on (PrefillWorker service).
    #[arg(long, env = "PD_PREFILL_LISTEN", default_value = "127.0.0.1:0")]
    listen: String,
    /// Address of the HTTP endpoints /metrics, /health and /ready.
    #[arg(long, env = "PD_METRICS_LISTEN", default_value = "127.0.0.1:0")]
    metrics_listen: String,
    /// GGUF file or Hugging Face folder.
    #[arg(long, env = "PD_MODEL", default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// Weights in memory: f16, f32, q8, stored or wq (must match the decode workers').
    #[arg(long, default_value = "wq")]
    weights: WeightFormat,
    #[command(flatten)]
    step: pd_prefill::step::StepArgs,
    /// Turn off the prefix cache (every prompt computed and shipped from its first token).
    #[arg(long, env = "PD_NO_PREFIX_CACHE")]
    no_prefix_cache: bool,
    /// KV cache blocks (of 16 tokens) for the prompts in flight and the cached prefixes.
    #[arg(long, default_value_t = 576)]
    kv_blocks: usize,
    /// How the KV cache stores K and V: f16 (half the memory and attention reads; what the
    /// KV wire carries by default) or f32.
    #[arg(long, env = "PD_KV_CACHE_DTYPE", default_value = "f16")]
    kv_cache_dtype: KvCacheDType,
    /// Longest wait on a decode worker's KV service, in milliseconds.
    #[arg(long, default_value_t = 5_000)]
    kv_timeout_ms: u64,
    /// On SIGTERM, the longest wait for accepted prefills, in milliseconds.
    #[arg(long, env = "PD_GRACE_MS", default_value_t = 30_000)]
    grace_ms: u64,
    /// Compute threads.
    #[arg(long, env = "PD_THREADS", default_value_t = 1)]
    threads: usize,
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
        println!("pd-prefill config ok: {config:?}");
        return Ok(());
    }
    // Before any other thread exists: the compute pools read this once.
    set_compute_threads(args.threads)?;
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(serve(args, config))
}

fn config(args: &Args) -> anyhow::Result<pd_prefill::Config> {
    let config = pd_prefill::Config {
        model: args.model.clone(),
        load: LoadOptions { weights: args.weights, device: args.device },
        cache: CacheConfig {
            prefix_cache: !args.no_prefix_cache,
            dtype: args.kv_cache_dtype,
            ..CacheConfig::with_blocks(args.kv_blocks)
        },
        step: args.step.config().map_err(anyhow::Error::msg)?,
        kv_timeout: Duration::from_millis(args.kv_timeout_ms),
        grace: Duration::from_millis(args.grace_ms),
        tls: args.tls.files().map_err(anyhow::Error::msg)?,
    };
    config.cache.validate()?;
    Ok(config)
}

async fn serve(args: Args, config: pd_prefill::Config) -> anyhow::Result<()> {
    let telemetry = pd_telemetry::init("pd-prefill", args.log_format, "prefill", &pd_telemetry::instance_name());
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("--listen {}: cannot listen there", args.listen))?;
    let http = tokio::net::TcpListener::bind(&args.metrics_listen)
        .await
        .with_context(|| format!("--metrics-listen {}: cannot listen there", args.metrics_listen))?;
    // The lines launchers and tests wait for.
    println!("pd-prefill metrics on {}", http.local_addr()?);
    println!("pd-prefill listening on {}", listener.local_addr()?);
    let result = pd_prefill::run(config, listener, http, pd_telemetry::shutdown_signal()).await;
    if let Err(e) = &result {
        tracing::error!(error = %e, "pd-prefill failed");
    }
    drop(telemetry);
    result
}
