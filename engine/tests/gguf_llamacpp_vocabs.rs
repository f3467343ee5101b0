//! GGUF vocabularies against llama.cpp's own tokenizer tests: the vocabulary-only files
//! `models/ggml-vocab-<name>.gguf` of llama.cpp's source (byte-level BPE: Llama 3's, Qwen2's,
//! GPT-2's; SentencePiece: Llama 2's), with their `.inp` inputs and `.out` ids (which
//! llama.cpp checks against Hugging Face `tokenizers` on each family's tokenizer.json). Those
//! files are 2-8 MB each and live in llama.cpp's source, not in this repository: the test
//! reads them from `$PD_LLAMACPP_MODELS`, by default `target/llamacpp/src/vendor/llama.cpp/models`,
//! where `bench/engine-vs-llamacpp.sh --build` unpacks them. Run by hand:
//!
//!     bench/engine-vs-llamacpp.sh --build
//!     cargo test --release -p pd-engine --test gguf_llamacpp_vocabs -- --ignored
//!
//! Without these files: the splitting rules are unit-tested in `tokenizer::pre`, the
//! SentencePiece rules in `tokenizer`, and Phi-3's vocabulary (committed) in
//! `gguf_spm_tokenizer`.

mod common;

use std::path::PathBuf;

use pd_engine::loader::gguf::GgufFile;
use pd_engine::Tokenizer;

fn models() -> PathBuf {
    match std::env::var_os("PD_LLAMACPP_MODELS") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/llamacpp/src/vendor/llama.cpp/models"),
    }
}

/// Encodes every case of `ggml-vocab-<name>.gguf` and decodes the ids back.
fn check(name: &str) {
    let path = models().join(format!("ggml-vocab-{name}.gguf"));
    assert!(path.exists(), "{} is missing: run bench/engine-vs-llamacpp.sh --build", path.display());
    let file = GgufFile::open(&path, &candle_core::Device::Cpu).expect("open the GGUF");
    let tok = Tokenizer::from_gguf(file.metadata()).expect("build the tokenizer");
    // Llama 2 and 3 start a raw prompt with BOS (llama.cpp's `add_bos`); Qwen and GPT-2 do not.
    assert_eq!(tok.adds_bos(), name.starts_with("llama"), "{name}");
    let cases = common::llama_cpp_vocab_cases(&path);
    let mut failures = Vec::new();
    for (text, want) in &cases {
        let got = tok.encode(text).expect("encode");
        if &got != want {
            failures.push(format!("{text:?}\n   pd: {got:?}\n  cpp: {want:?}"));
        }
        // The ids give the text back exactly (SentencePiece's dummy prefix comes off again).
        assert_eq!(&tok.decode(want, false).expect("decode"), text, "{name}: decoding {want:?}");
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {} cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
#[ignore = "needs llama.cpp's vocabulary files (bench/engine-vs-llamacpp.sh --build)"]
fn llama3_vocabulary_encodes_every_llama_cpp_case() {
    check("llama-bpe");
}

#[test]
#[ignore = "needs llama.cpp's vocabulary files (bench/engine-vs-llamacpp.sh --build)"]
fn qwen2_vocabulary_encodes_every_llama_cpp_case() {
    check("qwen2");
}

#[test]
#[ignore = "needs llama.cpp's vocabulary files (bench/engine-vs-llamacpp.sh --build)"]
fn gpt2_vocabulary_encodes_every_llama_cpp_case() {
    check("gpt-2");
}

#[test]
#[ignore = "needs llama.cpp's vocabulary files (bench/engine-vs-llamacpp.sh --build)"]
fn llama2_sentencepiece_vocabulary_encodes_every_llama_cpp_case() {
    check("llama-spm");
}
