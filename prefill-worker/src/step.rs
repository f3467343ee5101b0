//! What one prefill step runs (request-parallel prefill): chunks of up to `max_prompts`
//! prompts in one forward, at most `max_long` of them long, within a token budget that keeps
//! the step near `target` by a cost model of tokens x context (short prompts always get up
//! to `short_chunk` tokens, so one arriving during a document is prefilled in about one
//! step; the budget bounds the document's share). Prompts are ranked short before long, each
//! shortest remaining first, except that one waiting longer than `max_wait` since its last
//! chunk goes first, so a short prompt that arrives during a document is prefilled in the next step
//! beside the document's chunk, and the document still advances every step. While short
//! prompts are about (one arrived in the last `short_window`) the step target drops to
//! `short_target`: a short prompt then waits for a shorter document step, and its own step
//! carries no document chunk the budget cannot afford.
//!
//! Plain functions over plain data; the loop that runs them is `steps`.

use std::time::Duration;

pub mod args;
pub use args::StepArgs;

/// The step policy (prefill worker flags).
#[derive(Debug, Clone, Copy)]
pub struct StepConfig {
    /// Most prompts in one step (vLLM's max_num_partial_prefills).
    pub max_prompts: usize,
    /// Most long prompts in one step (max_long_partial_prefills).
    pub max_long: usize,
    /// A prompt with more tokens than this is long.
    pub long_threshold: usize,
    /// Predicted step time to stay under.
    pub target: Duration,
    /// The first-ranked prompt gets at least this many tokens (progress under any budget).
    pub min_chunk: usize,
    /// A prompt that is not long gets at least this many tokens per step whatever the budget
    /// (an interactive prompt is prefilled in one or two steps; the budget bounds how much of
    /// a long prompt rides along).
    pub short_chunk: usize,
    /// Largest chunk of one prompt in one step.
    pub max_chunk: usize,
    /// A prompt that has waited this long since its last chunk goes first.
    pub max_wait: Duration,
    /// Step target while short prompts are about (one arrived within `short_window`): steps
    /// of long prompts shrink so that a short prompt arriving mid-step waits less, and a long
    /// prompt's chunk no longer rides along in a step carrying short prompts.
    pub short_target: Duration,
    /// How long after a short prompt's arrival `short_target` holds (zero: never).
    pub short_window: Duration,
    /// Stop a step of long prompts between layers when a short prompt arrives (`steps`).
    pub preempt: bool,
}

impl StepConfig {
    /// One prompt at a time in chunks of `chunk` tokens (benchmarks, tests).
    pub fn single(chunk: usize) -> Self {
        StepConfig {
            max_prompts: 1,
            max_long: 1,
            long_threshold: usize::MAX,
            target: Duration::from_secs(3600),
            min_chunk: chunk.max(1),
            short_chunk: 0,
            max_chunk: chunk.max(1),
            max_wait: Duration::from_secs(3600),
            short_target: Duration::from_secs(3600),
            short_window: Duration::ZERO,
            preempt: false,
        }
    }

    /// Whether a prompt of `len` tokens counts as short (not long).
    pub fn is_short(&self, len: usize) -> bool {
        len <= self.long_threshold
    }

    /// Whether a step of `chunks` ((prompt length, tokens in this step, tokens before it)
    /// each) may be stopped between layers when a short prompt arrives (`preempt`): only long
    /// prompts' chunks, none finishing its prompt (no layer of it is being shipped).
    pub fn preemptible(&self, chunks: impl IntoIterator<Item = (usize, usize, usize)>) -> bool {
        self.preempt && chunks.into_iter().all(|(len, take, done)| !self.is_short(len) && done + take < len)
    }

    /// The policy for the next step, given how long ago the last short prompt arrived.
    pub fn for_step(&self, since_short: Option<Duration>) -> StepConfig {
        match since_short {
            Some(age) if age < self.short_window => StepConfig { target: self.target.min(self.short_target), ..*self },
            _ => *self,
        }
    }
}

/// A preemptible step stops after layer `layer` (0-based) of `layers` only while at least a
/// quarter of the layers are left: past that, finishing costs the short prompt less than
/// running the chunks again costs the others.
pub fn stops_after_layer(layer: usize, layers: usize) -> bool {
    4 * layers.saturating_sub(layer) >= layers
}

/// The same rule in time, for a step that has no layers to count (pd-sim's cost model): a
/// short prompt arriving within this share of the step stops it.
pub const STOPPABLE_SHARE: f64 = 0.75;

/// Step time as a function of its chunks: fixed + per token + per (token x context) pair,
/// all times a scale learned from measured steps (so the same model serves another CPU).
#[derive(Debug, Clone, Copy)]
pub struct CostModel {
    pub fixed_ms: f64,
    pub per_token_ms: f64,
    /// Attention: per new token per token of context it attends over.
    pub per_pair_us: f64,
    /// Measured / predicted, smoothed.
    pub scale: f64,
}

impl Default for CostModel {
    /// Fitted on the 2-core development VM (SmolLM2-135M f16, one thread): a step reads every
    /// weight once (~20 ms), ~3.6 ms per prompt token, and attention adds ~2.3 us per token
    /// per token of context (pp128 269 tok/s, pp2048 167 tok/s).
    fn default() -> Self {
        CostModel { fixed_ms: 20.0, per_token_ms: 3.6, per_pair_us: 2.3, scale: 1.0 }
    }
}

impl CostModel {
    /// Predicted time of a step with `chunks` of (tokens, context before them).
    pub fn predict(&self, chunks: &[(usize, usize)]) -> Duration {
        let mut ms = self.fixed_ms;
        for &(t, ctx) in chunks {
            ms += self.chunk_ms(t, ctx);
        }
        self.scaled(ms)
    }

