//! Structured output: a constraint (a JSON schema, any JSON object, a regex or a Lark grammar)
//! compiled by llguidance into a matcher that gives, at every output position, the set of
//! tokens that keep the text inside the constraint. The sampler masks every other token; the
//! first token (sampled by a prefill worker) and every later one (decode worker) are
//! constrained alike, and a migrated sequence replays the tokens already sent through a fresh
//! matcher. Once the constraint is complete only end-of-sequence remains allowed.
//!
//! The vocabulary llguidance sees is built from the tokenizer's own token bytes (special
//! tokens marked, so grammar text never matches them), once per tokenizer and shared.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

use crate::error::{EngineError, Result};
use crate::tokenizer::Tokenizer;

/// What the output must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputConstraint {
    /// A JSON value valid under this JSON schema (a JSON document).
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// A text the regex matches whole.
    Regex(String),
    /// A text of this Lark grammar (llguidance's dialect).
    Lark(String),
}

impl OutputConstraint {
    fn grammar(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            OutputConstraint::JsonSchema(schema) => {
                let value = serde_json::from_str(schema)
                    .map_err(|e| EngineError::Constraint(format!("the JSON schema is not JSON: {e}")))?;
                TopLevelGrammar::from_json_schema(value)
            }
            OutputConstraint::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"})),
            OutputConstraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            OutputConstraint::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        })
    }
}

/// The tokenizer as llguidance sees it: a trie of every token's bytes.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.tokenizer.encode(&String::from_utf8_lossy(s)).unwrap_or_default()
    }
}

/// Compiles constraints for one tokenizer (built once: the trie of a 50k vocabulary takes
/// tens of milliseconds).
pub struct Grammars {
    factory: ParserFactory,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammars")
    }
}

impl Grammars {
    pub fn new(tokenizer: &Tokenizer) -> Result<Self> {
        let vocab = tokenizer.vocab_size();
        let eos = tokenizer.eos_ids().first().copied().ok_or_else(|| {
            EngineError::Constraint("the tokenizer has no end-of-sequence token to end a constrained output".into())
        })?;
        let special: std::collections::HashSet<u32> =
            tokenizer.inner().get_added_tokens_decoder().iter().filter(|(_, t)| t.special).map(|(&id, _)| id).collect();
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| (id, tokenizer.token_bytes(id)))
            .map(|(id, bytes)| match special.contains(&id) || tokenizer.eos_ids().contains(&id) || bytes.is_empty() {
                // Never matched by grammar text (an empty token would match anywhere).
                true => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tokenizer.id_to_token(id).unwrap_or_default().as_bytes());
                    w
                }
                false => bytes,
            })
            .collect();
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, eos), &words);
        let env: TokEnv = Arc::new(Vocabulary { trie, tokenizer: tokenizer.clone() });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| EngineError::Constraint(e.to_string()))?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A matcher for `constraint` at the start of the output; an error names what does not
    /// compile.
    pub fn compile(&self, constraint: &OutputConstraint) -> Result<ConstraintState> {
        let parser =
            self.factory.create_parser(constraint.grammar()?).map_err(|e| EngineError::Constraint(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(EngineError::Constraint(e));
        }
        Ok(ConstraintState { matcher })
    }
}

/// One sequence's place in its constraint.
pub struct ConstraintState {
    matcher: Matcher,
}

impl std::fmt::Debug for ConstraintState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConstraintState")
    }
}

