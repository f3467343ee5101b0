//! `pd-bench plan`: a capacity plan from a load test (`requests.json`) or a traffic
//! description, and a worker cost model. What it computes, in order:
//!
//! 1. **Demand per window** (5 minutes, or the test's length if shorter), per class: prompt
//!    tokens/s and output tokens/s of first sendings (retries after a 429 are counted apart and
//!    add no demand; refused first sendings do: their demand was real).
//! 2. **Prefill pool**: the work of a window is the sum of each prompt's compute time alone on
//!    one worker (its uncached tokens in the steps the real planner makes of them at the
//!    workers' step target), per second of window: that many workers are busy all the time. Replicas = (peak work + growth over the scale-out time) /
//!    target utilization, rounded up, plus the spare replicas kept for a loss.
//! 3. **Decode pool**: the most rows a step may hold is the largest batch whose step time stays
//!    under the tightest ITL SLO at the traffic's mean context, and whose reservations (prompt +
//!    whole output, decode-first) fit the KV blocks. Demand is the sequences open at once at a
//!    percentile over time (`decode_percentile`, p95 by default), not their mean: first tokens
//!    come in bursts after prefill queues, and a worker past its batch limit breaks every
//!    stream's ITL. Per window, the larger of the load test's own percentile (each first
//!    sending open from its first token, or its sending plus its prompt's idle prefill time,
//!    for its output tokens at the planned step time) and that percentile for Poisson arrivals
//!    at the window's mean (the count of an M/G/inf queue is Poisson; normal approximation).
//!    Replicas follow from the peak as for prefill, at `decode_utilization` of the batch.
//! 4. **Loss of one replica**: the planned pools minus one carry the peak: prefill utilization
//!    of 1 or more means its queue grows without bound; decode sequences per replica beyond
//!    the KV limit mean reservations are refused and retried elsewhere, a cascade.
//! 5. **Autoscaler targets** (KEDA thresholds of `deploy/k8s/base/autoscaling.yaml`) that
//!    follow from the plan.

pub mod render;
pub mod traffic;

use std::collections::BTreeMap;

use pd_prefill::step::StepConfig;
use pd_sim::cost::WorkerCost;
use serde::Serialize;

use crate::loadgen::stats::{RequestSample, Summary};

/// The prefill worker's default step policy (its flags' defaults).
pub fn default_step() -> StepConfig {
    pd_prefill::step::StepArgs::default().config().unwrap_or_else(|_| StepConfig::single(512))
}

/// SLO targets of a class (p95).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Targets {
    pub ttft_ms: f64,
    pub itl_ms: f64,
}

/// The planner's knobs.
#[derive(Debug, Clone)]
pub struct PlanConfig {
    pub window_s: f64,
    pub slos: BTreeMap<String, Targets>,
    /// SLOs of a class not named in `slos`.
    pub default_slo: Targets,
    /// Busy fraction a prefill worker is planned at (queueing keeps TTFT below the SLO).
    pub prefill_utilization: f64,
    /// Fraction of the ITL- and KV-limited batch a decode worker is planned at.
    pub decode_utilization: f64,
    /// Decode sequences are planned at this quantile over time of how many are open at once
    /// (None: at their mean, output tokens/s x step time).
    pub decode_percentile: Option<f64>,
    /// Time from a scale-out decision to a serving replica.
    pub scale_out_s: f64,
    /// Replicas kept spare per pool for the loss of one.
    pub spare: u32,
    /// The prefill workers' step policy (their flags): a prompt costs the steps the real
    /// planner makes of it.
    pub step: StepConfig,
}

impl Default for PlanConfig {
    fn default() -> Self {
        PlanConfig {
            window_s: 300.0,
            slos: BTreeMap::new(),
            default_slo: Targets { ttft_ms: 1500.0, itl_ms: 100.0 },
            prefill_utilization: 0.7,
            decode_utilization: 0.8,
            decode_percentile: Some(0.95),
            scale_out_s: 120.0,
            spare: 1,
            step: default_step(),
        }
    }
}

/// Token counts of a class.
#[derive(Debug, Clone, Serialize)]
pub struct Dist {
    pub mean: f64,
    pub p50: Option<f64>,
    pub p95: Option<f64>,
    pub max: Option<f64>,
}

