//! The fleet's choices, and its orderings kept in step with every booking and refresh.

use super::*;
use crate::schedule::prefixes::PrefixIndex;

fn decode(free: u32, running: u32, max_batch: u32) -> pb::DecodeLoad {
    pb::DecodeLoad {
        free_blocks: free,
        total_blocks: 100,
        running_sequences: running,
        block_size: 16,
        max_batch,
        ..Default::default()
    }
}

#[test]
fn grants_count_until_the_worker_reports_them_and_refresh_keeps_our_accounting() {
    let now = Instant::now();
    let mut fleet = Fleet::default();
    fleet.apply(vec![("a".into(), decode(10, 0, 4)), ("b".into(), decode(8, 0, 4))], vec![]);
    let itl = Duration::from_millis(100);
    assert_eq!(fleet.best_decode(5, itl, now).map(|d| d.addr.as_str()), Some("a"));
    fleet.update_decode("a", |d| d.pending_blocks = 6);
    assert_eq!(fleet.best_decode(5, itl, now).map(|d| d.addr.as_str()), Some("b"));
    fleet.apply(vec![("a".into(), decode(10, 0, 4))], vec![]);
    assert_eq!(fleet.decode_at("a").expect("a").pending_blocks, 6, "kept across refresh");
    assert!(fleet.best_decode(5, itl, now).is_none(), "b left the fleet; a has 4 free");
    fleet.apply(vec![("a".into(), decode(10, 4, 4))], vec![]);
    fleet.update_decode("a", |d| d.pending_blocks = 0);
    assert!(fleet.best_decode(1, itl, now).is_none(), "a's batch is full");
}

#[test]
fn a_decode_worker_near_the_tightest_itl_slo_of_its_streams_takes_no_more() {
    let now = Instant::now();
    let mut fleet = Fleet::default();
    fleet.apply(vec![("a".into(), pb::DecodeLoad { step_ms: 85.0, ..decode(100, 3, 64) })], vec![]);
    let (interactive, batch) = (Duration::from_millis(100), Duration::from_millis(1000));
    assert!(fleet.best_decode(1, interactive, now).is_none(), "85 ms steps > 75% of 100 ms");
    assert!(fleet.best_decode(1, batch, now).is_some(), "a batch stream fits a batch-only worker");
    fleet.update_decode("a", |d| d.itl_slos.push(interactive));
    assert!(fleet.best_decode(1, batch, now).is_none(), "but not beside an interactive stream");
    // 60 ms steps with 3 rows; 3 more granted since the refresh: about 90 ms predicted.
    fleet.apply(vec![("a".into(), pb::DecodeLoad { step_ms: 60.0, ..decode(100, 3, 64) })], vec![]);
    fleet.update_decode("a", |d| d.itl_slos.clear());
    assert!(fleet.best_decode(1, interactive, now).is_some());
    fleet.update_decode("a", |d| d.ours = 6);
    assert_eq!(fleet.decode_at("a").expect("a").predicted_step_ms(), 90.0);
    assert!(fleet.best_decode(1, interactive, now).is_none());
    // 85 ms steps with this router's 3 streams; as they end the prediction falls with them.
    fleet.update_decode("a", |d| d.ours = 3);
    fleet.apply(vec![("a".into(), pb::DecodeLoad { step_ms: 85.0, ..decode(100, 3, 64) })], vec![]);
    assert!(fleet.best_decode(1, interactive, now).is_none());
    fleet.update_decode("a", |d| d.ours = 1);
    assert!((fleet.decode_at("a").expect("a").predicted_step_ms() - 85.0 * (1.0 - 2.0 / 6.0)).abs() < 1e-9);
    assert!(fleet.best_decode(1, interactive, now).is_some(), "two of three streams ended since the refresh");
    fleet.update_decode("a", |d| d.ours = 0);
    assert_eq!(fleet.decode_at("a").expect("a").predicted_step_ms(), 0.0, "none left: idle");
}

#[test]
fn prefill_slots_keep_one_for_the_top_priority_and_wait_uses_the_measured_rate() {
    let load = pb::PrefillLoad { max_partial_prefills: 2, prefill_tokens_per_s: 500.0, ..Default::default() };
    let mut fleet = Fleet::default();
    fleet.apply(vec![], vec![("p".into(), load)]);
    fleet.update_prefill("p", |p| p.book(1, 2048));
    assert!(fleet.best_prefill(false).is_none(), "batch may not take the last slot");
    fleet.update_prefill("p", |p| p.load.waiting_prefill_tokens = 2048);
    let (p, wait) = fleet.best_prefill(true).expect("interactive");
    assert_eq!((p.addr.as_str(), wait), ("p", Duration::from_millis(512)));
    // Half of it computed, as the worker reports: half of it is still ahead.
    fleet.update_prefill("p", |p| p.load.waiting_prefill_tokens = 1024);
    assert_eq!(fleet.prefill[fleet.prefill_index["p"]].in_flight_tokens().collect::<Vec<_>>(), vec![1024]);
}

