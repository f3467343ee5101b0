//! Choosing the next token and deciding when a sequence is done.
//!
//! Sampling itself is candle-transformers' `LogitsProcessor` (greedy, temperature, top-k,
//! top-p). Its randomness for the output token at index i comes from a generator seeded by
//! the request's seed and i alone, not by the tokens drawn before: the same seed gives the
//! same tokens, and a generation continued in another process (after the first token from a
//! prefill worker, or after a decode worker was lost and the request migrated) draws exactly
//! what the original process would have. `OutputTracker` turns tokens into
//! streamed text and applies stop token ids, stop strings and max tokens; text that might be
//! the start of a stop string is held back until it is known not to be one.

use candle_core::Tensor;
use candle_transformers::generation::{LogitsProcessor, Sampling};

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
}

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
        }
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

/// Per-sequence sampler state: the sampling rule, the seed and the output index of the next
/// token.
pub struct Sampler {
    sampling: Sampling,
    seed: u64,
    next_index: u64,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sampler")
    }
}

impl Sampler {
    pub fn new(params: &SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Sampler { sampling: params.sampling(), seed: params.seed, next_index: params.output_offset as u64 })
    }

    /// Next token from a `[vocab]` logits row, with randomness seeded by (seed, output index).
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        let seed = step_seed(self.seed, self.next_index);
        self.next_index += 1;
        Ok(LogitsProcessor::from_sampling(seed, self.sampling.clone()).sample(logits)?)
    }

    /// Skips `n` output positions (tokens sampled elsewhere, e.g. a prefill worker's first).
    pub fn skip(&mut self, n: usize) {
        self.next_index += n as u64;
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
        after_first.skip(1);
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
}
