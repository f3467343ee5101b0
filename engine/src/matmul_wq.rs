//! Weight-only quantized matmul for decode steps: `x @ W^T` where `W` keeps the
//! checkpoint's own quantized values and `x` stays f32. Q4_1 blocks (32 weights: f16 scale
//! `d`, f16 minimum `m`, 4-bit `q`; weight = d * q + m) and Q8_0 blocks (f16 `d`, 8-bit `q`,
//! m = 0) are repacked at load, losslessly, into layouts the kernel widens cheaply: a matrix
//! of Q4_1 parts keeps its nibbles (16 bytes per 32 weights), anything else becomes 32
//! signed bytes; the f16 scales `d` and minimums `m` (`m` only where some part has one) are
//! kept apart, as stored, so the weights take what the file takes (20 bytes per 32 Q4_1
//! weights, where f16 weights need 64). The kernels widen 16 (AVX-512) or 8 (AVX2 + F16C)
//! scales with one instruction into a stack buffer, then run those blocks: widening each
//! block's own scale inside the loop made decode steps 1.5x slower with AVX-512, and widening
//! a task's scales into a heap buffer first made 4-row steps 15% slower. Nothing is rounded
//! but what the file already rounded: unlike candle's Q8 path the activations keep all
//! their bits.
//!
//! Per block and row, `sum_j x_j (d q_j + m) = d * sum_j x_j q_j + m * sum_j x_j`; the block
//! sums of `x` are computed once per call (AVX2 and portable kernels; the AVX-512 one widens
//! `d q + m` once per block for all rows). Like the f16 kernel, each weight block is widened
//! once for up to 4 rows, and each output's summation order depends only on its own row, so a
//! sequence gets the same numbers alone or in any batch.
//!
//! AVX-512 (widened blocks pre-scaled by `d` once for all rows, 16 lanes) and AVX2 + FMA are
//! detected at run time; without them a portable loop computes the same products (in
//! another summation order).

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

/// The 32 quantized values of a block as the kernels read them: weight j = d * q(j) + m,
/// with the block's `d` and `m` kept apart.
pub(crate) trait QBlock: Copy + Send + Sync {
    /// The j-th quantized value, as f32.
    fn q(&self, j: usize) -> f32;
    /// The 32 values widened to f32, 8 lanes each (positions 0-7, 8-15, 16-23, 24-31).
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen8(&self) -> [std::arch::x86_64::__m256; 4];
    /// The 32 values widened to f32, 16 lanes each (positions 0-15, 16-31).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen16(&self) -> [std::arch::x86_64::__m512; 2];
}

/// 32 signed bytes.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub(crate) struct Block8 {
    q: [i8; QK],
}

/// 4-bit values as the Q4_1 file stores them: byte j holds value j (low nibble) and value
/// j + 16 (high nibble).
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub(crate) struct Block4 {
    q: [u8; QK / 2],
}

impl QBlock for Block8 {
    fn q(&self, j: usize) -> f32 {
        f32::from(self.q[j])
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn widen8(&self) -> [std::arch::x86_64::__m256; 4] {
        use std::arch::x86_64::*;
        let p = self.q.as_ptr();
        // SAFETY: each load reads 8 of the block's 32 bytes.
        std::array::from_fn(|i| unsafe {
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8 * i).cast::<__m128i>())))
        })
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn widen16(&self) -> [std::arch::x86_64::__m512; 2] {
        use std::arch::x86_64::*;
        let p = self.q.as_ptr();
        // SAFETY: each load reads 16 of the block's 32 bytes.
        std::array::from_fn(|i| unsafe {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(16 * i).cast::<__m128i>())))
        })
    }
}

impl QBlock for Block4 {
    fn q(&self, j: usize) -> f32 {
        f32::from(if j < QK / 2 { self.q[j] & 0x0F } else { self.q[j - QK / 2] >> 4 })
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn widen8(&self) -> [std::arch::x86_64::__m256; 4] {
        use std::arch::x86_64::*;
        // SAFETY: one 16-byte load of the block's nibbles.
        let raw = unsafe { _mm_loadu_si128(self.q.as_ptr().cast::<__m128i>()) };
        let low_nibbles = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(raw, low_nibbles);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), low_nibbles);
        let widen = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
        [widen(lo), widen(_mm_srli_si128::<8>(lo)), widen(hi), widen(_mm_srli_si128::<8>(hi))]
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn widen16(&self) -> [std::arch::x86_64::__m512; 2] {
        use std::arch::x86_64::*;
        // SAFETY: one 16-byte load of the block's nibbles.
        let bytes = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(self.q.as_ptr().cast::<__m128i>()) });
        let lo = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F));
        let hi = _mm512_srli_epi32::<4>(bytes);
        [_mm512_cvtepi32_ps(lo), _mm512_cvtepi32_ps(hi)]
    }
}

