//! Every model family against Hugging Face transformers: tiny random checkpoints of Llama
//! (plain, tied, and with each rope scaling type), Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and
//! Gemma 3 (with sliding windows short enough to bite), written by
//! transformers with its logits and greedy tokens (scripts/reference/families.py, committed
//! under tests/data/families). pd loads each folder, prefills the prompt, then decodes the
//! greedy tokens one step at a time from its own KV cache; every position's logits must be
//! within the bound of its dtype and the 32 greedy tokens identical. The GGUF files written
//! from the same weights in llama.cpp's layout (Q/K permuted for Llama, Llama 3.1's scaling as
//! `rope_freqs`) must give the same answers.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use pd_engine::loader::gguf::GgufFile;
use pd_engine::loader::hf::HfFolder;
use pd_engine::{BatchSeq, CacheConfig, KvCache, KvCacheDType, Model, SequenceKv, WeightFormat};

#[derive(serde::Deserialize)]
struct Reference {
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

fn families() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/families");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.expect("entry").path())
        .filter(|p| p.join("reference.json").is_file())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 15, "expected the fifteen family fixtures, found {dirs:?}");
    dirs
}

fn load(dir: &Path, format: WeightFormat) -> (Model, Reference) {
    let mut folder = HfFolder::open(dir, &Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let config = folder.model_config().unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let model =
        Model::load(config, &mut folder, format, &Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    (model, reference(dir))
}

fn load_gguf(dir: &Path, format: WeightFormat) -> Option<Model> {
    let path = dir.join("model.gguf");
    if !path.is_file() {
        return None;
    }
    let mut file = GgufFile::open(&path, &Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let config = file.model_config().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Some(Model::load(config, &mut file, format, &Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

fn reference(dir: &Path) -> Reference {
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    serde_json::from_str(&text).expect("reference parses")
}

fn row_diff(row: &Tensor, reference: &[f32]) -> f32 {
    let row = row.to_vec1::<f32>().expect("logits");
    assert_eq!(row.len(), reference.len(), "vocabulary size");
    row.iter().zip(reference).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
}

fn argmax(row: &Tensor) -> u32 {
    let row = row.to_vec1::<f32>().expect("logits");
    (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b])).expect("non-empty") as u32
}

/// Prefills the prompt (logits of every row), then decodes greedily; returns the largest
/// logit difference to the reference and the greedy tokens.
fn run(model: &Model, reference: &Reference, kv_dtype: KvCacheDType) -> (f32, Vec<u32>) {
    let cache = KvCache::new(
        model.config(),
        &CacheConfig { block_size: 4, prefix_cache: false, dtype: kv_dtype, ..CacheConfig::with_blocks(32) },
        &Device::Cpu,
    )
    .expect("cache");
    let mut kv = SequenceKv::new(cache.block_manager().empty_allocation());
    let prompt = &reference.prompt;
    let mut batch = [BatchSeq { tokens: prompt, kv: &mut kv, want_logits: true }];
    let rows = model.forward_rows(&cache, &mut batch, &[true], &mut |_| std::ops::ControlFlow::Continue(()));
    let rows = rows.expect("prefill");
    let mut worst = 0f32;
    for (i, reference_row) in reference.logits.iter().take(prompt.len()).enumerate() {
        worst = worst.max(row_diff(&rows.get(i).expect("row"), reference_row));
    }
    let mut last = rows.get(prompt.len() - 1).expect("last row");
    let mut greedy = Vec::new();
    for step in 0..reference.greedy.len() {
        let token = argmax(&last);
        greedy.push(token);
        // Decode the reference's token, so one flipped near-tie does not hide later positions.
        let next = [reference.greedy[step]];
        let logits = model.forward(&cache, &mut [BatchSeq { tokens: &next, kv: &mut kv, want_logits: true }]);
        last = logits.expect("decode step").get(0).expect("row");
        worst = worst.max(row_diff(&last, &reference.logits[prompt.len() + step]));
    }
    (worst, greedy)
}

#[test]
fn every_family_matches_transformers_in_f32() {
    for dir in families() {
        let (model, reference) = load(&dir, WeightFormat::F32);
        let (worst, greedy) = run(&model, &reference, KvCacheDType::F32);
        let name = dir.file_name().expect("valid").to_string_lossy().to_string();
        println!("{name}: max |logit - transformers| {worst:.2e}");
        assert!(worst < 2e-4, "{name}: logits differ from transformers' by {worst}");
        assert_eq!(greedy, reference.greedy, "{name}: greedy tokens");
    }
}

/// The serving defaults (f16 KV cache, weights in the default `wq` format, which keeps these
/// bf16 weights as f16): a looser logit bound, and the same tokens wherever transformers'
/// top two are apart by more than that bound.
#[test]
fn every_family_matches_transformers_with_serving_defaults() {
    for dir in families() {
        let (model, reference) = load(&dir, WeightFormat::Wq);
        let (worst, greedy) = run(&model, &reference, KvCacheDType::F16);
        let name = dir.file_name().expect("valid").to_string_lossy().to_string();
        println!("{name}: max |logit - transformers| {worst:.2e} (f16)");
        assert!(worst < 0.06, "{name}: logits differ from transformers' by {worst}");
        for (step, (&ours, &theirs)) in greedy.iter().zip(&reference.greedy).enumerate() {
            let row = &reference.logits[reference.prompt.len() - 1 + step];
            let mut sorted = row.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] > 0.2 {
                assert_eq!(ours, theirs, "{name}: greedy token {step}");
            }
        }
    }
}

/// Prompt and greedy tokens prefilled as one sequence in chunks of 10 (as a prefill worker
/// chunks a long prompt): every row's logits match transformers', so the masks of chunks
/// that start past a sliding window (and the keys they gather) are right too.
#[test]
fn every_family_matches_transformers_when_prefilled_in_chunks() {
    for dir in families() {
        let (model, reference) = load(&dir, WeightFormat::F32);
        let name = dir.file_name().expect("valid").to_string_lossy().to_string();
        let cache = KvCache::new(
            model.config(),
            &CacheConfig {
                block_size: 4,
                prefix_cache: false,
                dtype: KvCacheDType::F32,
                ..CacheConfig::with_blocks(32)
            },
            &Device::Cpu,
        )
        .expect("cache");
        let mut kv = SequenceKv::new(cache.block_manager().empty_allocation());
        let all: Vec<u32> = reference.prompt.iter().chain(&reference.greedy).copied().collect();
        let mut worst = 0f32;
        for (c, chunk) in all.chunks(10).enumerate() {
            let mut batch = [BatchSeq { tokens: chunk, kv: &mut kv, want_logits: true }];
            let rows = model.forward_rows(&cache, &mut batch, &[true], &mut |_| std::ops::ControlFlow::Continue(()));
            let rows = rows.unwrap_or_else(|e| panic!("{name}: chunk {c}: {e}"));
            for i in 0..chunk.len() {
                let row = rows.get(i).expect("row");
                worst = worst.max(row_diff(&row, &reference.logits[c * 10 + i]));
            }
        }
        println!("{name}: max |logit - transformers| {worst:.2e} (chunks of 10)");
        assert!(worst < 2e-4, "{name}: chunked prefill logits differ from transformers' by {worst}");
    }
}

#[test]
fn gguf_files_of_the_same_weights_match_transformers() {
    let mut checked = Vec::new();
    for dir in families() {
        let Some(model) = load_gguf(&dir, WeightFormat::F32) else { continue };
        let reference = reference(&dir);
        let (worst, greedy) = run(&model, &reference, KvCacheDType::F32);
        let name = dir.file_name().expect("valid").to_string_lossy().to_string();
        println!("{name}.gguf: max |logit - transformers| {worst:.2e}");
        assert!(worst < 2e-4, "{name}.gguf: logits differ from transformers' by {worst}");
        assert_eq!(greedy, reference.greedy, "{name}.gguf: greedy tokens");
        checked.push(name);
    }
    assert!(checked.len() >= 11, "GGUF fixtures checked: {checked:?}");
}

/// A copy of fixture `name` with its config.json changed by `edit`, loaded as the engine would.
fn load_edited(name: &str, edit: impl Fn(&mut serde_json::Value)) -> pd_engine::EngineError {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/families").join(name);
    let dir = tempfile::tempdir().expect("tempdir");
    for file in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(file), dir.path().join(file)).expect("copy");
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).expect("config")).expect("json");
    edit(&mut config);
    std::fs::write(dir.path().join("config.json"), config.to_string()).expect("write");
    let options = pd_engine::LoadOptions { weights: WeightFormat::F32, ..Default::default() };
    pd_engine::load_model(dir.path(), options).expect_err("must be refused")
}

