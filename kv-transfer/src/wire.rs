//! The transfer's wire units as Rust types, and their conversion from and to `pd.v1`.
//!
//! A frame carries K then V of a run of consecutive blocks (in the reservation's order) of one
//! layer, at most `MAX_FRAME_BYTES`, with a CRC-32 of its data.

use std::collections::HashMap;

use pd_engine::WireDType;
use pd_proto::v1 as pb;

use crate::convert::{dtype_from_pb, dtype_to_pb};
use crate::error::TransferError;

/// Largest frame payload: keeps gRPC messages small and memory per frame bounded.
pub const MAX_FRAME_BYTES: usize = 1 << 20;

/// What both ends must agree on before any KV moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    pub model_fingerprint: u64,
    pub dtype: WireDType,
    pub num_layers: u32,
    pub block_size: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
}

impl KvGeometry {
    /// Bytes of K (or V) of one block of one layer.
    pub fn block_bytes(&self) -> usize {
        self.block_size as usize * self.num_kv_heads as usize * self.head_dim as usize * self.dtype.size()
    }

    /// Payload bytes of a frame of `blocks` blocks (K and V).
    pub fn frame_bytes(&self, blocks: usize) -> usize {
        2 * blocks * self.block_bytes()
    }

    /// Blocks per frame so a frame stays within `MAX_FRAME_BYTES` (at least one).
    pub fn blocks_per_frame(&self) -> usize {
        (MAX_FRAME_BYTES / self.frame_bytes(1)).max(1)
    }

    /// Names the first difference between what the sender has and the receiver expects.
    pub fn check_matches(&self, expected: &KvGeometry) -> Result<(), TransferError> {
        let fields: [(&str, u64, u64); 5] = [
            ("num_layers", self.num_layers.into(), expected.num_layers.into()),
            ("block_size", self.block_size.into(), expected.block_size.into()),
            ("num_kv_heads", self.num_kv_heads.into(), expected.num_kv_heads.into()),
            ("head_dim", self.head_dim.into(), expected.head_dim.into()),
            ("dtype size", self.dtype.size() as u64, expected.dtype.size() as u64),
        ];
        if self.model_fingerprint != expected.model_fingerprint {
            return Err(TransferError::Incompatible(format!(
                "model fingerprint {:016x}, receiver has {:016x}",
                self.model_fingerprint, expected.model_fingerprint
            )));
        }
        if self.dtype != expected.dtype {
            return Err(TransferError::Incompatible(format!(
                "dtype {:?}, receiver expects {:?}",
                self.dtype, expected.dtype
            )));
        }
        for (name, got, want) in fields {
            if got != want {
                return Err(TransferError::Incompatible(format!("{name} {got}, receiver expects {want}")));
            }
        }
        Ok(())
    }
}

/// Opens a transfer.
#[derive(Debug, Clone, PartialEq)]
pub struct TransferHeader {
    pub transfer_id: String,
    pub geometry: KvGeometry,
    /// Destination blocks in token order.
    pub block_ids: Vec<u32>,
    pub num_tokens: u32,
    /// W3C trace context of the sending span.
    pub trace_context: HashMap<String, String>,
}

/// K and V of `block_count` blocks of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    pub layer: u32,
    /// Index into the header's block list.
    pub first_block: u32,
    pub block_count: u32,
    pub checksum: u32,
    pub data: Vec<u8>,
}

impl Frame {
    /// A frame whose checksum is computed from `data`.
    pub fn new(layer: u32, first_block: u32, block_count: u32, data: Vec<u8>) -> Self {
        Frame { layer, first_block, block_count, checksum: crc32fast::hash(&data), data }
    }
}

/// A frame whose data is borrowed (from a transport's receive buffer).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FrameView<'a> {
    pub layer: u32,
    pub first_block: u32,
    pub block_count: u32,
    pub checksum: u32,
    pub data: &'a [u8],
}

impl Frame {
    pub fn view(&self) -> FrameView<'_> {
        FrameView {
            layer: self.layer,
            first_block: self.first_block,
            block_count: self.block_count,
            checksum: self.checksum,
            data: &self.data,
        }
    }
}

/// Splits `num_blocks` blocks into frame-sized runs `(first, count)`.
pub fn frame_runs(geometry: &KvGeometry, num_blocks: usize) -> Vec<(u32, u32)> {
    let per = geometry.blocks_per_frame();
    (0..num_blocks).step_by(per).map(|first| (first as u32, per.min(num_blocks - first) as u32)).collect()
}

impl TransferHeader {
    pub fn to_pb(&self) -> pb::KvTransferHeader {
        let g = &self.geometry;
        pb::KvTransferHeader {
            transfer_id: self.transfer_id.clone(),
            model_fingerprint: g.model_fingerprint,
            dtype: dtype_to_pb(g.dtype) as i32,
            num_layers: g.num_layers,
            block_size: g.block_size,
            num_kv_heads: g.num_kv_heads,
            head_dim: g.head_dim,
            block_ids: self.block_ids.clone(),
            num_tokens: self.num_tokens,
            trace_context: self.trace_context.clone(),
        }
    }

    pub fn from_pb(h: pb::KvTransferHeader) -> Result<Self, TransferError> {
        Ok(TransferHeader {
            geometry: KvGeometry {
                model_fingerprint: h.model_fingerprint,
                dtype: dtype_from_pb(h.dtype)?,
                num_layers: h.num_layers,
                block_size: h.block_size,
                num_kv_heads: h.num_kv_heads,
                head_dim: h.head_dim,
            },
            transfer_id: h.transfer_id,
            block_ids: h.block_ids,
            num_tokens: h.num_tokens,
            trace_context: h.trace_context,
        })
    }
}

impl Frame {
    pub fn to_pb(self) -> pb::KvFrame {
        pb::KvFrame {
            layer: self.layer,
            first_block: self.first_block,
            block_count: self.block_count,
            checksum: self.checksum,
            data: self.data,
        }
    }

    pub fn from_pb(f: pb::KvFrame) -> Self {
        Frame {
            layer: f.layer,
            first_block: f.first_block,
            block_count: f.block_count,
            checksum: f.checksum,
            data: f.data,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> KvGeometry {
        KvGeometry {
            model_fingerprint: 7,
            dtype: WireDType::F16,
            num_layers: 30,
            block_size: 16,
            num_kv_heads: 3,
            head_dim: 64,
        }
    }

    #[test]
    fn frames_stay_under_the_limit_and_cover_every_block() {
        let g = geometry();
        assert_eq!(g.frame_bytes(1), 2 * 16 * 3 * 64 * 2);
        let runs = frame_runs(&g, 200);
        assert!(runs.iter().all(|&(_, n)| g.frame_bytes(n as usize) <= MAX_FRAME_BYTES));
        let covered: Vec<u32> = runs.iter().flat_map(|&(f, n)| f..f + n).collect();
        assert_eq!(covered, (0..200).collect::<Vec<_>>());
    }

    #[test]
    fn mismatches_are_named() {
        let g = geometry();
        let mut other = g;
        other.block_size = 32;
        let err = other.check_matches(&g).expect_err("block size");
        assert!(err.to_string().contains("block_size 32"), "{err}");
        let mut other = g;
        other.model_fingerprint = 8;
        assert!(other.check_matches(&g).expect_err("fp").to_string().contains("fingerprint"));
        let mut other = g;
        other.dtype = WireDType::F32;
        assert!(other.check_matches(&g).expect_err("dtype").to_string().contains("dtype"));
        assert_eq!(g.check_matches(&g), Ok(()));
    }
}
