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
use pd_prefill::pipeline::{prefill_and_send, PrefillJob, Unscheduled};

fn model_path() -> PathBuf {
    let path = std::env::var_os("PD_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(path.is_file(), "real model not found at {}: run scripts/fetch-model.sh", path.display());
    path
}

fn engine() -> Arc<Engine> {
    Arc::new(Engine::load(&model_path(), LoadOptions::default(), CacheConfig::with_blocks(128)).expect("model loads"))
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
                chunk: 16,
                header,
                sampling: greedy.clone(),
            };
            let sent = prefill_and_send(job, &sender, &Unscheduled).await.expect("sent");
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
