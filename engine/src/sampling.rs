//! Choosing the next token and deciding when a sequence is done.
//!
//! Before sampling, the logits may be processed (vLLM's order): end tokens masked until
//! `min_tokens`, `logit_bias` added, then the repetition, frequency and presence penalties,
//! from the sequence's own history (prompt and output). Sampling itself is
//! candle-transformers' `LogitsProcessor` (greedy, temperature, top-k, top-p). Log
//! probabilities, when asked, are those of the model's raw distribution (vLLM's default):
//! what the model thinks, not what the processing made of it.
//!
//! Sampling randomness for the output token at index i comes from a generator seeded by
//! the request's seed and i alone, not by the tokens drawn before: the same seed gives the
//! same tokens, and a generation continued in another process (after the first token from a
//! prefill worker, or after a decode worker was lost and the request migrated) draws exactly
//! what the original process would have. `OutputTracker` turns tokens into
//! streamed text and applies stop token ids, stop strings and max tokens; text that might be
//! the start of a stop string is held back until it is known not to be one.

use std::collections::{HashMap, HashSet};

use candle_core::Tensor;
use candle_transformers::generation::{LogitsProcessor, Sampling};

use crate::constraint::{ConstraintState, Grammars, OutputConstraint};
use crate::error::{EngineError, Result};
use crate::tokenizer::Tokenizer;

/// How one request samples and when it stops.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub seed: u64,
    pub max_tokens: usize,
    /// Extra ids that end the sequence (the tokenizer's EOS ids always do, unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Texts that end the sequence; the returned text stops before them.
    pub stop_strings: Vec<String>,
    pub ignore_eos: bool,
    /// Index of this request's first generated token within the whole output (0; a migrated
    /// request continues after the tokens already sent). Seeds the sampling of each token.
    pub output_offset: usize,
    /// vLLM's (and Hugging Face's) repetition penalty: above 1, every token already in the
    /// prompt or the output has a positive logit divided by it and a negative one multiplied;
    /// 1 is off.
    pub repetition_penalty: f32,
    /// OpenAI's: subtracted from a token's logit once for each time it was generated.
    pub frequency_penalty: f32,
    /// OpenAI's: subtracted once from the logit of every token generated at least once.
    pub presence_penalty: f32,
    /// Added to the logits of these token ids (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// End-of-sequence and stop token ids cannot be sampled before this many output tokens.
    pub min_tokens: usize,
    /// Log probabilities of each sampled token: None, or Some(k) for the sampled token's and
    /// those of the k most likely tokens (k at most `MAX_TOP_LOGPROBS`).
    pub logprobs: Option<usize>,
    /// What the output must match (structured output), applied to every output token.
    pub constraint: Option<OutputConstraint>,
}

/// Most alternatives per token `logprobs` may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams {
            output_offset: 0,
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
            max_tokens,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            logprobs: None,
            constraint: None,
        }
    }

    /// The parameters of answer `index` of several sampled from one prompt (`n`): the same,
    /// with answer 0's seed unchanged and answer i's seed `seed + i * 0x9E37_79B9_7F4A_7C15`
    /// (wrapping), so each answer draws its own stream and all of them replay from one seed.
    pub fn for_choice(&self, index: usize) -> SamplingParams {
        let mut p = self.clone();
        p.seed = self.seed.wrapping_add((index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        p
    }

    /// True when the logits are changed before sampling.
    fn processes_logits(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || !self.logit_bias.is_empty()
            || self.min_tokens > 0
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(EngineError::InvalidSampling(m));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!("temperature {} must be >= 0", self.temperature));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return bad(format!("top_p {p} must be in (0, 1]"));
            }
        }
        if self.top_k == Some(0) {
            return bad("top_k must be at least 1".into());
        }
        if self.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        if self.stop_strings.iter().any(String::is_empty) {
            return bad("stop strings must not be empty".into());
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0 && self.repetition_penalty <= 2.0) {
            return bad(format!("repetition_penalty {} must be in (0, 2]", self.repetition_penalty));
        }
        for (name, value) in
            [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)]
        {
            if !(-2.0..=2.0).contains(&value) {
                return bad(format!("{name} {value} must be between -2 and 2"));
            }
        }
        if let Some((id, b)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return bad(format!("logit_bias of token {id} is {b}; it must be between -100 and 100"));
        }
        // Both count the whole output (a migrated request's tokens already sent included).
        if self.min_tokens > self.output_offset + self.max_tokens {
            return bad(format!("min_tokens {} exceeds max_tokens {}", self.min_tokens, self.max_tokens));
        }
        if self.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
            return bad(format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}"));
        }
        Ok(())
    }

    fn sampling(&self) -> Sampling {
        let temperature = self.temperature;
        if temperature == 0.0 {
            return Sampling::ArgMax;
        }
        match (self.top_k, self.top_p) {
            (None, None) => Sampling::All { temperature },
            (Some(k), None) => Sampling::TopK { k, temperature },
            (None, Some(p)) => Sampling::TopP { p, temperature },
            (Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature },
        }
    }
}

