//! Engine numerics and error handling on a tiny random-weight Llama built by the test:
//! batching, chunking and KV export/import must not change the math; bad input must give
//! typed errors that name the problem.

mod common;

use candle_core::Device;
use common::{max_diff, run_alone, tiny_config, tiny_weights, tokens, write_gguf, write_hf_folder, MapSource};
use pd_engine::{
    load_model, BatchSeq, CacheConfig, EngineError, KvCache, LoadOptions, Model, SequenceKv, WeightFormat, WireDType,
};

fn tiny_model(seed: u64) -> Model {
    tiny_model_as(seed, WeightFormat::F32)
}

fn tiny_model_as(seed: u64, format: WeightFormat) -> Model {
    let config = tiny_config();
    let mut source = MapSource(tiny_weights(&config, seed));
    Model::load(config, &mut source, format, &Device::Cpu).expect("tiny model loads")
}

/// The dense formats, whose batching and chunking must not change the numbers.
const DENSE: [WeightFormat; 2] = [WeightFormat::F32, WeightFormat::F16];

fn cache_for(model: &Model, blocks: usize, block_size: usize) -> KvCache {
    KvCache::new(
        model.config(),
        &CacheConfig { block_size, prefix_cache: false, ..CacheConfig::with_blocks(blocks) },
        &Device::Cpu,
    )
    .expect("cache")
}

#[test]
fn mixed_batch_equals_each_sequence_alone() {
    for format in DENSE {
        mixed_batch_case(&tiny_model_as(1, format));
    }
}

fn mixed_batch_case(model: &Model) {
    let cache = cache_for(model, 64, 4);
    let blocks = cache.block_manager();
    let (a_prompt, b_prompt, c_prompt) = (tokens(5, 1), tokens(7, 2), tokens(9, 3));
    let (a_next, c_next) = ([11u32], [42u32]);

    // Alone: each sequence in its own forward calls.
    let mut a = SequenceKv::new(blocks.empty_allocation());
    let a_alone = run_alone(model, &cache, &mut a, &[&a_prompt, &a_next]);
    let mut b = SequenceKv::new(blocks.empty_allocation());
    let b_alone = run_alone(model, &cache, &mut b, &[&b_prompt]);
    let mut c = SequenceKv::new(blocks.empty_allocation());
    let c_alone = run_alone(model, &cache, &mut c, &[&c_prompt, &c_next]);

    // Together: A and C prefilled, then one batch with A's decode token, B's whole prompt
    // as a prefill chunk and C's decode token.
    let mut a2 = SequenceKv::new(blocks.empty_allocation());
    let mut c2 = SequenceKv::new(blocks.empty_allocation());
    run_alone(model, &cache, &mut a2, &[&a_prompt]);
    run_alone(model, &cache, &mut c2, &[&c_prompt]);
    let mut b2 = SequenceKv::new(blocks.empty_allocation());
    let together = model
        .forward(
            &cache,
            &mut [
                BatchSeq { tokens: &a_next, kv: &mut a2, want_logits: true },
                BatchSeq { tokens: &b_prompt, kv: &mut b2, want_logits: true },
                BatchSeq { tokens: &c_next, kv: &mut c2, want_logits: true },
            ],
        )
        .expect("mixed batch");
    assert_eq!(together.dims(), &[3, 64]);
    for (i, alone) in [a_alone, b_alone, c_alone].iter().enumerate() {
        let row = together.get(i).expect("row");
        let diff = max_diff(&row, alone);
        assert!(diff < 1e-4, "sequence {i}: batched logits differ by {diff}");
    }
    assert_eq!((a2.len(), b2.len(), c2.len()), (6, 7, 10));
}

#[test]
fn chunked_prefill_equals_one_shot() {
    for format in DENSE {
        chunked_case(&tiny_model_as(2, format));
    }
}

fn chunked_case(model: &Model) {
    let cache = cache_for(model, 64, 4);
    let blocks = cache.block_manager();
    let prompt = tokens(23, 4);
    let next = [17u32];
    let mut whole = SequenceKv::new(blocks.empty_allocation());
    let reference_prompt = run_alone(model, &cache, &mut whole, &[&prompt]);
    let reference_next = run_alone(model, &cache, &mut whole, &[&next]);
    for chunk in [1, 3, 4, 7, 16] {
        let mut kv = SequenceKv::new(blocks.empty_allocation());
        let pieces: Vec<&[u32]> = prompt.chunks(chunk).collect();
        let after_prompt = run_alone(model, &cache, &mut kv, &pieces);
        let after_next = run_alone(model, &cache, &mut kv, &[&next]);
        let d1 = max_diff(&after_prompt, &reference_prompt);
        let d2 = max_diff(&after_next, &reference_next);
        assert!(d1 < 1e-4 && d2 < 1e-4, "chunk {chunk}: differs by {d1} / {d2}");
    }
}

