//! Text <-> token ids. For GGUF checkpoints the tokenizer is built from the file's own vocab
//! and merges (byte-level BPE, digits split one by one, control tokens special), which
//! reproduces llama.cpp's ids; for Hugging Face folders it is read from tokenizer.json.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper};

use crate::constraint::Grammars;
use crate::error::{EngineError, Result};

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
        if model != "gpt2" {
            return Err(EngineError::Tokenizer(format!(
                "tokenizer model `{model}` is not supported (byte-level BPE `gpt2` is)"
            )));
        }
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
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(tok_err)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre: Vec<PreTokenizerWrapper> = vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()];
        inner.with_pre_tokenizer(Some(Sequence::new(pre)));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == GGUF_TOKEN_CONTROL || t == GGUF_TOKEN_USER_DEFINED)
            .map(|(text, _)| AddedToken::from(text.clone(), true))
            .collect();
        inner.add_special_tokens(special).map_err(tok_err)?;
        let id = |key: &str| metadata.get(key).and_then(|v| v.to_u32().ok());
        let eos_ids: Vec<u32> =
            ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"].iter().filter_map(|k| id(k)).collect();
        Ok(Tokenizer { inner, eos_ids, bos_id: id("tokenizer.ggml.bos_token_id"), grammars: Default::default() })
    }

    /// Reads a Hugging Face `tokenizer.json`; `eos_ids` and `bos_id` come from config.json.
    pub fn from_file(path: &Path, eos_ids: Vec<u32>, bos_id: Option<u32>) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| EngineError::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Tokenizer { inner, eos_ids, bos_id, grammars: Default::default() })
    }

    /// Token ids of `text`. Special-token markup in the text (`<|im_start|>`) becomes the
    /// special token; no BOS is added (chat templates write their own).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self.inner.encode(text, false).map_err(tok_err)?;
        Ok(encoding.get_ids().to_vec())
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

    /// Wraps an already built `tokenizers` tokenizer.
    pub fn from_inner(inner: tokenizers::Tokenizer, eos_ids: Vec<u32>, bos_id: Option<u32>) -> Self {
        Tokenizer { inner, eos_ids, bos_id, grammars: Default::default() }
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
        Ok(Tokenizer { inner, eos_ids: vec![63], bos_id: Some(62), grammars: Default::default() })
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
        match self.decode(&[id], false).unwrap_or_default() {
            // A decoder that drops a lone token's text (a bare space): the vocabulary's own.
            text if text.is_empty() => self.id_to_token(id).unwrap_or_default().into_bytes(),
            text => text.into_bytes(),
        }
    }
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
