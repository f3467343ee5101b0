//! config.json of the families the engine runs, read into a `ModelConfig`: which family,
//! which rotary scheme, which optional parts (Q/K/V biases, Q/K norms, sliding-window
//! layers and their rotary base), and a refusal that
//! names every setting that would change the math in a way the engine does not implement.
//! Unknown keys that do not change the output (dropout, initializer ranges, dtype) are
//! left alone; the list of refused ones is what the other families' configs use.

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::config::{Activation, DecoderParts, ModelConfig, MoeConfig, RopeScaling, RopeStyle, SlidingWindow};
use crate::error::{EngineError, Result};

/// The decoder families a folder may hold (all in Llama's layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    /// Phi-3 / Phi-3.5 mini: Llama's math with Q/K/V and gate/up stored fused.
    Phi3,
    /// Gemma 2: (1 + w) norms, norms after attention and MLP too, scaled embeddings, GELU,
    /// soft-capped attention scores and logits, alternating sliding-window layers.
    Gemma2,
    /// Gemma 3 text: Gemma 2's layout with Q/K norms, five sliding-window layers in six
    /// with a rotary base of their own, and (usually) no soft-capping.
    Gemma3,
    /// Qwen3-MoE: Qwen3's attention, mixture-of-experts MLPs (`moe.rs`).
    Qwen3Moe,
}

impl Family {
    /// Gemma's conventions: (1 + w) norms, tied embeddings by default, GELU, Gemma's keys.
    fn is_gemma(self) -> bool {
        matches!(self, Family::Gemma2 | Family::Gemma3)
    }
}

