//! A sequence's K/V as bytes: the unit the KV-transfer layer ships between processes.
//!
//! Layout (little endian): a 40-byte header, then for each layer of the range K then V, each
//! `[num_tokens, num_kv_heads, head_dim]` in the wire dtype (f16 by default, f32 optional).
//! The header names the model fingerprint and the geometry, so an import into another model,
//! another geometry, or with a wrong byte count is refused before anything is written.
//! Token-major layout makes the bytes independent of block size and block ids.

use std::ops::Range;

use candle_core::{DType, Tensor};

use super::blocks::BlockManager;
use super::cache::{KvCache, SequenceKv};
use crate::error::{EngineError, Result};
use crate::model::Model;

const MAGIC: [u8; 4] = *b"PDKV";
const VERSION: u16 = 1;
/// Size of the encoded header in bytes.
pub const HEADER_LEN: usize = 40;

/// Element type of K/V values on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireDType {
    F16,
    F32,
}

impl WireDType {
    pub fn size(self) -> usize {
        match self {
            WireDType::F16 => 2,
            WireDType::F32 => 4,
        }
    }

    /// The tensor element type of these values.
    pub(crate) fn dtype(self) -> DType {
        match self {
            WireDType::F16 => DType::F16,
            WireDType::F32 => DType::F32,
        }
    }

    fn code(self) -> u8 {
        match self {
            WireDType::F16 => 1,
            WireDType::F32 => 2,
        }
    }

    fn from_code(code: u8) -> Result<Self> {
        match code {
            1 => Ok(WireDType::F16),
            2 => Ok(WireDType::F32),
            other => Err(EngineError::KvImport(format!("unknown dtype code {other}"))),
        }
    }
}

/// What a KV byte blob holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvHeader {
    pub fingerprint: u64,
    pub dtype: WireDType,
    /// Layers of the model that produced the KV (all of them, not just this range).
    pub model_layers: u32,
    pub layer_start: u32,
    pub layer_count: u32,
    pub num_tokens: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
}

