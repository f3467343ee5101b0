//! pd-proto: the one crate that compiles `proto/pd/v1/*.proto` (tonic + prost, into OUT_DIR).
//! Every other crate uses the generated types from here.

/// Version 1 of pd's APIs.
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("pd.v1");
}

pub mod tls;

/// Encoded file descriptors of every pd.v1 proto, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/pd_descriptor.bin"));

/// Connections accepted on `listener` with TCP_NODELAY set: tokens, KV accepts and commits
/// are small writes that must not wait for Nagle's algorithm. Every pd gRPC server serves
/// from this.
pub fn nodelay_incoming(
    listener: tokio::net::TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> + Send + 'static {
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::TcpListenerStream::new(listener).map(|conn| {
        conn.inspect(|stream| {
            let _ = stream.set_nodelay(true);
        })
    })
}
