//! `BatchState` without a model or a runtime: a character tokenizer, a block pool, logits made
//! by hand (one-hot rows pick the greedy token).

use std::time::Instant;

use candle_core::{Device, Tensor};
use pd_engine::{BlockManager, SamplingParams, SequenceKv, Tokenizer};
use pd_proto::v1::decode_event::Event as Ev;
use pd_telemetry::metrics::DecodeMetrics;
use pd_telemetry::opentelemetry::Context;
use pd_telemetry::{Metrics, RequestClass, StageLabels, StageSpan};
use tokio::sync::mpsc;

use super::*;

const VOCAB: usize = 64;
const EOS: u32 = 63;

/// How a test sequence joins: prefilled elsewhere, or with a prompt to run here.
enum Begin {
    Prefilled { first_token: u32 },
    Prompt(Vec<u32>),
}

struct Fixture {
    tokenizer: Tokenizer,
    metrics: DecodeMetrics,
    blocks: BlockManager,
}

impl Fixture {
    fn new() -> Self {
        Fixture {
            tokenizer: Tokenizer::characters().expect("tokenizer"),
            metrics: DecodeMetrics::register(&Metrics::new()),
            blocks: BlockManager::new(64, 16),
        }
    }

    fn admission(&self, begin: Begin, max_tokens: usize) -> (Admission, mpsc::UnboundedReceiver<Event>) {
        let (events, rx) = mpsc::unbounded_channel();
        let (start, prompt) = match begin {
            Begin::Prompt(p) => (Start::Prompt { from: 0 }, p),
            Begin::Prefilled { first_token } => (Start::Prefilled { first_token, logprobs: None }, vec![1; 5]),
        };
        let prompt_tokens = prompt.len();
        let kv = SequenceKv::new(self.blocks.allocate(2).expect("blocks"));
        let a = Admission {
            index: 0,
            kv,
            start,
            prompt,
            params: SamplingParams::greedy(max_tokens),
            cached_tokens: 0,
            received: Received { kv_transfer_ms: 1.5, kv_bytes: 100 },
            events,
            span: StageSpan::start("decode.generate", &Context::new()),
            labels: StageLabels::new(&RequestClass::default_class(), prompt_tokens),
            forks: Vec::new(),
            score: None,
        };
        (a, rx)
    }

    fn admit(&self, state: &mut BatchState, begin: Begin, max_tokens: usize) -> mpsc::UnboundedReceiver<Event> {
        let (a, rx) = self.admission(begin, max_tokens);
        state.admit(a, &self.tokenizer, &self.metrics);
        rx
    }

    /// One step whose logits pick `tokens` (one per row that asks for logits).
    fn step(&self, state: &mut BatchState, tokens: &[u32]) -> Vec<usize> {
        let takes = state.plan();
        let mut data = vec![0f32; tokens.len() * VOCAB];
        for (row, &t) in tokens.iter().enumerate() {
            data[row * VOCAB + t as usize] = 10.0;
        }
        let logits = Tensor::from_vec(data, (tokens.len(), VOCAB), &Device::Cpu).expect("logits");
        // Without a KV cache a fork takes its own blocks only (the state is what is tested).
        let fork = |_: &SequenceKv, _: usize, own: pd_engine::BlockAllocation| Ok(SequenceKv::new(own));
        let with = StepTools { tokenizer: &self.tokenizer, metrics: &self.metrics, fork: &fork };
        state.apply_logits(&takes, &logits, Instant::now(), with);
        takes
    }
}

/// Every event received so far: token texts, and the finish reason if it ended.
fn drain(rx: &mut mpsc::UnboundedReceiver<Event>) -> (Vec<String>, Option<pb::Finished>, Option<tonic::Status>) {
    let (mut texts, mut finished, mut error) = (Vec::new(), None, None);
    while let Ok(e) = rx.try_recv() {
        match e {
            Ok(pb::DecodeEvent { event: Some(Ev::Token(t)) }) => texts.push(t.text),
            Ok(pb::DecodeEvent { event: Some(Ev::Finished(f)) }) => finished = Some(f),
            Ok(other) => panic!("unexpected event {other:?}"),
            Err(status) => error = Some(status),
        }
    }
    (texts, finished, error)
}

