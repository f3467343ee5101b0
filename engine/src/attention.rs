//! Causal attention over the paged KV cache for a batch of sequences at different positions.
//!
//! Two paths with the same math:
//! - decode rows (one new token) on CPU read K/V straight from the cache blocks, with no
//!   gather copy, all query heads of a KV group sharing one pass over the keys;
//! - prefill chunks (and every row on other devices) gather the sequence's K/V once and use
//!   matrix multiplies with a causal mask, which is what makes long prompts fast.

use candle_core::{Device, Storage, Tensor};
use rayon::prelude::*;

use crate::error::{EngineError, Result};
use crate::kv::cache::KvCache;

/// Where one sequence's rows sit in the batch and what context they attend to.
#[derive(Debug, Clone)]
pub(crate) struct SeqPlan {
    /// First row of this sequence in the flattened batch.
    pub row_start: usize,
    /// Rows (new tokens) of this sequence in the batch.
    pub rows: usize,
    /// Tokens already in the cache before this step (position of the first new token).
    pub start_pos: usize,
    /// Cache slots of positions 0 .. start_pos + rows.
    pub slots: Vec<u32>,
    /// For the gather path: the slots as a tensor and the causal mask, built once per step
    /// and shared by every layer.
    gather: Option<GatherInputs>,
}

#[derive(Debug, Clone)]
struct GatherInputs {
    slots: Tensor,
    /// `[1, group * rows, ctx]`: 0 where a query may attend, -inf elsewhere.
    mask: Tensor,
}

impl SeqPlan {
    pub fn new(
        row_start: usize,
        rows: usize,
        start_pos: usize,
        slots: Vec<u32>,
        heads: Heads,
        device: &Device,
    ) -> Result<Self> {
        let mut plan = SeqPlan { row_start, rows, start_pos, slots, gather: None };
        if !plan.uses_direct_kernel(device) {
            let ctx = start_pos + rows;
            let group = heads.num_heads / heads.num_kv_heads;
            // Row r of a group is query i = r % rows at position start_pos + i; it sees keys j <= that.
            let mask: Vec<f32> = (0..group * rows)
                .flat_map(|r| {
                    let visible = start_pos + r % rows;
                    (0..ctx).map(move |j| if j <= visible { 0.0 } else { f32::NEG_INFINITY })
                })
                .collect();
            plan.gather = Some(GatherInputs {
                slots: Tensor::from_slice(&plan.slots[..ctx], ctx, device)?,
                mask: Tensor::from_vec(mask, (1, group * rows, ctx), device)?,
            });
        }
        Ok(plan)
    }

    /// Decode rows on CPU read the cache in place; everything else gathers.
    fn uses_direct_kernel(&self, device: &Device) -> bool {
        self.rows == 1 && matches!(device, Device::Cpu)
    }
}

/// Head geometry the kernels need.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Attention output `[rows, num_heads * head_dim]` for `q` (`[rows, num_heads * head_dim]`,
/// rotary already applied) of every sequence in `plans` (in row order), reading layer `layer`.
pub(crate) fn paged_attention(
    q: &Tensor,
    cache: &KvCache,
    layer: usize,
    plans: &[SeqPlan],
    heads: Heads,
) -> Result<Tensor> {
    let device = q.device();
    let decode_rows: Vec<usize> =
        plans.iter().enumerate().filter(|(_, p)| p.uses_direct_kernel(device)).map(|(i, _)| i).collect();
    let mut decoded =
        if decode_rows.is_empty() { Vec::new() } else { decode_on_cpu(q, cache, layer, plans, &decode_rows, heads)? }
            .into_iter();
    let mut parts = Vec::with_capacity(plans.len());
    for plan in plans {
        if plan.uses_direct_kernel(device) {
            let row = decoded.next().ok_or_else(|| EngineError::InvalidBatch("decode rows out of step".into()))?;
            parts.push(Tensor::from_vec(row, (1, heads.num_heads * heads.head_dim), q.device())?);
        } else {
            let q_seq = q.narrow(0, plan.row_start, plan.rows)?;
            parts.push(gathered_attention(&q_seq, cache, layer, plan, heads)?);
        }
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// Prefill-chunk attention: gather this sequence's K/V, then masked matmuls.
fn gathered_attention(q: &Tensor, cache: &KvCache, layer: usize, plan: &SeqPlan, heads: Heads) -> Result<Tensor> {
    let Heads { num_heads, num_kv_heads, head_dim } = heads;
    let group = num_heads / num_kv_heads;
    let n = plan.rows;
    let ctx = plan.start_pos + n;
    let inputs =
        plan.gather.as_ref().ok_or_else(|| EngineError::InvalidBatch("gather inputs missing from the plan".into()))?;
    let (k, v) = cache.gather(layer, &inputs.slots)?;
    // [ctx, kvh*hd] -> [kvh, ctx, hd]
    let k = k.reshape((ctx, num_kv_heads, head_dim))?.transpose(0, 1)?.contiguous()?;
    let v = v.reshape((ctx, num_kv_heads, head_dim))?.transpose(0, 1)?.contiguous()?;
    // [n, nh*hd] -> [nh, n, hd] -> [kvh, group*n, hd]: the heads of a group are adjacent.
    let q = q.reshape((n, num_heads, head_dim))?.transpose(0, 1)?.contiguous()?.reshape((
        num_kv_heads,
        group * n,
        head_dim,
    ))?;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let scores = (q.matmul(&k.t()?)? * scale)?;
    let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&inputs.mask)?)?;
    let out = probs.matmul(&v)?; // [kvh, group*n, hd]
    Ok(out.reshape((num_heads, n, head_dim))?.transpose(0, 1)?.contiguous()?.reshape((n, num_heads * head_dim))?)
}