impl KvHeader {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6] = self.dtype.code();
        out[8..16].copy_from_slice(&self.fingerprint.to_le_bytes());
        let fields =
            [self.model_layers, self.layer_start, self.layer_count, self.num_tokens, self.num_kv_heads, self.head_dim];
        for (i, f) in fields.iter().enumerate() {
            out[16 + 4 * i..20 + 4 * i].copy_from_slice(&f.to_le_bytes());
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self> {
        if bytes.len() < HEADER_LEN {
            return Err(EngineError::KvImport(format!(
                "{} bytes is shorter than the {HEADER_LEN}-byte header",
                bytes.len()
            )));
        }
        if bytes[0..4] != MAGIC {
            return Err(EngineError::KvImport("bad magic: not a pd KV blob".into()));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != VERSION {
            return Err(EngineError::KvImport(format!("format version {version}, this build reads {VERSION}")));
        }
        let u32_at = |i: usize| {
            let at = 16 + 4 * i;
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let mut fp = [0u8; 8];
        fp.copy_from_slice(&bytes[8..16]);
        Ok(KvHeader {
            dtype: WireDType::from_code(bytes[6])?,
            fingerprint: u64::from_le_bytes(fp),
            model_layers: u32_at(0),
            layer_start: u32_at(1),
            layer_count: u32_at(2),
            num_tokens: u32_at(3),
            num_kv_heads: u32_at(4),
            head_dim: u32_at(5),
        })
    }

    /// Bytes of K (or V) of one layer.
    pub fn tensor_bytes(&self) -> usize {
        self.num_tokens as usize * self.num_kv_heads as usize * self.head_dim as usize * self.dtype.size()
    }

    /// Bytes after the header.
    pub fn payload_len(&self) -> usize {
        2 * self.layer_count as usize * self.tensor_bytes()
    }

    /// Refuses KV that `model` cannot use, naming the first mismatch.
    pub fn check_compatible(&self, model: &Model) -> Result<()> {
        let c = model.config();
        let mismatch = |what: &str, got: u64, want: u64| {
            Err(EngineError::KvImport(format!("{what} is {got}, this model has {want}")))
        };
        if self.fingerprint != model.fingerprint() {
            return Err(EngineError::KvImport(format!(
                "model fingerprint {:016x} differs from this model's {:016x}",
                self.fingerprint,
                model.fingerprint()
            )));
        }
        if self.model_layers as usize != c.num_layers {
            return mismatch("layer count", self.model_layers.into(), c.num_layers as u64);
        }
        if self.num_kv_heads as usize != c.num_kv_heads {
            return mismatch("KV head count", self.num_kv_heads.into(), c.num_kv_heads as u64);
        }
        if self.head_dim as usize != c.head_dim {
            return mismatch("head dim", self.head_dim.into(), c.head_dim as u64);
        }
        let end = self.layer_start as u64 + self.layer_count as u64;
        if self.layer_count == 0 || end > c.num_layers as u64 {
            return Err(EngineError::KvImport(format!(
                "layer range {}..{end} is empty or beyond the model's {} layers",
                self.layer_start, c.num_layers
            )));
        }
        if self.num_tokens as usize > c.max_position {
            return mismatch("token count", self.num_tokens.into(), c.max_position as u64);
        }
        Ok(())
    }
}

/// Encodes `kv`'s K/V for `layers` (all of the sequence's tokens).
pub fn export_kv(
    model: &Model,
    cache: &KvCache,
    kv: &SequenceKv,
    layers: Range<usize>,
    dtype: WireDType,
) -> Result<Vec<u8>> {
    let c = model.config();
    if layers.is_empty() || layers.end > c.num_layers {
        return Err(EngineError::InvalidBatch(format!(
            "layer range {layers:?} is empty or beyond the model's {} layers",
            c.num_layers
        )));
    }
    let header = KvHeader {
        fingerprint: model.fingerprint(),
        dtype,
        model_layers: c.num_layers as u32,
        layer_start: layers.start as u32,
        layer_count: layers.len() as u32,
        num_tokens: kv.len() as u32,
        num_kv_heads: c.num_kv_heads as u32,
        head_dim: c.head_dim as u32,
    };
    let mut out = Vec::with_capacity(HEADER_LEN + header.payload_len());
    out.extend_from_slice(&header.encode());
    if kv.is_empty() {
        return Ok(out);
    }
    let slots = Tensor::from_vec(kv.slots(0, kv.len())?, kv.len(), model.device())?;
    cache.download(layer_tensors(cache, layers, &slots), dtype.dtype(), &mut out)?;
    Ok(out)
}

/// K then V of each layer at `slots`, as stored, produced one layer at a time as the download
/// asks for them (so a GPU gathers layer i+1 while layer i is being copied out).
fn layer_tensors<'a>(
    cache: &'a KvCache,
    layers: Range<usize>,
    slots: &'a Tensor,
) -> impl Iterator<Item = Result<Tensor>> + 'a {
    layers.flat_map(move |layer| match cache.gather_stored(layer, slots) {
        Ok((k, v)) => vec![Ok(k), Ok(v)],
        Err(e) => vec![Err(e)],
    })
}

