//! GGUF checkpoints: container checks (truncation), hyperparameters of the llama, qwen2,
//! qwen3, phi3, gemma2 and gemma3 architectures from metadata (llama.cpp's keys, and its
//! fixed rules where the converter writes none),
//! tensors on demand, tokenizer and chat template from the file's own metadata.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::Device;

use super::{RawTensor, TensorSource};
use crate::config::{Activation, DecoderParts, ModelConfig, MoeConfig, RopeScaling, RopeStyle, SlidingWindow};
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
    /// Gemma's norms are stored as 1 + w, so they load as plain norms.
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
            "qwen3" | "qwen3moe" | "gemma3" => (RopeStyle::Halves, false, true),
            "phi3" | "gemma2" => (RopeStyle::Halves, false, false),
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
        // Qwen3's heads are wider than hidden / heads: llama.cpp stores `attention.key_length`
        // (older files only a wider `rope.dimension_count`). Phi-4-mini rotates 3/4 of each
        // head: `rope.dimension_count` below the head width.
        let rotary = int("rope.dimension_count").ok();
        let head_dim = int("attention.key_length")
            .ok()
            .or(rotary.filter(|&r| r > hidden_size / num_heads))
            .unwrap_or(hidden_size / num_heads);
        let rotary_dim = match rotary {
            Some(r) if r < head_dim && arch == "phi3" => Some(r),
            Some(r) if r != head_dim => {
                return Err(EngineError::UnsupportedSetting {
                    field: format!("{arch}.rope.dimension_count"),
                    reason: format!("{r} of {head_dim} values per head (partial rotary: phi3 files only)"),
                });
            }
            _ => None,
        };
        let num_layers = int("block_count")?;
        let window_key = format!("{arch}.attention.sliding_window");
        let window = if md.contains_key(&window_key) { Some(int("attention.sliding_window")?) } else { None };
        let sliding_window = sliding_layers(&arch, num_layers, window)?;
        let parts = if arch.starts_with("gemma") {
            let has = |key: &str| md.contains_key(&format!("{arch}.{key}"));
            let cap = |key: &str, default: Option<f32>| -> Result<Option<f32>> {
                Ok(if has(key) { Some(float(key)?).filter(|&c| c != 0.0) } else { default })
            };
            let (attn_softcap, final_softcap) = match arch.as_str() {
                // llama.cpp's values where a Gemma 2 file has no caps.
                "gemma2" => (cap("attn_logit_softcapping", Some(50.0))?, cap("final_logit_softcapping", Some(30.0))?),
                _ => (cap("attn_logit_softcapping", None)?, cap("final_logit_softcapping", None)?),
            };
            DecoderParts {
                qk_norm,
                post_norms: true,
                embed_scale: Some((hidden_size as f32).sqrt()),
                activation: Activation::GeluTanh,
                query_scale: gemma_query_scale(&arch, num_layers, hidden_size, num_heads),
                attn_softcap,
                final_softcap,
                // llama.cpp: Gemma 3's local layers rotate with base 10000 (or the file's
                // `rope.freq_base_swa`) and no scaling; Gemma 2's as its global ones.
                local_rope_theta: match arch.as_str() {
                    "gemma3" => Some(if has("rope.freq_base_swa") { float("rope.freq_base_swa")? } else { 10_000.0 }),
                    _ => None,
                },
                sliding_window,
                ..Default::default()
            }
        } else {
            // llama.cpp's qwen3moe: every layer's MLP is the experts, the chosen weights
            // renormalised (`expert_weights_norm`, where a file says otherwise).
            let moe = match arch.as_str() {
                "qwen3moe" => Some(MoeConfig {
                    experts: int("expert_count")?,
                    top_k: int("expert_used_count")?,
                    ffn: int("expert_feed_forward_length")?,
                    norm_top_k: match md.get(&format!("{arch}.expert_weights_norm")) {
                        Some(v) => v
                            .to_bool()
                            .map_err(|e| EngineError::Metadata(format!("`{arch}.expert_weights_norm`: {e}")))?,
                        None => true,
                    },
                    layers: vec![true; num_layers],
                }),
                _ => None,
            };
            DecoderParts { qkv_bias, qk_norm, sliding_window, rotary_dim, moe, ..Default::default() }
        };
        let default_theta = if arch == "gemma3" { 1_000_000.0 } else { 10_000.0 };
        let config = ModelConfig {
            vocab_size,
            hidden_size,
            intermediate_size: int("feed_forward_length")?,
            num_layers,
            num_heads,
            num_kv_heads: int("attention.head_count_kv").unwrap_or(num_heads),
            head_dim,
            max_position: int("context_length")?,
            rope_theta: float("rope.freq_base").unwrap_or(default_theta),
            rms_norm_eps: float("attention.layer_norm_rms_epsilon")? as f64,
            rope_style,
            rope_scaling: self.rope_scaling(&arch, int("context_length")?)?,
            parts,
        };
        config.validate()?;
        Ok(config)
    }

    /// `{arch}.rope.scaling.*`: none or linear. Llama 3.1's scheme comes as the
    /// `rope_freqs` tensor, which the model reads; YaRN and others are refused by name.
    /// LongRoPE (phi3 files with `rope_factors_long`/`short` tensors): the original context
    /// and attention factor from metadata, the factor lists left for the model to read.
    fn rope_scaling(&self, arch: &str, context: usize) -> Result<RopeScaling> {
        let md = &self.content.metadata;
        let key = |k: &str| format!("{arch}.rope.scaling.{k}");
        if self.content.tensor_infos.contains_key("rope_factors_long.weight") {
            let number = |k: &str| -> Result<Option<f32>> {
                md.get(&key(k))
                    .map(|v| {
                        v.to_f32()
                            .or_else(|_| v.to_u32().map(|x| x as f32))
                            .or_else(|_| v.to_u64().map(|x| x as f32))
                            .map_err(|e| EngineError::Metadata(format!("`{}`: {e}", key(k))))
                    })
                    .transpose()
            };
            let original_max = number("original_context_length")?.ok_or_else(|| {
                EngineError::Metadata(format!("LongRoPE factors without `{}`", key("original_context_length")))
            })? as usize;
            let attention_factor = match number("attn_factor")? {
                Some(a) => a,
                None => RopeScaling::longrope_attention(context as f32 / original_max as f32, original_max),
            };
            return Ok(RopeScaling::LongRope { short: Vec::new(), long: Vec::new(), original_max, attention_factor });
        }
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

/// The layers of a file that attend within `window` (`{arch}.attention.sliding_window`):
/// every layer of a Phi-3 file; Gemma's by llama.cpp's fixed pattern (layer `i` slides when
/// `i % n < n - 1`: Gemma 2 every other layer from the first, Gemma 3 five in six). In other
/// architectures the key would be a setting this reader ignores: refused.
fn sliding_layers(arch: &str, num_layers: usize, window: Option<usize>) -> Result<Option<SlidingWindow>> {
    let Some(size) = window.filter(|&w| w > 0) else { return Ok(None) };
    let pattern = match arch {
        "phi3" => 1,
        "gemma2" => 2,
        "gemma3" => 6,
        _ => {
            return Err(EngineError::UnsupportedSetting {
                field: format!("{arch}.attention.sliding_window"),
                reason: "sliding-window layers in this architecture's files".into(),
            })
        }
    };
    let layers = (0..num_layers).map(|i| pattern == 1 || i % pattern < pattern - 1).collect();
    Ok(Some(SlidingWindow { size, layers }))
}

/// The query scale of a Gemma file, which the converter does not store: llama.cpp scales by
/// `(hidden / heads)^-1/2` for the 27B models (46 layers in Gemma 2, 62 in Gemma 3, whose
/// `query_pre_attn_scalar` is that) and by head_dim^-1/2 (the kernels' own) otherwise.
fn gemma_query_scale(arch: &str, num_layers: usize, hidden: usize, heads: usize) -> Option<f32> {
    match (arch, num_layers) {
        ("gemma2", 46) | ("gemma3", 62) => Some((hidden / heads) as f32),
        _ => None,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sliding_layers_follow_llama_cpp_patterns() {
        let layers = |arch, n| sliding_layers(arch, n, Some(512)).expect("known").expect("a window").layers;
        assert_eq!(layers("phi3", 3), vec![true; 3]);
        assert_eq!(layers("gemma2", 4), vec![true, false, true, false]);
        assert_eq!(layers("gemma3", 7), vec![true, true, true, true, true, false, true]);
        assert!(sliding_layers("gemma3", 7, Some(0)).expect("no window").is_none());
        let err = sliding_layers("llama", 2, Some(512)).expect_err("refused").to_string();
        assert!(err.contains("llama.attention.sliding_window"), "{err}");
        assert_eq!(gemma_query_scale("gemma3", 62, 5376, 32), Some(168.0));
        assert_eq!(gemma_query_scale("gemma3", 26, 1152, 4), None);
    }
}
