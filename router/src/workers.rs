//! The worker pools: addresses given by flags (a DNS name is re-resolved on every refresh, so
//! a Kubernetes headless service's pods come and go) and one lazily connected channel per
//! resolved address. Which worker serves a request is the scheduler's choice (`schedule`).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use pd_proto::v1::decode_worker_client::DecodeWorkerClient;
use pd_proto::v1::prefill_worker_client::PrefillWorkerClient;
use tonic::transport::{Channel, Endpoint};

use crate::error::RouterError;

/// One pool of workers.
#[derive(Debug)]
pub struct Pool {
    name: &'static str,
    /// `host:port` as given (names are resolved on use).
    specs: Vec<String>,
    channels: Mutex<HashMap<String, Channel>>,
    /// Mutual TLS to these workers (None: plaintext).
    tls: Option<tonic::transport::ClientTlsConfig>,
}

impl Pool {
    pub fn new(name: &'static str, specs: Vec<String>, tls: Option<tonic::transport::ClientTlsConfig>) -> Self {
        Pool { name, specs, channels: Mutex::new(HashMap::new()), tls }
    }

    /// True when the pool has no workers configured.
    pub fn specs_empty(&self) -> bool {
        self.specs.is_empty()
    }

    /// Every address the specs resolve to now.
    pub async fn endpoints(&self) -> Vec<String> {
        let mut out = Vec::new();
        for spec in &self.specs {
            if let Ok(addrs) = tokio::net::lookup_host(spec.as_str()).await {
                for addr in addrs {
                    let addr = addr.to_string();
                    if !out.contains(&addr) {
                        out.push(addr);
                    }
                }
            }
        }
        out
    }

    pub fn channel(&self, addr: &str) -> Result<Channel, RouterError> {
        let mut channels = self.channels.lock().map_err(|_| RouterError::NoWorker(self.name))?;
        if let Some(c) = channels.get(addr) {
            return Ok(c.clone());
        }
        let failed = |e: tonic::transport::Error| RouterError::Worker { stage: self.name, message: e.to_string() };
        let mut endpoint =
            Endpoint::from_shared(format!("{}://{addr}", pd_proto::tls::scheme(self.tls.is_some()))).map_err(failed)?;
        if let Some(tls) = &self.tls {
            endpoint = endpoint.tls_config(tls.clone()).map_err(failed)?;
        }
        let channel = endpoint
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(1))
            .keep_alive_timeout(Duration::from_secs(2))
            .connect_lazy();
        channels.insert(addr.to_string(), channel.clone());
        Ok(channel)
    }

    /// Drops a cached channel (after its worker failed), so the next use reconnects.
    pub fn forget(&self, addr: &str) {
        if let Ok(mut channels) = self.channels.lock() {
            channels.remove(addr);
        }
    }
}

/// A chosen worker, its client and why it was chosen (for the route span).
#[derive(Debug)]
pub struct Picked<C> {
    pub addr: String,
    pub client: C,
    pub why: String,
}

/// Both pools.
#[derive(Debug)]
pub struct Pools {
    pub decode: Pool,
    pub prefill: Pool,
}

impl Pools {
    pub fn decode_client(&self, addr: &str, why: String) -> Result<Picked<DecodeWorkerClient<Channel>>, RouterError> {
        Ok(Picked { addr: addr.to_string(), client: DecodeWorkerClient::new(self.decode.channel(addr)?), why })
    }

    pub fn prefill_client(&self, addr: &str, why: String) -> Result<Picked<PrefillWorkerClient<Channel>>, RouterError> {
        Ok(Picked { addr: addr.to_string(), client: PrefillWorkerClient::new(self.prefill.channel(addr)?), why })
    }
}
