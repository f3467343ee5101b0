//! `pd-bench profile`: measures a running prefill + decode worker pair over pd.v1 (as the
//! router drives them) and fits the cost model a simulated worker and a capacity plan use.
//!
//! - prefill: prompts of several lengths, one at a time, of random token ids (nothing cached);
//!   each prompt's compute time (`PrefillResponse.prefill_ms`) is fitted as steps x fixed +
//!   per token + per token pair. The prefill worker runs with a step target so large that a
//!   lone prompt goes in whole `--chunk` chunks (`--step-target-ms 60000`), so the steps are
//!   known; they are counted by the real planner;
//! - decode: B streams at context C started together after one warm-up request that leaves
//!   their shared prefix in both workers' prefix caches (so B long prompts are computed once);
//!   the step time is the median gap between tokens while all B streams generate, fitted as
//!   fixed + per row + per token of context;
//! - KV hand-off: `kv_commit_ms` against the bytes shipped.
//!
//! The result is the cost model (JSON) plus every measured point and the fit's error on it.

use std::time::Instant;

use pd_prefill::step::StepConfig;
use pd_proto::v1 as pb;
use pd_sim::cost::{DecodeCost, KvCost, PrefillCost, WideForward, WorkerCost, WorkerShape};
use pd_sim::fit::fit_non_negative;
use serde::Serialize;
use tonic::transport::Channel;

type Decode = pb::decode_worker_client::DecodeWorkerClient<Channel>;
type Prefill = pb::prefill_worker_client::PrefillWorkerClient<Channel>;

/// What to measure.
#[derive(Debug, Clone)]
pub struct Plan {
    pub prefill_lengths: Vec<usize>,
    pub batches: Vec<usize>,
    pub contexts: Vec<usize>,
    /// Tokens each decode stream generates.
    pub decode_tokens: u32,
    /// The prefill worker's step policy (its flags), to count its steps.
    pub step: StepConfig,
    pub max_position: u32,
    /// Said in the cost model's `source`.
    pub machine: String,
}

/// One measured prefill.
#[derive(Debug, Clone, Serialize)]
pub struct PrefillPoint {
    pub tokens: usize,
    pub prefill_ms: f64,
    pub kv_commit_ms: f64,
    pub kv_bytes: u64,
    /// The fitted model's prediction, with the steps the planner makes of it.
    pub predicted_ms: f64,
}

/// One measured decode cell.
#[derive(Debug, Clone, Serialize)]
pub struct DecodePoint {
    pub batch: usize,
    pub context: usize,
    /// Summed context of the rows at the middle of the measured window.
    pub total_context: usize,
    pub step_ms: f64,
    pub predicted_ms: f64,
}

/// The file `profile` writes: the cost model and what it was fitted to.
#[derive(Debug, Clone, Serialize)]
pub struct Profile {
    #[serde(flatten)]
    pub cost: WorkerCost,
    pub measured: Measured,
}

#[derive(Debug, Clone, Serialize)]
pub struct Measured {
    pub prefill: Vec<PrefillPoint>,
    pub decode: Vec<DecodePoint>,
    /// Largest |predicted - measured| / measured over the points.
    pub prefill_max_error: f64,
    pub decode_max_error: f64,
}

/// A small deterministic generator of token ids (distinct prompts never share a prefix).
struct Tokens(u64);

impl Tokens {
    fn take(&mut self, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| {
                self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                1_000 + ((self.0 >> 33) % 20_000) as u32
            })
            .collect()
    }
}

/// What one request through the pair gave.
struct Outcome {
    prefill: pb::PrefillResponse,
    token_nanos: Vec<u64>,
}

