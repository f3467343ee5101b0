//! Rotary position frequencies, with the context-extension schemes checkpoints declare
//! (Hugging Face's `rope_scaling` / `rope_parameters`, GGUF's `rope.scaling.*` keys and
//! `rope_freqs` tensor). Every Llama 3.1 and 3.2 checkpoint sets `llama3`; serving one with
//! plain frequencies gives wrong tokens without any error, so a scheme pd does not implement
//! is refused at load, never ignored.
//!
//! The formulas follow transformers' `modeling_rope_utils` (float32 throughout, as there).

use crate::error::{EngineError, Result};

/// How the base frequencies `theta^(-2i/d)` are changed.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum RopeScaling {
    #[default]
    None,
    /// Positions divided by `factor` (every frequency divided by it).
    Linear { factor: f32 },
    /// Llama 3.1's: long wavelengths divided by `factor`, short ones kept, a smooth ramp
    /// between `original_max / low_freq_factor` and `original_max / high_freq_factor`.
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max: usize },
    /// YaRN: interpolated and extrapolated frequencies blended by a ramp over dimensions,
    /// and cos/sin scaled by `attention_factor`.
    Yarn { factor: f32, original_max: usize, beta_fast: f32, beta_slow: f32, attention_factor: f32, truncate: bool },
    /// Per-frequency divisors as stored in a GGUF file's `rope_freqs.weight` (llama.cpp's
    /// form of Llama 3.1's scaling): frequency i is divided by `factors[i]`.
    Factors(Vec<f32>),
    /// LongRoPE (Phi-3.5, Phi-4-mini, Phi-3 128k): frequency i divided by `short[i]` when the
    /// served context fits the original one, by `long[i]` when it is longer, and cos/sin
    /// scaled by `attention_factor`. The set is chosen once per model by the context it
    /// serves (as llama.cpp chooses by its context size), never per sequence: transformers
    /// switches a whole forward pass to the long set once the sequence passes the original
    /// context, which would rotate a cached or shipped key differently from the query that
    /// meets it later.
    LongRope { short: Vec<f32>, long: Vec<f32>, original_max: usize, attention_factor: f32 },
}

impl RopeScaling {
    /// YaRN's default attention factor for `factor` (transformers' `get_mscale`).
    pub fn yarn_mscale(factor: f32, mscale: f32) -> f32 {
        if factor <= 1.0 {
            1.0
        } else {
            0.1 * mscale * factor.ln() + 1.0
        }
    }

    /// LongRoPE's default attention factor for a context `factor` times the original
    /// (transformers' and llama.cpp's `sqrt(1 + ln factor / ln original)`).
    pub fn longrope_attention(factor: f32, original_max: usize) -> f32 {
        if factor <= 1.0 {
            1.0
        } else {
            (1.0 + factor.ln() / (original_max as f32).ln()).sqrt()
        }
    }

