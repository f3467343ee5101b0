//! Model hyperparameters, read from a checkpoint (GGUF metadata or config.json) and checked
//! once, so the forward pass can trust them. Also the engine-level settings a worker chooses.

use crate::error::{EngineError, Result};
pub use crate::rope::RopeScaling;

/// How rotary embeddings pair the dimensions of a head. GGUF Llama checkpoints store Q/K
/// permuted for interleaved pairs (2i, 2i+1); Hugging Face checkpoints use halves (i, i+d/2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    Interleaved,
    Halves,
}

/// Hyperparameters of the decoder families the engine runs: Llama (and its context-extended
/// Llama 3.x), Mistral, Phi-3, Qwen2 / Qwen2.5, Qwen3, Gemma 2 and Gemma 3, which differ from
/// Llama in the optional `parts`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Longest sequence (prompt + output) the model was trained for.
    pub max_position: usize,
    pub rope_theta: f32,
    pub rms_norm_eps: f64,
    pub rope_style: RopeStyle,
    /// How rotary frequencies are changed for a longer context (Llama 3.x, YaRN, ...).
    pub rope_scaling: RopeScaling,
    /// What a family adds to or changes in Llama's layer.
    pub parts: DecoderParts,
}

/// The departures from Llama's decoder layer, each off by default.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DecoderParts {
    /// Q, K and V projections have biases (Qwen2).
    pub qkv_bias: bool,
    /// Each head of Q and K is RMS-normalised (own weights of `head_dim`) before rotary
    /// embeddings (Qwen3).
    pub qk_norm: bool,
    /// The attention and MLP outputs are RMS-normalised before joining the residual (Gemma 2's
    /// post-attention and post-feedforward norms).
    pub post_norms: bool,
    /// Embeddings are multiplied by this (Gemma: sqrt(hidden_size)).
    pub embed_scale: Option<f32>,
    /// The MLP's gate activation.
    pub activation: Activation,
    /// Attention scores are scaled by `query_scale^-1/2` instead of `head_dim^-1/2` (Gemma's
    /// `query_pre_attn_scalar`).
    pub query_scale: Option<f32>,
    /// Attention scores become `cap * tanh(score / cap)` (Gemma 2, `attn_logit_softcapping`).
    pub attn_softcap: Option<f32>,
    /// Logits become `cap * tanh(logit / cap)` (Gemma 2, `final_logit_softcapping`).
    pub final_softcap: Option<f32>,
    /// Layers that attend only to the most recent positions (Mistral, Phi-3, Gemma 2 and 3).
    pub sliding_window: Option<SlidingWindow>,
    /// Rotary base of the sliding-window layers, with plain frequencies, where it differs
    /// from the model's (Gemma 3's `rope_local_base_freq`; its global layers keep
    /// `rope_theta` and the scaling).
    pub local_rope_theta: Option<f32>,
    /// Rotary embeddings turn only the first `rotary_dim` values of each head; the rest pass
    /// unchanged (Phi-4-mini's `partial_rotary_factor`, GGUF's `rope.dimension_count` below
    /// the head width). `None`: the whole head.
    pub rotary_dim: Option<usize>,
    /// Mixture-of-experts MLPs in place of the dense one (Qwen3-MoE).
    pub moe: Option<MoeConfig>,
}

/// A mixture-of-experts MLP (Qwen3-MoE): a router picks `top_k` of `experts` gated MLPs of
/// width `ffn` per token, from a softmax over the router's logits; their outputs are summed
/// weighted by those probabilities (renormalised to sum to 1 when `norm_top_k`).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub experts: usize,
    pub top_k: usize,
    /// Width of each expert's MLP (`moe_intermediate_size`).
    pub ffn: usize,
    pub norm_top_k: bool,
    /// `layers[i]`: whether layer `i`'s MLP is the experts (the others keep the dense MLP
    /// of `intermediate_size`).
    pub layers: Vec<bool>,
}

/// Sliding-window attention: in the layers it names, a query at position `p` sees the keys
/// at `p - size + 1 ..= p` (transformers' `sliding_window`); the other layers see every
/// position. The cache keeps every position's K/V either way (a prompt's KV is shipped and
/// prefix-cached whole).
#[derive(Debug, Clone, PartialEq)]
pub struct SlidingWindow {
    /// Keys a query sees, itself included.
    pub size: usize,
    /// `layers[i]`: whether layer `i` slides.
    pub layers: Vec<bool>,
}

