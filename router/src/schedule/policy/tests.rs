use super::*;

fn waiting(seq: u64, priority: i32, deadline_ms: u64, tokens: usize) -> Waiting<()> {
    let t0 = Instant::now();
    Waiting {
        seq,
        class: 0,
        priority,
        tokens,
        work: tokens,
        max_tokens: 16,
        arrived: t0,
        deadline: t0 + Duration::from_millis(deadline_ms),
        itl_slo: Duration::from_millis(100),
        long: false,
        reply: (),
    }
}

#[test]
fn higher_priority_first_then_earliest_deadline_then_arrival() {
    let q = vec![waiting(0, 0, 10, 5), waiting(1, 10, 900, 5), waiting(2, 10, 500, 5), waiting(3, 10, 500, 5)];
    assert_eq!(next(&q, true), Some(2));
    let q = vec![waiting(0, 0, 10, 5)];
    assert_eq!(next(&q, true), Some(0));
    assert_eq!(next::<()>(&[], true), None);
}

#[test]
fn long_prompts_over_the_cap_let_shorter_work_pass() {
    let mut q = vec![waiting(0, 10, 100, 2000), waiting(1, 10, 900, 50), waiting(2, 0, 10, 2000)];
    q[0].long = true;
    q[2].long = true;
    assert_eq!(next(&q, true), Some(0), "under the cap: the usual order");
    assert_eq!(next(&q, false), Some(1), "at the cap: the short one passes");
    q.remove(1);
    assert_eq!(next(&q, false), None, "only long ones wait: none goes");
    let ms = Duration::from_millis;
    // Long against the share of the SLO admission allows (60%): 450 ms of 1.5 s.
    assert!(is_long(ms(450), ms(1500)) && !is_long(ms(440), ms(1500)));
}

#[test]
fn a_prompt_too_long_for_its_slo_is_refused_only_for_overload() {
    let b = Budget {
        queued_tokens: 0,
        max_queued_tokens: 100_000,
        ttft_slo: Duration::from_millis(1500),
        oldest_waiting: Duration::ZERO,
        max_queue_age: Duration::from_secs(3),
    };
    let ms = Duration::from_millis;
    // 2,000 tokens at 1,000 tokens/s: 2 s of its own, past the 1.5 s SLO by itself.
    assert_eq!(admit("interactive", 2000, b, ms(300), ms(2000), 1000.0), Ok(()), "light load: served");
    assert_eq!(admit("interactive", 2000, b, ms(1900), ms(2000), 1000.0), Ok(()), "behind one like it");
    let over = admit("interactive", 2000, b, ms(5000), ms(2000), 1000.0).expect_err("overload");
    assert!(over.message.contains("overloaded"), "{}", over.message);
    assert_eq!(over.retry_after_s, 3);
    // A short prompt keeps the SLO test.
    assert!(admit("interactive", 100, b, ms(850), ms(100), 1000.0).is_err());
}

#[test]
fn tokens_ahead_skip_lower_priorities_and_count_others_up_to_the_own_prompt() {
    let q = vec![waiting(0, 0, 10, 2000), waiting(1, 10, 10, 50), waiting(2, 20, 10, 30)];
    // A 40-token interactive (10) request waits for the 40 + 30 of those queued at >= 10,
    // and for at most 40 tokens of each prompt in flight (shortest remaining runs first).
    assert_eq!(tokens_ahead(&q, 10, |cap| [2048usize, 20].iter().map(|&t| t.min(cap) as u64).sum(), 40), 70 + 40 + 20);
    assert_eq!(tokens_ahead(&q, 0, |_| 0, 5000), 2080);
}

#[test]
fn admission_checks_the_class_budget_then_the_slo() {
    let b = Budget {
        queued_tokens: 900,
        max_queued_tokens: 1000,
        ttft_slo: Duration::from_millis(1500),
        oldest_waiting: Duration::from_millis(200),
        max_queue_age: Duration::from_secs(3),
    };
    let ms = Duration::from_millis;
    assert_eq!(admit("interactive", 100, b, ms(100), ms(400), 250.0), Ok(()));
    let full = admit("interactive", 350, b, ms(100), ms(400), 250.0).expect_err("budget");
    assert!(full.message.contains("max_queued_tokens"), "{}", full.message);
    assert_eq!(full.retry_after_s, 1); // 250 tokens over at 250 tok/s
    let late = admit("interactive", 10, b, ms(4200), ms(40), 250.0).expect_err("slo");
    assert!(late.message.contains("TTFT SLO"), "{}", late.message);
    assert_eq!(late.retry_after_s, 4); // 3.34 s over 60% of the SLO, rounded up
    assert!(admit("interactive", 10, b, ms(800), ms(100), 250.0).is_ok(), "within 60% of the SLO");
    // Work ahead: its own prefill counts too; nothing ahead: a long prompt is not overload.
    assert!(admit("interactive", 10, b, ms(800), ms(200), 250.0).is_err());
    assert_eq!(admit("interactive", 10, b, Duration::ZERO, ms(9000), 250.0), Ok(()));
}

#[test]
fn queue_wait_is_a_p95_of_waiting_for_streams_to_end() {
    assert_eq!(queue_wait(1, Some(2.0)), Duration::from_millis(1500)); // 3 mean gaps of 0.5 s
    assert_eq!(queue_wait(4, Some(2.0)), Duration::from_secs(4)); // 4 + 2 * 2 gaps
    assert_eq!(queue_wait(0, Some(2.0)), Duration::ZERO);
    assert_eq!(queue_wait(6, None), Duration::ZERO);
}

