//! The `pd.v1.DecodeWorker` service: decode-first reservation (blocks for the prompt and its
//! whole output under a lease), the KV target, then the token stream from the batch loop.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use pd_engine::{Engine, SamplingParams, SequenceKv, WireDType};
use pd_kv_transfer::engine_io::geometry_of;
use pd_kv_transfer::{KvRegistry, Reservation, TransferError};
use pd_proto::v1 as pb;
use pb::decode_worker_server::DecodeWorker;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status};

use crate::batcher::{Admission, Batcher, Event};

/// Shared state of the decode worker's services.
#[derive(Debug, Clone)]
pub struct DecodeService {
    pub(crate) engine: Arc<Engine>,
    pub(crate) registry: Arc<KvRegistry>,
    pub(crate) batcher: Batcher,
    pub(crate) kv_endpoint: String,
    pub(crate) kv_dtype: WireDType,
    pub(crate) lease: Duration,
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
        let req = request.into_inner();
        if req.request_id.is_empty() {
            return Err(Status::invalid_argument("request_id is required"));
        }
        if req.prompt_tokens.is_empty() {
            return Err(Status::invalid_argument("prompt_tokens is empty"));
        }
        let params = sampling_from_pb(req.sampling)?;
        let max = self.engine.model().config().max_position;
        let total = req.prompt_tokens.len() + params.max_tokens;
        if total > max {
            return Err(Status::invalid_argument(format!(
                "prompt_tokens ({}) + max_tokens ({}) exceed the context length of {max}",
                req.prompt_tokens.len(),
                params.max_tokens
            )));
        }
        let blocks = self.engine.blocks();
        let prompt_blocks = blocks.blocks_for(req.prompt_tokens.len());
        // The whole output's blocks are taken now, so decoding never runs out of KV.
        let prompt_alloc = blocks.allocate(prompt_blocks).map_err(|e| Status::resource_exhausted(e.to_string()))?;
        let growth = blocks
            .allocate(blocks.blocks_for(total) - prompt_blocks)
            .map_err(|e| Status::resource_exhausted(e.to_string()))?;
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
            })?;
        let (tx, rx) = mpsc::unbounded_channel::<Event>();
        let target = self.target(&req.request_id, block_ids, lease);
        let _ = tx.send(crate::batcher::event(pb::decode_event::Event::Target(target)));
        let (registry, batcher, id) = (self.registry.clone(), self.batcher.clone(), req.request_id.clone());
        let prompt_tokens = req.prompt_tokens.len();
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
                    let _ = tx.send(Err(transfer_status(e)));
                    return;
                }
                Err(_) => {
                    let _ = tx.send(Err(Status::internal("the KV reservation vanished")));
                    return;
                }
            };
            let mut blocks = committed.blocks;
            if let Err(e) = blocks.absorb(growth) {
                let _ = tx.send(Err(Status::internal(e.to_string())));
                return;
            }
            let mut kv = SequenceKv::new(blocks);
            kv.commit_len(committed.num_tokens as usize);
            let admission = Admission {
                kv,
                first_token: committed.first_token,
                params,
                prompt_tokens,
                kv_transfer_ms: committed.receive_time.as_secs_f64() * 1e3,
                kv_bytes: committed.bytes,
                events: tx.clone(),
            };
            if let Err(status) = batcher.admit(admission) {
                let _ = tx.send(Err(status));
            }
        });
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }

    async fn load(&self, _request: Request<pb::LoadRequest>) -> Result<Response<pb::DecodeLoad>, Status> {
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
