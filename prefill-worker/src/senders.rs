//! KV senders by endpoint, kept across requests (one connection per decode worker), and the
//! one retry a cached connection gets: a decode worker restarted on the same address leaves
//! the cached sender talking to a dead peer (a UCX endpoint times out; a gRPC channel would
//! reconnect by itself), so a transport failure at the start of a transfer, before any KV
//! moved, drops the cached sender, connects again and starts once more.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pd_kv_transfer::transport::{AnySender, AnyTransfer, Transport};
use pd_kv_transfer::{KvSender, TransferError, TransferHeader};

/// Connected senders by endpoint (gRPC or UCX, as the endpoint names).
#[derive(Debug, Clone)]
pub struct Senders {
    cached: Arc<Mutex<HashMap<String, AnySender>>>,
    timeout: Duration,
    tls: Option<tonic::transport::ClientTlsConfig>,
}

impl Senders {
    pub fn new(timeout: Duration, tls: Option<tonic::transport::ClientTlsConfig>) -> Self {
        Senders { cached: Arc::default(), timeout, tls }
    }

    /// The sender to `endpoint`: the cached one, or a new connection (then cached).
    async fn get(&self, endpoint: &str) -> Result<AnySender, TransferError> {
        if let Some(s) = self.cached.lock().ok().and_then(|m| m.get(endpoint).cloned()) {
            return Ok(s);
        }
        let sender = AnySender::connect(endpoint, self.timeout, self.tls.clone()).await?;
        if let Ok(mut m) = self.cached.lock() {
            m.insert(endpoint.to_string(), sender.clone());
        }
        Ok(sender)
    }

    /// Drops the cached sender to `endpoint` (its connection broke).
    pub fn forget(&self, endpoint: &str) {
        if let Ok(mut m) = self.cached.lock() {
            m.remove(endpoint);
        }
    }

    /// A sender to `endpoint` for one transfer, connected now if none is cached.
    pub async fn to(&self, endpoint: &str) -> Result<Link, TransferError> {
        let first = self.get(endpoint).await?;
        Ok(Link { senders: self.clone(), endpoint: endpoint.to_string(), first })
    }
}

/// One transfer's sender: starts on the cached connection, and on a transport failure there
/// reconnects once (see the module docs).
#[derive(Debug)]
pub struct Link {
    senders: Senders,
    endpoint: String,
    first: AnySender,
}

impl Link {
    pub fn transport(&self) -> Transport {
        self.first.transport()
    }
}

impl KvSender for Link {
    type Transfer = AnyTransfer;

    async fn start(&self, header: TransferHeader) -> Result<AnyTransfer, TransferError> {
        match self.first.start(header.clone()).await {
            Err(TransferError::Transport(why)) => {
                tracing::info!(endpoint = %self.endpoint, %why, "KV connection broken: connecting again");
                self.senders.forget(&self.endpoint);
                self.senders.get(&self.endpoint).await?.start(header).await
            }
            other => other,
        }
    }
}
