//! pd-sampling-bench: what sampling options cost a decode step, on the real model. A batch of
//! `--batch` sequences at `--context` tokens decodes `--steps` steps per mode; each step is
//! the batched forward plus one draw per row, as the decode worker runs it. Modes: plain
//! (temperature 1), `top_logprobs` 5, penalties (frequency, presence, repetition), and a
//! JSON schema constraint (every row inside the schema). Prints a Markdown table: forward ms
//! and sampling ms per step (medians), and what each mode's sampling adds to a step: its
//! sampling time over plain's, as a share of plain's whole step (the forward is the same
//! work in every mode; its run-to-run noise would swamp a plain step-time ratio). Compare
//! numbers from one run; these machines are noisy.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use pd_engine::{
    set_compute_threads, BatchSeq, CacheConfig, Engine, LoadOptions, OutputConstraint, Sampler, SamplingParams,
    SequenceKv, WeightFormat,
};

pd_engine::model_allocator!();

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, env = "PD_MODEL", default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    #[arg(long, default_value_t = 1)]
    threads: usize,
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Prompt tokens per sequence before the timed steps.
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Decode steps timed per mode.
    #[arg(long, default_value_t = 24)]
    steps: usize,
}

const SCHEMA: &str = r#"{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},"tags":{"type":"array","items":{"type":"string"}}},"required":["name","age","tags"]}"#;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    set_compute_threads(args.threads)?;
    let blocks = args.batch * (args.context + 5 * args.steps + 32).div_ceil(16) + 16;
    let engine = Engine::load(
        &args.model,
        LoadOptions { weights: WeightFormat::Wq, ..LoadOptions::default() },
        CacheConfig::with_blocks(blocks),
    )
    .context("loading the model")?;
    let tok = engine.tokenizer();
    let prompt: Vec<u32> = (0..args.context as u32).map(|i| 100 + i % 1000).collect();
    let mut seqs: Vec<SequenceKv> = Vec::new();
    let mut next = Vec::new();
    for _ in 0..args.batch {
        let mut kv = engine.sequence_with_capacity(args.context + 5 * args.steps + 16)?;
        let logits = engine.prefill(&mut kv, &prompt, 512)?;
        next.push(Sampler::new(&SamplingParams::greedy(1))?.sample(&logits)?);
        seqs.push(kv);
    }
    let base = SamplingParams { temperature: 1.0, ..SamplingParams::greedy(args.steps * 5) };
    let modes: Vec<(&str, SamplingParams)> = vec![
        ("plain (temperature 1)", base.clone()),
        ("top_logprobs 5", SamplingParams { logprobs: Some(5), ..base.clone() }),
        (
            "penalties",
            SamplingParams { frequency_penalty: 0.5, presence_penalty: 0.5, repetition_penalty: 1.1, ..base.clone() },
        ),
        (
            "json_schema",
            SamplingParams { constraint: Some(OutputConstraint::JsonSchema(SCHEMA.into())), ..base.clone() },
        ),
        ("plain again", base.clone()),
    ];
    tok.grammars()?; // built once per worker, not per step
    println!("| mode | forward ms/step | sampling ms/step | added to a step |");
    println!("|---|---|---|---|");
    let mut plain_step = None;
    for (name, params) in modes {
        let mut samplers: Vec<Sampler> = (0..args.batch)
            .map(|i| Sampler::for_sequence(&SamplingParams { seed: i as u64, ..params.clone() }, &prompt, tok))
            .collect::<Result<_, _>>()?;
        let (mut forward_ms, mut sampling_ms) = (Vec::new(), Vec::new());
        for _ in 0..args.steps {
            let started = Instant::now();
            let rows: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let mut batch: Vec<BatchSeq> =
                seqs.iter_mut().zip(&rows).map(|(kv, t)| BatchSeq { tokens: t, kv, want_logits: true }).collect();
            let logits = engine.forward(&mut batch)?;
            let forwarded = Instant::now();
            for (row, sampler) in samplers.iter_mut().enumerate() {
                let drawn = sampler.draw(&logits.get(row)?)?;
                // An ended row (its constraint complete) keeps feeding its last token.
                if !tok.eos_ids().contains(&drawn.token) {
                    next[row] = drawn.token;
                }
            }
            forward_ms.push((forwarded - started).as_secs_f64() * 1e3);
            sampling_ms.push(forwarded.elapsed().as_secs_f64() * 1e3);
        }
        let (f, s) = (median(forward_ms), median(sampling_ms));
        let (plain_forward, plain_sampling) = *plain_step.get_or_insert((f, s));
        let added = (s - plain_sampling) / (plain_forward + plain_sampling) * 100.0;
        println!("| {name} | {f:.2} | {s:.3} | {added:+.1}% |");
    }
    println!(
        "\nbatch {} at {} tokens of context, {} steps per mode, {} thread(s)",
        args.batch, args.context, args.steps, args.threads
    );
    Ok(())
}
