//! A worker's timing as a function of its work: the one thing a simulated worker knows about
//! hardware and model, and what a capacity plan divides traffic by. Two sources:
//! - fitted from measurements of a real worker pair (`pd-bench profile`, `fit`);
//! - a roofline from a hardware and a model description (`roofline`), with its assumptions
//!   stated in `source`.
//!
//! Prefill steps use the real prefill worker's cost model (fixed + per token + per token x
//! context pair), so a simulated prefill worker plans its steps with the real planner. A decode
//! step costs fixed (the weights read once) + per row + per token of context read by attention,
//! plus the prefill cost of any prompt chunk riding in the step (colocated serving).

use serde::{Deserialize, Serialize};

/// Everything a simulated worker and a capacity plan need to know about one worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerCost {
    /// Where the numbers come from: the machine and command, or the roofline's assumptions.
    pub source: String,
    pub prefill: PrefillCost,
    pub decode: DecodeCost,
    pub kv: KvCost,
    pub worker: WorkerShape,
    /// A forward over more rows than `rows` costs `extra_ms` more (on the CPU engine the
    /// small-batch kernel ends at 16 rows; wider forwards convert the f16 weights first).
    #[serde(default)]
    pub wide: Option<WideForward>,
    /// Sliding-window layers (Mistral, Gemma 2 and 3, Phi-3 where set), whose attention
    /// stops growing with the context at the window.
    #[serde(default)]
    pub window: Option<AttentionWindow>,
}

/// Layers whose attention sees only the last `tokens` keys: on them, `share` of the
/// attention cost (prefill `per_pair_us`, decode `per_context_us`) is paid for at most
/// `tokens` keys per query. KV memory (`kv.bytes_per_token`, `worker.kv_blocks`) is not
/// reduced: pd keeps every layer's KV for every position.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AttentionWindow {
    pub tokens: u32,
    /// Fraction of the layers (of the attention cost) that slide.
    pub share: f64,
}

impl AttentionWindow {
    /// Key-query pairs of a chunk of `t` queries after `ctx` keys, each query seeing every
    /// earlier key (`full`), and with the window (`windowed`): the cost model's
    /// `t * (ctx + t/2)`, with the part beyond the window cut off.
    pub(crate) fn pairs(self, t: f64, ctx: f64) -> (f64, f64) {
        let w = f64::from(self.tokens);
        let full = t * (ctx + t / 2.0);
        let windowed = if ctx + t <= w {
            full
        } else if ctx >= w {
            t * w
        } else {
            let below = w - ctx;
            below * (ctx + below / 2.0) + (t - below) * w
        };
        (full, windowed)
    }
}

/// The step-cost jump of forwards wider than `rows` rows.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WideForward {
    pub rows: usize,
    pub extra_ms: f64,
}

/// Prefill step time: `fixed_ms + per_token_ms * t + per_pair_us * t * (ctx + t/2) / 1000`
/// per chunk of `t` tokens after `ctx` computed ones, plus `per_prompt_ms` for each prompt
/// whose first chunk runs in the step (its setup).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrefillCost {
    pub fixed_ms: f64,
    pub per_token_ms: f64,
    pub per_pair_us: f64,
    #[serde(default)]
    pub per_prompt_ms: f64,
}

/// Decode step time: `fixed_ms + per_row_ms * rows + per_context_us * (sum of the rows'
/// contexts) / 1000`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DecodeCost {
    pub fixed_ms: f64,
    pub per_row_ms: f64,
    pub per_context_us: f64,
}

/// The KV hand-off: bytes per prompt token, and the time from the prefill's last logits to
/// the receiver's commit (`commit_fixed_ms + commit_ms_per_mb * MB shipped`; layers before
/// the last were shipped while the prompt was computed).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct KvCost {
    pub bytes_per_token: u64,
    pub commit_fixed_ms: f64,
    pub commit_ms_per_mb: f64,
}

/// A decode worker's limits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WorkerShape {
    pub block_size: u32,
    pub kv_blocks: u32,
    pub max_batch: u32,
    /// Context length of the model (prompt + output).
    pub max_position: u32,
}

/// A cost file that cannot be used, naming what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum CostError {
    #[error("cannot read the cost model {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("the cost model {path} is not valid: {source}")]
    Parse { path: String, source: serde_json::Error },
    #[error("the cost model's {field} must be {rule} (it is {value})")]
    Field { field: &'static str, rule: &'static str, value: f64 },
}

impl WorkerCost {
    /// Reads and checks a cost file (JSON).
    pub fn load(path: &str) -> Result<Self, CostError> {
        let text = std::fs::read_to_string(path).map_err(|source| CostError::Read { path: path.into(), source })?;
        let cost: WorkerCost =
            serde_json::from_str(&text).map_err(|source| CostError::Parse { path: path.into(), source })?;
        cost.validate()?;
        Ok(cost)
    }

