//! Causal attention over the paged KV cache for a batch of sequences at different positions.
//!
//! Two paths with the same math:
//! - decode rows (one new token) read K/V straight from the cache blocks, with no gather
//!   copy: on CPU all query heads of a KV group share one pass over the keys; on CUDA one
//!   kernel launch covers every decode row of the step (`crate::cuda::attention`);
//! - prefill chunks gather the sequence's K/V once and use matrix multiplies with a causal
//!   mask, which is what makes long prompts fast.

use candle_core::{DType, Device, Storage, Tensor};
use half::f16;
use rayon::prelude::*;

use crate::error::{EngineError, Result};
use crate::kv::cache::KvCache;
use crate::simd::Widen;

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
    heads: Heads,
    /// For the gather path: the slots as a tensor and the causal mask, built once per step
    /// and shared by every layer.
    gather: Option<GatherInputs>,
    /// The same for the sliding-window layers (when `heads.window` is set): only the keys
    /// some row of the step can see, and the mask that also hides those behind each row's
    /// window.
    window_gather: Option<GatherInputs>,
}

#[derive(Debug, Clone)]
struct GatherInputs {
    /// Cache slots of the keys gathered (positions `first ..= last row's`).
    slots: Tensor,
    /// `[1, rows, keys]`: 0 where a query may attend, -inf elsewhere (shared by the heads).
    mask: Tensor,
}

impl GatherInputs {
    /// The keys from position `first` on, for query rows at `start_pos ..`, each seeing the
    /// `window` keys up to itself (0: every key up to itself).
    fn new(all_slots: &[u32], rows: usize, start_pos: usize, window: usize, device: &Device) -> Result<Self> {
        let ctx = start_pos + rows;
        let first = first_key(start_pos, window);
        // One row per query (every head of a group shares it): query i at start_pos + i.
        let mask: Vec<f32> = (0..rows)
            .flat_map(|i| {
                let pos = start_pos + i;
                (first..ctx).map(move |j| if sees(pos, j, window) { 0.0 } else { f32::NEG_INFINITY })
            })
            .collect();
        Ok(GatherInputs {
            slots: Tensor::from_slice(&all_slots[first..ctx], ctx - first, device)?,
            mask: Tensor::from_vec(mask, (1, rows, ctx - first), device)?,
        })
    }
}

/// Whether a query at position `pos` sees the key at `key` (causal, and within `window`
/// keys of itself when `window` is not 0: transformers' `kv_idx > q_idx - sliding_window`).
fn sees(pos: usize, key: usize, window: usize) -> bool {
    key <= pos && (window == 0 || pos - key < window)
}

/// The first key position a query at `pos` sees.
fn first_key(pos: usize, window: usize) -> usize {
    match window {
        0 => 0,
        w => (pos + 1).saturating_sub(w),
    }
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
        let mut plan = SeqPlan { row_start, rows, start_pos, slots, heads, gather: None, window_gather: None };
        if !plan.uses_direct_kernel(device) {
            plan.gather = Some(GatherInputs::new(&plan.slots, rows, start_pos, 0, device)?);
            if heads.window > 0 {
                plan.window_gather = Some(GatherInputs::new(&plan.slots, rows, start_pos, heads.window, device)?);
            }
        }
        Ok(plan)
    }

    /// The cache slots a decode row reads in a layer of `window` (0: all of them).
    fn decode_slots(&self, window: usize) -> &[u32] {
        &self.slots[first_key(self.start_pos, window)..self.start_pos + 1]
    }

    /// Decode rows read the cache in place (on CPU, and on CUDA with the `cuda` build for
    /// heads the kernel takes); everything else gathers.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn direct_kernel(rows: usize, heads: Heads, device: &Device) -> bool {
        rows == 1
            && match device {
                Device::Cpu => true,
                #[cfg(feature = "cuda")]
                Device::Cuda(_) => heads.head_dim <= crate::cuda::attention::MAX_HEAD_DIM,
                _ => false,
            }
    }

    fn uses_direct_kernel(&self, device: &Device) -> bool {
        Self::direct_kernel(self.rows, self.heads, device)
    }
}