#[test]
fn a_step_stopped_between_layers_advances_nothing_and_runs_again_to_the_same_logits() {
    let model = tiny_model(7);
    let layers = model.config().num_layers;
    assert!(layers >= 2, "the tiny model needs two layers to stop between them");
    let cache = cache_for(&model, 64, 4);
    let blocks = cache.block_manager();
    let (prompt, rest) = (tokens(9, 5), tokens(11, 6));
    let mut reference = SequenceKv::new(blocks.empty_allocation());
    let expected = run_alone(&model, &cache, &mut reference, &[&prompt, &rest]);

    let mut kv = SequenceKv::new(blocks.empty_allocation());
    run_alone(&model, &cache, &mut kv, &[&prompt]);
    let mut seen = Vec::new();
    let stopped =
        model.forward_observed(&cache, &mut [BatchSeq { tokens: &rest, kv: &mut kv, want_logits: true }], &mut |l| {
            seen.push(l);
            if l == 0 {
                std::ops::ControlFlow::Break(())
            } else {
                std::ops::ControlFlow::Continue(())
            }
        });
    assert!(matches!(stopped, Err(EngineError::Preempted { layers: 1 })), "{stopped:?}");
    assert_eq!(seen, vec![0], "no layer after the stop ran");
    assert_eq!(kv.len(), prompt.len(), "the stopped chunk did not advance the sequence");
    // The same chunk again: its half-written K/V are overwritten, the logits are the reference's.
    let again = run_alone(&model, &cache, &mut kv, &[&rest]);
    let diff = max_diff(&again, &expected);
    assert!(diff < 1e-5, "after a stop the chunk's logits differ by {diff}");
    assert_eq!(kv.len(), prompt.len() + rest.len());
    drop((kv, reference));
    assert_eq!(blocks.free_blocks(), blocks.total_blocks(), "every block is back");
}

#[test]
fn export_import_into_other_blocks_gives_identical_next_logits() {
    let model = tiny_model(3);
    let source_cache = cache_for(&model, 32, 4);
    let prompt = tokens(13, 5);
    let next = [9u32];
    let mut kv = SequenceKv::new(source_cache.block_manager().empty_allocation());
    run_alone(&model, &source_cache, &mut kv, &[&prompt]);
    let layers = 0..model.config().num_layers;
    let f32_bytes = pd_engine::kv::export::export_kv(&model, &source_cache, &kv, layers.clone(), WireDType::F32)
        .expect("export f32");
    let f16_bytes =
        pd_engine::kv::export::export_kv(&model, &source_cache, &kv, layers, WireDType::F16).expect("export f16");
    assert_eq!(f16_bytes.len() * 2 - pd_engine::kv::export::HEADER_LEN, f32_bytes.len());
    let expected = run_alone(&model, &source_cache, &mut kv, &[&next]);

    for (bytes, tolerance) in [(&f32_bytes, 0.0f32), (&f16_bytes, 2e-2)] {
        let target_cache = cache_for(&model, 32, 4);
        let target_blocks = target_cache.block_manager();
        // Occupy some blocks so the import lands at other block ids than the source's.
        let _occupied = target_blocks.allocate(5).expect("occupy");
        let mut imported =
            pd_engine::kv::export::import_kv(&model, &target_cache, &target_blocks, bytes).expect("import");
        assert_eq!(imported.len(), prompt.len());
        assert_ne!(imported.blocks().ids(), kv.blocks().ids());
        let got = run_alone(&model, &target_cache, &mut imported, &[&next]);
        let diff = max_diff(&got, &expected);
        assert!(diff <= tolerance, "next logits after import differ by {diff} (allowed {tolerance})");
    }
}

