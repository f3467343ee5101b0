//! Text <-> token ids. For GGUF checkpoints the tokenizer is built from the file's own
//! metadata: byte-level BPE vocabularies (`gpt2`: vocab and merges, the text split as the
//! file's `tokenizer.ggml.pre` names (`pre`), control tokens special), which reproduces
//! llama.cpp's and transformers' ids, and SentencePiece vocabularies
//! (`llama`: Llama 2, Mistral, Phi-3, Gemma), built the way Hugging Face transformers converts
//! them (a BPE with byte fallback whose merges come from the token scores). For Hugging Face
//! folders it is read from tokenizer.json.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace};
use tokenizers::pre_tokenizers::split::Split;
use tokenizers::{AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, SplitDelimiterBehavior};

use crate::constraint::Grammars;
use crate::error::{EngineError, Result};

mod pre;

/// GGUF token type of control tokens (`<|im_start|>`, ...).
const GGUF_TOKEN_CONTROL: i32 = 3;
/// GGUF token type of user-defined tokens, also matched as whole tokens.
const GGUF_TOKEN_USER_DEFINED: i32 = 4;

/// A model's tokenizer with its end-of-sequence ids.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Ids that end generation unless the request says otherwise.
    eos_ids: Vec<u32>,
    bos_id: Option<u32>,
    /// Whether a raw prompt (`encode_prompt`) starts with BOS, as transformers' `add_special_tokens`
    /// and llama.cpp's `add_bos` put it there: Llama, Gemma, Mistral yes; Qwen, SmolLM no.
    add_bos: bool,
    /// Structured-output compiler for this vocabulary, built on first use and shared by every
    /// clone (`grammars`).
    grammars: std::sync::Arc<std::sync::OnceLock<std::result::Result<Grammars, String>>>,
}

