//! pd-engine-bench: engine speed on the real model, one process, one thread count.
//! Prints a Markdown table: prefill tok/s by prompt length (chunked), decode ms/token by
//! batch size at a fixed context, KV export/import GB/s, peak RSS. Run it once per thread
//! count (`--threads`); compare numbers from one run, these machines are noisy.

use std::path::PathBuf;

// Reuses freed memory instead of returning it to the kernel: the forward pass allocates
// large short-lived buffers, which glibc maps fresh (and the kernel zeroes) every time.
pd_engine::model_allocator!();
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use pd_engine::{
    set_compute_threads, BatchSeq, CacheConfig, DeviceKind, Engine, KvCacheDType, LoadOptions, SequenceKv,
    WeightFormat, WireDType,
};

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, env = "PD_MODEL", default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Weights in memory: wq (default: the file's Q4_1/Q8_0 values, f32 activations), f16,
    /// f32, q8 (re-quantized) or stored (as in the file).
    #[arg(long, default_value = "wq")]
    weights: WeightFormat,
    /// Where the model runs: cpu (default), cuda or cuda:N (a `--features cuda` build).
    #[arg(long, default_value = "cpu")]
    device: DeviceKind,
    /// KV cache element type: f16 (default) or f32.
    #[arg(long, default_value = "f16")]
    kv_cache: KvCacheDType,
    /// Prompt lengths for the prefill measurement.
    #[arg(long, value_delimiter = ',', default_value = "128,512,2048")]
    prefill: Vec<usize>,
    #[arg(long, default_value_t = 512)]
    chunk: usize,
    /// Batch sizes for the decode measurement.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    batch: Vec<usize>,
    /// Context length of every sequence in the decode measurement.
    #[arg(long, default_value_t = 512)]
    context: usize,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// After the decode table, where each batch's step time goes by kind of operation
    /// (`pd_engine::profile`), timed over a second run of the same steps.
    #[arg(long)]
    breakdown: bool,
    /// Also measure what one row at this context (0 = skip) costs a decode batch of 4 rows
    /// at `--context`: the step time with and without it.
    #[arg(long, default_value_t = 0)]
    long_row: usize,
}

/// Deterministic token ids in the normal-text range of the vocabulary.
fn prompt(len: usize, salt: usize) -> Vec<u32> {
    (0..len).map(|i| (100 + (i * 7919 + salt * 104_729) % 40_000) as u32).collect()
}

fn peak_rss_mib() -> Option<f64> {
    status_mib("VmHWM:")
}