impl ConstraintState {
    /// Sets every token the constraint does not allow next to minus infinity (`end_ids`, the
    /// sequence's end tokens, count as the constraint's end-of-sequence).
    pub fn mask(&mut self, logits: &mut [f32], end_ids: &[u32]) -> Result<()> {
        let allowed = self.matcher.compute_mask_or_eos().map_err(|e| EngineError::Constraint(e.to_string()))?;
        let eos_allowed = allowed.is_allowed(self.matcher.tok_env().map(|t| t.tok_trie().eos_token()).unwrap_or(0));
        for (id, l) in logits.iter_mut().enumerate() {
            let id = id as u32;
            let ok =
                if end_ids.contains(&id) { eos_allowed } else { id < allowed.len() as u32 && allowed.is_allowed(id) };
            if !ok {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances past `token` (an end token ends the sequence and needs no advance).
    pub fn advance(&mut self, token: u32, end_ids: &[u32]) -> Result<()> {
        if end_ids.contains(&token) {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| EngineError::Constraint(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::sampling::{Sampler, SamplingParams};

    /// Samples at temperature 1 from flat logits under `constraint` until an end token.
    fn generate(constraint: OutputConstraint, seed: u64, offset_tokens: &[u32]) -> Result<Vec<u32>> {
        let tok = Tokenizer::characters()?;
        let params = SamplingParams {
            temperature: 1.0,
            seed,
            constraint: Some(constraint),
            output_offset: offset_tokens.len(),
            ..SamplingParams::greedy(32)
        };
        let mut context = vec![0, 1];
        context.extend_from_slice(offset_tokens);
        let mut sampler = Sampler::for_sequence(&params, &context, &tok)?;
        let logits = Tensor::zeros(64, candle_core::DType::F32, &Device::Cpu)?;
        let mut out = Vec::new();
        for _ in 0..32 {
            let t = sampler.sample(&logits)?;
            if tok.eos_ids().contains(&t) {
                return Ok(out);
            }
            out.push(t);
        }
        Ok(out)
    }

    /// The text of `ids` (the test tokenizer's decoder would put spaces between tokens).
    fn text_of(tok: &Tokenizer, ids: &[u32]) -> String {
        String::from_utf8(ids.iter().flat_map(|&id| tok.token_bytes(id)).collect()).unwrap_or_default()
    }

    #[test]
    fn sampled_text_matches_the_regex_and_ends_when_it_is_complete() -> Result<()> {
        let tok = Tokenizer::characters()?;
        for seed in 0..8 {
            let ids = generate(OutputConstraint::Regex("(ab|cd)[0-3]{2}".into()), seed, &[])?;
            let text = text_of(&tok, &ids);
            assert_eq!(text.len(), 4, "{text:?}");
            assert!(
                ["ab", "cd"].contains(&&text[..2]) && text[2..].chars().all(|c| ('0'..='3').contains(&c)),
                "{text}"
            );
        }
        Ok(())
    }

    #[test]
    fn a_migrated_sequence_replays_what_was_sent_and_continues_inside_the_constraint() -> Result<()> {
        let tok = Tokenizer::characters()?;
        // "ab" already sent: only digits may follow.
        let sent = tok.encode("ab")?;
        let ids = generate(OutputConstraint::Regex("(ab|cd)[0-3]{2}".into()), 5, &sent)?;
        let text = text_of(&tok, &ids);
        assert!(text.len() == 2 && text.chars().all(|c| ('0'..='3').contains(&c)), "{text:?}");
        // Sent tokens the constraint cannot take are refused, not continued from.
        let wrong = tok.encode("zz")?;
        assert!(generate(OutputConstraint::Regex("(ab|cd)[0-3]{2}".into()), 5, &wrong).is_err());
        Ok(())
    }

    #[test]
    fn constraints_that_do_not_compile_are_named() -> Result<()> {
        let tok = Tokenizer::characters()?;
        let grammars = tok.grammars()?;
        let bad = grammars.compile(&OutputConstraint::Regex("[a-".into())).expect_err("unclosed class");
        assert!(bad.to_string().contains("regex"), "{bad}");
        let not_json = grammars.compile(&OutputConstraint::JsonSchema("{nope".into())).expect_err("not JSON");
        assert!(not_json.to_string().contains("not JSON"), "{not_json}");
        Ok(())
    }
}
