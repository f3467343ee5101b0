use super::*;

fn cfg() -> StepConfig {
    StepConfig {
        max_prompts: 4,
        max_long: 1,
        long_threshold: 512,
        target: Duration::from_millis(150),
        min_chunk: 16,
        short_chunk: 0,
        max_chunk: 512,
        max_wait: Duration::from_secs(2),
        short_target: Duration::from_millis(50),
        short_window: Duration::from_secs(3),
        preempt: false,
    }
}

fn cand(remaining: usize, done: usize, waited_ms: u64) -> Candidate {
    Candidate { remaining, done, len: remaining + done, waited: Duration::from_millis(waited_ms) }
}

#[test]
fn a_short_prompt_runs_first_beside_the_documents_chunk_within_the_budget() {
    let cost = CostModel::default();
    let cands = [cand(1500, 548, 10), cand(20, 0, 0)];
    let step = plan(&cands, &cfg(), &cost);
    assert_eq!(step[0], (1, 20), "the short prompt first, whole");
    assert!(step.len() == 2 && step[1].0 == 0 && step[1].1 > 0, "the document still advances: {step:?}");
    let chunks: Vec<_> = step.iter().map(|&(i, t)| (t, cands[i].done)).collect();
    assert!(cost.predict(&chunks) <= cfg().target + Duration::from_millis(10), "{:?}", cost.predict(&chunks));
}

#[test]
fn a_documents_last_tokens_do_not_put_it_ahead_of_a_short_prompt() {
    let cost = CostModel::default();
    // 16 tokens left of a 2,048-token document, and a 94-token question: the question first.
    let cands = [cand(16, 2032, 10), cand(94, 0, 0)];
    let config = StepConfig { short_chunk: 128, ..cfg() };
    let step = plan(&cands, &config.for_step(Some(Duration::ZERO)), &cost);
    assert_eq!(step, vec![(1, 94)], "the question alone: the document's finishing chunk waits");
    // Without short prompts about, shortest remaining first among long prompts.
    let step = plan(&[cand(1000, 0, 0), cand(16, 2032, 0)], &cfg(), &cost);
    assert_eq!(step[0], (1, 16));
}

#[test]
fn at_most_one_long_prompt_and_at_most_max_prompts() {
    let cost = CostModel { per_token_ms: 0.01, per_pair_us: 0.0, ..CostModel::default() };
    let cands = [cand(2000, 0, 0), cand(3000, 0, 0), cand(10, 0, 0), cand(11, 0, 0), cand(12, 0, 0), cand(13, 0, 0)];
    let step = plan(&cands, &cfg(), &cost);
    let ids: Vec<usize> = step.iter().map(|&(i, _)| i).collect();
    assert_eq!(ids, vec![2, 3, 4, 5], "four short prompts fill the step; no long one fits");
    let step = plan(&cands[..3], &cfg(), &cost);
    assert_eq!(step.iter().map(|&(i, _)| i).collect::<Vec<_>>(), vec![2, 0], "one long beside the short");
}

#[test]
fn a_starved_prompt_goes_first_and_the_first_always_progresses() {
    let cost = CostModel { fixed_ms: 1000.0, ..CostModel::default() }; // over budget already
    let step = plan(&[cand(10, 0, 0), cand(900, 100, 5000)], &cfg(), &cost);
    assert_eq!(step, vec![(1, 16)], "starved first, min_chunk despite the budget");
    assert!(plan(&[], &cfg(), &cost).is_empty());
}

#[test]
fn single_config_runs_one_prompt_in_fixed_chunks() {
    let step = plan(&[cand(600, 0, 0), cand(5, 0, 0)], &StepConfig::single(256), &CostModel::default());
    assert_eq!(step, vec![(1, 5)]);
    let step = plan(&[cand(600, 0, 0)], &StepConfig::single(256), &CostModel::default());
    assert_eq!(step, vec![(0, 256)]);
}

#[test]
fn the_cost_model_learns_a_slower_machine() {
    let mut cost = CostModel::default();
    let chunks = [(64, 0)];
    let predicted = cost.predict(&chunks);
    for _ in 0..30 {
        cost.observe(&chunks, predicted * 2);
    }
    let learned = cost.predict(&chunks).as_secs_f64() / predicted.as_secs_f64();
    assert!((learned - 2.0).abs() < 0.05, "{learned}");
}

#[test]
fn short_prompts_get_their_short_chunk_whatever_the_budget_and_long_ones_do_not() {
    let cost = CostModel::default();
    let config = StepConfig { short_chunk: 128, ..cfg() };
    let step = plan(&[cand(1500, 548, 10), cand(96, 0, 0)], &config, &cost);
    assert_eq!(step[0], (1, 96), "the whole short prompt in one step: {step:?}");
    assert_eq!(step.len(), 1, "no budget left for the document this step");
    let step = plan(&[cand(1500, 548, 10)], &config, &cost);
    assert!(step[0].1 < 64, "the document alone keeps to the budget: {step:?}");
}

