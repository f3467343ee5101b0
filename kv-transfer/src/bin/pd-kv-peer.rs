//! pd-kv-peer: one end of a KV transfer with synthetic KV, as its own process. Used by the
//! fault tests (kill one end mid-transfer) and handy for checking connectivity between hosts.
//!
//!   pd-kv-peer receive --listen 127.0.0.1:0 --transfer-id t --tokens 512 --lease-ms 2000
//!     prints `listening ADDR` and `blocks ID,ID,...` (the reserved block ids a sender must
//!     name), then `outcome ...` and `free_blocks N of M` when the
//!     reservation ends (commit, refusal or lease expiry), and exits.
//!   pd-kv-peer send --to ADDR --block-ids 31,30,... --transfer-id t --tokens 512 --frame-delay-ms 50
//!     prints `accepted`, `sent I` per frame, then `committed` or `error: ...` (exit 1).

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use pd_engine::{BlockManager, WireDType};
use pd_kv_transfer::grpc::{GrpcKvReceiver, GrpcKvSender};
use pd_kv_transfer::kv_commit;
use pd_kv_transfer::{
    frame_runs, Frame, KvGeometry, KvReceiver, KvRegistry, KvSender, KvTransfer, MemorySink, Reservation,
    TransferHeader,
};

#[derive(Debug, Parser)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Reserve blocks for one transfer and serve the KV service until it ends.
    Receive {
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: String,
        #[arg(long, default_value_t = 2000)]
        lease_ms: u64,
        #[command(flatten)]
        transfer: TransferArgs,
    },
    /// Send synthetic KV for one transfer.
    Send {
        #[arg(long)]
        to: String,
        /// Destination block ids as the receiver reserved them.
        #[arg(long, value_delimiter = ',', required = true)]
        block_ids: Vec<u32>,
        /// Pause before each frame (to make a transfer slow enough to interrupt).
        #[arg(long, default_value_t = 0)]
        frame_delay_ms: u64,
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
        #[command(flatten)]
        transfer: TransferArgs,
    },
}

/// Which transport to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Transport {
    Grpc,
    /// UCX over TCP on loopback (needs the `ucx` feature).
    UcxTcp,
    /// UCX over shared memory (needs the `ucx` feature).
    UcxShm,
}

#[cfg(feature = "ucx")]
fn ucx_config(t: Transport) -> pd_kv_transfer::ucx::UcxConfig {
    match t {
        Transport::UcxShm => pd_kv_transfer::ucx::UcxConfig::loopback_shared_memory(),
        _ => pd_kv_transfer::ucx::UcxConfig::loopback_tcp(),
    }
}

/// What both ends agree on.
#[derive(Debug, Args)]
struct TransferArgs {
    #[arg(long, value_enum, default_value = "grpc")]
    transport: Transport,
    #[arg(long, default_value = "peer")]
    transfer_id: String,
    #[arg(long, default_value_t = 512)]
    tokens: u32,
    #[arg(long, default_value_t = 4)]
    layers: u32,
}

impl TransferArgs {
    fn geometry(&self) -> KvGeometry {
        KvGeometry {
            model_fingerprint: 0x5eed,
            dtype: WireDType::F16,
            num_layers: self.layers,
            block_size: 16,
            num_kv_heads: 2,
            head_dim: 8,
        }
    }

    fn blocks(&self) -> usize {
        (self.tokens as usize).div_ceil(16)
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Receive { listen, lease_ms, transfer } => receive(&listen, lease_ms, &transfer).await,
        Command::Send { to, block_ids, frame_delay_ms, timeout_ms, transfer } => {
            match send(&to, block_ids, frame_delay_ms, timeout_ms, &transfer).await {
                Ok(()) => {
                    say("committed");
                    Ok(())
                }
                Err(e) => {
                    say(&format!("error: {e}"));
                    std::process::exit(1);
                }
            }
        }
    }
}