/// Whether a stored tensor type can be repacked.
pub(crate) fn supported(dtype: GgmlDType) -> bool {
    matches!(dtype, GgmlDType::Q4_1 | GgmlDType::Q8_0)
}

/// The blocks of a matrix, row after row, in one of the two layouts.
#[derive(Debug)]
enum Blocks {
    Nibbles(Vec<Block4>),
    Bytes(Vec<Block8>),
}

/// A `[n, k]` weight matrix in blocks, row after row.
#[derive(Debug)]
pub(crate) struct WqWeight {
    blocks: Blocks,
    /// Each block's scale d, row after row.
    scales: Vec<f16>,
    /// Each block's minimum m, row after row; `None` when every part is Q8_0 (all zero).
    /// The AVX-512 kernel folds m into the widened weights; the others add `m * sum(x)` per
    /// block in one vector pass per output, from block sums of x computed once per call.
    mins: Option<Vec<f16>>,
    n: usize,
    k: usize,
}

fn f16_at(b: &[u8], i: usize) -> f16 {
    f16::from_le_bytes([b[i], b[i + 1]])
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
        let nibbles = parts.iter().all(|p| p.dtype() == GgmlDType::Q4_1);
        let any_min = parts.iter().any(|p| p.dtype() == GgmlDType::Q4_1);
        // Exact sizes up front: vectors grown by pushing end up to twice the size they hold,
        // over pages the load's freed buffers had already made resident.
        let total: usize = parts.iter().map(|p| p.shape().elem_count() / QK).sum();
        let (mut b4, mut b8) =
            if nibbles { (Vec::with_capacity(total), Vec::new()) } else { (Vec::new(), Vec::with_capacity(total)) };
        let mut scales = Vec::with_capacity(total);
        let mut mins = Vec::with_capacity(if any_min { total } else { 0 });
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
                match part.dtype() {
                    GgmlDType::Q4_1 => {
                        let block = Block4 { q: std::array::from_fn(|j| b[4 + j]) };
                        if nibbles {
                            b4.push(block);
                        } else {
                            b8.push(Block8 { q: std::array::from_fn(|j| block.q(j) as i8) });
                        }
                        scales.push(f16_at(b, 0));
                        mins.push(f16_at(b, 2));
                    }
                    _ => {
                        b8.push(Block8 { q: std::array::from_fn(|j| b[2 + j] as i8) });
                        scales.push(f16_at(b, 0));
                        if any_min {
                            mins.push(f16::ZERO);
                        }
                    }
                }
            }
            n += dims[0];
        }
        let blocks = if nibbles { Blocks::Nibbles(b4) } else { Blocks::Bytes(b8) };
        Ok(WqWeight { blocks, scales, mins: any_min.then_some(mins), n, k })
    }

    /// The weights as an f32 `[n, k]` tensor (for many-row products, where gemm wins).
    pub(crate) fn dequantize(&self, device: &Device) -> Result<Tensor> {
        let mut out = Vec::with_capacity(self.n * self.k);
        self.widen_blocks(0..self.n * self.k / QK, &mut out);
        Ok(Tensor::from_vec(out, (self.n, self.k), device)?)
    }

    /// Rows `ids` as an f32 `[ids.len(), k]` tensor: a tied model's token embeddings, read
    /// from its output projection instead of a second copy of the table. The values are
    /// candle's dequantization of the stored blocks (`d * q + m`), bit for bit.
    pub(crate) fn rows(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        let nb = self.k / QK;
        let mut out = Vec::with_capacity(ids.len() * self.k);
        for &id in ids {
            let id = id as usize;
            if id >= self.n {
                return Err(EngineError::InvalidBatch(format!("row {id} of a {}-row matrix", self.n)));
            }
            self.widen_blocks(id * nb..(id + 1) * nb, &mut out);
        }
        Ok(Tensor::from_vec(out, (ids.len(), self.k), device)?)
    }

    /// Appends the f32 values of blocks `range` (row-major block indices) to `out`.
    fn widen_blocks(&self, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
        fn values<B: QBlock>(blocks: &[B], scales: &[f16], mins: Option<&[f16]>, out: &mut Vec<f32>) {
            for (i, b) in blocks.iter().enumerate() {
                let (d, m) = (scales[i].to_f32(), mins.map_or(0.0, |m| m[i].to_f32()));
                out.extend((0..QK).map(|j| b.q(j) * d + m));
            }
        }
        let (scales, mins) = (&self.scales[range.clone()], self.mins.as_ref().map(|m| &m[range.clone()]));
        match &self.blocks {
            Blocks::Nibbles(b) => values(&b[range], scales, mins, out),
            Blocks::Bytes(b) => values(&b[range], scales, mins, out),
        }
    }

    /// Bytes the weights take in memory.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        let blocks = match &self.blocks {
            Blocks::Nibbles(b) => std::mem::size_of_val(b.as_slice()),
            Blocks::Bytes(b) => std::mem::size_of_val(b.as_slice()),
        };
        blocks
            + std::mem::size_of_val(self.scales.as_slice())
            + self.mins.as_ref().map_or(0, |m| std::mem::size_of_val(m.as_slice()))
    }

    /// `x` `[m, k]` (f32, CPU) times the weights transposed, as `[m, n]`.
    pub(crate) fn matmul(&self, x: &Tensor) -> Result<Tensor> {
        let (m, k) = x.dims2()?;
        if k != self.k {
            return Err(EngineError::InvalidBatch(format!("matmul width {k} vs weight width {}", self.k)));
        }
        let x = x.contiguous()?;
        let y = match &*x.storage_and_layout().0 {
            candle_core::Storage::Cpu(candle_core::CpuStorage::F32(data)) => {
                let offset = x.layout().start_offset();
                self.product_of(&data[offset..offset + m * k], m)
            }
            _ => self.product_of(&x.flatten_all()?.to_vec1::<f32>()?, m),
        };
        Ok(Tensor::from_vec(y, (m, self.n), x.device())?)
    }

    fn product_of(&self, x_all: &[f32], m: usize) -> Vec<f32> {
        match &self.blocks {
            Blocks::Nibbles(b) => self.product(b, x_all, m, simd()),
            Blocks::Bytes(b) => self.product(b, x_all, m, simd()),
        }
    }

    /// The product as `[m, n]`. Each task owns `OUTPUTS_PER_TASK` outputs (columns) of every
    /// row, so the weights are split between threads and each is read once per 4 rows. The
    /// tasks write their columns straight into the row-major result: a task-owned transposed
    /// copy, turned back afterwards, took 3% of the CPU time of prefill in 512-row chunks (perf)
    /// and as much memory again as the result.
    fn product<B: QBlock>(&self, blocks: &[B], x_all: &[f32], m: usize, simd: Simd) -> Vec<f32> {
        let (k, nb, n) = (self.k, self.k / QK, self.n);
        // Each row's block sums, in a fixed order (the same alone or in a batch); only needed
        // for the minimums.
        let xsum: Vec<f32> = if self.mins.is_some() && simd != Simd::Avx512 {
            x_all.chunks_exact(QK).map(|c| c.iter().sum()).collect()
        } else {
            Vec::new()
        };
        let mut y = vec![0f32; m * n];
        let out = Columns { ptr: y.as_mut_ptr(), len: y.len() };
        // Row blocks outside, the task's outputs inside (x stays in L1; see `matmul.rs`).
        let task = |task: usize| {
            let first = task * OUTPUTS_PER_TASK;
            let outputs = OUTPUTS_PER_TASK.min(n - first);
            let w = |i: usize| {
                let rows = (first + i) * nb..(first + i + 1) * nb;
                (&blocks[rows.clone()], &self.scales[rows.clone()], self.mins.as_ref().map(|m| &m[rows]))
            };
            let sums = |r: usize, rows: usize| if xsum.is_empty() { &[][..] } else { &xsum[r * nb..(r + rows) * nb] };
            let mut r = 0;
            while r + ROW_BLOCK <= m {
                let (xr, sr) = (&x_all[r * k..(r + ROW_BLOCK) * k], sums(r, ROW_BLOCK));
                for i in 0..outputs {
                    for (j, value) in dot_rows::<ROW_BLOCK, B>(xr, sr, w(i), simd).into_iter().enumerate() {
                        // SAFETY: column first + i belongs to this task alone; r + j < m.
                        unsafe { out.set((r + j) * n + first + i, value) };
                    }
                }
                r += ROW_BLOCK;
            }
            for r in r..m {
                let (xr, sr) = (&x_all[r * k..(r + 1) * k], sums(r, 1));
                for i in 0..outputs {
                    // SAFETY: as above.
                    unsafe { out.set(r * n + first + i, dot_rows::<1, B>(xr, sr, w(i), simd)[0]) };
                }
            }
        };
        let tasks = n.div_ceil(OUTPUTS_PER_TASK);
        if rayon::current_num_threads() > 1 {
            (0..tasks).into_par_iter().for_each(task);
        } else {
            (0..tasks).for_each(task);
        }
        y
    }
}

