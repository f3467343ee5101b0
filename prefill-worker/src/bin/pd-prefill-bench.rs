//! pd-prefill-bench: what the KV transfer adds to time-to-first-token, with the real model:
//! a prompt prefilled by the pipeline (chunks of 512, layers shipped as they are computed)
//! into a receiver in this process over gRPC loopback, f16 and f32 KV.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use pd_engine::{CacheConfig, ChatMessage, Engine, LoadOptions, WireDType};
use pd_kv_transfer::engine_io::geometry_of;
use pd_kv_transfer::grpc::{GrpcKvReceiver, GrpcKvSender};
use pd_kv_transfer::{KvReceiver, KvRegistry, Reservation, TransferHeader};
use pd_prefill::pipeline::{prefill_and_send, PrefillJob};
use pd_prefill::step::StepConfig;
use pd_prefill::steps::Steps;

pd_engine::model_allocator!();

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, env = "PD_MODEL", default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: std::path::PathBuf,
    /// Prompt length.
    #[arg(long, default_value_t = 2048)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Before any other thread exists: the compute pools read this once.
    pd_engine::set_compute_threads(args.threads)?;
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run(&args))
}

async fn run(args: &Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.model.is_file(), "no model at {}: run scripts/fetch-model.sh", args.model.display());
    // Every run computes the whole prompt: the prefix cache would serve repeats.
    let cache = CacheConfig { prefix_cache: false, ..CacheConfig::with_blocks(args.prompt_tokens.div_ceil(16) + 8) };
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
        let job = PrefillJob {
            engine: prefill.clone(),
            prompt: prompt.clone(),
            ship_from: 0,
            header,
            sampling: pd_engine::SamplingParams::greedy(1),
        };
        let steps = Steps::start(prefill.clone(), StepConfig::single(512))?;
        let sent = prefill_and_send(job, &sender, &steps, |_| {}).await?;
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
