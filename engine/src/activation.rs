//! The gated MLP's activation, `act(gate) * up`, read from the fused `[rows, 2 * ffn]`
//! gate/up product. On the CPU it is one pass that writes only the `[rows, ffn]` result:
//! candle's ops wrote `act(gate)` to a tensor of its own first, 12 KiB per row at
//! Qwen3-0.6B's width, which was part of a 512-row prefill chunk's peak memory. Other devices
//! keep candle's ops. Both compute what candle's CPU kernels compute, element by element
//! (`silu(x) = x / (1 + e^-x)`, GELU's tanh form), so the paths agree to the last bit but for
//! libm's rounding of `exp` and `tanh`.

use candle_core::{CpuStorage, Device, Storage, Tensor};
use rayon::prelude::*;

use crate::config::Activation;
use crate::error::Result;

/// Rows per parallel task.
const ROWS_PER_TASK: usize = 16;

/// `act(gate_up[:, ..ffn]) * gate_up[:, ffn..]` as `[rows, ffn]`.
pub(crate) fn gated_activation(gate_up: &Tensor, ffn: usize, act: Activation) -> Result<Tensor> {
    let (rows, width) = gate_up.dims2()?;
    if let (Device::Cpu, true, 2) = (gate_up.device(), gate_up.is_contiguous(), width / ffn.max(1)) {
        if let Storage::Cpu(CpuStorage::F32(data)) = &*gate_up.storage_and_layout().0 {
            let offset = gate_up.layout().start_offset();
            let input = &data[offset..offset + rows * width];
            let mut out = vec![0f32; rows * ffn];
            out.par_chunks_mut(ffn * ROWS_PER_TASK).zip(input.par_chunks(width * ROWS_PER_TASK)).for_each(
                |(out, input)| {
                    for (out, row) in out.chunks_exact_mut(ffn).zip(input.chunks_exact(width)) {
                        let (gate, up) = row.split_at(ffn);
                        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                            *o = apply(act, g) * u;
                        }
                    }
                },
            );
            return Ok(Tensor::from_vec(out, (rows, ffn), gate_up.device())?);
        }
    }
    let gate = gate_up.narrow(1, 0, ffn)?;
    let gate = match act {
        Activation::Silu => candle_nn::ops::silu(&gate)?,
        Activation::GeluTanh => gate.gelu()?,
    };
    Ok((gate * gate_up.narrow(1, ffn, ffn)?)?)
}

/// One value's activation, as candle's CPU kernels write it.
fn apply(act: Activation, x: f32) -> f32 {
    match act {
        Activation::Silu => x / (1.0 + (-x).exp()),
        Activation::GeluTanh => {
            const SQRT_TWO_OVER_PI: f32 = 0.797_884_6;
            0.5 * x * (1.0 + (SQRT_TWO_OVER_PI * x * (1.0 + 0.044_715 * x * x)).tanh())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused pass equals candle's ops on the same values, for both activations, on a
    /// row count that leaves a partial task.
    #[test]
    fn fused_activation_equals_candles_ops() {
        let (rows, ffn) = (37, 48);
        let values: Vec<f32> = (0..rows * 2 * ffn).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 150.0).collect();
        let gate_up = Tensor::from_vec(values, (rows, 2 * ffn), &Device::Cpu).expect("tensor");
        for act in [Activation::Silu, Activation::GeluTanh] {
            let fused = gated_activation(&gate_up, ffn, act).expect("fused");
            let gate = gate_up.narrow(1, 0, ffn).expect("gate");
            let gate = match act {
                Activation::Silu => candle_nn::ops::silu(&gate).expect("silu"),
                Activation::GeluTanh => gate.gelu().expect("gelu"),
            };
            let reference = (gate * gate_up.narrow(1, ffn, ffn).expect("up")).expect("mul");
            assert_eq!(fused.dims(), reference.dims());
            let (fused, reference) = (fused.flatten_all().expect("f"), reference.flatten_all().expect("r"));
            let (fused, reference) = (fused.to_vec1::<f32>().expect("f"), reference.to_vec1::<f32>().expect("r"));
            for (i, (a, b)) in fused.iter().zip(&reference).enumerate() {
                assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{act:?} value {i}: {a} vs {b}");
            }
        }
    }
}