#[test]
fn hf_folder_and_gguf_load_the_same_model() {
    let config = tiny_config();
    let weights = tiny_weights(&config, 4);
    let dir = tempfile::tempdir().expect("tempdir");
    write_hf_folder(dir.path(), &config, &weights);
    let options = LoadOptions { weights: WeightFormat::F32, ..LoadOptions::default() };
    let loaded = load_model(dir.path(), options).expect("HF folder loads");
    let in_memory = Model::load(config.clone(), &mut MapSource(weights.clone()), WeightFormat::F32, &Device::Cpu)
        .expect("in-memory model");
    assert_eq!(loaded.model.fingerprint(), in_memory.fingerprint());
    let prompt = tokens(6, 7);
    let cache_a = cache_for(&in_memory, 8, 4);
    let cache_b = cache_for(&loaded.model, 8, 4);
    let mut kv_a = SequenceKv::new(cache_a.block_manager().empty_allocation());
    let mut kv_b = SequenceKv::new(cache_b.block_manager().empty_allocation());
    let a = run_alone(&in_memory, &cache_a, &mut kv_a, &[&prompt]);
    let b = run_alone(&loaded.model, &cache_b, &mut kv_b, &[&prompt]);
    assert_eq!(max_diff(&a, &b), 0.0);
    assert_eq!(loaded.tokenizer.encode("ab c").expect("encode"), vec![0, 1, 60, 2]);
    let chat = loaded.chat_template.expect("template from tokenizer_config.json");
    let text = chat.render(&[pd_engine::ChatMessage::new("user", "hi")], true).expect("render");
    assert_eq!(text, "<s>user: hi\n<s>assistant: ");

    let gguf = dir.path().join("tiny.gguf");
    write_gguf(&gguf, &config, &weights, "llama", &[]);
    let from_gguf = load_model(&gguf, options).expect("GGUF loads");
    assert_eq!(from_gguf.model.config().num_layers, 2);
    assert_eq!(from_gguf.tokenizer.eos_ids(), &[63]);
}

fn load_err(path: &std::path::Path) -> EngineError {
    load_model(path, LoadOptions::default()).expect_err("must be refused")
}

#[test]
fn bad_model_files_get_typed_errors_naming_the_problem() {
    let config = tiny_config();
    let weights = tiny_weights(&config, 5);
    let dir = tempfile::tempdir().expect("tempdir");

    let good = dir.path().join("good.gguf");
    write_gguf(&good, &config, &weights, "llama", &[]);
    let bytes = std::fs::read(&good).expect("read");
    let truncated = dir.path().join("truncated.gguf");
    std::fs::write(&truncated, &bytes[..bytes.len() - 1000]).expect("write");
    let err = load_err(&truncated);
    assert!(matches!(err, EngineError::InvalidGguf { .. }) && err.to_string().contains("truncated"), "{err}");
    let header_only = dir.path().join("header.gguf");
    std::fs::write(&header_only, &bytes[..20]).expect("write");
    assert!(matches!(load_err(&header_only), EngineError::InvalidGguf { .. }));

    let other_arch = dir.path().join("gpt2.gguf");
    write_gguf(&other_arch, &config, &weights, "gpt2", &[]);
    let err = load_err(&other_arch);
    assert!(matches!(err, EngineError::UnsupportedArchitecture(ref a) if a == "gpt2"), "{err}");
    assert!(err.to_string().contains("gpt2"));

    let missing = dir.path().join("missing.gguf");
    write_gguf(&missing, &config, &weights, "llama", &["blk.1.ffn_down.weight"]);
    let err = load_err(&missing);
    assert!(matches!(err, EngineError::MissingTensor(ref n) if n == "blk.1.ffn_down.weight"), "{err}");

    let folder = dir.path().join("hf");
    std::fs::create_dir(&folder).expect("mkdir");
    write_hf_folder(&folder, &config, &weights);
    std::fs::remove_file(folder.join("config.json")).expect("rm");
    let err = load_err(&folder);
    assert!(matches!(err, EngineError::ModelFolder { .. }) && err.to_string().contains("config.json"), "{err}");

    let err = load_err(&dir.path().join("does-not-exist.gguf"));
    assert!(matches!(err, EngineError::Io { .. }), "{err}");
}

