//! Simulated workers over real gRPC, driven as the router drives them: a decode reservation,
//! a prefill into its target, the stream to its end; the blocks come back in every case
//! (finished, refused, lease expired, lost worker), and bad requests are refused by name.
//! Each of these runs over gRPC and, with the `ucx` feature, over UCX (`--kv-transport ucx`:
//! every frame moved into the real registry).

use std::sync::Arc;
use std::time::Duration;

use pd_kv_transfer::transport::Transport;
use pd_prefill::step::StepConfig;
use pd_proto::v1 as pb;
use pd_sim::cost::{DecodeCost, KvCost, PrefillCost, WorkerCost, WorkerShape};
use pd_sim::fleet::{Fleet, Role};
use tonic::transport::Channel;

type Decode = pb::decode_worker_client::DecodeWorkerClient<Channel>;
type Prefill = pb::prefill_worker_client::PrefillWorkerClient<Channel>;

fn cost(kv_blocks: u32) -> Arc<WorkerCost> {
    Arc::new(WorkerCost {
        source: "test".into(),
        prefill: PrefillCost { fixed_ms: 2.0, per_token_ms: 0.01, per_pair_us: 0.0, per_prompt_ms: 0.0 },
        decode: DecodeCost { fixed_ms: 2.0, per_row_ms: 0.0, per_context_us: 0.0 },
        kv: KvCost { bytes_per_token: 100, commit_fixed_ms: 0.0, commit_ms_per_mb: 0.0 },
        worker: WorkerShape { block_size: 16, kv_blocks, max_batch: 8, max_position: 4096 },
        wide: None,
        window: None,
    })
}

async fn fleet(kv_blocks: u32, transport: Transport) -> (Fleet, Decode, Prefill) {
    if transport == Transport::Ucx && std::env::var_os("UCX_TLS").is_none() {
        // Loopback only; every test of this file sets the same values.
        std::env::set_var("UCX_TLS", "tcp");
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    let step = StepConfig::single(512);
    let fleet = Fleet::start(cost(kv_blocks), step, "127.0.0.1", 1, 1, transport).await.expect("fleet");
    let decode = Decode::connect(format!("http://{}", fleet.decode_addrs[0])).await.expect("decode");
    let prefill = Prefill::connect(format!("http://{}", fleet.prefill_addrs[0])).await.expect("prefill");
    (fleet, decode, prefill)
}

fn request(id: &str, prompt: usize, max_tokens: u32, lease_ms: u32) -> pb::DecodeRequest {
    pb::DecodeRequest {
        request_id: id.into(),
        prompt_tokens: vec![7; prompt],
        sampling: Some(pb::SamplingParams { max_tokens, seed: Some(0), ..Default::default() }),
        lease_ms,
        prefill_here: false,
        n: 1,
        output_offset: 0,
    }
}

async fn free_blocks(decode: &mut Decode) -> u32 {
    decode.load(pb::LoadRequest::default()).await.expect("load").into_inner().free_blocks
}

/// Reserve, prefill: the decode stream (after its KV target) and the prefill worker's answer.
async fn reserve_and_prefill(
    decode: &mut Decode,
    prefill: &mut Prefill,
    req: pb::DecodeRequest,
) -> (tonic::Streaming<pb::DecodeEvent>, pb::PrefillResponse) {
    let mut stream = decode.generate(req.clone()).await.expect("generate").into_inner();
    let Some(pb::decode_event::Event::Target(target)) = stream.message().await.expect("event").and_then(|e| e.event)
    else {
        panic!("the first event is not a KV target")
    };
    let p = pb::PrefillRequest {
        request_id: req.request_id,
        prompt_tokens: req.prompt_tokens,
        target: Some(target),
        sampling: req.sampling,
        output_offset: 0,
    };
    (stream, prefill.prefill(p).await.expect("prefill").into_inner())
}

/// Reserve, prefill, read the stream: (tokens, finished).
async fn generate(
    decode: &mut Decode,
    prefill: &mut Prefill,
    req: pb::DecodeRequest,
) -> (Vec<u32>, Option<pb::Finished>) {
    let (mut stream, answer) = reserve_and_prefill(decode, prefill, req).await;
    assert_eq!(answer.first_token, pd_sim::FIRST_TOKEN);
    let (mut tokens, mut finished) = (Vec::new(), None);
    while let Some(e) = stream.message().await.expect("event") {
        match e.event {
            Some(pb::decode_event::Event::Token(t)) => tokens.push(t.token_id),
            Some(pb::decode_event::Event::Finished(f)) => finished = Some(f),
            _ => {}
        }
    }
    (tokens, finished)
}

/// Runs each of the transport-dependent checks over gRPC, and over UCX when built with it.
macro_rules! over_both_transports {
    ($($check:ident),* $(,)?) => {
        mod grpc {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                super::$check(super::Transport::Grpc).await
            })*
        }
        #[cfg(feature = "ucx")]
        mod ucx {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                super::$check(super::Transport::Ucx).await
            })*
        }
    };
}