async fn one(
    decode: &mut Decode,
    prefill: &mut Prefill,
    id: String,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> anyhow::Result<Outcome> {
    let sampling = pb::SamplingParams { max_tokens, ignore_eos: true, seed: Some(0), ..Default::default() };
    let request = pb::DecodeRequest {
        request_id: id.clone(),
        prompt_tokens: prompt.clone(),
        sampling: Some(sampling.clone()),
        lease_ms: 120_000,
        prefill_here: false,
        n: 1,
        output_offset: 0,
    };
    let mut stream = decode.generate(request).await?.into_inner();
    let target = match stream.message().await?.and_then(|e| e.event) {
        Some(pb::decode_event::Event::Target(t)) => t,
        other => anyhow::bail!("{id}: the decode worker's first event is not a KV target: {other:?}"),
    };
    let request = pb::PrefillRequest {
        request_id: id.clone(),
        prompt_tokens: prompt,
        target: Some(target),
        sampling: Some(sampling),
        output_offset: 0,
    };
    let prefill = prefill.prefill(request).await?.into_inner();
    let mut token_nanos = Vec::new();
    while let Some(event) = stream.message().await? {
        match event.event {
            Some(pb::decode_event::Event::Token(t)) => token_nanos.push(t.server_time_unix_nanos),
            Some(pb::decode_event::Event::Finished(_)) => break,
            _ => {}
        }
    }
    Ok(Outcome { prefill, token_nanos })
}

/// The CPU engine's small-batch kernel takes forwards of at most this many rows.
const SMALL_ROWS: usize = 16;

/// Steps the real planner makes of a lone prompt of `tokens` under `model`: (steps of at
/// most SMALL_ROWS tokens, wider steps).
fn steps_alone(tokens: usize, step: &StepConfig, model: &pd_prefill::step::CostModel) -> (usize, usize) {
    let chunks = pd_prefill::step::lone_chunks(tokens, step, model);
    let small = chunks.iter().filter(|&&t| t <= SMALL_ROWS).count();
    (small, chunks.len() - small)
}

fn predict_prefill(cost: &WorkerCost, tokens: usize, step: &StepConfig) -> f64 {
    let (small, wide) = steps_alone(tokens, step, &cost.prefill_model());
    let t = tokens as f64;
    let extra = cost.wide.map(|w| w.extra_ms).unwrap_or(0.0);
    cost.prefill.per_prompt_ms
        + (small + wide) as f64 * cost.prefill.fixed_ms
        + wide as f64 * extra
        + cost.prefill.per_token_ms * t
        + cost.prefill.per_pair_us * t * t / 2.0 / 1e3
}

/// Fits the prefill coefficients to (tokens, ms) with the planner's step counts: a setup cost
/// per prompt (told apart from the per-step cost by prompts of several chunks), a fixed cost
/// per step, and more per step wider than SMALL_ROWS when some prompts were that short.
fn fit_prefill(points: &[(usize, f64)], step: &StepConfig) -> anyhow::Result<(PrefillCost, Option<WideForward>)> {
    let mut cost = pd_prefill::step::CostModel::default();
    let split = points.iter().any(|&(n, _)| n <= SMALL_ROWS) && points.iter().any(|&(n, _)| n > SMALL_ROWS);
    let multi = points.iter().any(|&(n, _)| n > step.max_chunk);
    let (mut wide, mut per_prompt) = (None, 0.0);
    for _ in 0..3 {
        let rows: Vec<(Vec<f64>, f64)> = points
            .iter()
            .map(|&(n, ms)| {
                let t = n as f64;
                let (small, wide) = steps_alone(n, step, &cost);
                let mut x = if multi { vec![1.0] } else { vec![] };
                x.extend(if split { vec![small as f64, wide as f64] } else { vec![(small + wide) as f64] });
                x.extend([t, t * t / 2.0 / 1e3]);
                (x, ms)
            })
            .collect();
        let c = fit_non_negative(&rows).ok_or_else(|| anyhow::anyhow!("prefill fit: too few or unusable points"))?;
        let c = if multi {
            per_prompt = c[0];
            &c[1..]
        } else {
            &c[..]
        };
        let (fixed, rest) = if split {
            wide = Some(WideForward { rows: SMALL_ROWS, extra_ms: (c[1] - c[0]).max(0.0) });
            (c[0], &c[2..])
        } else {
            (c[0], &c[1..])
        };
        cost = pd_prefill::step::CostModel { fixed_ms: fixed, per_token_ms: rest[0], per_pair_us: rest[1], scale: 1.0 };
    }
    let prefill = PrefillCost {
        fixed_ms: cost.fixed_ms,
        per_token_ms: cost.per_token_ms,
        per_pair_us: cost.per_pair_us,
        per_prompt_ms: per_prompt,
    };
    Ok((prefill, wide))
}

/// Median step time while all of a cell's streams generate, and their summed context then.
fn steady_step(outcomes: &[Outcome], context: usize) -> Option<(f64, usize)> {
    let start = outcomes.iter().filter_map(|o| o.token_nanos.first()).max()?;
    let end = outcomes.iter().filter_map(|o| o.token_nanos.last()).min()?;
    let mut gaps: Vec<f64> = outcomes
        .iter()
        .flat_map(|o| o.token_nanos.windows(2))
        .filter(|w| w[0] >= *start && w[1] <= *end)
        .map(|w| (w[1] - w[0]) as f64 / 1e6)
        .collect();
    if gaps.len() < 3 {
        return None;
    }
    gaps.sort_by(f64::total_cmp);
    // Tokens generated per stream at the window's middle.
    let per_stream = outcomes.iter().map(|o| o.token_nanos.len()).min().unwrap_or(0);
    let total = outcomes.len() * (context + per_stream / 2);
    Some((gaps[gaps.len() / 2], total))
}

/// Runs the measurements against `prefill_addr` + `decode_addr` and fits the model.
pub async fn run(prefill_addr: &str, decode_addr: &str, p: &Plan) -> anyhow::Result<Profile> {
    let mut decode = Decode::connect(format!("http://{decode_addr}")).await?;
    let mut prefill = Prefill::connect(format!("http://{prefill_addr}")).await?;
    let load = decode.load(pb::LoadRequest::default()).await?.into_inner();
    // A new seed per run: prompts a worker cached in an earlier run would ship fewer bytes.
    let seed =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1);
    let mut tokens = Tokens(seed);
    let run_id = std::process::id();
    let mut prefill_points = Vec::new();
    let mut kv_rows = Vec::new();
    let mut bytes_per_token = Vec::new();
    for (i, &n) in p.prefill_lengths.iter().enumerate() {
        let o = one(&mut decode, &mut prefill, format!("profile-{run_id}-p{i}"), tokens.take(n), 1).await?;
        eprintln!(
            "profile: prefill {n} tokens: {:.1} ms, KV commit {:.1} ms",
            o.prefill.prefill_ms, o.prefill.kv_commit_ms
        );
        // Whole blocks move (a prompt's last block too, however full).
        let block = load.block_size.max(1) as usize;
        let shipped = (n - o.prefill.cached_tokens as usize).div_ceil(block) * block;
        bytes_per_token.push(o.prefill.kv_bytes as f64 / shipped.max(1) as f64);
        kv_rows.push((vec![1.0, o.prefill.kv_bytes as f64 / 1e6], o.prefill.kv_commit_ms.max(1e-3)));
        prefill_points.push(PrefillPoint {
            tokens: n,
            prefill_ms: o.prefill.prefill_ms,
            kv_commit_ms: o.prefill.kv_commit_ms,
            kv_bytes: o.prefill.kv_bytes,
            predicted_ms: 0.0,
        });
    }
    let fit_rows: Vec<(usize, f64)> = prefill_points.iter().map(|q| (q.tokens, q.prefill_ms)).collect();
    let (prefill_cost, wide) = fit_prefill(&fit_rows, &p.step)?;
    let mut decode_points = Vec::new();
    for &c in &p.contexts {
        for &b in &p.batches {
            let shared = tokens.take(c.saturating_sub(1).max(1));
            let id = format!("profile-{run_id}-d{c}x{b}");
            let mut warm = shared.clone();
            warm.extend(tokens.take(1));
            one(&mut decode, &mut prefill, format!("{id}-warm"), warm, 1).await?;
            let started = Instant::now();
            let streams = (0..b).map(|k| {
                let (mut d, mut q) = (decode.clone(), prefill.clone());
                let mut prompt = shared.clone();
                prompt.extend(tokens.take(1));
                let id = format!("{id}-{k}");
                // Long enough that every stream still generates when the last one starts.
                let max = p.decode_tokens + 6 * b as u32;
                async move { one(&mut d, &mut q, id, prompt, max).await }
            });
            let outcomes: Vec<Outcome> = futures_util::future::try_join_all(streams).await?;
            let Some((step_ms, total_context)) = steady_step(&outcomes, c) else {
                eprintln!("profile: decode {b} x {c}: no window where all streams generated; skipped");
                continue;
            };
            eprintln!("profile: decode {b} x {c}: step {step_ms:.2} ms ({:.1} s)", started.elapsed().as_secs_f64());
            decode_points.push(DecodePoint { batch: b, context: c, total_context, step_ms, predicted_ms: 0.0 });
        }
    }
    let rows: Vec<(Vec<f64>, f64)> =
        decode_points.iter().map(|d| (vec![1.0, d.batch as f64, d.total_context as f64 / 1e3], d.step_ms)).collect();
    let dc =
        fit_non_negative(&rows).ok_or_else(|| anyhow::anyhow!("decode fit: too few or unusable cells (need 3)"))?;
    let kv = fit_non_negative(&kv_rows)
        .unwrap_or_else(|| vec![kv_rows.iter().map(|r| r.1).sum::<f64>() / kv_rows.len().max(1) as f64, 0.0]);
    let bpt = bytes_per_token.iter().sum::<f64>() / bytes_per_token.len().max(1) as f64;
    let cost = WorkerCost {
        source: format!("pd-bench profile on {} (prefill {prefill_addr}, decode {decode_addr})", p.machine),
        prefill: prefill_cost,
        decode: DecodeCost { fixed_ms: dc[0], per_row_ms: dc[1], per_context_us: dc[2] },
        kv: KvCost { bytes_per_token: bpt.round() as u64, commit_fixed_ms: kv[0], commit_ms_per_mb: kv[1] },
        worker: WorkerShape {
            block_size: load.block_size,
            kv_blocks: load.total_blocks,
            max_batch: load.max_batch,
            max_position: p.max_position,
        },
        wide,
        // A fit is linear in the context; a windowed model's measured points bend it instead.
        window: None,
    };
    cost.validate()?;
    Ok(score(cost, prefill_points, decode_points, &p.step))
}

