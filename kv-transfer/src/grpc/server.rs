//! Receiving side of the gRPC transport: one task per transfer stream drives the registry.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pb::kv_receiver_message::Message as Reply;
use pb::kv_sender_message::Message as Incoming;
use pb::kv_transfer_server::{KvTransfer as KvTransferRpc, KvTransferServer};
use pd_proto::v1 as pb;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::{CONNECTION_WINDOW, FRAMES_IN_FLIGHT, MAX_MESSAGE, STREAM_WINDOW};
use crate::error::TransferError;
use crate::receiver::{KvRegistry, SenderId};
use crate::wire::{Frame, TransferHeader};

/// The `pd.v1.KvTransfer` service over a registry.
#[derive(Debug, Clone)]
pub struct KvTransferService {
    registry: Arc<KvRegistry>,
}

impl KvTransferService {
    pub fn new(registry: Arc<KvRegistry>) -> Self {
        KvTransferService { registry }
    }

    /// The tonic server wrapper with message limits for 1 MiB frames.
    pub fn into_server(self) -> KvTransferServer<Self> {
        KvTransferServer::new(self).max_decoding_message_size(MAX_MESSAGE)
    }
}

fn refused(err: &TransferError) -> pb::KvReceiverMessage {
    pb::KvReceiverMessage {
        message: Some(Reply::Refused(pb::KvRefused { reason: err.to_string(), kind: err.kind().to_string() })),
    }
}

/// Opens the transfer a header names: its id, this stream's sender id and the acceptance, or
/// the refusal to send.
fn open(
    registry: &KvRegistry,
    h: pb::KvTransferHeader,
) -> Result<((String, SenderId), pb::KvReceiverMessage), pb::KvReceiverMessage> {
    let id = h.transfer_id.clone();
    match TransferHeader::from_pb(h).and_then(|header| registry.open(&header)) {
        Ok(sender) => {
            let accepted = pb::KvAccepted { max_frames_in_flight: FRAMES_IN_FLIGHT as u32 };
            Ok(((id, sender), pb::KvReceiverMessage { message: Some(Reply::Accepted(accepted)) }))
        }
        Err(e) => Err(refused(&registry.reject(&id, None, e))),
    }
}

/// The refusal of a message out of protocol order (the transfer, if open, is rejected).
fn unexpected(
    registry: &KvRegistry,
    message: Option<&Incoming>,
    open: Option<&(String, SenderId)>,
) -> pb::KvReceiverMessage {
    let what = match message {
        Some(Incoming::Header(_)) => "a second header",
        None => "an empty message",
        _ => "a frame, commit or abort before the header",
    };
    let err = TransferError::Protocol(format!("unexpected {what}"));
    let err = match open {
        Some((id, sender)) => registry.reject(id, Some(*sender), err),
        None => err,
    };
    refused(&err)
}

/// Drives one transfer stream until it commits, fails or ends.
async fn serve_stream(
    registry: Arc<KvRegistry>,
    mut inbound: Streaming<pb::KvSenderMessage>,
    out: mpsc::Sender<Result<pb::KvReceiverMessage, Status>>,
) {
    let mut transfer: Option<(String, SenderId)> = None;
    loop {
        let message = match inbound.message().await {
            Ok(Some(m)) => m.message,
            // The sender went away without commit or abort: keep the blocks for a retry
            // until the lease ends.
            Ok(None) | Err(_) => {
                if let Some((id, sender)) = &transfer {
                    registry.detach(id, *sender);
                }
                return;
            }
        };
        let reply = match (message, &transfer) {
            (Some(Incoming::Header(h)), None) => match open(&registry, h) {
                Ok((opened, accepted)) => {
                    transfer = Some(opened);
                    Some(accepted)
                }
                Err(refusal) => {
                    let _ = out.send(Ok(refusal)).await;
                    return;
                }
            },
            (Some(Incoming::Frame(f)), Some((id, sender))) => {
                match registry.apply_frame(id, *sender, &Frame::from_pb(f)) {
                    Ok(()) => None,
                    Err(e) => {
                        let _ = out.send(Ok(refused(&e))).await;
                        return;
                    }
                }
            }
            (Some(Incoming::Commit(c)), Some((id, sender))) => {
                let reply = match registry.commit(id, *sender, c) {
                    Ok((bytes, frames)) => {
                        pb::KvReceiverMessage { message: Some(Reply::Committed(pb::KvCommitted { bytes, frames })) }
                    }
                    Err(e) => refused(&e),
                };
                let _ = out.send(Ok(reply)).await;
                return;
            }
            (Some(Incoming::Abort(a)), Some((id, sender))) => {
                let _ = registry.sender_abort(id, *sender, &a.reason);
                return;
            }
            (other, open) => {
                let _ = out.send(Ok(unexpected(&registry, other.as_ref(), open.as_ref()))).await;
                return;
            }
        };
        if let Some(reply) = reply {
            if out.send(Ok(reply)).await.is_err() {
                if let Some((id, sender)) = &transfer {
                    registry.detach(id, *sender);
                }
                return;
            }
        }
    }
}

#[tonic::async_trait]
impl KvTransferRpc for KvTransferService {
    type TransferStream = ReceiverStream<Result<pb::KvReceiverMessage, Status>>;

    async fn transfer(
        &self,
        request: Request<Streaming<pb::KvSenderMessage>>,
    ) -> Result<Response<Self::TransferStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(serve_stream(self.registry.clone(), request.into_inner(), tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Frees the blocks of reservations whose lease ended, every `period`, until aborted.
pub fn spawn_lease_reaper(registry: Arc<KvRegistry>, period: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            registry.expire_due();
        }
    })
}

/// The tonic server every KV receiver runs (the decode worker adds its DecodeWorker service
/// to it): HTTP/2 windows and frame size for bulk data, and keepalive pings (every second,
/// 2 s to answer, as the router's and the senders' channels ping), so a peer partitioned
/// away is noticed in seconds: its streams end, their sequences and reservations are freed
/// at once instead of decoding for nobody or holding blocks until the lease ends (a
/// rolling update then waited for those leases before the worker could drain).
pub fn kv_server_builder() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(1 << 20)
        .http2_keepalive_interval(Some(Duration::from_secs(1)))
        .http2_keepalive_timeout(Some(Duration::from_secs(2)))
}

/// A running gRPC KV receiver (server plus lease reaper); stops when shut down or dropped.
#[derive(Debug)]
pub struct GrpcKvReceiver {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
    reaper: JoinHandle<()>,
}

impl GrpcKvReceiver {
    /// Serves `registry` on `listener` (bind it to port 0 in tests).
    pub fn start(registry: Arc<KvRegistry>, listener: TcpListener) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let reaper = spawn_lease_reaper(registry.clone(), Duration::from_millis(50));
        let service = KvTransferService::new(registry).into_server();
        let incoming = pd_proto::nodelay_incoming(listener);
        let server = tokio::spawn(async move {
            let result = kv_server_builder()
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
            if let Err(e) = result {
                eprintln!("KV receiver on {addr} stopped: {e}");
            }
        });
        Ok(GrpcKvReceiver { addr, stop: Some(stop), server: Some(server), reaper })
    }
}

impl Drop for GrpcKvReceiver {
    fn drop(&mut self) {
        // Dropping `stop` ends the server; the reaper has to be stopped by hand.
        self.reaper.abort();
    }
}

impl crate::KvReceiver for GrpcKvReceiver {
    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
    }
}
