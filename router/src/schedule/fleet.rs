//! The router's view of every worker: what each reported at the last periodic refresh (one
//! concurrent round of `Load` calls per interval, not per request), corrected by what this
//! router dispatched since (KV blocks granted but not yet reserved, prompts in flight), so a
//! choice among hundreds of workers is a scan of memory. This router's own accounting on a
//! worker changes only through its booking methods (`book`, `opened`, `unbook`), called by
//! `state` with each request's booking; a worker is found by address through an index.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pd_proto::v1 as pb;

use super::prefixes::{PrefixIndex, Prompt};

/// A decode worker takes new streams while its step time is under this fraction of the
/// tightest ITL SLO among its streams.
pub const ITL_HEADROOM: f64 = 0.75;

/// A decode worker as last seen.
#[derive(Debug, Clone)]
pub struct DecodeState {
    pub addr: String,
    pub load: pb::DecodeLoad,
    /// Blocks of grants whose reservation the worker has not confirmed yet.
    pending_blocks: u32,
    /// Requests this router has on the worker (granted and not finished).
    ours: u32,
    /// `ours` when `load` was taken: fewer now means streams ended since.
    ours_at_load: u32,
    /// The ITL SLO of each of them (the tightest one bounds the step time).
    itl_slos: Vec<Duration>,
    /// Blocks of those requests (prompt and output each, shared prefixes counted per
    /// request: every stream reads its whole context each step).
    active_blocks: u32,
    pub prefixes: PrefixIndex,
}

impl DecodeState {
    pub fn new(addr: String, mut load: pb::DecodeLoad) -> Self {
        let mut prefixes = PrefixIndex::default();
        prefixes.apply(load.cache.take(), load.block_size);
        DecodeState {
            addr,
            load,
            pending_blocks: 0,
            ours: 0,
            ours_at_load: 0,
            itl_slos: Vec::new(),
            active_blocks: 0,
            prefixes,
        }
    }

    /// A request of `blocks` (ITL SLO `itl`) granted here: its blocks count as taken until
    /// the worker confirms its reservation (`opened`).
    pub fn book(&mut self, blocks: u32, itl: Duration) {
        self.pending_blocks += blocks;
        self.ours += 1;
        self.itl_slos.push(itl);
        self.active_blocks += blocks;
    }

    /// The worker reserved a booked request's blocks: its own free-block count includes them.
    pub fn opened(&mut self, blocks: u32) {
        self.pending_blocks = self.pending_blocks.saturating_sub(blocks);
    }

    /// A booked request ended (`opened`: its reservation had been confirmed).
    pub fn unbook(&mut self, blocks: u32, itl: Duration, opened: bool) {
        if !opened {
            self.opened(blocks);
        }
        self.ours = self.ours.saturating_sub(1);
        self.active_blocks = self.active_blocks.saturating_sub(blocks);
        if let Some(i) = self.itl_slos.iter().position(|x| *x == itl) {
            self.itl_slos.swap_remove(i);
        }
    }

    /// Requests this router has on the worker.
    pub fn ours(&self) -> u32 {
        self.ours
    }

    /// Load in blocks: this router's active requests', or what the worker uses if more.
    pub fn load_blocks(&self) -> u32 {
        let used = self.load.total_blocks.saturating_sub(self.free_blocks());
        self.active_blocks.max(used)
    }

    pub fn free_blocks(&self) -> u32 {
        self.load.free_blocks.saturating_sub(self.pending_blocks)
    }

    /// Blocks a sequence of `tokens` tokens needs.
    pub fn blocks_for(&self, tokens: usize) -> u32 {
        let size = self.load.block_size.max(1) as usize;
        tokens.div_ceil(size) as u32
    }

    pub fn free_fraction(&self) -> f64 {
        f64::from(self.free_blocks()) / f64::from(self.load.total_blocks.max(1))
    }

    /// Sequences on the worker: as last seen, less this router's that ended since, or this
    /// router's own if more.
    fn busy(&self) -> u32 {
        let seen = self.load.running_sequences + self.load.waiting_transfers;
        seen.saturating_sub(self.ours_at_load.saturating_sub(self.ours)).max(self.ours)
    }

