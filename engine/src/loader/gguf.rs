//! GGUF checkpoints: container checks (truncation), hyperparameters of the llama, qwen2 and
//! qwen3 architectures from metadata (llama.cpp's keys),
//! tensors on demand, tokenizer and chat template from the file's own metadata.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::Device;

use super::{RawTensor, TensorSource};
use crate::config::{DecoderParts, ModelConfig, RopeScaling, RopeStyle};
use crate::error::{EngineError, Result};

/// An open GGUF file whose tensor data was checked to be all there.
pub struct GgufFile {
    path: PathBuf,
    reader: BufReader<File>,
    content: Content,
    device: Device,
    taken: HashSet<String>,
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
        Ok(GgufFile { path: path.to_path_buf(), reader, content, device: device.clone(), taken: HashSet::new() })
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// Hyperparameters from `{arch}.*` keys. Mistral's files use the llama architecture;
    /// llama.cpp stores their Q and K permuted for interleaved rotary pairs, Qwen's not.
    pub fn model_config(&self) -> Result<ModelConfig> {
        let md = &self.content.metadata;
        let arch = md
            .get("general.architecture")
            .ok_or_else(|| EngineError::Metadata("no `general.architecture`".into()))?
            .to_string()
            .map_err(|e| EngineError::Metadata(format!("`general.architecture`: {e}")))?
            .clone();
        let (rope_style, qkv_bias, qk_norm) = match arch.as_str() {
            "llama" => (RopeStyle::Interleaved, false, false),
            "qwen2" => (RopeStyle::Halves, true, false),
            "qwen3" => (RopeStyle::Halves, false, true),
            "phi3" => (RopeStyle::Halves, false, false),
            _ => return Err(EngineError::UnsupportedArchitecture(arch)),
        };
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
        // Qwen3's heads are wider than hidden / heads: llama.cpp stores `attention.key_length`.
        let head_dim =
            int("attention.key_length").or_else(|_| int("rope.dimension_count")).unwrap_or(hidden_size / num_heads);
        if let Ok(rotary) = int("rope.dimension_count") {
            if rotary != head_dim {
                return Err(EngineError::UnsupportedSetting {
                    field: format!("{arch}.rope.dimension_count"),
                    reason: format!("{rotary} of {head_dim} values per head (partial rotary)"),
                });
            }
        }
        let config = ModelConfig {
            vocab_size,
            hidden_size,
            intermediate_size: int("feed_forward_length")?,
            num_layers: int("block_count")?,
            num_heads,
            num_kv_heads: int("attention.head_count_kv").unwrap_or(num_heads),
            head_dim,
            max_position: int("context_length")?,
            rope_theta: float("rope.freq_base").unwrap_or(10_000.0),
            rms_norm_eps: float("attention.layer_norm_rms_epsilon")? as f64,
            rope_style,
            rope_scaling: self.rope_scaling(&arch)?,
            parts: DecoderParts { qkv_bias, qk_norm, ..Default::default() },
        };
        config.validate()?;
        Ok(config)
    }

    /// `{arch}.rope.scaling.*`: none or linear. Llama 3.1's scheme comes as the
    /// `rope_freqs` tensor, which the model reads; YaRN and others are refused by name.
    fn rope_scaling(&self, arch: &str) -> Result<RopeScaling> {
        let md = &self.content.metadata;
        let key = |k: &str| format!("{arch}.rope.scaling.{k}");
        let kind = match md.get(&key("type")) {
            Some(v) => v.to_string().map_err(|e| EngineError::Metadata(format!("`{}`: {e}", key("type"))))?.clone(),
            None => "none".to_string(),
        };
        let factor = md
            .get(&key("factor"))
            .or_else(|| md.get(&format!("{arch}.rope.scale_linear")))
            .map(|v| v.to_f32().map_err(|e| EngineError::Metadata(format!("`{}`: {e}", key("factor")))))
            .transpose()?;
        match (kind.as_str(), factor) {
            ("none", _) => Ok(RopeScaling::None),
            ("linear", Some(1.0)) => Ok(RopeScaling::None),
            ("linear", Some(factor)) => Ok(RopeScaling::Linear { factor }),
            ("linear", None) => Err(EngineError::Metadata(format!("`{}` is linear without a factor", key("type")))),
            (other, _) => Err(EngineError::UnsupportedSetting {
                field: key("type"),
                reason: format!("`{other}` (none and linear are implemented)"),
            }),
        }
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
        self.taken.insert(name.to_string());
        Ok(Some(RawTensor::Quant(t)))
    }

    fn contains(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    fn unused(&self) -> Vec<String> {
        let mut names: Vec<String> =
            self.content.tensor_infos.keys().filter(|n| !self.taken.contains(*n)).cloned().collect();
        names.sort();
        names
    }
}
