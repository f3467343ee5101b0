//! A GGUF SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`) against its references:
//! llama.cpp's own tokenizer test for Phi-3 (data/tokenizers/ggml-vocab-phi-3.gguf, with
//! `.inp` / `.out` from llama.cpp's models/, MIT licensed), and Hugging Face transformers'
//! `AutoTokenizer.from_pretrained(dir, gguf_file=...)`, which gives the same ids on all 46
//! cases. The extra strings' ids below were taken from transformers 5.25.
//!
//! The `.inp` file holds the inputs, each followed by a line `__ggml_vocab_test__`; `.out` the
//! ids of each input, one line each, without BOS (llama.cpp's test-tokenizer-0 tokenizes with
//! `add_special = false`, and so does `Tokenizer::encode`).

mod common;

use std::path::PathBuf;

use candle_core::quantized::gguf_file::Value;
use pd_engine::loader::gguf::GgufFile;
use pd_engine::Tokenizer;

fn phi3_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizers/ggml-vocab-phi-3.gguf")
}

fn phi3() -> Tokenizer {
    let file = GgufFile::open(&phi3_path(), &candle_core::Device::Cpu).expect("open the GGUF");
    Tokenizer::from_gguf(file.metadata()).expect("build the tokenizer")
}

/// llama.cpp's test cases for the Phi-3 vocabulary.
fn cases() -> Vec<(String, Vec<u32>)> {
    common::llama_cpp_vocab_cases(&phi3_path())
}

#[test]
fn phi3_encodes_every_llama_cpp_case() {
    let tok = phi3();
    let cases = cases();
    assert_eq!(cases.len(), 46);
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|(text, want)| {
            let got = tok.encode(text).expect("encode");
            (&got != want).then(|| format!("{text:?}\n   pd: {got:?}\n  cpp: {want:?}"))
        })
        .collect();
    assert!(failures.is_empty(), "{} of {} cases differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

/// Phi-3 puts "▁" before every text (even one starting with a space) and decoding strips one
/// leading space, so plain text comes back unchanged.
#[test]
fn phi3_decodes_back_to_the_text() {
    let tok = phi3();
    for (text, ids) in cases() {
        assert_eq!(tok.decode(&ids, false).expect("decode"), text, "ids {ids:?}");
    }
    let text = "Grüße aus Köln — 東京 🦙!";
    let ids = tok.encode(text).expect("encodes");
    assert_eq!(ids, [1632, 29993, 5831, 1770, 20763, 813, 29871, 30591, 30675, 29871, 243, 162, 169, 156, 29991]);
    assert_eq!(tok.decode(&ids, false).expect("decodes"), text);
    let text = "  leading and trailing  ";
    assert_eq!(tok.encode(text).expect("encodes"), [259, 8236, 322, 25053, 259]);
    assert_eq!(tok.decode(&tok.encode(text).expect("encodes"), false).expect("decodes"), text);
}

#[test]
fn phi3_special_tokens_are_whole_and_ids_right() {
    let tok = phi3();
    for (text, id) in [
        ("<|user|>", 32010),
        ("<|end|>", 32007),
        ("<|assistant|>", 32001),
        ("<|system|>", 32006),
        ("<|endoftext|>", 32000),
        ("<s>", 1),
        ("</s>", 2),
        ("<unk>", 0),
    ] {
        assert_eq!(tok.encode(text).expect("encodes"), [id], "{text}");
        assert_eq!(tok.token_to_id(text), Some(id));
    }
    // The text after a special token gets its own "▁" (as transformers gives, and decodes as a
    // space: a chat prompt does not round-trip through decode byte for byte).
    let chat = "<|system|>\nYou are helpful.<|end|>\n<|user|>\nWhat's 2+2?<|end|>\n<|assistant|>\n";
    let ids = tok.encode(chat).expect("encodes");
    assert_eq!(
        ids,
        [
            32006, 29871, 13, 3492, 526, 8444, 29889, 32007, 29871, 13, 32010, 29871, 13, 5618, 29915, 29879, 29871,
            29906, 29974, 29906, 29973, 32007, 29871, 13, 32001, 29871, 13
        ]
    );
    assert_eq!(
        tok.decode(&ids, false).expect("decodes"),
        "<|system|> \nYou are helpful.<|end|> \n<|user|> \nWhat's 2+2?<|end|> \n<|assistant|> \n"
    );
    assert_eq!(tok.decode(&ids, true).expect("valid"), "\nYou are helpful. \n \nWhat's 2+2? \n \n");

    // The file names `<|endoftext|>` as eos; Phi-3 ends its turns with `<|end|>` (its
    // generation config lists both), which stops generation as in llama.cpp.
    assert_eq!(tok.eos_ids(), [32000, 32007]);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.vocab_size(), 32064);
    // Bytes of pieces: a byte token is its byte, "▁" a space, added tokens their text.
    assert_eq!(tok.token_bytes(13), b"\n");
    assert_eq!(tok.token_bytes(15043), b" Hello");
    assert_eq!(tok.token_bytes(259), b"  ");
    assert_eq!(tok.token_bytes(32007), b"<|end|>");
}

#[test]
fn other_tokenizer_models_are_refused_by_name() {
    let file = GgufFile::open(&phi3_path(), &candle_core::Device::Cpu).expect("valid");
    let mut metadata = file.metadata().clone();
    metadata.insert("tokenizer.ggml.model".to_string(), Value::String("bert".to_string()));
    let err = Tokenizer::from_gguf(&metadata).expect_err("refused").to_string();
    assert!(err.contains("`bert`"), "{err}");
}
