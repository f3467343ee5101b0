//! pd-kv-bench: KV transfer throughput against a plain memory copy of the same bytes, in one
//! run, and the part of time-to-first-token a transfer adds for a real 2,048-token prompt.
//!
//! Transport rows: a receiver (memory sink) and a sender in this process, over loopback. Each
//! frame is built the way a prefill worker builds it (copy out of a buffer, CRC-32), sent,
//! checked and copied into place on the receiving side. The memcpy row copies the same bytes
//! in 1 MiB pieces once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use pd_engine::{BlockManager, CacheConfig, ChatMessage, Engine, LoadOptions, WireDType};
use pd_kv_transfer::engine_io::{geometry_of, prefill_and_send, Unscheduled};
use pd_kv_transfer::grpc::{GrpcKvReceiver, GrpcKvSender};
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
    /// Real model for the time-to-first-token part; skipped if absent.
    #[arg(long, env = "PD_MODEL", default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: std::path::PathBuf,
    /// Prompt length for the time-to-first-token part.
    #[arg(long, default_value_t = 2048)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 1)]
    threads: usize,
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
            let gbps = run_transfers(&sender, &registry, &pool, g, blocks, mib, repeat).await;
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
            let gbps = run_transfers(&sender, &registry, &pool, g, blocks, mib, repeat).await;
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
    g: KvGeometry,
    blocks: usize,
    mib: usize,
    repeat: usize,
) -> anyhow::Result<f64> {
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
        let receipt = transfer.commit(0, header.num_tokens).await?;
        best = best.min(t.elapsed().as_secs_f64());
        anyhow::ensure!(receipt.bytes as usize == mib * MIB, "sent {} bytes", receipt.bytes);
        drop(outcome.await?.map_err(|e| anyhow::anyhow!("{e}"))?);
    }
    Ok((mib * MIB) as f64 / best / 1e9)
}

async fn ttft_part(args: &Args) -> anyhow::Result<()> {
    if !args.model.is_file() {
        println!("(no model at {}: skipping the time-to-first-token part)", args.model.display());
        return Ok(());
    }
    let cache = CacheConfig::with_blocks(args.prompt_tokens.div_ceil(16) + 8);
    let load = || Engine::load(&args.model, LoadOptions::default(), cache).context("loading the model");
    let prefill = Arc::new(load()?);
    let decode = Arc::new(load()?);
    let registry = KvRegistry::new(decode.clone());
    let server = GrpcKvReceiver::start(registry.clone(), tokio::net::TcpListener::bind("127.0.0.1:0").await?)?;
    let sender = GrpcKvSender::connect(&server.local_addr().to_string(), Duration::from_secs(60)).await?;
    let words = "The history of the river valley begins with small farming villages. ".repeat(400);
    let mut prompt = prefill.chat_prompt(&[ChatMessage::new("user", &words)])?;
    prompt.truncate(args.prompt_tokens);
    println!();
    println!("| {}-token prompt, real model, gRPC loopback, chunk 512 | f16 KV | f32 KV |", prompt.len());
    println!("|---|---|---|");
    let mut rows: Vec<Vec<String>> = vec![Vec::new(); 5];
    for dtype in [WireDType::F16, WireDType::F32] {
        let geometry = geometry_of(&prefill, dtype);
        let blocks = decode.blocks().allocate(decode.blocks().blocks_for(prompt.len()))?;
        let id = format!("ttft-{dtype:?}");
        let header = TransferHeader {
            transfer_id: id.clone(),
            geometry,
            block_ids: blocks.ids().to_vec(),
            num_tokens: prompt.len() as u32,
            trace_context: Default::default(),
        };
        let outcome = registry.reserve(Reservation {
            transfer_id: id,
            geometry: geometry_of(&decode, dtype),
            blocks,
            num_tokens: prompt.len() as u32,
            lease: Duration::from_secs(120),
        })?;
        let sent = prefill_and_send(
            prefill.clone(),
            prompt.clone(),
            512,
            header,
            &sender,
            &pd_engine::SamplingParams::greedy(1),
            &Unscheduled,
        )
        .await?;
        drop(outcome.await?.map_err(|e| anyhow::anyhow!("{e}"))?);
        rows[0].push(format!("{:.2} s", sent.prefill_time.as_secs_f64()));
        rows[1].push(format!("{:.1} MB", sent.receipt.bytes as f64 / 1e6));
        rows[2].push(format!("{:.1} ms", sent.last_layer_to_commit.as_secs_f64() * 1e3));
        rows[3].push(format!("{:.1} ms", sent.prefill_end_to_commit.as_secs_f64() * 1e3));
        rows[4].push(format!(
            "{:.2}%",
            100.0 * sent.prefill_end_to_commit.as_secs_f64() / sent.prefill_time.as_secs_f64()
        ));
    }
    let names = [
        "prefill compute",
        "KV shipped",
        "last layer's KV written -> commit received",
        "prefill done (logits) -> commit received = added to TTFT",
        "added to TTFT / prefill time",
    ];
    for (name, row) in names.iter().zip(rows) {
        println!("| {name} | {} |", row.join(" | "));
    }
    server.shutdown().await;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Before any other thread exists: the compute pools read this once.
    pd_engine::set_compute_threads(args.threads)?;
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
    ttft_part(&args).await
}