fn chunked(step_tokens: usize) -> BatchState {
    BatchState::new(PrefillPolicy::Chunked { step_tokens }, 8)
}

#[test]
fn a_prefilled_sequence_streams_its_first_token_at_once_then_one_per_step() {
    let f = Fixture::new();
    let mut state = chunked(256);
    // "h" = 7, "i" = 8 in the character tokenizer.
    let mut rx = f.admit(&mut state, Begin::Prefilled { first_token: 7 }, 3);
    let mut texts = drain(&mut rx).0;
    assert_eq!(texts, vec!["h"]);
    assert_eq!(state.inputs(&state.plan()), vec![vec![7]]);
    f.step(&mut state, &[8]);
    assert_eq!(state.inputs(&state.plan()), vec![vec![8]], "the sampled token is fed next");
    f.step(&mut state, &[8]);
    let (more, finished, error) = drain(&mut rx);
    texts.extend(more);
    assert_eq!(texts.len(), 3, "one event per token");
    assert_eq!(texts.concat(), f.tokenizer.decode(&[7, 8, 8], true).expect("decode"));
    assert!(error.is_none());
    let finished = finished.expect("finished at max_tokens");
    assert_eq!((finished.finish_reason.as_str(), finished.completion_tokens, finished.kv_bytes), ("length", 3, 100));
    assert!(state.is_empty(), "a finished sequence leaves the batch");
    assert_eq!(f.blocks.free_blocks(), f.blocks.total_blocks(), "its blocks are free");
}

#[test]
fn end_of_sequence_finishes_with_stop_and_a_one_token_output_finishes_on_admission() {
    let f = Fixture::new();
    let mut state = chunked(256);
    let mut rx = f.admit(&mut state, Begin::Prefilled { first_token: 0 }, 10);
    f.step(&mut state, &[EOS]);
    let (texts, finished, _) = drain(&mut rx);
    assert_eq!(texts, vec!["a", ""]);
    assert_eq!(finished.expect("finished").finish_reason, "stop");
    let mut one = f.admit(&mut state, Begin::Prefilled { first_token: 1 }, 1);
    assert!(state.is_empty(), "max_tokens 1: done with the prefill worker's token");
    assert_eq!(drain(&mut one).1.expect("finished").completion_tokens, 1);
}

#[test]
fn chunked_prefill_spreads_a_prompt_over_steps_beside_decode_rows() {
    let f = Fixture::new();
    let mut state = chunked(8);
    let mut decoding = f.admit(&mut state, Begin::Prefilled { first_token: 2 }, 100);
    let mut prompt = f.admit(&mut state, Begin::Prompt((0..20).collect()), 2);
    // Budget 8 tokens: 1 decode row leaves 7 for the prompt.
    assert_eq!(state.plan(), vec![1, 7]);
    let inputs = state.inputs(&state.plan());
    assert_eq!(inputs[1], (0..7).collect::<Vec<u32>>());
    let asks: Vec<bool> = state.batch(&inputs).iter().map(|b| b.want_logits).collect();
    assert_eq!(asks, vec![true, false], "no logits for a prompt's middle chunk");
    f.step(&mut state, &[3]);
    assert_eq!(state.plan(), vec![1, 7]);
    f.step(&mut state, &[3]);
    assert_eq!(state.plan(), vec![1, 6], "the rest of the prompt");
    let inputs = state.inputs(&state.plan());
    assert!(state.batch(&inputs)[1].want_logits, "the last chunk gives the first token");
    f.step(&mut state, &[3, 4]);
    assert_eq!(drain(&mut prompt).0, vec!["e"]);
    assert_eq!(drain(&mut decoding).0.len(), 4);
    assert_eq!(state.plan(), vec![1, 1]);
}

