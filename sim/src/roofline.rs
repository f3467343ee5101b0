//! A worker cost model from first principles, for hardware we do not have here: a roofline of
//! a hardware description (peak dense FLOP/s, memory bandwidth, KV link bandwidth, memory)
//! and a model geometry, with two efficiency factors (fraction of peak FLOP/s a prefill
//! reaches, fraction of bandwidth a decode step reaches). Every assumption is written into the
//! result's `source`, so a plan built on it says what it assumed.
//!
//! - prefill: 2 FLOP per parameter per token, plus 4 x layers x heads x head_dim FLOP per
//!   token per token of context it attends over (QK^T and AV); a step also reads the weights
//!   once (its fixed part).
//! - decode: a step reads the weights once (fixed), does 2 FLOP per parameter per row, and
//!   reads every row's KV (per token of context).
//! - KV hand-off: K and V of every layer per token; layers before the last overlap the
//!   compute, so the commit waits for one layer's bytes over the link plus a round trip.
//! - sliding-window layers (Mistral, Gemma 2 and 3, Phi-3 where set) attend over at most
//!   their window: their share of the attention cost stops growing there (`AttentionWindow`);
//!   their KV memory does not shrink, as pd keeps every layer's KV.
//!
//! A model is named (`model`) or given by its geometry (`Geometry`, e.g. read by `pd-bench
//! roofline --model` from a config.json or GGUF header), which also gives its parameters.

use serde::{Deserialize, Serialize};

use crate::cost::{AttentionWindow, DecodeCost, KvCost, PrefillCost, WorkerCost, WorkerShape};

/// One worker's hardware (all its GPUs together under tensor parallelism).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hardware {
    pub name: String,
    /// Peak dense FLOP/s at the weights' precision, per GPU.
    pub tflops: f64,
    /// Memory bandwidth per GPU, GB/s.
    pub hbm_gb_s: f64,
    /// Memory per GPU, GB.
    pub hbm_gb: f64,
    /// KV link from a prefill to a decode worker, GB/s per GPU (RDMA NIC).
    pub link_gb_s: f64,
    /// GPUs per worker (tensor parallel).
    pub gpus: u32,
    /// Fraction of peak FLOP/s a prefill reaches (MFU).
    pub mfu: f64,
    /// Fraction of peak bandwidth a decode step reaches (MBU).
    pub mbu: f64,
}

/// A transformer's geometry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelShape {
    pub name: String,
    /// Every weight: what memory holds and what a decode step reads (at batch sizes where a
    /// mixture of experts' tokens reach most experts).
    pub params: f64,
    /// Weights one token computes with (a mixture of experts: only its chosen experts);
    /// `params` when not set.
    #[serde(default)]
    pub active_params: Option<f64>,
    pub layers: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Bytes per weight (2 for bf16/f16).
    pub weight_bytes: f64,
    /// Bytes per KV value (2 for f16).
    pub kv_value_bytes: f64,
    pub max_position: u32,
    /// Sliding-window layers, if any.
    #[serde(default)]
    pub window: Option<AttentionWindow>,
}

/// A decoder's geometry as its config states it.
#[derive(Debug, Clone, PartialEq)]
pub struct Geometry {
    pub vocab: u64,
    pub hidden: u64,
    pub ffn: u64,
    pub layers: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub max_position: u32,
    /// The output projection is the embedding table.
    pub tied: bool,
    /// Window size and how many layers slide.
    pub window: Option<(u32, u32)>,
    /// Mixture-of-experts MLPs: how many experts, chosen per token, their width, and how many
    /// layers have them (the others keep the dense `ffn`).
    pub experts: Option<Experts>,
}

/// A mixture of experts' shape (`Geometry::experts`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Experts {
    pub count: u64,
    pub per_token: u64,
    pub ffn: u64,
    pub layers: u32,
}