/// The profile with every point's prediction and the largest relative errors.
fn score(cost: WorkerCost, mut prefill: Vec<PrefillPoint>, mut decode: Vec<DecodePoint>, step: &StepConfig) -> Profile {
    let mut prefill_max_error: f64 = 0.0;
    for q in &mut prefill {
        q.predicted_ms = predict_prefill(&cost, q.tokens, step);
        prefill_max_error = prefill_max_error.max((q.predicted_ms - q.prefill_ms).abs() / q.prefill_ms.max(1e-9));
    }
    let mut decode_max_error: f64 = 0.0;
    for d in &mut decode {
        d.predicted_ms = cost.decode_step_ms(d.batch, d.total_context, &[]);
        decode_max_error = decode_max_error.max((d.predicted_ms - d.step_ms).abs() / d.step_ms.max(1e-9));
    }
    Profile { cost, measured: Measured { prefill, decode, prefill_max_error, decode_max_error } }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_fit_recovers_a_planned_model() {
        let step = StepConfig::single(256);
        let truth = WorkerCost {
            source: String::new(),
            prefill: PrefillCost { fixed_ms: 15.0, per_token_ms: 2.5, per_pair_us: 1.5, per_prompt_ms: 25.0 },
            decode: DecodeCost { fixed_ms: 1.0, per_row_ms: 1.0, per_context_us: 1.0 },
            kv: KvCost { bytes_per_token: 1, commit_fixed_ms: 0.0, commit_ms_per_mb: 0.0 },
            worker: WorkerShape { block_size: 16, kv_blocks: 1, max_batch: 1, max_position: 4096 },
            wide: Some(WideForward { rows: SMALL_ROWS, extra_ms: 60.0 }),
            window: None,
        };
        let points: Vec<(usize, f64)> =
            [8, 16, 32, 128, 512, 1024, 2048].iter().map(|&n| (n, predict_prefill(&truth, n, &step))).collect();
        let (got, wide) = fit_prefill(&points, &step).expect("fit");
        assert!((wide.expect("wide").extra_ms - 60.0).abs() < 1e-6, "{wide:?}");
        assert!((got.fixed_ms - 15.0).abs() < 1e-6 && (got.per_token_ms - 2.5).abs() < 1e-6, "{got:?}");
        assert!((got.per_pair_us - 1.5).abs() < 1e-6, "{got:?}");
        assert!((got.per_prompt_ms - 25.0).abs() < 1e-6, "{got:?}");
    }

    #[test]
    fn the_steady_window_is_where_every_stream_generates() {
        let ms = 1_000_000;
        let a = Outcome { prefill: Default::default(), token_nanos: (0..10).map(|i| i * 10 * ms).collect() };
        // Starts 20 ms later, steps 20 ms apart inside a's window.
        let b = Outcome { prefill: Default::default(), token_nanos: (0..5).map(|i| 20 * ms + i * 20 * ms).collect() };
        let (step, total) = steady_step(&[a, b], 100).expect("window");
        assert!((step - 10.0).abs() < 1e-9, "{step}");
        assert_eq!(total, 2 * (100 + 2));
    }
}
