//! Mixture-of-experts MLP (Qwen3-MoE), computed as transformers computes it: router logits
//! `h @ R^T`, a softmax over the experts in f32, each row's `top_k` largest probabilities
//! (renormalised to sum to 1 with `norm_top_k`), each chosen expert's gated MLP run once on
//! all the rows that chose it, and the weighted outputs added into a zero tensor expert by
//! expert in ascending order (transformers' `index_add_` loop). Only the chosen experts run:
//! a token costs `top_k` experts' MLPs, not `experts`.
//!
//! Batch independence holds as for the dense MLP: an expert's projection of a row does not
//! depend on the other rows it runs with (`Linear`), and a row's sum is taken in expert order.

use std::borrow::Cow;

use candle_core::quantized::{QStorage, QTensor};
use candle_core::{Device, Tensor};

use crate::config::{Activation, MoeConfig, WeightFormat};
use crate::error::{EngineError, Result};
use crate::loader::{RawTensor, TensorSource};
use crate::model::{gated_mlp, linear, required, Linear};

/// One expert: a gated MLP of the expert width.
#[derive(Debug)]
struct Expert {
    gate_up: Linear,
    down: Linear,
}

/// A layer's router and experts.
#[derive(Debug)]
pub(crate) struct Moe {
    /// `[experts, hidden]`, f32.
    router: Tensor,
    experts: Vec<Expert>,
    top_k: usize,
    norm_top_k: bool,
    ffn: usize,
}

/// A `[experts, rows, k]` tensor as one `[rows, k]` tensor per expert (quantized blocks are
/// cut between experts, never widened).
fn split_experts(raw: RawTensor, name: &str, device: &Device) -> Result<Vec<RawTensor>> {
    let dims = raw.dims();
    let &[experts, rows, k] = dims.as_slice() else {
        return Err(EngineError::TensorShape { name: name.into(), got: dims.clone(), expected: vec![0, 0, 0] });
    };
    match raw {
        RawTensor::Dense(t) => (0..experts).map(|e| Ok(RawTensor::Dense(t.get(e)?))).collect(),
        RawTensor::Quant(q) => {
            let data = q.data()?;
            let per = data.len() / experts;
            (0..experts)
                .map(|e| {
                    let bytes = Cow::Owned(data[e * per..(e + 1) * per].to_vec());
                    let storage = QStorage::from_data(bytes, device, q.dtype())?;
                    Ok(RawTensor::Quant(QTensor::new(storage, (rows, k))?))
                })
                .collect()
        }
    }
}

impl Moe {
    /// Layer `layer`'s router (`ffn_gate_inp`) and experts (`ffn_gate_exps`, `ffn_up_exps`:
    /// `[experts, ffn, hidden]`; `ffn_down_exps`: `[experts, hidden, ffn]`).
    pub(crate) fn load(
        source: &mut dyn TensorSource,
        layer: usize,
        m: &MoeConfig,
        hidden: usize,
        format: WeightFormat,
        device: &Device,
    ) -> Result<Self> {
        let name = |part: &str| format!("blk.{layer}.{part}.weight");
        let router = required(source, &name("ffn_gate_inp"), &[m.experts, hidden])?.dequantize()?.to_device(device)?;
        let mut take = |part: &str, shape: &[usize]| -> Result<Vec<RawTensor>> {
            split_experts(required(source, &name(part), shape)?, &name(part), device)
        };
        let gates = take("ffn_gate_exps", &[m.experts, m.ffn, hidden])?;
        let ups = take("ffn_up_exps", &[m.experts, m.ffn, hidden])?;
        let downs = take("ffn_down_exps", &[m.experts, hidden, m.ffn])?;
        let experts = gates
            .into_iter()
            .zip(ups)
            .zip(downs)
            .map(|((gate, up), down)| {
                Ok(Expert {
                    gate_up: linear(vec![gate, up], format, device)?,
                    down: linear(vec![down], format, device)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Moe { router, experts, top_k: m.top_k, norm_top_k: m.norm_top_k, ffn: m.ffn })
    }

    /// The MLP output `[rows, hidden]` for `h` `[rows, hidden]`.
    pub(crate) fn forward(&self, h: &Tensor, activation: Activation) -> Result<Tensor> {
        let device = h.device();
        let logits = h.matmul(&self.router.t()?)?;
        let probs = candle_nn::ops::softmax_last_dim(&logits)?.to_vec2::<f32>()?;
        let mut chosen: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); self.experts.len()];
        for (row, p) in probs.iter().enumerate() {
            for (expert, weight) in route(p, self.top_k, self.norm_top_k) {
                chosen[expert].0.push(row as u32);
                chosen[expert].1.push(weight);
            }
        }
        let mut out = h.zeros_like()?;
        for (expert, (rows, weights)) in self.experts.iter().zip(chosen) {
            if rows.is_empty() {
                continue;
            }
            let n = rows.len();
            let rows = Tensor::from_vec(rows, n, device)?;
            let y = gated_mlp(&expert.gate_up, &expert.down, &h.index_select(&rows, 0)?, self.ffn, activation)?;
            let y = y.broadcast_mul(&Tensor::from_vec(weights, (n, 1), device)?)?;
            out = out.index_add(&rows, &y, 0)?;
        }
        Ok(out)
    }
}

/// A row's experts and weights: the `top_k` largest of `probs` (ties to the lower expert),
/// largest first, renormalised to sum to 1 when `norm`.
fn route(probs: &[f32], top_k: usize, norm: bool) -> Vec<(usize, f32)> {
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    order.truncate(top_k);
    let total: f32 = order.iter().map(|&e| probs[e]).sum();
    order.into_iter().map(|e| (e, if norm { probs[e] / total } else { probs[e] })).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_takes_its_largest_experts_renormalised_or_not() {
        let probs = [0.1, 0.4, 0.2, 0.3];
        assert_eq!(route(&probs, 2, false), vec![(1, 0.4), (3, 0.3)]);
        let normed = route(&probs, 2, true);
        assert_eq!(normed.iter().map(|r| r.0).collect::<Vec<_>>(), [1, 3]);
        assert!((normed[0].1 - 0.4 / 0.7).abs() < 1e-7 && (normed[1].1 - 0.3 / 0.7).abs() < 1e-7);
        // Ties go to the lower expert.
        assert_eq!(route(&[0.25; 4], 1, false), vec![(0, 0.25)]);
    }

    #[test]
    fn quantized_experts_are_cut_between_experts() -> Result<()> {
        let dense = Tensor::randn(0f32, 1.0, (3, 4, 64), &Device::Cpu)?;
        let q = QTensor::quantize(&dense, candle_core::quantized::GgmlDType::Q8_0)?;
        let whole = q.dequantize(&Device::Cpu)?;
        let parts = split_experts(RawTensor::Quant(q), "experts", &Device::Cpu)?;
        assert_eq!(parts.len(), 3);
        for (e, part) in parts.iter().enumerate() {
            assert_eq!(part.dims(), [4, 64]);
            let diff = (part.dequantize()? - whole.get(e)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "expert {e}");
        }
        let e =
            split_experts(RawTensor::Dense(dense.get(0)?), "blk.0.ffn_up_exps.weight", &Device::Cpu).expect_err("2-D");
        assert!(e.to_string().contains("blk.0.ffn_up_exps.weight"), "{e}");
        Ok(())
    }
}