#[test]
fn settings_and_tensors_the_engine_would_ignore_are_refused_by_name() {
    // Qwen2's biases under a config that says Llama: the biases would be dropped silently.
    let err = load_edited("qwen2", |c| {
        c["model_type"] = "llama".into();
        c["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
    });
    assert!(matches!(&err, pd_engine::EngineError::UnusedTensor(n) if n.contains("_proj.bias")), "{err}");
    let err = load_edited("llama3-rope", |c| c["rope_parameters"]["rope_type"] = "longrope2".into());
    assert!(err.to_string().contains("rope_parameters.rope_type"), "{err}");
    // LongRoPE without its factor lists, or with lists that do not fit the rotated values.
    let err = load_edited("llama3-rope", |c| c["rope_parameters"]["rope_type"] = "longrope".into());
    assert!(err.to_string().contains("rope_parameters.short_factor"), "{err}");
    let err = load_edited("phi4-mini", |c| c["rope_parameters"]["short_factor"] = serde_json::json!(vec![1.0f64; 8]));
    assert!(err.to_string().contains("short_factor has 8 values, the head rotates 6"), "{err}");
    // Partial rotary outside Phi-3's layout (transformers' Llama layer would ignore it).
    let err = load_edited("llama", |c| c["partial_rotary_factor"] = 0.5.into());
    assert!(err.to_string().contains("partial_rotary_factor"), "{err}");
    let err = load_edited("llama-tied", |c| c["tie_word_embeddings"] = false.into());
    assert!(matches!(&err, pd_engine::EngineError::MissingTensor(n) if n == "lm_head.weight"), "{err}");
    let err = load_edited("qwen3", |c| c["model_type"] = "gemma3n_text".into());
    assert!(matches!(&err, pd_engine::EngineError::UnsupportedArchitecture(a) if a == "gemma3n_text"), "{err}");
}
