//! `x @ W^T` for the few rows of a decode step, on CPU, with f32 or f16 weights (f16 is
//! widened to f32 as it is loaded; the arithmetic is f32 either way).
//!
//! A general gemm packs the weight matrix on every call, so with 1-16 rows it costs about as
//! much per row as a whole matrix pass: a batch of 4 took 4x the time of 1. This kernel reads
//! each weight row once for all rows of the batch (decode is bound by reading weights) and
//! keeps 4 rows x 8 lanes of partial sums in registers. Each output's summation order depends
//! only on its own row, so a sequence gets the same numbers alone or in any batch.
//!
//! With AVX-512 (detected at run time, `simd`) the same loop runs on 16 lanes: at batch 4-16
//! the kernel is bound by FMA and f16-widening throughput, which the wider registers double.

use candle_core::{DType, Storage, Tensor};
use half::f16;
use rayon::prelude::*;

use crate::error::{EngineError, Result};
use crate::simd::Widen as WeightElem;

/// Rows processed together against one weight row.
const ROW_BLOCK: usize = 4;
/// Independent accumulators per row (hides FMA latency when a batch has one row).
const ACCS: usize = 3;
/// Lanes of one partial sum (one AVX register of f32).
const LANES: usize = 8;
/// Accumulators per row and lanes of each on the AVX-512 path (4 x 16 = 64 weights per
/// step: the model widths 576 and 1536 are multiples, so there is no tail).
const ACCS_512: usize = 4;
const LANES_512: usize = 16;
/// Outputs per parallel task.
const OUTPUTS_PER_TASK: usize = 64;

/// `x` `[m, k]` (f32) times `weight` `[n, k]` (f32 or f16) transposed, as `[m, n]`, on CPU.
pub(crate) fn small_m_matmul(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let (n, k_w) = weight.dims2()?;
    if k != k_w {
        return Err(EngineError::InvalidBatch(format!("matmul width {k} vs weight width {k_w}")));
    }
    let x = x.contiguous()?;
    let (x_storage, x_layout) = x.storage_and_layout();
    let (w_storage, w_layout) = weight.storage_and_layout();
    let (Storage::Cpu(x_cpu), Storage::Cpu(w_cpu)) = (&*x_storage, &*w_storage) else {
        return Err(EngineError::InvalidBatch("small-m matmul needs CPU tensors".into()));
    };
    if !w_layout.is_contiguous() {
        return Err(EngineError::InvalidBatch("small-m matmul needs a contiguous weight".into()));
    }
    let x_all = &x_cpu.as_slice::<f32>()?[x_layout.start_offset()..x_layout.start_offset() + m * k];
    let w_range = w_layout.start_offset()..w_layout.start_offset() + n * k;
    let wide = crate::simd::avx512();
    let yt = match weight.dtype() {
        DType::F32 => transposed_product(x_all, &w_cpu.as_slice::<f32>()?[w_range], m, k, wide),
        DType::F16 => transposed_product(x_all, &w_cpu.as_slice::<f16>()?[w_range], m, k, wide),
        other => {
            return Err(EngineError::InvalidBatch(format!("small-m matmul has no {other:?} weights")));
        }
    };
    drop(x_storage);
    Ok(Tensor::from_vec(untranspose(&yt, m, n), (m, n), x.device())?)
}

/// `[n, m]` as `[m, n]`, in tiles of 64 outputs: row by row, the writes of a tile are
/// contiguous and its reads stay in L1 (element by element with stride n, the copy of a
/// 16-row lm_head output took 6% of a decode step).
pub(crate) fn untranspose(yt: &[f32], m: usize, n: usize) -> Vec<f32> {
    const TILE: usize = 64;
    let mut y = vec![0f32; m * n];
    for first in (0..n).step_by(TILE) {
        let last = (first + TILE).min(n);
        for r in 0..m {
            let row = &mut y[r * n + first..r * n + last];
            for (o, value) in row.iter_mut().enumerate() {
                *value = yt[(first + o) * m + r];
            }
        }
    }
    y
}