/// Head geometry the kernels need.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Scores become `softcap * tanh(score / softcap)` before the softmax (Gemma 2); 0: off.
    pub softcap: f32,
    /// Keys a query sees, itself included, in a sliding-window layer; 0: every earlier key.
    /// A plan is made with the model's window (its masks serve every layer), and each
    /// layer's attention is called with its own.
    pub window: usize,
}

/// Gemma 2's attention logit soft-capping, in place (nothing when `cap` is 0).
fn softcap_in_place(scores: &mut [f32], cap: f32) {
    if cap > 0.0 {
        scores.iter_mut().for_each(|s| *s = cap * (*s / cap).tanh());
    }
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
    // `[decode rows, width]`, in plan order.
    let decoded = match (decode_rows.is_empty(), device) {
        (true, _) => None,
        #[cfg(feature = "cuda")]
        (false, Device::Cuda(_)) => Some(decode_on_cuda(q, cache, layer, plans, &decode_rows, heads)?),
        (false, _) => {
            let rows = decode_on_cpu(q, cache, layer, plans, &decode_rows, heads)?;
            Some(Tensor::from_vec(rows.concat(), (decode_rows.len(), heads.num_heads * heads.head_dim), device)?)
        }
    };
    let mut next_decoded = 0;
    let mut parts = Vec::with_capacity(plans.len());
    for plan in plans {
        if plan.uses_direct_kernel(device) {
            let rows = decoded.as_ref().ok_or_else(|| EngineError::InvalidBatch("decode rows out of step".into()))?;
            parts.push(rows.narrow(0, next_decoded, 1)?);
            next_decoded += 1;
        } else {
            let q_seq = q.narrow(0, plan.row_start, plan.rows)?;
            parts.push(gathered_attention(&q_seq, cache, layer, plan, heads)?);
        }
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// Elements of one score tile (`[tile rows * group, keys]` f32): 4 MiB.
const SCORE_TILE_ELEMS: usize = 1 << 20;

/// Query rows per score tile for `group` heads over `keys` keys: as many as fit in
/// `SCORE_TILE_ELEMS`, at least 16 (tiny tiles would be all call overhead).
fn tile_rows(rows: usize, group: usize, keys: usize) -> usize {
    (SCORE_TILE_ELEMS / (group * keys).max(1)).clamp(16, rows.max(16))
}

/// Prefill-chunk attention: gather this sequence's K/V as stored, then masked matmuls, one KV
/// head (its group of query heads) and one tile of query rows at a time. The scores are the
/// largest activation of a forward pass (`group * rows * keys` f32 per KV head: 8 MiB for 2
/// heads of a 512-token chunk at 2,048 keys), written again by the masking and the softmax;
/// tiles of `SCORE_TILE_ELEMS` bound that whatever the chunk and the context. Only one KV
/// head's keys and values are widened to f32 at a time (all of them were 16 MiB at 2,048
/// keys of Qwen3-0.6B, and as much again for their per-head copies).
fn gathered_attention(q: &Tensor, cache: &KvCache, layer: usize, plan: &SeqPlan, heads: Heads) -> Result<Tensor> {
    let keys = gather_inputs(plan, heads)?.slots.dim(0)?;
    let tile = tile_rows(plan.rows, heads.num_heads / heads.num_kv_heads, keys);
    gathered_attention_in_tiles(q, cache, layer, plan, heads, tile)
}

fn gather_inputs(plan: &SeqPlan, heads: Heads) -> Result<&GatherInputs> {
    let inputs = if heads.window > 0 { &plan.window_gather } else { &plan.gather };
    inputs.as_ref().ok_or_else(|| EngineError::InvalidBatch("gather inputs missing from the plan".into()))
}

/// `gathered_attention` with `tile` query rows per score tile.
fn gathered_attention_in_tiles(
    q: &Tensor,
    cache: &KvCache,
    layer: usize,
    plan: &SeqPlan,
    heads: Heads,
    tile: usize,
) -> Result<Tensor> {
    let Heads { num_heads, num_kv_heads, head_dim, softcap, .. } = heads;
    let group = num_heads / num_kv_heads;
    let n = plan.rows;
    let inputs = gather_inputs(plan, heads)?;
    let ctx = inputs.slots.dim(0)?;
    let (k, v) = cache.gather_stored(layer, &inputs.slots)?;
    let (k, v) = (k.reshape((ctx, num_kv_heads, head_dim))?, v.reshape((ctx, num_kv_heads, head_dim))?);
    // A KV head's query group is a contiguous range of columns of q, [n, group*hd], which is
    // [n*group, hd] with row i*group + g: a tile of query rows is a contiguous range of rows,
    // every head of the group included. Scaled per head, on fewer values than the scores,
    // and only one head's copy alive at a time.
    let scale = 1.0 / (head_dim as f64).sqrt();
    let mask = inputs.mask.reshape((n, 1, ctx))?;
    let tile = tile.max(1);
    let mut outs = Vec::with_capacity(num_kv_heads);
    for h in 0..num_kv_heads {
        let widen = |t: &Tensor| -> Result<Tensor> { Ok(t.narrow(1, h, 1)?.squeeze(1)?.to_dtype(DType::F32)?) };
        let (kt, vh) = (widen(&k)?.t()?, widen(&v)?.contiguous()?); // [hd, ctx], [ctx, hd]
        let qh = (q.narrow(1, h * group * head_dim, group * head_dim)?.contiguous()? * scale)?
            .reshape((n * group, head_dim))?;
        let mut tiles = Vec::with_capacity(n.div_ceil(tile));
        for first in (0..n).step_by(tile) {
            let rows = tile.min(n - first);
            let mut scores = qh.narrow(0, first * group, rows * group)?.matmul(&kt)?; // [rows*group, ctx]
            if softcap > 0.0 {
                scores = ((scores / softcap as f64)?.tanh()? * softcap as f64)?;
            }
            let scores = scores.reshape((rows, group, ctx))?.broadcast_add(&mask.narrow(0, first, rows)?)?;
            let probs = candle_nn::ops::softmax_last_dim(&scores)?.reshape((rows * group, ctx))?;
            tiles.push(probs.matmul(&vh)?); // [rows*group, hd]
        }
        let out = if tiles.len() == 1 { tiles.remove(0) } else { Tensor::cat(&tiles, 0)? };
        outs.push(out.reshape((n, group * head_dim))?);
    }
    // Each head's [n, group*hd] is its columns of the output: one copy into place.
    Ok(Tensor::cat(&outs, 1)?)
}

/// Decode attention on CUDA straight from the cache blocks: `[which.len(), width]`.
#[cfg(feature = "cuda")]
fn decode_on_cuda(
    q: &Tensor,
    cache: &KvCache,
    layer: usize,
    plans: &[SeqPlan],
    which: &[usize],
    heads: Heads,
) -> Result<Tensor> {
    let rows: Vec<u32> = which.iter().map(|&i| plans[i].row_start as u32).collect();
    let q_rows = q.index_select(&Tensor::from_vec(rows, which.len(), q.device())?, 0)?;
    let contexts: Vec<&[u32]> = which.iter().map(|&i| plans[i].decode_slots(heads.window)).collect();
    let (k_cache, v_cache) = cache.layer(layer);
    crate::cuda::attention::paged_decode(&q_rows, k_cache, v_cache, &contexts, heads)
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
    let rows = DecodeRows { q_all: &q_all, plans, which, heads };
    // The layer's own rows: its K and V are views into every layer's storage.
    let k_range = k_layout.start_offset()..k_layout.start_offset() + k_cache.elem_count();
    let v_range = v_layout.start_offset()..v_layout.start_offset() + v_cache.elem_count();
    match k_cache.dtype() {
        DType::F32 => Ok(rows.run(&k_cpu.as_slice::<f32>()?[k_range], &v_cpu.as_slice::<f32>()?[v_range])),
        DType::F16 => Ok(rows.run(&k_cpu.as_slice::<f16>()?[k_range], &v_cpu.as_slice::<f16>()?[v_range])),
        other => Err(EngineError::InvalidBatch(format!("no decode attention over a {other:?} cache"))),
    }
}

/// The decode rows of one layer's attention.
struct DecodeRows<'a> {
    q_all: &'a [f32],
    plans: &'a [SeqPlan],
    which: &'a [usize],
    heads: Heads,
}

impl DecodeRows<'_> {
    fn run<E: Widen>(&self, k_all: &[E], v_all: &[E]) -> Vec<Vec<f32>> {
        let width = self.heads.num_heads * self.heads.head_dim;
        let wide = crate::simd::avx512() && self.heads.head_dim.is_multiple_of(16);
        let one = |&i: &usize| {
            let plan = &self.plans[i];
            let q_row = &self.q_all[plan.row_start * width..(plan.row_start + 1) * width];
            let slots = plan.decode_slots(self.heads.window);
            #[cfg(target_arch = "x86_64")]
            if wide {
                // SAFETY: `wide` means AVX-512 F was detected.
                return unsafe { decode_one_avx512(q_row, k_all, v_all, slots, self.heads) };
            }
            decode_one(q_row, k_all, v_all, slots, self.heads, false)
        };
        // With one thread, handing work to rayon's pool only adds a thread switch per call.
        if rayon::current_num_threads() > 1 {
            self.which.par_iter().map(one).collect()
        } else {
            self.which.iter().map(one).collect()
        }
    }
}