/// Per-sequence sampler state: the sampling rule, the seed, the output index of the next
/// token, and what the logit processing needs of the sequence's history.
pub struct Sampler {
    sampling: Sampling,
    seed: u64,
    next_index: u64,
    /// None when the logits are sampled as the model gave them.
    processing: Option<Processing>,
    /// Alternatives per token to report (None: no log probabilities).
    logprobs: Option<usize>,
    /// The structured-output matcher, when the output is constrained.
    constraint: Option<ConstraintState>,
    /// Ids that end the sequence: stop token ids, and end-of-sequence unless `ignore_eos`.
    end_ids: Vec<u32>,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sampler")
    }
}

/// Penalties, biases and the `min_tokens` mask, with the history they read.
struct Processing {
    repetition: f32,
    frequency: f32,
    presence: f32,
    bias: Vec<(u32, f32)>,
    min_tokens: u64,
    /// Every token of the prompt and the output (the repetition penalty's set).
    seen: HashSet<u32>,
    /// Output tokens (those sent before a migration included) and how often each came.
    counts: HashMap<u32, u32>,
}

impl Processing {
    fn record(&mut self, token: u32) {
        self.seen.insert(token);
        *self.counts.entry(token).or_default() += 1;
    }

    /// Processes `logits` for the output token at `index` (`end_ids` masked before
    /// `min_tokens`).
    fn apply(&self, logits: &mut [f32], index: u64, end_ids: &[u32]) {
        if index < self.min_tokens {
            for &id in end_ids {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        for &(id, bias) in &self.bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        if self.repetition != 1.0 {
            for &id in &self.seen {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = if *l > 0.0 { *l / self.repetition } else { *l * self.repetition };
                }
            }
        }
        if self.frequency != 0.0 || self.presence != 0.0 {
            for (&id, &count) in &self.counts {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l -= self.frequency * count as f32 + self.presence;
                }
            }
        }
    }
}

/// One sampled token, with its log probabilities when they were asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
}

