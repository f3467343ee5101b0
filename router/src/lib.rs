//! pd-router: the front door. A request goes through named stages:
//!
//! - front ends: OpenAI-compatible HTTP (`http`, JSON as the typed structs of `api`) and the
//!   gRPC Generation API with reflection (`grpc`) both decode into `validate::GenerateParams`;
//! - `validate`: one set of checks and defaults, chat template, tokenization;
//! - `classes`: the request's traffic class and its limits;
//! - `schedule`: admission (429 + Retry-After), the router's per-class queues, worker state
//!   from a periodic refresh, where each prompt is prefilled; `workers` holds the channels;
//! - `route`: the scheduler's grant as worker clients, the decision on the route span;
//! - `lifecycle`: the decode worker's reservation and stream, the prefill (`prefill`, with
//!   retries), and `relay`, which merges the prefill worker's first token with the decode
//!   worker's stream, and hands the client its `updates`;
//! - `record`: the request's root span, client-side metrics and log record; `error`: the one
//!   error enum and its HTTP status / gRPC code mapping.

#![warn(clippy::too_many_lines)] // functions stay under 80 lines (clippy.toml)

pub mod api;
pub mod batch;
pub mod classes;
pub mod error;
pub mod grpc;
pub mod http;
pub mod lifecycle;
pub mod prefill;
pub mod reasoning;
pub mod record;
pub mod relay;
pub mod route;
pub mod schedule;
pub mod score;
pub mod serve;
pub mod tenants;
pub mod tools;
pub mod updates;
pub mod validate;
pub mod workers;

/// The gRPC health service's name (grpc.health.v1).
pub const HEALTH_SERVICE: &str = "grpc.health.v1.Health";

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pd_proto::v1::generation_server::GenerationServer;
use pd_telemetry::metrics::RouterMetrics;
use tokio::net::TcpListener;

pub use error::RouterError;
pub use validate::Limits;

/// Everything `run` needs.
#[derive(Debug, Clone)]
pub struct Config {
    /// The model file or folder (the router reads only its tokenizer and chat template).
    pub model: PathBuf,
    /// A chat template file used instead of the model's own (`--chat-template`).
    pub chat_template: Option<PathBuf>,
    /// A thinking model's `<think>` block is returned as `reasoning_content` (`reasoning`).
    pub separate_reasoning: bool,
    /// The name clients use in `model`.
    pub model_name: String,
    /// Empty: colocated serving (decode workers prefill every prompt themselves).
    pub prefill_workers: Vec<String>,
    pub decode_workers: Vec<String>,
    /// Traffic classes (`--classes`, or the built-in interactive + batch).
    pub classes: classes::Classes,
    /// Queues, refresh and where prompts are prefilled.
    pub schedule: schedule::ScheduleConfig,
    pub limits: Limits,
    /// Largest accepted request body in bytes.
    pub body_limit: usize,
    /// After the shutdown signal: how long `/ready` fails while the servers still accept
    /// requests, so load balancers stop sending new ones before the listeners close.
    pub drain_delay: std::time::Duration,
    /// Mutual TLS to the workers (`pd_proto::tls`); None: plaintext.
    pub tls: Option<pd_proto::tls::TlsFiles>,
    /// Put prompts and generated text in the request record and span (off: they appear in
    /// no log line and no span).
    pub log_content: bool,
    /// An HTTP connection that has not sent a whole request head within this is closed
    /// (silent, slowloris and idle keep-alive connections).
    pub header_read_timeout: std::time::Duration,
    /// A request body not read whole within this of its head gets 408.
    pub body_read_timeout: std::time::Duration,
}

/// `text` with the chat template in `path` instead of the model's own (its `bos_token` and
/// `eos_token` are still the model's).
pub fn with_chat_template(
    mut text: pd_engine::TextSide,
    path: &std::path::Path,
) -> anyhow::Result<pd_engine::TextSide> {
    let source = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("--chat-template {}: cannot be read: {e}", path.display()))?;
    let t = &text.tokenizer;
    let text_of = |id: Option<u32>| id.and_then(|i| t.id_to_token(i)).unwrap_or_default();
    let template = pd_engine::ChatTemplate::new(&source, &text_of(t.bos_id()), &text_of(t.eos_ids().first().copied()))
        .map_err(|e| anyhow::anyhow!("--chat-template {}: {e}", path.display()))?;
    text.chat_template = Some(template);
    Ok(text)
}