/// The product as `[n, m]` (one output's values for all rows together).
fn transposed_product<W: WeightElem>(x_all: &[f32], w_all: &[W], m: usize, k: usize, wide: bool) -> Vec<f32> {
    let n = w_all.len() / k;
    // Output transposed ([n, m]) so parallel tasks own disjoint slices.
    let mut yt = vec![0f32; n * m];
    // Row blocks outside, the task's outputs inside: one block of x (4 rows) stays in L1
    // while the task's weight rows come from L2. The other way round, 16 rows of x (up to
    // 96 KiB) were streamed from L2 for every output, and batch 16 cost more than 4x batch 4.
    let task = |(task, y_chunk): (usize, &mut [f32])| {
        let first = task * OUTPUTS_PER_TASK;
        let outputs = y_chunk.len() / m;
        let w_row = |i: usize| &w_all[(first + i) * k..(first + i + 1) * k];
        let mut r = 0;
        while r + ROW_BLOCK <= m {
            let x_block = &x_all[r * k..(r + ROW_BLOCK) * k];
            for i in 0..outputs {
                y_chunk[i * m + r..i * m + r + ROW_BLOCK].copy_from_slice(&dot_rows::<ROW_BLOCK, W>(
                    x_block,
                    w_row(i),
                    k,
                    wide,
                ));
            }
            r += ROW_BLOCK;
        }
        for r in r..m {
            let row = &x_all[r * k..(r + 1) * k];
            for i in 0..outputs {
                y_chunk[i * m + r] = dot_rows::<1, W>(row, w_row(i), k, wide)[0];
            }
        }
    };
    // With one thread, handing work to rayon's pool only adds a thread switch per call.
    if rayon::current_num_threads() > 1 {
        yt.par_chunks_mut(OUTPUTS_PER_TASK * m).enumerate().for_each(task);
    } else {
        yt.chunks_mut(OUTPUTS_PER_TASK * m).enumerate().for_each(task);
    }
    yt
}

/// Dot products of `R` rows of `x` (each `k` long) with one weight row. Every row's sum is
/// formed the same way whatever `R` is (`ACCS` 8-lane FMA accumulators over interleaved
/// chunks, added in order, lanes added in order, then the scalar tail; on the AVX-512 path
/// `ACCS_512` 16-lane ones), so results do not depend on the batch. `wide` selects the
/// AVX-512 path and must be the same for every call of a process (`simd::avx512`).
#[inline(always)]
fn dot_rows<const R: usize, W: WeightElem>(x: &[f32], w: &[W], k: usize, wide: bool) -> [f32; R] {
    assert!(x.len() >= R * k && w.len() >= k, "dot_rows: slices shorter than {R} x {k}");
    #[cfg(target_arch = "x86_64")]
    if wide {
        let whole = k / (ACCS_512 * LANES_512) * (ACCS_512 * LANES_512);
        // SAFETY: `wide` is only true when AVX-512 F was detected; lengths checked above.
        let sums = unsafe { row_sums_avx512::<R, W>(x, w, k, whole) };
        return std::array::from_fn(|r| {
            let tail: f32 = (whole..k).map(|i| x[r * k + i] * w[i].to_f32()).sum();
            sums[r] + tail
        });
    }
    let _ = wide;
    let whole = k / (ACCS * LANES) * (ACCS * LANES);
    let lanes = lane_sums::<R, W>(x, w, k, whole);
    std::array::from_fn(|r| {
        let tail: f32 = (whole..k).map(|i| x[r * k + i] * w[i].to_f32()).sum();
        lanes[r].iter().sum::<f32>() + tail
    })
}

/// Per row, 8 lane sums over `0..whole` (a multiple of ACCS * 8) with AVX2 + FMA.
#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
#[inline(always)]
fn lane_sums<const R: usize, W: WeightElem>(x: &[f32], w: &[W], k: usize, whole: usize) -> [[f32; LANES]; R] {
    use std::arch::x86_64::*;
    let mut out = [[0f32; LANES]; R];
    // SAFETY: the caller checked x.len() >= R * k and w.len() >= k, and whole <= k, so every
    // load reads inside the slices; AVX2, FMA and F16C are enabled at compile time (cfg above).
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); ACCS]; R];
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut c = 0;
        while c < whole {
            let wv: [__m256; ACCS] = std::array::from_fn(|a| W::load8(wp.add(c + a * LANES)));
            for (r, row_acc) in acc.iter_mut().enumerate() {
                let row = xp.add(r * k + c);
                for (a, lane_acc) in row_acc.iter_mut().enumerate() {
                    *lane_acc = _mm256_fmadd_ps(_mm256_loadu_ps(row.add(a * LANES)), wv[a], *lane_acc);
                }
            }
            c += ACCS * LANES;
        }
        for r in 0..R {
            let sum = acc[r][1..].iter().fold(acc[r][0], |total, &a| _mm256_add_ps(total, a));
            _mm256_storeu_ps(out[r].as_mut_ptr(), sum);
        }
    }
    out
}