/// Log probabilities of a sampled token and of the most likely tokens at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The most likely tokens, most likely first.
    pub top: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler with no history (the logit processing sees an empty prompt and no end ids);
    /// a constrained output needs the tokenizer (`for_sequence`).
    pub fn new(params: &SamplingParams) -> Result<Self> {
        if params.constraint.is_some() {
            return Err(EngineError::InvalidSampling("a constrained output needs the tokenizer".into()));
        }
        Self::with_end_ids(params, &[], &[], None)
    }

    /// A sampler for a sequence whose context so far is `context` (the prompt; for a migrated
    /// request its last `output_offset` tokens are output already sent, and a constraint
    /// replays them), ending at `tokenizer`'s end-of-sequence ids besides `stop_token_ids`.
    pub fn for_sequence(params: &SamplingParams, context: &[u32], tokenizer: &Tokenizer) -> Result<Self> {
        let grammars = match params.constraint {
            Some(_) => Some(tokenizer.grammars()?),
            None => None,
        };
        Self::with_end_ids(params, context, tokenizer.eos_ids(), grammars)
    }

    fn with_end_ids(
        params: &SamplingParams,
        context: &[u32],
        eos_ids: &[u32],
        grammars: Option<&Grammars>,
    ) -> Result<Self> {
        params.validate()?;
        let outputs = &context[context.len().saturating_sub(params.output_offset)..];
        let mut end_ids: Vec<u32> = params.stop_token_ids.clone();
        if !params.ignore_eos {
            end_ids.extend_from_slice(eos_ids);
        }
        let processing = params.processes_logits().then(|| {
            let mut counts = HashMap::new();
            for &t in outputs {
                *counts.entry(t).or_default() += 1;
            }
            Processing {
                repetition: params.repetition_penalty,
                frequency: params.frequency_penalty,
                presence: params.presence_penalty,
                bias: params.logit_bias.clone(),
                min_tokens: params.min_tokens as u64,
                seen: if params.repetition_penalty != 1.0 { context.iter().copied().collect() } else { HashSet::new() },
                counts,
            }
        });
        let constraint = match (&params.constraint, grammars) {
            (None, _) => None,
            (Some(c), Some(g)) => {
                let mut state = g.compile(c)?;
                for &t in outputs {
                    state.advance(t, &end_ids)?;
                }
                Some(state)
            }
            (Some(_), None) => {
                return Err(EngineError::InvalidSampling("a constrained output needs the tokenizer".into()))
            }
        };
        Ok(Sampler {
            sampling: params.sampling(),
            seed: params.seed,
            next_index: params.output_offset as u64,
            processing,
            logprobs: params.logprobs,
            constraint,
            end_ids,
        })
    }

    /// Next token from a `[vocab]` logits row, with randomness seeded by (seed, output index).
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        Ok(self.draw(logits)?.token)
    }

    /// Next token and, when asked, its log probabilities.
    pub fn draw(&mut self, logits: &Tensor) -> Result<Sampled> {
        let index = self.next_index;
        self.next_index += 1;
        let mut processor = LogitsProcessor::from_sampling(step_seed(self.seed, index), self.sampling.clone());
        if self.processing.is_none() && self.logprobs.is_none() && self.constraint.is_none() {
            return Ok(Sampled { token: processor.sample(logits)?, logprobs: None });
        }
        let raw: Vec<f32> = logits.to_dtype(candle_core::DType::F32)?.to_vec1()?;
        let token = if self.processing.is_none() && self.constraint.is_none() {
            processor.sample(logits)?
        } else {
            let mut processed = raw.clone();
            if let Some(p) = &self.processing {
                p.apply(&mut processed, index, &self.end_ids);
            }
            if let Some(c) = &mut self.constraint {
                c.mask(&mut processed, &self.end_ids)?;
            }
            if processed.iter().all(|l| *l == f32::NEG_INFINITY) {
                return Err(EngineError::Constraint("no token can continue the output".into()));
            }
            processor.sample(&Tensor::from_vec(processed, raw.len(), logits.device())?)?
        };
        self.record(token)?;
        Ok(Sampled { token, logprobs: self.logprobs.map(|k| token_logprobs(&raw, token, k)) })
    }

    /// Takes a token sampled elsewhere (a prefill worker's first) as the next output position;
    /// an error when the output's constraint does not allow it.
    pub fn accept(&mut self, token: u32) -> Result<()> {
        self.next_index += 1;
        self.record(token)
    }

    fn record(&mut self, token: u32) -> Result<()> {
        if let Some(p) = &mut self.processing {
            p.record(token);
        }
        if let Some(c) = &mut self.constraint {
            c.advance(token, &self.end_ids)?;
        }
        Ok(())
    }
}