impl SlidingWindow {
    /// The window of layer `i` (`None`: the layer sees every position).
    pub fn of_layer(&self, i: usize) -> Option<usize> {
        self.layers.get(i).copied().unwrap_or(false).then_some(self.size)
    }
}

/// The activation of the MLP's gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activation {
    #[default]
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`, Gemma).
    GeluTanh,
}

impl ModelConfig {
    /// Checks the relations the forward pass relies on.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_position", self.max_position),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(EngineError::Metadata(format!("{name} must be positive")));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(EngineError::Metadata(format!(
                "num_heads ({}) must be a multiple of num_kv_heads ({})",
                self.num_heads, self.num_kv_heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(EngineError::Metadata(format!(
                "head_dim ({}) must be even for rotary embeddings",
                self.head_dim
            )));
        }
        if let Some(r) = self.parts.rotary_dim {
            if r == 0 || !r.is_multiple_of(2) || r > self.head_dim {
                return Err(EngineError::Metadata(format!(
                    "rotary dimensions ({r}) must be even, positive and at most head_dim ({})",
                    self.head_dim
                )));
            }
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(EngineError::Metadata(format!("rope_theta ({}) must be a positive number", self.rope_theta)));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(EngineError::Metadata(format!(
                "rms_norm_eps ({}) must be a positive number",
                self.rms_norm_eps
            )));
        }
        for (name, value) in [
            ("query_pre_attn_scalar", self.parts.query_scale),
            ("attn_logit_softcapping", self.parts.attn_softcap),
            ("final_logit_softcapping", self.parts.final_softcap),
            ("embedding scale", self.parts.embed_scale),
            ("rope_local_base_freq", self.parts.local_rope_theta),
        ] {
            if let Some(v) = value.filter(|v| !(v.is_finite() && *v > 0.0)) {
                return Err(EngineError::Metadata(format!("{name} ({v}) must be a positive number")));
            }
        }
        if let Some(w) = &self.parts.sliding_window {
            if w.size == 0 {
                return Err(EngineError::Metadata("sliding_window must be positive".into()));
            }
            if w.layers.len() != self.num_layers {
                return Err(EngineError::Metadata(format!(
                    "sliding-window layer list has {} entries for {} layers",
                    w.layers.len(),
                    self.num_layers
                )));
            }
        }
        if let Some(m) = &self.parts.moe {
            if m.experts == 0 || m.ffn == 0 || m.top_k == 0 || m.top_k > m.experts {
                return Err(EngineError::Metadata(format!(
                    "mixture of experts: {} of {} experts of width {} (each must be positive, top-k at most the experts)",
                    m.top_k, m.experts, m.ffn
                )));
            }
            if m.layers.len() != self.num_layers {
                return Err(EngineError::Metadata(format!(
                    "expert layer list has {} entries for {} layers",
                    m.layers.len(),
                    self.num_layers
                )));
            }
        }
        self.rope_scaling.validate()
    }

    /// Values of each head that rotary embeddings turn.
    pub fn rotary_dim(&self) -> usize {
        self.parts.rotary_dim.unwrap_or(self.head_dim)
    }

    /// Width of one token's K (or V) in one layer.
    pub fn kv_width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Bytes of K and V for one token over all layers at `bytes_per_value`.
    pub fn kv_bytes_per_token(&self, bytes_per_value: usize) -> usize {
        2 * self.num_layers * self.kv_width() * bytes_per_value
    }
}

/// Where the model's math runs. CUDA exists only with the `cuda` cargo feature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda(usize),
}

impl DeviceKind {
    /// The one place a candle device is created.
    pub fn to_device(self) -> Result<candle_core::Device> {
        match self {
            DeviceKind::Cpu => Ok(candle_core::Device::Cpu),
            DeviceKind::Cuda(ordinal) => {
                if cfg!(feature = "cuda") {
                    candle_core::Device::new_cuda(ordinal)
                        .map_err(|e| EngineError::Device { ordinal, reason: e.to_string() })
                } else {
                    Err(EngineError::Config("this build has no CUDA support; rebuild with `--features cuda`".into()))
                }
            }
        }
    }
}

impl std::str::FromStr for DeviceKind {
    type Err = EngineError;

    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" => Ok(DeviceKind::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceKind::Cuda)
                .ok_or_else(|| EngineError::Config(format!("device `{other}` is not cpu, cuda or cuda:N"))),
        }
    }
}

/// How weights are kept in memory after loading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// Dequantize to f32 and multiply with exact f32 activations: follows the checkpoint most
    /// closely; costs 4 bytes per weight of memory traffic in decode.
    F32,
    /// Dequantize to f16 (half the memory traffic of F32, and decode is bound by it) and widen
    /// to f32 for the arithmetic: only the weights are rounded, to 11
    /// significant bits, while activations stay f32 (Q8's 8-bit activation rounding flips
    /// near-ties). CPU only; on other devices it falls back to F32.
    F16,
    /// Re-quantize to Q8_0 so candle's SIMD quantized kernels apply: a quarter of the memory
    /// traffic of F32 in decode, but activations are rounded to 8 bits.
    Q8,
    /// Keep weights exactly as stored (llama.cpp-style numerics; Q4_1 has no SIMD kernel on x86).
    Stored,
    /// The default. Weight-only quantized: Q4_1 and Q8_0 tensors keep the file's own values
    /// (repacked losslessly: Q4_1 as nibbles with f32 scale and minimum, 0.75 bytes per
    /// weight; Q8_0 as bytes with an f32 scale) and are widened to f32 in registers;
    /// activations stay f32 (`matmul_wq`). Other block-quantized tensors (Q4_0, Q4_K, Q6_K,
    /// ...) keep their blocks and candle's kernels (as `Stored`: 8-bit activations); float
    /// tensors (f32, f16, bf16) become F16. CPU only; on other devices it falls back to F32.
    Wq,
}

impl std::str::FromStr for WeightFormat {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(WeightFormat::F32),
            "f16" => Ok(WeightFormat::F16),
            "q8" => Ok(WeightFormat::Q8),
            "stored" => Ok(WeightFormat::Stored),
            "wq" => Ok(WeightFormat::Wq),
            other => {
                Err(EngineError::Config(format!("weight format `{other}` is not one of f32, f16, q8, stored, wq")))
            }
        }
    }
}

/// Settings for loading a model.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    pub device: DeviceKind,
    pub weights: WeightFormat,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { device: DeviceKind::Cpu, weights: WeightFormat::Wq }
    }
}

/// Settings for the paged KV cache.
#[derive(Debug, Clone, Copy)]
pub struct CacheConfig {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the cache (memory = num_blocks * block_size * kv_bytes_per_token(dtype.size())).
    pub num_blocks: usize,
    /// Keep full blocks of finished prompts content-addressed for reuse (prefix caching).
    pub prefix_cache: bool,
    /// How K and V values are stored.
    pub dtype: KvCacheDType,
}

/// The element type of the KV cache. The arithmetic is f32 either way (values are widened as
/// attention reads them); f16 halves what decode attention reads per step and the cache's
/// memory, and equals what the KV wire carries by default, so a handed-off prompt decodes on
/// exactly the values its prefill worker computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDType {
    F32,
    #[default]
    F16,
}

impl KvCacheDType {
    pub fn size(self) -> usize {
        match self {
            KvCacheDType::F32 => 4,
            KvCacheDType::F16 => 2,
        }
    }

    pub(crate) fn dtype(self) -> candle_core::DType {
        match self {
            KvCacheDType::F32 => candle_core::DType::F32,
            KvCacheDType::F16 => candle_core::DType::F16,
        }
    }
}

impl std::str::FromStr for KvCacheDType {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(KvCacheDType::F32),
            "f16" => Ok(KvCacheDType::F16),
            other => Err(EngineError::Config(format!("KV cache dtype `{other}` is not f16 or f32"))),
        }
    }
}

impl CacheConfig {
    pub const DEFAULT_BLOCK_SIZE: usize = 16;

    /// A cache of `num_blocks` blocks of the default size.
    pub fn with_blocks(num_blocks: usize) -> Self {
        CacheConfig {
            block_size: Self::DEFAULT_BLOCK_SIZE,
            num_blocks,
            prefix_cache: true,
            dtype: KvCacheDType::default(),
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.block_size == 0 || self.num_blocks == 0 {
            return Err(EngineError::Config(format!(
                "block_size ({}) and num_blocks ({}) must be positive",
                self.block_size, self.num_blocks
            )));
        }
        Ok(())
    }
}

/// Sets the number of threads candle's matmul pool and rayon use. Call first thing in `main`,
/// before any model math: both pools read the setting once when they start.
pub fn set_compute_threads(threads: usize) -> Result<()> {
    if threads == 0 {
        return Err(EngineError::Config("threads must be at least 1".into()));
    }
    // Sound here: called at process start before other threads exist (edition 2021 API).
    std::env::set_var("CANDLE_NUM_THREADS", threads.to_string());
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    Ok(())
}
