//! The forward pass of Llama-style decoders (Llama, Mistral, Qwen2 with Q/K/V biases, Qwen3
//! with per-head Q/K norms, Gemma 2 and 3 with their extra norms, caps and sliding-window
//! layers on a rotary base of their own, Qwen3-MoE's experts in `moe.rs`) over an external
//! paged KV cache, in candle's order:
//! config, small blocks with `load`, then the model. The cache is passed in, never owned by
//! the weights.
//!
//! One `forward` call runs a batch whose rows are the new tokens of several sequences, each at
//! its own position: prefill chunks (many rows) and decode steps (one row) mix freely. Every
//! projection runs once over all rows (weights are read once per step); only attention is per
//! sequence. Logits are computed only for the last row of sequences that ask for them.

use std::ops::ControlFlow;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use crate::attention::{paged_attention, Heads, SeqPlan};
use crate::config::{Activation, ModelConfig, RopeStyle, WeightFormat};
use crate::embedding::Embedding;
use crate::error::{EngineError, Result};
use crate::kv::cache::{KvCache, SequenceKv};
use crate::loader::{RawTensor, TensorSource};
use crate::matmul::small_m_matmul;
use crate::matmul_wq::WqWeight;
use crate::profile::{timed, Op};

/// A projection `x @ W^T`; dense weights are `[out, in]`, f32 or f16 (f16 is widened to f32
/// for the arithmetic in both paths, so both give the same numbers up to summation order).
#[derive(Debug)]
pub(crate) enum Linear {
    Dense {
        weight: Tensor,
    },
    Quant(QMatMul),
    /// Weight-only quantized, f32 activations (`WeightFormat::Wq`, CPU); shared with the
    /// token embeddings of a tied model.
    Wq(Arc<WqWeight>),
}

/// Up to how many rows a projection on CPU uses the small-batch kernels (weights read once per
/// 4 rows, widened in registers); above it, gemm over weights widened to f32 for the call
/// (prefill chunks). With AVX-512 the small-batch kernels were as fast as gemm at 512 rows
/// and 1.35x faster at 128 (gemm's kernels here are AVX2, and each call widens every
/// weight first), so they take every size. With AVX2 gemm wins from about 40 rows: at 32 rows
/// the small-batch kernel took 148 ms per step against gemm's 187, at 128 and 512 rows gemm
/// prefilled 7% and 23% faster (`pd-engine-bench`, `PD_ENGINE_SIMD=avx2`). A cut at 16 rows
/// made a 17-row decode step cost 1.6x a 16-row one.
fn small_batch_rows() -> usize {
    if crate::simd::avx512() {
        usize::MAX
    } else {
        32
    }
}

impl Linear {
    /// Whether `forward` over `rows` rows on `device` reads the weights as they are kept,
    /// without a widened copy made for the call (so splitting the rows costs no extra pass).
    fn streams_weights(&self, device: &Device, rows: usize) -> bool {
        match self {
            _ if !matches!(device, Device::Cpu) => false,
            Linear::Quant(_) => true,
            Linear::Dense { .. } | Linear::Wq(_) => rows <= small_batch_rows(),
        }
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Linear::Dense { weight } => {
                if !matches!(x.device(), Device::Cpu) {
                    // GPU: half-precision weights multiply half-precision activations on the
                    // tensor cores (cuBLAS accumulates in f32); the residual stream stays f32.
                    match weight.dtype() {
                        DType::F32 => x.matmul(&weight.t()?)?,
                        dtype => x.to_dtype(dtype)?.matmul(&weight.t()?)?.to_dtype(DType::F32)?,
                    }
                } else if x.dim(0)? <= small_batch_rows() {
                    small_m_matmul(x, weight)?
                } else {
                    x.matmul(&weight.to_dtype(DType::F32)?.t()?)?
                }
            }
            Linear::Quant(q) => q.forward(x)?,
            Linear::Wq(w) => {
                if x.dim(0)? <= small_batch_rows() {
                    w.matmul(x)?
                } else {
                    x.matmul(&w.dequantize(x.device())?.t()?)?
                }
            }
        })
    }
}

/// One decoder layer's weights. Q/K/V and gate/up are fused into one matmul each.
#[derive(Debug)]
struct Layer {
    attn_norm: Tensor,
    qkv: Linear,
    /// Q, K and V biases, concatenated like `qkv`'s outputs (Qwen2).
    qkv_bias: Option<Tensor>,
    /// RMSNorm weights of one head of Q and of K (Qwen3).
    qk_norm: Option<(Tensor, Tensor)>,
    /// Norms of the attention and the MLP outputs before the residual (Gemma 2).
    post_norms: Option<(Tensor, Tensor)>,
    out: Linear,
    ffn_norm: Tensor,
    mlp: Mlp,
}

