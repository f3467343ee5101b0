//! Hugging Face model folders (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Phi-3, Gemma 2,
//! Gemma 3, and the language model of Gemma 3's multimodal checkpoints):
//! config.json, tokenizer.json, tokenizer_config.json (chat template, optional) and
//! *.safetensors.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use super::hf_config::{language_config, EosIds, HfConfig};
use super::{RawTensor, TensorSource};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};

/// A model folder with its tensors loaded.
#[derive(Debug)]
pub struct HfFolder {
    pub path: PathBuf,
    config: HfConfig,
    tensors: HashMap<String, Tensor>,
}

fn folder_err(path: &Path, reason: impl Into<String>) -> EngineError {
    EngineError::ModelFolder { path: path.to_path_buf(), reason: reason.into() }
}

/// A config.json (`path`, in `folder`): the language model's config and whether the
/// checkpoint is multimodal.
fn read_config(folder: &Path, path: &Path) -> Result<(HfConfig, bool)> {
    if !path.is_file() {
        return Err(folder_err(folder, "no config.json"));
    }
    let text = std::fs::read_to_string(path).map_err(|source| EngineError::Io { path: path.to_path_buf(), source })?;
    let raw: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| folder_err(folder, format!("config.json: {e}")))?;
    let (raw, multimodal) = language_config(raw)?;
    let config: HfConfig = serde_json::from_value(raw).map_err(|e| folder_err(folder, format!("config.json: {e}")))?;
    config.family()?;
    Ok((config, multimodal))
}

/// The model config of a config.json alone (no weights), and whether the output projection
/// is the embedding table: for planning a model pd serves without downloading it.
pub fn config_only(path: &Path) -> Result<(ModelConfig, bool)> {
    let folder = path.parent().unwrap_or(path);
    let (config, _) = read_config(folder, path)?;
    Ok((config.model_config()?, config.tied_embeddings()))
}

impl HfFolder {
    pub fn open(path: &Path, device: &Device) -> Result<Self> {
        let (config, multimodal) = read_config(path, &path.join("config.json"))?;
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|source| EngineError::Io { path: path.to_path_buf(), source })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(folder_err(path, "no *.safetensors files"));
        }
        let mut tensors = HashMap::new();
        for file in &files {
            let loaded = candle_core::safetensors::load(file, device)
                .map_err(|e| folder_err(path, format!("{}: {e}", file.display())))?;
            tensors.extend(loaded);
        }
        if multimodal {
            tensors = language_model_tensors(tensors);
        }
        Ok(HfFolder { path: path.to_path_buf(), config, tensors })
    }

    pub fn model_config(&self) -> Result<ModelConfig> {
        self.config.model_config()
    }

    pub fn eos_ids(&self) -> Vec<u32> {
        match &self.config.eos_token_id {
            Some(EosIds::One(id)) => vec![*id],
            Some(EosIds::Many(ids)) => ids.clone(),
            None => Vec::new(),
        }
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.config.bos_token_id
    }

    /// Path of tokenizer.json, which must exist.
    pub fn tokenizer_path(&self) -> Result<PathBuf> {
        let p = self.path.join("tokenizer.json");
        if p.is_file() {
            Ok(p)
        } else {
            Err(folder_err(&self.path, "no tokenizer.json"))
        }
    }

    /// `chat_template` from tokenizer_config.json (a string, or the one named "default").
    pub fn chat_template(&self) -> Result<Option<String>> {
        let p = self.path.join("tokenizer_config.json");
        if !p.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&p).map_err(|source| EngineError::Io { path: p.clone(), source })?;
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| folder_err(&self.path, format!("tokenizer_config.json: {e}")))?;
        Ok(match value.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(items)) => items
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string),
            _ => None,
        })
    }
}

/// A multimodal checkpoint's language model under the names of a text-only one: transformers
/// 4's `language_model.model.*` / `language_model.lm_head.*` (the files on the Hub) or 5's
/// `model.language_model.*`. The vision tower and projector are dropped: pd serves text
/// (the router refuses image content parts by name).
fn language_model_tensors(tensors: HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    let vision = ["vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector."];
    tensors
        .into_iter()
        .filter(|(name, _)| !vision.iter().any(|v| name.starts_with(v)))
        .map(|(name, t)| {
            let renamed = if let Some(rest) = name.strip_prefix("language_model.model.") {
                format!("model.{rest}")
            } else if let Some(rest) = name.strip_prefix("model.language_model.") {
                format!("model.{rest}")
            } else if let Some(rest) = name.strip_prefix("language_model.") {
                rest.to_string()
            } else {
                name
            };
            (renamed, t)
        })
        .collect()
}

