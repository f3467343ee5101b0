//! Which transport a KV link uses: the receiving decode worker chooses (`--kv-transport`) and
//! names it in the endpoint it advertises in every reservation answer; the prefill worker
//! connects by that endpoint, so decode workers of one fleet may differ. A plain `host:port`
//! is pd.v1 gRPC (mutual TLS when configured); `ucx://host:port` is UCX (cargo feature `ucx`;
//! tcp, shared memory or RDMA as `UCX_TLS` says; not covered by the gRPC links' TLS). A
//! transport this build lacks, or a UCX link without `UCX_TLS`, is an error naming it, never
//! a silent fallback to gRPC.

use std::str::FromStr;
use std::time::Duration;

use pd_proto::v1 as pb;

use crate::grpc::{GrpcKvSender, GrpcTransfer};
use crate::{CommitReceipt, Frame, KvSender, KvTransfer, TransferError, TransferHeader};

/// A KV transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    #[default]
    Grpc,
    Ucx,
}

const UCX_SCHEME: &str = "ucx://";

impl Transport {
    pub fn name(self) -> &'static str {
        match self {
            Transport::Grpc => "grpc",
            Transport::Ucx => "ucx",
        }
    }

    /// An endpoint's transport and its `host:port`.
    pub fn of_endpoint(endpoint: &str) -> (Transport, &str) {
        match endpoint.strip_prefix(UCX_SCHEME) {
            Some(addr) => (Transport::Ucx, addr),
            None => (Transport::Grpc, endpoint),
        }
    }

    /// The endpoint a receiver at `addr` advertises.
    pub fn endpoint(self, addr: &str) -> String {
        match self {
            Transport::Grpc => addr.to_string(),
            Transport::Ucx => format!("{UCX_SCHEME}{addr}"),
        }
    }

    /// Whether this build can use the transport.
    pub fn built(self) -> bool {
        self == Transport::Grpc || cfg!(feature = "ucx")
    }
}

impl FromStr for Transport {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "grpc" => Ok(Transport::Grpc),
            "ucx" if cfg!(feature = "ucx") => Ok(Transport::Ucx),
            "ucx" => Err("`ucx`: this build has no UCX transport (cargo feature pd-kv-transfer/ucx)".into()),
            other => Err(format!("`{other}` is not a KV transport (grpc or ucx)")),
        }
    }
}

/// UCX's transports and devices from the environment, as Kubernetes sets them: `UCX_TLS` is
/// required (an explicit list, e.g. `rc,sm,tcp` on RDMA nodes, `tcp` elsewhere);
/// `UCX_NET_DEVICES` defaults to `all`.
#[cfg(feature = "ucx")]
pub fn ucx_config_from_env() -> Result<crate::ucx::UcxConfig, TransferError> {
    let transports = std::env::var("UCX_TLS").ok().filter(|v| !v.is_empty()).ok_or_else(|| {
        TransferError::Transport("the UCX KV transport needs UCX_TLS (e.g. `tcp`, or `rc,sm,tcp` with RDMA)".into())
    })?;
    let net_devices = std::env::var("UCX_NET_DEVICES").ok().filter(|v| !v.is_empty()).unwrap_or_else(|| "all".into());
    Ok(crate::ucx::UcxConfig { transports, net_devices })
}

/// A running UCX receiver (besides the gRPC `KvTransfer` service a decode worker's server
/// always carries), serving one registry until shut down or dropped.
#[derive(Debug)]
pub struct UcxServing {
    addr: std::net::SocketAddr,
    #[cfg(feature = "ucx")]
    receiver: crate::ucx::UcxKvReceiver,
}

impl UcxServing {
    /// Serves `registry` over UCX on `bind` (port 0 picks one), with `UCX_TLS` and
    /// `UCX_NET_DEVICES` from the environment.
    pub fn start(
        registry: std::sync::Arc<crate::KvRegistry>,
        bind: std::net::SocketAddr,
    ) -> Result<Self, TransferError> {
        #[cfg(feature = "ucx")]
        {
            use crate::KvReceiver;
            let receiver = crate::ucx::UcxKvReceiver::start(registry, ucx_config_from_env()?, bind)?;
            Ok(UcxServing { addr: receiver.local_addr(), receiver })
        }
        #[cfg(not(feature = "ucx"))]
        {
            let _ = (registry, bind);
            Err(TransferError::Transport("this build has no UCX transport (cargo feature pd-kv-transfer/ucx)".into()))
        }
    }

