//! The paged KV cache tensors and the per-sequence view of them.
//!
//! Per layer one K and one V tensor shaped `[num_blocks * block_size, num_kv_heads * head_dim]`
//! (the `[num_blocks, block_size, n_kv_heads, head_dim]` layout, flattened to slots), f16 or
//! f32 (`KvCacheDType`), on the model's device. Values go in and come out as f32: the stored
//! type is this module's business and the attention kernels'. The cache never owns
//! bookkeeping: which slots belong to whom is decided
//! by `BlockManager` allocations, carried by `SequenceKv`.

use candle_core::{DType, Device, Tensor};
use half::f16;
use half::slice::HalfFloatSliceExt;

use super::blocks::{BlockAllocation, BlockId, BlockManager};
use crate::config::{CacheConfig, ModelConfig};
use crate::error::{EngineError, Result};

/// K and V storage for every layer.
#[derive(Debug)]
pub struct KvCache {
    /// (K, V) per layer, each `[num_slots, kv_width]` of `dtype`: views into one K and one V
    /// tensor of every layer's rows.
    layers: Vec<(Tensor, Tensor)>,
    dtype: DType,
    block_size: usize,
    num_blocks: usize,
    kv_width: usize,
    /// Pinned host buffers for KV bytes crossing to and from a GPU.
    #[cfg(feature = "cuda")]
    staging: crate::cuda::staging::Staging,
}

