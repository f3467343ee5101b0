//! The planner's arithmetic on small cases computed by hand.

use super::*;
use crate::plan::traffic::Traffic;
use pd_sim::cost::{DecodeCost, KvCost, PrefillCost, WorkerShape};

/// Prefill: 10 ms per prompt token, nothing else; decode: 10 ms per step at any batch.
fn cost(kv_blocks: u32) -> WorkerCost {
    WorkerCost {
        source: "hand".into(),
        prefill: PrefillCost { fixed_ms: 0.0, per_token_ms: 10.0, per_pair_us: 0.0, per_prompt_ms: 0.0 },
        decode: DecodeCost { fixed_ms: 10.0, per_row_ms: 0.0, per_context_us: 0.0 },
        kv: KvCost { bytes_per_token: 1000, commit_fixed_ms: 0.0, commit_ms_per_mb: 0.0 },
        worker: WorkerShape { block_size: 16, kv_blocks, max_batch: 8, max_position: 4096 },
        wide: None,
        window: None,
    }
}

/// `chat`: 1 then 2 requests/s in two 100 s windows, 100 prompt tokens, `output` out.
fn traffic(output: usize) -> Traffic {
    let json = format!(
        r#"{{"window_s": 100, "classes": [{{"name": "chat", "rates_per_s": [1, 2], "input_tokens": 100,
            "output_tokens": {output}, "ttft_slo_ms": 2000, "itl_slo_ms": 50}}]}}"#
    );
    Traffic::parse(&json).expect("traffic")
}