/// A layer's MLP: gated (gate and up fused into one matmul), or a mixture of such experts.
#[derive(Debug)]
enum Mlp {
    Dense { gate_up: Linear, down: Linear },
    Experts(crate::moe::Moe),
}

/// On CPU, a gated MLP over many rows runs in slices of rows whose `[rows, 2 * ffn]` gate/up
/// product holds at most this many values (8 MiB), at least `MLP_MIN_ROWS` rows: that product
/// and its activation are a layer's largest tensors, and a 512-token prefill chunk of
/// Llama-3.2-1B held 48 MiB of them at once. Rows are independent, so the slices give the
/// same numbers; the weights are read once per slice instead of once per chunk, which the
/// row blocks of the small-batch kernels already do every 4 rows.
const MLP_SLICE_VALUES: usize = 1 << 21;
const MLP_MIN_ROWS: usize = 64;

/// Rows per slice of a gated MLP `ffn` wide (a multiple of the kernels' 4-row blocks).
fn mlp_slice_rows(ffn: usize) -> usize {
    (MLP_SLICE_VALUES / (2 * ffn).max(1)).max(MLP_MIN_ROWS) / 4 * 4
}

/// A gated MLP: `down(act(gate(h)) * up(h))`, gate and up as one matmul of `2 * ffn` outputs.
/// Long inputs run in slices of rows (`MLP_SLICE_VALUES`) where the projections read their
/// weights as kept; where a call would widen them first (gemm on AVX2, GPU) they run whole.
pub(crate) fn gated_mlp(gate_up: &Linear, down: &Linear, h: &Tensor, ffn: usize, act: Activation) -> Result<Tensor> {
    let (rows, slice) = (h.dim(0)?, mlp_slice_rows(ffn));
    let streams = |l: &Linear| l.streams_weights(h.device(), slice);
    if rows <= slice || !streams(gate_up) || !streams(down) {
        return mlp_rows(gate_up, down, h, ffn, act);
    }
    mlp_in_slices(gate_up, down, h, ffn, act, slice)
}

fn mlp_in_slices(
    gate_up: &Linear,
    down: &Linear,
    h: &Tensor,
    ffn: usize,
    act: Activation,
    slice: usize,
) -> Result<Tensor> {
    let rows = h.dim(0)?;
    let parts = (0..rows)
        .step_by(slice)
        .map(|r| mlp_rows(gate_up, down, &h.narrow(0, r, slice.min(rows - r))?, ffn, act))
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}

fn mlp_rows(gate_up: &Linear, down: &Linear, h: &Tensor, ffn: usize, act: Activation) -> Result<Tensor> {
    let gate_up = timed(Op::Projections, || gate_up.forward(h))?;
    let act = timed(Op::Activation, || crate::activation::gated_activation(&gate_up, ffn, act))?;
    // `[rows, 2 * ffn]`, the largest activation of a layer: freed before the down projection.
    drop(gate_up);
    timed(Op::Projections, || down.forward(&act))
}

/// A sequence's share of a forward batch.
#[derive(Debug)]
pub struct BatchSeq<'a> {
    /// New tokens to run (a prefill chunk, or the one token of a decode step).
    pub tokens: &'a [u32],
    /// The sequence's KV; grows by `tokens.len()` on success.
    pub kv: &'a mut SequenceKv,
    /// Whether the logits after the last new token are wanted.
    pub want_logits: bool,
}

/// Llama-family model weights and rotary tables.
#[derive(Debug)]
pub struct Model {
    config: ModelConfig,
    /// Token embeddings `[vocab, hidden]`, as the checkpoint stores them.
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    /// `[max_position, rotary_dim / 2]` rotary tables.
    cos: Tensor,
    sin: Tensor,
    /// The sliding-window layers' own tables, where their rotary base differs (Gemma 3).
    local_rope: Option<(Tensor, Tensor)>,
    /// Each layer's attention window (0: every earlier position).
    windows: Vec<usize>,
    device: Device,
    /// Identifies model + weight format, so KV from another model is refused.
    fingerprint: u64,
}

/// The first `rows` rows of `t` in storage of their own, so the rest is freed with `t`.
/// (candle's `copy` of a narrowed view clones the whole storage behind it: the rotary
/// tables of a 131,072-position model stayed 32 MiB after being "trimmed".)
fn first_rows(t: &Tensor, rows: usize) -> Result<Tensor> {
    Ok(match t.dim(0)? {
        all if all > rows => t.narrow(0, 0, rows)?.force_contiguous()?,
        _ => t.clone(),
    })
}

