//! The `pd.v1.PrefillWorker` service: prompts share one engine chunk by chunk (`gate`:
//! shortest remaining prompt first, no starvation), the prompt's KV
//! shipped layer by layer to the decode worker named in the request, and the request's
//! stages as spans in its trace (`prefill.queue`, `prefill.compute` with an event per
//! chunk, `kv.send`, whose context travels in the KV transfer header so the decode worker's
//! `kv.receive` is its child). While draining (SIGTERM) new prefills are refused with
//! UNAVAILABLE, which the router retries on another worker.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pb::prefill_worker_server::PrefillWorker;
use pd_engine::{Engine, SamplingParams, WireDType};
use pd_kv_transfer::engine_io::{geometry_of, prefill_and_send, ChunkScheduler};
use pd_kv_transfer::grpc::GrpcKvSender;
use pd_kv_transfer::{KvGeometry, TransferError, TransferHeader};
use pd_proto::v1 as pb;
use pd_telemetry::metrics::PrefillMetrics;
use pd_telemetry::opentelemetry::KeyValue;
use pd_telemetry::{input_bucket, RequestClass, StageSpan};
use tonic::{Request, Response, Status};

use crate::gate::{ChunkGate, Turn};

/// Load gauges, updated by `Counted` guards so every exit path counts down.
#[derive(Debug, Default)]
struct Gauges {
    waiting_tokens: AtomicU64,
    queued: AtomicU32,
    running: AtomicU32,
    next_ticket: AtomicU64,
    /// Arrival time of every queued prefill, by ticket (oldest first).
    queued_since: Mutex<BTreeMap<u64, Instant>>,
}

impl Gauges {
    fn oldest_queued_age(&self) -> Duration {
        self.queued_since.lock().ok().and_then(|q| q.values().next().map(|t| t.elapsed())).unwrap_or_default()
    }
}

/// Shared state of the prefill service.
#[derive(Debug, Clone)]
pub struct PrefillService {
    engine: Arc<Engine>,
    /// Whose chunk runs next on this engine (shortest remaining prompt first).
    gate: Arc<ChunkGate>,
    gauges: Arc<Gauges>,
    senders: Arc<Mutex<HashMap<String, GrpcKvSender>>>,
    chunk: usize,
    kv_timeout: Duration,
    metrics: PrefillMetrics,
    stopping: Arc<AtomicBool>,
}

/// The turns of one request at the gate; its first turn moves it from queued to running.
struct Turns<'a> {
    gate: &'a Arc<ChunkGate>,
    counted: &'a Mutex<Counted>,
}

impl ChunkScheduler for Turns<'_> {
    type Turn = Turn;

    async fn turn(&self, remaining_tokens: usize) -> Turn {
        let turn = self.gate.turn(remaining_tokens, Instant::now()).await;
        if let Ok(mut counted) = self.counted.lock() {
            if !counted.running {
                counted.start_running();
            }
        }
        turn
    }
}

/// Counts a request in the gauges from arrival until it is dropped.
struct Counted {
    gauges: Arc<Gauges>,
    tokens: u64,
    ticket: u64,
    running: bool,
}

impl Counted {
    fn new(gauges: Arc<Gauges>, tokens: u64, arrived: Instant) -> Self {
        let ticket = gauges.next_ticket.fetch_add(1, Ordering::Relaxed);
        gauges.waiting_tokens.fetch_add(tokens, Ordering::Relaxed);
        gauges.queued.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut q) = gauges.queued_since.lock() {
            q.insert(ticket, arrived);
        }
        Counted { gauges, tokens, ticket, running: false }
    }

    fn start_running(&mut self) {
        self.leave_queue();
        self.gauges.running.fetch_add(1, Ordering::Relaxed);
        self.running = true;
    }

    fn leave_queue(&self) {
        self.gauges.queued.fetch_sub(1, Ordering::Relaxed);
        if let Ok(mut q) = self.gauges.queued_since.lock() {
            q.remove(&self.ticket);
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.gauges.waiting_tokens.fetch_sub(self.tokens, Ordering::Relaxed);
        if self.running {
            self.gauges.running.fetch_sub(1, Ordering::Relaxed);
        } else {
            self.leave_queue();
        }
    }
}

fn sampling_from_pb(s: Option<pb::SamplingParams>) -> Result<SamplingParams, Status> {
    let s = s.unwrap_or_default();
    let params = SamplingParams {
        temperature: s.temperature as f64,
        top_k: (s.top_k > 0).then_some(s.top_k as usize),
        top_p: (s.top_p > 0.0).then_some(s.top_p as f64),
        seed: s.seed,
        max_tokens: (s.max_tokens as usize).max(1),
        stop_token_ids: s.stop_token_ids,
        stop_strings: s.stop,
        ignore_eos: s.ignore_eos,
    };
    params.validate().map_err(|e| Status::invalid_argument(e.to_string()))?;
    Ok(params)
}