impl Family {
    fn of(architectures: &[String], model_type: Option<&str>) -> Result<Family> {
        let by_type = match model_type {
            Some("llama") => Some(Family::Llama),
            Some("mistral") => Some(Family::Mistral),
            Some("qwen2") => Some(Family::Qwen2),
            Some("qwen3") => Some(Family::Qwen3),
            Some("qwen3_moe") => Some(Family::Qwen3Moe),
            Some("phi3") => Some(Family::Phi3),
            Some("gemma2") => Some(Family::Gemma2),
            Some("gemma3_text") => Some(Family::Gemma3),
            _ => None,
        };
        let by_arch = architectures.iter().find_map(|a| match a.as_str() {
            "LlamaForCausalLM" => Some(Family::Llama),
            "MistralForCausalLM" => Some(Family::Mistral),
            "Qwen2ForCausalLM" => Some(Family::Qwen2),
            "Qwen3ForCausalLM" => Some(Family::Qwen3),
            "Qwen3MoeForCausalLM" => Some(Family::Qwen3Moe),
            "Phi3ForCausalLM" => Some(Family::Phi3),
            "Gemma2ForCausalLM" => Some(Family::Gemma2),
            "Gemma3ForCausalLM" => Some(Family::Gemma3),
            _ => None,
        });
        // transformers picks the model class by `model_type` when there is one.
        let found = if model_type.is_some() { by_type } else { by_arch };
        found.ok_or_else(|| {
            let name = model_type.map(str::to_string).or_else(|| architectures.first().cloned());
            EngineError::UnsupportedArchitecture(name.unwrap_or_else(|| "unknown".into()))
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum EosIds {
    One(u32),
    Many(Vec<u32>),
}

/// The config.json fields the engine reads; `rest` is checked for settings it refuses.
#[derive(Debug, Deserialize)]
pub(super) struct HfConfig {
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
    /// transformers 4's name; transformers 5 writes `rope_parameters` (with `rope_theta`).
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    rms_norm_eps: f64,
    pub(super) bos_token_id: Option<u32>,
    pub(super) eos_token_id: Option<EosIds>,
    tie_word_embeddings: Option<bool>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// The config of the language model to serve, from a folder's config.json, and whether the
/// checkpoint is multimodal (its language model's tensors under `language_model.` names
/// beside a vision tower pd does not run). Gemma 3's 4B/12B/27B checkpoints
/// (`Gemma3ForConditionalGeneration`) nest it under `text_config`, which keeps only what
/// differs from transformers' `Gemma3TextConfig` defaults: those are filled in here, as
/// transformers does, for every Gemma 3 text config. The outer config's token ids win (its
/// `eos_token_id` lists the end-of-turn token).
pub(super) fn language_config(mut raw: Value) -> Result<(Value, bool)> {
    let outer_type = raw.get("model_type").and_then(Value::as_str).map(str::to_string);
    let multimodal = outer_type.as_deref() == Some("gemma3") && raw.get("text_config").is_some_and(Value::is_object);
    let mut config = if multimodal {
        let mut text = raw["text_config"].take();
        for key in ["bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"] {
            if let Some(v) = raw.get(key).filter(|v| !v.is_null()) {
                text[key] = v.clone();
            }
        }
        text["model_type"] = "gemma3_text".into();
        text["architectures"] = serde_json::json!(["Gemma3ForCausalLM"]);
        text
    } else {
        raw
    };
    if config.get("model_type").and_then(Value::as_str) == Some("gemma3_text") {
        let defaults = serde_json::json!({
            "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
            "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "pad_token_id": 0,
            "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": true,
            "query_pre_attn_scalar": 256, "sliding_window": 4096,
        });
        let object = config.as_object_mut().ok_or_else(|| EngineError::Metadata("config is not an object".into()))?;
        for (key, value) in defaults.as_object().into_iter().flatten() {
            if object.get(key).is_none_or(Value::is_null) {
                object.insert(key.clone(), value.clone());
            }
        }
    }
    Ok((config, multimodal))
}

/// Families whose configs may set sliding-window layers that pd runs.
fn windowed(family: Family) -> bool {
    !matches!(family, Family::Llama)
}

fn unsupported(field: &str, reason: impl Into<String>) -> EngineError {
    EngineError::UnsupportedSetting { field: field.to_string(), reason: reason.into() }
}

impl HfConfig {
    pub(super) fn family(&self) -> Result<Family> {
        Family::of(&self.architectures, self.model_type.as_deref())
    }

    /// Whether the output projection is the embedding matrix (each family's default when
    /// the config does not say).
    pub(super) fn tied_embeddings(&self) -> bool {
        let gemma = self.family().is_ok_and(Family::is_gemma);
        self.tie_word_embeddings.unwrap_or(gemma)
    }

    /// Gemma's norms compute `x * (1 + w)`; the folder stores `w`.
    pub(super) fn norm_offset(&self) -> bool {
        self.family().is_ok_and(Family::is_gemma)
    }

    fn number(&self, key: &str) -> Option<f32> {
        self.value(key).and_then(Value::as_f64).map(|v| v as f32)
    }

    fn value(&self, key: &str) -> Option<&Value> {
        self.rest.get(key).filter(|v| !v.is_null())
    }

    fn flag(&self, key: &str) -> bool {
        self.value(key).and_then(Value::as_bool).unwrap_or(false)
    }

    /// Refuses the settings that change the output and that the engine does not implement.
    fn refuse_unsupported(&self, family: Family) -> Result<()> {
        let gemma = family.is_gemma();
        for key in ["hidden_act", "hidden_activation"] {
            match self.value(key).and_then(Value::as_str) {
                None | Some("silu") => {}
                Some("gelu_pytorch_tanh") if gemma => {}
                Some(other) => return Err(unsupported(key, format!("`{other}` (silu; gelu_pytorch_tanh for Gemma)"))),
            }
        }
        if self.flag("attention_bias") {
            return Err(unsupported("attention_bias", "true (a bias on the attention output projection)"));
        }
        if self.flag("mlp_bias") {
            return Err(unsupported("mlp_bias", "true"));
        }
        if let Some(Value::Array(types)) = self.value("layer_types") {
            let known = |t: &Value| {
                t.as_str() == Some("full_attention") || (windowed(family) && t.as_str() == Some("sliding_attention"))
            };
            if let Some(t) = types.iter().find(|t| !known(t)) {
                return Err(unsupported(
                    "layer_types",
                    format!("{t} (full_attention; sliding_attention where the family has windows)"),
                ));
            }
            if types.len() != self.num_hidden_layers {
                let reason = format!("{} entries for {} layers", types.len(), self.num_hidden_layers);
                return Err(unsupported("layer_types", reason));
            }
        }
        if self.flag("use_bidirectional_attention") {
            return Err(unsupported("use_bidirectional_attention", "true (an encoder's attention)"));
        }
        let gemma_keys: &[&str] =
            if gemma { &[] } else { &["attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"] };
        for key in gemma_keys.iter().chain(&[
            "logits_scaling",
            "embedding_multiplier",
            "residual_multiplier",
            "attention_multiplier",
        ]) {
            if let Some(v) = self.value(key) {
                return Err(unsupported(key, format!("{v}")));
            }
        }
        // transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`.
        let moe_keys: &[&str] = if family == Family::Qwen3Moe { &[] } else { &["num_experts", "num_local_experts"] };
        for key in moe_keys.iter().chain(&["n_routed_experts", "shared_expert_intermediate_size"]) {
            if self.value(key).and_then(Value::as_u64).is_some_and(|n| n > 0) {
                return Err(unsupported(key, "mixture-of-experts layers of this kind (Qwen3-MoE's are implemented)"));
            }
        }
        Ok(())
    }

    /// Qwen3-MoE's experts: `num_experts` MLPs of `moe_intermediate_size`, `num_experts_per_tok`
    /// per token, in every `decoder_sparse_step`-th layer not in `mlp_only_layers`.
    fn experts(&self) -> Result<MoeConfig> {
        let count = |key: &str, default: Option<u64>| -> Result<usize> {
            match self.value(key) {
                None => default.map(|d| d as usize).ok_or_else(|| unsupported(key, "missing")),
                Some(v) => v.as_u64().map(|n| n as usize).ok_or_else(|| unsupported(key, format!("{v} (a count)"))),
            }
        };
        let step = count("decoder_sparse_step", Some(1))?.max(1);
        let dense: Vec<u64> = match self.value("mlp_only_layers") {
            None => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_u64().ok_or_else(|| unsupported("mlp_only_layers", format!("{v} (a layer index)"))))
                .collect::<Result<_>>()?,
            Some(v) => return Err(unsupported("mlp_only_layers", format!("{v} (a list of layers)"))),
        };
        let experts = match self.value("num_experts") {
            Some(_) => count("num_experts", None)?,
            None => count("num_local_experts", None)?,
        };
        Ok(MoeConfig {
            experts,
            top_k: count("num_experts_per_tok", None)?,
            ffn: count("moe_intermediate_size", None)?,
            norm_top_k: self.flag("norm_topk_prob"),
            layers: (0..self.num_hidden_layers)
                .map(|i| !dense.contains(&(i as u64)) && experts > 0 && (i + 1).is_multiple_of(step))
                .collect(),
        })
    }

    /// The rotary scheme and base, from `rope_parameters` or `rope_scaling` + `rope_theta`.
    /// `dynamic` (NTK) changes nothing up to its original context: it is served as the plain
    /// scheme with the context capped there (the third value: a cap on the context).
    /// Gemma 3's global layers take `rope_parameters.full_attention` (transformers 5 keys
    /// the parameters by layer type) or `rope_scaling` + `rope_theta`.
    fn rope(&self, family: Family) -> Result<(RopeScaling, f32, Option<usize>)> {
        let raw = self.rope_parameters.as_ref().or(self.rope_scaling.as_ref()).filter(|v| !v.is_null());
        let by_type = raw.and_then(|p| p.get("full_attention")).filter(|v| v.is_object());
        let params = by_type.or(raw);
        let theta_in = params.and_then(|p| p.get("rope_theta")).and_then(Value::as_f64).map(|t| t as f32);
        let default_theta = if family == Family::Gemma3 { 1_000_000.0 } else { 10_000.0 };
        let theta = theta_in.or(self.rope_theta).unwrap_or(default_theta);
        let Some(p) = params else { return Ok((RopeScaling::None, theta, None)) };
        let field = match (self.rope_parameters.is_some(), by_type.is_some()) {
            (true, true) => "rope_parameters.full_attention",
            (true, false) => "rope_parameters",
            (false, _) => "rope_scaling",
        };
        let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
        let num = |key: &str| p.get(key).filter(|v| !v.is_null()).and_then(Value::as_f64).map(|v| v as f32);
        let need = |key: &str| num(key).ok_or_else(|| unsupported(&format!("{field}.{key}"), "missing"));
        // transformers 5: a top-level `original_max_position_embeddings` wins over the
        // scheme's own (Phi-3's configs keep it there; Phi3Config defaults it to 4096).
        let phi3 = family == Family::Phi3;
        let original = || {
            let top = self.value("original_max_position_embeddings").and_then(Value::as_u64).map(|v| v as usize);
            let default = if phi3 { 4096 } else { self.max_position_embeddings };
            top.or(num("original_max_position_embeddings").map(|v| v as usize)).unwrap_or(default)
        };
        let scaling = match kind {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: need("factor")? },
            // NTK scaling starts past the original context; the engine stops there.
            "dynamic" => return Ok((RopeScaling::None, theta, Some(original()))),
            "llama3" => RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max: need("original_max_position_embeddings")? as usize,
            },
            "yarn" if phi3 => self.longrope(p, field, original())?,
            "yarn" => {
                let factor = match num("factor") {
                    Some(f) => f,
                    None => self.max_position_embeddings as f32 / original() as f32,
                };
                let attention_factor = match (num("attention_factor"), num("mscale"), num("mscale_all_dim")) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                        RopeScaling::yarn_mscale(factor, m) / RopeScaling::yarn_mscale(factor, all)
                    }
                    _ => RopeScaling::yarn_mscale(factor, 1.0),
                };
                RopeScaling::Yarn {
                    factor,
                    original_max: original(),
                    beta_fast: num("beta_fast").unwrap_or(32.0),
                    beta_slow: num("beta_slow").unwrap_or(1.0),
                    attention_factor,
                    truncate: p.get("truncate").and_then(Value::as_bool).unwrap_or(true),
                }
            }
            // Phi-3's configs name LongRoPE `su` (and transformers reads a Phi-3 `yarn` as it).
            "longrope" | "su" => self.longrope(p, field, original())?,
            other => return Err(unsupported(&format!("{field}.rope_type"), format!("`{other}`"))),
        };
        Ok((scaling, theta, None))
    }

