//! pd-proto: the one crate that compiles `proto/pd/v1/*.proto` (tonic + prost, into OUT_DIR).
//! Every other crate uses the generated types from here.

/// Version 1 of pd's APIs.
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("pd.v1");
}

pub mod tls;

/// The answer of a worker's `LoadStream`: one load per request read, in order.
pub type LoadAnswers<T> =
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<T, tonic::Status>> + Send + 'static>>;

/// Serves `LoadStream`: each `LoadRequest` read from `requests` answered with `load` of it, as
/// the unary `Load` answers it. An error (a worker shutting down) ends the stream with that
/// status; the router then counts the worker as gone for the round, as with a failed `Load`.
pub fn answer_loads<T, F>(requests: tonic::Streaming<v1::LoadRequest>, mut load: F) -> LoadAnswers<T>
where
    T: Send + 'static,
    F: FnMut(&v1::LoadRequest) -> Result<T, tonic::Status> + Send + 'static,
{
    use tokio_stream::StreamExt;
    Box::pin(requests.map(move |request| request.and_then(|r| load(&r))))
}

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