impl KvCache {
    /// Allocates a zeroed cache for `model` with `config`'s geometry on `device`.
    pub fn new(model: &ModelConfig, config: &CacheConfig, device: &Device) -> Result<Self> {
        config.validate()?;
        let slots = config.num_blocks * config.block_size;
        let kv_width = model.kv_width();
        let dtype = config.dtype.dtype();
        // One K and one V allocation for all layers, each layer's tensor a view of its rows.
        // A tensor per layer and kind rounded every one of them up to whole transparent huge
        // pages (2 MiB, which mimalloc asks the kernel for): 110 MiB over a 1,010 MiB pool of
        // 56 tensors. K and V stay apart so that reading a layer's K and V at once takes two
        // locks, never one twice.
        let all = || Tensor::zeros((model.num_layers * slots, kv_width), dtype, device);
        let (k_all, v_all) = (all()?, all()?);
        let layers = (0..model.num_layers)
            .map(|l| Ok((k_all.narrow(0, l * slots, slots)?, v_all.narrow(0, l * slots, slots)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache {
            layers,
            dtype,
            block_size: config.block_size,
            num_blocks: config.num_blocks,
            kv_width,
            #[cfg(feature = "cuda")]
            staging: Default::default(),
        })
    }

    /// Writes zeros over every slot of every layer, so that each page of the pool is
    /// resident, as it is in a worker that has run a while (the kernel maps a fresh
    /// allocation's pages only when first written). `pd-engine-bench` measures memory from
    /// that steady state rather than from a pool the prompts have only partly touched.
    pub fn touch_all(&self) -> Result<()> {
        const SLOTS_PER_WRITE: usize = 4096;
        let slots = self.num_blocks * self.block_size;
        for (k, v) in &self.layers {
            for start in (0..slots).step_by(SLOTS_PER_WRITE) {
                let n = SLOTS_PER_WRITE.min(slots - start);
                let zeros = Tensor::zeros((n, self.kv_width), self.dtype, k.device())?;
                k.slice_set(&zeros, 0, start)?;
                v.slice_set(&zeros, 0, start)?;
            }
        }
        Ok(())
    }

    /// A block manager whose ids address this cache.
    pub fn block_manager(&self) -> BlockManager {
        BlockManager::new(self.num_blocks, self.block_size)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn kv_width(&self) -> usize {
        self.kv_width
    }

    /// The stored element type (f16 or f32).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// (K, V) of one layer, as stored.
    pub fn layer(&self, layer: usize) -> (&Tensor, &Tensor) {
        let (k, v) = &self.layers[layer];
        (k, v)
    }

    /// Writes rows of `k` and `v` (`[n, kv_width]`, any float type: converted to the cache's)
    /// into slots. `slot_index` is `[n, kv_width]` u32, every row filled with its destination
    /// slot (scatter along dim 0, in place).
    pub(crate) fn write(&self, layer: usize, slot_index: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
        let (k_cache, v_cache) = &self.layers[layer];
        k_cache.scatter_set(slot_index, &k.to_dtype(self.dtype)?.contiguous()?, 0)?;
        v_cache.scatter_set(slot_index, &v.to_dtype(self.dtype)?.contiguous()?, 0)?;
        Ok(())
    }

    /// Copies the K/V of slots `from` to slots `to` (same length) in every layer, as stored.
    pub(crate) fn copy_slots(&self, from: &[u32], to: &[u32]) -> Result<()> {
        if from.len() != to.len() {
            return Err(EngineError::InvalidBatch(format!("copy of {} slots into {}", from.len(), to.len())));
        }
        if from.is_empty() {
            return Ok(());
        }
        let (k0, _) = &self.layers[0];
        let device = k0.device();
        let n = from.len();
        let source = Tensor::from_vec(from.to_vec(), n, device)?;
        let index: Vec<u32> = to.iter().flat_map(|&s| std::iter::repeat_n(s, self.kv_width)).collect();
        let index = Tensor::from_vec(index, (n, self.kv_width), device)?;
        for layer in 0..self.layers.len() {
            let (k, v) = self.gather_stored(layer, &source)?;
            self.write(layer, &index, &k, &v)?;
        }
        Ok(())
    }

    /// Rows of K and V at `slots` (`[n]` u32), each `[n, kv_width]` f32 (tests compare with it).
    #[cfg(test)]
    pub(crate) fn gather(&self, layer: usize, slots: &Tensor) -> Result<(Tensor, Tensor)> {
        let (k_cache, v_cache) = &self.layers[layer];
        Ok((
            k_cache.index_select(slots, 0)?.to_dtype(DType::F32)?,
            v_cache.index_select(slots, 0)?.to_dtype(DType::F32)?,
        ))
    }

    /// Rows of K and V at `slots` (`[n]` u32), each `[n, kv_width]` as stored (for export).
    pub(crate) fn gather_stored(&self, layer: usize, slots: &Tensor) -> Result<(Tensor, Tensor)> {
        let (k_cache, v_cache) = &self.layers[layer];
        Ok((k_cache.index_select(slots, 0)?, v_cache.index_select(slots, 0)?))
    }

    /// Appends the values of each tensor (as stored, on this cache's device) to `out` as
    /// `wire` (f16 or f32) bytes, in order. On a GPU the conversion runs on the device and the
    /// copies go through pinned staging buffers, one tensor's copy overlapping the host's
    /// handling of the one before; on CPU the conversion is half's vectorised slice one.
    pub(crate) fn download(
        &self,
        tensors: impl Iterator<Item = Result<Tensor>>,
        wire: DType,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        #[cfg(feature = "cuda")]
        if self.layers.first().is_some_and(|(k, _)| k.device().is_cuda()) {
            return self.staging.download(tensors.map(|t| Ok(t?.to_dtype(wire)?)), out);
        }
        for t in tensors {
            append_as(out, &t?, wire)?;
        }
        Ok(())
    }

    /// A `shape` tensor on this cache's device holding `bytes` of `wire` values (f16 or f32),
    /// ready for `write`: on CPU already in the cache's type (half's slice conversion), on a
    /// GPU as sent (the device converts while writing).
    pub(crate) fn upload(&self, bytes: &[u8], wire: DType, shape: (usize, usize)) -> Result<Tensor> {
        let (k_cache, _) = &self.layers[0];
        #[cfg(feature = "cuda")]
        if k_cache.device().is_cuda() {
            return self.staging.upload(k_cache, bytes, wire, shape);
        }
        let n = shape.0 * shape.1;
        if bytes.len() != n * wire.size_in_bytes() {
            return Err(EngineError::KvImport(format!("{} bytes for {n} {wire:?} values", bytes.len())));
        }
        let halves = || bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]])).collect::<Vec<_>>();
        let floats = || bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect::<Vec<_>>();
        let device = k_cache.device();
        Ok(match (wire, self.dtype) {
            (DType::F16, DType::F16) => Tensor::from_vec(halves(), shape, device)?,
            (DType::F32, DType::F32) => Tensor::from_vec(floats(), shape, device)?,
            (DType::F16, DType::F32) => {
                let mut wide = vec![0f32; n];
                halves().convert_to_f32_slice(&mut wide);
                Tensor::from_vec(wide, shape, device)?
            }
            (DType::F32, DType::F16) => {
                let mut narrow = vec![f16::ZERO; n];
                narrow.convert_from_f32_slice(&floats());
                Tensor::from_vec(narrow, shape, device)?
            }
            (from, to) => return Err(EngineError::KvImport(format!("no KV values from {from:?} into a {to:?} cache"))),
        })
    }

    /// Checks that `blocks` all address this cache.
    pub(crate) fn check_blocks(&self, blocks: &[BlockId]) -> Result<()> {
        match blocks.iter().find(|&&b| b as usize >= self.num_blocks) {
            Some(b) => {
                Err(EngineError::InvalidBatch(format!("block {b} is outside the cache of {} blocks", self.num_blocks)))
            }
            None => Ok(()),
        }
    }
}