/// Hugging Face name of a GGUF tensor name; `gemma`: Gemma's four norms per layer (its
/// `post_attention_layernorm` follows attention, `pre_feedforward_layernorm` is Llama's).
fn hf_name(gguf: &str, gemma: bool) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        "rope_freqs.weight" => return None,
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let part = match (part, gemma) {
        ("ffn_norm.weight", true) => "pre_feedforward_layernorm.weight",
        ("post_attention_norm.weight", true) => "post_attention_layernorm.weight",
        ("post_ffw_norm.weight", true) => "post_feedforward_layernorm.weight",
        (part, _) => match part {
            "attn_norm.weight" => "input_layernorm.weight",
            "attn_q.weight" => "self_attn.q_proj.weight",
            "attn_k.weight" => "self_attn.k_proj.weight",
            "attn_v.weight" => "self_attn.v_proj.weight",
            "attn_output.weight" => "self_attn.o_proj.weight",
            "attn_q.bias" => "self_attn.q_proj.bias",
            "attn_k.bias" => "self_attn.k_proj.bias",
            "attn_v.bias" => "self_attn.v_proj.bias",
            "attn_qkv.weight" => "self_attn.qkv_proj.weight",
            "ffn_gate_up.weight" => "mlp.gate_up_proj.weight",
            "attn_q_norm.weight" => "self_attn.q_norm.weight",
            "attn_k_norm.weight" => "self_attn.k_norm.weight",
            "ffn_norm.weight" => "post_attention_layernorm.weight",
            "ffn_gate.weight" => "mlp.gate_proj.weight",
            "ffn_up.weight" => "mlp.up_proj.weight",
            "ffn_down.weight" => "mlp.down_proj.weight",
            "ffn_gate_inp.weight" => "mlp.gate.weight",
            _ => return None,
        },
    };
    Some(format!("model.layers.{layer}.{part}"))
}

/// A GGUF name of stacked experts (`blk.N.ffn_{gate,up,down}_exps.weight`) as the Hugging
/// Face name of expert `{e}`'s matrix, with `{e}` to fill in.
fn expert_names(gguf: &str) -> Option<String> {
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let proj = match part {
        "ffn_gate_exps.weight" => "gate_proj",
        "ffn_up_exps.weight" => "up_proj",
        "ffn_down_exps.weight" => "down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.mlp.experts.{{e}}.{proj}.weight"))
}

impl HfFolder {
    /// The experts' matrices (one per expert in the folder, as the Hub's Qwen3-MoE files and
    /// transformers' `save_pretrained` store them) stacked as `[experts, rows, k]`.
    fn take_experts(&mut self, pattern: &str) -> Result<Option<RawTensor>> {
        let mut parts = Vec::new();
        while let Some(t) = self.tensors.remove(&pattern.replace("{e}", &parts.len().to_string())) {
            parts.push(t);
        }
        if parts.is_empty() {
            return Err(EngineError::MissingTensor(pattern.replace("{e}", "0")));
        }
        Ok(Some(RawTensor::Dense(Tensor::stack(&parts, 0)?)))
    }
}

impl TensorSource for HfFolder {
    fn take(&mut self, name: &str) -> Result<Option<RawTensor>> {
        if let Some(pattern) = expert_names(name) {
            return self.take_experts(&pattern);
        }
        let Some(hf) = hf_name(name, self.config.norm_offset()) else { return Ok(None) };
        let tied = name == "output.weight" && self.config.tied_embeddings();
        match self.tensors.remove(&hf) {
            // A tied checkpoint that also stores the copy: the embedding is what the model uses.
            Some(_) if tied => Ok(None),
            // Gemma computes x * (1 + w) (llama.cpp's converter stores 1 + w in GGUF files).
            Some(t) if self.config.norm_offset() && name.ends_with("norm.weight") => {
                Ok(Some(RawTensor::Dense((t.to_dtype(candle_core::DType::F32)? + 1.0)?)))
            }
            Some(t) => Ok(Some(RawTensor::Dense(t))),
            None if tied => Ok(None),
            // Report the name as the folder spells it.
            None => Err(EngineError::MissingTensor(hf)),
        }
    }

    fn contains(&self, name: &str) -> bool {
        if let Some(pattern) = expert_names(name) {
            return self.tensors.contains_key(&pattern.replace("{e}", "0"));
        }
        hf_name(name, self.config.norm_offset()).is_some_and(|hf| self.tensors.contains_key(&hf))
    }

    fn unused(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort();
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_multimodal_checkpoints_language_model_is_read_under_either_naming() {
        let t = Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu).expect("tensor");
        let names = [
            "language_model.model.layers.0.mlp.up_proj.weight",
            "model.language_model.norm.weight",
            "language_model.lm_head.weight",
            "vision_tower.vision_model.embeddings.patch_embedding.weight",
            "model.vision_tower.vision_model.post_layernorm.weight",
            "multi_modal_projector.mm_input_projection_weight",
        ];
        let tensors = names.iter().map(|n| (n.to_string(), t.clone())).collect();
        let mut kept: Vec<String> = language_model_tensors(tensors).into_keys().collect();
        kept.sort();
        assert_eq!(kept, ["lm_head.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]);
    }
}
