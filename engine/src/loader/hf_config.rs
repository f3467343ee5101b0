//! config.json of the families the engine runs, read into a `ModelConfig`: which family,
//! which rotary scheme, which optional parts (Q/K/V biases, Q/K norms), and a refusal that
//! names every setting that would change the math in a way the engine does not implement.
//! Unknown keys that do not change the output (dropout, initializer ranges, dtype) are
//! left alone; the list of refused ones is what the other families' configs use.

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::config::{Activation, DecoderParts, ModelConfig, RopeScaling, RopeStyle};
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
}

impl Family {
    fn of(architectures: &[String], model_type: Option<&str>) -> Result<Family> {
        let by_type = match model_type {
            Some("llama") => Some(Family::Llama),
            Some("mistral") => Some(Family::Mistral),
            Some("qwen2") => Some(Family::Qwen2),
            Some("qwen3") => Some(Family::Qwen3),
            Some("phi3") => Some(Family::Phi3),
            Some("gemma2") => Some(Family::Gemma2),
            _ => None,
        };
        let by_arch = architectures.iter().find_map(|a| match a.as_str() {
            "LlamaForCausalLM" => Some(Family::Llama),
            "MistralForCausalLM" => Some(Family::Mistral),
            "Qwen2ForCausalLM" => Some(Family::Qwen2),
            "Qwen3ForCausalLM" => Some(Family::Qwen3),
            "Phi3ForCausalLM" => Some(Family::Phi3),
            "Gemma2ForCausalLM" => Some(Family::Gemma2),
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
        let gemma = self.family().is_ok_and(|f| f == Family::Gemma2);
        self.tie_word_embeddings.unwrap_or(gemma)
    }

    /// Gemma's norms compute `x * (1 + w)`; the folder stores `w`.
    pub(super) fn norm_offset(&self) -> bool {
        self.family().is_ok_and(|f| f == Family::Gemma2)
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
        let gemma = family == Family::Gemma2;
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
        if matches!(family, Family::Qwen2 | Family::Qwen3) && self.flag("use_sliding_window") {
            return Err(unsupported("use_sliding_window", "true (sliding-window layers)"));
        }
        if let Some(p) = self.value("partial_rotary_factor").and_then(Value::as_f64) {
            if p != 1.0 {
                return Err(unsupported("partial_rotary_factor", format!("{p} (rotary on part of each head)")));
            }
        }
        if let Some(Value::Array(types)) = self.value("layer_types") {
            // Gemma 2's sliding layers attend fully within the window, where the context is capped.
            let known =
                |t: &Value| t.as_str() == Some("full_attention") || (gemma && t.as_str() == Some("sliding_attention"));
            if let Some(t) = types.iter().find(|t| !known(t)) {
                return Err(unsupported("layer_types", format!("{t} (only full_attention layers)")));
            }
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
        for key in ["num_experts", "num_local_experts", "n_routed_experts"] {
            if self.value(key).and_then(Value::as_u64).is_some_and(|n| n > 0) {
                return Err(unsupported(key, "mixture-of-experts layers"));
            }
        }
        Ok(())
    }

    /// The rotary scheme and base, from `rope_parameters` or `rope_scaling` + `rope_theta`.
    /// `dynamic` (NTK) changes nothing up to its original context: it is served as the plain
    /// scheme with the context capped there (the third value: a cap on the context).
    fn rope(&self) -> Result<(RopeScaling, f32, Option<usize>)> {
        let params = self.rope_parameters.as_ref().or(self.rope_scaling.as_ref()).filter(|v| !v.is_null());
        let theta_in = params.and_then(|p| p.get("rope_theta")).and_then(Value::as_f64).map(|t| t as f32);
        let theta = theta_in.or(self.rope_theta).unwrap_or(10_000.0);
        let Some(p) = params else { return Ok((RopeScaling::None, theta, None)) };
        let field = if self.rope_parameters.is_some() { "rope_parameters" } else { "rope_scaling" };
        let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
        let num = |key: &str| p.get(key).filter(|v| !v.is_null()).and_then(Value::as_f64).map(|v| v as f32);
        let need = |key: &str| num(key).ok_or_else(|| unsupported(&format!("{field}.{key}"), "missing"));
        if let Some(p) = num("partial_rotary_factor").filter(|&p| p != 1.0) {
            let field = format!("{field}.partial_rotary_factor");
            return Err(unsupported(&field, format!("{p} (rotary on part of each head)")));
        }
        let original =
            || num("original_max_position_embeddings").map(|v| v as usize).unwrap_or(self.max_position_embeddings);
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
            other => return Err(unsupported(&format!("{field}.rope_type"), format!("`{other}`"))),
        };
        Ok((scaling, theta, None))
    }

    pub(super) fn model_config(&self) -> Result<ModelConfig> {
        let family = self.family()?;
        self.refuse_unsupported(family)?;
        let (rope_scaling, rope_theta, rope_cap) = self.rope()?;
        // Mistral's, Phi-3's and Gemma 2's sliding window equals full attention up to the
        // window: the context is capped there rather than the window implemented.
        let window = match family {
            Family::Mistral | Family::Phi3 | Family::Gemma2 => {
                self.value("sliding_window").and_then(Value::as_u64).map(|w| w as usize)
            }
            _ => None,
        };
        let parts = match family {
            Family::Qwen2 => DecoderParts { qkv_bias: true, ..Default::default() },
            Family::Qwen3 => DecoderParts { qk_norm: true, ..Default::default() },
            Family::Gemma2 => DecoderParts {
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
        let max_position = [window, rope_cap].into_iter().flatten().fold(self.max_position_embeddings, usize::min);
        let config = ModelConfig {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim: self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1)),
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
            (serde_json::json!({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}), "rope_scaling.rope_type"),
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
            (serde_json::json!({"model_type": "qwen2", "use_sliding_window": true}), "use_sliding_window"),
        ];
        for (extra, field) in cases {
            let err = config(extra.clone()).expect_err("refused").to_string();
            assert!(err.contains(field), "{extra}: {err}");
        }
        let err = config(serde_json::json!({"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}));
        assert!(matches!(err, Err(EngineError::UnsupportedArchitecture(a)) if a == "gemma3_text"));
    }

    #[test]
    fn families_set_their_parts() {
        let qwen2 = config(serde_json::json!({"model_type": "qwen2", "sliding_window": 32})).expect("valid");
        assert!(qwen2.parts.qkv_bias && !qwen2.parts.qk_norm && qwen2.max_position == 256);
        let qwen3 = config(serde_json::json!({"model_type": "qwen3", "head_dim": 16})).expect("valid");
        assert!(qwen3.parts.qk_norm && !qwen3.parts.qkv_bias && qwen3.head_dim == 16);
        let mistral = config(serde_json::json!({"model_type": "mistral", "sliding_window": 128})).expect("valid");
        assert_eq!(mistral.max_position, 128, "context capped at the window");
    }
}