/// Writes the layers in `bytes` into `kv`'s blocks, which must already cover the tokens.
/// Does not change `kv.len()`: call `SequenceKv::commit_len` once every layer is in.
pub fn import_kv_layers(model: &Model, cache: &KvCache, kv: &mut SequenceKv, bytes: &[u8]) -> Result<KvHeader> {
    let header = KvHeader::decode(bytes)?;
    header.check_compatible(model)?;
    let payload = &bytes[HEADER_LEN..];
    if payload.len() != header.payload_len() {
        return Err(EngineError::KvImport(format!(
            "payload is {} bytes, the header describes {}",
            payload.len(),
            header.payload_len()
        )));
    }
    let tokens = header.num_tokens as usize;
    if kv.blocks().capacity_tokens() < tokens {
        return Err(EngineError::KvImport(format!(
            "{tokens} tokens do not fit the {} reserved",
            kv.blocks().capacity_tokens()
        )));
    }
    if tokens == 0 {
        return Ok(header);
    }
    let width = model.config().kv_width();
    let index: Vec<u32> = kv.slots(0, tokens)?.into_iter().flat_map(|s| std::iter::repeat_n(s, width)).collect();
    let index = Tensor::from_vec(index, (tokens, width), model.device())?;
    let per = header.tensor_bytes();
    for (i, layer) in (header.layer_start as usize..).take(header.layer_count as usize).enumerate() {
        let at = 2 * i * per;
        let k = cache.upload(&payload[at..at + per], header.dtype.dtype(), (tokens, width))?;
        let v = cache.upload(&payload[at + per..at + 2 * per], header.dtype.dtype(), (tokens, width))?;
        cache.write(layer, &index, &k, &v)?;
    }
    Ok(header)
}

/// Imports a whole sequence (every layer) into newly allocated blocks.
pub fn import_kv(model: &Model, cache: &KvCache, blocks: &BlockManager, bytes: &[u8]) -> Result<SequenceKv> {
    let header = KvHeader::decode(bytes)?;
    header.check_compatible(model)?;
    if header.layer_start != 0 || header.layer_count as usize != model.config().num_layers {
        return Err(EngineError::KvImport(format!(
            "holds layers {}..{}, a whole-sequence import needs all {}",
            header.layer_start,
            header.layer_start + header.layer_count,
            model.config().num_layers
        )));
    }
    let tokens = header.num_tokens as usize;
    let mut kv = SequenceKv::new(blocks.allocate(blocks.blocks_for(tokens))?);
    import_kv_layers(model, cache, &mut kv, bytes)?;
    kv.commit_len(tokens);
    Ok(kv)
}

/// K then V of `blocks` (whole blocks, in order) of one layer, in `dtype`: the payload of a
/// KV-transfer frame, `2 * blocks * block_size * kv_width` values.
pub fn read_blocks(cache: &KvCache, layer: usize, blocks: &[u32], dtype: WireDType) -> Result<Vec<u8>> {
    check_layer_blocks(cache, layer, blocks)?;
    let slots = block_slots(cache, blocks);
    let n = slots.len();
    let (k_cache, _) = cache.layer(layer);
    let slots = Tensor::from_vec(slots, n, k_cache.device())?;
    let mut out = Vec::with_capacity(2 * n * cache.kv_width() * dtype.size());
    cache.download(layer_tensors(cache, layer..layer + 1, &slots), dtype.dtype(), &mut out)?;
    Ok(out)
}

/// Writes a frame payload made by `read_blocks` into `blocks` of one layer.
pub fn write_blocks(cache: &KvCache, layer: usize, blocks: &[u32], dtype: WireDType, data: &[u8]) -> Result<()> {
    check_layer_blocks(cache, layer, blocks)?;
    let slots = block_slots(cache, blocks);
    let n = slots.len();
    let width = cache.kv_width();
    let per = n * width * dtype.size();
    if data.len() != 2 * per {
        return Err(EngineError::KvImport(format!(
            "{} bytes for {} blocks of layer {layer}, expected {}",
            data.len(),
            blocks.len(),
            2 * per
        )));
    }
    let (k_cache, _) = cache.layer(layer);
    let device = k_cache.device();
    let index: Vec<u32> = slots.iter().flat_map(|&s| std::iter::repeat_n(s, width)).collect();
    let index = Tensor::from_vec(index, (n, width), device)?;
    let k = cache.upload(&data[..per], dtype.dtype(), (n, width))?;
    let v = cache.upload(&data[per..], dtype.dtype(), (n, width))?;
    cache.write(layer, &index, &k, &v)
}

fn check_layer_blocks(cache: &KvCache, layer: usize, blocks: &[u32]) -> Result<()> {
    if layer >= cache.num_layers() {
        return Err(EngineError::KvImport(format!(
            "layer {layer} is beyond the cache's {} layers",
            cache.num_layers()
        )));
    }
    if blocks.is_empty() {
        return Err(EngineError::KvImport("no blocks".into()));
    }
    cache.check_blocks(blocks).map_err(|e| EngineError::KvImport(e.to_string()))
}