/// A row-major result that parallel tasks write, each to its own columns.
struct Columns {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: tasks write disjoint elements (each its own columns) and nothing reads the buffer
// until every task has finished.
unsafe impl Sync for Columns {}

impl Columns {
    /// Writes element `at`.
    ///
    /// # Safety
    /// No other task writes `at`, and the buffer outlives the write.
    unsafe fn set(&self, at: usize, value: f32) {
        assert!(at < self.len, "output element {at} of {}", self.len);
        // SAFETY: in bounds (checked), written by this task alone (the caller's contract).
        unsafe { *self.ptr.add(at) = value };
    }
}

/// Which kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Simd {
    Portable,
    Avx2,
    Avx512,
}

/// The kernel for this process (checked once): AVX-512 per `simd::level`, else AVX2 + FMA
/// if the CPU has them.
fn simd() -> Simd {
    #[cfg(target_arch = "x86_64")]
    {
        static DETECTED: std::sync::OnceLock<Simd> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            // F16C widens the scales; every CPU with AVX2 + FMA has it.
            if crate::simd::avx512() {
                Simd::Avx512
            } else if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                Simd::Avx2
            } else {
                Simd::Portable
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    Simd::Portable
}

/// `R` rows of `x` (each `nb * 32` long, block sums in `xsum` when there are minimums) with
/// one weight row.
#[inline(always)]
fn dot_rows<const R: usize, B: QBlock>(
    x: &[f32],
    xsum: &[f32],
    (w, d, mins): (&[B], &[f16], Option<&[f16]>),
    simd: Simd,
) -> [f32; R] {
    let nb = w.len();
    assert!(x.len() >= R * nb * QK, "dot_rows: x shorter than {R} x {nb} blocks");
    assert!(d.len() == nb, "dot_rows: one scale per block");
    if let Some(mins) = mins {
        assert!(mins.len() == nb, "dot_rows: one minimum per block");
        assert!(simd == Simd::Avx512 || xsum.len() >= R * nb, "dot_rows: one block sum per block");
    }
    // SAFETY: AVX-512 F was detected at run time; the lengths were checked above.
    #[cfg(target_arch = "x86_64")]
    if simd == Simd::Avx512 {
        return unsafe { full_avx512::<R, B>(x, w, d, mins) };
    }
    let scaled: [f32; R] = match simd {
        // SAFETY: the features were detected at run time; the lengths were checked above.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { scaled_avx2::<R, B>(x, w, d) },
        _ => scaled_portable::<R, B>(x, w, d),
    };
    let Some(mins) = mins else { return scaled };
    let minimum = match simd {
        // SAFETY: AVX2 + FMA are part of either detected level; lengths checked above.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { minimums_avx2::<R>(xsum, mins) },
        _ => std::array::from_fn(|r| (0..nb).fold(0f32, |t, b| xsum[r * nb + b].mul_add(mins[b].to_f32(), t))),
    };
    std::array::from_fn(|r| scaled[r] + minimum[r])
}

/// Per row, `sum_b d_b * sum_j x_j q_j` in plain Rust.
fn scaled_portable<const R: usize, B: QBlock>(x: &[f32], w: &[B], d: &[f16]) -> [f32; R] {
    let nb = w.len();
    std::array::from_fn(|r| {
        let mut scaled = 0f32;
        for (b, block) in w.iter().enumerate() {
            let xb = &x[(r * nb + b) * QK..(r * nb + b + 1) * QK];
            let dot = xb.iter().enumerate().fold(0f32, |dot, (j, x)| x.mul_add(block.q(j), dot));
            scaled = dot.mul_add(d[b].to_f32(), scaled);
        }
        scaled
    })
}

/// Per row, `sum_b m_b * xsum_b`: 8 blocks per vector step, the rest one by one.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `xsum` holds `R * mins.len()` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn minimums_avx2<const R: usize>(xsum: &[f32], mins: &[f16]) -> [f32; R] {
    use std::arch::x86_64::*;
    let nb = mins.len();
    std::array::from_fn(|r| {
        let whole = nb / 8 * 8;
        let mut mv = _mm256_setzero_ps();
        for b in (0..whole).step_by(8) {
            // SAFETY: b + 8 <= nb, and mins and this row's xsum hold nb values.
            mv = unsafe {
                _mm256_fmadd_ps(
                    _mm256_cvtph_ps(_mm_loadu_si128(mins.as_ptr().add(b).cast::<__m128i>())),
                    _mm256_loadu_ps(xsum.as_ptr().add(r * nb + b)),
                    mv,
                )
            };
        }
        let tail = (whole..nb).fold(0f32, |t, b| xsum[r * nb + b].mul_add(mins[b].to_f32(), t));
        let mut lanes = [0f32; 8];
        // SAFETY: 8 f32 fit in `lanes`.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), mv) };
        lanes.iter().sum::<f32>() + tail
    })
}