#[test]
fn estimated_wait_and_retry_after() {
    assert_eq!(estimated_wait(400, 100, 250.0), Duration::from_secs(2));
    assert_eq!(estimated_wait(0, 0, 0.0), Duration::ZERO);
    assert_eq!(retry_after(Duration::from_millis(10)), 1);
    assert_eq!(retry_after(Duration::from_millis(2001)), 3);
}

#[test]
fn conditional_disaggregation_is_local_only_when_short_busy_and_roomy() {
    let rule =
        LocalRule { max_tokens: 256, max_ratio: 4.0, min_prefill_wait: Duration::from_millis(300), min_free_kv: 0.25 };
    let busy = Some(Duration::from_millis(800));
    let idle = Some(Duration::from_millis(50));
    assert_eq!(place(&rule, 64, 128, busy, 0.9), Place::Local("short_prompt_prefill_busy"));
    assert_eq!(place(&rule, 64, 128, idle, 0.9), Place::Remote("prefill_pool_free"));
    assert_eq!(place(&rule, 2048, 128, busy, 0.9), Place::Remote("long_prompt"));
    assert_eq!(place(&rule, 200, 16, busy, 0.9), Place::Remote("prompt_output_ratio"));
    assert_eq!(place(&rule, 64, 128, busy, 0.1), Place::Remote("decode_kv_low"));
    assert_eq!(place(&rule, 5000, 1, None, 0.0), Place::Local("no_prefill_worker"));
    let never = LocalRule { max_tokens: 0, ..rule };
    assert_eq!(place(&never, 1, 128, busy, 0.9), Place::Remote("long_prompt"));
}

#[test]
fn the_backlog_counts_when_requests_are_ahead_or_this_one_cannot_be_placed_now() {
    let rate = Some(2.0);
    assert_eq!(backlog_wait(0, true, rate), Duration::ZERO);
    // At the head of the queue, waiting for room: one service gap's p95.
    assert_eq!(backlog_wait(0, false, rate), Duration::from_millis(1500));
    assert_eq!(backlog_wait(3, true, rate), Duration::from_secs(4)); // 4 + 2 * 2 gaps of 0.5 s
    assert_eq!(backlog_wait(3, false, None), Duration::ZERO); // not measured: no estimate
}

#[test]
fn a_queue_whose_oldest_request_is_past_the_queue_age_refuses_at_once() {
    let b = Budget {
        queued_tokens: 0,
        max_queued_tokens: 1000,
        ttft_slo: Duration::from_millis(1500),
        oldest_waiting: Duration::from_millis(4200),
        max_queue_age: Duration::from_secs(3),
    };
    let r = admit("interactive", 50, b, Duration::ZERO, Duration::from_millis(100), 250.0).expect_err("stuck queue");
    assert!(r.message.contains("max_queue_age_ms") && r.message.contains("4200"), "{}", r.message);
    assert_eq!(r.retry_after_s, 2); // 1.2 s over the age, rounded up
}

fn view() -> QueueView {
    QueueView {
        tokens_ahead: 0,
        tokens_per_s: 1000.0,
        queued_ahead: 0,
        oldest_ahead: Duration::ZERO,
        decode_room: true,
        prefill_room: true,
        released_per_s: Some(10.0),
        served_per_s: Some(20.0),
    }
}

#[test]
fn an_idle_fleet_with_room_estimates_no_wait() {
    let e = estimate_wait(&view());
    assert_eq!(e.total(), Duration::ZERO, "{e:?}");
}

#[test]
fn the_admission_estimate_is_the_longest_of_its_causes() {
    // Prefill work ahead: 1,500 tokens at 1,000 tokens/s.
    let e = estimate_wait(&QueueView { tokens_ahead: 1500, ..view() });
    assert_eq!((e.prefill, e.total()), (Duration::from_millis(1500), Duration::from_millis(1500)));
    // No decode room: the 3 ahead and this one each wait for a stream to end, a p95 at 10/s
    // (4 + 2 * 2 gaps of 100 ms); the queue ahead is served at 20/s (4 + 4 gaps of 50 ms).
    let held = QueueView { queued_ahead: 3, decode_room: false, ..view() };
    let e = estimate_wait(&held);
    assert_eq!(e.decode, Duration::from_millis(800));
    assert_eq!(e.backlog, Duration::from_millis(400));
    assert_eq!(e.total(), Duration::from_millis(800));
    // Too few streams ended to tell a rate: the decode side adds nothing, the backlog remains.
    let e = estimate_wait(&QueueView { released_per_s: None, ..held });
    assert_eq!((e.decode, e.total()), (Duration::ZERO, Duration::from_millis(400)));
    // Nothing queued but no prefill slot free: this request waits at the head for the queue's
    // service (1 + 2 gaps of 50 ms).
    let e = estimate_wait(&QueueView { prefill_room: false, ..view() });
    assert_eq!(e.backlog, Duration::from_millis(150));
    // And at least as long again as the oldest request ahead has waited.
    let e = estimate_wait(&QueueView { queued_ahead: 1, oldest_ahead: Duration::from_secs(2), ..view() });
    assert_eq!(e.total(), Duration::from_secs(2));
}
