//! The `pd.v1.DecodeWorker` service: decode-first reservation (blocks for the prompt and its
//! whole output under a lease), the KV target, then the token stream from the batch loop.
//!
//! Spans in the request's trace: `decode.admit` (the reservation), `kv.receive` (header
//! accepted to commit, as measured by the KV registry; a child of the prefill worker's
//! `kv.send`, whose context came in the transfer header) and `decode.generate` (first token
//! to last, in the batch loop). While draining, new requests are refused with UNAVAILABLE.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use pb::decode_worker_server::DecodeWorker;
use pd_engine::{Engine, SamplingParams, SequenceKv, WireDType};
use pd_kv_transfer::engine_io::geometry_of;
use pd_kv_transfer::{KvRegistry, Reservation, TransferError};
use pd_proto::v1 as pb;
use pd_telemetry::metrics::DecodeMetrics;
use pd_telemetry::{input_bucket, RequestClass, StageSpan};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status};

use crate::batcher::{Admission, Batcher, Event, Start};

/// Shared state of the decode worker's services.
#[derive(Debug, Clone)]
pub struct DecodeService {
    pub(crate) engine: Arc<Engine>,
    pub(crate) registry: Arc<KvRegistry>,
    pub(crate) batcher: Batcher,
    pub(crate) kv_endpoint: String,
    pub(crate) kv_dtype: WireDType,
    pub(crate) lease: Duration,
    pub(crate) metrics: DecodeMetrics,
    pub(crate) stopping: Arc<AtomicBool>,
}

/// Request sampling parameters in the engine's terms, or INVALID_ARGUMENT naming the field.
pub fn sampling_from_pb(s: Option<pb::SamplingParams>) -> Result<SamplingParams, Status> {
    let s = s.ok_or_else(|| Status::invalid_argument("sampling is required"))?;
    let params = SamplingParams {
        temperature: s.temperature as f64,
        top_k: (s.top_k > 0).then_some(s.top_k as usize),
        top_p: (s.top_p > 0.0).then_some(s.top_p as f64),
        seed: s.seed,
        max_tokens: s.max_tokens as usize,
        stop_token_ids: s.stop_token_ids,
        stop_strings: s.stop,
        ignore_eos: s.ignore_eos,
    };
    params.validate().map_err(|e| Status::invalid_argument(e.to_string()))?;
    Ok(params)
}

fn transfer_status(e: TransferError) -> Status {
    e.to_status()
}

