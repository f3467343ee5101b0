//! Event sequences replayed at chosen instants: no clock is read, nothing sleeps.

use super::*;

const CLASSES: &str = r#"
default = "interactive"
[classes.interactive]
priority = 10
max_input_tokens = 4096
max_output_tokens = 1024
ttft_slo_ms = 1500
itl_slo_ms = 100
max_queued_tokens = 16384
max_queue_age_ms = 3000
[classes.batch]
priority = 0
max_input_tokens = 8000
max_output_tokens = 4096
ttft_slo_ms = 600000
itl_slo_ms = 1000
max_queued_tokens = 1000000
max_queue_age_ms = 600000
"#;

pub(crate) fn classes() -> Classes {
    Classes::parse(CLASSES).expect("classes")
}

pub(crate) fn class(name: &str) -> Arc<Class> {
    classes().all().iter().find(|c| c.name == name).expect("a class of that name").clone()
}

fn decode(free: u32, max_batch: u32) -> pb::DecodeLoad {
    pb::DecodeLoad { free_blocks: free, total_blocks: 1000, block_size: 16, max_batch, ..Default::default() }
}

fn prefill(slots: u32, tokens_per_s: f64) -> pb::PrefillLoad {
    pb::PrefillLoad { max_partial_prefills: slots, prefill_tokens_per_s: tokens_per_s, ..Default::default() }
}

pub(crate) fn prompt(tokens: usize, salt: u32) -> Arc<Prompt> {
    Arc::new(Prompt::new((0..tokens as u32).map(|t| t * 7 + salt * 100_003).collect()))
}

/// A state with `decode` workers (free blocks, max batch) and `prefill` workers (slots,
/// tokens/s), refreshed at `t0`.
fn fleet(decode_workers: &[(u32, u32)], prefill_workers: &[(u32, f64)], t0: Instant) -> State<&'static str> {
    let config = ScheduleConfig { long_prefills_per_worker: 1, ..ScheduleConfig::default() };
    let mut s = State::new(&classes(), config, !prefill_workers.is_empty());
    let d = decode_workers.iter().enumerate().map(|(i, &(f, b))| (format!("d{i}"), decode(f, b))).collect();
    let p = prefill_workers.iter().enumerate().map(|(i, &(n, r))| (format!("p{i}"), prefill(n, r))).collect();
    s.refreshed(d, p, t0);
    s
}