over_both_transports!(
    a_request_gets_exactly_its_tokens_and_gives_its_blocks_back,
    refusals_name_the_problem_and_hold_nothing,
    a_lease_that_ends_before_the_commit_frees_the_reservation,
    a_lost_worker_ends_its_streams_unfinished_and_refuses_everything,
);

async fn a_request_gets_exactly_its_tokens_and_gives_its_blocks_back(transport: Transport) {
    let (fleet, mut decode, mut prefill) = fleet(64, transport).await;
    // 40 tokens of 100 bytes: modelled over gRPC; over UCX the frames of 3 whole blocks.
    let bytes = if transport == Transport::Ucx { 4800 } else { 4000 };
    for (i, max) in [1u32, 5].into_iter().enumerate() {
        let (tokens, finished) = generate(&mut decode, &mut prefill, request(&format!("r{i}"), 40, max, 0)).await;
        assert_eq!(tokens.len(), max as usize, "{tokens:?}");
        assert_eq!(tokens[0], pd_sim::FIRST_TOKEN, "the first token is the prefill worker's");
        let f = finished.expect("finished");
        assert_eq!((f.completion_tokens, f.prompt_tokens, f.kv_bytes), (max, 40, bytes));
    }
    assert_eq!(free_blocks(&mut decode).await, 64);
    assert_eq!(fleet.ucx_held_blocks(), 0);
    let summary = fleet.handoffs();
    let expected = match transport {
        Transport::Grpc => "2 over grpc (control messages only), 0 over ucx (0 bytes in 0 frames); 0 failed",
        Transport::Ucx => "0 over grpc (control messages only), 2 over ucx (9600 bytes in 2 frames); 0 failed",
    };
    assert!(summary.ends_with(expected), "{summary}");
}

async fn refusals_name_the_problem_and_hold_nothing(transport: Transport) {
    let (_fleet, mut decode, _prefill) = fleet(4, transport).await;
    let e = decode.generate(request("big", 60, 10, 0)).await.expect_err("5 blocks of 4");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted);
    assert!(e.message().contains("5 needed, 4 free"), "{}", e.message());
    let e = decode.generate(request("", 4, 1, 0)).await.expect_err("no id");
    assert!(e.message().contains("request_id"), "{}", e.message());
    let e = decode.generate(request("zero", 4, 0, 0)).await.expect_err("no tokens");
    assert!(e.message().contains("max_tokens"), "{}", e.message());
    let e = decode.generate(request("long", 4000, 200, 0)).await.expect_err("too long");
    assert!(e.message().contains("context length"), "{}", e.message());
    assert_eq!(free_blocks(&mut decode).await, 4);
}