impl Dist {
    fn of(v: &[f64]) -> Dist {
        let s = Summary::of(v.iter().copied());
        let mean = if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
        Dist { mean, p50: s.p50, p95: s.p95, max: s.max }
    }
}

/// One row of the capacity table.
#[derive(Debug, Clone, Serialize)]
pub struct ClassRow {
    pub class: String,
    /// First sendings, retries after a 429, and first sendings refused.
    pub requests: usize,
    pub retries: usize,
    pub refused: usize,
    pub input_tokens: Dist,
    pub output_tokens: Dist,
    pub target: Targets,
    /// Measured in the load test (None for a traffic description).
    pub ttft_p95_ms: Option<f64>,
    pub itl_p95_ms: Option<f64>,
    /// TTFT of the class's p95 prompt on an idle prefill worker (compute + KV commit).
    pub idle_ttft_p95_ms: f64,
    pub peak_input_tok_s: f64,
    pub peak_output_tok_s: f64,
    /// KV blocks its sequences hold at its peak (concurrency x blocks per reservation).
    pub peak_kv_blocks: f64,
}

/// Demand in one window.
#[derive(Debug, Clone, Serialize)]
pub struct Window {
    pub start_s: f64,
    pub input_tok_s: BTreeMap<String, f64>,
    pub output_tok_s: BTreeMap<String, f64>,
    /// Prefill workers busy all the time to compute this window's prompts.
    pub prefill_work: f64,
    pub output_total_tok_s: f64,
    /// Decode sequences open at once, at the planned step time: the mean over the window, and
    /// at `decode_percentile` (the mean when it is None).
    pub decode_mean_sequences: f64,
    pub decode_sequences: f64,
}

/// One pool's sizing.
#[derive(Debug, Clone, Serialize)]
pub struct Pool {
    /// Per replica: prefill busy-seconds per second it can give (its utilization target), or
    /// decode output tokens/s at the planned batch.
    pub per_replica: f64,
    /// Peak demand in the same unit (prefill: busy workers; decode: tokens/s).
    pub peak: f64,
    /// Demand added during one scale-out time at the steepest rise seen between windows.
    pub growth: f64,
    /// Replicas for peak + growth, before the spare ones.
    pub serving: u32,
    pub replicas: u32,
    /// With one replica fewer than planned, at the peak: utilization (prefill) or sequences
    /// per replica over the KV limit (decode, > 1 means refusals).
    pub after_loss: f64,
    pub cascade: bool,
}

/// Decode step sizing.
#[derive(Debug, Clone, Serialize)]
pub struct DecodeBatch {
    pub mean_context: f64,
    pub blocks_per_sequence: usize,
    /// Largest batch under the tightest ITL SLO; the KV limit; the planned batch.
    pub itl_limit: usize,
    pub kv_limit: usize,
    pub planned: usize,
    pub step_ms: f64,
    pub peak_sequences: f64,
    pub peak_kv_usage: f64,
}

/// KEDA thresholds that follow from the plan (per replica, AverageValue).
#[derive(Debug, Clone, Serialize)]
pub struct Keda {
    pub prefill_waiting_tokens: u64,
    pub prefill_queue_age_s: f64,
    pub decode_running_sequences: u64,
    pub decode_kv_usage: f64,
}

/// The whole plan.
#[derive(Debug, Clone, Serialize)]
pub struct CapacityPlan {
    pub cost_source: String,
    pub window_s: f64,
    pub scale_out_s: f64,
    /// The quantile over time decode is sized for (None: the mean).
    pub decode_percentile: Option<f64>,
    pub windows: Vec<Window>,
    pub classes: Vec<ClassRow>,
    pub prefill: Pool,
    pub decode: Pool,
    pub batch: DecodeBatch,
    pub keda: Keda,
    /// Things the plan could not meet (an SLO unreachable even on idle workers, ...).
    pub warnings: Vec<String>,
}

/// Why a plan cannot be made.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("no requests to plan for")]
    Empty,
    #[error("{0} must be positive")]
    NotPositive(&'static str),
    #[error("--decode-percentile must be in (0, 1), got {0}")]
    Percentile(f64),
}

