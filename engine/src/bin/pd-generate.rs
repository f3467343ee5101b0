//! pd-generate: runs the engine in one process: a prompt in, streamed text out.
//! A demo and a smoke check of a model file; the serving cluster lives in the worker binaries.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
// Reuses freed memory: the forward pass allocates large short-lived buffers, which glibc
// would map fresh (and the kernel zero) on every step.
pd_engine::model_allocator!();

use pd_engine::{set_compute_threads, CacheConfig, ChatMessage, Engine, LoadOptions, SamplingParams, WeightFormat};

/// Generate text with pd-engine.
#[derive(Debug, Parser)]
struct Args {
    /// GGUF file or Hugging Face model folder.
    #[arg(long, env = "PD_MODEL", default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// The user message (rendered with the model's chat template unless --raw).
    #[arg(long, default_value = "What is the capital of France?")]
    prompt: String,
    /// Send the prompt as plain text, without the chat template.
    #[arg(long)]
    raw: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long)]
    top_p: Option<f64>,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Compute threads for this process.
    #[arg(long, env = "PD_THREADS", default_value_t = 1)]
    threads: usize,
    /// Weights in memory: wq (default: the file's Q4_1/Q8_0 values, f32 activations), f16,
    /// f32, q8 (re-quantized) or stored (as in the file).
    #[arg(long, default_value = "wq")]
    weights: WeightFormat,
    /// Prefill chunk size in tokens.
    #[arg(long, default_value_t = 512)]
    chunk: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    set_compute_threads(args.threads)?;
    let options = LoadOptions { weights: args.weights, ..LoadOptions::default() };
    let started = Instant::now();
    let engine = Engine::load(&args.model, options, CacheConfig::with_blocks(512))
        .with_context(|| format!("loading {}", args.model.display()))?;
    eprintln!("loaded {} in {:.1}s", args.model.display(), started.elapsed().as_secs_f64());
    let prompt = if args.raw {
        engine.tokenizer().encode_prompt(&args.prompt)?
    } else {
        engine.chat_prompt(&[ChatMessage::new("user", &args.prompt)])?
    };
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
        ..SamplingParams::greedy(args.max_tokens)
    };
    let started = Instant::now();
    let mut first_token = None;
    let mut stdout = std::io::stdout();
    let generation = engine.generate(&prompt, &params, args.chunk, |out| {
        first_token.get_or_insert_with(|| started.elapsed());
        // A closed stdout (e.g. `| head`) should not abort generation.
        let _ = write!(stdout, "{}", out.text_delta).and_then(|_| stdout.flush());
    })?;
    let total = started.elapsed();
    let ttft = first_token.unwrap_or(total);
    println!();
    let decode_tokens = generation.tokens.len().saturating_sub(1).max(1);
    eprintln!(
        "prompt {} tokens, output {} tokens, finish {:?}; TTFT {:.0} ms, decode {:.1} ms/token",
        prompt.len(),
        generation.tokens.len(),
        generation.finish,
        ttft.as_secs_f64() * 1e3,
        (total - ttft).as_secs_f64() * 1e3 / decode_tokens as f64
    );
    Ok(())
}