impl Model {
    /// Keeps the rotary tables for the first `positions` positions only: no sequence of a
    /// KV pool of `positions` slots goes further. At a 131,072-token context the full tables
    /// take 32 MiB (head width 64), more than the KV pool of a small deployment.
    pub(crate) fn limit_positions(&mut self, positions: usize) -> Result<()> {
        (self.cos, self.sin) = (first_rows(&self.cos, positions)?, first_rows(&self.sin, positions)?);
        if let Some((cos, sin)) = &self.local_rope {
            self.local_rope = Some((first_rows(cos, positions)?, first_rows(sin, positions)?));
        }
        Ok(())
    }

    /// Builds the model from a checkpoint's tensors. A tensor of the checkpoint that the
    /// configured architecture does not use is refused (`UnusedTensor`): it means a setting
    /// the engine did not read.
    pub fn load(
        mut config: ModelConfig,
        source: &mut dyn TensorSource,
        format: WeightFormat,
        device: &Device,
    ) -> Result<Self> {
        if let Some(freqs) = source.take("rope_freqs.weight")? {
            if config.rope_scaling != crate::rope::RopeScaling::None {
                return Err(EngineError::Metadata("both `rope_freqs` and a rope scaling type are set".into()));
            }
            let factors = freqs.dequantize()?.flatten_all()?.to_vec1::<f32>()?;
            config.rope_scaling = crate::rope::RopeScaling::Factors(factors);
        }
        // LongRoPE from GGUF: the converter stores the two factor lists as tensors and the
        // rest as metadata (read into an empty `LongRope` by the GGUF reader).
        let long = source.take("rope_factors_long.weight")?;
        let short = source.take("rope_factors_short.weight")?;
        if long.is_some() || short.is_some() {
            let crate::rope::RopeScaling::LongRope { short: s, long: l, .. } = &mut config.rope_scaling else {
                return Err(EngineError::Metadata(
                    "`rope_factors_long`/`short` tensors without LongRoPE metadata".into(),
                ));
            };
            let values = |t: Option<RawTensor>, name: &str| -> Result<Vec<f32>> {
                let t = t.ok_or_else(|| EngineError::MissingTensor(name.to_string()))?;
                Ok(t.dequantize()?.flatten_all()?.to_vec1::<f32>()?)
            };
            *l = values(long, "rope_factors_long.weight")?;
            *s = values(short, "rope_factors_short.weight")?;
        }
        config.validate()?;
        if config.parts.attn_softcap.is_some() && !matches!(device, Device::Cpu) {
            return Err(EngineError::UnsupportedSetting {
                field: "attn_logit_softcapping".into(),
                reason: "not implemented in the CUDA attention kernel (CPU only)".into(),
            });
        }
        crate::simd::check_env()?;
        let c = &config;
        let (hidden, kv_width) = (c.hidden_size, c.kv_width());
        let q_width = c.num_heads * c.head_dim;
        let embed_raw = required(source, "token_embd.weight", &[c.vocab_size, hidden])?;
        let mut embed = Embedding::new(&embed_raw, device)?;
        let norm = dense_vector(required(source, "output_norm.weight", &[hidden])?, device)?;
        let lm_head = match source.take("output.weight")? {
            Some(w) => {
                check_shape("output.weight", &w, &[c.vocab_size, hidden])?;
                linear(vec![w], format, device)?
            }
            None => {
                let head = linear(vec![embed_raw], format, device)?;
                if let Linear::Wq(w) = &head {
                    embed = Embedding::Tied(Arc::clone(w));
                }
                head
            }
        };
        let mut fingerprint_data = format!("{config:?}|{format:?}").into_bytes();
        fingerprint_data.extend(norm.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()));
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let name = |part: &str| format!("blk.{i}.{part}.weight");
            let mut req = |part: &str, shape: &[usize]| required(source, &name(part), shape);
            let attn_norm = dense_vector(req("attn_norm", &[hidden])?, device)?;
            // Phi-3 stores Q/K/V as one matrix, and gate/up as one (llama.cpp: as `ffn_up`
            // of twice the width); the fused matmuls take them as they are.
            let qkv = match source.contains(&name("attn_qkv")) {
                true => vec![required(source, &name("attn_qkv"), &[q_width + 2 * kv_width, hidden])?],
                false => {
                    let mut req = |part: &str, shape: &[usize]| required(source, &name(part), shape);
                    vec![
                        req("attn_q", &[q_width, hidden])?,
                        req("attn_k", &[kv_width, hidden])?,
                        req("attn_v", &[kv_width, hidden])?,
                    ]
                }
            };
            let mut req = |part: &str, shape: &[usize]| required(source, &name(part), shape);
            let out = req("attn_output", &[hidden, q_width])?;
            let ffn_norm = dense_vector(req("ffn_norm", &[hidden])?, device)?;
            let mlp = match c.parts.moe.as_ref().filter(|m| m.layers[i]) {
                Some(m) => Mlp::Experts(crate::moe::Moe::load(source, i, m, hidden, format, device)?),
                None => dense_mlp(source, i, c, format, device)?,
            };
            let qkv_bias = if c.parts.qkv_bias {
                let parts = [("attn_q", q_width), ("attn_k", kv_width), ("attn_v", kv_width)];
                let parts = parts.iter().map(|&(part, width)| {
                    let name = format!("blk.{i}.{part}.bias");
                    dense_vector(required(source, &name, &[width])?, device)
                });
                Some(Tensor::cat(&parts.collect::<Result<Vec<_>>>()?, 0)?)
            } else {
                None
            };
            let post_norms = if c.parts.post_norms {
                let mut norm = |part: &str| dense_vector(required(source, &name(part), &[hidden])?, device);
                Some((norm("post_attention_norm")?, norm("post_ffw_norm")?))
            } else {
                None
            };
            let qk_norm = if c.parts.qk_norm {
                let mut norm = |part: &str| {
                    dense_vector(required(source, &format!("blk.{i}.{part}.weight"), &[c.head_dim])?, device)
                };
                Some((norm("attn_q_norm")?, norm("attn_k_norm")?))
            } else {
                None
            };
            if i == 0 {
                fingerprint_data.extend(attn_norm.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()));
            }
            layers.push(Layer {
                attn_norm,
                qkv: linear(qkv, format, device)?,
                qkv_bias,
                qk_norm,
                post_norms,
                out: linear(vec![out], format, device)?,
                ffn_norm,
                mlp,
            });
        }
        if let Some(name) = source.unused().into_iter().next() {
            return Err(EngineError::UnusedTensor(name));
        }
        let (cos, sin) = rope_tables(c, &c.rope_scaling, c.rope_theta, device)?;
        let local_rope = match c.parts.local_rope_theta {
            Some(theta) => Some(rope_tables(c, &crate::rope::RopeScaling::None, theta, device)?),
            None => None,
        };
        let windows = (0..c.num_layers)
            .map(|i| c.parts.sliding_window.as_ref().and_then(|w| w.of_layer(i)).unwrap_or(0))
            .collect();
        Ok(Model {
            fingerprint: fnv1a64(&fingerprint_data),
            config,
            embed,
            layers,
            norm,
            lm_head,
            cos,
            sin,
            local_rope,
            windows,
            device: device.clone(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Model identity for KV compatibility checks.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Runs one step over `batch` and returns `[n, vocab]` logits, one row per sequence with
    /// `want_logits`, in batch order. Each sequence's KV grows by its tokens; on error no
    /// sequence's length changes (blocks it grew into stay owned by it and are freed with it).
    pub fn forward(&self, cache: &KvCache, batch: &mut [BatchSeq<'_>]) -> Result<Tensor> {
        self.forward_observed(cache, batch, &mut |_| ControlFlow::Continue(()))
    }

    /// `forward`, calling `layer_done(l)` as soon as layer `l`'s K/V of every new token are in
    /// the cache (so a prefill worker can start shipping layer `l` while later layers compute).
    /// `layer_done` returning `Break` stops the step there (a prefill worker preempting a
    /// document's step for a short prompt): `EngineError::Preempted`, and as with any error no
    /// sequence's length changes, so the same step can run again later; the K/V already
    /// written for its tokens are overwritten then.
    pub fn forward_observed(
        &self,
        cache: &KvCache,
        batch: &mut [BatchSeq<'_>],
        layer_done: &mut dyn FnMut(usize) -> ControlFlow<()>,
    ) -> Result<Tensor> {
        self.forward_rows(cache, batch, &[], layer_done)
    }

    /// `forward_observed`, with a logits row for *every* new token of the sequences whose
    /// entry in `every_row` is true (a prompt scored for its own log probabilities, as
    /// evaluation harnesses ask): their rows come in token order where their one row would.
    pub fn forward_rows(
        &self,
        cache: &KvCache,
        batch: &mut [BatchSeq<'_>],
        every_row: &[bool],
        layer_done: &mut dyn FnMut(usize) -> ControlFlow<()>,
    ) -> Result<Tensor> {
        let c = &self.config;
        if batch.is_empty() {
            return Err(EngineError::InvalidBatch("empty batch".into()));
        }
        if cache.num_layers() != c.num_layers || cache.kv_width() != c.kv_width() {
            return Err(EngineError::InvalidBatch("KV cache geometry does not match the model".into()));
        }
        let softcap = c.parts.attn_softcap.unwrap_or(0.0);
        // Plans carry the masks of the model's window; each layer attends with its own.
        let window = self.windows.iter().copied().max().unwrap_or(0);
        let heads =
            Heads { num_heads: c.num_heads, num_kv_heads: c.num_kv_heads, head_dim: c.head_dim, softcap, window };
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut plans = Vec::with_capacity(batch.len());
        let mut logit_rows = Vec::new();
        for (index, seq) in batch.iter_mut().enumerate() {
            let n = seq.tokens.len();
            if n == 0 {
                return Err(EngineError::InvalidBatch("a sequence has no new tokens".into()));
            }
            if let Some(&bad) = seq.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(EngineError::InvalidBatch(format!(
                    "token id {bad} is outside the vocabulary of {}",
                    c.vocab_size
                )));
            }
            let start = seq.kv.len();
            let end = start + n;
            let max = c.max_position.min(self.cos.dim(0)?);
            if end > max {
                return Err(EngineError::ContextOverflow { tokens: end, max });
            }
            seq.kv.blocks_mut().ensure_tokens(end)?;
            cache.check_blocks(seq.kv.blocks().ids())?;
            plans.push(SeqPlan::new(ids.len(), n, start, seq.kv.slots(0, end)?, heads, &self.device)?);
            ids.extend_from_slice(seq.tokens);
            positions.extend((start..end).map(|p| p as u32));
            if every_row.get(index).copied().unwrap_or(false) {
                logit_rows.extend((ids.len() - n..ids.len()).map(|r| r as u32));
            } else if seq.want_logits {
                logit_rows.push((ids.len() - 1) as u32);
            }
        }
        let rows = ids.len();
        let dev = &self.device;
        let embedded = self.embed.lookup(&ids, dev)?;
        let positions = Tensor::from_vec(positions, rows, dev)?;
        let half = c.rotary_dim() / 2;
        let at_positions =
            |table: &Tensor| -> Result<Tensor> { Ok(table.index_select(&positions, 0)?.reshape((rows, 1, half))?) };
        let (cos, sin) = (at_positions(&self.cos)?, at_positions(&self.sin)?);
        let local = match &self.local_rope {
            Some((cos, sin)) => Some((at_positions(cos)?, at_positions(sin)?)),
            None => None,
        };
        let new_slots: Vec<u32> = plans
            .iter()
            .flat_map(|p| p.slots[p.start_pos..p.start_pos + p.rows].iter().copied())
            .flat_map(|s| std::iter::repeat_n(s, c.kv_width()))
            .collect();
        let slot_index = Tensor::from_vec(new_slots, (rows, c.kv_width()), dev)?;
        let (q_width, kv_width) = (c.num_heads * c.head_dim, c.kv_width());
        let eps = c.rms_norm_eps as f32;

        let mut x = embedded;
        if let Some(scale) = c.parts.embed_scale {
            x = (x * scale as f64)?;
        }
        // The kernels scale scores by head_dim^-1/2; a family's own query scale is folded in.
        let query_factor = c.parts.query_scale.map(|s| (c.head_dim as f64 / s as f64).sqrt());
        for (layer_idx, layer) in self.layers.iter().enumerate() {
            let h = timed(Op::Norms, || candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps))?;
            let mut qkv = timed(Op::Projections, || layer.qkv.forward(&h))?;
            if let Some(bias) = &layer.qkv_bias {
                qkv = qkv.broadcast_add(bias)?;
            }
            let (mut q, mut k) = (qkv.narrow(1, 0, q_width)?, qkv.narrow(1, q_width, kv_width)?);
            if let Some((q_norm, k_norm)) = &layer.qk_norm {
                (q, k) = timed(Op::Norms, || {
                    let per_head = |x: &Tensor, w: &Tensor| -> Result<Tensor> {
                        let heads = x.reshape(((), c.head_dim))?.contiguous()?;
                        Ok(candle_nn::ops::rms_norm(&heads, w, eps)?.reshape((rows, ()))?)
                    };
                    Ok::<_, EngineError>((per_head(&q, q_norm)?, per_head(&k, k_norm)?))
                })?;
            }
            let window = self.windows[layer_idx];
            let (cos, sin) = match &local {
                Some((cos, sin)) if window > 0 => (cos, sin),
                _ => (&cos, &sin),
            };
            let (mut q, k) = timed(Op::Rope, || {
                Ok::<_, EngineError>((self.rope(&q, c.num_heads, cos, sin)?, self.rope(&k, c.num_kv_heads, cos, sin)?))
            })?;
            if let Some(f) = query_factor {
                q = (q * f)?;
            }
            let v = qkv.narrow(1, q_width + kv_width, kv_width)?;
            timed(Op::KvWrite, || cache.write(layer_idx, &slot_index, &k, &v))?;
            // What the cache now holds, and the norm's output, are not needed again: a
            // prefill chunk's live set stays one layer stage's tensors.
            drop((h, qkv, k, v));
            if layer_done(layer_idx).is_break() {
                return Err(EngineError::Preempted { layers: layer_idx + 1 });
            }
            let attn =
                timed(Op::Attention, || paged_attention(&q, cache, layer_idx, &plans, Heads { window, ..heads }))?;
            drop(q);
            let mut out = timed(Op::Projections, || layer.out.forward(&attn))?;
            drop(attn);
            if let Some((post_attn, _)) = &layer.post_norms {
                out = timed(Op::Norms, || candle_nn::ops::rms_norm(&out, post_attn, eps))?;
            }
            x = timed(Op::Residual, || x + out)?;
            let h = timed(Op::Norms, || candle_nn::ops::rms_norm(&x, &layer.ffn_norm, eps))?;
            let mut down = match &layer.mlp {
                Mlp::Dense { gate_up, down } => gated_mlp(gate_up, down, &h, c.intermediate_size, c.parts.activation)?,
                Mlp::Experts(moe) => moe.forward(&h, c.parts.activation)?,
            };
            if let Some((_, post_ffw)) = &layer.post_norms {
                down = timed(Op::Norms, || candle_nn::ops::rms_norm(&down, post_ffw, eps))?;
            }
            x = timed(Op::Residual, || x + down)?;
        }
        for (seq, plan) in batch.iter_mut().zip(&plans) {
            seq.kv.commit_len(plan.start_pos + plan.rows);
        }
        if logit_rows.is_empty() {
            return Ok(Tensor::zeros((0, c.vocab_size), DType::F32, dev)?);
        }
        let n = logit_rows.len();
        timed(Op::LmHead, || {
            let last = x.index_select(&Tensor::from_vec(logit_rows, n, dev)?, 0)?;
            let last = candle_nn::ops::rms_norm(&last, &self.norm, eps)?;
            let logits = self.lm_head.forward(&last)?;
            match c.parts.final_softcap {
                Some(cap) => Ok(((logits / cap as f64)?.tanh()? * cap as f64)?),
                None => Ok(logits),
            }
        })
    }

    /// Applies rotary embeddings to `[rows, heads * head_dim]`: to the first `rotary_dim`
    /// values of each head, the rest passing unchanged (partial rotary).
    fn rope(&self, x: &Tensor, heads: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (rows, width) = x.dims2()?;
        let (head_dim, rotary) = (width / heads, self.config.rotary_dim());
        let x = x.reshape((rows, heads, 1, head_dim))?;
        let turn = |x: &Tensor| -> Result<Tensor> {
            Ok(match self.config.rope_style {
                RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(x, cos, sin)?,
                RopeStyle::Halves => candle_nn::rotary_emb::rope(x, cos, sin)?,
            })
        };
        let y = if rotary == head_dim {
            turn(&x)?
        } else {
            let turned = turn(&x.narrow(3, 0, rotary)?.contiguous()?)?;
            Tensor::cat(&[turned, x.narrow(3, rotary, head_dim - rotary)?], 3)?
        };
        Ok(y.reshape((rows, width))?)
    }
}

/// `[max_position, rotary_dim / 2]` cos and sin, with a rotary scheme and base (and the
/// scheme's attention factor, which YaRN and LongRoPE fold into both).
fn rope_tables(
    c: &ModelConfig,
    scaling: &crate::rope::RopeScaling,
    theta: f32,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let half = c.rotary_dim() / 2;
    let (inv_freq, attention_factor) = scaling.frequencies(c.rotary_dim(), theta, c.max_position)?;
    let inv_freq = Tensor::from_vec(inv_freq, (1, half), device)?;
    let pos =
        Tensor::arange(0u32, c.max_position as u32, device)?.to_dtype(DType::F32)?.reshape((c.max_position, 1))?;
    let angles = pos.broadcast_mul(&inv_freq)?;
    if attention_factor == 1.0 {
        return Ok((angles.cos()?, angles.sin()?));
    }
    let f = attention_factor as f64;
    Ok(((angles.cos()? * f)?, (angles.sin()? * f)?))
}

/// Layer `i`'s dense MLP: gate and up apart, fused (`ffn_gate_up`, Phi-3's folders) or as one
/// `ffn_up` of twice the width (llama.cpp's Phi-3 files).
fn dense_mlp(
    source: &mut dyn TensorSource,
    i: usize,
    c: &ModelConfig,
    format: WeightFormat,
    device: &Device,
) -> Result<Mlp> {
    let name = |part: &str| format!("blk.{i}.{part}.weight");
    let (hidden, ffn) = (c.hidden_size, c.intermediate_size);
    let gate_up = if source.contains(&name("ffn_gate_up")) {
        vec![required(source, &name("ffn_gate_up"), &[2 * ffn, hidden])?]
    } else if !source.contains(&name("ffn_gate")) && source.contains(&name("ffn_up")) {
        vec![required(source, &name("ffn_up"), &[2 * ffn, hidden])?]
    } else {
        vec![required(source, &name("ffn_gate"), &[ffn, hidden])?, required(source, &name("ffn_up"), &[ffn, hidden])?]
    };
    let down = required(source, &name("ffn_down"), &[hidden, ffn])?;
    Ok(Mlp::Dense { gate_up: linear(gate_up, format, device)?, down: linear(vec![down], format, device)? })
}

fn check_shape(name: &str, t: &RawTensor, expected: &[usize]) -> Result<()> {
    let got = t.dims();
    if got != expected {
        return Err(EngineError::TensorShape { name: name.to_string(), got, expected: expected.to_vec() });
    }
    Ok(())
}

pub(crate) fn required(source: &mut dyn TensorSource, name: &str, shape: &[usize]) -> Result<RawTensor> {
    let t = source.take(name)?.ok_or_else(|| EngineError::MissingTensor(name.to_string()))?;
    check_shape(name, &t, shape)?;
    Ok(t)
}

fn dense_vector(t: RawTensor, device: &Device) -> Result<Tensor> {
    Ok(t.dequantize()?.to_device(device)?)
}

/// A block-quantized type (not a plain float format stored as such).
fn is_block_quantized(dtype: GgmlDType) -> bool {
    !matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
}

/// Candle's Q8_0 block width: quantizing needs the input width to be a multiple of it.
const Q8_0_BLOCK: usize = 32;

/// One matmul whose output rows are `parts` stacked (all `[rows_i, k]`).
pub(crate) fn linear(parts: Vec<RawTensor>, format: WeightFormat, device: &Device) -> Result<Linear> {
    let k = parts[0].dims()[1];
    let all_quant_dtype = match parts.as_slice() {
        [RawTensor::Quant(first), rest @ ..] => {
            rest.iter().all(|p| matches!(p, RawTensor::Quant(q) if q.dtype() == first.dtype())).then(|| first.dtype())
        }
        _ => None,
    };
    // Under `wq` on CPU, block-quantized types without a repacking kernel (Q4_0, Q4_K, Q6_K,
    // ...) keep their stored blocks and candle's kernels rather than being widened to f16
    // (4x the memory traffic of Q4_K).
    let wq_stored = matches!((format, device), (WeightFormat::Wq, Device::Cpu))
        && all_quant_dtype.is_some_and(|d| !crate::matmul_wq::supported(d) && is_block_quantized(d));
    let keep_stored = wq_stored
        || matches!(
            (format, all_quant_dtype),
            (WeightFormat::Stored, Some(_)) | (WeightFormat::Q8, Some(GgmlDType::Q8_0))
        );
    let repackable = parts.iter().map(|p| match p {
        RawTensor::Quant(q) if crate::matmul_wq::supported(q.dtype()) => Some(q),
        _ => None,
    });
    if let (WeightFormat::Wq, Device::Cpu, Some(q)) = (format, device, repackable.collect::<Option<Vec<_>>>()) {
        if k.is_multiple_of(crate::matmul_wq::QK) {
            return Ok(Linear::Wq(Arc::new(WqWeight::from_parts(&q)?)));
        }
    }
    if keep_stored {
        let dtype = all_quant_dtype.unwrap_or(GgmlDType::Q8_0);
        let rows: usize = parts.iter().map(|p| p.dims()[0]).sum();
        let mut bytes = Vec::new();
        for part in &parts {
            if let RawTensor::Quant(q) = part {
                bytes.extend_from_slice(&q.data()?);
            }
        }
        let storage = QStorage::from_data(std::borrow::Cow::Owned(bytes), device, dtype)?;
        return Ok(Linear::Quant(QMatMul::from_qtensor(QTensor::new(storage, (rows, k))?)?));
    }
    let dense = parts.iter().map(|p| Ok(p.dequantize()?.to_device(device)?)).collect::<Result<Vec<_>>>()?;
    let dense = Tensor::cat(&dense, 0)?;
    match format {
        WeightFormat::Q8 if k.is_multiple_of(Q8_0_BLOCK) => {
            Ok(Linear::Quant(QMatMul::from_qtensor(QTensor::quantize(&dense, GgmlDType::Q8_0)?)?))
        }
        // On a GPU `wq` has no kernel of its own: f16, like `f16`.
        WeightFormat::F16 | WeightFormat::Wq => Ok(Linear::Dense { weight: dense.to_dtype(DType::F16)? }),
        _ => Ok(Linear::Dense { weight: dense }),
    }
}

/// FNV-1a, 64 bit: a stable fingerprint without extra dependencies.
pub(crate) fn fnv1a64(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| (hash ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Trimmed rotary tables hold only the kept rows, in storage of their own.
    #[test]
    fn trimmed_tables_free_the_rows_they_drop() {
        let t = Tensor::arange(0f32, 4096.0, &Device::Cpu).expect("arange").reshape((1024, 4)).expect("reshape");
        let kept = first_rows(&t, 10).expect("trim");
        assert_eq!(kept.dims(), &[10, 4]);
        assert_eq!(
            kept.flatten_all().expect("flat").to_vec1::<f32>().expect("v"),
            (0..40).map(|i| i as f32).collect::<Vec<_>>()
        );
        let stored = match &*kept.storage_and_layout().0 {
            candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v.len(),
            other => panic!("unexpected storage {:?}", other.dtype()),
        };
        assert_eq!(stored, 40, "the trimmed table still holds the dropped rows");
        assert_eq!(first_rows(&t, 2048).expect("no trim").dims(), &[1024, 4]);
    }

    /// A long MLP input run in slices of rows equals the whole run (`wq` weights, a last
    /// slice shorter than the others), and the slice size keeps the gate/up product bounded.
    #[test]
    fn an_mlp_in_slices_of_rows_equals_the_whole() {
        let (rows, hidden, ffn) = (150, 64, 96);
        let weights = |n: usize, k: usize, salt: usize| {
            let v: Vec<f32> = (0..n * k).map(|i| (((i + salt) * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.2).collect();
            let q = QTensor::quantize(&Tensor::from_vec(v, (n, k), &Device::Cpu).expect("t"), GgmlDType::Q4_1);
            linear(vec![RawTensor::Quant(q.expect("quantize"))], WeightFormat::Wq, &Device::Cpu).expect("linear")
        };
        let (gate_up, down) = (weights(2 * ffn, hidden, 1), weights(hidden, ffn, 2));
        let h: Vec<f32> = (0..rows * hidden).map(|i| ((i * 31 % 97) as f32 / 97.0 - 0.5) * 2.0).collect();
        let h = Tensor::from_vec(h, (rows, hidden), &Device::Cpu).expect("h");
        let whole = mlp_rows(&gate_up, &down, &h, ffn, Activation::Silu).expect("whole");
        let sliced = mlp_in_slices(&gate_up, &down, &h, ffn, Activation::Silu, 64).expect("sliced");
        assert_eq!(sliced.dims(), whole.dims());
        let diff = (sliced - &whole).expect("sub").abs().expect("abs").max_all().expect("max");
        let scale = whole.abs().expect("abs").max_all().expect("max").to_scalar::<f32>().expect("scalar");
        assert!(diff.to_scalar::<f32>().expect("scalar") <= 1e-5 * scale.max(1.0), "slices differ from the whole");
        // Llama-3.2-1B (ffn 8,192): 128 rows, 8 MiB of gate/up; a narrow MLP takes more rows.
        assert_eq!(mlp_slice_rows(8192), 128);
        assert_eq!(mlp_slice_rows(14336), 72);
        assert_eq!(mlp_slice_rows(1536), 680);
    }

    /// A Q4_K or Q6_K matrix under the default `wq` keeps its blocks (candle's kernels)
    /// instead of being widened to f16, and multiplies as its dequantized values do (up to
    /// the 8-bit rounding of the activations).
    #[test]
    fn k_quants_under_wq_stay_quantized() {
        let values: Vec<f32> = (0..256 * 256).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.2).collect();
        let dense = Tensor::from_vec(values, (256, 256), &Device::Cpu).expect("tensor");
        let x = Tensor::from_vec(
            (0..256 * 3).map(|i| (i % 17) as f32 / 17.0 - 0.5).collect::<Vec<_>>(),
            (3, 256),
            &Device::Cpu,
        )
        .expect("x");
        for dtype in [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q4_0] {
            let q = QTensor::quantize(&dense, dtype).expect("quantize");
            let reference = x.matmul(&q.dequantize(&Device::Cpu).expect("dequantize").t().expect("t")).expect("matmul");
            let l = linear(vec![RawTensor::Quant(q)], WeightFormat::Wq, &Device::Cpu).expect("linear");
            assert!(matches!(l, Linear::Quant(_)), "{dtype:?} kept quantized");
            let got = l.forward(&x).expect("forward");
            let diff = (got - &reference).expect("sub").abs().expect("abs").max_all().expect("max");
            let diff = diff.to_scalar::<f32>().expect("scalar");
            assert!(diff < 0.05, "{dtype:?}: differs from the dequantized product by {diff}");
        }
    }
}