fn holding(prompt: &Prompt, blocks: usize) -> Option<pb::CacheEvents> {
    let hashes = prompt.hashes(3, 16)[..blocks].to_vec();
    Some(pb::CacheEvents {
        instance: 1,
        hash_seed: 3,
        block_size: 16,
        snapshot: true,
        snapshot_hashes: hashes,
        ..Default::default()
    })
}

#[test]
fn a_held_prefix_attracts_its_requests_until_the_holder_is_much_busier() {
    let prompt = Prompt::new((0..1600).collect());
    let mut fleet = Fleet::default();
    let hot = pb::DecodeLoad { cache: holding(&prompt, 90), ..decode(1000, 0, 64) };
    fleet.apply(vec![("a".into(), decode(1000, 0, 64)), ("b".into(), hot)], vec![]);
    let (itl, now) = (Duration::from_millis(100), Instant::now());
    let (d, cached) = fleet.choose_decode(110, itl, &prompt, 2.0, now).expect("room");
    assert_eq!((d.addr.as_str(), cached), ("b", 1440));
    // b runs one such request more than a: still b (the 90 blocks it holds weigh 180).
    fleet.update_decode("b", |d| d.active_blocks = 110);
    assert_eq!(fleet.choose_decode(110, itl, &prompt, 2.0, now).expect("room").0.addr, "b");
    // Two more: the load wins and the prompt goes to a.
    fleet.update_decode("b", |d| d.active_blocks = 220);
    assert_eq!(fleet.choose_decode(110, itl, &prompt, 2.0, now).expect("room").0.addr, "a");
    // Weight 0 ignores caches: the least loaded.
    fleet.update_decode("b", |d| d.active_blocks = 10);
    assert_eq!(fleet.choose_decode(110, itl, &prompt, 0.0, now).expect("room").0.addr, "a");
}

#[test]
fn the_prefill_worker_is_the_one_with_the_soonest_first_token() {
    let prompt = Prompt::new((0..1600).collect());
    let base = pb::PrefillLoad { max_partial_prefills: 4, prefill_tokens_per_s: 1000.0, ..Default::default() };
    let warm = pb::PrefillLoad { cache: holding(&prompt, 99), ..base.clone() };
    let mut fleet = Fleet::default();
    fleet.apply(vec![], vec![("cold".into(), base), ("warm".into(), warm)]);
    let now = Instant::now();
    let (p, wait, cached) = fleet.choose_prefill(true, &prompt, now).expect("room");
    assert_eq!((p.addr.as_str(), wait, cached), ("warm", Duration::ZERO, 1584));
    // The warm one busy with 3 prompts of 256 still ahead: 0.77 s + 0.016 s < 1.6 s cold.
    fleet.update_prefill("warm", |p| p.in_flight = vec![(1, 256), (2, 256), (3, 256)]);
    assert_eq!(fleet.choose_prefill(true, &prompt, now).expect("room").0.addr, "warm");
    busy_more(&mut fleet);
    assert_eq!(fleet.choose_prefill(true, &prompt, now).expect("room").0.addr, "cold");
}

fn busy_more(fleet: &mut Fleet) {
    fleet.update_prefill("warm", |p| {
        p.in_flight = vec![(1, 2048), (2, 2048), (3, 2048)];
        p.load.max_partial_prefills = 8;
        p.load.prefill_tokens_per_s = 300.0;
    });
    // A rate changes only at a refresh, which notes the pool's rates again.
    fleet.note_pools();
}

#[test]
fn a_quarantined_decode_worker_gets_work_only_when_it_is_the_only_one() {
    let now = Instant::now();
    let mut fleet = Fleet::default();
    fleet.apply(vec![("a".into(), decode(100, 0, 4)), ("b".into(), decode(50, 0, 4))], vec![]);
    let itl = Duration::from_millis(100);
    assert_eq!(fleet.best_decode(1, itl, now).map(|d| d.addr.as_str()), Some("a"));
    fleet.quarantine.insert("a".into(), now + Duration::from_secs(10));
    assert_eq!(fleet.best_decode(1, itl, now).map(|d| d.addr.as_str()), Some("b"));
    assert_eq!(fleet.healthy_decode(now).count(), 1);
    fleet.apply(vec![("a".into(), decode(100, 0, 4))], vec![]);
    assert_eq!(fleet.best_decode(1, itl, now).map(|d| d.addr.as_str()), Some("a"), "alone, it still serves");
    assert_eq!(fleet.healthy_decode(now).count(), 0, "but a migration will not go back to it");
    fleet.quarantine.insert("a".into(), now);
    assert_eq!(fleet.healthy_decode(now).count(), 1, "the quarantine ended");
}