/// `decode_one` for AVX-512: KV head by KV head, with the query heads of its group (and then
/// their outputs) held in registers over all positions, each cache row widened once for the
/// group and each score reduced once. Position by position with all heads inside (the
/// portable order), the per-head loads, stores and calls bounded decode attention.
///
/// # Safety
/// The CPU must have AVX-512 F; head_dim a multiple of 16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn decode_one_avx512<E: Widen>(q: &[f32], k_all: &[E], v_all: &[E], slots: &[u32], heads: Heads) -> Vec<f32> {
    let group = heads.num_heads / heads.num_kv_heads;
    // SAFETY (all): forwarded from the caller; each arm matches head_dim and the group size.
    match (heads.head_dim, group) {
        (64, 1) => unsafe { decode_groups_avx512::<E, 4, 1>(q, k_all, v_all, slots, heads) },
        (64, 2) => unsafe { decode_groups_avx512::<E, 4, 2>(q, k_all, v_all, slots, heads) },
        (64, 3) => unsafe { decode_groups_avx512::<E, 4, 3>(q, k_all, v_all, slots, heads) },
        (64, 4) => unsafe { decode_groups_avx512::<E, 4, 4>(q, k_all, v_all, slots, heads) },
        (128, 1) => unsafe { decode_groups_avx512::<E, 8, 1>(q, k_all, v_all, slots, heads) },
        (128, 2) => unsafe { decode_groups_avx512::<E, 8, 2>(q, k_all, v_all, slots, heads) },
        (128, 4) => unsafe { decode_groups_avx512::<E, 8, 4>(q, k_all, v_all, slots, heads) },
        _ => decode_one(q, k_all, v_all, slots, heads, true),
    }
}

