//! Weight-only quantized matmul for decode steps: `x @ W^T` where `W` keeps the
//! checkpoint's own quantized values and `x` stays f32. Q4_1 blocks (32 weights: f16 scale
//! `d`, f16 minimum `m`, 4-bit `q`; weight = d * q + m) and Q8_0 blocks (f16 `d`, 8-bit `q`,
//! m = 0) are repacked at load, losslessly, into one layout the kernel widens cheaply: f32
//! `d` and `m` and 32 signed bytes, 40 bytes per 32 weights where f16 needs 64. Nothing is
//! rounded but what the file already rounded: unlike candle's Q8 path the activations keep
//! all their bits.
//!
//! Per block and row, `sum_j x_j (d q_j + m) = d * sum_j x_j q_j + m * sum_j x_j`; the block
//! sums of `x` are computed once per call. Like the f16 kernel, each weight block is widened
//! once for up to 4 rows, and each output's summation order depends only on its own row, so a
//! sequence gets the same numbers alone or in any batch.
//!
//! AVX2 + FMA are detected at run time; without them a portable loop computes the same
//! products (in another summation order).

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use half::f16;
use rayon::prelude::*;

use crate::error::{EngineError, Result};

/// Weights per block.
pub(crate) const QK: usize = 32;
/// Bytes of a stored Q4_1 block (f16 d, f16 m, 16 bytes of nibbles) and a Q8_0 block (f16 d,
/// 32 signed bytes).
const Q4_1_BYTES: usize = 20;
const Q8_0_BYTES: usize = 34;
/// Rows processed together against one weight row.
const ROW_BLOCK: usize = 4;
/// Outputs per parallel task.
const OUTPUTS_PER_TASK: usize = 64;

/// One block as the kernel reads it: weight j = d * q[j] + m, with m kept apart (`mins`).
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub(crate) struct Block {
    d: f32,
    q: [i8; QK],
}

/// Whether a stored tensor type can be repacked.
pub(crate) fn supported(dtype: GgmlDType) -> bool {
    matches!(dtype, GgmlDType::Q4_1 | GgmlDType::Q8_0)
}

/// A `[n, k]` weight matrix in blocks, row after row.
#[derive(Debug)]
pub(crate) struct WqWeight {
    blocks: Vec<Block>,
    /// Each block's minimum m, row after row (all zero for Q8_0): summed with the block sums
    /// of x in one vector pass per output instead of one scalar step per block.
    mins: Vec<f32>,
    n: usize,
    k: usize,
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

impl WqWeight {
    /// Q4_1 or Q8_0 tensors stacked by rows (all `[rows_i, k]`, `k` a multiple of 32).
    pub(crate) fn from_parts(parts: &[&QTensor]) -> Result<Self> {
        let k = parts.first().map(|p| p.shape().dims()[1]).unwrap_or(0);
        if k == 0 || !k.is_multiple_of(QK) {
            return Err(EngineError::InvalidBatch(format!(
                "Q4 weights need a width that is a multiple of {QK}, not {k}"
            )));
        }
        let (mut blocks, mut mins) = (Vec::new(), Vec::new());
        let mut n = 0;
        for part in parts {
            let dims = part.shape().dims();
            if !supported(part.dtype()) || dims.len() != 2 || dims[1] != k {
                return Err(EngineError::InvalidBatch(format!(
                    "not a [_, {k}] Q4_1 or Q8_0 tensor: {:?} {dims:?}",
                    part.dtype()
                )));
            }
            let data = part.data()?;
            let size = if part.dtype() == GgmlDType::Q4_1 { Q4_1_BYTES } else { Q8_0_BYTES };
            if data.len() != dims[0] * k / QK * size {
                return Err(EngineError::InvalidBatch(format!(
                    "{:?} tensor of {} bytes for {dims:?}",
                    part.dtype(),
                    data.len()
                )));
            }
            for b in data.chunks_exact(size) {
                let (block, m) = match part.dtype() {
                    GgmlDType::Q4_1 => {
                        let nibble = |j: usize| if j < QK / 2 { b[4 + j] & 0x0F } else { b[4 + j - QK / 2] >> 4 };
                        (Block { d: f16_at(b, 0), q: std::array::from_fn(|j| nibble(j) as i8) }, f16_at(b, 2))
                    }
                    _ => (Block { d: f16_at(b, 0), q: std::array::from_fn(|j| b[2 + j] as i8) }, 0.0),
                };
                blocks.push(block);
                mins.push(m);
            }
            n += dims[0];
        }
        Ok(WqWeight { blocks, mins, n, k })
    }

    /// The weights as an f32 `[n, k]` tensor (for many-row products, where gemm wins).
    pub(crate) fn dequantize(&self, device: &Device) -> Result<Tensor> {
        let mut out = Vec::with_capacity(self.n * self.k);
        for (b, m) in self.blocks.iter().zip(&self.mins) {
            out.extend(b.q.iter().map(|&q| f32::from(q) * b.d + m));
        }
        Ok(Tensor::from_vec(out, (self.n, self.k), device)?)
    }

