//! GGUF checkpoints: container checks (truncation), Llama hyperparameters from metadata,
//! tensors on demand, tokenizer and chat template from the file's own metadata.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::Device;

use super::{RawTensor, TensorSource};
use crate::config::{ModelConfig, RopeStyle};
use crate::error::{EngineError, Result};

/// An open GGUF file whose tensor data was checked to be all there.
pub struct GgufFile {
    path: PathBuf,
    reader: BufReader<File>,
    content: Content,
    device: Device,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GgufFile({})", self.path.display())
    }
}

impl GgufFile {
    pub fn open(path: &Path, device: &Device) -> Result<Self> {
        let io = |source| EngineError::Io { path: path.to_path_buf(), source };
        let invalid = |reason: String| EngineError::InvalidGguf { path: path.to_path_buf(), reason };
        let file = File::open(path).map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| invalid(format!("header: {e}")))?;
        for (name, info) in &content.tensor_infos {
            let elems = info.shape.elem_count();
            let block = info.ggml_dtype.block_size();
            if elems % block != 0 {
                return Err(invalid(format!("tensor `{name}` has {elems} values, not whole blocks of {block}")));
            }
            let bytes = (elems / block * info.ggml_dtype.type_size()) as u64;
            let end = content.tensor_data_offset + info.offset + bytes;
            if end > file_len {
                return Err(invalid(format!("truncated: tensor `{name}` ends at byte {end}, the file has {file_len}")));
            }
        }
        Ok(GgufFile { path: path.to_path_buf(), reader, content, device: device.clone() })
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// Llama hyperparameters from `{arch}.*` keys.
    pub fn model_config(&self) -> Result<ModelConfig> {
        let md = &self.content.metadata;
        let arch = md
            .get("general.architecture")
            .ok_or_else(|| EngineError::Metadata("no `general.architecture`".into()))?
            .to_string()
            .map_err(|e| EngineError::Metadata(format!("`general.architecture`: {e}")))?
            .clone();
        if arch != "llama" {
            return Err(EngineError::UnsupportedArchitecture(arch));
        }
        let value = |key: &str| {
            md.get(&format!("{arch}.{key}")).ok_or_else(|| EngineError::Metadata(format!("no `{arch}.{key}`")))
        };
        let int = |key: &str| -> Result<usize> {
            let v = value(key)?;
            v.to_u32()
                .map(|x| x as usize)
                .or_else(|_| v.to_u64().map(|x| x as usize))
                .map_err(|e| EngineError::Metadata(format!("`{arch}.{key}`: {e}")))
        };
        let float = |key: &str| -> Result<f32> {
            value(key)?.to_f32().map_err(|e| EngineError::Metadata(format!("`{arch}.{key}`: {e}")))
        };
        let hidden_size = int("embedding_length")?;
        let num_heads = int("attention.head_count")?;
        if num_heads == 0 {
            return Err(EngineError::Metadata("attention.head_count must be positive".into()));
        }
        let vocab_size = match int("vocab_size") {
            Ok(v) => v,
            Err(_) => md
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.to_vec().ok())
                .map(Vec::len)
                .ok_or_else(|| EngineError::Metadata("no vocab size and no tokenizer tokens".into()))?,
        };
        let config = ModelConfig {
            vocab_size,
            hidden_size,
            intermediate_size: int("feed_forward_length")?,
            num_layers: int("block_count")?,
            num_heads,
            num_kv_heads: int("attention.head_count_kv").unwrap_or(num_heads),
            head_dim: int("rope.dimension_count").unwrap_or(hidden_size / num_heads),
            max_position: int("context_length")?,
            rope_theta: float("rope.freq_base").unwrap_or(10_000.0),
            rms_norm_eps: float("attention.layer_norm_rms_epsilon")? as f64,
            rope_style: RopeStyle::Interleaved,
        };
        config.validate()?;
        Ok(config)
    }

    /// The chat template stored in the file, if any.
    pub fn chat_template(&self) -> Option<String> {
        self.content.metadata.get("tokenizer.chat_template").and_then(|v| v.to_string().ok()).cloned()
    }
}

impl TensorSource for GgufFile {
    fn take(&mut self, name: &str) -> Result<Option<RawTensor>> {
        if !self.content.tensor_infos.contains_key(name) {
            return Ok(None);
        }
        let t = self.content.tensor(&mut self.reader, name, &self.device).map_err(|e| EngineError::InvalidGguf {
            path: self.path.clone(),
            reason: format!("tensor `{name}`: {e}"),
        })?;
        Ok(Some(RawTensor::Quant(t)))
    }
}
