//! The attention paths against each other: decode kernel vs gathered path, a chunk vs its
//! rows one by one (tiles, windows, soft-capping), the SIMD softmax vs the portable one.

use super::*;

#[test]
fn the_avx512_softmax_matches_the_portable_one() {
    if crate::simd::detected() != crate::simd::Level::Avx512 {
        eprintln!("skipped: this CPU has no AVX-512");
        return;
    }
    // Lengths around the 16-lane edges; values from a wide range, one very negative.
    for n in [1usize, 15, 16, 17, 100, 513] {
        let xs: Vec<f32> =
            (0..n).map(|i| ((i * 7919) % 97) as f32 * 0.37 - 20.0 - if i == 3 { 200.0 } else { 0.0 }).collect();
        let mut portable = xs.clone();
        softmax_in_place(&mut portable);
        let mut wide = xs;
        // SAFETY: AVX-512 F was detected above.
        unsafe { softmax_avx512(&mut wide) };
        for (a, b) in portable.iter().zip(&wide) {
            assert!((a - b).abs() <= 1e-6 + 1e-5 * a.abs(), "n {n}: {a} vs {b}");
        }
    }
}
use crate::config::{CacheConfig, KvCacheDType, ModelConfig, RopeStyle};

/// The direct decode kernel and the gather+matmul path agree on scattered blocks, for both
/// cache element types, with a toy geometry (portable loops) and SmolLM2's (64-wide heads,
/// 3 query heads per KV head: the grouped AVX-512 kernel where the CPU has it), with and
/// without a sliding window.
#[test]
fn decode_kernel_matches_gathered_path() -> Result<()> {
    let h = |num_heads, num_kv_heads, head_dim, softcap, window| Heads {
        num_heads,
        num_kv_heads,
        head_dim,
        softcap,
        window,
    };
    for dtype in [KvCacheDType::F32, KvCacheDType::F16] {
        for heads in [
            h(4, 2, 8, 0.0, 0),
            h(9, 3, 64, 0.0, 0),
            h(4, 2, 128, 0.0, 0),
            // Gemma 2's soft-capping, in the portable and the grouped kernels.
            h(4, 2, 8, 1.5, 0),
            h(4, 2, 128, 1.5, 0),
            // Windows shorter than the context (1: a row sees itself only), and longer.
            h(4, 2, 8, 0.0, 4),
            h(9, 3, 64, 0.0, 5),
            h(4, 2, 128, 1.5, 1),
            h(4, 2, 8, 0.0, 64),
        ] {
            decode_kernel_matches_gathered_path_with(dtype, heads)?;
        }
    }
    Ok(())
}

/// A one-layer model of `heads` and a cache whose 32 slots hold random K/V.
fn filled_cache(dtype: KvCacheDType, heads: Heads) -> Result<(ModelConfig, KvCache)> {
    let model = ModelConfig {
        vocab_size: 8,
        hidden_size: heads.num_heads * heads.head_dim,
        intermediate_size: 8,
        num_layers: 1,
        num_heads: heads.num_heads,
        num_kv_heads: heads.num_kv_heads,
        head_dim: heads.head_dim,
        max_position: 64,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        rope_style: RopeStyle::Halves,
        rope_scaling: Default::default(),
        parts: Default::default(),
    };
    let config = CacheConfig { prefix_cache: false, block_size: 4, dtype, ..CacheConfig::with_blocks(8) };
    let cache = KvCache::new(&model, &config, &Device::Cpu)?;
    let (slots_total, kv_width) = (32, model.kv_width());
    let k = Tensor::randn(0f32, 1.0, (slots_total, kv_width), &Device::Cpu)?;
    let v = Tensor::randn(0f32, 1.0, (slots_total, kv_width), &Device::Cpu)?;
    let index: Vec<u32> = (0..slots_total as u32).flat_map(|s| std::iter::repeat_n(s, kv_width)).collect();
    let index = Tensor::from_vec(index, (slots_total, kv_width), &Device::Cpu)?;
    cache.write(0, &index, &k, &v)?;
    Ok((model, cache))
}