impl ModelShape {
    /// The shape of a decoder of this geometry with bf16 weights and an f16 KV cache:
    /// parameters are Q, K, V and output projections, the gated MLP (three matrices) of each
    /// layer, the embedding table and, when untied, the output projection (norms and biases
    /// are under 0.1%).
    pub fn from_geometry(name: &str, g: &Geometry) -> ModelShape {
        let q_width = u64::from(g.heads * g.head_dim);
        let kv_width = u64::from(g.kv_heads * g.head_dim);
        let attention = g.hidden * (q_width + 2 * kv_width) + q_width * g.hidden;
        let dense = u64::from(g.layers) * (attention + 3 * g.hidden * g.ffn);
        let tables = if g.tied { 1 } else { 2 };
        // A token computes with the output projection, not the embedding table it reads a row of.
        let (params, active) = match g.experts {
            None => (dense + tables * g.vocab * g.hidden, None),
            Some(e) => {
                let (moe, rest) = (u64::from(e.layers.min(g.layers)), u64::from(g.layers.saturating_sub(e.layers)));
                let mlp = |experts: u64| g.hidden * e.count + experts * 3 * g.hidden * e.ffn;
                let layers = (g.layers.max(1)) as u64;
                let attention_all = layers * attention;
                let dense_mlps = rest * 3 * g.hidden * g.ffn;
                let total = attention_all + dense_mlps + moe * mlp(e.count) + tables * g.vocab * g.hidden;
                let active = attention_all + dense_mlps + moe * mlp(e.per_token) + g.vocab * g.hidden;
                (total, Some(active as f64))
            }
        };
        ModelShape {
            name: name.into(),
            params: params as f64,
            active_params: active,
            layers: g.layers,
            heads: g.heads,
            kv_heads: g.kv_heads,
            head_dim: g.head_dim,
            weight_bytes: 2.0,
            kv_value_bytes: 2.0,
            max_position: g.max_position,
            window: g.window.filter(|&(tokens, layers)| tokens > 0 && layers > 0 && tokens < g.max_position).map(
                |(tokens, layers)| AttentionWindow {
                    tokens,
                    share: f64::from(layers.min(g.layers)) / f64::from(g.layers.max(1)),
                },
            ),
        }
    }
}

/// Named hardware: `h100`, `h200` (SXM, bf16 dense peak, 400 Gb/s NIC per GPU).
pub fn hardware(name: &str, gpus: u32) -> Option<Hardware> {
    let (tflops, hbm_gb_s, hbm_gb) = match name {
        "h100" => (989.0, 3350.0, 80.0),
        "h200" => (989.0, 4800.0, 141.0),
        _ => return None,
    };
    Some(Hardware { name: name.into(), tflops, hbm_gb_s, hbm_gb, link_gb_s: 50.0, gpus, mfu: 0.5, mbu: 0.7 })
}

/// Names `model` knows.
pub const MODELS: &str =
    "llama-8b, llama-70b, smollm2-135m, qwen2.5-7b, qwen3-8b, qwen3-30b-a3b, mistral-7b, gemma-2-9b, gemma-3-12b";

/// Named models: `llama-8b` (Llama-3.1-8B), `llama-70b` (Llama-3.1-70B), `smollm2-135m`
/// (published parameter counts), and by their configs' geometry Qwen2.5-7B, Qwen3-8B,
/// Mistral-7B v0.3, Gemma-2-9B (every other layer slides over 4,096 keys) and Gemma-3-12B
/// (5 of 6 layers slide over 1,024), and Qwen3-30B-A3B (128 experts, 8 per token).
pub fn model(name: &str) -> Option<ModelShape> {
    let geometry = |vocab, hidden, ffn, layers, heads, kv_heads, head_dim, max_position, tied, window| Geometry {
        experts: None,
        vocab,
        hidden,
        ffn,
        layers,
        heads,
        kv_heads,
        head_dim,
        max_position,
        tied,
        window,
    };
    let by_geometry = match name {
        "qwen2.5-7b" => Some(geometry(152_064, 3584, 18_944, 28, 28, 4, 128, 32_768, false, None)),
        "qwen3-8b" => Some(geometry(151_936, 4096, 12_288, 36, 32, 8, 128, 40_960, false, None)),
        "mistral-7b" => Some(geometry(32_768, 4096, 14_336, 32, 32, 8, 128, 32_768, false, None)),
        "gemma-2-9b" => Some(geometry(256_000, 3584, 14_336, 42, 16, 8, 256, 8192, true, Some((4096, 21)))),
        "gemma-3-12b" => Some(geometry(262_208, 3840, 15_360, 48, 16, 8, 256, 131_072, true, Some((1024, 40)))),
        "qwen3-30b-a3b" => Some(Geometry {
            experts: Some(Experts { count: 128, per_token: 8, ffn: 768, layers: 48 }),
            ..geometry(151_936, 2048, 6144, 48, 32, 4, 128, 40_960, false, None)
        }),
        _ => None,
    };
    if let Some(g) = by_geometry {
        return Some(ModelShape::from_geometry(name, &g));
    }
    let (params, layers, heads, kv_heads, head_dim, max_position) = match name {
        "llama-8b" => (8.03e9, 32, 32, 8, 128, 131_072),
        "llama-70b" => (70.6e9, 80, 64, 8, 128, 131_072),
        "smollm2-135m" => (1.35e8, 30, 9, 3, 64, 8192),
        _ => return None,
    };
    Some(ModelShape {
        name: name.into(),
        params,
        layers,
        heads,
        kv_heads,
        head_dim,
        weight_bytes: 2.0,
        kv_value_bytes: 2.0,
        max_position,
        window: None,
        active_params: None,
    })
}