/// Per row, `sum_b d_b * sum_j x_j q_j` with AVX2 + FMA: each block widened once for the R
/// rows, then 4 products per row and one scaling by d.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `x` holds `R * w.len() * 32` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scaled_avx2<const R: usize, B: QBlock>(x: &[f32], w: &[B], d: &[f16]) -> [f32; R] {
    use std::arch::x86_64::*;
    let nb = w.len();
    // Two accumulators per row (even and odd blocks) halve the FMA dependency chain.
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let xp = x.as_ptr();
    let mut scales = [0f32; 8];
    for (b, block) in w.iter().enumerate() {
        if b % 8 == 0 {
            widen_scales_8(&d[b..(b + 8).min(nb)], &mut scales);
        }
        // SAFETY (all loads below): x holds 32 values per block and row (the caller's check).
        let q = unsafe { block.widen8() };
        let d = _mm256_set1_ps(scales[b % 8]);
        for (r, row_acc) in acc.iter_mut().enumerate() {
            let row = unsafe { xp.add((r * nb + b) * QK) };
            let xv: [__m256; 4] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(row.add(8 * i)) });
            let t01 = _mm256_fmadd_ps(xv[1], q[1], _mm256_mul_ps(xv[0], q[0]));
            let t23 = _mm256_fmadd_ps(xv[3], q[3], _mm256_mul_ps(xv[2], q[2]));
            row_acc[b & 1] = _mm256_fmadd_ps(_mm256_add_ps(t01, t23), d, row_acc[b & 1]);
        }
    }
    std::array::from_fn(|r| {
        let sum = _mm256_add_ps(acc[r][0], acc[r][1]);
        let mut lanes = [0f32; 8];
        // SAFETY: 8 f32 fit in `lanes`.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
        lanes.iter().sum::<f32>()
    })
}