/// The group-by-group loops for head_dim = 16 * D and G query heads per KV head.
///
/// # Safety
/// The CPU must have AVX-512 F; `heads.head_dim == 16 * D`, `num_heads == G * num_kv_heads`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn decode_groups_avx512<E: Widen, const D: usize, const G: usize>(
    q: &[f32],
    k_all: &[E],
    v_all: &[E],
    slots: &[u32],
    heads: Heads,
) -> Vec<f32> {
    use std::arch::x86_64::*;
    let Heads { num_heads, num_kv_heads, head_dim, softcap, .. } = heads;
    assert!(
        head_dim == 16 * D && num_heads == G * num_kv_heads && q.len() == num_heads * head_dim,
        "decode_groups_avx512: shapes"
    );
    let kv_width = num_kv_heads * head_dim;
    let ctx = slots.len();
    let rows_end = slots.iter().map(|&s| (s as usize + 1) * kv_width).max().unwrap_or(0);
    assert!(rows_end <= k_all.len() && rows_end <= v_all.len(), "decode_groups_avx512: slot beyond the cache");
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut scores = vec![0f32; num_heads * ctx];
    let mut out = vec![0f32; num_heads * head_dim];
    for g in 0..num_kv_heads {
        let offset = g * head_dim;
        // SAFETY (all pointer reads and writes below): q and out hold num_heads * head_dim
        // values, scores num_heads * ctx, and every cache row read is below rows_end.
        let qv: [[__m512; D]; G] = std::array::from_fn(|i| {
            std::array::from_fn(|d| unsafe { _mm512_loadu_ps(q.as_ptr().add((g * G + i) * head_dim + d * 16)) })
        });
        let sp = unsafe { scores.as_mut_ptr().add(g * G * ctx) };
        for (j, &slot) in slots.iter().enumerate() {
            if g == 0 {
                prefetch_row(k_all, slots.get(j + PREFETCH_AHEAD), kv_width);
            }
            let row = unsafe { k_all.as_ptr().add(slot as usize * kv_width + offset) };
            let kv: [__m512; D] = std::array::from_fn(|d| unsafe { E::load16(row.add(d * 16)) });
            for (i, qh) in qv.iter().enumerate() {
                let mut acc = _mm512_mul_ps(qh[0], kv[0]);
                for d in 1..D {
                    acc = _mm512_fmadd_ps(qh[d], kv[d], acc);
                }
                unsafe { *sp.add(i * ctx + j) = _mm512_reduce_add_ps(acc) * scale };
            }
        }
        for i in 0..G {
            let row = &mut scores[(g * G + i) * ctx..(g * G + i + 1) * ctx];
            softcap_in_place(row, softcap);
            // SAFETY: AVX-512 F (this function's contract).
            unsafe { softmax_avx512(row) };
        }
        let mut acc = [[_mm512_setzero_ps(); D]; G];
        for (j, &slot) in slots.iter().enumerate() {
            if g == 0 {
                prefetch_row(v_all, slots.get(j + PREFETCH_AHEAD), kv_width);
            }
            let row = unsafe { v_all.as_ptr().add(slot as usize * kv_width + offset) };
            let vv: [__m512; D] = std::array::from_fn(|d| unsafe { E::load16(row.add(d * 16)) });
            for (i, a) in acc.iter_mut().enumerate() {
                let p = _mm512_set1_ps(unsafe { *sp.add(i * ctx + j) });
                for d in 0..D {
                    a[d] = _mm512_fmadd_ps(p, vv[d], a[d]);
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            for (d, lanes) in a.iter().enumerate() {
                unsafe { _mm512_storeu_ps(out.as_mut_ptr().add((g * G + i) * head_dim + d * 16), *lanes) };
            }
        }
    }
    out
}

/// Attention of one query row over `slots` (its whole context, itself included). One pass
/// over the keys and one over the values, each cache row read once for all heads. `wide`:
/// the AVX-512 loops (head_dim a multiple of 16).
#[inline(always)]
fn decode_one<E: Widen>(q: &[f32], k_all: &[E], v_all: &[E], slots: &[u32], heads: Heads, wide: bool) -> Vec<f32> {
    let Heads { num_heads, num_kv_heads, head_dim, softcap, .. } = heads;
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
            scores[h * ctx + j] = dot(q_head, &row[g * head_dim..(g + 1) * head_dim], wide) * scale;
        }
    }
    for head_scores in scores.chunks_exact_mut(ctx) {
        softcap_in_place(head_scores, softcap);
        softmax_in_place(head_scores);
    }
    let mut out = vec![0f32; num_heads * head_dim];
    for (j, &slot) in slots.iter().enumerate() {
        prefetch_row(v_all, slots.get(j + PREFETCH_AHEAD), kv_width);
        let row = &v_all[slot as usize * kv_width..(slot as usize + 1) * kv_width];
        for (h, out_head) in out.chunks_exact_mut(head_dim).enumerate() {
            let g = h / group;
            axpy(scores[h * ctx + j], &row[g * head_dim..(g + 1) * head_dim], out_head, wide);
        }
    }
    out
}