#[test]
fn naive_prefill_runs_one_whole_prompt_per_step() {
    let f = Fixture::new();
    let mut state = BatchState::new(PrefillPolicy::Naive, 8);
    let _a = f.admit(&mut state, Begin::Prompt((0..300).collect()), 2);
    let _b = f.admit(&mut state, Begin::Prompt((0..5).collect()), 2);
    assert_eq!(state.plan(), vec![300, 0]);
    f.step(&mut state, &[1]);
    assert_eq!(state.plan(), vec![1, 5]);
}

#[test]
fn a_full_decode_batch_still_gives_prompts_a_quarter_chunk() {
    let f = Fixture::new();
    let mut state = BatchState::new(PrefillPolicy::Chunked { step_tokens: 8 }, 16);
    let _rx: Vec<_> = (0..10).map(|_| f.admit(&mut state, Begin::Prefilled { first_token: 1 }, 50)).collect();
    let _p = f.admit(&mut state, Begin::Prompt((0..40).collect()), 2);
    assert_eq!(state.plan().last(), Some(&2));
    assert_eq!(state.room(), 5);
}

#[test]
fn a_client_that_went_away_leaves_and_frees_its_blocks() {
    let f = Fixture::new();
    let mut state = chunked(256);
    let rx = f.admit(&mut state, Begin::Prefilled { first_token: 1 }, 50);
    let _other = f.admit(&mut state, Begin::Prefilled { first_token: 1 }, 50);
    drop(rx);
    state.drop_cancelled();
    assert_eq!(state.len(), 1);
    assert_eq!(f.blocks.free_blocks(), f.blocks.total_blocks() - 2);
}

#[test]
fn fail_all_ends_every_sequence_with_the_status() {
    let f = Fixture::new();
    let mut state = chunked(256);
    let mut a = f.admit(&mut state, Begin::Prefilled { first_token: 1 }, 50);
    let mut b = f.admit(&mut state, Begin::Prompt(vec![1, 2, 3]), 50);
    state.fail_all(tonic::Status::unavailable("shutting down"));
    assert!(state.is_empty());
    assert_eq!(drain(&mut a).2.expect("error").code(), tonic::Code::Unavailable);
    assert_eq!(drain(&mut b).2.expect("error").message(), "shutting down");
    assert_eq!(f.blocks.free_blocks(), f.blocks.total_blocks());
}

#[test]
fn bad_sampling_is_refused_at_admission() {
    let f = Fixture::new();
    let mut state = chunked(256);
    let (mut a, mut rx) = f.admission(Begin::Prefilled { first_token: 1 }, 5);
    a.params.top_k = Some(0);
    state.admit(a, &f.tokenizer, &f.metrics);
    assert!(state.is_empty());
    assert_eq!(drain(&mut rx).2.expect("error").code(), tonic::Code::InvalidArgument);
}

#[test]
fn policies_parse_and_bad_ones_are_named() {
    assert_eq!("naive".parse(), Ok(PrefillPolicy::Naive));
    assert_eq!("chunked".parse(), Ok(PrefillPolicy::Chunked { step_tokens: 256 }));
    assert_eq!("chunked:64".parse(), Ok(PrefillPolicy::Chunked { step_tokens: 64 }));
    for bad in ["chunked:0", "greedy", "chunked:x"] {
        let err = bad.parse::<PrefillPolicy>().expect_err(bad);
        assert!(err.contains(bad), "{err}");
    }
}