/// Block `b` of every row into accumulators `A` and `A + 1`; with `M`, the block's minimum
/// `m` is part of the widened weights (d * q + m in one multiply-add, shared by the rows).
///
/// # Safety
/// The CPU must have AVX-512 F; `x` holds `R * nb * 32` values and `b < nb`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn block_avx512<const R: usize, B: QBlock, const A: usize, const M: bool>(
    x: &[f32],
    nb: usize,
    b: usize,
    block: &B,
    (d, m): (f32, f32),
    acc: &mut [[std::arch::x86_64::__m512; 4]; R],
) {
    use std::arch::x86_64::*;
    // SAFETY (all loads): x holds 32 values per block and row (the caller's contract).
    let [q0, q1] = unsafe { block.widen16() };
    let d = _mm512_set1_ps(d);
    let (w0, w1) = if M {
        let m = _mm512_set1_ps(m);
        (_mm512_fmadd_ps(q0, d, m), _mm512_fmadd_ps(q1, d, m))
    } else {
        (_mm512_mul_ps(q0, d), _mm512_mul_ps(q1, d))
    };
    for (r, row_acc) in acc.iter_mut().enumerate() {
        let row = unsafe { x.as_ptr().add((r * nb + b) * QK) };
        row_acc[A] = _mm512_fmadd_ps(unsafe { _mm512_loadu_ps(row) }, w0, row_acc[A]);
        row_acc[A + 1] = _mm512_fmadd_ps(unsafe { _mm512_loadu_ps(row.add(16)) }, w1, row_acc[A + 1]);
    }
}