fn uncached(r: &RequestSample) -> usize {
    r.input_tokens.saturating_sub(r.cached_tokens.unwrap_or(0))
}

fn output_of(r: &RequestSample) -> usize {
    if r.rejected() || r.status.is_some() {
        r.requested_output_tokens
    } else {
        r.reported_output_tokens.unwrap_or_else(|| r.output_tokens().max(r.requested_output_tokens.min(1)))
    }
}

/// Per-window demand from first sendings over `duration_s`.
fn windows(firsts: &[&RequestSample], duration_s: f64, cost: &WorkerCost, cfg: &PlanConfig) -> Vec<Window> {
    let window = cfg.window_s.min(duration_s);
    let mut count = ((duration_s / window).ceil() as usize).max(1);
    let mut spans = vec![window; count];
    spans[count - 1] = duration_s - (count - 1) as f64 * window;
    // A last window shorter than a tenth of the others is folded into the one before.
    if count > 1 && spans[count - 1] < 0.1 * window {
        let rest = spans.pop().unwrap_or(0.0);
        count -= 1;
        spans[count - 1] += rest;
    }
    let mut out: Vec<Window> = (0..count)
        .map(|i| Window {
            start_s: i as f64 * window,
            input_tok_s: BTreeMap::new(),
            output_tok_s: BTreeMap::new(),
            prefill_work: 0.0,
            output_total_tok_s: 0.0,
            decode_mean_sequences: 0.0,
            decode_sequences: 0.0,
        })
        .collect();
    for r in firsts {
        let i = ((r.sent_ms / 1e3 / window).floor() as usize).min(count - 1);
        let (w, span) = (&mut out[i], spans[i]);
        *w.input_tok_s.entry(r.class.clone()).or_default() += r.input_tokens as f64 / span;
        *w.output_tok_s.entry(r.class.clone()).or_default() += output_of(r) as f64 / span;
        w.output_total_tok_s += output_of(r) as f64 / span;
        w.prefill_work += cost.prefill_planned_ms(uncached(r), &cfg.step) / 1e3 / span;
    }
    out
}

/// Growth of `f` between consecutive windows, per second, at its steepest (0 if never rising).
fn steepest_rise(w: &[Window], window_s: f64, f: impl Fn(&Window) -> f64) -> f64 {
    w.windows(2).map(|p| (f(&p[1]) - f(&p[0])) / window_s).fold(0.0, f64::max)
}