impl DecodeService {
    /// Refuses new requests from now on (SIGTERM); running ones go on.
    pub fn stop_accepting(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    /// Updates the scrape-time gauges.
    pub fn refresh_gauges(&self) {
        self.metrics.running.set(self.batcher.running() as f64);
        self.metrics.kv_usage.set(self.engine.blocks().usage_ratio());
    }

    /// A request whose prompt runs here, in the batch: blocks for prompt and output now, no
    /// KV target, no transfer.
    fn generate_here(
        &self,
        req: pb::DecodeRequest,
        params: SamplingParams,
        parent: pd_telemetry::opentelemetry::Context,
        class: String,
        admit: StageSpan,
    ) -> Result<Response<UnboundedReceiverStream<Event>>, Status> {
        let blocks = self.engine.blocks();
        let prompt_tokens = req.prompt_tokens.len();
        let alloc = match blocks.allocate(blocks.blocks_for(prompt_tokens + params.max_tokens)) {
            Ok(a) => a,
            Err(e) => return Err(self.refuse(&admit, "kv_blocks", Status::resource_exhausted(e.to_string()))),
        };
        admit.set("pd.request_id", req.request_id.clone());
        admit.set("pd.prefill_here", true);
        admit.set("pd.kv.blocks_reserved", alloc.ids().len() as i64);
        admit.end();
        let (tx, rx) = mpsc::unbounded_channel::<Event>();
        let span = StageSpan::start("decode.generate", &parent);
        span.set("pd.request_id", req.request_id.clone());
        span.set("pd.prefill_here", true);
        let admission = Admission {
            kv: SequenceKv::new(alloc),
            start: Start::Prompt(req.prompt_tokens),
            params,
            prompt_tokens,
            kv_transfer_ms: 0.0,
            kv_bytes: 0,
            events: tx.clone(),
            span,
            labels: [class, input_bucket(prompt_tokens).to_string()],
        };
        self.batcher.admit(admission)?;
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }

    /// Checks a request; returns its sampling parameters.
    fn check(&self, req: &pb::DecodeRequest) -> Result<SamplingParams, Status> {
        if req.request_id.is_empty() {
            return Err(Status::invalid_argument("request_id is required"));
        }
        if req.prompt_tokens.is_empty() {
            return Err(Status::invalid_argument("prompt_tokens is empty"));
        }
        let params = sampling_from_pb(req.sampling.clone())?;
        let max = self.engine.model().config().max_position;
        let total = req.prompt_tokens.len() + params.max_tokens;
        if total > max {
            return Err(Status::invalid_argument(format!(
                "prompt_tokens ({}) + max_tokens ({}) exceed the context length of {max}",
                req.prompt_tokens.len(),
                params.max_tokens
            )));
        }
        Ok(params)
    }

    fn refuse(&self, span: &StageSpan, reason: &'static str, status: Status) -> Status {
        span.error(status.message());
        self.metrics.rejected.with_label_values(&[reason]).inc();
        status
    }

    fn target(&self, id: &str, block_ids: Vec<u32>, lease: Duration) -> pb::KvTarget {
        let g = geometry_of(&self.engine, self.kv_dtype);
        let deadline = SystemTime::now() + lease;
        pb::KvTarget {
            transfer_id: id.to_string(),
            kv_endpoint: self.kv_endpoint.clone(),
            block_ids,
            model_fingerprint: g.model_fingerprint,
            block_size: g.block_size,
            dtype: match g.dtype {
                WireDType::F16 => pb::KvDtype::F16 as i32,
                WireDType::F32 => pb::KvDtype::F32 as i32,
            },
            num_layers: g.num_layers,
            num_kv_heads: g.num_kv_heads,
            head_dim: g.head_dim,
            lease_deadline_unix_ms: deadline.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0),
        }
    }
}

#[tonic::async_trait]
impl DecodeWorker for DecodeService {
    type GenerateStream = UnboundedReceiverStream<Event>;