    pub fn local_addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    pub async fn shutdown(self) {
        #[cfg(feature = "ucx")]
        crate::KvReceiver::shutdown(self.receiver).await;
    }
}

/// A sender over whichever transport its endpoint names. Cloning shares the connection.
#[derive(Debug, Clone)]
pub enum AnySender {
    Grpc(GrpcKvSender),
    #[cfg(feature = "ucx")]
    Ucx(crate::ucx::UcxKvSender),
}

impl AnySender {
    /// Connects to `endpoint`: gRPC (with mutual TLS when `tls` is given) or UCX.
    pub async fn connect(
        endpoint: &str,
        timeout: Duration,
        tls: Option<tonic::transport::ClientTlsConfig>,
    ) -> Result<Self, TransferError> {
        match Transport::of_endpoint(endpoint) {
            (Transport::Grpc, addr) => Ok(AnySender::Grpc(GrpcKvSender::connect_with(addr, timeout, tls).await?)),
            #[cfg(feature = "ucx")]
            (Transport::Ucx, addr) => {
                let resolved = tokio::net::lookup_host(addr)
                    .await
                    .map_err(|e| TransferError::Transport(format!("resolving `{addr}`: {e}")))?
                    .next()
                    .ok_or_else(|| TransferError::Transport(format!("`{addr}` resolves to no address")))?;
                let config = ucx_config_from_env()?;
                Ok(AnySender::Ucx(crate::ucx::UcxKvSender::connect(resolved, config, timeout).await?))
            }
            #[cfg(not(feature = "ucx"))]
            (Transport::Ucx, _) => Err(TransferError::Transport(format!(
                "`{endpoint}` is a UCX endpoint and this build has no UCX transport"
            ))),
        }
    }

    pub fn transport(&self) -> Transport {
        match self {
            AnySender::Grpc(_) => Transport::Grpc,
            #[cfg(feature = "ucx")]
            AnySender::Ucx(_) => Transport::Ucx,
        }
    }
}

/// One open transfer of an `AnySender`.
#[derive(Debug)]
pub enum AnyTransfer {
    Grpc(GrpcTransfer),
    #[cfg(feature = "ucx")]
    Ucx(crate::ucx::UcxTransfer),
}

impl KvSender for AnySender {
    type Transfer = AnyTransfer;

    async fn start(&self, header: TransferHeader) -> Result<AnyTransfer, TransferError> {
        match self {
            AnySender::Grpc(s) => s.start(header).await.map(AnyTransfer::Grpc),
            #[cfg(feature = "ucx")]
            AnySender::Ucx(s) => s.start(header).await.map(AnyTransfer::Ucx),
        }
    }
}

impl KvTransfer for AnyTransfer {
    async fn send(&mut self, frame: Frame) -> Result<(), TransferError> {
        match self {
            AnyTransfer::Grpc(t) => t.send(frame).await,
            #[cfg(feature = "ucx")]
            AnyTransfer::Ucx(t) => t.send(frame).await,
        }
    }

    async fn commit(self, commit: pb::KvCommit) -> Result<CommitReceipt, TransferError> {
        match self {
            AnyTransfer::Grpc(t) => t.commit(commit).await,
            #[cfg(feature = "ucx")]
            AnyTransfer::Ucx(t) => t.commit(commit).await,
        }
    }

    async fn abort(self, reason: &str) {
        match self {
            AnyTransfer::Grpc(t) => t.abort(reason).await,
            #[cfg(feature = "ucx")]
            AnyTransfer::Ucx(t) => t.abort(reason).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_name_their_transport() {
        assert_eq!(Transport::of_endpoint("10.0.0.7:9000"), (Transport::Grpc, "10.0.0.7:9000"));
        assert_eq!(Transport::of_endpoint("ucx://decode-0:9001"), (Transport::Ucx, "decode-0:9001"));
        assert_eq!(Transport::Ucx.endpoint("decode-0:9001"), "ucx://decode-0:9001");
        assert_eq!("grpc".parse::<Transport>(), Ok(Transport::Grpc));
        assert!("rdma".parse::<Transport>().expect_err("not a transport").contains("grpc or ucx"));
        assert_eq!("ucx".parse::<Transport>().is_ok(), cfg!(feature = "ucx"));
    }
}