/// Makes the plan for `samples` sent over `duration_s` (None: until the last one ended).
pub fn plan(
    samples: &[RequestSample],
    duration_s: Option<f64>,
    cost: &WorkerCost,
    cfg: &PlanConfig,
) -> Result<CapacityPlan, PlanError> {
    for (name, v) in [
        ("--window-s", cfg.window_s),
        ("--prefill-utilization", cfg.prefill_utilization),
        ("--decode-utilization", cfg.decode_utilization),
    ] {
        if v.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return Err(PlanError::NotPositive(name));
        }
    }
    if let Some(q) = cfg.decode_percentile.filter(|q| !(*q > 0.0 && *q < 1.0)) {
        return Err(PlanError::Percentile(q));
    }
    let firsts: Vec<&RequestSample> = samples.iter().filter(|r| r.attempt == 0).collect();
    if firsts.is_empty() {
        return Err(PlanError::Empty);
    }
    let last = samples.iter().map(|r| r.end_ms.unwrap_or(r.sent_ms).max(r.sent_ms)).fold(0.0, f64::max) / 1e3;
    let duration_s = duration_s.unwrap_or(last).max(last).max(1e-3);
    let mut windows = windows(&firsts, duration_s, cost, cfg);
    let window_s = cfg.window_s.min(duration_s);
    let mut warnings = Vec::new();
    let slo = |class: &str| cfg.slos.get(class).copied().unwrap_or(cfg.default_slo);

    // Decode batch at the traffic's mean context, under the tightest ITL SLO with traffic.
    let classes: Vec<String> = {
        let mut c: Vec<String> = firsts.iter().map(|r| r.class.clone()).collect();
        c.sort();
        c.dedup();
        c
    };
    let itl = classes.iter().map(|c| slo(c).itl_ms).fold(f64::INFINITY, f64::min);
    let n = firsts.len() as f64;
    let mean_in = firsts.iter().map(|r| r.input_tokens as f64).sum::<f64>() / n;
    let mean_out = firsts.iter().map(|r| output_of(r) as f64).sum::<f64>() / n;
    let batch = decode_batch(cost, mean_in, mean_out, itl, &mut warnings);
    let step_s = batch.step_ms / 1e3;
    let spans = decode_spans(&firsts, cost, cfg, step_s);
    for (i, w) in windows.iter_mut().enumerate() {
        let end = if i + 1 < count_of(duration_s, window_s) { w.start_s + window_s } else { duration_s };
        let (mean, at_q) = open_at(&spans, w.start_s, end, cfg.decode_percentile);
        w.decode_mean_sequences = mean;
        w.decode_sequences = match cfg.decode_percentile {
            Some(q) => at_q.max(poisson_quantile(mean, q)),
            None => mean,
        };
    }

    // Pools.
    let prefill = pool(
        &windows,
        window_s,
        cfg,
        |w| w.prefill_work,
        cfg.prefill_utilization,
        |peak, r| (peak / f64::from(r.max(1)), peak / f64::from(r.max(1)) >= 1.0),
    );
    let per_decode = batch.planned as f64 / step_s * cfg.decode_utilization;
    let seqs_per_token_s = step_s;
    // Without a percentile, the output rate itself (the sequences' mean times the rate each
    // yields); with one, the sequences at that percentile in tokens/s at the planned step.
    let decode_demand = |w: &Window| match cfg.decode_percentile {
        None => w.output_total_tok_s,
        Some(_) => w.decode_sequences / step_s,
    };
    let decode = pool(&windows, window_s, cfg, decode_demand, per_decode, |peak, r| {
        let per_replica = peak * seqs_per_token_s / f64::from(r.max(1));
        let over = per_replica / batch.kv_limit.max(1) as f64;
        (over, over > 1.0)
    });
    let peak_sequences = decode.peak * seqs_per_token_s;
    let blocks = f64::from(decode.replicas.max(1)) * f64::from(cost.worker.kv_blocks);
    let batch = DecodeBatch {
        peak_sequences,
        peak_kv_usage: peak_sequences * batch.blocks_per_sequence as f64 / blocks,
        ..batch
    };
    let rows = class_rows(samples, &firsts, &windows, cost, cfg, &batch, &slo, &mut warnings);
    let keda = keda(cost, cfg, &rows, &batch);
    Ok(CapacityPlan {
        cost_source: cost.source.clone(),
        window_s,
        scale_out_s: cfg.scale_out_s,
        decode_percentile: cfg.decode_percentile,
        windows,
        classes: rows,
        prefill,
        decode,
        batch,
        keda,
        warnings,
    })
}

/// How many windows `windows` makes of `duration_s` (a short last one folded in).
fn count_of(duration_s: f64, window_s: f64) -> usize {
    let count = ((duration_s / window_s).ceil() as usize).max(1);
    let last = duration_s - (count - 1) as f64 * window_s;
    if count > 1 && last < 0.1 * window_s {
        count - 1
    } else {
        count
    }
}

/// When each first sending holds a decode sequence, in seconds: from its first token (as
/// measured, else its sending plus its prompt's time on an idle prefill worker and the KV
/// commit) for its output tokens at `step_s` each.
fn decode_spans(firsts: &[&RequestSample], cost: &WorkerCost, cfg: &PlanConfig, step_s: f64) -> Vec<(f64, f64)> {
    firsts
        .iter()
        .map(|r| {
            let idle = (cost.prefill_planned_ms(uncached(r), &cfg.step) + cost.kv_commit_ms(r.input_tokens)) / 1e3;
            let start = r.token_ms.first().map_or(r.sent_ms / 1e3 + idle, |t| t / 1e3);
            (start, start + output_of(r) as f64 * step_s)
        })
        .collect()
}

