//! `pd-bench roofline --model`: a model's shape for pd-sim's roofline, by name or from any
//! checkpoint pd serves (its config read by pd-engine: every family, with its sliding-window
//! layers), without its weights.

use anyhow::Context;

/// `--model` of `roofline`: a name pd-sim knows, or a checkpoint's config read by pd-engine
/// (every family pd serves, with its sliding-window layers).
pub fn model_shape(model: &str) -> anyhow::Result<pd_sim::roofline::ModelShape> {
    let path = std::path::Path::new(model);
    if !path.exists() {
        return pd_sim::roofline::model(model).with_context(|| {
            format!("--model {model:?}: no such file, and known names are {}", pd_sim::roofline::MODELS)
        });
    }
    let (c, tied) = pd_engine::loader::read_config(path).with_context(|| format!("--model {model}"))?;
    let window =
        c.parts.sliding_window.as_ref().map(|w| (w.size as u32, w.layers.iter().filter(|&&s| s).count() as u32));
    let geometry = pd_sim::roofline::Geometry {
        vocab: c.vocab_size as u64,
        hidden: c.hidden_size as u64,
        ffn: c.intermediate_size as u64,
        layers: c.num_layers as u32,
        heads: c.num_heads as u32,
        kv_heads: c.num_kv_heads as u32,
        head_dim: c.head_dim as u32,
        max_position: c.max_position as u32,
        tied,
        window,
        experts: c.parts.moe.as_ref().map(|m| pd_sim::roofline::Experts {
            count: m.experts as u64,
            per_token: m.top_k as u64,
            ffn: m.ffn as u64,
            layers: m.layers.iter().filter(|&&e| e).count() as u32,
        }),
    };
    let name = path.file_stem().map_or_else(|| model.to_string(), |s| s.to_string_lossy().into_owned());
    Ok(pd_sim::roofline::ModelShape::from_geometry(&name, &geometry))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> String {
        format!("{}/../engine/tests/data/families/{name}", env!("CARGO_MANIFEST_DIR"))
    }

    #[test]
    fn a_checkpoint_gives_its_geometry_and_windows() -> anyhow::Result<()> {
        // Gemma 3 (multimodal config, text_config inside): 5 of 6 layers slide over 16 keys.
        let gemma = model_shape(&fixture("gemma3-multimodal"))?;
        let window = gemma.window.context("gemma 3 slides")?;
        assert_eq!((window.tokens, window.share), (16, 5.0 / 6.0));
        // The same model from its config.json alone and from its GGUF file.
        let qwen_json = model_shape(&fixture("qwen3/config.json"))?;
        let qwen_gguf = model_shape(&fixture("qwen3/model.gguf"))?;
        assert_eq!(
            (qwen_json.layers, qwen_json.kv_heads, qwen_json.head_dim),
            (qwen_gguf.layers, qwen_gguf.kv_heads, qwen_gguf.head_dim)
        );
        assert_eq!(qwen_json.params, qwen_gguf.params);
        assert!(qwen_json.window.is_none());
        // Qwen3-MoE: 4 experts of 48, 2 per token, in both layers (hidden 64).
        let moe = model_shape(&fixture("qwen3-moe"))?;
        let active = moe.active_params.context("active weights")?;
        assert_eq!(
            moe.params - active,
            2.0 * (2.0 * 3.0 * 64.0 * 48.0) + 128.0 * 64.0,
            "2 idle experts x 2 layers + embedding"
        );
        // Named models still work; an unknown name lists the known ones.
        assert_eq!(model_shape("qwen3-8b")?.layers, 36);
        let e = model_shape("no-such-model").expect_err("unknown");
        assert!(e.to_string().contains("gemma-2-9b"), "{e}");
        Ok(())
    }
}