/// Why a roofline cannot be built.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RooflineError {
    #[error("the weights ({weights_gb:.0} GB) leave no KV memory on {gpus} x {hbm_gb} GB: use more GPUs per worker")]
    DoesNotFit { weights_gb: f64, gpus: u32, hbm_gb: f64 },
    #[error("{0} must be positive")]
    NotPositive(&'static str),
}

/// The cost model of `model` on `hw`, with `block_size`-token KV blocks, at most `max_batch`
/// rows per decode step, and 90% of memory usable.
pub fn roofline(hw: &Hardware, m: &ModelShape, block_size: u32, max_batch: u32) -> Result<WorkerCost, RooflineError> {
    for (name, v) in [("tflops", hw.tflops), ("hbm_gb_s", hw.hbm_gb_s), ("mfu", hw.mfu), ("mbu", hw.mbu)] {
        if v.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return Err(RooflineError::NotPositive(name));
        }
    }
    let gpus = f64::from(hw.gpus.max(1));
    let flops = hw.tflops * 1e12 * gpus * hw.mfu;
    let bandwidth = hw.hbm_gb_s * 1e9 * gpus * hw.mbu;
    let weights = m.params * m.weight_bytes;
    let active = m.active_params.unwrap_or(m.params);
    let kv_per_token = 2.0 * f64::from(m.layers * m.kv_heads * m.head_dim) * m.kv_value_bytes;
    let attention_flops = 4.0 * f64::from(m.layers * m.heads * m.head_dim);
    let kv_memory = hw.hbm_gb * 1e9 * gpus * 0.9 - weights;
    if kv_memory <= 0.0 {
        return Err(RooflineError::DoesNotFit { weights_gb: weights / 1e9, gpus: hw.gpus, hbm_gb: hw.hbm_gb });
    }
    let kv_blocks = (kv_memory / (kv_per_token * f64::from(block_size))).floor().min(f64::from(u32::MAX)) as u32;
    let link = hw.link_gb_s * 1e9 * gpus;
    let mut window = m.window.map_or(String::new(), |w| {
        format!("; {:.0}% of the layers attend over the last {} keys only", w.share * 100.0, w.tokens)
    });
    if let Some(a) = m.active_params {
        window.push_str(&format!(
            "; mixture of experts: {:.2}B of {:.2}B weights computed per token, every weight read per decode step",
            a / 1e9,
            m.params / 1e9
        ));
    }
    let source = format!(
        "roofline: {} on {} x {} ({} TFLOP/s, {} GB/s, {} GB each; prefill at {:.0}% of peak FLOP/s, decode at {:.0}% of \
         bandwidth; KV over {} GB/s per GPU, one layer after the compute + 0.1 ms); {:.1} GB weights, {} bytes of KV per token{}",
        m.name,
        hw.gpus,
        hw.name,
        hw.tflops,
        hw.hbm_gb_s,
        hw.hbm_gb,
        hw.mfu * 100.0,
        hw.mbu * 100.0,
        hw.link_gb_s,
        weights / 1e9,
        kv_per_token,
        window
    );
    Ok(WorkerCost {
        source,
        prefill: PrefillCost {
            fixed_ms: weights / bandwidth * 1e3,
            per_token_ms: 2.0 * active / flops * 1e3,
            per_pair_us: attention_flops / flops * 1e6,
            per_prompt_ms: 0.0,
        },
        decode: DecodeCost {
            fixed_ms: weights / bandwidth * 1e3,
            per_row_ms: 2.0 * active / flops * 1e3,
            per_context_us: kv_per_token / bandwidth * 1e6,
        },
        kv: KvCost {
            bytes_per_token: kv_per_token as u64,
            commit_fixed_ms: 0.1,
            commit_ms_per_mb: 1e6 / f64::from(m.layers) / link * 1e3,
        },
        worker: WorkerShape { block_size, kv_blocks, max_batch, max_position: m.max_position },
        wide: None,
        window: m.window,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_8b_on_one_h200_matches_the_hand_computed_roofline() {
        let hw = hardware("h200", 1).expect("h200");
        let m = model("llama-8b").expect("llama-8b");
        let c = roofline(&hw, &m, 16, 256).expect("fits");
        // 16.06 GB of weights at 0.7 x 4.8 TB/s = 3.36 TB/s: 4.78 ms per step.
        assert!((c.decode.fixed_ms - 16.06e9 / 3.36e12 * 1e3).abs() < 1e-6, "{}", c.decode.fixed_ms);
        // 2 x 8.03e9 FLOP at 0.5 x 989 TFLOP/s: 0.0325 ms per prompt token (~31k tok/s).
        assert!((c.prefill.per_token_ms - 0.032477).abs() < 1e-5, "{}", c.prefill.per_token_ms);
        // K and V: 2 x 32 layers x 8 heads x 128 x 2 bytes = 131,072 bytes per token.
        assert_eq!(c.kv.bytes_per_token, 131_072);
        // (126.9 GB - 16.06 GB) / (131,072 x 16) = 52,852 blocks.
        assert_eq!(c.worker.kv_blocks, 52_852);
        assert!(c.source.contains("h200") && c.source.contains("50%"));
        c.validate().expect("valid");
    }

    #[test]
    fn geometry_gives_the_published_parameter_counts_and_windows() {
        // Qwen2.5-7B: 7.61B; Qwen3-8B: 8.19B; Mistral-7B v0.3: 7.25B; Gemma-2-9B: 9.24B
        // (the model cards), each within 0.5% (norms and biases are left out).
        for (name, published) in
            [("qwen2.5-7b", 7.61e9), ("qwen3-8b", 8.19e9), ("mistral-7b", 7.25e9), ("gemma-2-9b", 9.24e9)]
        {
            let m = model(name).expect(name);
            assert!((m.params / published - 1.0).abs() < 0.005, "{name}: {} vs {published}", m.params);
        }
        // Qwen3-30B-A3B: 30.5B weights, 3.3B activated (its model card, which counts the
        // embedding table a token reads one row of; the roofline computes with the rest).
        let moe = model("qwen3-30b-a3b").expect("qwen3-30b-a3b");
        assert!((moe.params / 30.5e9 - 1.0).abs() < 0.01, "{}", moe.params);
        let active = moe.active_params.expect("active");
        assert!(((active + 151_936.0 * 2048.0) / 3.3e9 - 1.0).abs() < 0.02, "{active}");
        let hw = hardware("h200", 1).expect("h200");
        let c = roofline(&hw, &moe, 16, 256).expect("fits");
        assert!((c.prefill.per_token_ms - 2.0 * active / (989e12 * 0.5) * 1e3).abs() < 1e-12);
        assert!((c.decode.fixed_ms - 2.0 * moe.params / (4800e9 * 0.7) * 1e3).abs() < 1e-9);
        assert!(c.source.contains("mixture of experts"), "{}", c.source);
        let g3 = model("gemma-3-12b").expect("gemma-3-12b");
        assert_eq!(g3.window, Some(AttentionWindow { tokens: 1024, share: 40.0 / 48.0 }));
        assert_eq!(model("qwen3-8b").expect("qwen3").window, None);
    }

    /// Gemma-2-9B's sliding layers make long contexts cheaper than full attention would,
    /// and cost exactly as much below the window.
    #[test]
    fn windows_cut_attention_beyond_the_window_only() {
        let hw = hardware("h200", 1).expect("h200");
        let windowed = roofline(&hw, &model("gemma-2-9b").expect("gemma"), 16, 256).expect("fits");
        let full = WorkerCost { window: None, ..windowed.clone() };
        assert!(windowed.source.contains("50% of the layers attend over the last 4096 keys"), "{}", windowed.source);
        for (rows, context) in [(1, 1000), (8, 4096)] {
            let (w, f) = (windowed.attended(context), full.attended(context));
            assert_eq!(w, f, "below the window");
            assert_eq!(windowed.decode_step_ms(rows, rows * w, &[]), full.decode_step_ms(rows, rows * f, &[]));
        }
        // 8,000 keys: half the layers read 4,096 of them.
        assert_eq!(windowed.attended(8000), 8000 - (8000 - 4096) / 2);
        assert_eq!(windowed.prefill_step_ms(&[(512, 0)]), full.prefill_step_ms(&[(512, 0)]));
        let (w, f) = (windowed.prefill_step_ms(&[(2048, 6000)]), full.prefill_step_ms(&[(2048, 6000)]));
        // Full: 2048 x (6000 + 1024) pairs; windowed half: 2048 x 4096.
        let saved = 0.5 * 2048.0 * (7024.0 - 4096.0) * windowed.prefill.per_pair_us / 1e3;
        assert!((f - w - saved).abs() < 1e-9, "{f} - {w} vs {saved}");
        // A chunk across the window's edge: 100 queries from 4,000 keys.
        let (full_pairs, windowed_pairs) = windowed.window.expect("window").pairs(100.0, 4000.0);
        assert_eq!(full_pairs, 100.0 * 4050.0);
        assert_eq!(windowed_pairs, 96.0 * 4048.0 + 4.0 * 4096.0);
    }

    #[test]
    fn a_model_that_does_not_fit_says_so() {
        let hw = hardware("h100", 1).expect("h100");
        let m = model("llama-70b").expect("70b");
        let e = roofline(&hw, &m, 16, 256).expect_err("141 GB of weights on 80 GB");
        assert!(e.to_string().contains("more GPUs"), "{e}");
        let hw4 = hardware("h100", 4).expect("h100");
        assert!(roofline(&hw4, &m, 16, 256).is_ok());
    }
}
