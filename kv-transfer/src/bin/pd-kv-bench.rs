//! pd-kv-bench: KV transfer throughput against a plain memory copy of the same bytes, in one
//! run. (What a transfer adds to time-to-first-token with the real model is pd-prefill's
//! `pd-prefill-bench`.)
//!
//! Transport rows: a receiver (memory sink) and a sender in this process, over loopback. Each
//! frame is built the way a prefill worker builds it (copy out of a buffer, CRC-32), sent,
//! checked and copied into place on the receiving side. The memcpy row copies the same bytes
//! in 1 MiB pieces once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use pd_engine::{BlockManager, WireDType};
use pd_kv_transfer::grpc::{GrpcKvReceiver, GrpcKvSender};
use pd_kv_transfer::kv_commit;
use pd_kv_transfer::{
    frame_runs, Frame, KvGeometry, KvReceiver, KvRegistry, KvSender, KvTransfer, MemorySink, Reservation,
    TransferHeader,
};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
struct Args {
    /// Transfer sizes in MiB.
    #[arg(long, value_delimiter = ',', default_value = "8,64,256")]
    sizes: Vec<usize>,
    /// Repetitions per size (the best is reported, as for memcpy).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
}

const MIB: usize = 1 << 20;

fn geometry() -> KvGeometry {
    // 64 KiB per block (K and V), a 7B-class layer shape.
    KvGeometry {
        model_fingerprint: 1,
        dtype: WireDType::F16,
        num_layers: 32,
        block_size: 16,
        num_kv_heads: 8,
        head_dim: 128,
    }
}

fn memcpy_gbps(bytes: usize, repeat: usize) -> f64 {
    let src: Vec<u8> = (0..bytes).map(|i| (i * 31 % 251) as u8).collect();
    let mut dst = vec![0u8; bytes];
    let mut best = f64::MAX;
    for _ in 0..repeat {
        let t = Instant::now();
        for (d, s) in dst.chunks_mut(MIB).zip(src.chunks(MIB)) {
            d.copy_from_slice(s);
        }
        best = best.min(t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    bytes as f64 / best / 1e9
}

/// Which transport a throughput row measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    Grpc,
    #[cfg(feature = "ucx")]
    UcxTcp,
    #[cfg(feature = "ucx")]
    UcxShm,
}

async fn throughput_gbps(transport: Transport, mib: usize, repeat: usize) -> anyhow::Result<f64> {
    let g = geometry();
    let blocks = mib * MIB / g.num_layers as usize / g.frame_bytes(1);
    anyhow::ensure!(blocks > 0, "{mib} MiB is smaller than one block per layer");
    let pool = BlockManager::new(blocks, g.block_size as usize);
    let registry = KvRegistry::new(Arc::new(MemorySink::new(g, blocks)));
    match transport {
        Transport::Grpc => {
            let server = GrpcKvReceiver::start(registry.clone(), tokio::net::TcpListener::bind("127.0.0.1:0").await?)?;
            let sender = GrpcKvSender::connect(&server.local_addr().to_string(), Duration::from_secs(30)).await?;
            let gbps = run_transfers(&sender, &registry, &pool, mib, repeat).await;
            server.shutdown().await;
            gbps
        }
        #[cfg(feature = "ucx")]
        t => {
            use pd_kv_transfer::ucx::{UcxConfig, UcxKvReceiver, UcxKvSender};
            let config =
                if t == Transport::UcxShm { UcxConfig::loopback_shared_memory() } else { UcxConfig::loopback_tcp() };
            let server = UcxKvReceiver::start(registry.clone(), config.clone(), "127.0.0.1:0".parse()?)?;
            let sender = UcxKvSender::connect(server.local_addr(), config, Duration::from_secs(30)).await?;
            let gbps = run_transfers(&sender, &registry, &pool, mib, repeat).await;
            drop(sender);
            server.shutdown().await;
            gbps
        }
    }
}

async fn run_transfers<S: KvSender>(
    sender: &S,
    registry: &Arc<KvRegistry>,
    pool: &BlockManager,
    mib: usize,
    repeat: usize,
) -> anyhow::Result<f64> {
    let g = geometry();
    let blocks = pool.total_blocks();
    let layer_bytes: Vec<u8> = (0..g.frame_bytes(blocks)).map(|i| (i * 7 % 253) as u8).collect();
    let mut best = f64::MAX;
    for round in 0..repeat {
        let allocation = pool.allocate(blocks)?;
        let id = format!("bench-{mib}-{round}");
        let header = TransferHeader {
            transfer_id: id.clone(),
            geometry: g,
            block_ids: allocation.ids().to_vec(),
            num_tokens: (blocks * 16) as u32,
            trace_context: Default::default(),
        };
        let outcome = registry.reserve(Reservation {
            transfer_id: id,
            geometry: g,
            blocks: allocation,
            num_tokens: header.num_tokens,
            lease: Duration::from_secs(60),
        })?;
        let t = Instant::now();
        let mut transfer = sender.start(header.clone()).await?;
        for layer in 0..g.num_layers {
            for (first, count) in frame_runs(&g, blocks) {
                let at = g.frame_bytes(first as usize);
                let data = layer_bytes[at..at + g.frame_bytes(count as usize)].to_vec();
                transfer.send(Frame::new(layer, first, count, data)).await?;
            }
        }
        let receipt = transfer.commit(kv_commit(0, header.num_tokens)).await?;
        best = best.min(t.elapsed().as_secs_f64());
        anyhow::ensure!(receipt.bytes as usize == mib * MIB, "sent {} bytes", receipt.bytes);
        drop(outcome.await?.map_err(|e| anyhow::anyhow!("{e}"))?);
    }
    Ok((mib * MIB) as f64 / best / 1e9)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let transports: Vec<(&str, Transport)> = vec![
        ("gRPC", Transport::Grpc),
        #[cfg(feature = "ucx")]
        ("UCX tcp", Transport::UcxTcp),
        #[cfg(feature = "ucx")]
        ("UCX shared memory", Transport::UcxShm),
    ];
    println!(
        "| size | memcpy GB/s | {} |",
        transports.iter().map(|(n, _)| format!("{n} GB/s (x memcpy)")).collect::<Vec<_>>().join(" | ")
    );
    println!("|---|---|{}", "---|".repeat(transports.len()));
    for &mib in &args.sizes {
        let copy = memcpy_gbps(mib * MIB, args.repeat);
        let mut cells = Vec::new();
        for (_, t) in &transports {
            let gbps = throughput_gbps(*t, mib, args.repeat).await?;
            cells.push(format!("{gbps:.2} ({:.2}x)", gbps / copy));
        }
        println!("| {mib} MiB | {copy:.2} | {} |", cells.join(" | "));
    }
    Ok(())
}