    /// LongRoPE's factor lists and attention factor (transformers' `_compute_longrope_parameters`:
    /// `factor` defaults to max / original positions).
    fn longrope(&self, p: &Value, field: &str, original_max: usize) -> Result<RopeScaling> {
        let list = |key: &str| -> Result<Vec<f32>> {
            let bad = || unsupported(&format!("{field}.{key}"), "missing or not a list of numbers");
            let values = p.get(key).and_then(Value::as_array).ok_or_else(bad)?;
            values.iter().map(|v| v.as_f64().map(|x| x as f32).ok_or_else(bad)).collect()
        };
        let num = |key: &str| p.get(key).filter(|v| !v.is_null()).and_then(Value::as_f64).map(|v| v as f32);
        let factor = num("factor").unwrap_or(self.max_position_embeddings as f32 / original_max as f32);
        Ok(RopeScaling::LongRope {
            short: list("short_factor")?,
            long: list("long_factor")?,
            original_max,
            attention_factor: num("attention_factor")
                .unwrap_or_else(|| RopeScaling::longrope_attention(factor, original_max)),
        })
    }

    /// Values of each head that rotate, where fewer than all: `partial_rotary_factor` (top
    /// level or in the rotary parameters) times the head width, as transformers truncates it.
    /// Phi-3's layer applies it (Phi-4-mini: 0.75); another family's would be ignored by its
    /// layer in transformers too, so it is refused there.
    fn rotary_dim(&self, family: Family, head_dim: usize) -> Result<Option<usize>> {
        let params = self.rope_parameters.as_ref().or(self.rope_scaling.as_ref()).filter(|v| v.is_object());
        let (field, factor) = match params.and_then(|p| p.get("partial_rotary_factor")).and_then(Value::as_f64) {
            Some(f) if self.rope_parameters.is_some() => ("rope_parameters.partial_rotary_factor", f),
            Some(f) => ("rope_scaling.partial_rotary_factor", f),
            None => match self.value("partial_rotary_factor").and_then(Value::as_f64) {
                Some(f) => ("partial_rotary_factor", f),
                None => return Ok(None),
            },
        };
        if factor == 1.0 {
            return Ok(None);
        }
        if family != Family::Phi3 {
            return Err(unsupported(field, format!("{factor} (rotary on part of each head: Phi-3's layout only)")));
        }
        let dim = (head_dim as f64 * factor) as usize;
        if !(factor > 0.0 && factor < 1.0) || dim == 0 || !dim.is_multiple_of(2) {
            return Err(unsupported(field, format!("{factor} (gives {dim} of {head_dim} values: not an even number)")));
        }
        Ok(Some(dim))
    }