    /// The step time once the streams granted since the last refresh run too, and without
    /// this router's streams that ended since: each row added or gone costs about half a
    /// row's share of the step (batched rows share the weight reads); no row left, no step.
    /// (Without the ended ones, a client sending its next request as the last one ended was
    /// refused for the step time of a batch that no longer ran.)
    pub fn predicted_step_ms(&self) -> f64 {
        let rows = (self.load.running_sequences + self.load.waiting_transfers).max(1);
        let ended = self.ours_at_load.saturating_sub(self.ours);
        let now = rows.max(self.ours).saturating_sub(ended);
        if now == 0 {
            return 0.0;
        }
        let change = f64::from(now) - f64::from(rows);
        self.load.step_ms * (1.0 + change / (2.0 * f64::from(rows)))
    }

    /// True when a sequence needing `blocks` of a class with ITL SLO `itl` fits now: free
    /// blocks, a batch slot, and a step time under `ITL_HEADROOM` of the tightest ITL SLO of
    /// the streams there (this one included), so a new stream does not push them past it.
    pub fn has_room(&self, blocks: u32, itl: Duration) -> bool {
        let max_batch = if self.load.max_batch == 0 { u32::MAX } else { self.load.max_batch };
        let tightest = self.itl_slos.iter().copied().chain([itl]).min().unwrap_or(itl);
        let step_ok = self.predicted_step_ms() <= ITL_HEADROOM * tightest.as_secs_f64() * 1e3;
        self.free_blocks() >= blocks && self.busy() < max_batch && step_ok
    }
}

/// A prefill worker as last seen.
#[derive(Debug, Clone)]
pub struct PrefillState {
    pub addr: String,
    pub load: pb::PrefillLoad,
    /// This router's prompts on the worker: (request sequence number, tokens to compute).
    in_flight: Vec<(u64, usize)>,
    pub prefixes: PrefixIndex,
}

impl PrefillState {
    pub fn new(addr: String, mut load: pb::PrefillLoad) -> Self {
        let mut prefixes = PrefixIndex::default();
        prefixes.apply(load.cache.take(), 0);
        PrefillState { addr, load, in_flight: Vec::new(), prefixes }
    }

    /// Request `seq`'s prompt, `tokens` of it to compute, sent here.
    pub fn book(&mut self, seq: u64, tokens: usize) {
        self.in_flight.push((seq, tokens));
    }

    /// Request `seq`'s prompt is prefilled (or failed).
    pub fn unbook(&mut self, seq: u64) {
        self.in_flight.retain(|(s, _)| *s != seq);
    }

    /// Prompts the worker runs together in one step.
    pub fn slots(&self) -> usize {
        self.load.max_partial_prefills.max(1) as usize
    }

    pub fn busy(&self) -> usize {
        self.in_flight.len().max((self.load.running_prefills + self.load.queued_prefills) as usize)
    }

    /// Free slots for a request of a class that is not the top priority keep one slot free
    /// for the top one (batch work never fills a worker).
    pub fn has_room(&self, top_priority: bool) -> bool {
        let slots = if top_priority { self.slots() } else { self.slots().saturating_sub(1).max(1) };
        self.busy() < slots
    }

    /// Measured tokens per second, or `prior` before the worker measured any.
    pub fn rate(&self, prior: f64) -> f64 {
        if self.load.prefill_tokens_per_s > 0.0 {
            self.load.prefill_tokens_per_s
        } else {
            prior
        }
    }

    /// Tokens still to prefill of each prompt in flight: ours, scaled down to what the worker
    /// reports not yet computed (they are partly done), plus what other routers sent.
    pub fn in_flight_tokens(&self) -> Vec<usize> {
        let ours: usize = self.in_flight.iter().map(|(_, t)| t).sum();
        let reported = self.load.waiting_prefill_tokens as usize;
        // 0 reported while we have prompts there: the refresh predates them.
        let mut v: Vec<usize> = if reported > 0 && reported < ours {
            let scale = reported as f64 / ours as f64;
            self.in_flight.iter().map(|(_, t)| (*t as f64 * scale).ceil() as usize).collect()
        } else {
            self.in_flight.iter().map(|(_, t)| *t).collect()
        };
        if reported > ours {
            v.push(reported - ours);
        }
        v
    }
}

