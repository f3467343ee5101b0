//! Hugging Face model folders of the Llama family: config.json, tokenizer.json,
//! tokenizer_config.json (chat template, optional) and *.safetensors.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::Deserialize;

use super::{RawTensor, TensorSource};
use crate::config::{ModelConfig, RopeStyle};
use crate::error::{EngineError, Result};

/// The config.json fields the engine reads.
#[derive(Debug, Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: usize,
    rope_theta: Option<f32>,
    rms_norm_eps: f64,
    bos_token_id: Option<u32>,
    eos_token_id: Option<EosIds>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum EosIds {
    One(u32),
    Many(Vec<u32>),
}

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

impl HfFolder {
    pub fn open(path: &Path, device: &Device) -> Result<Self> {
        let config_path = path.join("config.json");
        if !config_path.is_file() {
            return Err(folder_err(path, "no config.json"));
        }
        let text = std::fs::read_to_string(&config_path)
            .map_err(|source| EngineError::Io { path: config_path.clone(), source })?;
        let config: HfConfig =
            serde_json::from_str(&text).map_err(|e| folder_err(path, format!("config.json: {e}")))?;
        let llama = config.architectures.iter().any(|a| a == "LlamaForCausalLM")
            || config.model_type.as_deref() == Some("llama");
        if !llama {
            let arch = config
                .architectures
                .first()
                .cloned()
                .or_else(|| config.model_type.clone())
                .unwrap_or_else(|| "unknown".into());
            return Err(EngineError::UnsupportedArchitecture(arch));
        }
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
        Ok(HfFolder { path: path.to_path_buf(), config, tensors })
    }

    pub fn model_config(&self) -> Result<ModelConfig> {
        let c = &self.config;
        let config = ModelConfig {
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_layers: c.num_hidden_layers,
            num_heads: c.num_attention_heads,
            num_kv_heads: c.num_key_value_heads.unwrap_or(c.num_attention_heads),
            head_dim: c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads.max(1)),
            max_position: c.max_position_embeddings,
            rope_theta: c.rope_theta.unwrap_or(10_000.0),
            rms_norm_eps: c.rms_norm_eps,
            rope_style: RopeStyle::Halves,
        };
        config.validate()?;
        Ok(config)
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

/// Hugging Face name of a GGUF tensor name.
fn hf_name(gguf: &str) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let part = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{part}"))
}

impl TensorSource for HfFolder {
    fn take(&mut self, name: &str) -> Result<Option<RawTensor>> {
        let Some(hf) = hf_name(name) else { return Ok(None) };
        match self.tensors.remove(&hf) {
            Some(t) => Ok(Some(RawTensor::Dense(t))),
            // Report the name as the folder spells it.
            None if name != "output.weight" => Err(EngineError::MissingTensor(hf)),
            None => Ok(None),
        }
    }
}
