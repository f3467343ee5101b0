use std::sync::Arc;
use std::time::Duration;

use pd_sim::cost::WorkerCost;
use pd_sim::vtime::{Classes, Config, ScheduleConfig};

use super::tally::Histogram;
use super::*;
use crate::loadgen::prompt::Rng;
use crate::loadgen::stats::Summary;

/// bench/fleet.sh's fast cost model: 1 ms prefill steps, 5 ms decode steps.
fn fast() -> WorkerCost {
    serde_json::from_str(
        r#"{"source": "fast", "prefill": {"fixed_ms": 1.0, "per_token_ms": 0.0, "per_pair_us": 0.0},
            "decode": {"fixed_ms": 5.0, "per_row_ms": 0.0, "per_context_us": 0.0},
            "kv": {"bytes_per_token": 23040, "commit_fixed_ms": 0.0, "commit_ms_per_mb": 0.0},
            "worker": {"block_size": 16, "kv_blocks": 100000, "max_batch": 256, "max_position": 8192}}"#,
    )
    .expect("cost model")
}

fn config(prefill: usize, decode: usize) -> Config {
    Config {
        cost: Arc::new(fast()),
        step: pd_prefill::step::StepArgs::default().config().expect("step"),
        prefill,
        decode,
        schedule: ScheduleConfig::default(),
        classes: Classes::load(None).expect("classes"),
        hop: Duration::from_micros(200),
        jitter: None,
    }
}

#[test]
fn closed_loop_clients_send_until_the_cap_and_every_answer_is_whole() {
    let scenario = Scenario::parse(
        "duration=5 max_requests=40 seed=3\nclass interactive concurrency=2 input=32 output=8 ttft_p95_ms=1500",
    )
    .expect("scenario");
    let run = simulate(&scenario, config(1, 1), true, 1);
    assert_eq!(run.samples.len(), 40);
    assert!(run.samples.iter().all(|s| s.ok() && s.output_tokens() == 8 && s.input_tokens == 32));
    // Two clients, each waiting for its answer: never more than two requests open at once.
    for s in &run.samples {
        let open = run.samples.iter().filter(|o| o.sent_ms <= s.sent_ms && o.end_ms.unwrap_or(0.0) > s.sent_ms).count();
        assert!(open <= 2, "{open} requests open at {} ms", s.sent_ms);
    }
    assert_eq!(run.tally.classes[0].served, 40);
    assert_eq!(run.totals.held_blocks, 0);
}

#[test]
fn poisson_arrivals_are_those_pd_bench_run_draws() {
    let scenario =
        Scenario::parse("duration=3 max_requests=1000 seed=11\nclass interactive rate=20 input=16..48 output=4")
            .expect("scenario");
    let run = simulate(&scenario, config(2, 2), true, 1);
    // The runner's driver: seed + class index, first request at the class's start.
    let mut rng = Rng::new(11);
    let (mut at, mut want) = (0.0, Vec::new());
    while at < 3.0 {
        want.push(at * 1e3);
        at += rng.exponential(1.0 / 20.0);
    }
    let mut sent: Vec<f64> = run.samples.iter().map(|s| s.sent_ms).collect();
    sent.sort_by(f64::total_cmp);
    assert_eq!(sent.len(), want.len());
    for (s, w) in sent.iter().zip(&want) {
        assert!((s - w).abs() < 1e-3, "sent at {s} ms, the runner sends at {w} ms");
    }
}

#[test]
fn replicas_report_a_spread_and_the_first_run_is_unjittered() {
    let scenario =
        Scenario::parse("duration=2 max_requests=200 seed=5\nclass interactive rate=40 input=16..200 output=4..32")
            .expect("scenario");
    let one = simulate(&scenario, config(1, 2), false, 1);
    let five = simulate(&scenario, config(1, 2), false, 5);
    assert_eq!(five.replicas.len(), 5);
    assert_eq!(one.replicas[0], five.replicas[0], "the first replica is the plain run");
    assert!(one.samples.is_empty(), "samples are kept only when asked");
    assert!(five.markdown("t", &scenario).contains("Over 5 replicas"));
}

#[test]
fn histogram_percentiles_are_within_half_a_percent_of_nearest_rank() {
    let mut rng = Rng::new(9);
    let values: Vec<f64> = (0..20_000).map(|_| rng.exponential(40.0) + 0.01).collect();
    let mut h = Histogram::default();
    values.iter().for_each(|&v| h.record(v));
    let exact = Summary::of(values.iter().copied());
    for (q, want) in [(0.5, exact.p50), (0.95, exact.p95), (0.99, exact.p99)] {
        let (got, want) = (h.quantile(q).expect("quantile"), want.expect("exact"));
        assert!((got / want - 1.0).abs() < 0.005, "p{q}: {got} vs {want}");
    }
    assert_eq!(h.count(), 20_000);
}