    /// `x` `[m, k]` (f32, CPU) times the weights transposed, as `[m, n]`.
    pub(crate) fn matmul(&self, x: &Tensor) -> Result<Tensor> {
        let (m, k) = x.dims2()?;
        if k != self.k {
            return Err(EngineError::InvalidBatch(format!("matmul width {k} vs weight width {}", self.k)));
        }
        let x_all = x.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let nb = k / QK;
        // Each row's block sums, in a fixed order (the same alone or in a batch).
        let xsum: Vec<f32> = x_all.chunks_exact(QK).map(|c| c.iter().sum()).collect();
        let simd = simd_available();
        let mut yt = vec![0f32; self.n * m];
        // Row blocks outside, the task's outputs inside (x stays in L1; see `matmul.rs`).
        let task = |(task, y_chunk): (usize, &mut [f32])| {
            let first = task * OUTPUTS_PER_TASK;
            let outputs = y_chunk.len() / m;
            let w = |i: usize| {
                let rows = (first + i) * nb..(first + i + 1) * nb;
                (&self.blocks[rows.clone()], &self.mins[rows])
            };
            let mut r = 0;
            while r + ROW_BLOCK <= m {
                let (xr, sr) = (&x_all[r * k..(r + ROW_BLOCK) * k], &xsum[r * nb..(r + ROW_BLOCK) * nb]);
                for i in 0..outputs {
                    y_chunk[i * m + r..i * m + r + ROW_BLOCK].copy_from_slice(&dot_rows::<ROW_BLOCK>(
                        xr,
                        sr,
                        w(i),
                        simd,
                    ));
                }
                r += ROW_BLOCK;
            }
            for r in r..m {
                let (xr, sr) = (&x_all[r * k..(r + 1) * k], &xsum[r * nb..(r + 1) * nb]);
                for i in 0..outputs {
                    y_chunk[i * m + r] = dot_rows::<1>(xr, sr, w(i), simd)[0];
                }
            }
        };
        if rayon::current_num_threads() > 1 {
            yt.par_chunks_mut(OUTPUTS_PER_TASK * m).enumerate().for_each(task);
        } else {
            yt.chunks_mut(OUTPUTS_PER_TASK * m).enumerate().for_each(task);
        }
        Ok(Tensor::from_vec(crate::matmul::untranspose(&yt, m, self.n), (m, self.n), x.device())?)
    }
}

/// Whether this CPU has AVX2 and FMA (checked once).
fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `R` rows of `x` (each `nb * 32` long, block sums in `xsum`) with one weight row.
#[inline(always)]
fn dot_rows<const R: usize>(x: &[f32], xsum: &[f32], (w, mins): (&[Block], &[f32]), simd: bool) -> [f32; R] {
    let nb = w.len();
    assert_eq!(mins.len(), nb, "dot_rows: one minimum per block");
    assert!(x.len() >= R * nb * QK && xsum.len() >= R * nb, "dot_rows: slices shorter than {R} x {nb} blocks");
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: the features were detected at run time; the lengths were checked above.
        return unsafe { dot_rows_avx2::<R>(x, xsum, w, mins) };
    }
    let _ = simd;
    dot_rows_portable::<R>(x, xsum, w, mins)
}

fn dot_rows_portable<const R: usize>(x: &[f32], xsum: &[f32], w: &[Block], mins: &[f32]) -> [f32; R] {
    let nb = w.len();
    std::array::from_fn(|r| {
        let (mut scaled, mut minimum) = (0f32, 0f32);
        for (b, block) in w.iter().enumerate() {
            let xb = &x[(r * nb + b) * QK..(r * nb + b + 1) * QK];
            let dot = xb.iter().zip(&block.q).fold(0f32, |dot, (x, &q)| x.mul_add(f32::from(q), dot));
            scaled = dot.mul_add(block.d, scaled);
            minimum = xsum[r * nb + b].mul_add(mins[b], minimum);
        }
        scaled + minimum
    })
}

