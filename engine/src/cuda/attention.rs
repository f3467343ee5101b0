//! Launches `paged_attention.cu`: decode attention for every one-token row of a step in one
//! kernel launch, reading K/V from the paged cache through each sequence's slot list.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{DType, Storage, Tensor};

use super::{cuda_device, cuda_err, tensor_from_slice};
use crate::attention::Heads;
use crate::error::{EngineError, Result};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/paged_attention.ptx"));
const MODULE: &str = "pd_paged_attention";
/// Must match `PD_THREADS` and `PD_MAX_HEAD_DIM` in the kernel.
const THREADS: u32 = 256;
pub(crate) const MAX_HEAD_DIM: usize = 256;

/// Attention outputs `[rows, num_heads * head_dim]` (f32) for `q` (`[rows, num_heads *
/// head_dim]` f32, one decode row per sequence), where row r attends to the cache slots
/// `contexts[r]` (positions 0..=its own, in order) of `k_cache`/`v_cache` (one layer).
pub(crate) fn paged_decode(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    contexts: &[&[u32]],
    heads: Heads,
) -> Result<Tensor> {
    let Heads { num_heads, num_kv_heads, head_dim, .. } = heads;
    let rows = contexts.len();
    if head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads != 0 || q.dims2()? != (rows, num_heads * head_dim) {
        return Err(EngineError::InvalidBatch(format!(
            "paged decode: q {:?} for {rows} rows, {num_heads} heads over {num_kv_heads} KV heads of {head_dim} \
             (at most {MAX_HEAD_DIM})",
            q.dims()
        )));
    }
    let dev = cuda_device(q.device(), "paged decode attention")?;
    let mut offsets = Vec::with_capacity(rows + 1);
    let mut slots = Vec::with_capacity(contexts.iter().map(|c| c.len()).sum());
    offsets.push(0u32);
    for c in contexts {
        slots.extend_from_slice(c);
        offsets.push(slots.len() as u32);
    }
    let max_ctx = contexts.iter().map(|c| c.len()).max().unwrap_or(0).max(1);
    let slots_d = dev.clone_htod(&slots).map_err(|e| cuda_err("copying slot lists", e))?;
    let offsets_d = dev.clone_htod(&offsets).map_err(|e| cuda_err("copying slot offsets", e))?;
    let out = dev.alloc_zeros::<f32>(rows * num_heads * head_dim).map_err(|e| cuda_err("allocating outputs", e))?;
    // SAFETY: the kernel writes every score before reading it (phase 1 before phase 2).
    let scratch =
        unsafe { dev.alloc::<f32>(rows * num_heads * max_ctx) }.map_err(|e| cuda_err("allocating scores", e))?;

    let q = q.contiguous()?;
    let (q_storage, q_layout) = q.storage_and_layout();
    let (k_storage, k_layout) = k_cache.storage_and_layout();
    let (v_storage, v_layout) = v_cache.storage_and_layout();
    let (Storage::Cuda(q_s), Storage::Cuda(k_s), Storage::Cuda(v_s)) = (&*q_storage, &*k_storage, &*v_storage) else {
        return Err(cuda_err("paged decode attention", "query and cache must all be on the GPU"));
    };
    let q_view = q_s.as_cuda_slice::<f32>()?.slice(q_layout.start_offset()..);
    let config =
        LaunchConfig { grid_dim: (num_heads as u32, rows as u32, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    let (nh, nkv, hd, mc) = (num_heads as i32, num_kv_heads as i32, head_dim as i32, max_ctx as i32);
    let scale = 1.0f32 / (head_dim as f32).sqrt();
    macro_rules! launch {
        ($ty:ty, $name:literal) => {{
            let func = dev.get_or_load_custom_func($name, MODULE, PTX)?;
            let k_view = k_s.as_cuda_slice::<$ty>()?.slice(k_layout.start_offset()..);
            let v_view = v_s.as_cuda_slice::<$ty>()?.slice(v_layout.start_offset()..);
            let mut b = func.builder();
            b.arg(&out).arg(&scratch).arg(&q_view).arg(&k_view).arg(&v_view);
            b.arg(&slots_d).arg(&offsets_d).arg(&nh).arg(&nkv).arg(&hd).arg(&mc).arg(&scale);
            // SAFETY: the argument list matches the kernel's signature; every index the kernel
            // forms is bounded by the slot lists (checked against the cache by the caller's
            // block manager) and the sizes allocated above.
            unsafe { b.launch(config) }.map_err(|e| cuda_err("paged decode launch", e))?;
        }};
    }
    match k_cache.dtype() {
        DType::F16 => launch!(half::f16, "pd_paged_decode_f16"),
        DType::F32 => launch!(f32, "pd_paged_decode_f32"),
        other => return Err(cuda_err("paged decode attention", format!("no kernel for a {other:?} cache"))),
    }
    drop((q_storage, k_storage, v_storage));
    Ok(tensor_from_slice(out, dev, (rows, num_heads * head_dim)))
}