    /// The rotary base of the sliding-window layers where it differs from the global one:
    /// Gemma 3's `rope_parameters.sliding_attention` (transformers 5) or
    /// `rope_local_base_freq` (transformers 4), with plain frequencies. Another family
    /// whose layer types rotate differently is refused.
    fn local_rope_theta(&self, family: Family) -> Result<Option<f32>> {
        let params = self.rope_parameters.as_ref().filter(|v| !v.is_null());
        let local = params.and_then(|p| p.get("sliding_attention")).filter(|v| v.is_object());
        if family != Family::Gemma3 {
            let global = params.and_then(|p| p.get("full_attention"));
            if local.is_some() && local != global {
                return Err(unsupported("rope_parameters.sliding_attention", "a rotary scheme of its own"));
            }
            return Ok(None);
        }
        if let Some(kind) = local.and_then(|l| l.get("rope_type")).and_then(Value::as_str) {
            if kind != "default" {
                return Err(unsupported("rope_parameters.sliding_attention.rope_type", format!("`{kind}` (default)")));
            }
        }
        let theta = local.and_then(|l| l.get("rope_theta")).and_then(Value::as_f64).map(|t| t as f32);
        Ok(Some(theta.or(self.number("rope_local_base_freq")).unwrap_or(10_000.0)))
    }

