//! Many simulated workers in one process, each a gRPC server on its own port, and the losses
//! a run schedules (`prefill:3@30` loses prefill worker 3 thirty seconds in).

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use pd_kv_transfer::transport::Transport;
use pd_prefill::step::StepConfig;
use pd_proto::v1 as pb;
use tokio::net::TcpListener;

use crate::cost::WorkerCost;
use crate::decode::SimDecode;
use crate::kv::{Handoffs, UcxInbox};
use crate::prefill::SimPrefill;

/// Which pool a worker belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
}

/// A worker lost at a given time into the run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Loss {
    pub role: Role,
    pub index: usize,
    pub after: Duration,
}

impl FromStr for Loss {
    type Err = String;

    /// `prefill:INDEX@SECONDS` or `decode:INDEX@SECONDS`.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("--lose {s:?}: expected prefill:INDEX@SECONDS or decode:INDEX@SECONDS");
        let (role, rest) = s.split_once(':').ok_or_else(bad)?;
        let (index, secs) = rest.split_once('@').ok_or_else(bad)?;
        let role = match role {
            "prefill" => Role::Prefill,
            "decode" => Role::Decode,
            _ => return Err(bad()),
        };
        let index = index.parse().map_err(|_| bad())?;
        let secs: f64 = secs.parse().map_err(|_| bad())?;
        if !secs.is_finite() || secs < 0.0 {
            return Err(bad());
        }
        Ok(Loss { role, index, after: Duration::from_secs_f64(secs) })
    }
}

/// The running fleet: addresses by pool, and the workers (to lose them).
pub struct Fleet {
    pub prefill_addrs: Vec<SocketAddr>,
    pub decode_addrs: Vec<SocketAddr>,
    prefill: Vec<SimPrefill>,
    decode: Vec<SimDecode>,
    handoffs: Arc<Handoffs>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet").field("prefill", &self.prefill_addrs).field("decode", &self.decode_addrs).finish()
    }
}

async fn listen(host: &str) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind((host, 0)).await?;
    let addr = listener.local_addr()?;
    Ok((listener, addr))
}

impl Fleet {
    /// Starts `prefill` + `decode` workers listening on `host` (ports picked by the system),
    /// the decode workers taking KV over `transport` (UCX on a port of each one's own).
    pub async fn start(
        cost: Arc<WorkerCost>,
        step: StepConfig,
        host: &str,
        prefill: usize,
        decode: usize,
        transport: Transport,
    ) -> anyhow::Result<Fleet> {
        let handoffs = Arc::new(Handoffs::default());
        let mut fleet = Fleet {
            prefill_addrs: Vec::new(),
            decode_addrs: Vec::new(),
            prefill: Vec::new(),
            decode: Vec::new(),
            handoffs: handoffs.clone(),
        };
        for _ in 0..decode {
            let (listener, addr) = listen(host).await?;
            let ucx = match transport {
                Transport::Grpc => None,
                Transport::Ucx => Some(Arc::new(UcxInbox::start(&cost, host)?)),
            };
            let worker = SimDecode::start(cost.clone(), addr.to_string(), ucx);
            let router = tonic::transport::Server::builder()
                .add_service(pb::decode_worker_server::DecodeWorkerServer::new(worker.clone()))
                .add_service(pb::kv_transfer_server::KvTransferServer::new(worker.clone()));
            tokio::spawn(router.serve_with_incoming(pd_proto::nodelay_incoming(listener)));
            fleet.decode_addrs.push(addr);
            fleet.decode.push(worker);
        }
        for _ in 0..prefill {
            let (listener, addr) = listen(host).await?;
            let worker = SimPrefill::start(cost.clone(), step, handoffs.clone());
            let router = tonic::transport::Server::builder()
                .add_service(pb::prefill_worker_server::PrefillWorkerServer::new(worker.clone()));
            tokio::spawn(router.serve_with_incoming(pd_proto::nodelay_incoming(listener)));
            fleet.prefill_addrs.push(addr);
            fleet.prefill.push(worker);
        }
        Ok(fleet)
    }

    /// Loses one worker now; false when there is no such worker.
    pub fn lose(&self, role: Role, index: usize) -> bool {
        match role {
            Role::Prefill => self.prefill.get(index).map(SimPrefill::lose).is_some(),
            Role::Decode => self.decode.get(index).map(SimDecode::lose).is_some(),
        }
    }

    /// Committed and failed KV hand-offs by transport, as one line.
    pub fn handoffs(&self) -> String {
        self.handoffs.summary()
    }

    /// Blocks the decode workers' UCX registries still hold (0 when every transfer ended).
    pub fn ucx_held_blocks(&self) -> usize {
        self.decode.iter().map(SimDecode::ucx_held_blocks).sum()
    }

    /// `PD_PREFILL_WORKERS=...` and `PD_DECODE_WORKERS=...` lines for the router.
    pub fn env_lines(&self) -> String {
        let join = |a: &[SocketAddr]| a.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(",");
        format!("PD_PREFILL_WORKERS={}\nPD_DECODE_WORKERS={}\n", join(&self.prefill_addrs), join(&self.decode_addrs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losses_parse_and_bad_ones_are_named() {
        let l: Loss = "decode:3@12.5".parse().expect("loss");
        assert_eq!(l, Loss { role: Role::Decode, index: 3, after: Duration::from_millis(12_500) });
        for bad in ["decode3@1", "gpu:1@2", "prefill:x@1", "prefill:1@-2", "prefill:1"] {
            let e = bad.parse::<Loss>().expect_err(bad);
            assert!(e.contains(bad), "{e}");
        }
    }
}