/// Every worker that answered the last refresh.
#[derive(Debug, Default)]
pub struct Fleet {
    pub decode: Vec<DecodeState>,
    pub prefill: Vec<PrefillState>,
    /// Position of each worker in `decode` / `prefill` by address.
    decode_index: HashMap<String, usize>,
    prefill_index: HashMap<String, usize>,
    /// True after the first refresh.
    pub refreshed: bool,
    /// Decode workers that lost a stream, passed over until the time given (this router only).
    pub quarantine: HashMap<String, Instant>,
}

impl Fleet {
    /// Replaces the reported loads, keeping this router's own accounting for workers still
    /// answering; a worker that did not answer leaves the fleet until it answers again.
    pub fn apply(&mut self, decode: Vec<(String, pb::DecodeLoad)>, prefill: Vec<(String, pb::PrefillLoad)>) {
        let mut old_d: HashMap<String, DecodeState> = self.decode.drain(..).map(|d| (d.addr.clone(), d)).collect();
        self.decode = decode
            .into_iter()
            .map(|(addr, mut load)| match old_d.remove(&addr) {
                Some(mut d) => {
                    d.prefixes.apply(load.cache.take(), load.block_size);
                    DecodeState { load, ours_at_load: d.ours, ..d }
                }
                None => DecodeState::new(addr, load),
            })
            .collect();
        let mut old_p: HashMap<String, PrefillState> = self.prefill.drain(..).map(|p| (p.addr.clone(), p)).collect();
        self.prefill = prefill
            .into_iter()
            .map(|(addr, mut load)| match old_p.remove(&addr) {
                Some(mut p) => {
                    p.prefixes.apply(load.cache.take(), 0);
                    PrefillState { load, ..p }
                }
                None => PrefillState::new(addr, load),
            })
            .collect();
        self.decode_index = self.decode.iter().enumerate().map(|(i, d)| (d.addr.clone(), i)).collect();
        self.prefill_index = self.prefill.iter().enumerate().map(|(i, p)| (p.addr.clone(), i)).collect();
        self.refreshed = true;
    }

    pub fn decode_mut(&mut self, addr: &str) -> Option<&mut DecodeState> {
        let i = *self.decode_index.get(addr)?;
        self.decode.get_mut(i)
    }

    pub fn prefill_mut(&mut self, addr: &str) -> Option<&mut PrefillState> {
        let i = *self.prefill_index.get(addr)?;
        self.prefill.get_mut(i)
    }

    /// True while `addr` is in quarantine at `now`.
    pub fn quarantined(&self, addr: &str, now: Instant) -> bool {
        !self.quarantine.is_empty() && self.quarantine.get(addr).is_some_and(|until| *until > now)
    }

    /// Decode workers not in quarantine, or all of them when every one is: quarantine steers
    /// new work away from a worker that lost a stream while another can take it; it does not
    /// leave a pool of one without a worker.
    pub fn usable_decode(&self, now: Instant) -> impl Iterator<Item = &DecodeState> {
        let any_healthy = self.healthy_decode(now).next().is_some();
        self.decode.iter().filter(move |d| !any_healthy || !self.quarantined(&d.addr, now))
    }

    /// Decode workers not in quarantine.
    pub fn healthy_decode(&self, now: Instant) -> impl Iterator<Item = &DecodeState> {
        self.decode.iter().filter(move |d| !self.quarantined(&d.addr, now))
    }

    /// The decode worker with room for `blocks` (ITL SLO `itl`) and the most free blocks.
    pub fn best_decode(&self, blocks: u32, itl: Duration, now: Instant) -> Option<&DecodeState> {
        self.usable_decode(now)
            .filter(|d| d.has_room(blocks, itl))
            .max_by_key(|d| (d.free_blocks(), std::cmp::Reverse(d.busy())))
    }

    /// The decode worker for `prompt` (needing `blocks`, ITL SLO `itl`) among those with room:
    /// the lowest cost, counting each prompt block it lacks (to be shipped and stored) as
    /// `weight` blocks of load, so a held prefix attracts its requests until the holder is
    /// that much busier than another worker. With the cached tokens expected there.
    pub fn choose_decode(
        &self,
        blocks: u32,
        itl: Duration,
        prompt: &Prompt,
        weight: f64,
        now: Instant,
    ) -> Option<(&DecodeState, usize)> {
        let scored = self.usable_decode(now).filter(|d| d.has_room(blocks, itl)).map(|d| {
            let cached = d.prefixes.cached_tokens(prompt, now);
            let missing = d.blocks_for(prompt.len()).saturating_sub(d.blocks_for(cached)) as f64;
            let cost = weight * missing + f64::from(d.load_blocks());
            (d, cached, cost)
        });
        scored
            .min_by(|a, b| a.2.total_cmp(&b.2).then(b.0.free_blocks().cmp(&a.0.free_blocks())))
            .map(|(d, c, _)| (d, c))
    }