    /// The layers that attend within `sliding_window` (Mistral's and Phi-3's: all of them;
    /// Gemma's: `layer_types`, else every other layer for Gemma 2 and five in six for
    /// Gemma 3; Qwen's only with `use_sliding_window`: `layer_types`, else the layers from
    /// `max_window_layers` on; transformers' rules). `None` where no layer slides.
    fn sliding_window(&self, family: Family) -> Result<Option<SlidingWindow>> {
        let qwen = matches!(family, Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe);
        if qwen && !self.flag("use_sliding_window") {
            return Ok(None);
        }
        let Some(size) = self.value("sliding_window").filter(|_| windowed(family)) else { return Ok(None) };
        let size = size
            .as_u64()
            .filter(|&w| w > 0)
            .ok_or_else(|| unsupported("sliding_window", format!("{size} (a positive number of positions)")))?;
        let n = self.num_hidden_layers;
        let layers: Vec<bool> = match (family, self.value("layer_types")) {
            (Family::Gemma2 | Family::Gemma3 | Family::Qwen2 | Family::Qwen3, Some(Value::Array(types))) => {
                types.iter().map(|t| t.as_str() == Some("sliding_attention")).collect()
            }
            (Family::Qwen2 | Family::Qwen3, _) => {
                let first = match self.value("max_window_layers") {
                    None => 28,
                    Some(v) => v.as_u64().ok_or_else(|| unsupported("max_window_layers", format!("{v}")))?,
                };
                (0..n).map(|i| i as u64 >= first).collect()
            }
            // transformers' Qwen3-MoE slides in every layer when it slides at all.
            (Family::Qwen3Moe, _) => vec![true; n],
            (Family::Gemma2, _) => (0..n).map(|i| !(i + 1).is_multiple_of(2)).collect(),
            (Family::Gemma3, _) => {
                let pattern = match self.value("sliding_window_pattern") {
                    None => 6,
                    Some(v) => v
                        .as_u64()
                        .filter(|&p| p > 0)
                        .ok_or_else(|| unsupported("sliding_window_pattern", format!("{v} (a positive number)")))?,
                };
                (0..n).map(|i| !(i as u64 + 1).is_multiple_of(pattern)).collect()
            }
            _ => vec![true; n],
        };
        Ok(layers.contains(&true).then_some(SlidingWindow { size: size as usize, layers }))
    }