/// # Safety
/// The CPU must have AVX2 and FMA; `x` holds `R * w.len() * 32` values and `xsum`
/// `R * w.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_rows_avx2<const R: usize>(x: &[f32], xsum: &[f32], w: &[Block], mins: &[f32]) -> [f32; R] {
    use std::arch::x86_64::*;
    let nb = w.len();
    // Two accumulators per row (even and odd blocks) halve the FMA dependency chain.
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let xp = x.as_ptr();
    for (b, block) in w.iter().enumerate() {
        // SAFETY (all loads below): a block holds 32 bytes of q; x holds 32 values per block
        // and row (checked by the caller).
        let qp = block.q.as_ptr();
        let widen = |offset: usize| unsafe {
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(qp.add(offset).cast::<__m128i>())))
        };
        let q = [widen(0), widen(8), widen(16), widen(24)];
        let d = _mm256_set1_ps(block.d);
        for (r, row_acc) in acc.iter_mut().enumerate() {
            let row = unsafe { xp.add((r * nb + b) * QK) };
            let (x0, x1, x2, x3) = unsafe {
                (
                    _mm256_loadu_ps(row),
                    _mm256_loadu_ps(row.add(8)),
                    _mm256_loadu_ps(row.add(16)),
                    _mm256_loadu_ps(row.add(24)),
                )
            };
            let t01 = _mm256_fmadd_ps(x1, q[1], _mm256_mul_ps(x0, q[0]));
            let t23 = _mm256_fmadd_ps(x3, q[3], _mm256_mul_ps(x2, q[2]));
            row_acc[b & 1] = _mm256_fmadd_ps(_mm256_add_ps(t01, t23), d, row_acc[b & 1]);
        }
    }
    std::array::from_fn(|r| {
        // The minimums: 8 blocks per vector step, the rest one by one.
        let whole = nb / 8 * 8;
        let mut mv = _mm256_setzero_ps();
        for b in (0..whole).step_by(8) {
            // SAFETY: b + 8 <= nb, and mins and this row's xsum hold nb values.
            mv = unsafe {
                _mm256_fmadd_ps(
                    _mm256_loadu_ps(mins.as_ptr().add(b)),
                    _mm256_loadu_ps(xsum.as_ptr().add(r * nb + b)),
                    mv,
                )
            };
        }
        let tail = (whole..nb).fold(0f32, |t, b| xsum[r * nb + b].mul_add(mins[b], t));
        let sum = _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), mv);
        let mut lanes = [0f32; 8];
        // SAFETY: 8 f32 fit in `lanes`.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
        lanes.iter().sum::<f32>() + tail
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;

    fn quantized(n: usize, k: usize, dtype: GgmlDType) -> Result<QTensor> {
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
        Ok(QTensor::quantize(&w, dtype)?)
    }

    #[test]
    fn matches_the_f32_product_of_the_dequantized_weights_and_is_independent_of_batch() -> Result<()> {
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
            product_matches(dtype)?;
        }
        Ok(())
    }

    fn product_matches(dtype: GgmlDType) -> Result<()> {
        // n not a multiple of the task size: the edges are exercised.
        let (n, k) = (70, 96);
        let qt = quantized(n, k, dtype)?;
        let w = WqWeight::from_parts(&[&qt])?;
        let reference_w = qt.dequantize(&Device::Cpu)?;
        assert_eq!(w.dequantize(&Device::Cpu)?.to_vec2::<f32>()?, reference_w.to_vec2::<f32>()?, "same weights");
        let x = Tensor::randn(0f32, 1.0, (7, k), &Device::Cpu)?;
        let ours = w.matmul(&x)?;
        let reference = x.matmul(&reference_w.t()?)?;
        let diff = (&ours - &reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-4, "differs from the f32 product by {diff}");
        for row in 0..7 {
            let alone = w.matmul(&x.narrow(0, row, 1)?)?;
            let d = (alone - ours.narrow(0, row, 1)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(d, 0.0, "row {row} depends on its batch");
        }
        Ok(())
    }

    #[test]
    fn the_portable_loop_agrees_with_the_simd_kernel() -> Result<()> {
        let qt = quantized(3, 64, GgmlDType::Q4_1)?;
        let w = WqWeight::from_parts(&[&qt])?;
        let x: Vec<f32> = Tensor::randn(0f32, 1.0, (1, 64), &Device::Cpu)?.flatten_all()?.to_vec1()?;
        let xsum: Vec<f32> = x.chunks_exact(QK).map(|c| c.iter().sum()).collect();
        for o in 0..3 {
            let (row, mins) = (&w.blocks[o * 2..(o + 1) * 2], &w.mins[o * 2..(o + 1) * 2]);
            let portable = dot_rows_portable::<1>(&x, &xsum, row, mins)[0];
            let simd = dot_rows::<1>(&x, &xsum, (row, mins), simd_available())[0];
            assert!((portable - simd).abs() < 1e-4, "{portable} vs {simd}");
        }
        Ok(())
    }

    #[test]
    fn bad_shapes_are_refused_by_name() -> Result<()> {
        let q4k = quantized(4, 256, GgmlDType::Q4K)?;
        let e = WqWeight::from_parts(&[&q4k]).expect_err("Q4K is not repacked");
        assert!(e.to_string().contains("Q4_1 or Q8_0"), "{e}");
        let w = WqWeight::from_parts(&[&quantized(2, 32, GgmlDType::Q4_1)?])?;
        let e = w.matmul(&Tensor::zeros((1, 64), candle_core::DType::F32, &Device::Cpu)?).expect_err("width");
        assert!(e.to_string().contains("width 64"), "{e}");
        Ok(())
    }
}
