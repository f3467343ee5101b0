//! The worker pools as the router sees them: addresses given by flags (a DNS name is
//! re-resolved on every choice, so a Kubernetes headless service's pods come and go), one
//! lazily connected channel per resolved address, and the choice of worker by load.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use pb::decode_worker_client::DecodeWorkerClient;
use pb::prefill_worker_client::PrefillWorkerClient;
use pd_proto::v1 as pb;
use tonic::transport::{Channel, Endpoint};

use crate::error::RouterError;

/// How long a load query may take before the worker counts as unavailable.
const LOAD_TIMEOUT: Duration = Duration::from_millis(500);

/// One pool of workers.
#[derive(Debug)]
pub struct Pool {
    name: &'static str,
    /// `host:port` as given (names are resolved on use).
    specs: Vec<String>,
    channels: Mutex<HashMap<String, Channel>>,
}

impl Pool {
    pub fn new(name: &'static str, specs: Vec<String>) -> Self {
        Pool { name, specs, channels: Mutex::new(HashMap::new()) }
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

    fn channel(&self, addr: &str) -> Result<Channel, RouterError> {
        let mut channels = self.channels.lock().map_err(|_| RouterError::NoWorker(self.name))?;
        if let Some(c) = channels.get(addr) {
            return Ok(c.clone());
        }
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| RouterError::Worker { stage: self.name, message: e.to_string() })?
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

/// Both pools, and where prompts are prefilled.
#[derive(Debug)]
pub struct Pools {
    pub decode: Pool,
    pub prefill: Pool,
    /// Prompts of at most this many tokens are prefilled on the decode worker, in its batch
    /// (conditional disaggregation: a short prompt costs the running streams less than a
    /// queue slot and a KV transfer cost it). 0 = every prompt goes to a prefill worker.
    pub local_prefill_max_tokens: usize,
}

impl Pools {
    /// True when a prompt of `tokens` tokens is prefilled on the decode worker: always when
    /// no prefill pool is configured (colocated serving), else when it is short enough.
    pub fn prefill_here(&self, tokens: usize) -> bool {
        self.prefill.specs_empty() || tokens <= self.local_prefill_max_tokens
    }

    /// The decode worker with the most free KV blocks (fewest running sequences on ties).
    pub async fn pick_decode(&self, exclude: &[String]) -> Result<Picked<DecodeWorkerClient<Channel>>, RouterError> {
        let mut best: Option<(String, DecodeWorkerClient<Channel>, (u32, i64))> = None;
        let mut answered = 0;
        for addr in self.decode.endpoints().await {
            if exclude.contains(&addr) {
                continue;
            }
            let mut client = DecodeWorkerClient::new(self.decode.channel(&addr)?);
            match tokio::time::timeout(LOAD_TIMEOUT, client.load(pb::LoadRequest {})).await {
                Ok(Ok(load)) => {
                    answered += 1;
                    let l = load.into_inner();
                    let score = (l.free_blocks, -(l.running_sequences as i64));
                    if best.as_ref().is_none_or(|(_, _, s)| score > *s) {
                        best = Some((addr, client, score));
                    }
                }
                _ => self.decode.forget(&addr),
            }
        }
        best.map(|(addr, client, (free, running))| Picked {
            addr,
            client,
            why: format!("most free KV blocks: {free} free, {} running, of {answered} answering", -running),
        })
        .ok_or(RouterError::NoWorker("decode"))
    }

    /// The prefill worker with the fewest waiting prefill tokens.
    pub async fn pick_prefill(&self, exclude: &[String]) -> Result<Picked<PrefillWorkerClient<Channel>>, RouterError> {
        let mut best: Option<(String, PrefillWorkerClient<Channel>, u64)> = None;
        let mut answered = 0;
        for addr in self.prefill.endpoints().await {
            if exclude.contains(&addr) {
                continue;
            }
            let mut client = PrefillWorkerClient::new(self.prefill.channel(&addr)?);
            match tokio::time::timeout(LOAD_TIMEOUT, client.load(pb::LoadRequest {})).await {
                Ok(Ok(load)) => {
                    answered += 1;
                    let waiting = load.into_inner().waiting_prefill_tokens;
                    if best.as_ref().is_none_or(|(_, _, w)| waiting < *w) {
                        best = Some((addr, client, waiting));
                    }
                }
                _ => self.prefill.forget(&addr),
            }
        }
        best.map(|(addr, client, waiting)| Picked {
            addr,
            client,
            why: format!("fewest waiting prefill tokens: {waiting}, of {answered} answering"),
        })
        .ok_or(RouterError::NoWorker("prefill"))
    }

    /// True when a decode worker answers, and a prefill worker too if a pool is configured.
    pub async fn ready(&self) -> bool {
        self.pick_decode(&[]).await.is_ok() && (self.prefill.specs_empty() || self.pick_prefill(&[]).await.is_ok())
    }
}