/// e^x for x <= 0, to about 5e-6 relative (clamped at -87): 2^(x log2 e) split into a power of
/// two set in the exponent bits and 2^f, f in [0, 1), by a degree-7 polynomial. Branch-free,
/// so a loop over it vectorizes (std's `exp` is a libm call per value: over a 49,152-token
/// vocabulary it was most of what `top_logprobs` cost a decode step).
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    let t = x.max(-87.0) * std::f32::consts::LOG2_E;
    let n = t.floor();
    let r = (t - n) * std::f32::consts::LN_2;
    // e^r, r in [0, ln 2): Taylor to r^7 (remainder below 1.3e-6 relative).
    let mut p: f32 = 1.0 / 5040.0;
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p.mul_add(r, c);
    }
    f32::from_bits(((n as i32 + 127) as u32) << 23) * p
}

/// The sum of e^(l - max) over `logits` (each <= max), in eight f32 lanes.
fn sum_exp(logits: &[f32], max: f32) -> f64 {
    let mut lanes = [0f32; 8];
    let chunks = logits.chunks_exact(8);
    let rest: f64 = chunks.remainder().iter().map(|&l| f64::from(exp_nonpositive(l - max))).sum();
    for chunk in chunks {
        for (lane, &l) in lanes.iter_mut().zip(chunk) {
            *lane += exp_nonpositive(l - max);
        }
    }
    lanes.iter().map(|&v| f64::from(v)).sum::<f64>() + rest
}

/// Log probabilities of `token` and the `k` most likely tokens under `logits` (log-softmax;
/// the normalizer's exponentials in f32 to about 5e-6, summed per lane, its log in f64).
pub fn token_logprobs(logits: &[f32], token: u32, k: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_norm = max as f64 + sum_exp(logits, max).ln();
    let logprob = |l: f32| (l as f64 - log_norm) as f32;
    // The k largest in one pass: a small sorted list (k <= 20).
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (id, &l) in logits.iter().enumerate() {
            if top.len() == k && top[k - 1].1 >= l {
                continue;
            }
            let at = top.partition_point(|&(_, t)| t >= l);
            top.insert(at, (id as u32, l));
            top.truncate(k);
        }
    }
    TokenLogprobs {
        logprob: logits.get(token as usize).map_or(f32::NEG_INFINITY, |&l| logprob(l)),
        top: top.into_iter().map(|(id, l)| (id, logprob(l))).collect(),
    }
}

/// The generator seed of output token `index` (splitmix64 of both: nearby indices and seeds
/// give unrelated streams).
fn step_seed(seed: u64, index: u64) -> u64 {
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    mix(seed ^ mix(index))
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop token id.
    Stop,
    /// A stop string appeared in the text.
    StopString,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    /// OpenAI's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::StopString => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What one new token produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenOutput {
    pub token: u32,
    /// Text that is now final (may be empty while a stop string or a UTF-8 char is pending).
    pub text_delta: String,
    pub finish: Option<FinishReason>,
}

/// Follows one sequence's output: text so far, stop conditions.
#[derive(Debug, Clone)]
pub struct OutputTracker {
    params: SamplingParams,
    eos_ids: Vec<u32>,
    /// Tokens generated so far (stop tokens excluded).
    generated: Vec<u32>,
    /// Text handed out so far.
    emitted: String,
    finished: Option<FinishReason>,
}

impl OutputTracker {
    pub fn new(params: SamplingParams, tokenizer: &Tokenizer) -> Self {
        OutputTracker {
            eos_ids: if params.ignore_eos { Vec::new() } else { tokenizer.eos_ids().to_vec() },
            params,
            generated: Vec::new(),
            emitted: String::new(),
            finished: None,
        }
    }

    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    pub fn text(&self) -> &str {
        &self.emitted
    }

    pub fn finished(&self) -> Option<FinishReason> {
        self.finished
    }

