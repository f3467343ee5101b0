//! Helpers for transfer tests: geometry, reservations over a real block pool, payloads.
#![allow(dead_code)] // each test binary uses its own subset

use std::sync::Arc;
use std::time::Duration;

use pd_engine::{BlockManager, WireDType};
use pd_kv_transfer::{Frame, KvGeometry, KvRegistry, MemorySink, Outcome, Reservation, TransferHeader};
use tokio::sync::oneshot;

pub fn geometry(dtype: WireDType, layers: u32) -> KvGeometry {
    KvGeometry { model_fingerprint: 0x5eed, dtype, num_layers: layers, block_size: 16, num_kv_heads: 2, head_dim: 8 }
}

/// A receiving side: block pool, memory sink and registry.
pub struct Receiver {
    pub blocks: BlockManager,
    pub sink: Arc<MemorySink>,
    pub registry: Arc<KvRegistry>,
    pub geometry: KvGeometry,
}

impl Receiver {
    pub fn new(geometry: KvGeometry, num_blocks: usize) -> Self {
        let sink = Arc::new(MemorySink::new(geometry, num_blocks));
        Receiver {
            blocks: BlockManager::new(num_blocks, geometry.block_size as usize),
            registry: KvRegistry::new(sink.clone()),
            sink,
            geometry,
        }
    }

    /// Reserves blocks for `tokens` tokens; returns the header a sender would send.
    pub fn reserve(&self, id: &str, tokens: u32, lease: Duration) -> (TransferHeader, oneshot::Receiver<Outcome>) {
        let n = (tokens as usize).div_ceil(self.geometry.block_size as usize);
        let blocks = self.blocks.allocate(n).expect("blocks for the reservation");
        let header = TransferHeader {
            transfer_id: id.to_string(),
            geometry: self.geometry,
            block_ids: blocks.ids().to_vec(),
            num_tokens: tokens,
            trace_context: Default::default(),
        };
        let outcome = self
            .registry
            .reserve(Reservation {
                transfer_id: id.to_string(),
                geometry: self.geometry,
                blocks,
                num_tokens: tokens,
                lease,
            })
            .expect("reserve");
        (header, outcome)
    }

    pub fn all_free(&self) -> bool {
        self.blocks.free_blocks() == self.blocks.total_blocks()
    }
}

/// Deterministic pseudo-random bytes.
pub fn payload(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// All frames of a transfer (every layer, runs of at most `per_frame` blocks).
pub fn frames(header: &TransferHeader, seed: u64, per_frame: u32) -> Vec<Frame> {
    let g = header.geometry;
    let n = header.block_ids.len() as u32;
    let mut out = Vec::new();
    for layer in 0..g.num_layers {
        let mut first = 0;
        while first < n {
            let count = per_frame.min(n - first);
            let data = payload(seed ^ ((layer as u64) << 32) ^ first as u64, g.frame_bytes(count as usize));
            out.push(Frame::new(layer, first, count, data));
            first += count;
        }
    }
    out
}

/// Checks that the sink holds exactly what `frames` carried, at the header's block ids.
pub fn assert_landed(receiver: &Receiver, header: &TransferHeader, frames: &[Frame]) {
    for f in frames {
        let per_block =
            pd_kv_transfer::receiver::split_frame_payload(&header.geometry, f.block_count as usize, &f.data);
        for (i, expected) in per_block.iter().enumerate() {
            let block = header.block_ids[(f.first_block as usize) + i];
            assert!(
                receiver.sink.block(f.layer, block) == *expected,
                "layer {} block {block} of {} holds other bytes",
                f.layer,
                header.transfer_id
            );
        }
    }
}

/// Two senders on their own connections: the first opens and sends one frame, then the second
/// (a retry the router started before this side saw the first one's stream end) opens the same
/// transfer, sends everything and commits. The first one's commit is refused as superseded, and
/// the blocks hold the second one's data.
pub async fn a_newer_sender_takes_over<S: pd_kv_transfer::KvSender>(r: &Receiver, first: &S, second: &S) {
    use pd_kv_transfer::{kv_commit, KvTransfer};
    let (header, outcome) = r.reserve("retried", 40, Duration::from_secs(30));
    let (stale, all) = (frames(&header, 31, 3), frames(&header, 32, 3));
    let mut old = first.start(header.clone()).await.expect("the first sender is accepted");
    old.send(stale[0].clone()).await.expect("the first sender's first frame");
    let mut retry = second.start(header.clone()).await.expect("the retry takes the transfer over");
    for f in &all {
        retry.send(f.clone()).await.expect("the retry's frames");
    }
    // The old stream's next frame is refused; its commit reports that refusal.
    let _ = old.send(stale[1].clone()).await;
    let refused = old.commit(kv_commit(1, 40)).await.expect_err("the superseded sender cannot commit");
    assert!(refused.to_string().contains("superseded") || refused.to_string().contains("taken over"), "{refused}");
    retry.commit(kv_commit(2, 40)).await.expect("the retry commits");
    let committed = outcome.await.expect("outcome").expect("committed");
    assert_eq!(committed.first_token, 2);
    assert_landed(r, &header, &all);
    drop(committed);
    assert!(r.all_free());
}