    /// Prompt tokens the best-placed worker is expected to hold: of the prefill pool, or of
    /// the decode workers when there is none (they prefill).
    pub fn expected_cached(&self, prompt: &Prompt, now: Instant) -> usize {
        let best = |it: &mut dyn Iterator<Item = usize>| it.max().unwrap_or(0);
        if self.prefill.is_empty() {
            best(&mut self.decode.iter().map(|d| d.prefixes.cached_tokens(prompt, now)))
        } else {
            best(&mut self.prefill.iter().map(|p| p.prefixes.cached_tokens(prompt, now)))
        }
    }

    /// The prefill worker with the shortest estimated wait, among those with a free slot.
    pub fn best_prefill(
        &self,
        top_priority: bool,
        prior: f64,
        step_budget: usize,
    ) -> Option<(&PrefillState, Duration)> {
        self.prefill
            .iter()
            .filter(|p| p.has_room(top_priority))
            .map(|p| (p, self.wait_of(p, prior, step_budget)))
            .min_by_key(|(_, w)| *w)
    }

    /// The prefill worker, among those with a free slot, that gives `prompt` its first token
    /// soonest: its estimated wait plus computing the part of the prompt it has not cached.
    /// With that wait and the cached tokens expected there.
    pub fn choose_prefill(
        &self,
        top_priority: bool,
        prior: f64,
        step_budget: usize,
        prompt: &Prompt,
        now: Instant,
    ) -> Option<(&PrefillState, Duration, usize)> {
        let scored = self.prefill.iter().filter(|p| p.has_room(top_priority)).map(|p| {
            let wait = self.wait_of(p, prior, step_budget);
            let cached = p.prefixes.cached_tokens(prompt, now);
            let compute = super::policy::estimated_wait(0, prompt.len() - cached.min(prompt.len()), p.rate(prior));
            (p, wait, cached, wait + compute)
        });
        scored.min_by_key(|s| s.3).map(|(p, w, c, _)| (p, w, c))
    }

    /// A worker's estimated wait for a new short prompt: its prompts in flight, each up to
    /// one step's tokens, at its measured rate.
    pub fn wait_of(&self, p: &PrefillState, prior: f64, step_budget: usize) -> Duration {
        let ahead = super::policy::tokens_ahead::<()>(&[], 0, &p.in_flight_tokens(), step_budget);
        super::policy::estimated_wait(ahead, 0, p.rate(prior))
    }