    /// What one chunk of `t` tokens after `ctx` adds to a step, in ms at scale 1.
    fn chunk_ms(&self, t: usize, ctx: usize) -> f64 {
        let pairs = t as f64 * (ctx as f64 + t as f64 / 2.0);
        self.per_token_ms * t as f64 + self.per_pair_us * pairs / 1e3
    }

    /// `ms` at scale 1 as the predicted duration.
    fn scaled(&self, ms: f64) -> Duration {
        Duration::from_secs_f64(ms * self.scale.max(0.05) / 1e3)
    }

    /// Learns from a step that was predicted `predicted` (at scale 1) and took `took`.
    pub fn observe(&mut self, chunks: &[(usize, usize)], took: Duration) {
        let base = CostModel { scale: 1.0, ..*self }.predict(chunks).as_secs_f64();
        if base > 0.0 {
            let ratio = (took.as_secs_f64() / base).clamp(0.05, 20.0);
            self.scale = 0.8 * self.scale + 0.2 * ratio;
        }
    }

    /// Most tokens a chunk at `ctx` can take while the step stays under `left`: a binary
    /// search over the prediction, first narrowed around the root of the model's quadratic
    /// (which only saves steps: the search's answer is the same).
    fn tokens_within(&self, ctx: usize, left: Duration, max: usize) -> usize {
        let base = self.scaled(self.fixed_ms);
        let fits = |t: usize| self.scaled(self.fixed_ms + self.chunk_ms(t, ctx)).saturating_sub(base) <= left;
        let (mut lo, mut hi) = (0usize, max);
        if let Some(guess) = self.root(ctx, left) {
            let guess = guess.min(max as f64) as usize;
            let (below, above) = (guess.saturating_sub(1), guess + 2);
            if fits(below) {
                lo = below;
            }
            if above <= hi && !fits(above) {
                hi = above - 1;
            }
        }
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    /// Where a chunk at `ctx` costs exactly `left`, in tokens (unrounded); None where the
    /// prediction may not grow with the tokens (a negative coefficient), so that narrowing
    /// around it could change the search's answer.
    fn root(&self, ctx: usize, left: Duration) -> Option<f64> {
        if !(self.per_token_ms >= 0.0 && self.per_pair_us >= 0.0) {
            return None;
        }
        let budget = left.as_secs_f64() * 1e3 / self.scale.max(0.05);
        let (a, b) = (self.per_pair_us / 2e3, self.per_token_ms + self.per_pair_us * ctx as f64 / 1e3);
        let t = if a > 0.0 {
            (-b + (b * b + 4.0 * a * budget).sqrt()) / (2.0 * a)
        } else if b > 0.0 {
            budget / b
        } else {
            return None;
        };
        t.is_finite().then_some(t.max(0.0))
    }
}

/// A prompt that can run in the next step.
#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    /// Tokens still to prefill.
    pub remaining: usize,
    /// Tokens already computed (the context of its next chunk).
    pub done: usize,
    /// Whole prompt length.
    pub len: usize,
    /// Since its last chunk (or arrival).
    pub waited: Duration,
}

/// The next step: (candidate index, tokens), ranked; empty when there is nothing to run.
pub fn plan(cands: &[Candidate], cfg: &StepConfig, cost: &CostModel) -> Vec<(usize, usize)> {
    let mut order: Vec<usize> = (0..cands.len()).collect();
    order.sort_by_key(|&i| {
        let c = &cands[i];
        let starved = c.waited >= cfg.max_wait;
        // Starved first (longest waiting first), then short prompts before long ones (a
        // document's last few tokens must not put its step ahead of a short prompt), each
        // shortest remaining first.
        let long = c.len > cfg.long_threshold;
        (!starved, if starved { Duration::MAX - c.waited } else { Duration::ZERO }, long, c.remaining)
    });
    let mut out: Vec<(usize, usize)> = Vec::new();
    // The step's predicted time so far, in ms at scale 1, summed as `predict` sums it.
    let mut step_ms = cost.fixed_ms;
    let mut long = 0;
    for i in order {
        let c = &cands[i];
        if out.len() >= cfg.max_prompts.max(1) {
            break;
        }
        let is_long = c.len > cfg.long_threshold;
        if is_long && long >= cfg.max_long.max(1) {
            continue;
        }
        let left = cfg.target.saturating_sub(cost.scaled(step_ms));
        let max = c.remaining.min(cfg.max_chunk.max(1));
        let mut tokens = cost.tokens_within(c.done, left, max);
        if out.is_empty() {
            tokens = tokens.max(cfg.min_chunk.min(max));
        }
        if !is_long {
            tokens = tokens.max(cfg.short_chunk.min(max));
        }
        if tokens == 0 {
            break;
        }
        long += usize::from(is_long);
        step_ms += cost.chunk_ms(tokens, c.done);
        out.push((i, tokens));
    }
    out
}

/// The chunks (tokens per step) the planner makes of a prompt of `tokens` alone on a worker
/// planning with `cost`: what a prompt costs in service, counted step by step.
pub fn lone_chunks(tokens: usize, cfg: &StepConfig, cost: &CostModel) -> Vec<usize> {
    let mut chunks = Vec::new();
    let mut done = 0;
    while done < tokens {
        let c = Candidate { remaining: tokens - done, done, len: tokens, waited: Duration::ZERO };
        let t = plan(&[c], cfg, cost).first().map(|&(_, t)| t).unwrap_or(tokens - done).clamp(1, tokens - done);
        chunks.push(t);
        done += t;
    }
    chunks
}

#[cfg(test)]
mod tests;
