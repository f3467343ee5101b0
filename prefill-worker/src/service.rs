//! The `pd.v1.PrefillWorker` service.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pd_engine::{Engine, SamplingParams, WireDType};
use pd_kv_transfer::engine_io::{geometry_of, prefill_and_send};
use pd_kv_transfer::grpc::GrpcKvSender;
use pd_kv_transfer::{KvGeometry, TransferError, TransferHeader};
use pd_proto::v1 as pb;
use pb::prefill_worker_server::PrefillWorker;
use tokio::sync::Semaphore;
use tonic::{Request, Response, Status};

/// Load gauges, updated by `Admitted` guards so every exit path counts down.
#[derive(Debug, Default)]
struct Gauges {
    waiting_tokens: AtomicU64,
    queued: AtomicU32,
    running: AtomicU32,
}

/// Shared state of the prefill service.
#[derive(Debug, Clone)]
pub struct PrefillService {
    engine: Arc<Engine>,
    /// One prefill at a time on this engine; FIFO (tokio's semaphore is fair).
    slot: Arc<Semaphore>,
    gauges: Arc<Gauges>,
    senders: Arc<Mutex<HashMap<String, GrpcKvSender>>>,
    chunk: usize,
    kv_timeout: Duration,
}

/// Counts a request in the gauges from arrival until it is dropped.
struct Counted {
    gauges: Arc<Gauges>,
    tokens: u64,
    running: bool,
}

impl Counted {
    fn start_running(&mut self) {
        self.gauges.queued.fetch_sub(1, Ordering::Relaxed);
        self.gauges.running.fetch_add(1, Ordering::Relaxed);
        self.running = true;
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.gauges.waiting_tokens.fetch_sub(self.tokens, Ordering::Relaxed);
        let gauge = if self.running { &self.gauges.running } else { &self.gauges.queued };
        gauge.fetch_sub(1, Ordering::Relaxed);
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
    pub fn new(engine: Arc<Engine>, chunk: usize, kv_timeout: Duration) -> Self {
        PrefillService {
            engine,
            slot: Arc::new(Semaphore::new(1)),
            gauges: Arc::new(Gauges::default()),
            senders: Arc::new(Mutex::new(HashMap::new())),
            chunk: chunk.max(1),
            kv_timeout,
        }
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
}

#[tonic::async_trait]
impl PrefillWorker for PrefillService {
    async fn prefill(&self, request: Request<pb::PrefillRequest>) -> Result<Response<pb::PrefillResponse>, Status> {
        let arrived = Instant::now();
        let req = request.into_inner();
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
        let tokens = req.prompt_tokens.len() as u64;
        self.gauges.waiting_tokens.fetch_add(tokens, Ordering::Relaxed);
        self.gauges.queued.fetch_add(1, Ordering::Relaxed);
        let mut counted = Counted { gauges: self.gauges.clone(), tokens, running: false };
        let _permit = self.slot.acquire().await.map_err(|_| Status::unavailable("the prefill worker is stopping"))?;
        counted.start_running();
        let queue_ms = arrived.elapsed().as_secs_f64() * 1e3;
        let endpoint = target.kv_endpoint.clone();
        let sender = self.sender(&endpoint).await.map_err(|e| e.to_status())?;
        let header = TransferHeader {
            transfer_id: target.transfer_id.clone(),
            geometry,
            block_ids: target.block_ids.clone(),
            num_tokens: req.prompt_tokens.len() as u32,
            trace_context: Default::default(),
        };
        let sent = prefill_and_send(self.engine.clone(), req.prompt_tokens, self.chunk, header, &sender, &sampling).await;
        let sent = match sent {
            Ok(s) => s,
            Err(e) => {
                if matches!(e, TransferError::Transport(_) | TransferError::Timeout(..)) {
                    self.forget_sender(&endpoint);
                }
                return Err(e.to_status());
            }
        };
        drop(counted);
        Ok(Response::new(pb::PrefillResponse {
            first_token: sent.first_token,
            queue_ms,
            prefill_ms: sent.prefill_time.as_secs_f64() * 1e3,
            kv_commit_ms: sent.prefill_end_to_commit.as_secs_f64() * 1e3,
            kv_bytes: sent.receipt.bytes,
        }))
    }

    async fn load(&self, _request: Request<pb::LoadRequest>) -> Result<Response<pb::PrefillLoad>, Status> {
        Ok(Response::new(pb::PrefillLoad {
            waiting_prefill_tokens: self.gauges.waiting_tokens.load(Ordering::Relaxed),
            running_prefills: self.gauges.running.load(Ordering::Relaxed),
            queued_prefills: self.gauges.queued.load(Ordering::Relaxed),
        }))
    }
}