fn tok_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Builds the tokenizer from GGUF metadata (`tokenizer.ggml.*`).
    pub fn from_gguf(metadata: &HashMap<String, Value>) -> Result<Self> {
        let get = |key: &str| {
            metadata.get(key).ok_or_else(|| EngineError::Tokenizer(format!("GGUF metadata has no `{key}`")))
        };
        let model = get("tokenizer.ggml.model")?.to_string().map_err(tok_err)?;
        match model.as_str() {
            "gpt2" => {}
            "llama" => return Self::from_gguf_sentencepiece(metadata),
            _ => {
                return Err(EngineError::Tokenizer(format!(
                    "tokenizer model `{model}` is not supported (byte-level BPE `gpt2` and SentencePiece `llama` are)"
                )))
            }
        }
        let pre_name = metadata.get(pre::KEY).map(|v| v.to_string().map_err(tok_err)).transpose()?;
        let splitting = pre::byte_level(pre_name.map(String::as_str))?;
        let tokens: Vec<String> = get("tokenizer.ggml.tokens")?
            .to_vec()
            .map_err(tok_err)?
            .iter()
            .map(|v| v.to_string().cloned().map_err(tok_err))
            .collect::<Result<_>>()?;
        let merges: Vec<(String, String)> = get("tokenizer.ggml.merges")?
            .to_vec()
            .map_err(tok_err)?
            .iter()
            .map(|v| {
                let m = v.to_string().map_err(tok_err)?;
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| EngineError::Tokenizer(format!("merge `{m}` has no space")))
            })
            .collect::<Result<_>>()?;
        let types: Vec<i32> = match metadata.get("tokenizer.ggml.token_type") {
            Some(v) => {
                v.to_vec().map_err(tok_err)?.iter().map(|t| t.to_i32().map_err(tok_err)).collect::<Result<_>>()?
            }
            None => vec![1; tokens.len()],
        };
        let vocab: tokenizers::models::bpe::Vocab =
            tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(splitting.ignore_merges)
            .build()
            .map_err(tok_err)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        if let Some(normalizer) = splitting.normalizer {
            inner.with_normalizer(Some(normalizer)).map_err(tok_err)?;
        }
        inner.with_pre_tokenizer(Some(splitting.pre_tokenizer));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == GGUF_TOKEN_CONTROL || t == GGUF_TOKEN_USER_DEFINED)
            .map(|(text, _)| AddedToken::from(text.clone(), true))
            .collect();
        inner.add_special_tokens(special).map_err(tok_err)?;
        let id = |key: &str| metadata.get(key).and_then(|v| v.to_u32().ok());
        let eos_ids = end_of_generation_ids(metadata, &tokens);
        let bos_id = id("tokenizer.ggml.bos_token_id");
        let add_bos = gguf_add_bos(metadata, splitting.add_bos) && bos_id.is_some();
        Ok(Tokenizer { inner, eos_ids, bos_id, add_bos, grammars: Default::default() })
    }

    /// A SentencePiece vocabulary (`tokenizer.ggml.model == "llama"`), converted as transformers'
    /// GGUF loader does: a BPE with byte fallback over the file's tokens, its merges those of
    /// the file or else every split of a token into two tokens, best score first (Gemma: first
    /// in the file first). Spaces become "▁"; a "▁" is put before each text and each text after
    /// a special token, even one that starts with a space, as sentencepiece and llama.cpp do
    /// (Gemma: never), unless `tokenizer.ggml.add_space_prefix` is false, and decoding takes it
    /// off again. (transformers' GGUF loader leaves it out before a leading space; the models'
    /// own tokenizer.json files put it there, as this does.)
    /// Control tokens (and the bos/eos/unk/padding tokens) are special, user-defined ones added,
    /// both matched whole in the text.
    fn from_gguf_sentencepiece(metadata: &HashMap<String, Value>) -> Result<Self> {
        let get = |key: &str| {
            metadata.get(key).ok_or_else(|| EngineError::Tokenizer(format!("GGUF metadata has no `{key}`")))
        };
        let file_tokens: Vec<String> = get("tokenizer.ggml.tokens")?
            .to_vec()
            .map_err(tok_err)?
            .iter()
            .map(|v| v.to_string().cloned().map_err(tok_err))
            .collect::<Result<_>>()?;
        let types: Vec<i32> = match metadata.get("tokenizer.ggml.token_type") {
            Some(v) => {
                v.to_vec().map_err(tok_err)?.iter().map(|t| t.to_i32().map_err(tok_err)).collect::<Result<_>>()?
            }
            None => vec![1; file_tokens.len()],
        };
        let architecture = metadata.get("general.architecture").and_then(|v| v.to_string().ok()).map(String::as_str);
        let gemma = matches!(architecture, Some("gemma" | "gemma2" | "gemma3"));
        // Gemma files spell tokens of two or more spaces with real spaces; its normalizer makes
        // every space "▁", so they are renamed to match.
        let tokens: Vec<String> = if gemma {
            file_tokens
                .iter()
                .map(|t| match t.contains(' ') && t.chars().all(python_whitespace) {
                    true => "▁".repeat(t.chars().count()),
                    false => t.clone(),
                })
                .collect()
        } else {
            file_tokens.clone()
        };
        let merges: Vec<(String, String)> = match metadata.get("tokenizer.ggml.merges") {
            Some(merges) => merges
                .to_vec()
                .map_err(tok_err)?
                .iter()
                .map(|v| {
                    let m = v.to_string().map_err(tok_err)?;
                    m.split_once(' ')
                        .map(|(a, b)| (a.to_string(), b.to_string()))
                        .ok_or_else(|| EngineError::Tokenizer(format!("merge `{m}` has no space")))
                })
                .collect::<Result<_>>()?,
            None if gemma => {
                // Gemma's scores do not follow its merge order; the order in the file does.
                let positions: Vec<f64> = (0..tokens.len()).map(|i| -(i as f64)).collect();
                merges_from_scores(&tokens, &positions)
            }
            None => {
                let scores: Vec<f64> = get("tokenizer.ggml.scores")?
                    .to_vec()
                    .map_err(tok_err)?
                    .iter()
                    .map(|s| s.to_f32().map(f64::from).map_err(tok_err))
                    .collect::<Result<_>>()?;
                if scores.len() != tokens.len() {
                    return Err(EngineError::Tokenizer(format!(
                        "GGUF has {} tokens but {} scores",
                        tokens.len(),
                        scores.len()
                    )));
                }
                merges_from_scores(&tokens, &scores)
            }
        };
        let id = |key: &str| metadata.get(key).and_then(|v| v.to_u32().ok());
        let token_of = |key: &str| id(key).and_then(|i| file_tokens.get(i as usize)).cloned();
        let vocab: tokenizers::models::bpe::Vocab =
            tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let mut bpe = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).fuse_unk(true);
        if let Some(unk) = token_of("tokenizer.ggml.unknown_token_id") {
            bpe = bpe.unk_token(unk);
        }
        let mut inner = tokenizers::Tokenizer::new(bpe.build().map_err(tok_err)?);

        let add_space_prefix =
            metadata.get("tokenizer.ggml.add_space_prefix").and_then(|v| v.to_bool().ok()).unwrap_or(true);
        let space = || Replace::new(" ", "▁").map_err(tok_err);
        let mut decoders: Vec<DecoderWrapper> =
            vec![Replace::new("▁", " ").map_err(tok_err)?.into(), ByteFallback::new().into(), Fuse::new().into()];
        if gemma {
            inner.with_normalizer(Some(space()?)).map_err(tok_err)?;
            inner.with_pre_tokenizer(Some(
                Split::new(" ", SplitDelimiterBehavior::MergedWithPrevious, false).map_err(tok_err)?,
            ));
        } else {
            // SentencePiece's dummy prefix: "▁" before every text and every text after a
            // special token, even one that starts with a space (" Hello" is "▁", "▁Hello"), as
            // sentencepiece, llama.cpp and the models' own tokenizer.json (`Prepend`) give it.
            let mut normalizers: Vec<NormalizerWrapper> = vec![space()?.into()];
            if add_space_prefix {
                normalizers.insert(0, Prepend::new("▁".to_string()).into());
            }
            inner.with_normalizer(Some(tokenizers::normalizers::Sequence::new(normalizers))).map_err(tok_err)?;
            if add_space_prefix {
                decoders.push(Strip::new(' ', 1, 0).into());
            }
        }
        inner.with_decoder(Some(DecoderSequence::new(decoders)));

        // Named special tokens first, as transformers registers them, then control tokens; a
        // token whose spelling is not in the vocabulary (Gemma's renamed spaces) is left out so
        // that no id is made up.
        let spelled: std::collections::HashSet<&str> = tokens.iter().map(String::as_str).collect();
        let in_vocab = |t: &String| spelled.contains(t.as_str());
        let mut special: Vec<String> = ["bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"]
            .iter()
            .filter_map(|k| token_of(&format!("tokenizer.ggml.{k}")))
            .collect();
        special
            .extend(file_tokens.iter().zip(&types).filter(|(_, &t)| t == GGUF_TOKEN_CONTROL).map(|(t, _)| t.clone()));
        let mut seen = std::collections::HashSet::new();
        special.retain(|t| in_vocab(t) && seen.insert(t.clone()));
        let user: Vec<AddedToken> = file_tokens
            .iter()
            .zip(&types)
            .filter(|(t, &ty)| ty == GGUF_TOKEN_USER_DEFINED && !seen.contains(*t) && in_vocab(t))
            .map(|(t, _)| AddedToken::from(t.clone(), false).normalized(false))
            .collect();
        let special: Vec<AddedToken> =
            special.into_iter().map(|t| AddedToken::from(t, true).normalized(false)).collect();
        inner.add_special_tokens(special).map_err(tok_err)?;
        inner.add_tokens(user).map_err(tok_err)?;

        let eos_ids = end_of_generation_ids(metadata, &file_tokens);
        let bos_id = id("tokenizer.ggml.bos_token_id");
        // llama.cpp's default for SentencePiece vocabularies: BOS first.
        let add_bos = gguf_add_bos(metadata, true) && bos_id.is_some();
        Ok(Tokenizer { inner, eos_ids, bos_id, add_bos, grammars: Default::default() })
    }

    /// Reads a Hugging Face `tokenizer.json`; `eos_ids` and `bos_id` come from config.json.
    pub fn from_file(path: &Path, eos_ids: Vec<u32>, bos_id: Option<u32>) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| EngineError::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Self::from_inner(inner, eos_ids, bos_id))
    }

    /// Token ids of `text`. Special-token markup in the text (`<|im_start|>`) becomes the
    /// special token; no BOS is added (chat templates write their own).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self.inner.encode(text, false).map_err(tok_err)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Token ids of a raw prompt (a completion's `prompt`, not a rendered chat): `encode`, with
    /// BOS first where the vocabulary starts its texts with it (`add_bos`) and the text does
    /// not already begin with it (a prompt written out with its `<|begin_of_text|>` is not
    /// given a second one).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.encode(text)?;
        if let Some(bos) = self.bos_id.filter(|_| self.add_bos) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// Whether `encode_prompt` puts BOS first.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// Text of `ids`; special tokens are left out when `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(tok_err)
    }

    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// The text of one token id, if the vocabulary has it.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Id of a token's text, if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of ids, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Writes the tokenizer as tokenizer.json (used to build test model folders).
    pub fn save(&self, path: &Path) -> Result<()> {
        self.inner.save(path, false).map_err(tok_err)
    }

    /// Wraps an already built `tokenizers` tokenizer; a raw prompt starts with BOS when its
    /// post-processor puts it there (tokenizer.json's `TemplateProcessing`, as Llama 3's).
    pub fn from_inner(inner: tokenizers::Tokenizer, eos_ids: Vec<u32>, bos_id: Option<u32>) -> Self {
        let add_bos = bos_id.is_some_and(|bos| post_processor_adds_bos(&inner, bos));
        Tokenizer { inner, eos_ids, bos_id, add_bos, grammars: Default::default() }
    }

    /// A tokenizer of 64 single characters (`a`-`z`, `A`-`Z`, `0`-`7`, space, `.`; `<s>` = 62,
    /// `</s>` = 63 and end of sequence): for tests of code that needs text but no model, and
    /// for the tiny random-weight test models.
    pub fn characters() -> Result<Self> {
        let chars: Vec<String> = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234567 ."
            .chars()
            .map(String::from)
            .chain(["<s>".to_string(), "</s>".to_string()])
            .collect();
        let vocab: tokenizers::models::bpe::Vocab =
            chars.iter().enumerate().map(|(i, c)| (c.clone(), i as u32)).collect();
        let bpe = BPE::builder().vocab_and_merges(vocab, Vec::new()).build().map_err(tok_err)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner
            .add_special_tokens(vec![AddedToken::from("<s>", true), AddedToken::from("</s>", true)])
            .map_err(tok_err)?;
        Ok(Tokenizer { inner, eos_ids: vec![63], bos_id: Some(62), add_bos: false, grammars: Default::default() })
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The structured-output compiler for this vocabulary (built on first use).
    pub fn grammars(&self) -> Result<&Grammars> {
        self.grammars
            .get_or_init(|| Grammars::new(self).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| EngineError::Constraint(e.clone()))
    }

    /// The bytes one token stands for in text (OpenAI's `bytes` of a logprob: a byte-level BPE
    /// token may hold part of a UTF-8 character). For byte-level vocabularies the token's
    /// characters are mapped back to bytes; otherwise it is the token decoded alone.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let byte_level = matches!(self.inner.get_decoder(), Some(tokenizers::DecoderWrapper::ByteLevel(_)));
        if let Some(bytes) = self.id_to_token(id).as_deref().filter(|_| byte_level).and_then(byte_level_bytes) {
            return bytes;
        }
        if let Some(bytes) = self.sentencepiece_bytes(id) {
            return bytes;
        }
        match self.decode(&[id], false).unwrap_or_default() {
            // A decoder that drops a lone token's text (a bare space): the vocabulary's own.
            text if text.is_empty() => self.id_to_token(id).unwrap_or_default().into_bytes(),
            text => text.into_bytes(),
        }
    }
    /// The bytes of a SentencePiece piece (a BPE with byte fallback): `<0xHH>` is that byte, other
    /// pieces their text with "▁" as a space (decoding one alone would drop a leading space).
    /// None for other vocabularies and for added tokens.
    fn sentencepiece_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let ModelWrapper::BPE(bpe) = self.inner.get_model() else { return None };
        if !bpe.byte_fallback || self.inner.get_added_vocabulary().simple_id_to_token(id).is_some() {
            return None;
        }
        let token = self.id_to_token(id)?;
        let hex = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>')).filter(|h| h.len() == 2);
        match hex.map(|h| u8::from_str_radix(h, 16)) {
            Some(Ok(byte)) => Some(vec![byte]),
            _ => Some(token.replace('▁', " ").into_bytes()),
        }
    }
}

