//! The real model across a real gRPC transfer: prefill on one engine, each layer shipped as
//! soon as it is computed, decode on another engine continues with the same greedy tokens as
//! an uninterrupted run. (In one process with two engines; the cluster tests repeat this
//! with separate worker processes.)

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use pd_engine::{CacheConfig, ChatMessage, Engine, LoadOptions, SamplingParams, SequenceKv, WireDType};
use pd_kv_transfer::engine_io::geometry_of;
use pd_kv_transfer::grpc::{GrpcKvReceiver, GrpcKvSender};
use pd_kv_transfer::{KvReceiver, KvRegistry, Reservation, TransferHeader};
use pd_prefill::pipeline::{prefill_and_send, PrefillJob};
use pd_prefill::step::StepConfig;
use pd_prefill::steps::{StepEvent, Steps};

fn model_path() -> PathBuf {
    let path = std::env::var_os("PD_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(path.is_file(), "real model not found at {}: run scripts/fetch-model.sh", path.display());
    path
}

fn engine() -> Arc<Engine> {
    engine_with(true)
}

fn engine_with(prefix_cache: bool) -> Arc<Engine> {
    let cache = CacheConfig { prefix_cache, ..CacheConfig::with_blocks(128) };
    Arc::new(Engine::load(&model_path(), LoadOptions::default(), cache).expect("model loads"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_transfer_decode_gives_the_uninterrupted_greedy_tokens() {
    let prefill = engine();
    let decode = engine();
    let registry = KvRegistry::new(decode.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let server = GrpcKvReceiver::start(registry.clone(), listener).expect("receiver");
    let sender =
        GrpcKvSender::connect(&server.local_addr().to_string(), Duration::from_secs(10)).await.expect("connect");
    let mut greedy = SamplingParams::greedy(20);
    greedy.ignore_eos = true;

    for (i, question) in ["What is the capital of France?", "Name three primary colors."].iter().enumerate() {
        let prompt = prefill.chat_prompt(&[ChatMessage::new("user", question)]).expect("prompt");
        let expected = prefill.generate(&prompt, &greedy, 512, |_| {}).expect("uninterrupted").tokens;

        for dtype in [WireDType::F16, WireDType::F32] {
            let id = format!("q{i}-{dtype:?}");
            let geometry = geometry_of(&prefill, dtype);
            let blocks = decode.blocks().allocate(decode.blocks().blocks_for(prompt.len())).expect("reserve");
            let header = TransferHeader {
                transfer_id: id.clone(),
                geometry,
                block_ids: blocks.ids().to_vec(),
                num_tokens: prompt.len() as u32,
                trace_context: Default::default(),
            };
            let outcome = registry
                .reserve(Reservation {
                    transfer_id: id,
                    geometry: geometry_of(&decode, dtype),
                    blocks,
                    num_tokens: prompt.len() as u32,
                    lease: Duration::from_secs(30),
                })
                .expect("reservation");
            // Chunks of 16 tokens: the last chunk ships layers while later layers compute.
            let job = PrefillJob {
                engine: prefill.clone(),
                prompt: prompt.clone(),
                header,
                sampling: greedy.clone(),
                ship_from: 0,
            };
            let steps = Steps::start(prefill.clone(), StepConfig::single(16)).expect("steps");
            let sent = prefill_and_send(job, &sender, &steps, |_| {}).await.expect("sent");
            drop(sent.source);
            let committed = outcome.await.expect("outcome").expect("committed");
            assert_eq!(committed.first_token, expected[0]);
            let mut kv = SequenceKv::new(committed.blocks);
            kv.commit_len(committed.num_tokens as usize);
            let got = decode.decode_from(kv, committed.first_token, &greedy, &mut |_| {}).expect("decode").tokens;
            assert_eq!(got, expected, "{dtype:?} transfer changed the greedy tokens for {question:?}");
        }
    }
    assert_eq!(decode.blocks().free_blocks(), decode.blocks().total_blocks());
    assert_eq!(prefill.blocks().free_blocks(), prefill.blocks().total_blocks());
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_either_side_holds_is_neither_recomputed_nor_shipped() {
    let prefill = engine();
    let decode = engine();
    let plain = Arc::new(
        Engine::load(
            &model_path(),
            LoadOptions::default(),
            CacheConfig { prefix_cache: false, ..CacheConfig::with_blocks(128) },
        )
        .expect("model loads"),
    );
    let registry = KvRegistry::new(decode.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let server = GrpcKvReceiver::start(registry.clone(), listener).expect("receiver");
    let sender =
        GrpcKvSender::connect(&server.local_addr().to_string(), Duration::from_secs(10)).await.expect("connect");
    let steps = Steps::start(prefill.clone(), StepConfig::single(64)).expect("steps");
    let mut greedy = SamplingParams::greedy(12);
    greedy.ignore_eos = true;
    let system = "You are the help desk of a public library. Answer briefly and point to the right \
        shelf or service; when you do not know, say so and suggest asking a librarian at the desk.";
    let ask = |q: &str| {
        let messages = [ChatMessage::new("system", system), ChatMessage::new("user", q)];
        prefill.chat_prompt(&messages).expect("prompt")
    };
    // The decode side holds the first conversation (as after an earlier request); the prefill
    // side has computed a second one with the same system prompt.
    decode.generate(&ask("Where are the atlases?"), &greedy, 64, |_| {}).expect("decode side warm");
    prefill.generate(&ask("Can I print here?"), &greedy, 64, |_| {}).expect("prefill side warm");
    let bs = decode.blocks().block_size();
    let prompt = ask("How long can I keep a book?");
    let expected = plain.generate(&prompt, &greedy, 64, |_| {}).expect("reference").tokens;

    let (mut held, cached) = decode.blocks().allocate_prefix(&prompt, prompt.len()).expect("reserve");
    assert!(cached >= 2 * bs, "the system prompt's blocks are held: {cached}");
    let suffix = held.split_off(cached / bs);
    let geometry = geometry_of(&decode, WireDType::F16);
    let shipped = (prompt.len() - cached) as u32;
    let header = TransferHeader {
        transfer_id: "warm".into(),
        geometry,
        block_ids: suffix.ids().to_vec(),
        num_tokens: shipped,
        trace_context: Default::default(),
    };
    let reservation = Reservation {
        transfer_id: "warm".into(),
        geometry,
        blocks: suffix,
        num_tokens: shipped,
        lease: Duration::from_secs(30),
    };
    let outcome = registry.reserve(reservation).expect("reservation");
    let job = PrefillJob {
        engine: prefill.clone(),
        prompt: prompt.clone(),
        header,
        sampling: greedy.clone(),
        ship_from: cached,
    };
    let sent = prefill_and_send(job, &sender, &steps, |_| {}).await.expect("sent");
    assert_eq!(sent.cached_tokens, cached, "the prefill side computed only what it lacked");
    let c = decode.model().config();
    let block_bytes = (bs * c.num_kv_heads * c.head_dim * 2 * 2 * c.num_layers) as u64;
    assert_eq!(sent.receipt.bytes, (prompt.len() - cached).div_ceil(bs) as u64 * block_bytes, "only the suffix moved");
    drop(sent.source);
    let committed = outcome.await.expect("outcome").expect("committed");
    held.absorb(committed.blocks).expect("same pool");
    let mut kv = SequenceKv::new(held);
    kv.commit_len(cached + committed.num_tokens as usize);
    let got = decode.decode_from(kv, committed.first_token, &greedy, &mut |_| {}).expect("decode").tokens;
    assert_eq!(got, expected, "a cached prefix on both sides changed the greedy tokens");
    assert_eq!(decode.blocks().free_blocks(), decode.blocks().total_blocks());
    assert_eq!(prefill.blocks().free_blocks(), prefill.blocks().total_blocks());
    server.shutdown().await;
}

/// Follows one prompt through the step loop: its greedy continuation from the KV the steps
/// wrote, and the number of steps it took.
async fn through_steps(
    engine: &Arc<Engine>,
    steps: &Steps,
    prompt: Vec<u32>,
    greedy: &SamplingParams,
) -> (Vec<u32>, usize) {
    follow(engine, steps.submit(prompt).expect("submit"), greedy).await
}

/// The rest of one prompt's events: its greedy continuation and the steps (chunks) it took.
async fn follow(
    engine: &Arc<Engine>,
    mut events: tokio::sync::mpsc::UnboundedReceiver<StepEvent>,
    greedy: &SamplingParams,
) -> (Vec<u32>, usize) {
    let mut chunks = 0;
    while let Some(event) = events.recv().await {
        match event {
            StepEvent::Chunk { .. } => chunks += 1,
            StepEvent::Done(f) => {
                let first = pd_engine::Sampler::new(greedy).expect("sampler").sample(&f.logits).expect("sample");
                let tokens = engine.decode_from(f.kv, first, greedy, &mut |_| {}).expect("decode").tokens;
                return (tokens, chunks);
            }
            StepEvent::Failed(e) => panic!("prefill failed: {e}"),
            _ => {}
        }
    }
    panic!("the step loop ended without an answer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_prefilled_together_in_steps_give_the_tokens_of_a_whole_prefill() {
    // No prefix cache: the reference runs would serve the stepped prompts.
    let engine = engine_with(false);
    let mut greedy = SamplingParams::greedy(12);
    greedy.ignore_eos = true;
    let long = "Summarize: the lighthouse keeper climbed the stairs every evening, lit the lamp, wrote the weather in his log, and watched the ships pass until dawn, year after year, until the day the lamp was replaced by an automatic beacon and he moved to the village.";
    let prompts: Vec<Vec<u32>> = [long, "What is the capital of France?"]
        .iter()
        .map(|q| engine.chat_prompt(&[ChatMessage::new("user", q)]).expect("prompt"))
        .collect();
    let expected: Vec<Vec<u32>> =
        prompts.iter().map(|p| engine.generate(p, &greedy, 512, |_| {}).expect("whole").tokens).collect();
    // Two prompts per step, chunks of at most 16 tokens, a budget that forces several steps.
    let config =
        StepConfig { max_prompts: 2, max_chunk: 16, target: Duration::from_millis(1), ..StepConfig::single(8) };
    let steps = Steps::start(engine.clone(), config).expect("steps");
    let (a, b) = tokio::join!(
        through_steps(&engine, &steps, prompts[0].clone(), &greedy),
        through_steps(&engine, &steps, prompts[1].clone(), &greedy)
    );
    assert_eq!(a.0, expected[0], "the long prompt, chunked beside the short one");
    assert_eq!(b.0, expected[1], "the short prompt, beside the long one's chunks");
    assert!(a.1 > 2 && b.1 > 2, "both took several steps: {} and {}", a.1, b.1);
    assert_eq!(engine.blocks().free_blocks(), engine.blocks().total_blocks(), "every block is back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_prompt_preempts_a_documents_step_and_both_give_the_tokens_of_a_whole_prefill() {
    let engine = engine_with(false);
    let mut greedy = SamplingParams::greedy(12);
    greedy.ignore_eos = true;
    let story = "the lighthouse keeper climbed the stairs every evening, lit the lamp, wrote the weather in his log, and watched the ships pass until dawn, year after year, until the day the lamp was replaced by an automatic beacon and he moved to the village";
    let long = engine
        .chat_prompt(&[ChatMessage::new("user", &format!("Summarize: {story}. {story}. {story}. {story}."))])
        .expect("long");
    let short = engine.chat_prompt(&[ChatMessage::new("user", "What is the capital of France?")]).expect("short");
    assert!(long.len() > 3 * 64 && short.len() < 64, "prompt lengths {} and {}", long.len(), short.len());
    let expected_long = engine.generate(&long, &greedy, 512, |_| {}).expect("whole").tokens;
    let expected_short = engine.generate(&short, &greedy, 512, |_| {}).expect("whole").tokens;
    // The document runs alone in 64-token steps (a step target it always exceeds); the short
    // prompt is submitted as soon as the document's first step starts.
    let config = StepConfig {
        max_prompts: 2,
        long_threshold: short.len(),
        target: Duration::from_secs(10),
        preempt: true,
        ..StepConfig::single(64)
    };
    let steps = Steps::start(engine.clone(), config).expect("steps");
    // The stop is a race between the short prompt's arrival and the step's layers: a loaded
    // machine may lose it once; the tokens must match on every attempt.
    for attempt in 0..3 {
        let mut events = steps.submit(long.clone()).expect("submit");
        loop {
            match events.recv().await.expect("the document's events") {
                StepEvent::Started { .. } => break,
                StepEvent::Failed(e) => panic!("document failed: {e}"),
                _ => {}
            }
        }
        let (a, b) =
            tokio::join!(follow(&engine, events, &greedy), through_steps(&engine, &steps, short.clone(), &greedy));
        assert_eq!(a.0, expected_long, "attempt {attempt}: the document, after preempted steps");
        assert_eq!(b.0, expected_short, "attempt {attempt}: the short prompt");
        assert_eq!(a.1, long.len().div_ceil(64), "attempt {attempt}: a preempted step is not a chunk");
        assert_eq!(engine.blocks().free_blocks(), engine.blocks().total_blocks(), "every block is back");
        if steps.preemptions().steps > 0 {
            assert!(steps.preemptions().discarded > Duration::ZERO);
            return;
        }
    }
    panic!("no step was preempted in three attempts: {:?}", steps.preemptions());
}