/// A small deterministic generator (xorshift), so a failure replays.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// Every ordering and index agrees with the workers as they are now.
fn assert_filed(fleet: &Fleet) {
    let decode: BTreeSet<DecodeKey> =
        fleet.decode.iter().enumerate().map(|(i, d)| (d.load_blocks(), Reverse(d.free_blocks()), i)).collect();
    assert_eq!(fleet.decode_order, decode, "decode ordering");
    let prefill: BTreeSet<PrefillKey> = fleet
        .prefill
        .iter()
        .enumerate()
        .map(|(i, p)| (p.wait(fleet.prior, fleet.step_budget), Reverse(rate_key(p.rate(fleet.prior))), i))
        .collect();
    assert_eq!(fleet.prefill_order, prefill, "prefill ordering");
    let busy: BTreeSet<usize> = (0..fleet.prefill.len()).filter(|&i| fleet.prefill[i].has_in_flight()).collect();
    assert_eq!(fleet.prefill_busy, busy, "busy prefill workers");
    for cap in [1, 64, 256, 4096] {
        let plain: u64 = fleet.prefill.iter().flat_map(|p| p.in_flight_tokens()).map(|t| t.min(cap) as u64).sum();
        assert_eq!(fleet.prefill_in_flight(cap), plain, "prompts in flight capped at {cap}");
    }
    let mut held = Holders::default();
    for (i, d) in fleet.decode.iter().enumerate() {
        d.prefixes.for_each_hash(&mut |h| held.set(h, i, true));
    }
    assert_eq!(held.len(), fleet.decode_holders.len(), "decode holders");
    for (i, d) in fleet.decode.iter().enumerate() {
        d.prefixes.for_each_hash(&mut |h| assert!(fleet.decode_holders.of(h).contains(&(i as u32))));
    }
    for (i, p) in fleet.prefill.iter().enumerate() {
        p.prefixes.for_each_hash(&mut |h| assert!(fleet.prefill_holders.of(h).contains(&(i as u32))));
    }
}

/// The choices as plain scans of every worker: what the orderings must reproduce.
fn scan_decode(
    fleet: &Fleet,
    blocks: u32,
    itl: Duration,
    prompt: &Prompt,
    weight: f64,
    now: Instant,
) -> Option<(String, usize)> {
    let any_healthy = fleet.healthy_decode(now).next().is_some();
    let scored =
        fleet.decode.iter().filter(|d| fleet.usable(d, any_healthy, now) && d.has_room(blocks, itl)).map(|d| {
            let cached = d.prefixes.cached_tokens(prompt, now);
            let missing = d.blocks_for(prompt.len()).saturating_sub(d.blocks_for(cached)) as f64;
            (d, cached, weight * missing + f64::from(d.load_blocks()))
        });
    let best = scored.min_by(|a, b| a.2.total_cmp(&b.2).then(b.0.free_blocks().cmp(&a.0.free_blocks())));
    best.map(|(d, c, _)| (d.addr.clone(), c))
}

fn scan_prefill(fleet: &Fleet, top: bool, prompt: &Prompt, now: Instant) -> Option<(String, Duration, usize)> {
    let scored = fleet.prefill.iter().filter(|p| p.has_room(top)).map(|p| {
        let wait = p.wait(fleet.prior, fleet.step_budget);
        let cached = p.prefixes.cached_tokens(prompt, now);
        let first = wait + policy::estimated_wait(0, prompt.len() - cached.min(prompt.len()), p.rate(fleet.prior));
        (p, wait, cached, first)
    });
    scored.min_by_key(|s| s.3).map(|(p, w, c, _)| (p.addr.clone(), w, c))
}