/// Decode attention on CPU straight from the cache blocks: one output row per listed plan.
fn decode_on_cpu(
    q: &Tensor,
    cache: &KvCache,
    layer: usize,
    plans: &[SeqPlan],
    which: &[usize],
    heads: Heads,
) -> Result<Vec<Vec<f32>>> {
    let q_all = q.flatten_all()?.to_vec1::<f32>()?;
    let (k_cache, v_cache) = cache.layer(layer);
    let (k_storage, k_layout) = k_cache.storage_and_layout();
    let (v_storage, v_layout) = v_cache.storage_and_layout();
    let (Storage::Cpu(k_cpu), Storage::Cpu(v_cpu)) = (&*k_storage, &*v_storage) else {
        return Err(EngineError::InvalidBatch("CPU attention on a non-CPU cache".into()));
    };
    let k_all = &k_cpu.as_slice::<f32>()?[k_layout.start_offset()..];
    let v_all = &v_cpu.as_slice::<f32>()?[v_layout.start_offset()..];
    let width = heads.num_heads * heads.head_dim;
    let one = |&i: &usize| {
        let plan = &plans[i];
        let q_row = &q_all[plan.row_start * width..(plan.row_start + 1) * width];
        decode_one(q_row, k_all, v_all, &plan.slots[..plan.start_pos + 1], heads)
    };
    // With one thread, handing work to rayon's pool only adds a thread switch per call.
    if rayon::current_num_threads() > 1 {
        Ok(which.par_iter().map(one).collect())
    } else {
        Ok(which.iter().map(one).collect())
    }
}

/// Attention of one query row over `slots` (its whole context, itself included). One pass
/// over the keys and one over the values, each cache row read once for all heads.
fn decode_one(q: &[f32], k_all: &[f32], v_all: &[f32], slots: &[u32], heads: Heads) -> Vec<f32> {
    let Heads { num_heads, num_kv_heads, head_dim } = heads;
    let group = num_heads / num_kv_heads;
    let kv_width = num_kv_heads * head_dim;
    let ctx = slots.len();
    let scale = 1.0 / (head_dim as f32).sqrt();
    // scores[head * ctx + j]
    let mut scores = vec![0f32; num_heads * ctx];
    for (j, &slot) in slots.iter().enumerate() {
        prefetch_row(k_all, slots.get(j + PREFETCH_AHEAD), kv_width);
        let row = &k_all[slot as usize * kv_width..(slot as usize + 1) * kv_width];
        for (h, q_head) in q.chunks_exact(head_dim).enumerate() {
            let g = h / group;
            scores[h * ctx + j] = dot(q_head, &row[g * head_dim..(g + 1) * head_dim]) * scale;
        }
    }
    for head_scores in scores.chunks_exact_mut(ctx) {
        softmax_in_place(head_scores);
    }
    let mut out = vec![0f32; num_heads * head_dim];
    for (j, &slot) in slots.iter().enumerate() {
        prefetch_row(v_all, slots.get(j + PREFETCH_AHEAD), kv_width);
        let row = &v_all[slot as usize * kv_width..(slot as usize + 1) * kv_width];
        for (h, out_head) in out.chunks_exact_mut(head_dim).enumerate() {
            let g = h / group;
            axpy(scores[h * ctx + j], &row[g * head_dim..(g + 1) * head_dim], out_head);
        }
    }
    out
}

/// Cache rows are read this many positions before use: blocks are scattered, so the
/// hardware prefetcher loses the stream at every block boundary.
const PREFETCH_AHEAD: usize = 6;

