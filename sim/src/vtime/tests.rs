use std::sync::Arc;
use std::time::Duration;

use pd_prefill::step::{StepArgs, StepConfig};

use super::*;
use crate::cost::tests::sample;
use crate::cost::WorkerCost;

/// Requests sent at fixed times; closed-loop clients resend until `resend` runs out.
#[derive(Default)]
struct Script {
    sends: Vec<(Duration, Request)>,
    outcomes: Vec<(Outcome, Duration)>,
    /// Each ended request is sent again (as a closed-loop client would) this many times in all.
    resend: usize,
}

impl Traffic for Script {
    fn arrivals(&mut self, _: Duration, _: Duration) -> (Vec<(Duration, Request)>, bool) {
        (std::mem::take(&mut self.sends), false)
    }

    fn ended(&mut self, outcome: Outcome, now: Duration) -> Vec<(Duration, Request)> {
        let again = outcome.request.clone();
        self.outcomes.push((outcome, now));
        if self.resend == 0 {
            return Vec::new();
        }
        self.resend -= 1;
        vec![(now, again)]
    }
}

fn request(client: u64, class: &str, prompt: usize, max_tokens: usize) -> Request {
    let prompt = (0..prompt as u32).map(|i| i.wrapping_mul(2_654_435_761) % 30_000 + client as u32).collect();
    Request { client, class: class.into(), prompt: Arc::new(prompt), max_tokens, attempt: 0 }
}