/// Cache rows are read this many positions before use: blocks are scattered, so the
/// hardware prefetcher loses the stream at every block boundary.
const PREFETCH_AHEAD: usize = 16;

/// Asks the CPU to start loading the cache row of `slot` (a hint; no effect on results).
#[inline(always)]
fn prefetch_row<E>(all: &[E], slot: Option<&u32>, width: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(&slot) = slot {
        let start = slot as usize * width;
        if start + width <= all.len() {
            let per_line = (64 / std::mem::size_of::<E>()).max(1);
            for line in (0..width).step_by(per_line) {
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

/// Dot product of f32 `a` with `b` widened to f32. AVX-512 when `wide` (length a multiple
/// of 16), else AVX2/FMA with two accumulators when the length is a multiple of 16 (head
/// dims are), else the portable loop; the same inputs always take the same path.
#[inline]
fn dot<E: Widen>(a: &[f32], b: &[E], wide: bool) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if wide && a.len().is_multiple_of(16) && b.len() == a.len() {
        // SAFETY: `wide` means AVX-512 F was detected; both slices hold a.len() values.
        return unsafe { dot_avx512(a, b) };
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    if a.len().is_multiple_of(16) && b.len() == a.len() {
        use std::arch::x86_64::*;
        // SAFETY: both slices hold a.len() values, a multiple of 16, and every load reads
        // 8 values at an offset < len - 7; AVX2, FMA and F16C are enabled at compile time.
        unsafe {
            let (pa, pb) = (a.as_ptr(), b.as_ptr());
            let mut even = _mm256_setzero_ps();
            let mut odd = _mm256_setzero_ps();
            let mut i = 0;
            while i < a.len() {
                even = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), E::load8(pb.add(i)), even);
                odd = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), E::load8(pb.add(i + 8)), odd);
                i += 16;
            }
            let sum = _mm256_add_ps(even, odd);
            let halves = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
            let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
            let single = _mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1));
            return _mm_cvtss_f32(single);
        }
    }
    let _ = wide;
    a.iter().zip(b).map(|(x, y)| x * y.to_f32()).sum()
}