    pub(super) fn model_config(&self) -> Result<ModelConfig> {
        let family = self.family()?;
        self.refuse_unsupported(family)?;
        let (rope_scaling, rope_theta, rope_cap) = self.rope(family)?;
        let local_rope_theta = self.local_rope_theta(family)?;
        let sliding_window = self.sliding_window(family)?;
        let parts = match family {
            Family::Qwen2 => DecoderParts { qkv_bias: true, ..Default::default() },
            Family::Qwen3 => DecoderParts { qk_norm: true, ..Default::default() },
            Family::Qwen3Moe => DecoderParts { qk_norm: true, moe: Some(self.experts()?), ..Default::default() },
            Family::Gemma2 | Family::Gemma3 => DecoderParts {
                qk_norm: family == Family::Gemma3,
                post_norms: true,
                embed_scale: Some((self.hidden_size as f32).sqrt()),
                activation: Activation::GeluTanh,
                query_scale: self.number("query_pre_attn_scalar"),
                attn_softcap: self.number("attn_logit_softcapping"),
                final_softcap: self.number("final_logit_softcapping"),
                ..Default::default()
            },
            Family::Llama | Family::Mistral | Family::Phi3 => DecoderParts::default(),
        };
        let head_dim = self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1));
        let rotary_dim = self.rotary_dim(family, head_dim)?;
        let parts = DecoderParts { sliding_window, local_rope_theta, rotary_dim, ..parts };
        let max_position = rope_cap.map_or(self.max_position_embeddings, |cap| cap.min(self.max_position_embeddings));
        let config = ModelConfig {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim,
            max_position,
            rope_theta,
            rms_norm_eps: self.rms_norm_eps,
            rope_style: RopeStyle::Halves,
            rope_scaling,
            parts,
        };
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: Value) -> Result<ModelConfig> {
        let mut base = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        });
        base.as_object_mut().expect("valid").extend(extra.as_object().expect("valid").clone());
        let c: HfConfig = serde_json::from_value(base).map_err(|e| EngineError::Metadata(e.to_string()))?;
        c.model_config()
    }

    #[test]
    fn rope_schemes_are_read_from_either_name() {
        let c = config(serde_json::json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}))
        .expect("valid");
        assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { original_max: 64, .. }));
        let c = config(serde_json::json!({"rope_parameters": {"rope_type": "linear", "factor": 2.0,
            "rope_theta": 500.0}}))
        .expect("valid");
        assert_eq!((c.rope_scaling, c.rope_theta), (RopeScaling::Linear { factor: 2.0 }, 500.0));
        let c = config(serde_json::json!({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0,
            "original_max_position_embeddings": 64}}))
        .expect("valid");
        assert_eq!(
            (c.rope_scaling, c.max_position),
            (RopeScaling::None, 64),
            "dynamic: the context stops where it starts"
        );
    }

    #[test]
    fn settings_that_change_the_math_are_refused_by_name() {
        let cases = [
            (
                serde_json::json!({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}),
                "rope_scaling.short_factor",
            ),
            (serde_json::json!({"rope_scaling": {"rope_type": "su", "short_factor": [1.0, "x"]}}), "short_factor"),
            (serde_json::json!({"rope_scaling": {"rope_type": "longrope2"}}), "rope_scaling.rope_type"),
            (serde_json::json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}), "low_freq_factor"),
            (serde_json::json!({"hidden_act": "gelu"}), "hidden_act"),
            (serde_json::json!({"attention_bias": true}), "attention_bias"),
            (serde_json::json!({"final_logit_softcapping": 30.0}), "final_logit_softcapping"),
            (serde_json::json!({"num_local_experts": 8}), "num_local_experts"),
            (serde_json::json!({"partial_rotary_factor": 0.5}), "partial_rotary_factor"),
            (
                serde_json::json!({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}}),
                "rope_parameters.partial_rotary_factor",
            ),
        ];
        for (extra, field) in cases {
            let err = config(extra.clone()).expect_err("refused").to_string();
            assert!(err.contains(field), "{extra}: {err}");
        }
        let err = config(serde_json::json!({"model_type": "gemma3n_text", "architectures": ["Gemma3nForCausalLM"]}));
        assert!(matches!(err, Err(EngineError::UnsupportedArchitecture(a)) if a == "gemma3n_text"));
    }

    /// Qwen3-30B-A3B's expert settings (the Hub's `num_experts`; transformers 5 writes
    /// `num_local_experts`), a sparse step and dense layers; other expert schemes refused.
    #[test]
    fn qwen3_moe_experts_are_read_and_other_expert_schemes_refused() {
        let moe = |extra: Value| {
            let mut c = serde_json::json!({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                "num_hidden_layers": 4, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                "norm_topk_prob": true});
            c.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
            config(c)
        };
        let m = moe(serde_json::json!({"num_experts": 128})).expect("valid").parts.moe.expect("experts");
        assert_eq!((m.experts, m.top_k, m.ffn, m.norm_top_k), (128, 8, 768, true));
        assert_eq!(m.layers, [true; 4]);
        let m = moe(serde_json::json!({"num_local_experts": 16, "decoder_sparse_step": 2, "mlp_only_layers": [3]}))
            .expect("valid")
            .parts
            .moe
            .expect("experts");
        assert_eq!((m.experts, m.layers), (16, vec![false, true, false, false]));
        let err = moe(serde_json::json!({"num_experts": 4, "num_experts_per_tok": 5})).expect_err("5 of 4");
        assert!(err.to_string().contains("5 of 4 experts"), "{err}");
        let err = moe(serde_json::json!({"n_routed_experts": 64})).expect_err("DeepSeek's experts");
        assert!(err.to_string().contains("n_routed_experts"), "{err}");
        let err = config(serde_json::json!({"num_experts": 4})).expect_err("a Llama with experts");
        assert!(err.to_string().contains("num_experts"), "{err}");
    }

    /// gemma-3-4b-it's config.json as the Hub has it: the text model's settings under
    /// `text_config`, most left at Gemma3TextConfig's defaults, the end-of-turn id outside.
    #[test]
    fn gemma3_multimodal_configs_serve_their_language_model() {
        let raw = serde_json::json!({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "eos_token_id": [1, 106], "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
            "model_type": "gemma3_text", "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0,
            "rope_type": "linear"}, "sliding_window": 1024}, "vision_config": {"model_type": "siglip_vision_model"}});
        let (text, multimodal) = language_config(raw).expect("valid");
        assert!(multimodal);
        let c: HfConfig = serde_json::from_value(text).expect("parses");
        assert!(matches!(c.eos_token_id, Some(EosIds::Many(ref ids)) if ids == &[1, 106]), "the outer ids win");
        let m = c.model_config().expect("valid");
        assert_eq!((m.vocab_size, m.num_heads, m.num_kv_heads, m.head_dim), (262_208, 8, 4, 256));
        assert_eq!((m.parts.query_scale, m.rope_theta, m.parts.local_rope_theta), (Some(256.0), 1e6, Some(1e4)));
        assert_eq!(m.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        let window = m.parts.sliding_window.expect("sliding layers");
        assert_eq!((window.size, window.layers.iter().filter(|&&s| !s).count()), (1024, 5), "34 layers, 5 global");
        // Another multimodal family is not mistaken for its language model.
        let (_, multimodal) =
            language_config(serde_json::json!({"model_type": "llava", "text_config": {}})).expect("valid");
        assert!(!multimodal);
    }

    /// Phi-4-mini's rotary setting: 3/4 of each head turns, LongRoPE with Phi-3's top-level
    /// original context; the factor set is the one for the context served.
    #[test]
    fn phi4_mini_partial_rotary_and_longrope() {
        let phi = |extra: Value| {
            let mut c = serde_json::json!({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
                "max_position_embeddings": 1024, "original_max_position_embeddings": 64,
                "partial_rotary_factor": 0.75});
            c.as_object_mut().expect("valid").extend(extra.as_object().expect("valid").clone());
            config(c)
        };
        let factors = serde_json::json!({"rope_scaling": {"type": "longrope",
            "short_factor": [1.0, 1.5, 2.0], "long_factor": [2.0, 3.0, 4.0]}});
        let c = phi(factors.clone()).expect("valid");
        assert_eq!(c.parts.rotary_dim, Some(6), "0.75 of 8");
        let RopeScaling::LongRope { original_max, attention_factor, .. } = c.rope_scaling else { panic!("longrope") };
        assert_eq!(original_max, 64, "the top-level original context");
        assert!((attention_factor - RopeScaling::longrope_attention(16.0, 64)).abs() < 1e-7);
        let (freqs, _) = c.rope_scaling.frequencies(6, c.rope_theta, c.max_position).expect("valid");
        let (base, _) = RopeScaling::None.frequencies(6, c.rope_theta, 1024).expect("valid");
        assert!((freqs[2] - base[2] / 4.0).abs() < 1e-9, "1024 positions served: the long set");
        let mut explicit = factors.clone();
        explicit["rope_scaling"]["attention_factor"] = 1.25.into();
        let c = phi(explicit).expect("valid");
        assert!(matches!(c.rope_scaling, RopeScaling::LongRope { attention_factor: 1.25, .. }));
        let err = phi(serde_json::json!({"partial_rotary_factor": 0.7})).expect_err("refused").to_string();
        assert!(err.contains("partial_rotary_factor") && err.contains("not an even number"), "{err}");
        let err = phi(serde_json::json!({"rope_scaling": {"type": "longrope", "short_factor": [1.0],
            "long_factor": [1.0]}}))
        .and_then(|c| c.rope_scaling.frequencies(6, c.rope_theta, c.max_position).map(|_| ()))
        .expect_err("refused")
        .to_string();
        assert!(err.contains("long_factor has 1 values"), "{err}");
    }

    #[test]
    fn families_set_their_parts() {
        let qwen2 = config(serde_json::json!({"model_type": "qwen2", "sliding_window": 32})).expect("valid");
        assert!(qwen2.parts.qkv_bias && !qwen2.parts.qk_norm && qwen2.max_position == 256);
        assert_eq!(qwen2.parts.sliding_window, None, "Qwen's window applies only with use_sliding_window");
        let qwen2 = config(serde_json::json!({"model_type": "qwen2", "sliding_window": 32,
            "use_sliding_window": true, "max_window_layers": 1}))
        .expect("valid");
        assert_eq!(qwen2.parts.sliding_window.expect("a window").layers, vec![false, true]);
        let qwen3 = config(serde_json::json!({"model_type": "qwen3", "head_dim": 16})).expect("valid");
        assert!(qwen3.parts.qk_norm && !qwen3.parts.qkv_bias && qwen3.head_dim == 16);
        let mistral = config(serde_json::json!({"model_type": "mistral", "sliding_window": 128})).expect("valid");
        let window = mistral.parts.sliding_window.expect("a window");
        assert_eq!((mistral.max_position, window.size, window.layers), (256, 128, vec![true, true]));
        let gemma2 = config(serde_json::json!({"model_type": "gemma2", "sliding_window": 16, "num_hidden_layers": 3}))
            .expect("valid");
        assert_eq!(gemma2.parts.sliding_window.expect("a window").layers, vec![true, false, true]);
        assert_eq!(gemma2.parts.local_rope_theta, None);
    }

    /// Gemma 3 as transformers 4 wrote it (`rope_local_base_freq`, `sliding_window_pattern`)
    /// and as transformers 5 does (`rope_parameters` by layer type, `layer_types`).
    #[test]
    fn gemma3_reads_both_generations_of_config() {
        let old = config(serde_json::json!({"model_type": "gemma3_text", "num_hidden_layers": 7,
            "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 256}))
        .expect("valid");
        let window = old.parts.sliding_window.clone().expect("a window");
        assert_eq!(window.layers, vec![true, true, true, true, true, false, true]);
        assert_eq!((old.rope_theta, old.parts.local_rope_theta), (1e6, Some(1e4)));
        assert_eq!(old.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert!(old.parts.qk_norm && old.parts.post_norms);
        let new = config(serde_json::json!({"model_type": "gemma3_text", "num_hidden_layers": 2,
            "sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}))
        .expect("valid");
        assert_eq!(new.parts.sliding_window.expect("a window").layers, vec![true, false]);
        assert_eq!((new.rope_theta, new.parts.local_rope_theta), (1e6, Some(1e4)));
        assert_eq!(new.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        for (extra, field) in [
            (
                serde_json::json!({"rope_parameters": {"full_attention": {"rope_type": "default"},
                "sliding_attention": {"rope_type": "yarn", "factor": 2.0}}}),
                "rope_parameters.sliding_attention",
            ),
            (serde_json::json!({"layer_types": ["sliding_attention"]}), "layer_types"),
            (serde_json::json!({"layer_types": ["chunked_attention", "full_attention"]}), "layer_types"),
            (serde_json::json!({"use_bidirectional_attention": true}), "use_bidirectional_attention"),
            (serde_json::json!({"sliding_window": 0}), "sliding_window"),
            (serde_json::json!({"sliding_window": 8, "sliding_window_pattern": 0}), "sliding_window_pattern"),
        ] {
            let mut extra = extra.as_object().expect("object").clone();
            extra.insert("model_type".into(), "gemma3_text".into());
            let err = config(Value::Object(extra.clone())).expect_err("refused").to_string();
            assert!(err.contains(field), "{extra:?}: {err}");
        }
    }
}