fn config(cost: WorkerCost, step: StepConfig, prefill: usize, decode: usize, hop_ms: u64) -> Config {
    Config {
        cost: Arc::new(cost),
        step,
        prefill,
        decode,
        schedule: ScheduleConfig::default(),
        classes: Classes::load(None).expect("built-in classes"),
        hop: Duration::from_millis(hop_ms),
        jitter: None,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[test]
fn one_request_follows_the_cost_model_and_the_hops() {
    let cost = sample();
    let cfg = config(cost.clone(), StepConfig::single(512), 1, 1, 1);
    let mut script = Script { sends: vec![(Duration::ZERO, request(1, "interactive", 100, 4))], ..Script::default() };
    let totals = run(cfg, &mut script);
    let (o, end) = &script.outcomes[0];
    assert_eq!(o.error, None);
    // Client -> router -> decode (reserve) -> router (opened) -> prefill: 4 hops.
    let prefilled = 4.0 + cost.prefill_step_ms(&[(100, 0)]);
    // The hand-off (a hop and the commit), then decode -> router -> client.
    let first = prefilled + 1.0 + cost.kv_commit_ms(100) + 2.0;
    let got: Vec<f64> = o.tokens.iter().map(|&t| ms(t)).collect();
    assert!((got[0] - first).abs() < 1e-6, "first token at {} ms, expected {first}", got[0]);
    // Each later token: one decode step of the one row over its context.
    let mut at = first;
    for (i, &t) in got.iter().enumerate().skip(1) {
        at += cost.decode_step_ms(1, 100 + i, &[]);
        assert!((t - at).abs() < 1e-6, "token {i} at {t} ms, expected {at}");
    }
    assert_eq!(got.len(), 4);
    // The end reaches the router one hop after the last token left the worker, the client one more.
    assert!((ms(*end) - at).abs() < 1e-6);
    assert_eq!((totals.requests, totals.held_blocks), (1, 0));
}

#[test]
fn every_request_ends_and_no_block_is_held_under_overload() {
    // 100 blocks of 16 tokens per decode worker: 7 sequences of 100 + 100 tokens at once.
    let cfg = config(sample(), StepArgs::default().config().expect("step"), 1, 2, 0);
    let sends = (0..40).map(|c| (Duration::from_millis(c * 3), request(c, "interactive", 100, 100))).collect();
    let mut script = Script { sends, resend: 60, ..Script::default() };
    let totals = run(cfg, &mut script);
    assert_eq!(script.outcomes.len() as u64, totals.requests);
    assert_eq!(totals.requests, 100);
    let served = script.outcomes.iter().filter(|(o, _)| o.error.is_none()).count();
    let refused = script.outcomes.iter().filter(|(o, _)| o.status == Some(429)).count();
    assert!(served > 0 && refused > 0, "{served} served, {refused} refused: the fleet was not overloaded");
    assert_eq!(
        served + refused,
        100,
        "only 429s besides answers: {:?}",
        script.outcomes.iter().find(|(o, _)| o.status.is_some_and(|s| s != 429)).map(|(o, _)| &o.error)
    );
    for (o, _) in script.outcomes.iter().filter(|(o, _)| o.error.is_none()) {
        assert_eq!(o.tokens.len(), 100, "every answer has its tokens");
    }
    assert_eq!(totals.held_blocks, 0);
}

#[test]
fn runs_are_deterministic() {
    let go = || {
        let cfg = config(sample(), StepArgs::default().config().expect("step"), 2, 2, 0);
        let sends = (0..30)
            .map(|c| (Duration::from_millis(c * 17), request(c, "interactive", 20 + (c as usize * 37) % 600, 8)))
            .collect();
        let mut script = Script { sends, ..Script::default() };
        run(cfg, &mut script);
        script.outcomes.into_iter().map(|(o, end)| (o.request.client, o.tokens, end)).collect::<Vec<_>>()
    };
    assert_eq!(go(), go());
}

#[test]
fn a_short_prompt_cuts_a_preemptible_step_of_a_long_one() {
    let cfg = config(sample(), StepArgs::default().config().expect("step"), 1, 1, 0);
    let long = request(1, "batch", 1500, 2);
    let short = request(2, "interactive", 32, 2);
    let mut script =
        Script { sends: vec![(Duration::ZERO, long), (Duration::from_millis(30), short)], ..Script::default() };
    let totals = run(cfg, &mut script);
    assert!(totals.preempted >= 1, "{totals:?}");
    let ttft = |client| {
        let (o, _) = script.outcomes.iter().find(|(o, _)| o.request.client == client).expect("outcome");
        ms(o.tokens[0] - o.sent)
    };
    assert!(ttft(2) < ttft(1), "the short prompt ({} ms) waited for the long one ({} ms)", ttft(2), ttft(1));
    assert_eq!(totals.held_blocks, 0);
}

#[test]
fn without_a_prefill_pool_prompts_are_prefilled_in_the_decode_batch() {
    let cost = sample();
    let cfg = config(cost.clone(), StepArgs::default().config().expect("step"), 0, 1, 0);
    let mut script = Script { sends: vec![(Duration::ZERO, request(1, "interactive", 100, 3))], ..Script::default() };
    let totals = run(cfg, &mut script);
    let (o, _) = &script.outcomes[0];
    // The real worker's chunked policy: the whole 100-token prompt in the first step, whose
    // end also gives the first token.
    let first = cost.decode_step_ms(0, 0, &[(100, 0)]);
    assert!((ms(o.tokens[0]) - first).abs() < 1e-6, "{:?} vs {first}", o.tokens);
    assert_eq!((o.tokens.len(), totals.prefill_steps), (3, 0));
}

#[test]
fn a_request_no_worker_can_hold_ends_with_an_error_and_the_run_ends() {
    // 100 blocks of 16 tokens: 2,000 tokens of prompt + output fit on no decode worker.
    let cfg = config(sample(), StepArgs::default().config().expect("step"), 1, 1, 0);
    let mut script =
        Script { sends: vec![(Duration::ZERO, request(1, "interactive", 1000, 1000))], ..Script::default() };
    let totals = run(cfg, &mut script);
    let (o, _) = &script.outcomes[0];
    assert!(o.error.is_some() && o.tokens.is_empty(), "{o:?}");
    assert!(matches!(o.status, Some(429 | 503)), "{:?}", o.status);
    assert_eq!((totals.requests, totals.held_blocks), (1, 0));
}
