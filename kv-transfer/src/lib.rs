//! pd-kv-transfer: moves a sequence's KV cache from a prefill worker into blocks a decode
//! worker reserved, layer by layer, checked frame by frame.
//!
//! - `wire`: geometry, header and frame types, frame planning (at most 1 MiB each).
//! - `receiver`: reservations with leases and every check a frame must pass (`KvRegistry`),
//!   and the `KvSink` the data is written to (the engine's KV cache implements it).
//! - `engine_io`: the engine's side: model geometry, layer frames, the cache as sink.
//! - `convert`: the one place pd.v1 messages become engine types and back (sampling, KV
//!   target, dtype).
//! - `grpc`: the always-built transport (tonic bidirectional stream with backpressure).
//! - `ucx` (feature `ucx`): the UCX transport (active messages; tcp, shared memory, RDMA).
//! - `transport`: the transport an endpoint names (`host:port` gRPC, `ucx://host:port`), and a
//!   sender over either.
//! - `KvSender` / `KvReceiver`: what a transport backend provides.

#![warn(clippy::too_many_lines)] // functions stay under 80 lines (clippy.toml)

pub mod convert;
pub mod engine_io;
pub mod error;
pub mod grpc;
pub mod receiver;
pub mod transport;
#[cfg(feature = "ucx")]
pub mod ucx;
pub mod wire;

use std::future::Future;

use pd_proto::v1 as pb;

pub use error::TransferError;
pub use receiver::{CommittedKv, KvRegistry, KvSink, MemorySink, Outcome, Reservation, SenderId};
pub use wire::{frame_runs, Frame, KvGeometry, TransferHeader, MAX_FRAME_BYTES};

/// A commit without log probabilities: the first token and the prompt length.
pub fn kv_commit(first_token: u32, prompt_tokens: u32) -> pb::KvCommit {
    pb::KvCommit { first_token, prompt_tokens, first_logprobs: None }
}

/// What the receiver confirmed at commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitReceipt {
    pub bytes: u64,
    pub frames: u32,
}

/// The sending end of a transport: opens transfers to one receiver.
pub trait KvSender {
    type Transfer: KvTransfer;
    /// Sends the header and waits until the receiver accepts it (or refuses, or times out).
    fn start(&self, header: TransferHeader) -> impl Future<Output = Result<Self::Transfer, TransferError>> + Send;
}

/// One open transfer on the sending side.
pub trait KvTransfer: Send {
    /// Queues a frame; waits while the in-flight window is full. Fails early if the receiver
    /// refused the transfer or vanished.
    fn send(&mut self, frame: Frame) -> impl Future<Output = Result<(), TransferError>> + Send;
    /// Ends the transfer (first token, prompt length, the first token's log probabilities)
    /// and waits for the receiver's confirmation.
    fn commit(self, commit: pb::KvCommit) -> impl Future<Output = Result<CommitReceipt, TransferError>> + Send;
    /// Ends the transfer without success; the receiver frees the blocks.
    fn abort(self, reason: &str) -> impl Future<Output = ()> + Send;
}

/// The receiving end of a transport, serving one registry until shut down.
pub trait KvReceiver {
    /// Address senders connect to.
    fn local_addr(&self) -> std::net::SocketAddr;
    /// Stops accepting transfers and waits for the server to end.
    fn shutdown(self) -> impl Future<Output = ()> + Send;
}
