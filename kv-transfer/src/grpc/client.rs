//! Sending side of the gRPC transport.

use std::time::Duration;

use pb::kv_receiver_message::Message as Reply;
use pb::kv_sender_message::Message as Outgoing;
use pb::kv_transfer_client::KvTransferClient;
use pd_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::Streaming;

use super::{CONNECTION_WINDOW, FRAMES_IN_FLIGHT, MAX_MESSAGE, STREAM_WINDOW};
use crate::error::TransferError;
use crate::wire::{Frame, TransferHeader};
use crate::{CommitReceipt, KvSender, KvTransfer};

/// Opens transfers to one decode worker's KV service.
#[derive(Debug, Clone)]
pub struct GrpcKvSender {
    client: KvTransferClient<Channel>,
    /// Longest wait for any one step: accept, queue space for a frame, commit confirmation.
    timeout: Duration,
}

fn transport(e: impl std::fmt::Display) -> TransferError {
    TransferError::Transport(e.to_string())
}

impl GrpcKvSender {
    /// Connects to `addr` (`host:port`) in plaintext.
    pub async fn connect(addr: &str, timeout: Duration) -> Result<Self, TransferError> {
        Self::connect_with(addr, timeout, None).await
    }

    /// Connects to `addr`, with mutual TLS when `tls` is given.
    pub async fn connect_with(
        addr: &str,
        timeout: Duration,
        tls: Option<tonic::transport::ClientTlsConfig>,
    ) -> Result<Self, TransferError> {
        let mut endpoint =
            Endpoint::from_shared(format!("{}://{addr}", pd_proto::tls::scheme(tls.is_some()))).map_err(transport)?;
        if let Some(tls) = tls {
            endpoint = endpoint.tls_config(tls).map_err(transport)?;
        }
        let endpoint = endpoint
            .connect_timeout(timeout)
            .tcp_nodelay(true)
            .initial_stream_window_size(Some(STREAM_WINDOW))
            .initial_connection_window_size(Some(CONNECTION_WINDOW))
            .http2_keep_alive_interval(Duration::from_secs(1))
            .keep_alive_timeout(timeout)
            .keep_alive_while_idle(true);
        let channel = endpoint.connect().await.map_err(transport)?;
        Ok(GrpcKvSender { client: KvTransferClient::new(channel).max_decoding_message_size(MAX_MESSAGE), timeout })
    }
}

fn refusal(message: Option<pb::KvReceiverMessage>) -> TransferError {
    match message.and_then(|m| m.message) {
        Some(Reply::Refused(r)) => TransferError::from_refusal(&r.kind, r.reason),
        Some(other) => TransferError::Protocol(format!("unexpected reply {other:?}")),
        None => TransferError::Transport("the receiver closed the stream".into()),
    }
}

impl KvSender for GrpcKvSender {
    type Transfer = GrpcTransfer;

    async fn start(&self, header: TransferHeader) -> Result<GrpcTransfer, TransferError> {
        let (tx, rx) = mpsc::channel(FRAMES_IN_FLIGHT);
        let open = pb::KvSenderMessage { message: Some(Outgoing::Header(header.to_pb())) };
        tx.send(open).await.map_err(transport)?;
        let mut client = self.client.clone();
        let call = client.transfer(ReceiverStream::new(rx));
        let mut inbound = tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| TransferError::Timeout(self.timeout, "the receiver to open the stream"))?
            .map_err(transport)?
            .into_inner();
        let first = tokio::time::timeout(self.timeout, inbound.message())
            .await
            .map_err(|_| TransferError::Timeout(self.timeout, "the receiver to accept the header"))?
            .map_err(transport)?;
        match first.as_ref().and_then(|m| m.message.as_ref()) {
            Some(Reply::Accepted(_)) => Ok(GrpcTransfer { tx, inbound, timeout: self.timeout }),
            _ => Err(refusal(first)),
        }
    }
}

/// One transfer in flight over gRPC.
#[derive(Debug)]
pub struct GrpcTransfer {
    tx: mpsc::Sender<pb::KvSenderMessage>,
    inbound: Streaming<pb::KvReceiverMessage>,
    timeout: Duration,
}

impl GrpcTransfer {
    /// Waits for room in the queue while watching for an early refusal or a dead receiver.
    async fn push(&mut self, message: pb::KvSenderMessage, what: &'static str) -> Result<(), TransferError> {
        let deadline = tokio::time::sleep(self.timeout);
        tokio::pin!(deadline);
        tokio::select! {
            sent = self.tx.send(message) => sent.map_err(|_| TransferError::Transport("the request stream closed".into())),
            reply = self.inbound.message() => Err(match reply {
                Ok(m) => refusal(m),
                Err(status) => transport(status),
            }),
            _ = &mut deadline => Err(TransferError::Timeout(self.timeout, what)),
        }
    }
}

impl KvTransfer for GrpcTransfer {
    async fn send(&mut self, frame: Frame) -> Result<(), TransferError> {
        let message = pb::KvSenderMessage { message: Some(Outgoing::Frame(frame.to_pb())) };
        self.push(message, "room to send a frame").await
    }

    async fn commit(mut self, commit: pb::KvCommit) -> Result<CommitReceipt, TransferError> {
        let message = pb::KvSenderMessage { message: Some(Outgoing::Commit(commit)) };
        self.push(message, "room to send the commit").await?;
        let reply = tokio::time::timeout(self.timeout, self.inbound.message())
            .await
            .map_err(|_| TransferError::Timeout(self.timeout, "the commit confirmation"))?
            .map_err(transport)?;
        match reply.as_ref().and_then(|m| m.message.as_ref()) {
            Some(Reply::Committed(c)) => Ok(CommitReceipt { bytes: c.bytes, frames: c.frames }),
            _ => Err(refusal(reply)),
        }
    }

    async fn abort(mut self, reason: &str) {
        let message =
            pb::KvSenderMessage { message: Some(Outgoing::Abort(pb::KvAbort { reason: reason.to_string() })) };
        // Best effort: if the receiver is gone its lease frees the blocks anyway.
        if self.push(message, "room to send the abort").await.is_ok() {
            // Dropping the response stream would cancel the call before the abort is read:
            // close our side and wait for the receiver to end the stream.
            let GrpcTransfer { tx, mut inbound, timeout } = self;
            drop(tx);
            let _ = tokio::time::timeout(timeout, inbound.message()).await;
        }
    }
}