/// Starts a new peak: memory the last phase freed goes back to the kernel (mimalloc keeps
/// freed pages for a second), then the kernel sets VmHWM back to the current RSS
/// (`clear_refs` value 5). Returns false where it cannot (not Linux, or no write access), so
/// the phases' peaks are left out rather than reported wrong.
fn reset_peak() -> bool {
    // SAFETY: mi_collect takes no pointers; it only frees pages mimalloc owns.
    unsafe { libmimalloc_sys::mi_collect(true) };
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Peak resident memory by phase: the engine's own work (prefill, decode) apart from the
/// bench's measurement buffers (whole-context KV export and import, which a worker never
/// holds: it streams one layer's frames at a time).
#[derive(Debug, Default)]
struct PhasePeaks {
    /// Through the load and the warm-up.
    load: Option<f64>,
    prefill: Option<f64>,
    export_import: Option<f64>,
    decode: Option<f64>,
    /// The KV snapshot the bench holds through the decode phase, in MiB.
    snapshot: f64,
}

/// A memory figure of this process from /proc/self/status (VmHWM: peak, VmRSS: now).
fn status_mib(key: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    set_compute_threads(args.threads)?;
    let max_prompt = args.prefill.iter().copied().max().unwrap_or(0);
    let max_batch = args.batch.iter().copied().max().unwrap_or(1);
    // Each sequence grows by the warm-up step, the timed steps and, with --breakdown, as many again.
    let per_seq = args.context + 2 * args.steps + 2;
    let long_rows = if args.long_row > 0 { args.long_row + args.steps + 2 + per_seq * 9 } else { 0 };
    // Blocks, not tokens: every sequence rounds up to whole blocks.
    let blocks = |tokens: usize| tokens.div_ceil(CacheConfig::DEFAULT_BLOCK_SIZE);
    let blocks_needed = blocks(max_prompt).max(blocks(per_seq) * (max_batch + 1)) + blocks(long_rows) + 16;
    let cache = CacheConfig { prefix_cache: false, dtype: args.kv_cache, ..CacheConfig::with_blocks(blocks_needed) };
    let options = LoadOptions { weights: args.weights, device: args.device };
    let engine =
        Engine::load(&args.model, options, cache).with_context(|| format!("loading {}", args.model.display()))?;
    // Every page of the KV pool resident, as in a worker that has run a while: otherwise the
    // figures below would depend on how much of the pool this run's prompts happen to write.
    engine.cache().touch_all()?;
    // Resident right after the load: the weights, the tokenizer and the whole KV pool.
    let loaded_mib = status_mib("VmRSS:");
    println!(
        "model {} | device {:?} | weights {:?} | KV cache {:?} | threads {} | SIMD {}",
        args.model.display(),
        args.device,
        args.weights,
        args.kv_cache,
        args.threads,
        pd_engine::simd_level()
    );
    println!();
    println!("| measurement | value |");
    println!("|---|---|");

    // Warm-up: the first forward pays one-off costs (thread pools, page faults).
    drop(engine.prefill(&mut engine.new_sequence(), &prompt(32, 99), args.chunk)?);
    // A GPU queues work: every timed section ends by waiting for the device.
    let sync = || engine.model().device().synchronize();
    let mut peaks = PhasePeaks { load: peak_rss_mib(), ..PhasePeaks::default() };
    let phases = reset_peak();

    for &len in &args.prefill {
        let mut kv = engine.new_sequence();
        let t = Instant::now();
        engine.prefill(&mut kv, &prompt(len, len), args.chunk)?;
        sync()?;
        let s = t.elapsed().as_secs_f64();
        println!("| prefill {len} tokens (chunk {}) | {:.0} tok/s ({:.2} s) |", args.chunk, len as f64 / s, s);
    }
    if phases {
        peaks.prefill = peak_rss_mib();
        reset_peak();
    }

    // One prefilled context, copied into every sequence of the batch through KV export/import.
    let mut base = engine.new_sequence();
    let base_logits = engine.prefill(&mut base, &prompt(args.context, 7), args.chunk)?;
    let first_token = base_logits.argmax(0)?.to_scalar::<u32>()?;
    for dtype in [WireDType::F16, WireDType::F32] {
        // The second of two rounds: the first pays for fresh pages (and, on a GPU, the pinned
        // staging buffers), which a worker pays once.
        let (mut bytes, mut export_s, mut import_s) = (Vec::new(), 0.0, 0.0);
        for _ in 0..2 {
            // The last round's buffer goes first: two of them at once (235 MB in f32 at 512
            // tokens of Qwen3-0.6B) were the run's peak resident memory.
            drop(std::mem::take(&mut bytes));
            let t = Instant::now();
            bytes = engine.export_kv(&base, 0..engine.model().config().num_layers, dtype)?;
            export_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let imported = engine.import_kv(&bytes)?;
            sync()?;
            import_s = t.elapsed().as_secs_f64();
            drop(imported);
        }
        let gb = bytes.len() as f64 / 1e9;
        println!(
            "| KV export / import {dtype:?}, {} tokens ({:.1} MB) | {:.2} / {:.2} GB/s |",
            args.context,
            gb * 1e3,
            gb / export_s,
            gb / import_s
        );
    }
    // In the cache's own type (lossless either way), held through the decode measurement:
    // f32 doubled an f16 cache's bytes.
    let snapshot_dtype = match args.kv_cache {
        KvCacheDType::F16 => WireDType::F16,
        KvCacheDType::F32 => WireDType::F32,
    };
    if phases {
        peaks.export_import = peak_rss_mib();
    }
    let snapshot = engine.export_kv(&base, 0..engine.model().config().num_layers, snapshot_dtype)?;
    peaks.snapshot = snapshot.len() as f64 / MIB;
    if phases {
        reset_peak();
    }
    let mut single_ms = None;
    let mut breakdowns = Vec::new();
    for &batch in &args.batch {
        let mut seqs: Vec<SequenceKv> = (0..batch).map(|_| engine.import_kv(&snapshot)).collect::<Result<_, _>>()?;
        let mut tokens = vec![first_token; batch];
        let step = |seqs: &mut [SequenceKv], tokens: &mut Vec<u32>| -> anyhow::Result<()> {
            let mut items: Vec<BatchSeq<'_>> = seqs
                .iter_mut()
                .zip(tokens.iter())
                .map(|(kv, t)| BatchSeq { tokens: std::slice::from_ref(t), kv, want_logits: true })
                .collect();
            let logits = engine.forward(&mut items)?;
            *tokens = logits.argmax(1)?.to_vec1::<u32>()?;
            Ok(())
        };
        step(&mut seqs, &mut tokens)?;
        let t = Instant::now();
        for _ in 0..args.steps {
            step(&mut seqs, &mut tokens)?;
        }
        let step_ms = t.elapsed().as_secs_f64() * 1e3 / args.steps as f64;
        let per_token = step_ms / batch as f64;
        let base_ms = *single_ms.get_or_insert(step_ms);
        println!(
            "| decode batch {batch} at {} context | {step_ms:.1} ms/step, {per_token:.2} ms/token, {:.0} tok/s ({:.1}x batch {}) |",
            args.context,
            1e3 / per_token,
            base_ms / per_token,
            args.batch[0]
        );
        if args.breakdown {
            pd_engine::profile::enable(true);
            pd_engine::profile::take();
            let t = Instant::now();
            for _ in 0..args.steps {
                step(&mut seqs, &mut tokens)?;
            }
            let total = t.elapsed();
            pd_engine::profile::enable(false);
            breakdowns.push((batch, total, pd_engine::profile::take()));
        }
    }
    if !breakdowns.is_empty() {
        print_breakdown(&breakdowns, args.steps);
    }
    if args.long_row > 0 {
        long_row_cost(&engine, &snapshot, first_token, &args)?;
    }
    if phases {
        peaks.decode = peak_rss_mib();
    }
    // The memory budget a deployment plans with: the weight file plus the KV pool.
    let file_mib = std::fs::metadata(&args.model).map(|m| m.len()).unwrap_or(0) as f64 / MIB;
    let budget = file_mib + kv_pool_bytes(engine.cache()) as f64 / MIB;
    print_memory(loaded_mib, &peaks, file_mib, budget);
    Ok(())
}

/// The memory rows: RSS after the load, each phase's peak, the end, and the peaks as a
/// multiple of the weight file plus the KV pool.
fn print_memory(loaded: Option<f64>, peaks: &PhasePeaks, file_mib: f64, budget: f64) {
    // VmHWM restarts at each phase: the whole run's peak is the largest of them.
    let phases = [peaks.load, peaks.prefill, peaks.export_import, peaks.decode, peak_rss_mib()];
    let Some(whole) = phases.into_iter().flatten().reduce(f64::max) else { return };
    let pool_mib = budget - file_mib;
    if let Some(loaded) = loaded {
        println!("| RSS after the load | {loaded:.0} MiB ({:.3}x) |", loaded / budget);
    }
    if let Some(prefill) = peaks.prefill {
        println!("| peak RSS during prefill | {prefill:.0} MiB ({:.3}x) |", prefill / budget);
    }
    if let Some(buffers) = peaks.export_import {
        println!("| peak RSS during KV export / import (the bench's whole-context buffers) | {buffers:.0} MiB |");
    }
    if let Some(decode) = peaks.decode {
        let engine = decode - peaks.snapshot;
        println!(
            "| peak RSS during decode, less the bench's {:.0} MiB KV snapshot | {engine:.0} MiB ({:.3}x) |",
            peaks.snapshot,
            engine / budget
        );
    }
    if let Some(now) = status_mib("VmRSS:") {
        println!("| RSS at the end | {now:.0} MiB |");
    }
    println!("| peak RSS of the whole run | {whole:.0} MiB ({:.3}x) |", whole / budget);
    println!("| budget: model file + KV pool | {file_mib:.0} + {pool_mib:.0} MiB |");
}

const MIB: f64 = 1024.0 * 1024.0;

/// Bytes the KV pool holds: every layer's K and V tensors.
fn kv_pool_bytes(cache: &pd_engine::KvCache) -> usize {
    let mut bytes = 0;
    for layer in 0..cache.num_layers() {
        let (k, v) = cache.layer(layer);
        bytes += (k.elem_count() + v.elem_count()) * cache.dtype().size_in_bytes();
    }
    bytes
}

/// One batch size's timed steps: batch, total wall time, time per kind of operation.
type Breakdown = (usize, std::time::Duration, Vec<(pd_engine::profile::Op, std::time::Duration)>);

/// One table: per batch size, ms per step of each kind of operation and its share.
fn print_breakdown(rows: &[Breakdown], steps: usize) {
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / steps as f64;
    println!();
    let ops = pd_engine::profile::Op::ALL;
    let names: Vec<&str> = ops.iter().map(|op| op.name()).collect();
    println!("| decode step, ms (share) | {} | rest | total |", names.join(" | "));
    println!("|---|{}---|---|", "---|".repeat(ops.len()));
    for (batch, total, parts) in rows {
        let total_ms = ms(*total);
        let cells: Vec<String> =
            parts.iter().map(|(_, d)| format!("{:.2} ({:.0}%)", ms(*d), 100.0 * ms(*d) / total_ms)).collect();
        let rest = total_ms - parts.iter().map(|(_, d)| ms(*d)).sum::<f64>();
        println!(
            "| batch {batch} | {} | {rest:.2} ({:.0}%) | {total_ms:.2} |",
            cells.join(" | "),
            100.0 * rest / total_ms
        );
    }
}

/// Mean step time over `steps` decode steps of `seqs` (one token each).
fn step_ms(engine: &Engine, seqs: &mut [SequenceKv], first: u32, steps: usize) -> anyhow::Result<f64> {
    let mut tokens = vec![first; seqs.len()];
    let mut t = Instant::now();
    for i in 0..=steps {
        if i == 1 {
            t = Instant::now(); // the first step warms up
        }
        let mut items: Vec<BatchSeq<'_>> = seqs
            .iter_mut()
            .zip(tokens.iter())
            .map(|(kv, t)| BatchSeq { tokens: std::slice::from_ref(t), kv, want_logits: true })
            .collect();
        tokens = engine.forward(&mut items)?.argmax(1)?.to_vec1::<u32>()?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e3 / steps as f64)
}

/// The cost of one long-context row in a decode batch of 4 short rows.
fn long_row_cost(engine: &Engine, snapshot: &[u8], first: u32, args: &Args) -> anyhow::Result<()> {
    let mut long = engine.new_sequence();
    engine.prefill(&mut long, &prompt(args.long_row, 3), args.chunk)?;
    let mut short: Vec<SequenceKv> = (0..4).map(|_| engine.import_kv(snapshot)).collect::<Result<_, _>>()?;
    let alone = step_ms(engine, &mut short, first, args.steps)?;
    short.push(long);
    let with_long = step_ms(engine, &mut short, first, args.steps)?;
    let mut five: Vec<SequenceKv> = (0..5).map(|_| engine.import_kv(snapshot)).collect::<Result<_, _>>()?;
    let five_short = step_ms(engine, &mut five, first, args.steps)?;
    println!(
        "| decode batch 4 at {} context, + one row at {} | {alone:.1} -> {with_long:.1} ms/step (+{:.0}%; a 5th row at {} context: {five_short:.1}) |",
        args.context,
        args.long_row,
        100.0 * (with_long / alone - 1.0),
        args.context
    );
    Ok(())
}