#[test]
fn bad_runtime_input_gets_typed_errors_and_leaks_no_blocks() {
    let model = tiny_model(6);
    let cache = cache_for(&model, 4, 4);
    let blocks = cache.block_manager();

    // Longer than the context (96 tokens).
    let mut kv = SequenceKv::new(blocks.empty_allocation());
    let long = tokens(97, 1);
    let err =
        model.forward(&cache, &mut [BatchSeq { tokens: &long, kv: &mut kv, want_logits: true }]).expect_err("too long");
    assert!(matches!(err, EngineError::ContextOverflow { tokens: 97, max: 96 }), "{err}");

    // Out of blocks: 17 tokens need 5 blocks of 4, the cache has 4.
    let prompt = tokens(17, 2);
    let err = model
        .forward(&cache, &mut [BatchSeq { tokens: &prompt, kv: &mut kv, want_logits: true }])
        .expect_err("out of blocks");
    assert!(matches!(err, EngineError::OutOfBlocks { needed: 5, free: 4, total: 4 }), "{err}");
    assert_eq!(kv.len(), 0);
    drop(kv);
    assert_eq!(blocks.free_blocks(), 4, "a failed sequence gives every block back");

    // Token id outside the vocabulary.
    let mut kv = SequenceKv::new(blocks.empty_allocation());
    let err =
        model.forward(&cache, &mut [BatchSeq { tokens: &[64], kv: &mut kv, want_logits: true }]).expect_err("bad id");
    assert!(err.to_string().contains("token id 64"), "{err}");

    // KV from another model (other weights) and KV with a wrong byte count.
    let other = tiny_model(7);
    let other_cache = cache_for(&other, 4, 4);
    let mut other_kv = SequenceKv::new(other_cache.block_manager().empty_allocation());
    run_alone(&other, &other_cache, &mut other_kv, &[&tokens(5, 3)]);
    let foreign =
        pd_engine::kv::export::export_kv(&other, &other_cache, &other_kv, 0..2, WireDType::F16).expect("export");
    let err = pd_engine::kv::export::import_kv(&model, &cache, &blocks, &foreign).expect_err("fingerprint");
    assert!(matches!(err, EngineError::KvImport(_)) && err.to_string().contains("fingerprint"), "{err}");

    let mut own_kv = SequenceKv::new(blocks.empty_allocation());
    run_alone(&model, &cache, &mut own_kv, &[&tokens(5, 3)]);
    let own = pd_engine::kv::export::export_kv(&model, &cache, &own_kv, 0..2, WireDType::F16).expect("export");
    drop(own_kv);
    let err = pd_engine::kv::export::import_kv(&model, &cache, &blocks, &own[..own.len() - 2]).expect_err("short");
    assert!(err.to_string().contains("payload"), "{err}");
    let partial = pd_engine::kv::export::export_kv(
        &model,
        &cache,
        &SequenceKv::new(blocks.empty_allocation()),
        0..1,
        WireDType::F32,
    )
    .expect("export of one layer");
    let err = pd_engine::kv::export::import_kv(&model, &cache, &blocks, &partial).expect_err("one layer");
    assert!(err.to_string().contains("needs all 2"), "{err}");
    assert_eq!(blocks.free_blocks(), 4, "refused imports hold no blocks");
}

#[test]
fn a_forked_sequence_continues_exactly_like_its_parent_and_frees_only_its_own_blocks() {
    let model = tiny_model(5);
    let cache = cache_for(&model, 32, 4);
    let blocks = cache.block_manager();
    let prompt = tokens(11, 7); // two full blocks and three positions of a third
    let mut parent = SequenceKv::new(blocks.allocate(4).expect("room for the prompt and one more"));
    run_alone(&model, &cache, &mut parent, &[&prompt]);
    let before = blocks.free_blocks();

    // At the whole prompt: the partial third block is copied, the next token's logits agree.
    let mut fork = parent.fork(&cache, prompt.len(), blocks.allocate(2).expect("own blocks")).expect("fork");
    assert_eq!(fork.len(), prompt.len());
    assert_eq!(&fork.blocks().ids()[..2], &parent.blocks().ids()[..2], "full blocks are shared");
    assert_ne!(fork.blocks().ids()[2], parent.blocks().ids()[2], "the partial block is the fork's own");
    assert_eq!(blocks.free_blocks(), before - 2, "sharing takes no block");
    // One position short of the prompt: the fork recomputes the last prompt token itself.
    let mut short = parent.fork(&cache, prompt.len() - 1, blocks.allocate(2).expect("own blocks")).expect("fork");
    let from_short = run_alone(&model, &cache, &mut short, &[&prompt[prompt.len() - 1..]]);
    let from_fork = run_alone(&model, &cache, &mut fork, &[&[3]]);
    let from_parent = run_alone(&model, &cache, &mut parent, &[&[3]]);
    assert_eq!(max_diff(&from_fork, &from_parent), 0.0, "a fork sees its parent's K/V exactly");
    let mut alone = SequenceKv::new(blocks.allocate(3).expect("3"));
    let prompt_logits = run_alone(&model, &cache, &mut alone, &[&prompt]);
    assert!(max_diff(&from_short, &prompt_logits) < 1e-4, "the recomputed last token gives the prompt's logits");
    drop(alone);

    // The parent writing its next position never touched the fork's copy: the fork's own
    // next step still equals what the parent computed for the same token.
    let again = run_alone(&model, &cache, &mut short, &[&[3]]);
    assert!(max_diff(&again, &from_parent) < 1e-4);
    assert!(parent.fork(&cache, 6, blocks.empty_allocation()).is_err(), "a partial block needs a block to copy into");
    drop(parent);
    drop(fork);
    assert_eq!(blocks.free_blocks(), blocks.total_blocks() - 4, "the shared blocks stay with the last holder");
    drop(short);
    assert_eq!(blocks.free_blocks(), blocks.total_blocks(), "every block is back");
}