    /// Records `token` and says what text became final and whether the sequence is done.
    pub fn push(&mut self, token: u32, tokenizer: &Tokenizer) -> Result<TokenOutput> {
        if self.finished.is_some() {
            return Err(EngineError::InvalidBatch("token pushed after the sequence finished".into()));
        }
        if self.eos_ids.contains(&token) || self.params.stop_token_ids.contains(&token) {
            // Counted as generated (usage), never shown as text.
            self.finished = Some(FinishReason::Stop);
            let text_delta = self.flush(tokenizer, true)?;
            self.generated.push(token);
            return Ok(TokenOutput { token, text_delta, finish: self.finished });
        }
        self.generated.push(token);
        let at_limit = self.generated.len() >= self.params.max_tokens;
        let text_delta = self.flush(tokenizer, at_limit)?;
        if self.finished.is_none() && at_limit {
            self.finished = Some(FinishReason::Length);
        }
        Ok(TokenOutput { token, text_delta, finish: self.finished })
    }

    /// Emits newly final text; at the end (`last`) everything left that is not a stop string.
    fn flush(&mut self, tokenizer: &Tokenizer, last: bool) -> Result<String> {
        let full = tokenizer.decode(&self.generated, true)?;
        if !full.starts_with(&self.emitted) {
            return Ok(String::new());
        }
        if let Some(cut) = self.find_stop(&full) {
            self.finished = Some(FinishReason::StopString);
            let delta = full[self.emitted.len()..cut].to_string();
            self.emitted.push_str(&delta);
            return Ok(delta);
        }
        let mut end = full.len();
        if !last {
            if full.ends_with('\u{FFFD}') {
                end -= '\u{FFFD}'.len_utf8(); // an incomplete UTF-8 character
            }
            end -= self.pending_stop_prefix(&full[..end]);
        }
        let end = end.max(self.emitted.len());
        let delta = full[self.emitted.len()..end].to_string();
        self.emitted.push_str(&delta);
        Ok(delta)
    }

    /// Byte offset where the earliest stop string starts, if any.
    fn find_stop(&self, full: &str) -> Option<usize> {
        let longest = self.params.stop_strings.iter().map(String::len).max()?;
        let mut from = self.emitted.len().saturating_sub(longest);
        while !full.is_char_boundary(from) {
            from -= 1;
        }
        self.params.stop_strings.iter().filter_map(|s| full[from..].find(s.as_str()).map(|i| from + i)).min()
    }