    /// The pool's shortest estimated wait (None without a prefill worker) and total rate.
    pub fn prefill_pool(&self, prior: f64, step_budget: usize) -> (Option<Duration>, f64) {
        let wait = self.prefill.iter().map(|p| self.wait_of(p, prior, step_budget)).min();
        let rate = self.prefill.iter().map(|p| p.rate(prior)).sum::<f64>();
        (wait, if rate > 0.0 { rate } else { prior })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        fleet.decode_mut("a").expect("a").pending_blocks = 6;
        assert_eq!(fleet.best_decode(5, itl, now).map(|d| d.addr.as_str()), Some("b"));
        fleet.apply(vec![("a".into(), decode(10, 0, 4))], vec![]);
        assert_eq!(fleet.decode_mut("a").expect("a").pending_blocks, 6, "kept across refresh");
        assert!(fleet.best_decode(5, itl, now).is_none(), "b left the fleet; a has 4 free");
        fleet.apply(vec![("a".into(), decode(10, 4, 4))], vec![]);
        fleet.decode_mut("a").expect("a").pending_blocks = 0;
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
        fleet.decode_mut("a").expect("a").itl_slos.push(interactive);
        assert!(fleet.best_decode(1, batch, now).is_none(), "but not beside an interactive stream");
        // 60 ms steps with 3 rows; 3 more granted since the refresh: about 90 ms predicted.
        fleet.apply(vec![("a".into(), pb::DecodeLoad { step_ms: 60.0, ..decode(100, 3, 64) })], vec![]);
        fleet.decode_mut("a").expect("a").itl_slos.clear();
        assert!(fleet.best_decode(1, interactive, now).is_some());
        fleet.decode_mut("a").expect("a").ours = 6;
        assert_eq!(fleet.decode_mut("a").expect("a").predicted_step_ms(), 90.0);
        assert!(fleet.best_decode(1, interactive, now).is_none());
        // 85 ms steps with this router's 3 streams; as they end the prediction falls with them.
        fleet.decode_mut("a").expect("a").ours = 3;
        fleet.apply(vec![("a".into(), pb::DecodeLoad { step_ms: 85.0, ..decode(100, 3, 64) })], vec![]);
        assert!(fleet.best_decode(1, interactive, now).is_none());
        fleet.decode_mut("a").expect("a").ours = 1;
        assert!((fleet.decode_mut("a").expect("a").predicted_step_ms() - 85.0 * (1.0 - 2.0 / 6.0)).abs() < 1e-9);
        assert!(fleet.best_decode(1, interactive, now).is_some(), "two of three streams ended since the refresh");
        fleet.decode_mut("a").expect("a").ours = 0;
        assert_eq!(fleet.decode_mut("a").expect("a").predicted_step_ms(), 0.0, "none left: idle");
    }

    #[test]
    fn prefill_slots_keep_one_for_the_top_priority_and_wait_uses_the_measured_rate() {
        let load = pb::PrefillLoad { max_partial_prefills: 2, prefill_tokens_per_s: 500.0, ..Default::default() };
        let mut fleet = Fleet::default();
        fleet.apply(vec![], vec![("p".into(), load)]);
        fleet.prefill_mut("p").expect("p").book(1, 2048);
        assert!(fleet.best_prefill(false, 250.0, 256).is_none(), "batch may not take the last slot");
        fleet.prefill_mut("p").expect("p").load.waiting_prefill_tokens = 2048;
        let (p, wait) = fleet.best_prefill(true, 250.0, 256).expect("interactive");
        assert_eq!((p.addr.as_str(), wait), ("p", Duration::from_millis(512)));
        // Half of it computed, as the worker reports: half of it is still ahead.
        fleet.prefill_mut("p").expect("p").load.waiting_prefill_tokens = 1024;
        assert_eq!(fleet.prefill_mut("p").expect("p").in_flight_tokens(), vec![1024]);
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
        fleet.decode_mut("b").expect("b").active_blocks = 110;
        assert_eq!(fleet.choose_decode(110, itl, &prompt, 2.0, now).expect("room").0.addr, "b");
        // Two more: the load wins and the prompt goes to a.
        fleet.decode_mut("b").expect("b").active_blocks = 220;
        assert_eq!(fleet.choose_decode(110, itl, &prompt, 2.0, now).expect("room").0.addr, "a");
        // Weight 0 ignores caches: the least loaded.
        fleet.decode_mut("b").expect("b").active_blocks = 10;
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
        let (p, wait, cached) = fleet.choose_prefill(true, 300.0, 256, &prompt, now).expect("room");
        assert_eq!((p.addr.as_str(), wait, cached), ("warm", Duration::ZERO, 1584));
        // The warm one busy with 3 prompts of 256 still ahead: 0.77 s + 0.016 s < 1.6 s cold.
        let busy = fleet.prefill_mut("warm").expect("warm");
        busy.in_flight = vec![(1, 256), (2, 256), (3, 256)];
        assert_eq!(fleet.choose_prefill(true, 300.0, 256, &prompt, now).expect("room").0.addr, "warm");
        busy_more(&mut fleet);
        assert_eq!(fleet.choose_prefill(true, 300.0, 256, &prompt, now).expect("room").0.addr, "cold");
    }

    fn busy_more(fleet: &mut Fleet) {
        let p = fleet.prefill_mut("warm").expect("warm");
        p.in_flight = vec![(1, 2048), (2, 2048), (3, 2048)];
        p.load.max_partial_prefills = 8;
        p.load.prefill_tokens_per_s = 300.0;
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
}
