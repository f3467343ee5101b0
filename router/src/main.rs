//! pd-router: flags -> Config -> `pd_router::run`.

use anyhow::Context;
use std::path::PathBuf;

use clap::Parser;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

extern "C" {
    /// mimalloc's option setter (in the library the `mimalloc` crate links).
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
}

/// `mi_option_purge_delay` in mimalloc's `mi_option_e` (the same in its v2 and v3 headers).
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

/// Keeps freed pages for reuse instead of returning them to the kernel 10 ms after they
/// empty (mimalloc's default): every request's buffers then landed on freshly faulted pages
/// that the kernel zeroes, 8% of the router's CPU with 64 + 64 workers (bench/fleet.sh,
/// PERF=1). A router's working set is small and steady.
fn keep_freed_pages() {
    // SAFETY: sets one integer option; mimalloc allows it at any time.
    unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, -1) }
}

/// pd router.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// HTTP (OpenAI API) listen address.
    #[arg(long, env = "PD_HTTP_LISTEN", default_value = "127.0.0.1:8080")]
    http_listen: String,
    /// gRPC (pd.v1.Generation) listen address.
    #[arg(long, env = "PD_GRPC_LISTEN", default_value = "127.0.0.1:50051")]
    grpc_listen: String,
    /// Prefill workers, host:port (DNS names are re-resolved on every request). None:
    /// colocated serving, the decode workers prefill every prompt in their batch.
    #[arg(long, env = "PD_PREFILL_WORKERS", value_delimiter = ',')]
    prefill: Vec<String>,
    /// Traffic classes (TOML; see deploy/classes/default.toml, the built-in set).
    #[arg(long, env = "PD_CLASSES")]
    classes: Option<PathBuf>,
    /// Conditional disaggregation: a prompt of at most this many tokens may be prefilled on
    /// the decode worker (0 = never) ...
    #[arg(long, env = "PD_LOCAL_PREFILL_MAX_TOKENS", default_value_t = 0)]
    local_prefill_max_tokens: usize,
    /// ... and at most this many times its max_tokens ...
    #[arg(long, default_value_t = 4.0)]
    local_prefill_max_ratio: f64,
    /// ... while the prefill pool's estimated wait is at least this (milliseconds) ...
    #[arg(long, default_value_t = 500)]
    local_prefill_min_wait_ms: u64,
    /// ... and the decode worker keeps this fraction of its KV blocks free.
    #[arg(long, default_value_t = 0.25)]
    local_prefill_min_free_kv: f64,
    /// How often every worker's load is read (milliseconds).
    #[arg(long, env = "PD_REFRESH_MS", default_value_t = 100)]
    refresh_ms: u64,
    /// At most this many load queries per second: with more workers than that in
    /// `--refresh-ms`, rounds come less often (a query on a worker's open `LoadStream` costs
    /// the router about 25 us of CPU, a `Load` call to a worker without it about 50).
    #[arg(long, env = "PD_MAX_LOAD_CALLS_PER_S", default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..))]
    max_load_calls_per_s: u32,
    /// Prefill tokens per second assumed for a worker that has not measured its own rate
    /// (the development VM's core does 290-400 for short prompts).
    #[arg(long, default_value_t = 300.0)]
    prefill_tokens_per_s: f64,
    /// Tokens of each prompt in flight counted at most when estimating a prefill worker's
    /// wait for a new short prompt (conditional disaggregation's `min-wait` rule).
    #[arg(long, default_value_t = 256)]
    prefill_step_tokens: usize,
    /// Cache-aware routing: in the choice of a decode worker, each prompt block a worker does
    /// not hold in its prefix cache counts as this many KV blocks of load (0: ignore caches).
    #[arg(long, env = "PD_PREFIX_WEIGHT", default_value_t = 2.0, value_parser = non_negative)]
    prefix_weight: f64,
    /// A decode worker that lost a stream (its requests moved to others) gets no new requests
    /// from this router for this long, in milliseconds.
    #[arg(long, env = "PD_QUARANTINE_MS", default_value_t = 10_000)]
    quarantine_ms: u64,
    /// A client that takes no event of its stream for this long (milliseconds) loses the
    /// request: its decode sequence is cancelled and its KV freed.
    #[arg(long, env = "PD_CLIENT_SEND_TIMEOUT_MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    client_send_timeout_ms: u64,
    /// Long prompts (whose own prefill, at the measured rate, takes at least half of what
    /// admission allows the tightest class's TTFT SLO) prefilled at once per prefill worker;
    /// more wait while shorter requests pass them.
    #[arg(long, env = "PD_LONG_PREFILLS_PER_WORKER", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    long_prefills_per_worker: u64,
    /// Write each request's prompt and generated text into its log record and root span
    /// (by default they appear in no log line and no span).
    #[arg(long, env = "PD_LOG_CONTENT")]
    log_content: bool,
    /// An HTTP connection that has not sent a whole request head within this many
    /// milliseconds is closed (silent, slowloris and idle keep-alive connections).
    #[arg(long, env = "PD_HEADER_READ_TIMEOUT_MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    header_read_timeout_ms: u64,
    /// A request body not read whole within this many milliseconds of its head is answered
    /// 408 and its connection closed (a client trickling its body).
    #[arg(long, env = "PD_BODY_READ_TIMEOUT_MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    body_read_timeout_ms: u64,
    /// Decode workers, host:port (DNS names are re-resolved on every request).
    #[arg(long, env = "PD_DECODE_WORKERS", value_delimiter = ',', required = true)]
    decode: Vec<String>,
    /// Model file or folder (only its tokenizer and chat template are read).
    #[arg(long, env = "PD_MODEL", default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// A chat template file (Jinja, as in tokenizer_config.json) used instead of the model's
    /// own, as vLLM's and SGLang's --chat-template: a tool-use or corrected template.
    #[arg(long, env = "PD_CHAT_TEMPLATE")]
    chat_template: Option<PathBuf>,
    /// Thinking models' `<think>` blocks (templates that write them: Qwen3, SmolLM3,
    /// DeepSeek-R1's distills): `think` returns the block as `reasoning_content` and the rest as
    /// `content`, as vLLM's and SGLang's reasoning parsers; `none` leaves it in `content`.
    #[arg(long, env = "PD_REASONING_PARSER", value_parser = ["think", "none"], default_value = "think")]
    reasoning_parser: String,
    /// Name clients pass as `model`.
    #[arg(long, env = "PD_MODEL_NAME", default_value = "SmolLM2-135M-Instruct")]
    model_name: String,
    /// Largest `max_tokens` accepted.
    #[arg(long, default_value_t = 4096)]
    max_tokens: u32,
    /// Largest `n` (answers per request, sharing one prefill) accepted; keep it at most the
    /// decode workers' --max-batch.
    #[arg(long, env = "PD_MAX_N", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    max_n: u32,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    body_limit: usize,
    /// On SIGTERM, how long /ready fails before the listeners close (milliseconds).
    #[arg(long, env = "PD_DRAIN_DELAY_MS", default_value_t = 5_000)]
    drain_delay_ms: u64,
    /// Log lines: human or json.
    #[arg(long, env = "PD_LOG_FORMAT", default_value = "human")]
    log_format: pd_telemetry::LogFormat,
    #[command(flatten)]
    tls: pd_proto::tls::TlsArgs,
    /// Check the flags and environment, print the settings and exit (loads nothing, opens
    /// no socket): for deployment checks.
    #[arg(long)]
    check_config: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    keep_freed_pages();
    let args = Args::parse();
    let config = pd_router::Config {
        model: args.model,
        chat_template: args.chat_template,
        separate_reasoning: args.reasoning_parser == "think",
        model_name: args.model_name,
        prefill_workers: args.prefill,
        decode_workers: args.decode,
        classes: pd_router::classes::Classes::load(args.classes.as_deref())?,
        schedule: pd_router::schedule::ScheduleConfig {
            refresh: std::time::Duration::from_millis(args.refresh_ms.max(1)),
            max_load_calls_per_s: args.max_load_calls_per_s,
            local: pd_router::schedule::policy::LocalRule {
                max_tokens: args.local_prefill_max_tokens,
                max_ratio: args.local_prefill_max_ratio,
                min_prefill_wait: std::time::Duration::from_millis(args.local_prefill_min_wait_ms),
                min_free_kv: args.local_prefill_min_free_kv,
            },
            prior_tokens_per_s: args.prefill_tokens_per_s,
            step_budget: args.prefill_step_tokens,
            prefix_weight: args.prefix_weight,
            quarantine: std::time::Duration::from_millis(args.quarantine_ms),
            client_send_timeout: std::time::Duration::from_millis(args.client_send_timeout_ms),
            long_prefills_per_worker: args.long_prefills_per_worker as usize,
        },
        limits: pd_router::Limits {
            max_tokens: args.max_tokens,
            default_completion_tokens: 16,
            default_chat_tokens: 512,
            max_n: args.max_n,
        },
        body_limit: args.body_limit,
        drain_delay: std::time::Duration::from_millis(args.drain_delay_ms),
        tls: args.tls.files().map_err(anyhow::Error::msg)?,
        log_content: args.log_content,
        header_read_timeout: std::time::Duration::from_millis(args.header_read_timeout_ms),
        body_read_timeout: std::time::Duration::from_millis(args.body_read_timeout_ms),
    };
    if args.check_config {
        println!("pd-router config ok: {config:?}");
        return Ok(());
    }
    let telemetry = pd_telemetry::init("pd-router", args.log_format, "router", &pd_telemetry::instance_name());
    let http = tokio::net::TcpListener::bind(&args.http_listen)
        .await
        .with_context(|| format!("--http-listen {}: cannot listen there", args.http_listen))?;
    let grpc = tokio::net::TcpListener::bind(&args.grpc_listen)
        .await
        .with_context(|| format!("--grpc-listen {}: cannot listen there", args.grpc_listen))?;
    println!("pd-router http on {} grpc on {}", http.local_addr()?, grpc.local_addr()?);
    let result = pd_router::run(config, http, grpc, pd_telemetry::shutdown_signal()).await;
    if let Err(e) = &result {
        tracing::error!(error = %e, "pd-router failed");
    }
    drop(telemetry); // flushes pending spans
    result
}

/// A finite number >= 0.
fn non_negative(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("`{s}` is not a number >= 0")),
    }
}
