//! The KV hand-off of simulated workers over UCX (`pd-sim-worker --kv-transport ucx`).
//!
//! Over gRPC (the default) a simulated prefill worker sends only the protocol's control
//! messages (header, then commit after the cost model's hand-off time): a fleet of hundreds of
//! simulated workers on one machine could not move the bytes of their modelled KV. Over UCX the
//! receiving side is the real one, the `KvRegistry` behind the real UCX receiver, and it takes a
//! commit only after every (layer, block) frame arrived; so there the bytes move for real:
//! - the decode worker reserves its prompt blocks in the registry and advertises
//!   `ucx://host:port` with a geometry whose bytes per token are the cost model's
//!   (`geometry`), and the received data is checked and dropped (`DropSink`);
//! - the prefill worker sends every frame of the prompt (zeros, with their checksums) through
//!   the real prefill worker's sender cache (`pd_prefill::senders`), and commits no earlier
//!   than the cost model's hand-off time: the hand-off lasts the longer of the modelled time
//!   and the real transfer.
//!
//! A UCX failure is a typed error (the receiver's `TransferError`), never a fallback to gRPC.
//! Each decode worker runs its own UCX receiver thread: meant for fleets of tens of workers.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pd_engine::{BlockManager, WireDType};
use pd_kv_transfer::convert::Target;
use pd_kv_transfer::transport::{Transport, UcxServing};
use pd_kv_transfer::{
    frame_runs, Frame, KvGeometry, KvRegistry, KvSender, KvSink, KvTransfer, Outcome, Reservation, TransferError,
    MAX_FRAME_BYTES,
};
use pd_prefill::senders::Senders;
use pd_proto::v1 as pb;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::Status;

use crate::cost::WorkerCost;

/// The KV geometry a simulated decode worker advertises: f16 K and V whose bytes per token
/// are the cost model's `kv.bytes_per_token`, in the fewest layers (one head each) whose
/// block fits a frame. The bytes moved are the modelled model's; the frame count is close to
/// it (frames are at most 1 MiB either way).
pub fn geometry(cost: &WorkerCost) -> Result<KvGeometry, String> {
    let bytes = cost.kv.bytes_per_token;
    if bytes == 0 || !bytes.is_multiple_of(4) {
        return Err(format!(
            "the cost model's kv.bytes_per_token ({bytes}) must be a positive multiple of 4 (f16 K and V) to move KV over UCX"
        ));
    }
    let values = bytes / 4; // f16 values of K (and of V) per token, over all layers
    let block = u64::from(cost.worker.block_size);
    let layers = (1..=values)
        .filter(|&l| values.is_multiple_of(l) && values / l <= u64::from(u32::MAX))
        .find(|&l| 2 * block * (values / l) * 2 <= MAX_FRAME_BYTES as u64)
        .ok_or_else(|| format!("a {block}-token block of {bytes} bytes per token cannot fit a KV frame"))?;
    Ok(KvGeometry {
        model_fingerprint: 0,
        dtype: WireDType::F16,
        num_layers: layers as u32,
        block_size: cost.worker.block_size,
        num_kv_heads: 1,
        head_dim: (values / layers) as u32,
    })
}

/// Where a simulated decode worker's received KV goes: every frame's size is checked against
/// the geometry, then the data is dropped (there is no model to read it).
struct DropSink {
    geometry: KvGeometry,
}

impl KvSink for DropSink {
    fn write_blocks(&self, _layer: u32, block_ids: &[u32], dtype: WireDType, data: &[u8]) -> Result<(), String> {
        let expected = self.geometry.frame_bytes(block_ids.len());
        if dtype != self.geometry.dtype || data.len() != expected {
            return Err(format!(
                "{} bytes of {dtype:?} for {} blocks, expected {expected}",
                data.len(),
                block_ids.len()
            ));
        }
        Ok(())
    }
}

/// A simulated decode worker's UCX receiver: the real registry and UCX listener.
pub struct UcxInbox {
    registry: Arc<KvRegistry>,
    /// Block ids for reservations (the worker's own block count stays its accounting).
    blocks: BlockManager,
    geometry: KvGeometry,
    endpoint: String,
    serving: Mutex<Option<UcxServing>>,
    reaper: JoinHandle<()>,
}