fn names(granted: &[(&'static str, Placement)]) -> Vec<&'static str> {
    granted.iter().map(|(r, _)| *r).collect()
}

#[test]
fn a_full_batch_queues_requests_until_a_stream_ends() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let mut s = fleet(&[(1000, 2)], &[(4, 10_000.0)], t0);
    let class = class("interactive");
    for (name, ms) in [("a", 0), ("b", 1), ("c", 2)] {
        s.submit(&class, prompt(32, ms as u32), 16, name, at(ms)).expect("admitted");
    }
    let granted = s.dispatch(at(2));
    assert_eq!(names(&granted), ["a", "b"], "two batch slots");
    assert_eq!(s.queued_per_class()[class.index], 1, "one interactive request waits");
    // Nothing changes until a stream ends.
    assert!(s.dispatch(at(50)).is_empty());
    let seq_a = granted[0].1.seq;
    s.decode_opened(seq_a);
    s.prefill_done(seq_a);
    s.release(seq_a, true, at(100));
    let granted = s.dispatch(at(100));
    assert_eq!(names(&granted), ["c"]);
    assert_eq!(granted[0].1.waited, Duration::from_millis(98), "queued at 2 ms, granted at 100 ms");
    assert_eq!(s.queued_per_class(), [0, 0]);
}

#[test]
fn bookings_hold_blocks_until_the_worker_reports_them_and_go_back_on_release() {
    let t0 = Instant::now();
    let mut s = fleet(&[(100, 8)], &[(4, 10_000.0)], t0);
    let class = class("interactive");
    // 32 prompt + 16 output tokens: 3 blocks of 16.
    s.submit(&class, prompt(32, 1), 16, "a", t0).expect("admitted");
    let seq = s.dispatch(t0)[0].1.seq;
    let d = &s.fleet.decode()[0];
    assert_eq!((d.free_blocks(), d.ours()), (97, 1), "granted, not yet reserved");
    // A refresh from before the reservation keeps the router's own accounting.
    s.refreshed(vec![("d0".into(), decode(100, 8))], vec![("p0".into(), prefill(4, 10_000.0))], t0);
    assert_eq!(s.fleet.decode()[0].free_blocks(), 97);
    // The worker reserved it: its own count includes the blocks, ours no longer does.
    s.decode_opened(seq);
    s.decode_opened(seq); // twice is once
    s.refreshed(vec![("d0".into(), decode(97, 8))], vec![("p0".into(), prefill(4, 10_000.0))], t0);
    assert_eq!(s.fleet.decode()[0].free_blocks(), 97);
    assert_eq!(s.fleet.prefill()[0].busy(), 1, "its prefill slot");
    s.prefill_done(seq);
    assert_eq!(s.fleet.prefill()[0].busy(), 0);
    s.release(seq, true, t0);
    s.release(seq, true, t0); // a second release changes nothing
    assert_eq!((s.fleet.decode()[0].ours(), s.fleet.decode()[0].free_blocks()), (0, 97), "the worker's last report");
    s.refreshed(vec![("d0".into(), decode(100, 8))], vec![("p0".into(), prefill(4, 10_000.0))], t0);
    assert_eq!(s.fleet.decode()[0].free_blocks(), 100);
}

#[test]
fn a_withdrawn_request_leaves_the_queue_and_its_tokens() {
    let t0 = Instant::now();
    let mut s = fleet(&[(1000, 1)], &[(4, 10_000.0)], t0);
    let class = class("interactive");
    s.submit(&class, prompt(32, 1), 16, "a", t0).expect("admitted");
    let b = s.submit(&class, prompt(40, 2), 16, "b", t0).expect("admitted");
    assert_eq!(names(&s.dispatch(t0)), ["a"]);
    assert!(s.withdraw(b.seq, t0 + Duration::from_millis(5)));
    assert!(!s.withdraw(b.seq, t0 + Duration::from_millis(6)), "only once");
    assert_eq!((s.queued_per_class(), s.queued_tokens.clone()), (vec![0, 0], vec![0, 0]));
}

#[test]
fn at_the_cap_of_long_prompts_a_short_one_passes_and_the_next_long_one_waits_its_turn() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    // One prefill worker at 1,000 tokens/s: 2,000 tokens take 2 s, long against the 1.5 s SLO.
    let mut s = fleet(&[(10_000, 64)], &[(4, 1000.0)], t0);
    let (interactive, batch) = (class("interactive"), class("batch"));
    let first = s.submit(&batch, prompt(2000, 1), 16, "doc1", at(0)).expect("admitted");
    assert_eq!(names(&s.dispatch(at(0))), ["doc1"]);
    s.submit(&batch, prompt(2000, 2), 16, "doc2", at(1)).expect("admitted");
    s.submit(&interactive, prompt(32, 3), 16, "chat", at(2)).expect("admitted");
    assert_eq!(names(&s.dispatch(at(2))), ["chat"], "the long one waits for its turn");
    s.prefill_done(first.seq);
    assert_eq!(names(&s.dispatch(at(2100))), ["doc2"]);
}

#[test]
fn with_no_decode_room_admission_counts_the_rate_streams_end_at() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let mut s = fleet(&[(10_000, 1)], &[(4, 10_000.0)], t0);
    let class = class("interactive");
    // Streams have ended every 2 s lately (3 in the window): 0.6 per second.
    for ms in [0, 2000, 4000] {
        s.submit(&class, prompt(16, ms as u32), 16, "x", at(ms)).expect("admitted");
        let seq = s.dispatch(at(ms))[0].1.seq;
        s.release(seq, true, at(ms + 1));
    }
    s.submit(&class, prompt(16, 9), 16, "running", at(4500)).expect("admitted");
    assert_eq!(names(&s.dispatch(at(4500))), ["running"]);
    // The next one waits for a stream to end: a p95 of 3 gaps of 1.67 s = 5 s, past 60% of
    // the 1.5 s SLO: refused with a Retry-After.
    match s.submit(&class, prompt(16, 10), 16, "refused", at(4600)) {
        Err(RouterError::Overloaded { retry_after_s, .. }) => assert!(retry_after_s >= 4, "{retry_after_s}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn when_the_last_decode_worker_leaves_the_waiters_are_dropped() {
    let t0 = Instant::now();
    let mut s = fleet(&[(1000, 1)], &[(4, 10_000.0)], t0);
    let class = class("interactive");
    s.submit(&class, prompt(32, 1), 16, "a", t0).expect("admitted");
    s.submit(&class, prompt(32, 2), 16, "b", t0).expect("admitted");
    assert_eq!(names(&s.dispatch(t0)), ["a"]);
    s.refreshed(vec![], vec![("p0".into(), prefill(4, 10_000.0))], t0);
    assert_eq!(s.queued_per_class(), [0, 0]);
    assert!(matches!(s.submit(&class, prompt(8, 3), 4, "c", t0), Err(RouterError::NoWorker("decode"))));
    assert!(!s.ready());
}

#[test]
fn a_quarantined_decode_worker_gets_new_work_only_when_no_other_has_room() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let mut s = fleet(&[(1000, 8), (500, 8)], &[(4, 10_000.0)], t0);
    let class = class("interactive");
    s.quarantine("d0", at(10_000), t0);
    s.submit(&class, prompt(32, 1), 16, "a", at(1)).expect("admitted");
    assert_eq!(s.dispatch(at(1))[0].1.decode, "d1", "d0 has more room but is in quarantine");
    s.submit(&class, prompt(32, 2), 16, "b", at(10_001)).expect("admitted");
    assert_eq!(s.dispatch(at(10_001))[0].1.decode, "d0", "the quarantine ended");
}