/// 11 positions over blocks 5, 2, 7 (scattered, last one partly used).
fn scattered_slots() -> Vec<u32> {
    (0..11u32).map(|p| [5u32, 2, 7][(p / 4) as usize] * 4 + p % 4).collect()
}

/// A plan for `rows` rows at `start_pos` that takes the gather path (as a non-CPU
/// device would run decode rows).
fn gather_plan(rows: usize, start_pos: usize, slots: Vec<u32>, heads: Heads) -> Result<SeqPlan> {
    let inputs = |window| GatherInputs::new(&slots, rows, start_pos, window, &Device::Cpu);
    let (gather, window_gather) = (Some(inputs(0)?), Some(inputs(heads.window)?));
    Ok(SeqPlan { row_start: 0, rows, start_pos, slots, heads, gather, window_gather })
}

fn decode_kernel_matches_gathered_path_with(dtype: KvCacheDType, heads: Heads) -> Result<()> {
    let (model, cache) = filled_cache(dtype, heads)?;
    let slots = scattered_slots();
    let plan = SeqPlan::new(0, 1, 10, slots.clone(), heads, &Device::Cpu)?;
    let gather_plan = gather_plan(1, 10, slots, heads)?;
    let q = Tensor::randn(0f32, 1.0, (1, model.hidden_size), &Device::Cpu)?;
    let direct = paged_attention(&q, &cache, 0, std::slice::from_ref(&plan), heads)?;
    let gathered = gathered_attention(&q, &cache, 0, &gather_plan, heads)?;
    let diff = (direct - gathered)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff < 1e-5, "{dtype:?} {heads:?}: max difference {diff}");
    Ok(())
}

/// A prefill chunk's rows see what each row would see as a decode step (the mask of a
/// sliding window included), whatever the tiles of query rows the scores are computed
/// in, and the window changes the result where it is shorter than the context.
#[test]
fn a_chunk_attends_as_its_rows_would_one_by_one() -> Result<()> {
    for (window, softcap, tile) in [(0, 0.0, 4), (3, 0.0, 4), (6, 0.0, 4), (0, 0.0, 1), (3, 1.5, 3), (0, 1.5, 2)] {
        let heads = Heads { num_heads: 4, num_kv_heads: 2, head_dim: 8, softcap, window };
        let (model, cache) = filled_cache(KvCacheDType::F32, heads)?;
        let (rows, start_pos) = (4, 7);
        let q = Tensor::randn(0f32, 1.0, (rows, model.hidden_size), &Device::Cpu)?;
        let chunk = gather_plan(rows, start_pos, scattered_slots(), heads)?;
        let together = gathered_attention_in_tiles(&q, &cache, 0, &chunk, heads, tile)?;
        let full = gathered_attention(&q, &cache, 0, &chunk, Heads { window: 0, ..heads })?;
        for r in 0..rows {
            let plan = SeqPlan::new(0, 1, start_pos + r, scattered_slots(), heads, &Device::Cpu)?;
            let alone = paged_attention(&q.narrow(0, r, 1)?, &cache, 0, std::slice::from_ref(&plan), heads)?;
            let diff = (together.narrow(0, r, 1)? - alone)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "window {window}, tile {tile}, row {r}: max difference {diff}");
        }
        let changed = (together - full)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(window > 0, changed > 1e-3, "window {window}: the window changed the result by {changed}");
    }
    Ok(())
}

#[test]
fn score_tiles_hold_a_bounded_number_of_scores() {
    assert_eq!(tile_rows(512, 2, 2048), 256);
    assert_eq!(tile_rows(512, 2, 512), 512, "a short context keeps the chunk in one tile");
    assert_eq!(tile_rows(512, 8, 1 << 20), 16, "never fewer than 16 rows");
    assert_eq!(tile_rows(5, 2, 64), 16);
}

#[test]
fn a_window_counts_the_query_itself() {
    assert!(sees(10, 10, 1) && !sees(10, 9, 1));
    assert!(sees(10, 7, 4) && !sees(10, 6, 4) && !sees(10, 11, 4));
    assert!(sees(10, 0, 0));
    assert_eq!((first_key(10, 4), first_key(2, 4), first_key(10, 0)), (7, 0, 0));
}
