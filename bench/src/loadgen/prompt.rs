//! Prompts of an exact token count for the served model's tokenizer: words that are one
//! token each with their leading space (the tokenizer's pre-split keeps them apart), drawn
//! with a seeded generator. Each prompt is checked by encoding it; a tokenizer for which
//! this cannot work is refused with a message, never measured with wrong lengths.

use pd_engine::Tokenizer;

/// A small deterministic generator (splitmix64): reproducible workloads, no dependency.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Exponential with mean `mean` (Poisson inter-arrival times).
    pub fn exponential(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
}

const WORDS: &str = "the of and to in is was for on that with as by at from his her this which or an be are \
    were had have not but all one their they there been has when who will more no if out so said what up its about \
    into than them can only other new some could time these two may then do first any my now such like our over man \
    me even most made after also did many before must through back years where much your way well down should because \
    each just those people how too little state good very make world still own see men work long get here between both \
    life being under never day same another know while last might us great old year off come since against go came right \
    used take three states himself few house use during without again place american around however home small found \
    city water light river stone field table window garden market";

/// Builds prompts of exact token counts.
#[derive(Debug)]
pub struct PromptBuilder<'a> {
    tokenizer: &'a Tokenizer,
    words: Vec<&'static str>,
}

impl<'a> PromptBuilder<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Result<Self, String> {
        let words: Vec<&'static str> = WORDS
            .split_whitespace()
            .filter(|w| tokenizer.encode(&format!(" {w}")).map(|t| t.len() == 1).unwrap_or(false))
            .collect();
        if words.len() < 32 {
            return Err(format!(
                "the tokenizer splits common words into several tokens ({} of them are single tokens): cannot build exact-length prompts",
                words.len()
            ));
        }
        Ok(PromptBuilder { tokenizer, words })
    }

    /// `tokens` words drawn from `rng`.
    pub fn words(&self, rng: &mut Rng, tokens: usize) -> String {
        let mut s = String::with_capacity(tokens * 6);
        for _ in 0..tokens {
            s.push(' ');
            s.push_str(self.words[(rng.next_u64() % self.words.len() as u64) as usize]);
        }
        s
    }

    /// A prompt of exactly `tokens` tokens that starts with `prefix` (itself built by
    /// `words`, so its token count is its word count).
    pub fn prompt(&self, rng: &mut Rng, prefix: &str, tokens: usize) -> Result<String, String> {
        let prefix_tokens = prefix.split_whitespace().count();
        let text = format!("{prefix}{}", self.words(rng, tokens.saturating_sub(prefix_tokens)));
        let got = self.tokenizer.encode(&text).map_err(|e| e.to_string())?.len();
        if got != tokens {
            return Err(format!("built a prompt of {got} tokens for {tokens}: the tokenizer merges across words"));
        }
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn rng_is_reproducible_and_uniform_enough() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        assert_eq!(a.next_u64(), b.next_u64());
        let mean: f64 = (0..10_000).map(|_| a.unit()).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
        let exp: f64 = (0..10_000).map(|_| b.exponential(2.0)).sum::<f64>() / 10_000.0;
        assert!((exp - 2.0).abs() < 0.1, "{exp}");
    }
}