/// A refresh with random loads: about one worker in ten does not answer (it leaves until
/// it answers again), every third decode worker publishes a snapshot of part of a prompt.
fn random_refresh(rng: &mut Rng, fleet: &mut Fleet, (nd, np): (usize, usize), round: u64, prompts: &[Prompt]) {
    let answering: Vec<usize> = (0..nd).filter(|_| rng.below(10) > 0).collect();
    let mut decode = Vec::new();
    for i in answering {
        let total = 200 + rng.below(400) as u32;
        let cache = (i % 3 == 0).then(|| {
            let h = prompts[rng.below(prompts.len() as u64) as usize].hashes(3, 16);
            pb::CacheEvents {
                instance: 1 + round,
                hash_seed: 3,
                block_size: 16,
                snapshot: true,
                snapshot_hashes: h[..rng.below(h.len() as u64 + 1) as usize].to_vec(),
                ..Default::default()
            }
        });
        let load = pb::DecodeLoad {
            free_blocks: rng.below(u64::from(total)) as u32,
            total_blocks: total,
            running_sequences: rng.below(8) as u32,
            block_size: 16,
            max_batch: 4 + rng.below(8) as u32,
            step_ms: rng.below(90) as f64,
            cache,
            ..Default::default()
        };
        decode.push((format!("d{i}"), load));
    }
    let answering: Vec<usize> = (0..np).filter(|_| rng.below(10) > 0).collect();
    let mut prefill = Vec::new();
    for i in answering {
        let load = pb::PrefillLoad {
            max_partial_prefills: 1 + rng.below(4) as u32,
            prefill_tokens_per_s: [0.0, 500.0, 1000.0, 1000.0][rng.below(4) as usize],
            waiting_prefill_tokens: [0, 0, 300][rng.below(3) as usize],
            ..Default::default()
        };
        prefill.push((format!("p{i}"), load));
    }
    fleet.apply(decode, prefill);
}

#[test]
fn the_orderings_choose_what_a_scan_of_every_worker_chooses() {
    let prompts: Vec<Prompt> =
        (0..6u32).map(|k| Prompt::new((0..(40 + 70 * k)).map(|t| t * 31 + k).collect())).collect();
    let itl = [Duration::from_millis(100), Duration::from_millis(1000)];
    let now = Instant::now();
    for seed in 1..=40u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut fleet = Fleet::default();
        let sizes = (1 + rng.below(24) as usize, rng.below(24) as usize);
        let mut booked: Vec<(String, u32, Duration)> = Vec::new();
        let mut sent: Vec<(String, u64)> = Vec::new();
        for round in 0..12u64 {
            random_refresh(&mut rng, &mut fleet, sizes, round, &prompts);
            if rng.below(4) == 0 {
                fleet.quarantine.insert(format!("d{}", rng.below(sizes.0 as u64)), now + Duration::from_secs(1));
            }
            assert_filed(&fleet);
            for step in 0..20u64 {
                let prompt = &prompts[rng.below(6) as usize];
                let (blocks, itl) = (1 + rng.below(30) as u32, itl[rng.below(2) as usize]);
                let weight = [0.0, 2.0][rng.below(2) as usize];
                let top = rng.below(2) == 0;
                let at = format!("seed {seed} round {round} step {step}");
                let chosen = fleet.choose_decode(blocks, itl, prompt, weight, now).map(|(d, c)| (d.addr.clone(), c));
                assert_eq!(chosen, scan_decode(&fleet, blocks, itl, prompt, weight, now), "{at}");
                let placed = fleet.choose_prefill(top, prompt, now).map(|(p, w, c)| (p.addr.clone(), w, c));
                assert_eq!(placed, scan_prefill(&fleet, top, prompt, now), "{at}");
                let pool: Vec<&PrefixIndex> = if fleet.prefill.is_empty() {
                    fleet.decode.iter().map(|d| &d.prefixes).collect()
                } else {
                    fleet.prefill.iter().map(|p| &p.prefixes).collect()
                };
                let expected = pool.iter().map(|i| i.cached_tokens(prompt, now)).max().unwrap_or(0);
                assert_eq!(fleet.expected_cached(prompt, now), expected, "{at}");
                // Book what was chosen, and end some earlier bookings.
                if let Some((addr, _)) = chosen {
                    fleet.book_decode(&addr, blocks, itl, prompt, now);
                    booked.push((addr, blocks, itl));
                }
                if let Some((addr, ..)) = placed {
                    fleet.book_prefill(&addr, round * 100 + step, prompt.len(), prompt, now);
                    sent.push((addr, round * 100 + step));
                }
                if rng.below(3) == 0 && !booked.is_empty() {
                    let (addr, blocks, itl) = booked.swap_remove(rng.below(booked.len() as u64) as usize);
                    let opened = rng.below(2) == 0;
                    if opened {
                        fleet.opened_decode(&addr, blocks);
                    }
                    fleet.unbook_decode(&addr, blocks, itl, opened);
                }
                if rng.below(3) == 0 && !sent.is_empty() {
                    let (addr, seq) = sent.swap_remove(rng.below(sent.len() as u64) as usize);
                    fleet.unbook_prefill(&addr, seq);
                }
                assert_filed(&fleet);
            }
        }
    }
}
