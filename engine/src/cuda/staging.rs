//! KV bytes across PCIe through two reusable pinned host buffers.
//!
//! Export (`download`) takes the layers' tensors one by one as the caller produces them: the
//! device->host copy of tensor i is queued on the device's stream right behind the gather
//! that made it, and while it runs the host copies tensor i-1's bytes out of the other
//! buffer. Import (`upload`) does the reverse: the host fills one buffer while the previous
//! one is still being copied to the device. Pinned memory lets the copies run as DMA at full
//! link speed; the buffers are allocated once, grown when a larger tensor comes, and kept
//! for the cache's lifetime (plain page-locked memory, not write-combined: the host reads it).

use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::{
    result, CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, PinnedHostSlice,
};
use candle_core::{DType, Storage, Tensor};

use super::{cuda_device, cuda_err, tensor_from_slice};
use crate::error::Result;

/// One pinned buffer and the event recorded after the last copy that uses it.
struct Buf {
    host: PinnedHostSlice<u8>,
    done: CudaEvent,
}

impl Drop for Buf {
    fn drop(&mut self) {
        // The memory must outlive any copy still reading or writing it.
        let _ = self.done.synchronize();
    }
}

/// The two staging buffers of one KV cache.
#[derive(Default)]
pub(crate) struct Staging {
    bufs: Mutex<[Option<Buf>; 2]>,
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Staging")
    }
}

/// Makes `slot` hold at least `bytes`, waiting for its last copy before replacing it.
fn ensure<'a>(slot: &'a mut Option<Buf>, ctx: &Arc<CudaContext>, bytes: usize) -> Result<&'a mut Buf> {
    if slot.as_ref().is_none_or(|b| b.host.len() < bytes) {
        *slot = None; // drops (and waits for) the old buffer first
                      // Round up so that a sequence growing a little does not reallocate every time.
        let len = bytes.next_power_of_two().max(1 << 20);
        // SAFETY: the memory is only read after a copy into it completed (`done` is recorded
        // after every copy and synchronized before every host access).
        let host =
            unsafe { ctx.alloc_pinned_with_flags::<u8>(len, 0) }.map_err(|e| cuda_err("pinned allocation", e))?;
        let done = ctx.new_event(None).map_err(|e| cuda_err("event", e))?;
        *slot = Some(Buf { host, done });
    }
    Ok(slot.as_mut().expect("filled above"))
}

fn host_bytes(buf: &mut Buf, len: usize) -> Result<&mut [u8]> {
    buf.done.synchronize().map_err(|e| cuda_err("waiting for a staging copy", e))?;
    Ok(&mut buf.host.as_mut_slice().map_err(|e| cuda_err("pinned buffer", e))?[..len])
}

fn stream_of(tensor: &Tensor, what: &str) -> Result<Arc<CudaStream>> {
    let stream = cuda_device(tensor.device(), what)?.cuda_stream();
    stream.context().bind_to_thread().map_err(|e| cuda_err(what, e))?;
    Ok(stream)
}

impl Staging {
    /// Appends the bytes of each tensor (contiguous, f16 or f32, on the GPU) to `out`, in order.
    pub(crate) fn download(&self, tensors: impl Iterator<Item = Result<Tensor>>, out: &mut Vec<u8>) -> Result<()> {
        let mut bufs = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let mut pending: Option<(usize, usize)> = None;
        for (i, tensor) in tensors.enumerate() {
            let tensor = tensor?.contiguous()?;
            let stream = stream_of(&tensor, "KV export")?;
            let bytes = tensor.elem_count() * tensor.dtype().size_in_bytes();
            let slot = i % 2;
            let buf = ensure(&mut bufs[slot], stream.context(), bytes)?;
            let (storage, layout) = tensor.storage_and_layout();
            let Storage::Cuda(s) = &*storage else { return Err(cuda_err("KV export", "tensor left the GPU")) };
            let (start, n) = (layout.start_offset(), tensor.elem_count());
            let dst = host_bytes(buf, bytes)?;
            macro_rules! copy_out {
                ($ty:ty) => {{
                    let view = s.as_cuda_slice::<$ty>()?.slice(start..start + n);
                    let (src, _sync) = view.device_ptr(&stream);
                    // SAFETY: `src` addresses the `bytes` bytes of `tensor`, alive until the copy
                    // ran (candle frees in stream order); `dst` is pinned memory of `bytes` that
                    // nothing touches until `done` (recorded next) has fired.
                    unsafe { result::memcpy_dtoh_async(dst, src, stream.cu_stream()) }
                        .map_err(|e| cuda_err("KV export copy", e))?;
                }};
            }
            match tensor.dtype() {
                DType::F16 => copy_out!(half::f16),
                DType::F32 => copy_out!(f32),
                other => return Err(cuda_err("KV export", format!("no staging for {other:?}"))),
            }
            buf.done.record(&stream).map_err(|e| cuda_err("event", e))?;
            drop(storage);
            if let Some((p, len)) = pending.replace((slot, bytes)) {
                out.extend_from_slice(host_bytes(bufs[p].as_mut().expect("used above"), len)?);
            }
        }
        if let Some((p, len)) = pending {
            out.extend_from_slice(host_bytes(bufs[p].as_mut().expect("used above"), len)?);
        }
        Ok(())
    }

    /// A new GPU tensor of `dtype` (f16 or f32) and `shape` holding `bytes` (little endian),
    /// on the device of `like`. The copy is queued; the next upload fills the other buffer
    /// while it runs.
    pub(crate) fn upload(&self, like: &Tensor, bytes: &[u8], dtype: DType, shape: (usize, usize)) -> Result<Tensor> {
        let dev = cuda_device(like.device(), "KV import")?;
        let stream = stream_of(like, "KV import")?;
        let n = shape.0 * shape.1;
        if bytes.len() != n * dtype.size_in_bytes() {
            return Err(cuda_err("KV import", format!("{} bytes for {n} {dtype:?} values", bytes.len())));
        }
        let mut bufs = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        // Alternate buffers: the one used last may still be copying.
        bufs.swap(0, 1);
        let buf = ensure(&mut bufs[0], stream.context(), bytes.len())?;
        host_bytes(buf, bytes.len())?.copy_from_slice(bytes);
        macro_rules! copy_in {
            ($ty:ty) => {{
                // SAFETY: the device allocation is fully written by the copy queued right after
                // it on the same stream, before anything can read it.
                let mut slice = unsafe { dev.alloc::<$ty>(n) }?;
                let (dst, _sync) = slice.device_ptr_mut(&stream);
                let src = &buf.host.as_slice().map_err(|e| cuda_err("pinned buffer", e))?[..bytes.len()];
                // SAFETY: `dst` holds `n` values = `bytes.len()` bytes; `src` is pinned and
                // untouched until `done` (recorded next) has fired.
                unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }
                    .map_err(|e| cuda_err("KV import copy", e))?;
                drop(_sync);
                buf.done.record(&stream).map_err(|e| cuda_err("event", e))?;
                tensor_from_slice(slice, dev, shape)
            }};
        }
        Ok(match dtype {
            DType::F16 => copy_in!(half::f16),
            DType::F32 => copy_in!(f32),
            other => return Err(cuda_err("KV import", format!("no staging for {other:?}"))),
        })
    }
}