/// Per row, `sum_b sum_j x_j (d_b q_j + m_b)` with AVX-512: each block widened, scaled by d
/// and shifted by m once for the R rows (the per-row work is then what an f16 weight costs:
/// two multiply-adds per 32 weights), four accumulators per row (two blocks in flight, low
/// and high halves).
///
/// # Safety
/// The CPU must have AVX-512 F; `x` holds `R * w.len() * 32` values; `mins`, if any, one
/// value per block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn full_avx512<const R: usize, B: QBlock>(x: &[f32], w: &[B], d: &[f16], mins: Option<&[f16]>) -> [f32; R] {
    // SAFETY (both): forwarded from the caller.
    match mins {
        Some(mins) => unsafe { blocks_avx512::<R, B, true>(x, w, d, mins) },
        None => unsafe { blocks_avx512::<R, B, false>(x, w, d, &[]) },
    }
}

/// `full_avx512` with (`M`) or without minimums.
///
/// # Safety
/// As `full_avx512`; with `M`, `mins` holds one value per block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn blocks_avx512<const R: usize, B: QBlock, const M: bool>(
    x: &[f32],
    w: &[B],
    d: &[f16],
    mins: &[f16],
) -> [f32; R] {
    use std::arch::x86_64::*;
    let nb = w.len();
    assert!(x.len() >= R * nb * QK, "blocks_avx512: x shorter than {R} x {nb} blocks");
    assert!(!M || mins.len() == nb, "blocks_avx512: one minimum per block");
    assert!(d.len() == nb, "blocks_avx512: one scale per block");
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    let (mut scales, mut minimums) = ([0f32; 16], [0f32; 16]);
    // 16 blocks' scales widened at a time; two blocks per iteration with fixed accumulator
    // indices (an index computed from the block number kept the accumulators in memory).
    let mut start = 0;
    while start < nb {
        let n = (nb - start).min(16);
        widen_scales_16(&d[start..start + n], &mut scales);
        if M {
            widen_scales_16(&mins[start..start + n], &mut minimums);
        }
        let mut j = 0;
        while j + 2 <= n {
            let b = start + j;
            // SAFETY (both): b + 1 < nb; the caller's contract.
            unsafe {
                block_avx512::<R, B, 0, M>(x, nb, b, &w[b], (scales[j], minimums[j]), &mut acc);
                block_avx512::<R, B, 2, M>(x, nb, b + 1, &w[b + 1], (scales[j + 1], minimums[j + 1]), &mut acc);
            }
            j += 2;
        }
        if j < n {
            let b = start + j;
            // SAFETY: b < nb; the caller's contract.
            unsafe { block_avx512::<R, B, 0, M>(x, nb, b, &w[b], (scales[j], minimums[j]), &mut acc) };
        }
        start += n;
    }
    std::array::from_fn(|r| {
        let a = &acc[r];
        _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])))
    })
}

/// Up to 16 f16 scales as f32, one instruction for a whole group.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn widen_scales_16(h: &[f16], out: &mut [f32; 16]) {
    use std::arch::x86_64::*;
    if h.len() == 16 {
        // SAFETY: 16 f16 values are read and 16 f32 written, both in bounds.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_cvtph_ps(_mm256_loadu_si256(h.as_ptr().cast()))) };
    } else {
        out.iter_mut().zip(h).for_each(|(o, v)| *o = v.to_f32());
    }
}

