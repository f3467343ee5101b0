//! The engine's own CUDA code (feature `cuda`): where candle has no op that does the job
//! well. Decode attention reads the paged cache in place (`attention`), and KV export/import
//! cross PCIe through reusable pinned host buffers (`staging`). Everything else on a GPU runs
//! on candle's CUDA ops and cuBLAS.

pub(crate) mod attention;
pub(crate) mod staging;

use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{Device, Storage, Tensor};

use crate::error::{EngineError, Result};

/// Turns a CUDA driver or launch error into ours, naming what was being done.
pub(crate) fn cuda_err(what: &str, e: impl std::fmt::Display) -> EngineError {
    EngineError::Cuda { what: what.into(), reason: e.to_string() }
}

/// The CUDA device behind `device`, or an error naming `what` needed it.
pub(crate) fn cuda_device<'a>(device: &'a Device, what: &str) -> Result<&'a CudaDevice> {
    match device {
        Device::Cuda(d) => Ok(d),
        other => {
            Err(EngineError::Cuda { what: what.into(), reason: format!("needs a CUDA tensor, got one on {other:?}") })
        }
    }
}

/// Wraps a device slice that this module allocated as a contiguous tensor of `shape`.
pub(crate) fn tensor_from_slice<T: candle_core::cuda_backend::CudaDType>(
    slice: candle_core::cuda_backend::cudarc::driver::CudaSlice<T>,
    device: &CudaDevice,
    shape: impl Into<candle_core::Shape>,
) -> Tensor {
    let storage = CudaStorage::wrap_cuda_slice(slice, device.clone());
    Tensor::from_storage(Storage::Cuda(storage), shape, candle_core::op::BackpropOp::none(), false)
}
