//! pd-engine: inference for Llama-style decoders (Llama 3.x, Mistral, Qwen2/2.5, Qwen3 and
//! Qwen3-MoE, Phi-3, Gemma 2 and 3) on candle for a disaggregated server.
//!
//! What it gives the workers: a model whose KV cache is external and paged (`kv`), a forward
//! pass that batches prefill chunks and decode steps of sequences at different positions
//! (`model`), KV export/import as bytes with a compatibility header (`kv::export`), the
//! tokenizer and chat template of the checkpoint, and sampling with stop conditions.
//! No async runtime and no networking live here.

mod activation;
pub mod alloc;
mod attention;
pub mod chat;
pub mod config;
pub mod constraint;
#[cfg(feature = "cuda")]
mod cuda;
mod embedding;
pub mod engine;
pub mod error;
pub mod kv;
pub mod loader;
mod matmul;
mod matmul_wq;
pub mod model;
mod moe;
pub mod profile;
pub mod rope;
pub mod sampling;
mod simd;
pub mod tokenizer;

pub use chat::{json_dumps, ChatMessage, ChatTemplate, RESERVED_TEMPLATE_VARIABLES};
pub use config::{
    set_compute_threads, Activation, CacheConfig, DecoderParts, DeviceKind, KvCacheDType, LoadOptions, ModelConfig,
    MoeConfig, RopeScaling, RopeStyle, SlidingWindow, WeightFormat,
};
pub use constraint::OutputConstraint;
pub use engine::{load_model, load_text_side, Engine, Generation, LoadedModel, TextSide};
pub use error::{EngineError, Result};
pub use kv::blocks::{BlockAllocation, BlockId, BlockManager};
pub use kv::cache::{KvCache, SequenceKv};
pub use kv::export::{KvHeader, WireDType};
pub use kv::prefix::{BlockEvent, BlockEventKind, BlockHash, EventsSince};
pub use model::{BatchSeq, Model};
pub use sampling::{
    token_logprobs, FinishReason, OutputTracker, Sampled, Sampler, SamplingParams, TokenLogprobs, TokenOutput,
    MAX_TOP_LOGPROBS,
};
pub use tokenizer::Tokenizer;

/// The vector kernels this process runs (`avx512` or `avx2`; `PD_ENGINE_SIMD=avx2` forces
/// the latter), for benchmark reports and startup logs.
pub fn simd_level() -> &'static str {
    match simd::level() {
        simd::Level::Avx2 => "avx2",
        simd::Level::Avx512 => "avx512",
    }
}
