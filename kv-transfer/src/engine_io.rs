//! Connects the transfer to pd-engine: the geometry of a model's KV, reading a layer's blocks
//! as frames on the sending side, and the engine's cache as the receiving side's sink. (The
//! prefill pipeline that drives the sending side lives in pd-prefill.)

use pd_engine::{Engine, WireDType};

use crate::error::TransferError;
use crate::receiver::KvSink;
use crate::wire::{frame_runs, Frame, KvGeometry};

/// The KV geometry of `engine`'s model and cache, shipped as `dtype`.
pub fn geometry_of(engine: &Engine, dtype: WireDType) -> KvGeometry {
    let c = engine.model().config();
    KvGeometry {
        model_fingerprint: engine.model().fingerprint(),
        dtype,
        num_layers: c.num_layers as u32,
        block_size: engine.cache().block_size() as u32,
        num_kv_heads: c.num_kv_heads as u32,
        head_dim: c.head_dim as u32,
    }
}

/// Frames carrying layer `layer` of the blocks `source_blocks` (in token order).
pub fn layer_frames(
    engine: &Engine,
    layer: u32,
    source_blocks: &[u32],
    geometry: &KvGeometry,
) -> Result<Vec<Frame>, TransferError> {
    frame_runs(geometry, source_blocks.len())
        .into_iter()
        .map(|(first, count)| {
            let ids = &source_blocks[first as usize..(first + count) as usize];
            let data = pd_engine::kv::export::read_blocks(engine.cache(), layer as usize, ids, geometry.dtype)
                .map_err(|e| TransferError::Sink(e.to_string()))?;
            Ok(Frame::new(layer, first, count, data))
        })
        .collect()
}

impl KvSink for Engine {
    fn write_blocks(&self, layer: u32, block_ids: &[u32], dtype: WireDType, data: &[u8]) -> Result<(), String> {
        self.cache().write_blocks(layer, block_ids, dtype, data)
    }
}