/// A GGUF file's `tokenizer.ggml.add_bos_token`, or `default` where the file has none.
fn gguf_add_bos(metadata: &HashMap<String, Value>, default: bool) -> bool {
    metadata.get("tokenizer.ggml.add_bos_token").and_then(|v| v.to_bool().ok()).unwrap_or(default)
}

/// Whether `inner`'s post-processor puts `bos` before a text (transformers'
/// `add_special_tokens=True`).
fn post_processor_adds_bos(inner: &tokenizers::Tokenizer, bos: u32) -> bool {
    match (inner.encode("a", true), inner.encode("a", false)) {
        (Ok(with), Ok(without)) => with.get_ids().first() == Some(&bos) && without.get_ids().first() != Some(&bos),
        _ => false,
    }
}

/// The ids that end a generation in a GGUF file's vocabulary: its eos, eot and eom tokens,
/// and, as llama.cpp does, every token spelled as a chat format's end of turn. Files often
/// name only `<|endoftext|>` as eos while the model ends its turns with `<|end|>` (Phi-3),
/// `<|eot_id|>` (Llama 3) or `<end_of_turn>` (Gemma), whose generation configs list them.
fn end_of_generation_ids(metadata: &HashMap<String, Value>, tokens: &[String]) -> Vec<u32> {
    const TURN_ENDS: [&str; 9] = [
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<EOT>",
        "<｜end▁of▁sentence｜>",
        "<|end_of_text|>",
    ];
    let keys = ["eos_token_id", "eot_token_id", "eom_token_id"];
    let mut ids: Vec<u32> = keys
        .iter()
        .filter_map(|k| metadata.get(&format!("tokenizer.ggml.{k}")).and_then(|v| v.to_u32().ok()))
        .collect();
    ids.extend(tokens.iter().enumerate().filter(|(_, t)| TURN_ENDS.contains(&t.as_str())).map(|(i, _)| i as u32));
    let mut seen = std::collections::HashSet::new();
    ids.retain(|id| seen.insert(*id));
    ids
}