/// Serves HTTP on `http` and gRPC on `grpc` until `shutdown` resolves.
pub async fn run(
    config: Config,
    http: TcpListener,
    grpc: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let text = {
        let (model, template) = (config.model.clone(), config.chat_template.clone());
        let text = tokio::task::spawn_blocking(move || pd_engine::load_text_side(&model)).await??;
        Arc::new(match template {
            Some(path) => with_chat_template(text, &path)?,
            None => text,
        })
    };
    let metrics = Arc::new(pd_telemetry::Metrics::new());
    let router_metrics = RouterMetrics::register(&metrics);
    // Every label set of the failure counters exists from the start, at 0: an alert on their
    // rate (or on a series being absent) can be written before the first failure.
    for reason in lifecycle::MIGRATION_REASONS {
        router_metrics.migrations.with_label_values(&[reason]);
    }
    for reason in error::RouterError::REASONS {
        router_metrics.rejected.with_label_values(&[reason]);
    }
    let tls = config.tls.as_ref().map(|t| t.client()).transpose().map_err(anyhow::Error::msg)?;
    let pools = Arc::new(workers::Pools {
        decode: workers::Pool::new("decode", config.decode_workers.clone(), tls.clone()),
        prefill: workers::Pool::new("prefill", config.prefill_workers.clone(), tls),
    });
    let scheduler =
        schedule::Scheduler::new(config.classes.clone(), config.schedule.clone(), pools, router_metrics.clone());
    schedule::spawn_refresh(&scheduler).await;
    let state = Arc::new(http::AppState {
        text,
        scheduler,
        limits: config.limits.clone(),
        model_name: config.model_name.clone(),
        body_limit: config.body_limit,
        body_read_timeout: config.body_read_timeout,
        router_metrics,
        metrics,
        draining: AtomicBool::new(false),
        log_content: config.log_content,
        separate_reasoning: config.separate_reasoning,
    });
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let drain_state = state.clone();
    let drain_delay = config.drain_delay;
    let (health, health_service) = tonic_health::server::health_reporter();
    for name in [grpc::SERVICE, ""] {
        health.set_service_status(name, tonic_health::ServingStatus::Serving).await;
    }
    tokio::spawn(async move {
        shutdown.await;
        // Readiness (and gRPC health) fails first; the listeners close after the drain
        // delay, and open streams then run to their end (graceful shutdown of both servers).
        drain_state.draining.store(true, Ordering::Relaxed);
        for name in [grpc::SERVICE, ""] {
            health.set_service_status(name, tonic_health::ServingStatus::NotServing).await;
        }
        tracing::info!(drain_delay_ms = drain_delay.as_millis() as u64, "shutting down: /ready now fails");
        tokio::time::sleep(drain_delay).await;
        let _ = stop_tx.send(true);
    });
    // Reflection in both versions (grpcurl and grpcio-reflection 1.85 speak v1alpha), listing
    // the public services only: the workers' services share the descriptor set but are not
    // served here.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pd_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name(grpc::SERVICE)
            .with_service_name(HEALTH_SERVICE)
    };
    let mut grpc_stop = stop_rx.clone();
    let grpc_server = tonic::transport::Server::builder()
        .add_service(GenerationServer::new(grpc::GenerationService { state: state.clone() }))
        .add_service(reflection().build_v1()?)
        .add_service(reflection().build_v1alpha()?)
        .add_service(health_service)
        .serve_with_incoming_shutdown(pd_proto::nodelay_incoming(grpc), async move {
            let _ = grpc_stop.wait_for(|s| *s).await;
        });
    let http_server = serve::serve_http(http, http::router(state), config.header_read_timeout, stop_rx);
    let (g, ()) = tokio::join!(grpc_server, http_server);
    g?;
    tracing::info!("stopped");
    Ok(())
}