fn block_slots(cache: &KvCache, blocks: &[u32]) -> Vec<u32> {
    let bs = cache.block_size() as u32;
    blocks.iter().flat_map(|&b| (b * bs)..(b * bs + bs)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;
    use half::slice::HalfFloatSliceExt;

    /// A model geometry for KV tests: only the layer count and KV heads matter here.
    fn kv_model(
        num_layers: usize,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> crate::config::ModelConfig {
        crate::config::ModelConfig {
            vocab_size: 8,
            hidden_size: num_heads * head_dim,
            intermediate_size: 8,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            max_position: 64,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            rope_style: crate::config::RopeStyle::Halves,
            rope_scaling: Default::default(),
            parts: Default::default(),
        }
    }

    /// The host-side conversions the wire format is defined by.
    fn append_values(out: &mut Vec<u8>, values: &[f32], dtype: WireDType) {
        match dtype {
            WireDType::F32 => out.extend_from_slice(bytemuck::cast_slice(values)),
            WireDType::F16 => {
                let mut halves = vec![f16::ZERO; values.len()];
                halves.convert_from_f32_slice(values);
                out.extend_from_slice(bytemuck::cast_slice(&halves));
            }
        }
    }

    fn read_values(bytes: &[u8], dtype: WireDType) -> Vec<f32> {
        match dtype {
            WireDType::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            WireDType::F16 => {
                let halves: Vec<f16> = bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]])).collect();
                let mut out = vec![0f32; halves.len()];
                halves.convert_to_f32_slice(&mut out);
                out
            }
        }
    }

    #[test]
    fn header_round_trips_and_rejects_garbage() {
        let h = KvHeader {
            fingerprint: 0x1234_5678_9abc_def0,
            dtype: WireDType::F16,
            model_layers: 30,
            layer_start: 4,
            layer_count: 2,
            num_tokens: 17,
            num_kv_heads: 3,
            head_dim: 64,
        };
        assert_eq!(KvHeader::decode(&h.encode()).expect("decodes"), h);
        assert_eq!(h.payload_len(), 2 * 2 * 17 * 3 * 64 * 2);
        let err = KvHeader::decode(&h.encode()[..10]).expect_err("short");
        assert!(err.to_string().contains("shorter than"), "{err}");
        let mut bad = h.encode();
        bad[0] = b'X';
        assert!(KvHeader::decode(&bad).expect_err("magic").to_string().contains("magic"));
        let mut bad = h.encode();
        bad[6] = 9;
        assert!(KvHeader::decode(&bad).expect_err("dtype").to_string().contains("dtype"));
    }

    #[test]
    fn block_payloads_round_trip_into_other_blocks() -> Result<()> {
        use crate::config::CacheConfig;
        let model = kv_model(2, 2, 1, 4);
        let dev = candle_core::Device::Cpu;
        let config = CacheConfig { prefix_cache: false, block_size: 2, ..CacheConfig::with_blocks(6) };
        let source = KvCache::new(&model, &config, &dev)?;
        let slots = 12;
        let k = Tensor::arange(0f32, (slots * 4) as f32, &dev)?.reshape((slots, 4))?;
        let v = (k.clone() * -1.0)?;
        let index: Vec<u32> = (0..slots as u32).flat_map(|s| [s; 4]).collect();
        source.write(1, &Tensor::from_vec(index, (slots, 4), &dev)?, &k, &v)?;
        let payload = read_blocks(&source, 1, &[4, 1], WireDType::F32)?;
        assert_eq!(payload.len(), 2 * 2 * 2 * 4 * 4);
        // The layers are views of one K and one V tensor: writing layer 1 left layer 0 alone.
        assert_eq!(read_blocks(&source, 0, &[4, 1], WireDType::F32)?, vec![0u8; payload.len()]);
        let target = KvCache::new(&model, &config, &dev)?;
        write_blocks(&target, 1, &[0, 5], WireDType::F32, &payload)?;
        assert_eq!(read_blocks(&target, 1, &[0, 5], WireDType::F32)?, payload);
        let err = write_blocks(&target, 1, &[0], WireDType::F32, &payload).expect_err("size");
        assert!(err.to_string().contains("expected"), "{err}");
        assert!(write_blocks(&target, 2, &[0, 5], WireDType::F32, &payload).is_err(), "layer 2 of 2");
        assert!(write_blocks(&target, 1, &[0, 6], WireDType::F32, &payload).is_err(), "block 6 of 6");
        Ok(())
    }

    #[test]
    fn values_round_trip_through_both_dtypes() {
        let values = [0.0f32, 1.5, -2.25, 65504.0, 1e-3];
        let mut buf = Vec::new();
        append_values(&mut buf, &values, WireDType::F32);
        assert_eq!(read_values(&buf, WireDType::F32), values);
        let mut buf = Vec::new();
        append_values(&mut buf, &values, WireDType::F16);
        let back = read_values(&buf, WireDType::F16);
        for (a, b) in values.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() * 1e-3, "{a} vs {b}");
        }
    }

    /// Export converts straight from the cache in chunks and import parses bytes into the
    /// cache's type: both must give exactly the bytes and values of the host conversions above,
    /// for every cache type and wire type.
    #[test]
    fn device_side_conversion_gives_the_host_conversion_bytes() -> Result<()> {
        use crate::config::{CacheConfig, KvCacheDType};
        let model = kv_model(1, 2, 2, 8);
        let dev = candle_core::Device::Cpu;
        let slots = 8;
        let k = (Tensor::randn(0f32, 3.0, (slots, 16), &dev)? * 1.0001)?;
        let v = Tensor::randn(0f32, 0.01, (slots, 16), &dev)?;
        let index: Vec<u32> = (0..slots as u32).flat_map(|s| [s; 16]).collect();
        let index = Tensor::from_vec(index, (slots, 16), &dev)?;
        for cache_dtype in [KvCacheDType::F32, KvCacheDType::F16] {
            let config =
                CacheConfig { prefix_cache: false, block_size: 4, dtype: cache_dtype, ..CacheConfig::with_blocks(2) };
            let cache = KvCache::new(&model, &config, &dev)?;
            cache.write(0, &index, &k, &v)?;
            let slot_ids = Tensor::arange(0u32, slots as u32, &dev)?;
            let (k_stored, v_stored) = cache.gather(0, &slot_ids)?;
            for wire in [WireDType::F16, WireDType::F32] {
                let mut want = Vec::new();
                for t in [&k_stored, &v_stored] {
                    append_values(&mut want, &t.flatten_all()?.to_vec1::<f32>()?, wire);
                }
                let got = read_blocks(&cache, 0, &[0, 1], wire)?;
                assert_eq!(got, want, "{cache_dtype:?} cache, {wire:?} wire");
                let target = KvCache::new(&model, &config, &dev)?;
                write_blocks(&target, 0, &[1, 0], wire, &got)?;
                let swapped = Tensor::from_vec(vec![4u32, 5, 6, 7, 0, 1, 2, 3], slots, &dev)?;
                let (k_back, _) = target.gather(0, &swapped)?;
                let k_want = read_values(&want[..want.len() / 2], wire);
                let k_want = cache_dtype_round(&k_want, cache_dtype);
                assert_eq!(k_back.flatten_all()?.to_vec1::<f32>()?, k_want, "{cache_dtype:?} cache, {wire:?} wire");
            }
        }
        Ok(())
    }

    fn cache_dtype_round(values: &[f32], dtype: crate::config::KvCacheDType) -> Vec<f32> {
        match dtype {
            crate::config::KvCacheDType::F32 => values.to_vec(),
            crate::config::KvCacheDType::F16 => values.iter().map(|&x| f16::from_f32(x).to_f32()).collect(),
        }
    }
}