/// Per row, the sum over `0..whole` (a multiple of ACCS_512 * 16) with AVX-512: the AVX2
/// loop on 16 lanes, lanes added by the CPU's fixed reduction order.
///
/// # Safety
/// The CPU must have AVX-512 F; `x` holds `R * k` values and `w` at least `k`, `whole <= k`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn row_sums_avx512<const R: usize, W: WeightElem>(x: &[f32], w: &[W], k: usize, whole: usize) -> [f32; R] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); ACCS_512]; R];
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut c = 0;
    while c < whole {
        // SAFETY (all loads): c + ACCS_512 * 16 <= whole <= k, inside w and each row of x.
        let wv: [__m512; ACCS_512] = std::array::from_fn(|a| unsafe { W::load16(wp.add(c + a * LANES_512)) });
        for (r, row_acc) in acc.iter_mut().enumerate() {
            let row = unsafe { xp.add(r * k + c) };
            for (a, lane_acc) in row_acc.iter_mut().enumerate() {
                *lane_acc = _mm512_fmadd_ps(unsafe { _mm512_loadu_ps(row.add(a * LANES_512)) }, wv[a], *lane_acc);
            }
        }
        c += ACCS_512 * LANES_512;
    }
    std::array::from_fn(|r| {
        let sum = acc[r][1..].iter().fold(acc[r][0], |total, &a| _mm512_add_ps(total, a));
        _mm512_reduce_add_ps(sum)
    })
}

/// Portable version of the AVX2 lane sums, same summation order.
#[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c")))]
#[inline(always)]
fn lane_sums<const R: usize, W: WeightElem>(x: &[f32], w: &[W], k: usize, whole: usize) -> [[f32; LANES]; R] {
    let mut out = [[0f32; LANES]; R];
    for r in 0..R {
        let mut acc = [[0f32; LANES]; ACCS];
        for c in (0..whole).step_by(ACCS * LANES) {
            for (a, lanes) in acc.iter_mut().enumerate() {
                for l in 0..LANES {
                    let i = c + a * LANES + l;
                    lanes[l] = x[r * k + i].mul_add(w[i].to_f32(), lanes[l]);
                }
            }
        }
        for l in 0..LANES {
            out[r][l] = acc[1..].iter().fold(acc[0][l], |total, a| total + a[l]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn matches_candle_matmul_and_is_independent_of_batch() -> Result<()> {
        let dev = Device::Cpu;
        // k not a multiple of 8 and n not a multiple of the task size: the edges are exercised.
        let (k, n) = (37, 70);
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
        let x = Tensor::randn(0f32, 1.0, (7, k), &dev)?;
        let ours = small_m_matmul(&x, &w)?;
        let reference = x.matmul(&w.t()?)?;
        let diff = (&ours - &reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-4, "differs from candle by {diff}");
        for row in 0..7 {
            let alone = small_m_matmul(&x.narrow(0, row, 1)?, &w)?;
            let in_batch = ours.narrow(0, row, 1)?;
            let d = (alone - in_batch)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(d, 0.0, "row {row} depends on its batch");
        }
        Ok(())
    }

    #[test]
    fn the_avx512_and_avx2_paths_agree() -> Result<()> {
        if crate::simd::detected() != crate::simd::Level::Avx512 {
            eprintln!("skipped: this CPU has no AVX-512");
            return Ok(());
        }
        // 576 = 9 x 64: no tail on either path; 100: both have one.
        for k in [576, 100] {
            let w = Tensor::randn(0f32, 1.0, (70, k), &Device::Cpu)?.to_dtype(DType::F16)?;
            let x: Vec<f32> = Tensor::randn(0f32, 1.0, (5, k), &Device::Cpu)?.flatten_all()?.to_vec1()?;
            let w: Vec<f16> = w.flatten_all()?.to_vec1()?;
            let wide = transposed_product(&x, &w, 5, k, true);
            let narrow = transposed_product(&x, &w, 5, k, false);
            let d = wide.iter().zip(&narrow).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(d < 1e-3, "k {k}: paths differ by {d}");
        }
        Ok(())
    }

    #[test]
    fn f16_weights_match_f32_weights_of_the_same_values() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (40, 64), &dev)?.to_dtype(DType::F16)?;
        let x = Tensor::randn(0f32, 1.0, (3, 64), &dev)?;
        let from_f16 = small_m_matmul(&x, &w)?;
        let from_f32 = small_m_matmul(&x, &w.to_dtype(DType::F32)?)?;
        let d = (from_f16 - from_f32)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(d, 0.0, "widening f16 in the kernel must equal widening beforehand");
        Ok(())
    }
}