impl std::fmt::Debug for UcxInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UcxInbox({})", self.endpoint)
    }
}

impl UcxInbox {
    /// A UCX receiver on `host` (a port of its own), with `UCX_TLS` from the environment.
    pub fn start(cost: &WorkerCost, host: &str) -> anyhow::Result<Self> {
        let geometry = geometry(cost).map_err(anyhow::Error::msg)?;
        let ip: std::net::IpAddr = host.parse().map_err(|e| anyhow::anyhow!("--host {host:?} for UCX: {e}"))?;
        let registry = KvRegistry::new(Arc::new(DropSink { geometry }));
        let serving = UcxServing::start(registry.clone(), std::net::SocketAddr::new(ip, 0))
            .map_err(|e| anyhow::anyhow!("--kv-transport ucx: {e}"))?;
        let endpoint = Transport::Ucx.endpoint(&serving.local_addr().to_string());
        let reaper = pd_kv_transfer::grpc::spawn_lease_reaper(registry.clone(), Duration::from_millis(100));
        Ok(UcxInbox {
            registry,
            blocks: BlockManager::new(cost.worker.kv_blocks as usize, cost.worker.block_size as usize),
            geometry,
            endpoint,
            serving: Mutex::new(Some(serving)),
            reaper,
        })
    }

    /// The KV target of a reservation of `prompt` tokens under `lease`, and its outcome.
    pub fn reserve(
        &self,
        id: &str,
        prompt: usize,
        lease: Duration,
    ) -> Result<(pb::KvTarget, oneshot::Receiver<Outcome>), Status> {
        let count = prompt.div_ceil(self.geometry.block_size as usize);
        let blocks = self.blocks.allocate(count).map_err(|e| Status::resource_exhausted(e.to_string()))?;
        let block_ids = blocks.ids().to_vec();
        let r =
            Reservation { transfer_id: id.into(), geometry: self.geometry, blocks, num_tokens: prompt as u32, lease };
        let outcome = self.registry.reserve(r).map_err(|e| e.to_status())?;
        let target = Target {
            transfer_id: id.into(),
            kv_endpoint: self.endpoint.clone(),
            geometry: self.geometry,
            block_ids,
            lease_deadline: std::time::SystemTime::now() + lease,
            cached_tokens: 0,
        };
        Ok((target.to_pb(), outcome))
    }

    /// Ends a reservation the worker gave up on (its blocks return to the pool).
    pub fn abort(&self, id: &str, reason: &str) {
        let _ = self.registry.abort(id, reason);
    }

    /// The worker crashed: reservations fail and the UCX listener closes.
    pub fn lose(&self) {
        self.registry.abort_all("the simulated decode worker was lost");
        self.reaper.abort();
        if let Some(serving) = self.serving.lock().unwrap_or_else(|p| p.into_inner()).take() {
            tokio::spawn(serving.shutdown());
        }
    }

    /// Blocks held by reservations (0 once every transfer ended).
    pub fn held_blocks(&self) -> usize {
        self.blocks.held_blocks()
    }
}

/// KV hand-offs of one pd-sim-worker process, by transport.
#[derive(Debug, Default)]
pub struct Handoffs {
    grpc: AtomicU64,
    ucx: AtomicU64,
    ucx_bytes: AtomicU64,
    ucx_frames: AtomicU64,
    failed: AtomicU64,
}

impl Handoffs {
    pub(crate) fn grpc_committed(&self) {
        self.grpc.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn failed(&self) {
        self.failed.fetch_add(1, Ordering::Relaxed);
    }

    /// One line for the process's log: committed hand-offs by transport, and failures.
    pub fn summary(&self) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        format!(
            "KV hand-offs committed: {} over grpc (control messages only), {} over ucx ({} bytes in {} frames); {} failed",
            get(&self.grpc),
            get(&self.ucx),
            get(&self.ucx_bytes),
            get(&self.ucx_frames),
            get(&self.failed)
        )
    }
}