#[test]
fn a_prompt_run_here_lets_its_forks_join_once_complete_and_they_recompute_only_its_last_position() {
    let f = Fixture::new();
    let mut state = chunked(4);
    let (mut a, mut rx) = f.admission(Begin::Prompt(vec![1, 2, 3, 4, 5, 6]), 2);
    let fork = |index: u32| Fork {
        index,
        own: f.blocks.allocate(1).expect("blocks"),
        params: SamplingParams::greedy(2),
        span: StageSpan::start("decode.generate", &Context::new()),
    };
    a.forks = vec![fork(1), fork(2)];
    state.admit(a, &f.tokenizer, &f.metrics);
    assert_eq!(state.room(), 8 - 3, "the waiting answers hold their places");
    assert_eq!(state.inputs(&state.plan()), vec![vec![1, 2, 3, 4]], "the prompt runs once, in chunks");
    f.step(&mut state, &[]);
    assert_eq!(state.len(), 1, "the forks wait for the whole prompt");
    assert_eq!(state.inputs(&state.plan()), vec![vec![5, 6]]);
    f.step(&mut state, &[7]);
    assert_eq!(state.len(), 3, "the complete prompt let both forks join");
    assert_eq!(state.inputs(&state.plan()), vec![vec![7], vec![6], vec![6]], "each fork recomputes position 5 only");
    f.step(&mut state, &[8, 9, 10]);
    f.step(&mut state, &[11, 12]);
    let mut indexes = Vec::new();
    let mut finished = 0;
    while let Ok(e) = rx.try_recv() {
        match e.expect("event").event {
            Some(Ev::Token(t)) => indexes.push(t.index),
            Some(Ev::Finished(_)) => finished += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(finished, 3, "every answer ends");
    assert_eq!(indexes.iter().filter(|&&i| i == 0).count(), 2);
    assert_eq!(indexes.iter().filter(|&&i| i == 2).count(), 2, "{indexes:?}");
    assert!(state.is_empty());
    assert_eq!(f.blocks.free_blocks(), f.blocks.total_blocks(), "every block is free");
}

#[test]
fn a_scored_prompt_takes_a_row_per_token_beside_a_decoding_sequence() {
    let f = Fixture::new();
    // 4 tokens per step: the decoding sequence's row and 3 prompt tokens.
    let mut state = chunked(4);
    let mut decoding = f.admit(&mut state, Begin::Prefilled { first_token: 7 }, 3);
    let (mut a, mut scored_rx) = f.admission(Begin::Prompt(vec![2, 3, 4, 5, 6]), 1);
    let (sink, mut scores) = oneshot::channel();
    a.score = Some(Scoring { top: 2, sink });
    state.admit(a, &f.tokenizer, &f.metrics);
    let inputs = state.inputs(&state.plan());
    assert_eq!(inputs, vec![vec![7], vec![2, 3, 4]]);
    assert_eq!(state.every_row(&inputs), vec![false, true], "every prompt row is asked for");
    // Rows: the decoding token, then prompt positions 0..3 (scoring tokens 3, 4, 5).
    f.step(&mut state, &[8, 3, 4, 5]);
    assert!(scores.try_recv().is_err(), "scores go out once the prompt is complete");
    // Then position 3 (scoring token 6) and the prompt's last row, which samples token 9.
    f.step(&mut state, &[8, 6, 9]);
    let scored = scores.try_recv().expect("scores");
    let likeliest: Vec<u32> = scored.iter().map(|l| l.top[0].0).collect();
    assert_eq!(likeliest, vec![3, 4, 5, 6], "each position scores the prompt token after it");
    assert!(scored.iter().all(|l| l.logprob > -0.01 && l.top.len() == 2), "{scored:?}");
    let (texts, finished, error) = drain(&mut scored_rx);
    assert!(error.is_none());
    assert_eq!(texts, vec![f.tokenizer.decode(&[9], true).expect("decode")], "the first output token");
    assert_eq!(finished.expect("finished").completion_tokens, 1);
    assert_eq!(drain(&mut decoding).0.len(), 3, "the decoding sequence got its own rows");
    assert!(state.is_empty());
    assert_eq!(f.blocks.free_blocks(), f.blocks.total_blocks(), "the scored prompt's blocks are free");
}