#[test]
fn while_short_prompts_are_about_steps_shrink_and_carry_no_long_chunk_beyond_the_budget() {
    let cost = CostModel::default();
    let config = StepConfig { short_chunk: 128, ..cfg() };
    // No short prompt lately (or never): the full target.
    for since in [None, Some(Duration::from_secs(4))] {
        assert_eq!(config.for_step(since).target, Duration::from_millis(150));
    }
    let about = config.for_step(Some(Duration::from_millis(500)));
    assert_eq!(about.target, Duration::from_millis(50));
    assert_eq!(
        StepConfig { short_window: Duration::ZERO, ..config }.for_step(Some(Duration::ZERO)).target,
        config.target
    );
    // A document alone: a smaller chunk in a shorter step.
    let doc = [cand(1500, 548, 0)];
    let (full, short) = (plan(&doc, &config, &cost)[0].1, plan(&doc, &about, &cost)[0].1);
    assert!(
        short < full && short >= config.min_chunk,
        "document chunk {short} while short prompts are about, {full} otherwise"
    );
    assert!(cost.predict(&[(short, 548)]) <= Duration::from_millis(50) || short == config.min_chunk);
    // A short prompt and the document: the short one alone when its chunk fills the budget.
    let both = [cand(1500, 548, 0), cand(60, 0, 0)];
    assert_eq!(plan(&both, &about, &cost), vec![(1, 60)]);
    let with_doc = plan(&both, &config, &cost);
    assert_eq!(with_doc[0], (1, 60));
    // The document still advances: once it has waited max_wait it goes first.
    let starved = [cand(1500, 548, 2_500), cand(60, 0, 0)];
    assert_eq!(plan(&starved, &about, &cost)[0].0, 0);
    assert!(plan(&starved, &about, &cost).iter().any(|&(i, t)| i == 1 && t == 60));
}

#[test]
fn the_step_flags_are_checked_and_reach_the_policy() {
    let args = crate::step::StepArgs::default();
    let c = args.config().expect("defaults are valid");
    assert_eq!((c.short_target, c.short_window), (Duration::from_millis(25), Duration::from_secs(3)));
    let bad = crate::step::StepArgs { short_step_target_ms: 0, ..args };
    assert!(bad.config().expect_err("zero").contains("--short-step-target-ms"));
}

#[test]
fn only_a_step_of_long_prompts_none_finishing_is_preemptible_and_it_stops_early_only() {
    let config = StepConfig { long_threshold: 256, preempt: true, ..StepConfig::single(512) };
    // (prompt length, tokens this step, tokens before it)
    assert!(config.preemptible([(2048, 512, 0), (1024, 256, 256)]));
    assert!(!config.preemptible([(2048, 512, 0), (100, 100, 0)]), "a short prompt rides along");
    assert!(!config.preemptible([(2048, 512, 1536)]), "it finishes a prompt: its layers ship");
    assert!(!StepConfig { preempt: false, ..config }.preemptible([(2048, 512, 0)]));
    // 30 layers: stops after layers 0..=22 (at least a quarter, 7.5 layers, left), not later.
    let last = (0..30).filter(|&l| stops_after_layer(l, 30)).max();
    assert_eq!(last, Some(22));
    assert!((STOPPABLE_SHARE - 23.0 / 30.0).abs() < 0.02, "the time rule matches the layer rule");
}

#[test]
fn the_narrowed_search_finds_what_the_plain_binary_search_finds() {
    // The plain search over the prediction, as the planner did before narrowing it.
    let plain = |cost: &CostModel, ctx: usize, left: Duration, max: usize| {
        let (mut lo, mut hi) = (0usize, max);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if cost.predict(&[(mid, ctx)]).saturating_sub(cost.predict(&[])) <= left {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    };
    // A fixed xorshift stream: models from flat to attention-heavy, budgets from nothing to
    // more than any chunk costs, and the negative coefficient no narrowing is tried for.
    let mut x = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for i in 0..20_000 {
        // Every 50th: a slightly negative per-token cost (a fit can give one), with a fixed
        // cost large enough that no step predicts below zero.
        let negative = i % 50 == 0;
        let cost = CostModel {
            fixed_ms: next(40) as f64 + if negative { 100.0 } else { 0.0 },
            per_token_ms: if negative { -0.01 } else { next(5000) as f64 / 1000.0 },
            per_pair_us: if i % 7 == 0 { 0.0 } else { next(4000) as f64 / 1000.0 },
            scale: 0.05 + next(300) as f64 / 100.0,
        };
        let (ctx, max) = (next(4096) as usize, 1 + next(2048) as usize);
        let left = Duration::from_micros(next(400_000));
        assert_eq!(
            cost.tokens_within(ctx, left, max),
            plain(&cost, ctx, left, max),
            "{cost:?} ctx {ctx} left {left:?}"
        );
    }
}