async fn receive(listen: &str, lease_ms: u64, args: &TransferArgs) -> anyhow::Result<()> {
    let geometry = args.geometry();
    let blocks = BlockManager::new(args.blocks(), 16);
    let registry = KvRegistry::new(Arc::new(MemorySink::new(geometry, args.blocks())));
    let allocation = blocks.allocate(args.blocks())?;
    let reserved_ids = allocation.ids().to_vec();
    let outcome = registry.reserve(Reservation {
        transfer_id: args.transfer_id.clone(),
        geometry,
        blocks: allocation,
        num_tokens: args.tokens,
        lease: Duration::from_millis(lease_ms),
    })?;
    let ids: Vec<String> = reserved_ids.iter().map(u32::to_string).collect();
    let server = match args.transport {
        Transport::Grpc => {
            let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("binding {listen}"))?;
            AnyReceiver::Grpc(GrpcKvReceiver::start(registry, listener)?)
        }
        #[cfg(feature = "ucx")]
        t => AnyReceiver::Ucx(pd_kv_transfer::ucx::UcxKvReceiver::start(registry, ucx_config(t), listen.parse()?)?),
        #[cfg(not(feature = "ucx"))]
        _ => anyhow::bail!("this build has no UCX transport; rebuild with `--features ucx`"),
    };
    say(&format!("listening {}", server.local_addr()));
    say(&format!("blocks {}", ids.join(",")));
    match outcome.await {
        Ok(Ok(committed)) => {
            say(&format!("outcome committed {} bytes", committed.bytes));
            drop(committed);
        }
        Ok(Err(e)) => say(&format!("outcome failed: {e}")),
        Err(_) => say("outcome lost"),
    }
    say(&format!("free_blocks {} of {}", blocks.free_blocks(), blocks.total_blocks()));
    // Graceful: the sender's commit confirmation leaves before the process exits.
    server.shutdown().await;
    Ok(())
}

/// The receiver of either transport.
enum AnyReceiver {
    Grpc(GrpcKvReceiver),
    #[cfg(feature = "ucx")]
    Ucx(pd_kv_transfer::ucx::UcxKvReceiver),
}

impl AnyReceiver {
    fn local_addr(&self) -> std::net::SocketAddr {
        match self {
            AnyReceiver::Grpc(r) => r.local_addr(),
            #[cfg(feature = "ucx")]
            AnyReceiver::Ucx(r) => r.local_addr(),
        }
    }

    async fn shutdown(self) {
        match self {
            AnyReceiver::Grpc(r) => r.shutdown().await,
            #[cfg(feature = "ucx")]
            AnyReceiver::Ucx(r) => r.shutdown().await,
        }
    }
}

async fn send(
    to: &str,
    block_ids: Vec<u32>,
    frame_delay_ms: u64,
    timeout_ms: u64,
    args: &TransferArgs,
) -> anyhow::Result<()> {
    let timeout = Duration::from_millis(timeout_ms);
    match args.transport {
        Transport::Grpc => send_with(&GrpcKvSender::connect(to, timeout).await?, block_ids, frame_delay_ms, args).await,
        #[cfg(feature = "ucx")]
        t => {
            let sender = pd_kv_transfer::ucx::UcxKvSender::connect(to.parse()?, ucx_config(t), timeout).await?;
            send_with(&sender, block_ids, frame_delay_ms, args).await
        }
        #[cfg(not(feature = "ucx"))]
        _ => anyhow::bail!("this build has no UCX transport; rebuild with `--features ucx`"),
    }
}

async fn send_with<S: KvSender>(
    sender: &S,
    block_ids: Vec<u32>,
    frame_delay_ms: u64,
    args: &TransferArgs,
) -> anyhow::Result<()> {
    let geometry = args.geometry();
    let header = TransferHeader {
        transfer_id: args.transfer_id.clone(),
        geometry,
        block_ids,
        num_tokens: args.tokens,
        trace_context: Default::default(),
    };
    let mut transfer = sender.start(header).await?;
    say("accepted");
    let mut sent = 0;
    for layer in 0..geometry.num_layers {
        for (first, count) in frame_runs(&geometry, args.blocks()) {
            tokio::time::sleep(Duration::from_millis(frame_delay_ms)).await;
            let data = vec![(layer as u8).wrapping_add(first as u8); geometry.frame_bytes(count as usize)];
            transfer.send(Frame::new(layer, first, count, data)).await?;
            sent += 1;
            say(&format!("sent {sent}"));
        }
    }
    transfer.commit(kv_commit(1, args.tokens)).await?;
    Ok(())
}