    async fn generate(&self, request: Request<pb::DecodeRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        let parent = pd_telemetry::otel::extract_metadata(request.metadata());
        let class = RequestClass::from_metadata(request.metadata()).as_str().to_string();
        let admit = StageSpan::start("decode.admit", &parent);
        if self.stopping.load(Ordering::Relaxed) {
            return Err(self.refuse(
                &admit,
                "shutting_down",
                Status::unavailable("the decode worker is shutting down"),
            ));
        }
        let req = request.into_inner();
        let checked = self.check(&req);
        let params = match checked {
            Ok(p) => p,
            Err(status) => return Err(self.refuse(&admit, "invalid_request", status)),
        };
        if req.prefill_here {
            return self.generate_here(req, params, parent, class, admit);
        }
        let total = req.prompt_tokens.len() + params.max_tokens;
        let blocks = self.engine.blocks();
        let prompt_blocks = blocks.blocks_for(req.prompt_tokens.len());
        // The whole output's blocks are taken now, so decoding never runs out of KV.
        let allocated = blocks.allocate(prompt_blocks).and_then(|prompt| {
            blocks.allocate(blocks.blocks_for(total) - prompt_blocks).map(|growth| (prompt, growth))
        });
        let (prompt_alloc, growth) = match allocated {
            Ok(a) => a,
            Err(e) => return Err(self.refuse(&admit, "kv_blocks", Status::resource_exhausted(e.to_string()))),
        };
        admit.set("pd.request_id", req.request_id.clone());
        admit.set("pd.kv.blocks_reserved", (prompt_alloc.ids().len() + growth.ids().len()) as i64);
        admit.set("gen_ai.request.max_tokens", params.max_tokens as i64);
        let lease = if req.lease_ms > 0 { Duration::from_millis(req.lease_ms as u64) } else { self.lease };
        let block_ids = prompt_alloc.ids().to_vec();
        let outcome = self
            .registry
            .reserve(Reservation {
                transfer_id: req.request_id.clone(),
                geometry: geometry_of(&self.engine, self.kv_dtype),
                blocks: prompt_alloc,
                num_tokens: req.prompt_tokens.len() as u32,
                lease,
            })
            .map_err(|e| match e {
                TransferError::Protocol(m) if m.contains("already reserved") => Status::already_exists(m),
                other => transfer_status(other),
            });
        let outcome = match outcome {
            Ok(o) => o,
            Err(status) => return Err(self.refuse(&admit, "reservation", status)),
        };
        admit.set("pd.kv.free_blocks_after", blocks.free_blocks() as i64);
        admit.end();
        let (tx, rx) = mpsc::unbounded_channel::<Event>();
        let target = self.target(&req.request_id, block_ids, lease);
        let _ = tx.send(crate::batcher::event(pb::decode_event::Event::Target(target)));
        let (registry, batcher, id) = (self.registry.clone(), self.batcher.clone(), req.request_id.clone());
        let prompt_tokens = req.prompt_tokens.len();
        let labels = [class, input_bucket(prompt_tokens).to_string()];
        let metrics = self.metrics.clone();
        let layers = self.engine.model().config().num_layers as i64;
        tokio::spawn(async move {
            let committed = tokio::select! {
                outcome = outcome => outcome,
                _ = tx.closed() => {
                    // The client went away before the KV arrived: free the reservation now.
                    let _ = registry.abort(&id, "client disconnected");
                    return;
                }
            };
            let committed = match committed {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    StageSpan::start("kv.receive", &parent).error(e.to_string());
                    let _ = tx.send(Err(transfer_status(e)));
                    return;
                }
                Err(_) => {
                    let _ = tx.send(Err(Status::internal("the KV reservation vanished")));
                    return;
                }
            };
            // The receive as the registry measured it: header accepted to commit.
            let now = SystemTime::now();
            let receive = StageSpan::start_at(
                "kv.receive",
                &pd_telemetry::otel::extract_map(&committed.trace_context),
                now.checked_sub(committed.receive_time).unwrap_or(now),
            );
            receive.set("pd.kv.bytes", committed.bytes as i64);
            receive.set("pd.kv.frames", committed.frames as i64);
            receive.set("pd.kv.layers", layers);
            receive.end_at(now);
            metrics
                .kv_transfer_time
                .with_label_values(&[labels[0].as_str(), labels[1].as_str()])
                .observe(committed.receive_time.as_secs_f64());
            metrics.kv_transfer_bytes.inc_by(committed.bytes);
            let mut blocks = committed.blocks;
            if let Err(e) = blocks.absorb(growth) {
                let _ = tx.send(Err(Status::internal(e.to_string())));
                return;
            }
            let mut kv = SequenceKv::new(blocks);
            kv.commit_len(committed.num_tokens as usize);
            let span = StageSpan::start("decode.generate", &parent);
            span.set("pd.request_id", id.clone());
            let admission = Admission {
                kv,
                start: Start::Prefilled { first_token: committed.first_token },
                params,
                prompt_tokens,
                kv_transfer_ms: committed.receive_time.as_secs_f64() * 1e3,
                kv_bytes: committed.bytes,
                events: tx.clone(),
                span,
                labels,
            };
            if let Err(status) = batcher.admit(admission) {
                let _ = tx.send(Err(status));
            }
        });
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }

    async fn load(&self, _request: Request<pb::LoadRequest>) -> Result<Response<pb::DecodeLoad>, Status> {
        if self.stopping.load(Ordering::Relaxed) {
            // The router's choice skips workers whose load query fails.
            return Err(Status::unavailable("the decode worker is shutting down"));
        }
        let blocks = self.engine.blocks();
        Ok(Response::new(pb::DecodeLoad {
            free_blocks: blocks.free_blocks() as u32,
            total_blocks: blocks.total_blocks() as u32,
            running_sequences: self.batcher.running() as u32,
            waiting_transfers: self.registry.len() as u32,
            kv_cache_usage: blocks.usage_ratio(),
        }))
    }
}