/// Python's `str.isspace` (what transformers tests tokens with): Unicode white space and the
/// separators U+001C..U+001F.
fn python_whitespace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// transformers' `generate_merges` with scores: every split of a token into two tokens, the
/// splits of one token ordered by their ids, then all sorted (stably) by the token's score,
/// then the lengths (in characters) of the left and the right part, all descending. A token
/// listed twice has the id and score of its last listing and the place of its first.
fn merges_from_scores(tokens: &[String], scores: &[f64]) -> Vec<(String, String)> {
    let mut ids: HashMap<&str, u32> = HashMap::with_capacity(tokens.len());
    let mut score_of: HashMap<&str, f64> = HashMap::with_capacity(tokens.len());
    let mut order: Vec<&str> = Vec::with_capacity(tokens.len());
    for (i, (token, &score)) in tokens.iter().zip(scores).enumerate() {
        ids.insert(token, i as u32);
        if score_of.insert(token, score).is_none() {
            order.push(token);
        }
    }
    let mut merges: Vec<(f64, usize, usize, &str, &str)> = Vec::new();
    for token in order {
        let score = score_of[token];
        let mut local: Vec<(u32, u32, &str, &str)> = token
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (left, right) = token.split_at(at);
                Some((*ids.get(left)?, *ids.get(right)?, left, right))
            })
            .collect();
        local.sort_by_key(|&(l, r, _, _)| (l, r));
        merges.extend(local.into_iter().map(|(_, _, l, r)| (score, l.chars().count(), r.chars().count(), l, r)));
    }
    merges.sort_by(|a, b| (b.0, b.1, b.2).partial_cmp(&(a.0, a.1, a.2)).unwrap_or(std::cmp::Ordering::Equal));
    merges.into_iter().map(|(_, _, _, l, r)| (l.to_string(), r.to_string())).collect()
}