    /// Every time is finite and non-negative, every limit positive.
    pub fn validate(&self) -> Result<(), CostError> {
        let times = [
            ("prefill.fixed_ms", self.prefill.fixed_ms),
            ("prefill.per_token_ms", self.prefill.per_token_ms),
            ("prefill.per_pair_us", self.prefill.per_pair_us),
            ("prefill.per_prompt_ms", self.prefill.per_prompt_ms),
            ("decode.fixed_ms", self.decode.fixed_ms),
            ("decode.per_row_ms", self.decode.per_row_ms),
            ("decode.per_context_us", self.decode.per_context_us),
            ("kv.commit_fixed_ms", self.kv.commit_fixed_ms),
            ("kv.commit_ms_per_mb", self.kv.commit_ms_per_mb),
        ];
        for (field, value) in times {
            if !value.is_finite() || value < 0.0 {
                return Err(CostError::Field { field, rule: "a finite number >= 0", value });
            }
        }
        let limits = [
            ("worker.block_size", self.worker.block_size),
            ("worker.kv_blocks", self.worker.kv_blocks),
            ("worker.max_batch", self.worker.max_batch),
            ("worker.max_position", self.worker.max_position),
        ];
        for (field, value) in limits {
            if value == 0 {
                return Err(CostError::Field { field, rule: "at least 1", value: 0.0 });
            }
        }
        if let Some(w) = self.window {
            if w.tokens == 0 {
                return Err(CostError::Field { field: "window.tokens", rule: "at least 1", value: 0.0 });
            }
            if !(0.0..=1.0).contains(&w.share) {
                return Err(CostError::Field { field: "window.share", rule: "between 0 and 1", value: w.share });
            }
        }
        Ok(())
    }

    /// The real prefill worker's cost model with these numbers (scale 1).
    pub fn prefill_model(&self) -> pd_prefill::step::CostModel {
        pd_prefill::step::CostModel {
            fixed_ms: self.prefill.fixed_ms,
            per_token_ms: self.prefill.per_token_ms,
            per_pair_us: self.prefill.per_pair_us,
            scale: 1.0,
        }
    }

    /// What a forward over `rows` rows adds for being wide.
    fn wide_ms(&self, rows: usize) -> f64 {
        self.wide.filter(|w| rows > w.rows).map(|w| w.extra_ms).unwrap_or(0.0)
    }

    /// Time of one prefill step over `chunks` (tokens, context before them; context 0 is a
    /// prompt's first chunk). The real planner plans with `prefill_model`, which knows no
    /// window: it overestimates the steps of a windowed model's long prompts.
    pub fn prefill_step_ms(&self, chunks: &[(usize, usize)]) -> f64 {
        let rows = chunks.iter().map(|c| c.0).sum();
        let first = chunks.iter().filter(|c| c.1 == 0).count() as f64;
        self.prefill_model().predict(chunks).as_secs_f64() * 1e3
            + self.wide_ms(rows)
            + first * self.prefill.per_prompt_ms
            - chunks.iter().map(|&(t, ctx)| self.pairs_beyond_window_ms(t, ctx)).sum::<f64>()
    }

    /// What the window saves on a chunk of `t` tokens after `ctx` (0 without a window).
    fn pairs_beyond_window_ms(&self, t: usize, ctx: usize) -> f64 {
        self.window.map_or(0.0, |w| {
            let (full, windowed) = w.pairs(t as f64, ctx as f64);
            w.share * (full - windowed) * self.prefill.per_pair_us / 1e3
        })
    }

    /// The context a decode row at `context` tokens costs (`decode_step_ms` takes the sum
    /// over rows): all of it, less what sliding-window layers do not read.
    pub fn attended(&self, context: usize) -> usize {
        match self.window {
            Some(w) if context > w.tokens as usize => {
                let beyond = (context - w.tokens as usize) as f64;
                (context as f64 - w.share * beyond).round() as usize
            }
            _ => context,
        }
    }

    /// Time of one decode step: `rows` generating rows over `context` tokens in all (each
    /// row's `attended` context), plus prompt `chunks` (tokens, context before them) computed
    /// in the same step.
    pub fn decode_step_ms(&self, rows: usize, context: usize, chunks: &[(usize, usize)]) -> f64 {
        let d = &self.decode;
        let width = rows + chunks.iter().map(|c| c.0).sum::<usize>();
        let mut ms =
            d.fixed_ms + d.per_row_ms * rows as f64 + d.per_context_us * context as f64 / 1e3 + self.wide_ms(width);
        for &(t, ctx) in chunks {
            let pairs = t as f64 * (ctx as f64 + t as f64 / 2.0);
            ms += self.prefill.per_token_ms * t as f64 + self.prefill.per_pair_us * pairs / 1e3
                - self.pairs_beyond_window_ms(t, ctx);
            if ctx == 0 {
                ms += self.prefill.per_prompt_ms;
            }
        }
        ms
    }