/// Asks the CPU to start loading the cache row of `slot` (a hint; no effect on results).
#[inline(always)]
fn prefetch_row(all: &[f32], slot: Option<&u32>, width: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(&slot) = slot {
        let start = slot as usize * width;
        if start + width <= all.len() {
            for line in (0..width).step_by(16) {
                // SAFETY: prefetch is a hint that never faults; the address is inside `all`.
                unsafe {
                    std::arch::x86_64::_mm_prefetch(
                        all.as_ptr().add(start + line).cast::<i8>(),
                        std::arch::x86_64::_MM_HINT_T0,
                    );
                }
            }
        }
    }
}

/// Dot product. AVX2/FMA with two accumulators when the length is a multiple of 16 (head
/// dims are), else the portable loop; the same inputs always take the same path.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    if a.len().is_multiple_of(16) && b.len() == a.len() {
        use std::arch::x86_64::*;
        // SAFETY: both slices hold a.len() floats, a multiple of 16, and every load reads
        // 8 floats at an offset < len - 7; AVX2 and FMA are enabled at compile time.
        unsafe {
            let (pa, pb) = (a.as_ptr(), b.as_ptr());
            let mut even = _mm256_setzero_ps();
            let mut odd = _mm256_setzero_ps();
            let mut i = 0;
            while i < a.len() {
                even = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), even);
                odd = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8)), odd);
                i += 16;
            }
            let sum = _mm256_add_ps(even, odd);
            let halves = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
            let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
            let single = _mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1));
            return _mm_cvtss_f32(single);
        }
    }
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `y += alpha * x`.
#[inline]
fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    if x.len().is_multiple_of(8) && y.len() == x.len() {
        use std::arch::x86_64::*;
        // SAFETY: both slices hold x.len() floats, a multiple of 8; each load and store
        // touches 8 floats below that length; AVX2 and FMA are enabled at compile time.
        unsafe {
            let a = _mm256_set1_ps(alpha);
            let (px, py) = (x.as_ptr(), y.as_mut_ptr());
            let mut i = 0;
            while i < x.len() {
                _mm256_storeu_ps(py.add(i), _mm256_fmadd_ps(a, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i))));
                i += 8;
            }
        }
        return;
    }
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

fn softmax_in_place(xs: &mut [f32]) {
    let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for x in xs.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    for x in xs.iter_mut() {
        *x /= sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{CacheConfig, ModelConfig, RopeStyle};

    /// The direct decode kernel and the gather+matmul path agree on scattered blocks.
    #[test]
    fn decode_kernel_matches_gathered_path() -> Result<()> {
        let model = ModelConfig {
            vocab_size: 8,
            hidden_size: 32,
            intermediate_size: 8,
            num_layers: 1,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            max_position: 64,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            rope_style: RopeStyle::Halves,
        };
        let cache =
            KvCache::new(&model, &CacheConfig { block_size: 4, num_blocks: 8, prefix_cache: false }, &Device::Cpu)?;
        let slots_total = 32;
        let k = Tensor::randn(0f32, 1.0, (slots_total, 16), &Device::Cpu)?;
        let v = Tensor::randn(0f32, 1.0, (slots_total, 16), &Device::Cpu)?;
        let index: Vec<u32> = (0..slots_total as u32).flat_map(|s| [s; 16]).collect();
        let index = Tensor::from_vec(index, (slots_total, 16), &Device::Cpu)?;
        cache.write(0, &index, &k, &v)?;
        // 11 positions over blocks 5, 2, 7 (scattered, last one partly used).
        let slots: Vec<u32> = (0..11u32).map(|p| [5u32, 2, 7][(p / 4) as usize] * 4 + p % 4).collect();
        let heads = Heads { num_heads: 4, num_kv_heads: 2, head_dim: 8 };
        let plan = SeqPlan::new(0, 1, 10, slots.clone(), heads, &Device::Cpu)?;
        // The same rows through the gather path (as a non-CPU device would run them).
        let mut gather_plan = SeqPlan::new(0, 2, 9, slots, heads, &Device::Cpu)?;
        gather_plan.rows = 1;
        gather_plan.start_pos = 10;
        let ctx = 11;
        let mask = Tensor::zeros((1, 2, ctx), candle_core::DType::F32, &Device::Cpu)?;
        gather_plan.gather =
            Some(GatherInputs { slots: Tensor::from_slice(&gather_plan.slots, ctx, &Device::Cpu)?, mask });
        let q = Tensor::randn(0f32, 1.0, (1, 32), &Device::Cpu)?;
        let direct = paged_attention(&q, &cache, 0, std::slice::from_ref(&plan), heads)?;
        let gathered = gathered_attention(&q, &cache, 0, &gather_plan, heads)?;
        let diff = (direct - gathered)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "max difference {diff}");
        Ok(())
    }
}