fn geometry_from_target(t: &pb::KvTarget) -> Result<KvGeometry, Status> {
    let dtype = match pb::KvDtype::try_from(t.dtype) {
        Ok(pb::KvDtype::F16) => WireDType::F16,
        Ok(pb::KvDtype::F32) => WireDType::F32,
        _ => return Err(Status::invalid_argument(format!("target.dtype {} is not f16 or f32", t.dtype))),
    };
    Ok(KvGeometry {
        model_fingerprint: t.model_fingerprint,
        dtype,
        num_layers: t.num_layers,
        block_size: t.block_size,
        num_kv_heads: t.num_kv_heads,
        head_dim: t.head_dim,
    })
}

impl PrefillService {
    /// `max_wait`: a prompt waiting longer than this for a chunk's turn goes before shorter
    /// ones (no starvation).
    pub fn new(
        engine: Arc<Engine>,
        chunk: usize,
        kv_timeout: Duration,
        max_wait: Duration,
        metrics: PrefillMetrics,
    ) -> Self {
        PrefillService {
            engine,
            gate: ChunkGate::new(max_wait),
            gauges: Arc::new(Gauges::default()),
            senders: Arc::new(Mutex::new(HashMap::new())),
            chunk: chunk.max(1),
            kv_timeout,
            metrics,
            stopping: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Refuses new prefills from now on (SIGTERM); those already accepted go on.
    pub fn stop_accepting(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    /// Prefills accepted and not yet answered (queued or running).
    pub fn in_flight(&self) -> u32 {
        self.gauges.queued.load(Ordering::Relaxed) + self.gauges.running.load(Ordering::Relaxed)
    }

    /// Updates the scrape-time gauges (waiting tokens, oldest queue age).
    pub fn refresh_gauges(&self) {
        self.metrics.waiting_tokens.set(self.gauges.waiting_tokens.load(Ordering::Relaxed) as f64);
        self.metrics.oldest_age.set(self.gauges.oldest_queued_age().as_secs_f64());
    }

    /// A connected sender to `endpoint`, reused across requests.
    async fn sender(&self, endpoint: &str) -> Result<GrpcKvSender, TransferError> {
        if let Some(s) = self.senders.lock().ok().and_then(|m| m.get(endpoint).cloned()) {
            return Ok(s);
        }
        let sender = GrpcKvSender::connect(endpoint, self.kv_timeout).await?;
        if let Ok(mut m) = self.senders.lock() {
            m.insert(endpoint.to_string(), sender.clone());
        }
        Ok(sender)
    }

    fn forget_sender(&self, endpoint: &str) {
        if let Ok(mut m) = self.senders.lock() {
            m.remove(endpoint);
        }
    }

    fn refuse(&self, reason: &'static str, status: Status) -> Status {
        self.metrics.rejected.with_label_values(&[reason]).inc();
        status
    }

    /// Checks the request and returns (prompt, target, geometry, sampling).
    fn check(&self, req: pb::PrefillRequest) -> Result<(Vec<u32>, pb::KvTarget, KvGeometry, SamplingParams), Status> {
        if req.prompt_tokens.is_empty() {
            return Err(Status::invalid_argument("prompt_tokens is empty"));
        }
        let target = req.target.ok_or_else(|| Status::invalid_argument("target is required"))?;
        let sampling = sampling_from_pb(req.sampling)?;
        let geometry = geometry_from_target(&target)?;
        let ours = geometry_of(&self.engine, geometry.dtype);
        geometry.check_matches(&ours).map_err(|e| Status::failed_precondition(e.to_string()))?;
        let max = self.engine.model().config().max_position;
        if req.prompt_tokens.len() > max {
            return Err(Status::invalid_argument(format!(
                "prompt_tokens ({}) exceed the context length of {max}",
                req.prompt_tokens.len()
            )));
        }
        Ok((req.prompt_tokens, target, geometry, sampling))
    }
}

#[tonic::async_trait]
impl PrefillWorker for PrefillService {
    async fn prefill(&self, request: Request<pb::PrefillRequest>) -> Result<Response<pb::PrefillResponse>, Status> {
        let arrived = Instant::now();
        let parent = pd_telemetry::otel::extract_metadata(request.metadata());
        let class = RequestClass::from_metadata(request.metadata());
        if self.stopping.load(Ordering::Relaxed) {
            return Err(self.refuse("shutting_down", Status::unavailable("the prefill worker is shutting down")));
        }
        let queue_span = StageSpan::start("prefill.queue", &parent);
        let (prompt, target, geometry, sampling) = match self.check(request.into_inner()) {
            Ok(c) => c,
            Err(status) => {
                queue_span.error(status.message());
                return Err(self.refuse("invalid_request", status));
            }
        };
        let tokens = prompt.len();
        let labels = [class.as_str(), input_bucket(tokens)];
        queue_span.set("gen_ai.usage.input_tokens", tokens as i64);
        let counted = Mutex::new(Counted::new(self.gauges.clone(), tokens as u64, arrived));
        let send_span = StageSpan::start("kv.send", &parent);
        send_span.set("pd.kv.backend", "grpc");
        send_span.set("pd.kv.endpoint", target.kv_endpoint.clone());
        send_span.set("pd.kv.blocks", target.block_ids.len() as i64);
        let endpoint = target.kv_endpoint.clone();
        let sender = match self.sender(&endpoint).await {
            Ok(s) => s,
            Err(e) => {
                send_span.error(e.to_string());
                queue_span.error("not started: the decode worker's KV service is unreachable");
                return Err(e.to_status());
            }
        };
        let header = TransferHeader {
            transfer_id: target.transfer_id.clone(),
            geometry,
            block_ids: target.block_ids.clone(),
            num_tokens: tokens as u32,
            trace_context: pd_telemetry::otel::inject_map(send_span.context()),
        };
        let turns = Turns { gate: &self.gate, counted: &counted };
        let sent = prefill_and_send(self.engine.clone(), prompt, self.chunk, header, &sender, &sampling, &turns).await;
        drop(counted);
        let sent = match sent {
            Ok(s) => s,
            Err(e) => {
                if matches!(e, TransferError::Transport(_) | TransferError::Timeout(..)) {
                    self.forget_sender(&endpoint);
                }
                send_span.error(e.to_string());
                StageSpan::start("prefill.compute", &parent).error(e.to_string());
                return Err(e.to_status());
            }
        };
        // Spans of the stages as measured: queued until the first chunk's turn; compute
        // from there to the last chunk (with the waits between chunks when shorter prompts
        // went first, in `pd.prefill.waited_ms`).
        queue_span.end_at(sent.compute_started);
        let compute_span = StageSpan::start_at("prefill.compute", &parent, sent.compute_started);
        compute_span.set("gen_ai.usage.input_tokens", tokens as i64);
        compute_span.set("pd.prefill.chunk_tokens", self.chunk as i64);
        compute_span.set("pd.prefill.compute_ms", sent.prefill_time.as_secs_f64() * 1e3);
        compute_span.set("pd.prefill.waited_ms", sent.waited.as_secs_f64() * 1e3);
        for (i, (chunk_tokens, at)) in sent.chunks.iter().enumerate() {
            compute_span.event_at(
                "prefill.chunk",
                *at,
                vec![KeyValue::new("pd.chunk.index", i as i64), KeyValue::new("pd.chunk.tokens", *chunk_tokens as i64)],
            );
        }
        compute_span.end_at(sent.compute_ended);
        send_span.set("pd.kv.bytes", sent.receipt.bytes as i64);
        send_span.set("pd.kv.frames", sent.receipt.frames as i64);
        send_span.set("pd.kv.layers", sent.layers as i64);
        send_span.set("pd.kv.prefill_end_to_commit_ms", sent.prefill_end_to_commit.as_secs_f64() * 1e3);
        send_span.end();
        self.metrics.queue_time.with_label_values(&labels).observe(sent.waited.as_secs_f64());
        self.metrics.prefill_time.with_label_values(&labels).observe(sent.prefill_time.as_secs_f64());
        self.metrics.kv_transfer_bytes.inc_by(sent.receipt.bytes);
        Ok(Response::new(pb::PrefillResponse {
            first_token: sent.first_token,
            queue_ms: sent.waited.as_secs_f64() * 1e3,
            prefill_ms: sent.prefill_time.as_secs_f64() * 1e3,
            kv_commit_ms: sent.prefill_end_to_commit.as_secs_f64() * 1e3,
            kv_bytes: sent.receipt.bytes,
        }))
    }

    async fn load(&self, _request: Request<pb::LoadRequest>) -> Result<Response<pb::PrefillLoad>, Status> {
        if self.stopping.load(Ordering::Relaxed) {
            // The router's choice skips workers whose load query fails.
            return Err(Status::unavailable("the prefill worker is shutting down"));
        }
        Ok(Response::new(pb::PrefillLoad {
            waiting_prefill_tokens: self.gauges.waiting_tokens.load(Ordering::Relaxed),
            running_prefills: self.gauges.running.load(Ordering::Relaxed),
            queued_prefills: self.gauges.queued.load(Ordering::Relaxed),
        }))
    }
}