/// GPT-2's byte-level alphabet, inverted: the byte each of its 256 characters stands for.
/// Printable bytes stand for themselves; the others (control bytes, space, 127-160, 173) were
/// moved to 256 + n in order.
fn byte_level_bytes(token: &str) -> Option<Vec<u8>> {
    static INVERSE: std::sync::OnceLock<HashMap<char, u8>> = std::sync::OnceLock::new();
    let inverse = INVERSE.get_or_init(|| {
        let mut map = HashMap::new();
        let mut moved = 0u32;
        for b in 0..=255u8 {
            let printable = matches!(b, 33..=126 | 161..=172 | 174..=255);
            let c = if printable {
                char::from(b)
            } else {
                moved += 1;
                char::from_u32(255 + moved).unwrap_or(char::REPLACEMENT_CHARACTER)
            };
            map.insert(c, b);
        }
        map
    });
    token.chars().map(|c| inverse.get(&c).copied()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Value {
        Value::Array(items.iter().map(|s| Value::String(s.to_string())).collect())
    }

    /// A tiny SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, one byte token, "▁hi" and its
    /// parts, and the control token `<|user|>`.
    fn spm_metadata(architecture: &str) -> HashMap<String, Value> {
        let tokens = ["<unk>", "<s>", "</s>", "<0x0A>", "▁", "h", "i", "▁h", "hi", "▁hi", "<|user|>"];
        let scores = [0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, 0.0];
        let types = [2, 3, 3, 6, 1, 1, 1, 1, 1, 1, 3];
        HashMap::from([
            ("general.architecture".to_string(), Value::String(architecture.to_string())),
            ("tokenizer.ggml.model".to_string(), Value::String("llama".to_string())),
            ("tokenizer.ggml.tokens".to_string(), strings(&tokens)),
            ("tokenizer.ggml.scores".to_string(), Value::Array(scores.iter().map(|&s| Value::F32(s)).collect())),
            ("tokenizer.ggml.token_type".to_string(), Value::Array(types.iter().map(|&t| Value::I32(t)).collect())),
            ("tokenizer.ggml.unknown_token_id".to_string(), Value::U32(0)),
            ("tokenizer.ggml.bos_token_id".to_string(), Value::U32(1)),
            ("tokenizer.ggml.eos_token_id".to_string(), Value::U32(2)),
        ])
    }

    #[test]
    fn other_tokenizer_models_are_refused_by_name() {
        let mut metadata = spm_metadata("bert");
        metadata.insert("tokenizer.ggml.model".to_string(), Value::String("bert".to_string()));
        let err = Tokenizer::from_gguf(&metadata).expect_err("refused").to_string();
        assert!(err.contains("`bert` is not supported"), "{err}");
    }

    /// A byte-level BPE vocabulary of the digits 1-5 with the merges "1 2", "12 3" and
    /// "4 5", split as `pre` names.
    fn gpt2_metadata(pre: Option<&str>) -> HashMap<String, Value> {
        let mut m = HashMap::from([
            ("tokenizer.ggml.model".to_string(), Value::String("gpt2".to_string())),
            ("tokenizer.ggml.tokens".to_string(), strings(&["1", "2", "3", "4", "5", "12", "123", "45"])),
            ("tokenizer.ggml.merges".to_string(), strings(&["1 2", "12 3", "4 5"])),
        ]);
        if let Some(pre) = pre {
            m.insert("tokenizer.ggml.pre".to_string(), Value::String(pre.to_string()));
        }
        m
    }

    #[test]
    fn byte_level_vocabularies_split_as_their_file_says() {
        let ids =
            |pre| Tokenizer::from_gguf(&gpt2_metadata(Some(pre))).expect("builds").encode("12345").expect("encodes");
        // Llama 3 keeps up to three digits together before merging; Qwen and SmolLM split
        // every digit, so no merge applies.
        assert_eq!(ids("llama-bpe"), [6, 7]);
        assert_eq!(ids("qwen2"), [0, 1, 2, 3, 4]);
        assert_eq!(ids("smollm"), [0, 1, 2, 3, 4]);
        let err = Tokenizer::from_gguf(&gpt2_metadata(None)).expect_err("refused").to_string();
        assert!(err.contains("tokenizer.ggml.pre"), "{err}");

        // A piece that is a token is taken whole by Llama 3 (tiktoken's rule), merged up to by
        // Qwen: here "b c" merges first and nothing joins "a" to "bc".
        let mut m = gpt2_metadata(Some("llama-bpe"));
        m.insert("tokenizer.ggml.tokens".to_string(), strings(&["a", "b", "c", "bc", "abc"]));
        m.insert("tokenizer.ggml.merges".to_string(), strings(&["b c"]));
        assert_eq!(Tokenizer::from_gguf(&m).expect("builds").encode("abc").expect("encodes"), [4]);
        m.insert("tokenizer.ggml.pre".to_string(), Value::String("qwen2".to_string()));
        assert_eq!(Tokenizer::from_gguf(&m).expect("builds").encode("abc").expect("encodes"), [0, 3]);
    }

    #[test]
    fn raw_prompts_start_with_bos_as_the_file_says() {
        let mut m = gpt2_metadata(Some("llama-bpe"));
        m.insert("tokenizer.ggml.tokens".to_string(), strings(&["1", "2", "3", "4", "5", "12", "123", "45", "<s>"]));
        let types = [1, 1, 1, 1, 1, 1, 1, 1, GGUF_TOKEN_CONTROL];
        m.insert("tokenizer.ggml.token_type".to_string(), Value::Array(types.iter().map(|&t| Value::I32(t)).collect()));
        m.insert("tokenizer.ggml.bos_token_id".to_string(), Value::U32(8));
        // Llama 3 starts texts with BOS (llama.cpp's rule for `llama-bpe`), once.
        let llama3 = Tokenizer::from_gguf(&m).expect("builds");
        assert_eq!(llama3.encode_prompt("45").expect("encodes"), [8, 7]);
        assert_eq!(llama3.encode_prompt("<s>45").expect("encodes"), [8, 7], "written out: not doubled");
        assert_eq!(llama3.encode("45").expect("encodes"), [7]);
        // The file's own `add_bos_token` decides where it has one.
        m.insert("tokenizer.ggml.add_bos_token".to_string(), Value::Bool(false));
        assert_eq!(Tokenizer::from_gguf(&m).expect("builds").encode_prompt("45").expect("encodes"), [7]);
        m.remove("tokenizer.ggml.add_bos_token");
        m.insert("tokenizer.ggml.pre".to_string(), Value::String("qwen2".to_string()));
        assert_eq!(Tokenizer::from_gguf(&m).expect("builds").encode_prompt("45").expect("encodes"), [3, 4]);
        // SentencePiece: BOS unless the file says otherwise.
        let spm = Tokenizer::from_gguf(&spm_metadata("llama")).expect("builds");
        assert_eq!(spm.encode_prompt("hi").expect("encodes"), [1, 9]);
    }

    #[test]
    fn merges_follow_transformers_generate_merges() {
        let tokens: Vec<String> = ["<unk>", "<s>", "</s>", "<0x0A>", "▁", "h", "i", "▁h", "hi", "▁hi", "<|user|>"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let scores = [0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, 0.0];
        // transformers.tokenization_utils_base.generate_merges(vocab, dict(zip(tokens, scores)))
        let expected = [("▁", "h"), ("h", "i"), ("▁h", "i"), ("▁", "hi")];
        let merges = merges_from_scores(&tokens, &scores);
        assert_eq!(merges, expected.map(|(a, b)| (a.to_string(), b.to_string())));
    }

    #[test]
    fn sentencepiece_vocabulary_as_sentencepiece_splits_it() {
        let tok = Tokenizer::from_gguf(&spm_metadata("llama")).expect("builds");
        // sentencepiece's dummy prefix: "▁" before the text and after a special token, even
        // before a leading space (llama.cpp's ids on its Llama-2 vocabulary test, all 46 cases:
        // tests/gguf_llamacpp_vocabs.rs).
        assert_eq!(tok.encode("hi hi").expect("encodes"), [9, 9]);
        assert_eq!(tok.encode("\n").expect("encodes"), [4, 3]);
        assert_eq!(tok.encode("<|user|>hi hi").expect("encodes"), [10, 9, 9]);
        assert_eq!(tok.encode(" hi").expect("encodes"), [4, 9]);
        // No byte token for "x": the unknown token (transformers sets none and drops it).
        assert_eq!(tok.encode("x").expect("encodes"), [4, 0]);
        assert_eq!(tok.decode(&[9, 9], false).expect("decodes"), "hi hi");
        assert_eq!(tok.decode(&[10, 8, 9], true).expect("decodes"), "hi hi");
        assert_eq!(tok.eos_ids(), [2]);
        let mut turn_end = spm_metadata("phi3");
        if let Some(Value::Array(tokens)) = turn_end.get_mut("tokenizer.ggml.tokens") {
            tokens[10] = Value::String("<|end|>".into());
        }
        let ends = Tokenizer::from_gguf(&turn_end).expect("builds");
        assert_eq!(ends.eos_ids(), [2, 10], "a chat format's end of turn ends generation too");
        assert_eq!(tok.bos_id(), Some(1));
        assert_eq!(tok.vocab_size(), 11);
        assert_eq!(tok.token_bytes(9), b" hi");
        assert_eq!(tok.token_bytes(3), b"\n");
        assert_eq!(tok.token_bytes(10), b"<|user|>");

        // Phi-3: "▁" put before any text, even one that starts with a space.
        let phi3 = Tokenizer::from_gguf(&spm_metadata("phi3")).expect("builds");
        assert_eq!(phi3.encode(" hi").expect("encodes"), [4, 9]);
        assert_eq!(phi3.decode(&[4, 9], false).expect("decodes"), " hi");

        // add_space_prefix = false: no "▁" before the text, and none taken off in decoding.
        let mut metadata = spm_metadata("llama");
        metadata.insert("tokenizer.ggml.add_space_prefix".to_string(), Value::Bool(false));
        let bare = Tokenizer::from_gguf(&metadata).expect("builds");
        assert_eq!(bare.encode("hi hi").expect("encodes"), [8, 9]);
        assert_eq!(bare.decode(&[8, 9], false).expect("decodes"), "hi hi");
    }
}