/// Decode planned at the mean (the hand computations below); `decode_percentile` is tested
/// on its own.
fn config(t: &Traffic) -> PlanConfig {
    PlanConfig {
        window_s: t.window_s,
        slos: t.targets().into_iter().collect(),
        decode_percentile: None,
        ..PlanConfig::default()
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9 * b.abs().max(1.0)
}

#[test]
fn a_two_window_traffic_gives_the_hand_computed_pools() {
    let t = traffic(32);
    let p = plan(&t.samples(), Some(200.0), &cost(100), &config(&t)).expect("plan");
    assert_eq!(p.windows.len(), 2);
    // Prefill: 100 tokens = 1 s of one worker; 100 and 200 prompts per 100 s window.
    assert!(close(p.windows[0].prefill_work, 1.0) && close(p.windows[1].prefill_work, 2.0), "{:?}", p.windows);
    // Peak 2.0 busy + a rise of 1.0 per 100 s over 120 s (1.2) = 3.2 at 0.7 each: 5, + 1 spare.
    assert!(close(p.prefill.peak, 2.0) && close(p.prefill.growth, 1.2));
    assert_eq!((p.prefill.serving, p.prefill.replicas), (5, 6));
    assert!(close(p.prefill.after_loss, 0.4) && !p.prefill.cascade);
    // Decode: every batch steps in 10 ms < 50 ms, so max_batch 8 (KV: 100 / ceil(132/16) = 11).
    assert_eq!((p.batch.itl_limit, p.batch.kv_limit, p.batch.planned, p.batch.blocks_per_sequence), (8, 11, 8, 9));
    // 8 rows / 10 ms x 0.8 = 640 tok/s per replica; peak 64 tok/s + 32/100 x 120 = 38.4.
    assert!(close(p.decode.per_replica, 640.0) && close(p.decode.peak, 64.0) && close(p.decode.growth, 38.4));
    assert_eq!((p.decode.serving, p.decode.replicas), (1, 2));
    // 64 tok/s at 10 ms per token per stream: 0.64 sequences, 9 blocks each, of 200 blocks.
    assert!(close(p.batch.peak_sequences, 0.64) && close(p.batch.peak_kv_usage, 0.64 * 9.0 / 200.0));
    // KEDA: TTFT budget (2000 - 1000) / 2 = 500 ms at 0.1 tokens/ms = 50 tokens, at least a chunk.
    assert_eq!(p.keda.prefill_waiting_tokens, 512);
    assert!(close(p.keda.prefill_queue_age_s, 0.5));
    assert_eq!(p.keda.decode_running_sequences, 6);
    assert!(close(p.keda.decode_kv_usage, 8.0 * 9.0 / 100.0 * 0.8));
    let row = &p.classes[0];
    assert_eq!((row.requests, row.retries, row.refused), (300, 0, 0));
    assert!(close(row.peak_input_tok_s, 200.0) && close(row.idle_ttft_p95_ms, 1000.0));
    assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    let md = render::markdown(&p);
    assert!(md.contains("| chat | 300 (0, 0) |") && md.contains("| prefill |"), "{md}");
    assert!(render::svg(&p).contains("chat input"));
}

#[test]
fn losing_a_replica_of_a_pool_planned_without_spare_cascades_into_kv_saturation() {
    let t = traffic(320);
    let cfg = PlanConfig { spare: 0, scale_out_s: 0.0, decode_utilization: 1.0, ..config(&t) };
    let p = plan(&t.samples(), Some(200.0), &cost(100), &cfg).expect("plan");
    // ceil(420 / 16) = 27 blocks per reservation: 3 fit in 100 blocks; 3 / 10 ms = 300 tok/s.
    assert_eq!((p.batch.kv_limit, p.batch.planned), (3, 3));
    // Peak 200 x 320 / 100 = 640 tok/s: 3 replicas; with 2, 6.4 sequences = 3.2 each > 3.
    assert_eq!(p.decode.replicas, 3);
    assert!(p.decode.cascade && close(p.decode.after_loss, 3.2 / 3.0), "{:?}", p.decode);
}

#[test]
fn retries_add_no_demand_and_refused_first_sendings_do() {
    let t = traffic(32);
    let mut samples = t.samples();
    let mut retry = samples[0].clone();
    retry.attempt = 1;
    samples.push(retry);
    samples[1].status = Some(429);
    let p = plan(&samples, Some(200.0), &cost(100), &config(&t)).expect("plan");
    let row = &p.classes[0];
    assert_eq!((row.requests, row.retries, row.refused), (300, 1, 1));
    assert!(close(p.windows[0].prefill_work, 1.0));
}

#[test]
fn an_unreachable_slo_and_bad_input_are_named() {
    let t = traffic(32);
    let mut cfg = config(&t);
    cfg.slos.get_mut("chat").expect("chat").ttft_ms = 500.0;
    let p = plan(&t.samples(), None, &cost(100), &cfg).expect("plan");
    assert!(p.warnings.iter().any(|w| w.contains("TTFT SLO of 500")), "{:?}", p.warnings);
    assert_eq!(plan(&[], None, &cost(100), &cfg).expect_err("empty"), PlanError::Empty);
    let bad = PlanConfig { prefill_utilization: 0.0, ..config(&t) };
    assert_eq!(
        plan(&t.samples(), None, &cost(100), &bad).expect_err("zero"),
        PlanError::NotPositive("--prefill-utilization")
    );
    assert!(Traffic::parse(r#"{"window_s": 0, "classes": []}"#).is_err());
    assert!(Traffic::parse(r#"{"window_s": 1, "classes": [], "extra": 1}"#).expect_err("unknown").contains("extra"));
}

#[test]
fn decode_is_sized_for_the_sequences_open_at_a_percentile_not_their_mean() {
    // 2 requests/s in the second window, 32 tokens out at 10 ms: each holds a sequence for
    // 0.32 s, about 0.64 on average (a second after its sending: one span crosses each window
    // edge). Evenly spaced, never more than 1 is open; Poisson arrivals at that mean give a
    // p95 of mean + 1.645 sqrt(mean).
    let t = traffic(32);
    let cfg = PlanConfig { decode_percentile: Some(0.95), ..config(&t) };
    let p = plan(&t.samples(), Some(200.0), &cost(100), &cfg).expect("plan");
    let w = &p.windows[1];
    let mean = w.decode_mean_sequences;
    assert!((mean - 0.64).abs() < 0.01, "{w:?}");
    assert!((w.decode_sequences - (mean + 1.644_85 * mean.sqrt())).abs() < 1e-3, "{w:?}");
    assert!(close(p.decode.peak, w.decode_sequences / 0.01));
    // A burst the mean hides: 40 first tokens at once, 32 tokens each at 10 ms (0.32 s), every
    // 10 s: 1.28 sequences on average, 40 for 3.2% of the time and 0 otherwise.
    let burst: Vec<RequestSample> = (0..400)
        .map(|i| {
            let at = (i / 40) as f64 * 10_000.0;
            RequestSample {
                class: "chat".into(),
                input_tokens: 100,
                requested_output_tokens: 32,
                sent_ms: at,
                token_ms: (0..32).map(|k| at + 500.0 + 10.0 * k as f64).collect(),
                end_ms: Some(at + 820.0),
                reported_output_tokens: Some(32),
                error: None,
                status: None,
                retry_after_s: None,
                cached_tokens: None,
                attempt: 0,
            }
        })
        .collect();
    let at = |q: Option<f64>| {
        let cfg = PlanConfig { window_s: 100.0, decode_percentile: q, ..config(&t) };
        plan(&burst, Some(100.0), &cost(100), &cfg).expect("plan")
    };
    let (mean, p99) = (at(None), at(Some(0.99)));
    assert!((mean.windows[0].decode_sequences - 1.28).abs() < 1e-6, "{:?}", mean.windows[0]);
    assert_eq!(p99.windows[0].decode_sequences, 40.0, "the burst");
    assert_eq!((mean.decode.serving, p99.decode.serving), (1, 7), "40 at 8 rows x 0.8 each");
    assert!(matches!(
        plan(&burst, None, &cost(100), &PlanConfig { decode_percentile: Some(1.5), ..config(&t) }),
        Err(PlanError::Percentile(_))
    ));
}