    /// Length of the longest suffix of `text` that starts some stop string.
    fn pending_stop_prefix(&self, text: &str) -> usize {
        self.params
            .stop_strings
            .iter()
            .flat_map(|stop| (1..stop.len()).filter(|&n| stop.is_char_boundary(n) && text.ends_with(&stop[..n])).max())
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_vectorized_exponential_matches_std_across_its_range() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -(i as f32) * 1e-3 * 0.9; // 0 down to -180 (clamped below -87)
            let (ours, std) = (f64::from(exp_nonpositive(x)), f64::from(x).exp());
            if std > 1e-30 {
                worst = worst.max((ours - std).abs() / std);
            }
        }
        assert!(worst < 1e-5, "worst relative error {worst}");
        // The normalizer of a vocabulary-sized row, against f64 throughout.
        let logits: Vec<f32> = (0..49_157).map(|i| ((i * 7919) % 1000) as f32 / 37.0 - 9.0).collect();
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exact: f64 = logits.iter().map(|&l| (f64::from(l) - f64::from(max)).exp()).sum();
        assert!((sum_exp(&logits, max).ln() - exact.ln()).abs() < 1e-5);
    }

    #[test]
    fn validation_names_the_bad_field() {
        let mut p = SamplingParams::greedy(4);
        p.top_p = Some(1.5);
        assert!(p.validate().expect_err("top_p").to_string().contains("top_p"));
        let mut p = SamplingParams::greedy(0);
        p.temperature = 0.5;
        assert!(p.validate().expect_err("max").to_string().contains("max_tokens"));
        let mut p = SamplingParams::greedy(1);
        p.temperature = -1.0;
        assert!(p.validate().expect_err("temp").to_string().contains("temperature"));
    }

    #[test]
    fn each_output_position_samples_the_same_wherever_the_generation_continues() -> Result<()> {
        let logits = Tensor::new(&[0.5f32, 0.4, 0.3, 0.2, 0.1, 0.05, 0.0, -0.1], &Device::Cpu)?;
        let params = SamplingParams { temperature: 1.5, seed: 99, ..SamplingParams::greedy(64) };
        let mut whole = Sampler::new(&params)?;
        let draws: Vec<u32> = (0..64).map(|_| whole.sample(&logits)).collect::<Result<_>>()?;
        assert!(draws.iter().collect::<std::collections::HashSet<_>>().len() > 3, "it does sample: {draws:?}");
        // Continued after 40 tokens (a migrated request), or after a first token sampled elsewhere.
        let mut migrated = Sampler::new(&SamplingParams { output_offset: 40, ..params.clone() })?;
        let rest: Vec<u32> = (40..64).map(|_| migrated.sample(&logits)).collect::<Result<_>>()?;
        assert_eq!(rest, draws[40..]);
        let mut after_first = Sampler::new(&params)?;
        after_first.accept(draws[0])?;
        assert_eq!(after_first.sample(&logits)?, draws[1]);
        Ok(())
    }

    #[test]
    fn same_seed_same_tokens_and_greedy_takes_argmax() -> Result<()> {
        let logits = Tensor::new(&[0.1f32, 2.0, 1.9, 0.5, 1.8], &Device::Cpu)?;
        let mut greedy = Sampler::new(&SamplingParams::greedy(1))?;
        assert_eq!(greedy.sample(&logits)?, 1);
        let mut params = SamplingParams::greedy(1);
        params.temperature = 1.0;
        params.seed = 42;
        let draw = |params: &SamplingParams| -> Result<Vec<u32>> {
            let mut s = Sampler::new(params)?;
            (0..32).map(|_| s.sample(&logits)).collect()
        };
        let a = draw(&params)?;
        assert_eq!(a, draw(&params)?);
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1, "temperature 1 varies");
        params.top_k = Some(1);
        assert!(draw(&params)?.iter().all(|&t| t == 1), "top_k 1 is greedy");
        Ok(())
    }

    fn draw_with(params: &SamplingParams, context: &[u32], logits: &[f32]) -> Result<Sampled> {
        let logits = Tensor::new(logits, &Device::Cpu)?;
        Sampler::with_end_ids(params, context, &[0], None)?.draw(&logits)
    }

    #[test]
    fn penalties_and_biases_change_the_greedy_choice_as_vllm_defines_them() -> Result<()> {
        let logits = [0.0f32, 3.0, 2.9, 2.0, -1.0];
        let greedy = SamplingParams::greedy(8);
        assert_eq!(draw_with(&greedy, &[1, 1], &logits)?.token, 1);
        // Repetition: 3.0 / 1.1 = 2.73 < 2.9 for token 1, which is in the prompt.
        let p = SamplingParams { repetition_penalty: 1.1, ..greedy.clone() };
        assert_eq!(draw_with(&p, &[1], &logits)?.token, 2);
        // Frequency and presence count output tokens only: the last `output_offset` of the
        // context (tokens sent before a migration), not the prompt.
        let p = SamplingParams { frequency_penalty: 0.2, output_offset: 1, ..greedy.clone() };
        assert_eq!(draw_with(&p, &[1, 1], &logits)?.token, 2, "one output 1: 3.0 - 0.2 < 2.9");
        let p = SamplingParams { frequency_penalty: 0.2, ..greedy.clone() };
        assert_eq!(draw_with(&p, &[1, 1], &logits)?.token, 1, "prompt tokens are not output");
        let p = SamplingParams { presence_penalty: 1.5, output_offset: 2, ..greedy.clone() };
        assert_eq!(draw_with(&p, &[2, 1], &logits)?.token, 3, "1 and 2 generated: 1.5 and 1.4 < 2.0");
        let p = SamplingParams { logit_bias: vec![(4, 100.0)], ..greedy.clone() };
        assert_eq!(draw_with(&p, &[], &logits)?.token, 4);
        let p = SamplingParams { logit_bias: vec![(1, -100.0)], ..greedy.clone() };
        assert_eq!(draw_with(&p, &[], &logits)?.token, 2);
        Ok(())
    }

    #[test]
    fn min_tokens_masks_end_tokens_until_reached_and_follows_a_migration() -> Result<()> {
        let logits = Tensor::new(&[5.0f32, 1.0, 0.5], &Device::Cpu)?;
        let p = SamplingParams { min_tokens: 2, stop_token_ids: vec![1], ..SamplingParams::greedy(8) };
        let mut s = Sampler::with_end_ids(&p, &[], &[0], None)?;
        assert_eq!(s.sample(&logits)?, 2, "eos 0 and stop id 1 masked");
        assert_eq!(s.sample(&logits)?, 2);
        assert_eq!(s.sample(&logits)?, 0, "two tokens out: eos allowed");
        let migrated = SamplingParams { output_offset: 2, ..p.clone() };
        assert_eq!(Sampler::with_end_ids(&migrated, &[9, 2, 2], &[0], None)?.sample(&logits)?, 0);
        let ignore = SamplingParams { ignore_eos: true, ..p };
        assert_eq!(
            Sampler::with_end_ids(&ignore, &[], &[0], None)?.sample(&logits)?,
            0,
            "ignore_eos: eos is no end id"
        );
        Ok(())
    }

    #[test]
    fn logprobs_are_the_raw_log_softmax_with_the_top_tokens_in_order() -> Result<()> {
        let logits = [1.0f32, 3.0, 2.0, 0.5];
        let p = SamplingParams { logprobs: Some(2), logit_bias: vec![(0, 50.0)], ..SamplingParams::greedy(8) };
        let s = draw_with(&p, &[], &logits)?;
        assert_eq!(s.token, 0, "the bias decides the sample");
        let norm = logits.iter().map(|&l| (l as f64).exp()).sum::<f64>().ln();
        let lp = s.logprobs.expect("asked");
        assert!((lp.logprob as f64 - (1.0 - norm)).abs() < 1e-6, "raw, not biased: {lp:?}");
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((lp.top[0].1 as f64 - (3.0 - norm)).abs() < 1e-6);
        let none = draw_with(&SamplingParams::greedy(8), &[], &logits)?;
        assert_eq!(none, Sampled { token: 1, logprobs: None });
        let zero = draw_with(&SamplingParams { logprobs: Some(0), ..SamplingParams::greedy(8) }, &[], &logits)?;
        assert!(zero.logprobs.is_some_and(|l| l.top.is_empty()));
        Ok(())
    }

    #[test]
    fn out_of_range_processing_is_refused_by_name() {
        let base = SamplingParams::greedy(4);
        let cases = [
            (SamplingParams { repetition_penalty: 0.0, ..base.clone() }, "repetition_penalty"),
            (SamplingParams { frequency_penalty: 2.5, ..base.clone() }, "frequency_penalty"),
            (SamplingParams { presence_penalty: -3.0, ..base.clone() }, "presence_penalty"),
            (SamplingParams { logit_bias: vec![(3, 101.0)], ..base.clone() }, "logit_bias"),
            (SamplingParams { min_tokens: 5, ..base.clone() }, "min_tokens"),
            (SamplingParams { logprobs: Some(21), ..base }, "top_logprobs"),
        ];
        for (p, name) in cases {
            assert!(p.validate().expect_err(name).to_string().contains(name), "{name}");
        }
    }
}
