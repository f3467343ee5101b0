//! The prefix cache on the real model: a prompt whose prefix is cached (0, 1 or many shared
//! blocks, a shared part ending mid-block) generates exactly the greedy tokens it generates
//! with caching off; evicting cached blocks under KV pressure never touches a running
//! sequence; every block is free or cached once the sequences are gone.

mod common;

use common::real_model_path;
use pd_engine::{CacheConfig, ChatMessage, Engine, LoadOptions, SamplingParams};

fn engine(prefix_cache: bool, num_blocks: usize) -> Engine {
    let cache = CacheConfig { prefix_cache, ..CacheConfig::with_blocks(num_blocks) };
    Engine::load(&real_model_path(), LoadOptions::default(), cache).expect("real model loads")
}

const SYSTEM: &str = "You are a careful assistant for a company that builds bridges. Answer in one \
short sentence, name the material when it matters, and never invent numbers you were not given. \
When a question is about safety, say who should be asked, and keep the answer polite and plain.";

fn prompt(engine: &Engine, system: &str, question: &str) -> Vec<u32> {
    let messages = [ChatMessage::new("system", system), ChatMessage::new("user", question)];
    engine.chat_prompt(&messages).expect("chat prompt")
}

fn greedy(engine: &Engine, prompt: &[u32]) -> Vec<u32> {
    let mut params = SamplingParams::greedy(12);
    params.ignore_eos = true;
    engine.generate(prompt, &params, 64, |_| {}).expect("generate").tokens
}

fn shared_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[test]
fn cached_prefixes_keep_greedy_output_identical() {
    let cached = engine(true, 256);
    let plain = engine(false, 256);
    let bs = cached.blocks().block_size();
    let warm = prompt(&cached, SYSTEM, "Which steel grade is used for cables?");
    assert_eq!(greedy(&cached, &warm), greedy(&plain, &warm), "the first run computes everything");
    let cases = [
        // Many shared blocks (the system prompt), a different question.
        prompt(&cached, SYSTEM, "How long does concrete take to cure?"),
        // The same prompt again: all blocks but the last token's.
        warm.clone(),
        // Only the first block shared: the system prompt differs after a few words.
        prompt(
            &cached,
            "You are a careful assistant for a company that builds bridges. Answer in one short word.",
            "Hi",
        ),
        // Nothing shared: a plain-text prompt.
        cached.tokenizer().encode("Bridges are built from").expect("encode"),
    ];
    let mut seen = vec![warm];
    let mut hits = Vec::new();
    for case in &cases {
        let expected_hit = seen.iter().map(|s| shared_prefix(s, case)).max().unwrap_or(0).min(case.len() - 1) / bs * bs;
        hits.push(expected_hit / bs);
        let hit = cached.blocks().cached_prefix_tokens(case);
        assert_eq!(hit, expected_hit, "cached tokens of a prompt sharing {expected_hit} tokens");
        assert_eq!(greedy(&cached, case), greedy(&plain, case), "output with {hit} cached tokens");
        seen.push(case.clone());
    }
    assert!(hits[0] >= 3 && hits[2] == 1 && hits[3] == 0, "the cases cover many, one and no shared blocks: {hits:?}");
    assert!(!shared_prefix(&seen[0], &cases[0]).is_multiple_of(bs), "the shared part ends mid-block");
    let (queried, hit) = cached.blocks().prefix_stats();
    assert!(hit > 0 && hit < queried, "hits {hit} of {queried} tokens");
    assert_eq!(cached.blocks().free_blocks(), cached.blocks().total_blocks(), "all free or cached");
    assert!(cached.blocks().cached_blocks() > 0);
}

#[test]
fn eviction_under_pressure_never_changes_a_running_sequence() {
    let prompt_a = {
        let e = engine(false, 64);
        prompt(&e, SYSTEM, "What holds a suspension bridge up?")
    };
    let reference = greedy(&engine(false, 64), &prompt_a);
    let bs = CacheConfig::DEFAULT_BLOCK_SIZE;
    // Room for the running sequence and little else.
    let blocks = (prompt_a.len() + 12).div_ceil(bs) + 4;
    let e = engine(true, blocks);
    let mut params = SamplingParams::greedy(12);
    params.ignore_eos = true;
    // Cache A's prefix, then start A again on the cached blocks and keep it running while
    // other prompts evict everything they can.
    greedy(&e, &prompt_a);
    let (mut kv, cached) = e.sequence_for_prompt(&prompt_a, prompt_a.len() + 12).expect("fits");
    assert!(cached > 0);
    let logits = e.prefill(&mut kv, &prompt_a[cached..], 64).expect("prefill");
    for salt in 0..6u32 {
        let other: Vec<u32> = (0..(bs as u32 * 3 + 5)).map(|i| 100 + (i * 31 + salt * 7) % 5000).collect();
        match e.generate(&other, &SamplingParams::greedy(2), 64, |_| {}) {
            Ok(_) | Err(pd_engine::EngineError::OutOfBlocks { .. }) => {}
            Err(other) => panic!("unexpected error {other}"),
        }
    }
    let out = e.continue_generation(kv, logits, &params, &mut |_| {}).expect("continue").tokens;
    assert_eq!(out, reference, "the running sequence's shared blocks were not evicted");
    assert_eq!(e.blocks().free_blocks(), e.blocks().total_blocks());
}