/// # Safety
/// The CPU must have AVX-512 F; `a` and `b` hold the same number of values, a multiple of 16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn dot_avx512<E: Widen>(a: &[f32], b: &[E]) -> f32 {
    use std::arch::x86_64::*;
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i < a.len() {
        // SAFETY: i + 16 <= len for both slices (the caller's contract).
        acc = _mm512_fmadd_ps(unsafe { _mm512_loadu_ps(pa.add(i)) }, unsafe { E::load16(pb.add(i)) }, acc);
        i += 16;
    }
    _mm512_reduce_add_ps(acc)
}

/// `y += alpha * x` (x widened to f32); paths as in `dot`.
#[inline]
fn axpy<E: Widen>(alpha: f32, x: &[E], y: &mut [f32], wide: bool) {
    #[cfg(target_arch = "x86_64")]
    if wide && x.len().is_multiple_of(16) && y.len() == x.len() {
        // SAFETY: `wide` means AVX-512 F was detected; both slices hold x.len() values.
        unsafe { axpy_avx512(alpha, x, y) };
        return;
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    if x.len().is_multiple_of(8) && y.len() == x.len() {
        use std::arch::x86_64::*;
        // SAFETY: both slices hold x.len() values, a multiple of 8; each load and store
        // touches 8 values below that length; AVX2, FMA and F16C are enabled at compile time.
        unsafe {
            let a = _mm256_set1_ps(alpha);
            let (px, py) = (x.as_ptr(), y.as_mut_ptr());
            let mut i = 0;
            while i < x.len() {
                _mm256_storeu_ps(py.add(i), _mm256_fmadd_ps(a, E::load8(px.add(i)), _mm256_loadu_ps(py.add(i))));
                i += 8;
            }
        }
        return;
    }
    let _ = wide;
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi.to_f32();
    }
}

