//! The UCX transport (cargo feature `ucx`), over our own bindings to the system libucx.
//!
//! Why active messages: each frame travels as one AM whose header names the transfer, layer
//! and blocks and whose payload is the KV bytes. The receiver sees the header before it takes
//! the data, so every check of `KvRegistry` runs before a byte reaches the KV cache; large
//! frames use UCX's rendezvous protocol (zero-copy over shared memory or RDMA) into a staging
//! buffer. Tag messages would need a tag space per connection and a separate control channel;
//! RMA put into the receiver's registered KV memory would skip the receiver-side checks
//! (a wrong block index from a confused sender would overwrite another sequence's KV).
//!
//! The protocol is pd.v1's (header / frame / commit / abort, answered by accepted / committed /
//! refused), each message in an envelope that names the transfer id. A UCX worker is
//! single-threaded: each end runs one thread that owns the context, worker and endpoints and
//! talks to async code through channels.
//!
//! Always set `UCX_NET_DEVICES=lo` and an explicit transport list in tests and local runs
//! (`UcxConfig` does this without touching the process environment).

mod envelope;
mod receiver;
mod sender;
mod worker;

pub use receiver::UcxKvReceiver;
pub use sender::{UcxKvSender, UcxTransfer};

/// Active message ids.
const AM_TO_RECEIVER: u32 = 17;
const AM_TO_SENDER: u32 = 18;

/// Which UCX transports and devices to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxConfig {
    /// `UCX_TLS`, e.g. "tcp" or "posix,sysv,cma,tcp" (tcp is needed for connection setup).
    pub transports: String,
    /// `UCX_NET_DEVICES`, e.g. "lo".
    pub net_devices: String,
}

impl UcxConfig {
    /// TCP over loopback only.
    pub fn loopback_tcp() -> Self {
        UcxConfig { transports: "tcp".into(), net_devices: "lo".into() }
    }

    /// Shared memory for data between processes on one host; TCP over loopback to connect.
    pub fn loopback_shared_memory() -> Self {
        UcxConfig { transports: "posix,sysv,cma,tcp".into(), net_devices: "lo".into() }
    }
}