/// Up to 8 f16 scales as f32, one instruction for a whole group.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn widen_scales_8(h: &[f16], out: &mut [f32; 8]) {
    use std::arch::x86_64::*;
    if h.len() == 8 {
        // SAFETY: 8 f16 values are read and 8 f32 written, both in bounds.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast()))) };
    } else {
        out.iter_mut().zip(h).for_each(|(o, v)| *o = v.to_f32());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;

    fn quantized(n: usize, k: usize, dtype: GgmlDType) -> Result<QTensor> {
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
        Ok(QTensor::quantize(&w, dtype)?)
    }

    /// Q4_1 alone (the nibble layout), Q8_0 alone (bytes, no minimums) and both stacked in one
    /// matrix (bytes with minimums).
    fn layouts() -> Result<Vec<(&'static str, QTensor, Option<QTensor>)>> {
        // 19 blocks per row: a whole group of 16 (8 with AVX2) scales widened at once, and a
        // shorter one.
        let k = 19 * QK;
        Ok(vec![
            ("q4_1", quantized(70, k, GgmlDType::Q4_1)?, None),
            ("q8_0", quantized(70, k, GgmlDType::Q8_0)?, None),
            ("q4_1 + q8_0", quantized(40, k, GgmlDType::Q4_1)?, Some(quantized(30, k, GgmlDType::Q8_0)?)),
        ])
    }

    #[test]
    fn matches_the_f32_product_of_the_dequantized_weights_and_is_independent_of_batch() -> Result<()> {
        for (name, first, second) in layouts()? {
            let parts: Vec<&QTensor> = std::iter::once(&first).chain(second.as_ref()).collect();
            let w = WqWeight::from_parts(&parts)?;
            let reference_w = Tensor::cat(
                &parts.iter().map(|p| p.dequantize(&Device::Cpu)).collect::<candle_core::Result<Vec<_>>>()?,
                0,
            )?;
            assert_eq!(w.dequantize(&Device::Cpu)?.to_vec2::<f32>()?, reference_w.to_vec2::<f32>()?, "{name}: weights");
            // n = 70 is not a multiple of the task size: the edges are exercised.
            let x = Tensor::randn(0f32, 1.0, (7, w.k), &Device::Cpu)?;
            let ours = w.matmul(&x)?;
            let reference = x.matmul(&reference_w.t()?)?;
            let diff = (&ours - &reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-4, "{name}: differs from the f32 product by {diff}");
            for row in 0..7 {
                let alone = w.matmul(&x.narrow(0, row, 1)?)?;
                let d = (alone - ours.narrow(0, row, 1)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert_eq!(d, 0.0, "{name}: row {row} depends on its batch");
            }
        }
        Ok(())
    }

    #[test]
    fn every_kernel_this_cpu_has_agrees_with_the_portable_loop() -> Result<()> {
        let mut kernels = vec![Simd::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                kernels.push(Simd::Avx2);
            }
            if crate::simd::detected() == crate::simd::Level::Avx512 {
                kernels.push(Simd::Avx512);
            }
        }
        for (name, first, second) in layouts()? {
            let parts: Vec<&QTensor> = std::iter::once(&first).chain(second.as_ref()).collect();
            let w = WqWeight::from_parts(&parts)?;
            let x: Vec<f32> = Tensor::randn(0f32, 1.0, (5, w.k), &Device::Cpu)?.flatten_all()?.to_vec1()?;
            let run = |simd| match &w.blocks {
                Blocks::Nibbles(b) => w.product(b, &x, 5, simd),
                Blocks::Bytes(b) => w.product(b, &x, 5, simd),
            };
            let portable = run(Simd::Portable);
            for &kernel in &kernels {
                let d = run(kernel).iter().zip(&portable).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(d < 1e-4, "{name}: {kernel:?} differs from the portable loop by {d}");
            }
        }
        Ok(())
    }

    #[test]
    fn the_layout_takes_what_the_file_takes_and_rows_widen_as_candle_does() -> Result<()> {
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
            let q = quantized(50, 128, dtype)?;
            let w = WqWeight::from_parts(&[&q])?;
            assert_eq!(w.bytes(), q.data()?.len(), "{dtype:?}");
            let ids = [49u32, 0, 7, 7];
            let select = Tensor::new(&ids[..], &Device::Cpu)?;
            let want = q.dequantize(&Device::Cpu)?.index_select(&select, 0)?.to_vec2::<f32>()?;
            assert_eq!(w.rows(&ids, &Device::Cpu)?.to_vec2::<f32>()?, want, "{dtype:?}");
            let e = w.rows(&[50], &Device::Cpu).expect_err("row 50 of 50");
            assert!(e.to_string().contains("row 50 of a 50-row matrix"), "{e}");
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
