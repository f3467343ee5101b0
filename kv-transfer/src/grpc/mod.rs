//! The gRPC transport: the decode worker serves `pd.v1.KvTransfer/Transfer`; the prefill
//! worker streams frames into it. HTTP/2 windows are sized for bulk data (16 MiB per stream,
//! 64 MiB per connection, as measured on loopback); frames are at most 1 MiB; a bounded queue
//! of frames per transfer gives backpressure, so memory per transfer stays bounded.

mod client;
mod server;

pub use client::{GrpcKvSender, GrpcTransfer};
pub use server::{kv_server_builder, spawn_lease_reaper, GrpcKvReceiver, KvTransferService};

/// HTTP/2 per-stream flow-control window.
pub(crate) const STREAM_WINDOW: u32 = 16 << 20;
/// HTTP/2 per-connection flow-control window.
pub(crate) const CONNECTION_WINDOW: u32 = 64 << 20;
/// Largest gRPC message accepted: one frame plus its fields.
pub(crate) const MAX_MESSAGE: usize = crate::wire::MAX_FRAME_BYTES + (64 << 10);
/// Frames queued per transfer on the sending side before `send` waits.
pub const FRAMES_IN_FLIGHT: usize = 8;