/// Sends a prompt's KV to a UCX target: every frame, then the commit no earlier than
/// `modelled` after the start. Returns the bytes the receiver confirmed.
pub(crate) async fn send_frames(
    senders: &Senders,
    handoffs: &Handoffs,
    target: &pb::KvTarget,
    commit: pb::KvCommit,
    modelled: Duration,
) -> Result<u64, TransferError> {
    let started = Instant::now();
    let target = Target::from_pb(target)?;
    let g = target.geometry;
    let link = senders.to(&target.kv_endpoint).await?;
    let tokens = commit.prompt_tokens - target.cached_tokens;
    let mut transfer = link.start(target.header(tokens, Default::default())).await?;
    let runs = frame_runs(&g, target.block_ids.len());
    for layer in 0..g.num_layers {
        for &(first, count) in &runs {
            let frame = Frame::new(layer, first, count, vec![0; g.frame_bytes(count as usize)]);
            if let Err(e) = transfer.send(frame).await {
                transfer.abort(&e.to_string()).await;
                return Err(e);
            }
        }
    }
    tokio::time::sleep_until((started + modelled).into()).await;
    let receipt = transfer.commit(commit).await?;
    handoffs.ucx.fetch_add(1, Ordering::Relaxed);
    handoffs.ucx_bytes.fetch_add(receipt.bytes, Ordering::Relaxed);
    handoffs.ucx_frames.fetch_add(u64::from(receipt.frames), Ordering::Relaxed);
    Ok(receipt.bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(bytes_per_token: u64, block_size: u32) -> WorkerCost {
        let mut c: WorkerCost = serde_json::from_value(serde_json::json!({
            "source": "test",
            "prefill": {"fixed_ms": 1.0, "per_token_ms": 0.0, "per_pair_us": 0.0},
            "decode": {"fixed_ms": 1.0, "per_row_ms": 0.0, "per_context_us": 0.0},
            "kv": {"bytes_per_token": 0, "commit_fixed_ms": 0.0, "commit_ms_per_mb": 0.0},
            "worker": {"block_size": 16, "kv_blocks": 64, "max_batch": 8, "max_position": 1024}
        }))
        .expect("cost");
        c.kv.bytes_per_token = bytes_per_token;
        c.worker.block_size = block_size;
        c
    }

    #[test]
    fn the_geometry_moves_the_cost_models_bytes_per_token_in_frames_that_fit() {
        // SmolLM2 (30 x 3 x 64 x 2 x 2), Llama-3.1-8B (32 x 8 x 128 x 2 x 2), and odd sizes.
        for (bytes, block) in [(23_040, 16), (131_072, 16), (131_072, 256), (4, 1), (1_000, 16)] {
            let g = geometry(&cost(bytes, block)).expect("geometry");
            let per_token = u64::from(g.num_layers) * 2 * g.block_bytes() as u64 / u64::from(block);
            assert_eq!(per_token, bytes, "{g:?}");
            assert!(g.frame_bytes(1) <= MAX_FRAME_BYTES, "{g:?}");
        }
        assert_eq!(geometry(&cost(23_040, 16)).expect("smollm2").num_layers, 1);
        assert_eq!(geometry(&cost(131_072, 16)).expect("8b").num_layers, 2);
    }

    #[test]
    fn a_geometry_that_cannot_be_f16_k_and_v_is_refused_by_name() {
        for bytes in [0, 6, 1_001] {
            let e = geometry(&cost(bytes, 16)).expect_err("refused");
            assert!(e.contains("kv.bytes_per_token") && e.contains(&bytes.to_string()), "{e}");
        }
    }

    #[test]
    fn the_drop_sink_checks_each_frames_size() {
        let g = geometry(&cost(1_000, 16)).expect("geometry");
        let sink = DropSink { geometry: g };
        assert!(sink.write_blocks(0, &[0, 1], WireDType::F16, &vec![0; g.frame_bytes(2)]).is_ok());
        let e = sink.write_blocks(0, &[0, 1], WireDType::F16, &vec![0; g.frame_bytes(1)]).expect_err("short");
        assert!(e.contains("expected"), "{e}");
        assert!(sink.write_blocks(0, &[0], WireDType::F32, &vec![0; g.frame_bytes(1)]).is_err());
    }
}