    /// Time of a whole prompt of `tokens` prefilled alone in chunks of at most `chunk`.
    pub fn prefill_alone_ms(&self, tokens: usize, chunk: usize) -> f64 {
        let (mut done, mut ms) = (0, 0.0);
        while done < tokens {
            let t = (tokens - done).min(chunk.max(1));
            ms += self.prefill_step_ms(&[(t, done)]);
            done += t;
        }
        ms
    }

    /// Time of a whole prompt of `tokens` prefilled alone by a worker planning its steps with
    /// `step` (the real planner, planning with this model): what a prompt costs in service,
    /// where a step target smaller than a whole chunk makes more, smaller steps.
    pub fn prefill_planned_ms(&self, tokens: usize, step: &pd_prefill::step::StepConfig) -> f64 {
        let mut done = 0;
        let mut ms = 0.0;
        for t in pd_prefill::step::lone_chunks(tokens, step, &self.prefill_model()) {
            ms += self.prefill_step_ms(&[(t, done)]);
            done += t;
        }
        ms
    }

    /// From the prefill's last logits to the commit, for `tokens` shipped.
    pub fn kv_commit_ms(&self, tokens: usize) -> f64 {
        let mb = (tokens as u64 * self.kv.bytes_per_token) as f64 / 1e6;
        self.kv.commit_fixed_ms + self.kv.commit_ms_per_mb * mb
    }

    /// KV blocks a sequence of `tokens` holds.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.worker.block_size.max(1) as usize)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample() -> WorkerCost {
        WorkerCost {
            source: "test".into(),
            prefill: PrefillCost { fixed_ms: 20.0, per_token_ms: 2.0, per_pair_us: 1.0, per_prompt_ms: 0.0 },
            decode: DecodeCost { fixed_ms: 10.0, per_row_ms: 0.5, per_context_us: 2.0 },
            kv: KvCost { bytes_per_token: 1_000_000, commit_fixed_ms: 1.0, commit_ms_per_mb: 0.5 },
            worker: WorkerShape { block_size: 16, kv_blocks: 100, max_batch: 8, max_position: 2048 },
            wide: None,
            window: None,
        }
    }

    #[test]
    fn decode_step_adds_rows_context_and_prompt_chunks() {
        let c = sample();
        // 10 + 4 * 0.5 + 2 * 1000 / 1000 = 14 ms.
        assert!((c.decode_step_ms(4, 1000, &[]) - 14.0).abs() < 1e-9);
        // A 100-token chunk at context 0: 2 * 100 + 1 * 100 * 50 / 1000 = 205 ms more.
        assert!((c.decode_step_ms(4, 1000, &[(100, 0)]) - 219.0).abs() < 1e-9);
    }

    #[test]
    fn a_chunked_prompt_costs_its_pairs_once_and_a_fixed_part_per_chunk() {
        let c = sample();
        // Two chunks of 100: 2 * 20 + 2 * 200 + 1 * 200 * 200 / 2 / 1000 = 460 ms.
        assert!((c.prefill_alone_ms(200, 100) - 460.0).abs() < 1e-6);
        assert!((c.kv_commit_ms(3) - 2.5).abs() < 1e-9);
        // Wider than 16 rows: 50 ms more per step, in prefill and in decode (rows + chunks).
        let w = WorkerCost { wide: Some(WideForward { rows: 16, extra_ms: 50.0 }), ..c.clone() };
        assert!((w.prefill_alone_ms(200, 100) - 560.0).abs() < 1e-6);
        assert!((w.prefill_step_ms(&[(16, 0)]) - c.prefill_step_ms(&[(16, 0)])).abs() < 1e-9);
        assert!((w.decode_step_ms(4, 1000, &[(13, 0)]) - c.decode_step_ms(4, 1000, &[(13, 0)]) - 50.0).abs() < 1e-9);
        // A prompt's setup is paid once, in the step of its first chunk.
        let p = WorkerCost { prefill: PrefillCost { per_prompt_ms: 7.0, ..c.prefill }, ..c.clone() };
        assert!((p.prefill_alone_ms(200, 100) - c.prefill_alone_ms(200, 100) - 7.0).abs() < 1e-9);
        assert_eq!(c.blocks_for(17), 2);
    }

    #[test]
    fn bad_fields_are_named() {
        let mut c = sample();
        c.decode.per_row_ms = -1.0;
        let e = c.validate().expect_err("negative").to_string();
        assert!(e.contains("decode.per_row_ms"), "{e}");
        let mut c = sample();
        c.worker.kv_blocks = 0;
        assert!(c.validate().expect_err("zero").to_string().contains("worker.kv_blocks"));
        let json = serde_json::to_string(&sample()).expect("json");
        assert_eq!(serde_json::from_str::<WorkerCost>(&json).expect("back"), sample());
    }
}
