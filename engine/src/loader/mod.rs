//! Reading checkpoints: GGUF files (`gguf`) and Hugging Face folders (`hf`). Both hand the
//! model builder tensors under GGUF's names through `TensorSource`, plus a `ModelConfig`,
//! a tokenizer and an optional chat template.

pub mod gguf;
pub mod hf;
mod hf_config;

pub use hf_config::Family;

use std::path::Path;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use crate::config::ModelConfig;
use crate::error::Result;

/// A checkpoint's model config without its weights, for planning (`pd-bench roofline`): a
/// GGUF file (its header), a Hugging Face folder or a config.json alone. Also whether the
/// output projection is the token embedding table (tied).
pub fn read_config(path: &Path) -> Result<(ModelConfig, bool)> {
    if path.is_file() && path.extension().is_some_and(|e| e == "gguf") {
        let file = gguf::GgufFile::open(path, &Device::Cpu)?;
        return Ok((file.model_config()?, !file.contains("output.weight")));
    }
    hf::config_only(&if path.is_dir() { path.join("config.json") } else { path.to_path_buf() })
}

/// A weight as stored: block-quantized or dense. (One per weight, only while loading: the
/// size gap between the variants, wide with CUDA storage, costs nothing worth a box.)
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum RawTensor {
    Quant(QTensor),
    Dense(Tensor),
}

impl RawTensor {
    pub fn dims(&self) -> Vec<usize> {
        match self {
            RawTensor::Quant(q) => q.shape().dims().to_vec(),
            RawTensor::Dense(t) => t.dims().to_vec(),
        }
    }

    /// The weight as f32 on its device.
    pub fn dequantize(&self) -> Result<Tensor> {
        Ok(match self {
            RawTensor::Quant(q) => q.dequantize(&q.device())?,
            RawTensor::Dense(t) => t.to_dtype(candle_core::DType::F32)?,
        })
    }
}

/// Hands out a checkpoint's tensors by their GGUF names (`blk.0.attn_q.weight`, ...).
pub trait TensorSource {
    /// The tensor, or `None` when the checkpoint does not have it.
    fn take(&mut self, name: &str) -> Result<Option<RawTensor>>;

    /// Whether the checkpoint has the tensor (for layouts that store some weights fused:
    /// Phi-3's Q/K/V and gate/up projections).
    fn contains(&self, name: &str) -> bool;

    /// Tensors of the checkpoint no `take` asked for (after loading: the model as configured
    /// does not use them, which means a setting the engine does not read).
    fn unused(&self) -> Vec<String> {
        Vec::new()
    }
}