/// Appends a CPU tensor's values to `out` as `wire` bytes, converting in small chunks: a
/// whole-tensor temporary is a fresh allocation per layer, and its page faults made an f32
/// export 8x slower than the copy itself.
fn append_as(out: &mut Vec<u8>, t: &Tensor, wire: DType) -> Result<()> {
    const CHUNK: usize = 2048;
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return Err(EngineError::InvalidBatch("host KV bytes from a tensor that is not on the CPU".into()));
    };
    let range = layout.start_offset()..layout.start_offset() + t.elem_count();
    match (t.dtype(), wire) {
        (DType::F16, DType::F16) => out.extend_from_slice(bytemuck::cast_slice(&cpu.as_slice::<f16>()?[range])),
        (DType::F32, DType::F32) => out.extend_from_slice(bytemuck::cast_slice(&cpu.as_slice::<f32>()?[range])),
        (DType::F16, DType::F32) => {
            let mut buf = [0f32; CHUNK];
            for c in cpu.as_slice::<f16>()?[range].chunks(CHUNK) {
                c.convert_to_f32_slice(&mut buf[..c.len()]);
                out.extend_from_slice(bytemuck::cast_slice(&buf[..c.len()]));
            }
        }
        (DType::F32, DType::F16) => {
            let mut buf = [f16::ZERO; CHUNK];
            for c in cpu.as_slice::<f32>()?[range].chunks(CHUNK) {
                buf[..c.len()].convert_from_f32_slice(c);
                out.extend_from_slice(bytemuck::cast_slice(&buf[..c.len()]));
            }
        }
        (from, to) => return Err(EngineError::InvalidBatch(format!("no KV bytes from {from:?} to {to:?}"))),
    }
    Ok(())
}

/// One sequence's KV: the blocks it owns and how many token positions hold valid K/V.
#[derive(Debug)]
pub struct SequenceKv {
    blocks: BlockAllocation,
    /// Positions 0..len are computed (or imported) in every layer.
    len: usize,
}

impl SequenceKv {
    /// A sequence with no tokens yet over `blocks` (which may be pre-reserved).
    pub fn new(blocks: BlockAllocation) -> Self {
        SequenceKv { blocks, len: 0 }
    }

    /// Tokens whose K/V are in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn blocks(&self) -> &BlockAllocation {
        &self.blocks
    }

    pub(crate) fn blocks_mut(&mut self) -> &mut BlockAllocation {
        &mut self.blocks
    }

    /// Marks positions 0..len as valid. Call only once they were written in every layer
    /// (the model does this after a forward; KV import callers after the last layer).
    pub fn commit_len(&mut self, len: usize) {
        self.len = len;
    }

    /// Offers the full blocks of this sequence whose K/V hold `tokens` (the sequence's tokens
    /// from position 0; only the first `len()` count) to the prefix cache.
    pub fn cache_prefix(&mut self, tokens: &[u32]) {
        let valid = tokens.len().min(self.len);
        self.blocks.register(&tokens[..valid]);
    }

    /// A second sequence with the same first `valid` positions (at most `len()`) that writes
    /// its own from there on: the full blocks before `valid` are shared with this one (held,
    /// never written again by either), the K/V of a partly filled block at `valid` are copied
    /// into the first block of `growth`, and `growth` (this fork's own blocks, enough for its
    /// positions from the shared blocks on) becomes its tail.
    pub fn fork(&self, cache: &KvCache, valid: usize, growth: BlockAllocation) -> Result<SequenceKv> {
        let valid = valid.min(self.len);
        let bs = self.blocks.block_size();
        let (full, partial) = (valid / bs, valid % bs);
        let mut blocks = self.blocks.share_prefix(full);
        if partial > 0 {
            let Some(&into) = growth.ids().first() else {
                return Err(EngineError::InvalidBatch("a fork with a partial block needs blocks of its own".into()));
            };
            let from = self.slots(full * bs, valid)?;
            let to: Vec<u32> = (0..partial).map(|i| (into as usize * bs + i) as u32).collect();
            cache.copy_slots(&from, &to)?;
        }
        blocks.absorb(growth)?;
        Ok(SequenceKv { blocks, len: valid })
    }

    /// Cache slots of positions `start..end`; the blocks must cover them.
    pub(crate) fn slots(&self, start: usize, end: usize) -> Result<Vec<u32>> {
        (start..end)
            .map(|pos| {
                self.blocks.slot(pos).map(|s| s as u32).ok_or_else(|| {
                    EngineError::InvalidBatch(format!(
                        "position {pos} is beyond the sequence's {} reserved tokens",
                        self.blocks.capacity_tokens()
                    ))
                })
            })
            .collect()
    }
}