    /// The frequencies of the `head_dim` rotated values of a head (one per pair) and the
    /// factor cos and sin are multiplied by, for a model serving `context` positions.
    pub fn frequencies(&self, head_dim: usize, theta: f32, context: usize) -> Result<(Vec<f32>, f32)> {
        let half = head_dim / 2;
        let base: Vec<f32> = (0..half).map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32)).collect();
        Ok(match self {
            RopeScaling::None => (base, 1.0),
            RopeScaling::Linear { factor } => (base.iter().map(|f| f / factor).collect(), 1.0),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max } => {
                let old = *original_max as f32;
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                let freqs = base.iter().map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    let scaled = if wavelen > low_wavelen { f / factor } else { f };
                    if wavelen < high_wavelen || wavelen > low_wavelen {
                        scaled
                    } else {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    }
                });
                (freqs.collect(), 1.0)
            }
            RopeScaling::Yarn { factor, original_max, beta_fast, beta_slow, attention_factor, truncate } => {
                let dim = head_dim as f32;
                let correction = |rotations: f32| {
                    dim * (*original_max as f32 / (rotations * 2.0 * std::f32::consts::PI)).ln() / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction(*beta_fast), correction(*beta_slow));
                if *truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                let freqs = base.iter().enumerate().map(|(i, &extrapolated)| {
                    let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                    let keep = 1.0 - ramp;
                    (extrapolated / factor) * (1.0 - keep) + extrapolated * keep
                });
                (freqs.collect(), *attention_factor)
            }
            RopeScaling::Factors(factors) => {
                if factors.len() != half {
                    return Err(EngineError::Metadata(format!(
                        "rope_freqs has {} values, the head has {half} frequencies",
                        factors.len()
                    )));
                }
                if let Some(bad) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
                    return Err(EngineError::Metadata(format!("rope_freqs holds {bad}, not a positive number")));
                }
                (base.iter().zip(factors).map(|(f, d)| f / d).collect(), 1.0)
            }
            RopeScaling::LongRope { short, long, original_max, attention_factor } => {
                let (name, factors) = if context > *original_max { ("long", long) } else { ("short", short) };
                if factors.len() != half {
                    return Err(EngineError::Metadata(format!(
                        "rope {name}_factor has {} values, the head rotates {half} frequencies",
                        factors.len()
                    )));
                }
                if let Some(bad) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
                    return Err(EngineError::Metadata(format!(
                        "rope {name}_factor holds {bad}, not a positive number"
                    )));
                }
                (base.iter().zip(factors).map(|(f, d)| f / d).collect(), *attention_factor)
            }
        })
    }

    /// Checks the parameters once, naming the one that is wrong.
    pub fn validate(&self) -> Result<()> {
        let positive = |name: &str, v: f32| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(EngineError::Metadata(format!("rope_scaling.{name} ({v}) must be a positive number")))
            }
        };
        match self {
            RopeScaling::None | RopeScaling::Factors(_) => Ok(()),
            RopeScaling::Linear { factor } => positive("factor", *factor),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max } => {
                positive("factor", *factor)?;
                positive("low_freq_factor", *low_freq_factor)?;
                positive("high_freq_factor", *high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    return Err(EngineError::Metadata(format!(
                        "rope_scaling.high_freq_factor ({high_freq_factor}) must exceed low_freq_factor ({low_freq_factor})"
                    )));
                }
                positive("original_max_position_embeddings", *original_max as f32)
            }
            RopeScaling::Yarn { factor, original_max, beta_fast, beta_slow, attention_factor, .. } => {
                positive("factor", *factor)?;
                positive("beta_fast", *beta_fast)?;
                positive("beta_slow", *beta_slow)?;
                positive("attention_factor", *attention_factor)?;
                positive("original_max_position_embeddings", *original_max as f32)
            }
            RopeScaling::LongRope { original_max, attention_factor, .. } => {
                positive("attention_factor", *attention_factor)?;
                positive("original_max_position_embeddings", *original_max as f32)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_keeps_short_wavelengths_and_divides_long_ones() {
        let s = RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max: 8192 };
        let (base, _) = RopeScaling::None.frequencies(128, 500_000.0, 8192).expect("valid");
        let (scaled, attention) = s.frequencies(128, 500_000.0, 8192).expect("valid");
        assert_eq!(attention, 1.0);
        assert_eq!(scaled[0], base[0], "the fastest frequency is kept");
        assert!((scaled[63] - base[63] / 8.0).abs() < 1e-12, "the slowest is divided by the factor");
        assert!(scaled.iter().zip(&base).all(|(s, b)| s <= b && *s >= b / 8.0 - 1e-12));
    }

    #[test]
    fn yarn_blends_between_interpolation_and_extrapolation() {
        let s = RopeScaling::Yarn {
            factor: 4.0,
            original_max: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: RopeScaling::yarn_mscale(4.0, 1.0),
            truncate: true,
        };
        let (base, _) = RopeScaling::None.frequencies(64, 10_000.0, 4096).expect("valid");
        let (scaled, attention) = s.frequencies(64, 10_000.0, 4096).expect("valid");
        assert!((attention - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6);
        assert_eq!(scaled[0], base[0]);
        assert!((scaled[31] - base[31] / 4.0).abs() < 1e-12);
    }

    #[test]
    fn bad_parameters_are_named() {
        let s = RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 4.0, high_freq_factor: 1.0, original_max: 8192 };
        assert!(s.validate().expect_err("refused").to_string().contains("high_freq_factor"));
        let s = RopeScaling::Linear { factor: 0.0 };
        assert!(s.validate().expect_err("refused").to_string().contains("rope_scaling.factor"));
        let err = RopeScaling::Factors(vec![1.0; 3]).frequencies(64, 10_000.0, 4096).expect_err("refused");
        assert!(err.to_string().contains("rope_freqs has 3 values"));
        let s =
            RopeScaling::LongRope { short: vec![1.0; 4], long: vec![2.0; 3], original_max: 16, attention_factor: 1.2 };
        assert!(s.frequencies(8, 10_000.0, 16).is_ok(), "the short set fits");
        let err = s.frequencies(8, 10_000.0, 17).expect_err("refused");
        assert!(err.to_string().contains("long_factor has 3 values"), "{err}");
    }

    #[test]
    fn longrope_picks_its_set_by_the_served_context() {
        let (short, long) = (vec![1.0, 2.0, 3.0, 4.0], vec![4.0, 8.0, 16.0, 32.0]);
        let s =
            RopeScaling::LongRope { short: short.clone(), long: long.clone(), original_max: 64, attention_factor: 1.5 };
        let (base, _) = RopeScaling::None.frequencies(8, 10_000.0, 64).expect("valid");
        for (context, factors) in [(64, &short), (65, &long)] {
            let (freqs, attention) = s.frequencies(8, 10_000.0, context).expect("valid");
            assert_eq!(attention, 1.5);
            for ((f, b), d) in freqs.iter().zip(&base).zip(factors) {
                assert!((f - b / d).abs() <= 1e-7 * b, "{f} vs {b} / {d}");
            }
        }
        let expected = (1.0 + 2f32.ln() / 4096f32.ln()).sqrt();
        assert!((RopeScaling::longrope_attention(2.0, 4096) - expected).abs() < 1e-7);
        assert_eq!(RopeScaling::longrope_attention(1.0, 4096), 1.0);
    }
}