/// # Safety
/// The CPU must have AVX-512 F; `x` and `y` hold the same number of values, a multiple of 16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn axpy_avx512<E: Widen>(alpha: f32, x: &[E], y: &mut [f32]) {
    use std::arch::x86_64::*;
    let a = _mm512_set1_ps(alpha);
    let (px, py) = (x.as_ptr(), y.as_mut_ptr());
    let mut i = 0;
    while i < x.len() {
        // SAFETY: i + 16 <= len for both slices (the caller's contract).
        unsafe { _mm512_storeu_ps(py.add(i), _mm512_fmadd_ps(a, E::load16(px.add(i)), _mm512_loadu_ps(py.add(i)))) };
        i += 16;
    }
}

/// `softmax_in_place` on 16 lanes with a polynomial `exp` (`exp_avx512`); masked loads and
/// stores handle a length that is not a multiple of 16. libm's scalar `expf` was 4% of a
/// batch-16 decode step.
///
/// # Safety
/// The CPU must have AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_avx512(xs: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = xs.len();
    let p = xs.as_mut_ptr();
    let mask = |i: usize| -> __mmask16 {
        if n - i >= 16 {
            0xFFFF
        } else {
            (1u16 << (n - i)) - 1
        }
    };
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut max = neg_inf;
    // SAFETY (all masked loads and stores): lanes at i + l < n only.
    for i in (0..n).step_by(16) {
        max = _mm512_max_ps(max, unsafe { _mm512_mask_loadu_ps(neg_inf, mask(i), p.add(i)) });
    }
    let max = _mm512_set1_ps(_mm512_reduce_max_ps(max));
    let mut sum = _mm512_setzero_ps();
    for i in (0..n).step_by(16) {
        let m = mask(i);
        let e = exp_avx512(_mm512_sub_ps(unsafe { _mm512_maskz_loadu_ps(m, p.add(i)) }, max));
        sum = _mm512_mask_add_ps(sum, m, sum, e);
        unsafe { _mm512_mask_storeu_ps(p.add(i), m, e) };
    }
    let inv = _mm512_set1_ps(1.0 / _mm512_reduce_add_ps(sum));
    for i in (0..n).step_by(16) {
        let m = mask(i);
        unsafe { _mm512_mask_storeu_ps(p.add(i), m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p.add(i)), inv)) };
    }
}

/// `e^x` for x <= 0 (softmax arguments): x = n ln2 + r with |r| <= ln2 / 2, e^r by its
/// degree-6 Taylor polynomial (relative error below 2e-7, about one f32 ulp), times 2^n by
/// `scalef` (which flushes to 0 below f32's range).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn exp_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let x = _mm512_max_ps(x, _mm512_set1_ps(-104.0));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    // ln 2 in two parts, so that n * LN2_HI is exact.
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), r);
    let mut poly = _mm512_set1_ps(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(poly, n)
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
mod tests;