/// Over [from, to): the mean number of `spans` open, and the number open at quantile `q` of
/// the time (the smallest count that is not exceeded for at least that share of it).
fn open_at(spans: &[(f64, f64)], from: f64, to: f64, q: Option<f64>) -> (f64, f64) {
    let length = to - from;
    if length <= 0.0 {
        return (0.0, 0.0);
    }
    let (mut open, mut events) = (0i64, Vec::new());
    for &(start, end) in spans {
        if end <= from || start >= to || end <= start {
            continue;
        }
        if start <= from {
            open += 1;
        } else {
            events.push((start, 1));
        }
        if end < to {
            events.push((end, -1));
        }
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut time_at: BTreeMap<i64, f64> = BTreeMap::new();
    let mut t = from;
    for (at, change) in events {
        *time_at.entry(open).or_default() += at - t;
        t = at;
        open += change;
    }
    *time_at.entry(open).or_default() += to - t;
    let mean = time_at.iter().map(|(n, d)| *n as f64 * d).sum::<f64>() / length;
    let Some(q) = q else { return (mean, mean) };
    let mut covered = 0.0;
    for (n, d) in &time_at {
        covered += d;
        if covered >= q * length - 1e-12 {
            return (mean, *n as f64);
        }
    }
    (mean, time_at.keys().last().copied().unwrap_or(0) as f64)
}

/// The `q` quantile of a Poisson count of mean `mean`, by the normal approximation
/// (mean + z sqrt(mean)).
fn poisson_quantile(mean: f64, q: f64) -> f64 {
    if mean <= 0.0 {
        return 0.0;
    }
    mean + normal_quantile(q) * mean.sqrt()
}

/// The standard normal's `q` quantile, by bisection on its distribution function (erf by
/// Abramowitz and Stegun 7.1.26, error below 1.5e-7).
fn normal_quantile(q: f64) -> f64 {
    let erf = |x: f64| {
        let t = 1.0 / (1.0 + 0.327_591_1 * x.abs());
        let poly =
            t * (0.254_829_592 + t * (-0.284_496_736 + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
        (1.0 - poly * (-x * x).exp()).copysign(x)
    };
    let cdf = |z: f64| 0.5 * (1.0 + erf(z / std::f64::consts::SQRT_2));
    let (mut lo, mut hi) = (-10.0, 10.0);
    for _ in 0..100 {
        let mid = 0.5 * (lo + hi);
        if cdf(mid) < q {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

fn decode_batch(cost: &WorkerCost, mean_in: f64, mean_out: f64, itl: f64, warnings: &mut Vec<String>) -> DecodeBatch {
    let mean_context = mean_in + mean_out / 2.0;
    let attended = cost.attended(mean_context.round() as usize);
    let step = |b: usize| cost.decode_step_ms(b, b * attended, &[]);
    let max = cost.worker.max_batch as usize;
    let itl_limit = (1..=max).take_while(|&b| step(b) <= itl).last().unwrap_or(0);
    let blocks_per_sequence = cost.blocks_for((mean_in + mean_out).ceil() as usize).max(1);
    let kv_limit = cost.worker.kv_blocks as usize / blocks_per_sequence;
    if itl_limit == 0 {
        warnings.push(format!("one decode row already takes {:.1} ms > the ITL SLO of {itl} ms", step(1)));
    }
    if kv_limit == 0 {
        warnings.push(format!("one sequence needs {blocks_per_sequence} KV blocks > {}", cost.worker.kv_blocks));
    }
    let planned = itl_limit.min(kv_limit).max(1);
    DecodeBatch {
        mean_context,
        blocks_per_sequence,
        itl_limit,
        kv_limit,
        planned,
        step_ms: step(planned),
        peak_sequences: 0.0,
        peak_kv_usage: 0.0,
    }
}

/// Sizes a pool: `demand` per window, `per_replica` capacity (same unit), `loss(peak,
/// replicas - 1)` the state after losing one.
fn pool(
    windows: &[Window],
    window_s: f64,
    cfg: &PlanConfig,
    demand: impl Fn(&Window) -> f64,
    per_replica: f64,
    loss: impl Fn(f64, u32) -> (f64, bool),
) -> Pool {
    let peak = windows.iter().map(&demand).fold(0.0, f64::max);
    let growth = steepest_rise(windows, window_s, &demand) * cfg.scale_out_s;
    let serving = (((peak + growth) / per_replica).ceil() as u32).max(1);
    let replicas = serving + cfg.spare;
    // Losing the only replica loses the pool.
    let (after_loss, cascade) = if replicas > 1 { loss(peak, replicas - 1) } else { (f64::INFINITY, true) };
    Pool { per_replica, peak, growth, serving, replicas, after_loss, cascade }
}

#[allow(clippy::too_many_arguments)]
fn class_rows(
    samples: &[RequestSample],
    firsts: &[&RequestSample],
    windows: &[Window],
    cost: &WorkerCost,
    cfg: &PlanConfig,
    batch: &DecodeBatch,
    slo: &dyn Fn(&str) -> Targets,
    warnings: &mut Vec<String>,
) -> Vec<ClassRow> {
    let mut names: Vec<&str> = firsts.iter().map(|r| r.class.as_str()).collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .map(|class| {
            let mine: Vec<&&RequestSample> = firsts.iter().filter(|r| r.class == class).collect();
            let served: Vec<&&RequestSample> = mine.iter().copied().filter(|r| r.ok()).collect();
            let input = Dist::of(&mine.iter().map(|r| r.input_tokens as f64).collect::<Vec<_>>());
            let output = Dist::of(&mine.iter().map(|r| output_of(r) as f64).collect::<Vec<_>>());
            let target = slo(class);
            let p95_in = input.p95.unwrap_or(0.0) as usize;
            let idle_ttft = cost.prefill_planned_ms(p95_in, &cfg.step) + cost.kv_commit_ms(p95_in);
            if idle_ttft > target.ttft_ms {
                warnings.push(format!(
                    "{class}: its p95 prompt ({p95_in} tokens) takes {idle_ttft:.0} ms on an idle prefill worker, over its TTFT SLO of {} ms",
                    target.ttft_ms
                ));
            }
            let ttft = served.iter().filter_map(|r| r.ttft_ms());
            let gaps = served.iter().flat_map(|r| r.gaps_ms().collect::<Vec<_>>());
            let peak_out = windows.iter().map(|w| w.output_tok_s.get(class).copied().unwrap_or(0.0)).fold(0.0, f64::max);
            let seq_blocks = cost.blocks_for((input.mean + output.mean).ceil() as usize) as f64;
            ClassRow {
                class: class.to_string(),
                requests: mine.len(),
                retries: samples.iter().filter(|r| r.class == class && r.attempt > 0).count(),
                refused: mine.iter().filter(|r| r.rejected()).count(),
                input_tokens: input,
                output_tokens: output,
                target,
                ttft_p95_ms: Summary::of(ttft).p95,
                itl_p95_ms: Summary::of(gaps).p95,
                idle_ttft_p95_ms: idle_ttft,
                peak_input_tok_s: windows.iter().map(|w| w.input_tok_s.get(class).copied().unwrap_or(0.0)).fold(0.0, f64::max),
                peak_output_tok_s: peak_out,
                peak_kv_blocks: peak_out * batch.step_ms / 1e3 * seq_blocks,
            }
        })
        .collect()
}

fn keda(cost: &WorkerCost, cfg: &PlanConfig, rows: &[ClassRow], batch: &DecodeBatch) -> Keda {
    // The tightest class with traffic: its queue may use half of its TTFT budget left after
    // its own prompt's compute.
    let tight = rows.iter().min_by(|a, b| a.target.ttft_ms.total_cmp(&b.target.ttft_ms));
    let (budget_ms, mean_in) = tight
        .map(|r| (((r.target.ttft_ms - r.idle_ttft_p95_ms) / 2.0).max(0.0), r.input_tokens.mean.max(1.0)))
        .unwrap_or((0.0, 1.0));
    let tok_per_ms = mean_in / cost.prefill_planned_ms(mean_in as usize, &cfg.step).max(1e-9);
    Keda {
        prefill_waiting_tokens: ((budget_ms * tok_per_ms) as u64).max(cfg.step.max_chunk as u64),
        prefill_queue_age_s: budget_ms / 1e3,
        decode_running_sequences: ((batch.planned as f64 * cfg.decode_utilization).floor() as u64).max(1),
        decode_kv_usage: (batch.planned as f64 * batch.blocks_per_sequence as f64 / f64::from(cost.worker.kv_blocks)
            * cfg.decode_utilization)
            .min(0.9),
    }
}

#[cfg(test)]
mod tests;
