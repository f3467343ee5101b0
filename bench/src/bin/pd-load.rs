//! pd-load: end-to-end TTFT and ITL of any OpenAI-compatible server at several concurrency
//! levels (closed loop, streaming chat, short prompts), and the same workload through the
//! engine alone in this process, so the cost of the distributed path is visible. A first
//! version of the load generator; docs/design.md's definitions: TTFT = request sent -> first
//! token received; ITL = every gap between consecutive tokens, pooled.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use futures_util::StreamExt;
use pd_engine::{BatchSeq, CacheConfig, ChatMessage, Engine, LoadOptions, SamplingParams};
use serde_json::json;

#[derive(Debug, Parser)]
struct Args {
    /// Base URL of the server (e.g. http://127.0.0.1:8080); omit to measure only the engine.
    #[arg(long)]
    url: Option<String>,
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<usize>,
    /// Requests per concurrency level = concurrency x this.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Also run the workload through the engine alone (in this process).
    #[arg(long)]
    engine: bool,
    #[arg(long, env = "PD_MODEL", default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// Upper bound on one level's run.
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
}

/// One request's timings.
#[derive(Debug, Default)]
struct Sample {
    ttft: Duration,
    gaps: Vec<Duration>,
    tokens: usize,
}

fn question(i: usize) -> String {
    let topics = ["the sea", "mountains", "a city at night", "autumn", "a robot", "coffee", "trains", "the moon"];
    format!("Write a short story about {}.", topics[i % topics.len()])
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1e3
}

fn report(setup: &str, concurrency: usize, samples: &[Sample], wall: Duration) {
    let mut ttft: Vec<Duration> = samples.iter().map(|s| s.ttft).collect();
    let mut itl: Vec<Duration> = samples.iter().flat_map(|s| s.gaps.iter().copied()).collect();
    ttft.sort();
    itl.sort();
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    println!(
        "| {setup} | {concurrency} | {} | {:.0} | {:.0} | {:.1} | {:.1} | {} | {:.0} | {:.0} |",
        samples.len(),
        pct(&ttft, 0.5),
        pct(&ttft, 0.95),
        pct(&itl, 0.5),
        pct(&itl, 0.95),
        itl.len(),
        itl.last().map(|d| d.as_secs_f64() * 1e3).unwrap_or(f64::NAN),
        tokens as f64 / wall.as_secs_f64(),
    );
}

async fn one_request(client: &reqwest::Client, url: &str, i: usize, max_tokens: usize) -> anyhow::Result<Sample> {
    let body = json!({"messages": [{"role": "user", "content": question(i)}], "max_tokens": max_tokens,
                      "temperature": 0.8, "seed": i, "stream": true});
    let sent = Instant::now();
    let response = client.post(format!("{url}/v1/chat/completions")).json(&body).send().await?;
    anyhow::ensure!(response.status().is_success(), "status {}", response.status());
    let mut stream = response.bytes_stream();
    let mut buffer = String::new();
    let mut sample = Sample::default();
    let mut last: Option<Instant> = None;
    while let Some(chunk) = stream.next().await {
        buffer.push_str(&String::from_utf8_lossy(&chunk?));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            anyhow::ensure!(!event.contains("event: error"), "error event: {event}");
            let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else { continue };
            if data == "[DONE]" {
                continue;
            }
            let value: serde_json::Value = serde_json::from_str(data)?;
            if value["choices"][0]["delta"]["content"].is_string() {
                let now = Instant::now();
                match last {
                    None => sample.ttft = now - sent,
                    Some(prev) => sample.gaps.push(now - prev),
                }
                last = Some(now);
                sample.tokens += 1;
            }
        }
    }
    Ok(sample)
}

async fn cluster_level(
    url: &str,
    concurrency: usize,
    rounds: usize,
    max_tokens: usize,
) -> anyhow::Result<(Vec<Sample>, Duration)> {
    let client = reqwest::Client::new();
    let started = Instant::now();
    let mut workers = Vec::new();
    for w in 0..concurrency {
        let (client, url) = (client.clone(), url.to_string());
        workers.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for r in 0..rounds {
                out.push(one_request(&client, &url, w * rounds + r, max_tokens).await?);
            }
            anyhow::Ok(out)
        }));
    }
    let mut samples = Vec::new();
    for w in workers {
        samples.extend(w.await??);
    }
    Ok((samples, started.elapsed()))
}

/// The same workload on the engine alone: `concurrency` requests arrive together, each is
/// prefilled (one after another, as a colocated server without chunking would), then all
/// decode together in one batch; repeated `rounds` times.
fn engine_level(
    engine: &Engine,
    concurrency: usize,
    rounds: usize,
    max_tokens: usize,
) -> anyhow::Result<(Vec<Sample>, Duration)> {
    let started = Instant::now();
    let mut samples = Vec::new();
    for round in 0..rounds {
        let arrived = Instant::now();
        let mut seqs = Vec::new();
        let mut next = Vec::new();
        let mut batch_samples = Vec::new();
        for i in 0..concurrency {
            let prompt = engine.chat_prompt(&[ChatMessage::new("user", &question(round * concurrency + i))])?;
            let mut kv = engine.new_sequence();
            let logits = engine.prefill(&mut kv, &prompt, 512)?;
            let mut sampler = pd_engine::Sampler::new(&SamplingParams {
                temperature: 0.8,
                seed: i as u64,
                ..SamplingParams::greedy(max_tokens)
            })?;
            next.push(sampler.sample(&logits)?);
            seqs.push((kv, sampler));
            batch_samples.push(Sample { ttft: arrived.elapsed(), gaps: Vec::new(), tokens: 1 });
        }
        let mut last = vec![Instant::now(); concurrency];
        for _ in 1..max_tokens {
            let logits = {
                let mut batch: Vec<BatchSeq<'_>> = seqs
                    .iter_mut()
                    .zip(&next)
                    .map(|((kv, _), t)| BatchSeq { tokens: std::slice::from_ref(t), kv, want_logits: true })
                    .collect();
                engine.forward(&mut batch)?
            };
            for (i, ((_, sampler), s)) in seqs.iter_mut().zip(batch_samples.iter_mut()).enumerate() {
                next[i] = sampler.sample(&logits.get(i)?)?;
                let now = Instant::now();
                s.gaps.push(now - last[i]);
                last[i] = now;
                s.tokens += 1;
            }
        }
        samples.extend(batch_samples);
    }
    Ok((samples, started.elapsed()))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Before any other thread exists: the engine-alone run uses one compute thread.
    pd_engine::set_compute_threads(1)?;
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    println!("| setup | concurrency | requests | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms | ITL samples | longest gap ms | output tok/s |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    if let Some(url) = &args.url {
        for &c in &args.concurrency {
            let level = cluster_level(url, c, args.rounds, args.max_tokens);
            let (samples, wall) = tokio::time::timeout(Duration::from_secs(args.timeout_s), level).await??;
            report("cluster (HTTP, SSE)", c, &samples, wall);
        }
    }
    if args.engine {
        let engine = Engine::load(&args.model, LoadOptions::default(), CacheConfig::with_blocks(1024))?;
        for &c in &args.concurrency {
            let (samples, wall) = engine_level(&engine, c, args.rounds, args.max_tokens)?;
            report("engine alone (1 thread)", c, &samples, wall);
        }
    }
    Ok(())
}