async fn a_lease_that_ends_before_the_commit_frees_the_reservation(transport: Transport) {
    let (fleet, mut decode, _prefill) = fleet(16, transport).await;
    let mut stream = decode.generate(request("late", 20, 4, 100)).await.expect("generate").into_inner();
    assert!(matches!(
        stream.message().await.expect("target").and_then(|e| e.event),
        Some(pb::decode_event::Event::Target(_))
    ));
    assert_eq!(free_blocks(&mut decode).await, 14);
    let e = stream.message().await.expect_err("the lease ends");
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded);
    assert_eq!(free_blocks(&mut decode).await, 16);
    assert_eq!(fleet.ucx_held_blocks(), 0, "the registry's reservation ended too");
}

async fn a_lost_worker_ends_its_streams_unfinished_and_refuses_everything(transport: Transport) {
    let (fleet, mut decode, mut prefill) = fleet(64, transport).await;
    let mut stream = decode.generate(request("lost", 20, 1000, 0)).await.expect("generate").into_inner();
    let Some(pb::decode_event::Event::Target(target)) = stream.message().await.expect("event").and_then(|e| e.event)
    else {
        panic!("no target")
    };
    let p = pb::PrefillRequest {
        request_id: "lost".into(),
        prompt_tokens: vec![7; 20],
        target: Some(target),
        sampling: None,
        output_offset: 0,
    };
    prefill.prefill(p).await.expect("prefill");
    assert!(stream.message().await.expect("first token").is_some());
    assert!(fleet.lose(Role::Decode, 0));
    let mut finished = false;
    while let Ok(Some(e)) = tokio::time::timeout(Duration::from_secs(5), stream.message()).await.expect("ends") {
        finished |= matches!(e.event, Some(pb::decode_event::Event::Finished(_)));
    }
    assert!(!finished, "a lost worker's stream must not look finished");
    let e = decode.load(pb::LoadRequest::default()).await.expect_err("lost");
    assert_eq!(e.code(), tonic::Code::Unavailable);
    assert!(!fleet.lose(Role::Prefill, 3), "no such worker");
}

/// Reserve, prefill: the prefill worker's answer (its queue and compute times).
async fn prefill_answer(mut decode: Decode, mut prefill: Prefill, req: pb::DecodeRequest) -> pb::PrefillResponse {
    reserve_and_prefill(&mut decode, &mut prefill, req).await.1
}

#[tokio::test]
async fn a_short_prompt_stops_a_documents_simulated_step_only_with_preemption_on() {
    // 1 ms per prompt token: the document's 512-token steps last about half a second.
    let slow = Arc::new(WorkerCost {
        prefill: PrefillCost { fixed_ms: 2.0, per_token_ms: 1.0, per_pair_us: 0.0, per_prompt_ms: 0.0 },
        ..(*cost(256)).clone()
    });
    let mut waits = Vec::new();
    for preempt in [true, false] {
        let step = StepConfig { long_threshold: 64, max_prompts: 2, preempt, ..StepConfig::single(512) };
        let fleet = Fleet::start(slow.clone(), step, "127.0.0.1", 1, 1, Transport::Grpc).await.expect("fleet");
        let decode = Decode::connect(format!("http://{}", fleet.decode_addrs[0])).await.expect("decode");
        let prefill = Prefill::connect(format!("http://{}", fleet.prefill_addrs[0])).await.expect("prefill");
        let document = tokio::spawn(prefill_answer(decode.clone(), prefill.clone(), request("doc", 1024, 1, 0)));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let question = prefill_answer(decode.clone(), prefill.clone(), request("q", 20, 1, 0)).await;
        let document = document.await.expect("document");
        assert!(document.prefill_ms >= 1000.0, "the document's two steps: {document:?}");
        waits.push(question.queue_ms);
    }
    assert!(waits[0] < 150.0, "preempted: the question waited {} ms", waits[0]);
    assert!(waits[1] > 250.0, "not preempted: the question waited for the step, {} ms", waits[1]);
}
