//! Token embeddings kept as the checkpoint stores them. The table is `[vocab, hidden]`, and a
//! forward pass reads only the rows of its tokens. Widening the whole table to f32 at load
//! cost 4 bytes per value: at Llama-3.2-1B geometry (49,152 x 2,048) that is 384 MiB for a
//! table the Q4_1 file holds in 60 MiB. Block-quantized rows are widened on lookup, with
//! candle's own dequantization. A tied model whose output projection is repacked for the
//! `wq` kernels reads its rows from that projection, so the table is held once.

use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType};
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;

use crate::error::{EngineError, Result};
use crate::loader::RawTensor;
use crate::matmul_wq::WqWeight;

/// The embedding table: a GGUF tensor's raw blocks, or a dense tensor in its own dtype.
#[derive(Debug)]
pub enum Embedding {
    /// Row-major blocks of `dtype`, `row_bytes` per token; widened to f32 on lookup.
    Blocks { dtype: GgmlDType, bytes: Vec<u8>, row_bytes: usize, hidden: usize },
    /// `[vocab, hidden]` on the model's device (bf16, f16 or f32).
    Dense(Tensor),
    /// The output projection's repacked blocks (tied embeddings under `wq`).
    Tied(Arc<WqWeight>),
}

impl Embedding {
    /// Keeps `raw` (`[vocab, hidden]`) as it is stored: quantized blocks on the CPU, a dense
    /// tensor on `device`.
    pub fn new(raw: &RawTensor, device: &Device) -> Result<Self> {
        match raw {
            RawTensor::Quant(q) => {
                let (vocab, hidden) = q.shape().dims2()?;
                let dtype = q.dtype();
                if hidden % dtype.block_size() != 0 {
                    return Err(EngineError::Metadata(format!(
                        "token_embd.weight: width {hidden} is not a multiple of {dtype:?}'s block of {}",
                        dtype.block_size()
                    )));
                }
                let row_bytes = hidden / dtype.block_size() * dtype.type_size();
                let bytes = q.data()?.into_owned();
                if bytes.len() != vocab * row_bytes {
                    return Err(EngineError::Metadata(format!(
                        "token_embd.weight: {} bytes for {vocab} rows of {row_bytes}",
                        bytes.len()
                    )));
                }
                Ok(Embedding::Blocks { dtype, bytes, row_bytes, hidden })
            }
            RawTensor::Dense(t) => Ok(Embedding::Dense(t.to_device(device)?)),
        }
    }

    /// The f32 rows `[ids.len(), hidden]` of `ids` (checked against the vocabulary by the
    /// caller), on `device`.
    pub fn lookup(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        match self {
            Embedding::Blocks { dtype, bytes, row_bytes, hidden } => {
                let mut rows = Vec::with_capacity(ids.len() * row_bytes);
                for &id in ids {
                    let start = id as usize * row_bytes;
                    rows.extend_from_slice(&bytes[start..start + row_bytes]);
                }
                let q = qtensor_from_ggml(*dtype, &rows, vec![ids.len(), *hidden], &Device::Cpu)?;
                Ok(q.dequantize(&Device::Cpu)?.to_device(device)?)
            }
            Embedding::Dense(table) => {
                let ids = Tensor::from_slice(ids, ids.len(), table.device())?;
                Ok(table.index_select(&ids, 0)?.to_dtype(DType::F32)?)
            }
            Embedding::Tied(w) => w.rows(ids, device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;

    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?)
    }

    #[test]
    fn quantized_rows_widen_to_what_the_whole_table_dequantizes_to() -> Result<()> {
        let (vocab, hidden) = (40, 64);
        let values: Vec<f32> = (0..vocab * hidden).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        let dense = Tensor::from_vec(values, (vocab, hidden), &Device::Cpu)?;
        let ids = [3u32, 0, 39, 3, 17];
        let select = Tensor::new(&ids[..], &Device::Cpu)?;
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::F16, GgmlDType::F32] {
            let q = QTensor::quantize(&dense, dtype)?;
            let want = q.dequantize(&Device::Cpu)?.index_select(&select, 0)?;
            let table = Embedding::new(&RawTensor::Quant(q), &Device::Cpu)?;
            assert!(matches!(table, Embedding::Blocks { .. }));
            assert_eq!(max_diff(&table.lookup(&ids, &Device::Cpu)?, &want)?, 0.0, "{dtype:?}");
        }
        // Rows read from a tied output projection's repacked blocks are the same values.
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
            let q = QTensor::quantize(&dense, dtype)?;
            let want = Embedding::new(&RawTensor::Quant(QTensor::quantize(&dense, dtype)?), &Device::Cpu)?;
            let tied = Embedding::Tied(Arc::new(WqWeight::from_parts(&[&q])?));
            let (want, got) = (want.lookup(&ids, &Device::Cpu)?, tied.lookup(&ids, &Device::Cpu)?);
            assert_eq!(max_diff(&got, &want)?, 0.0, "tied {dtype:?}");
        }
        // A dense bf16 table keeps its dtype and gives f32 rows.
        let bf16 = dense.to_dtype(DType::BF16)?;
        let table = Embedding::new(&RawTensor::Dense(bf16.clone()), &Device::Cpu)?;
        let got = table.lookup(&ids, &Device::Cpu)?;
        assert_eq!(got.dtype(), DType::F32);
        assert_eq!(max_diff(&got, &bf16.to_dtype(DType::F32)?.index_select(&select, 0)?)?, 0.0);
        Ok(())
    }
}
