//! The router's view of every worker: what each reported at the last periodic refresh (one
//! concurrent round of `Load` calls per interval, not per request), corrected by what this
//! router dispatched since (KV blocks granted but not yet reserved, prompts in flight).
//!
//! A choice must not cost a scan of the fleet: with a thousand workers the router would spend
//! its core walking them for every request. So the fleet keeps each pool ordered the way the
//! choices read it, and the workers are re-filed whenever one changes (a booking, a refresh):
//! decode workers by load (least loaded first), prefill workers by their estimated wait
//! (shortest first, fastest first among equals). A choice walks the ordering from its best end
//! and stops as soon as no later worker can beat the best found; the workers that cache part
//! of the prompt are found through an inverted prefix index (`holders`) and scored
//! exactly. This router's accounting on a worker changes only through the booking methods
//! here, which re-file it; a worker is found by address through an index.

mod holders;
mod in_flight;
mod workers;

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::ops::Bound;
use std::time::{Duration, Instant};

use pd_proto::v1 as pb;
use rustc_hash::FxHashMap;

use super::policy;
use super::prefixes::Prompt;
use holders::Holders;
use in_flight::InFlight;
pub use workers::{DecodeState, PrefillState, ITL_HEADROOM};

/// A decode worker's place in its ordering: least loaded first, then most free blocks, then
/// its position.
type DecodeKey = (u32, Reverse<u32>, usize);
/// A prefill worker's place: shortest wait first, then the fastest, then its position.
type PrefillKey = (Duration, Reverse<u64>, usize);

/// A rate as an ordering key (a non-negative f64's bits order as the number does).
fn rate_key(rate: f64) -> u64 {
    rate.max(0.0).to_bits()
}

/// Every worker that answered the last refresh.
#[derive(Debug)]
pub struct Fleet {
    decode: Vec<DecodeState>,
    prefill: Vec<PrefillState>,
    /// Position of each worker in `decode` / `prefill` by address.
    decode_index: FxHashMap<String, usize>,
    prefill_index: FxHashMap<String, usize>,
    decode_order: BTreeSet<DecodeKey>,
    prefill_order: BTreeSet<PrefillKey>,
    /// Prefill workers with prompts in flight.
    prefill_busy: BTreeSet<usize>,
    /// Their prompts' tokens in flight, for admission's sum (`in_flight`).
    in_flight: InFlight,
    decode_holders: Holders,
    prefill_holders: Holders,
    /// The (seed, block size) pairs each pool hashes prompts with (one per model and block
    /// size in the fleet).
    decode_keys: Vec<(u64, u32)>,
    prefill_keys: Vec<(u64, u32)>,
    /// The largest decode block size (bounds the blocks a prompt needs from below).
    max_block_size: u32,
    /// The prefill pool's total and largest rate, tokens per second.
    prefill_rate: f64,
    max_prefill_rate: f64,
    /// Tokens/s assumed for a prefill worker that has not measured its own, and tokens of each
    /// prompt in flight counted at most in a wait (`ScheduleConfig`).
    prior: f64,
    step_budget: usize,
    /// True after the first refresh.
    pub refreshed: bool,
    /// Decode workers that lost a stream, passed over until the time given (this router only).
    pub quarantine: HashMap<String, Instant>,
}

impl Default for Fleet {
    fn default() -> Self {
        let config = super::ScheduleConfig::default();
        Fleet::new(config.prior_tokens_per_s, config.step_budget)
    }
}

impl Fleet {
    pub fn new(prior_tokens_per_s: f64, step_budget: usize) -> Self {
        Fleet {
            decode: Vec::new(),
            prefill: Vec::new(),
            decode_index: FxHashMap::default(),
            prefill_index: FxHashMap::default(),
            decode_order: BTreeSet::new(),
            prefill_order: BTreeSet::new(),
            prefill_busy: BTreeSet::new(),
            in_flight: InFlight::default(),
            decode_holders: Holders::default(),
            prefill_holders: Holders::default(),
            decode_keys: Vec::new(),
            prefill_keys: Vec::new(),
            max_block_size: 1,
            prefill_rate: 0.0,
            max_prefill_rate: 0.0,
            prior: prior_tokens_per_s,
            step_budget,
            refreshed: false,
            quarantine: HashMap::new(),
        }
    }

    pub fn decode(&self) -> &[DecodeState] {
        &self.decode
    }

    pub fn prefill(&self) -> &[PrefillState] {
        &self.prefill
    }

    /// Replaces the reported loads, keeping this router's own accounting for workers still
    /// answering; a worker that did not answer leaves the fleet until it answers again.
    pub fn apply(&mut self, decode: Vec<(String, pb::DecodeLoad)>, prefill: Vec<(String, pb::PrefillLoad)>) {
        let mut seen = vec![false; self.decode.len()];
        for (addr, mut load) in decode {
            let (cache, block_size) = (load.cache.take(), load.block_size);
            let slot = match self.decode_index.get(&addr) {
                Some(&slot) => {
                    let d = &mut self.decode[slot];
                    d.ours_at_load = d.ours;
                    d.load = load;
                    slot
                }
                None => {
                    self.decode_index.insert(addr.clone(), self.decode.len());
                    self.decode.push(DecodeState::new(addr, load));
                    seen.push(false);
                    self.decode.len() - 1
                }
            };
            seen[slot] = true;
            let holders = &mut self.decode_holders;
            self.decode[slot].prefixes.apply(cache, block_size, &mut |h, held| holders.set(h, slot, held));
            self.file_decode(slot);
        }
        if seen.iter().any(|s| !s) {
            let mut kept = seen.iter();
            self.decode.retain(|_| kept.next().copied().unwrap_or(false));
            self.refile_decode();
        }
        let mut seen = vec![false; self.prefill.len()];
        for (addr, mut load) in prefill {
            let cache = load.cache.take();
            let slot = match self.prefill_index.get(&addr) {
                Some(&slot) => {
                    self.prefill[slot].load = load;
                    slot
                }
                None => {
                    self.prefill_index.insert(addr.clone(), self.prefill.len());
                    self.prefill.push(PrefillState::new(addr, load));
                    seen.push(false);
                    self.prefill.len() - 1
                }
            };
            seen[slot] = true;
            let holders = &mut self.prefill_holders;
            self.prefill[slot].prefixes.apply(cache, 0, &mut |h, held| holders.set(h, slot, held));
            self.file_prefill(slot);
        }
        if seen.iter().any(|s| !s) {
            let mut kept = seen.iter();
            self.prefill.retain(|_| kept.next().copied().unwrap_or(false));
            self.refile_prefill();
        }
        self.note_pools();
        self.refreshed = true;
    }

    /// After a worker left: positions changed, so every index of the pool is made again.
    fn refile_decode(&mut self) {
        self.decode_index = self.decode.iter().enumerate().map(|(i, d)| (d.addr.clone(), i)).collect();
        self.decode_order.clear();
        self.decode_holders.clear();
        for slot in 0..self.decode.len() {
            self.decode[slot].filed = None;
            self.file_decode(slot);
            let holders = &mut self.decode_holders;
            self.decode[slot].prefixes.for_each_hash(&mut |h| holders.set(h, slot, true));
        }
    }

    fn refile_prefill(&mut self) {
        self.prefill_index = self.prefill.iter().enumerate().map(|(i, p)| (p.addr.clone(), i)).collect();
        self.prefill_order.clear();
        self.prefill_busy.clear();
        self.in_flight.clear();
        self.prefill_holders.clear();
        for slot in 0..self.prefill.len() {
            self.prefill[slot].filed = None;
            self.file_prefill(slot);
            let holders = &mut self.prefill_holders;
            self.prefill[slot].prefixes.for_each_hash(&mut |h| holders.set(h, slot, true));
        }
    }

    /// What the choices read of each pool as a whole, after a refresh.
    fn note_pools(&mut self) {
        let mut keys: Vec<(u64, u32)> = self.decode.iter().map(|d| d.prefixes.hash_key()).collect();
        keys.sort_unstable();
        keys.dedup();
        self.decode_keys = keys;
        self.max_block_size = self.decode.iter().map(|d| d.load.block_size).max().unwrap_or(1).max(1);
        let mut keys: Vec<(u64, u32)> = self.prefill.iter().map(|p| p.prefixes.hash_key()).collect();
        keys.sort_unstable();
        keys.dedup();
        self.prefill_keys = keys;
        let rates = self.prefill.iter().map(|p| p.rate(self.prior));
        self.prefill_rate = rates.clone().sum();
        self.max_prefill_rate = rates.fold(0.0, f64::max);
    }

    /// Files decode worker `slot` under its current load.
    fn file_decode(&mut self, slot: usize) {
        let d = &mut self.decode[slot];
        if let Some((load, free)) = d.filed.take() {
            self.decode_order.remove(&(load, Reverse(free), slot));
        }
        let key = (d.load_blocks(), d.free_blocks());
        d.filed = Some(key);
        self.decode_order.insert((key.0, Reverse(key.1), slot));
    }

    /// Files prefill worker `slot` under its current wait and rate.
    fn file_prefill(&mut self, slot: usize) {
        let p = &mut self.prefill[slot];
        if let Some((wait, rate)) = p.filed.take() {
            self.prefill_order.remove(&(wait, Reverse(rate_key(rate)), slot));
        }
        let key = (p.wait(self.prior, self.step_budget), p.rate(self.prior));
        p.filed = Some(key);
        self.prefill_order.insert((key.0, Reverse(rate_key(key.1)), slot));
        if p.has_in_flight() {
            self.prefill_busy.insert(slot);
        } else {
            self.prefill_busy.remove(&slot);
        }
        self.in_flight.set(slot, p.in_flight_tokens());
    }

    /// Changes decode worker `addr` and re-files it (this router's bookings; tests).
    fn update_decode(&mut self, addr: &str, f: impl FnOnce(&mut DecodeState)) {
        if let Some(&slot) = self.decode_index.get(addr) {
            f(&mut self.decode[slot]);
            self.file_decode(slot);
        }
    }

    fn update_prefill(&mut self, addr: &str, f: impl FnOnce(&mut PrefillState)) {
        if let Some(&slot) = self.prefill_index.get(addr) {
            f(&mut self.prefill[slot]);
            self.file_prefill(slot);
        }
    }

    pub fn decode_at(&self, addr: &str) -> Option<&DecodeState> {
        self.decode_index.get(addr).map(|&i| &self.decode[i])
    }

    /// A request of `blocks` (ITL SLO `itl`) for `prompt` granted on decode worker `addr`.
    pub fn book_decode(&mut self, addr: &str, blocks: u32, itl: Duration, prompt: &Prompt, now: Instant) {
        let Some(&slot) = self.decode_index.get(addr) else { return };
        let holders = &mut self.decode_holders;
        let d = &mut self.decode[slot];
        d.book(blocks, itl);
        d.prefixes.routed(prompt, now, &mut |h, held| holders.set(h, slot, held));
        self.file_decode(slot);
    }

    /// The decode worker reserved a booked request's blocks.
    pub fn opened_decode(&mut self, addr: &str, blocks: u32) {
        self.update_decode(addr, |d| d.opened(blocks));
    }

    /// A request booked on decode worker `addr` ended.
    pub fn unbook_decode(&mut self, addr: &str, blocks: u32, itl: Duration, opened: bool) {
        self.update_decode(addr, |d| d.unbook(blocks, itl, opened));
    }

    /// Request `seq`'s prompt, `tokens` of it to compute, sent to prefill worker `addr`.
    pub fn book_prefill(&mut self, addr: &str, seq: u64, tokens: usize, prompt: &Prompt, now: Instant) {
        let Some(&slot) = self.prefill_index.get(addr) else { return };
        let holders = &mut self.prefill_holders;
        let p = &mut self.prefill[slot];
        p.book(seq, tokens);
        p.prefixes.routed(prompt, now, &mut |h, held| holders.set(h, slot, held));
        self.file_prefill(slot);
    }

    /// Request `seq`'s prompt is prefilled (or failed) on prefill worker `addr`.
    pub fn unbook_prefill(&mut self, addr: &str, seq: u64) {
        self.update_prefill(addr, |p| p.unbook(seq));
    }

    /// True while `addr` is in quarantine at `now`.
    pub fn quarantined(&self, addr: &str, now: Instant) -> bool {
        !self.quarantine.is_empty() && self.quarantine.get(addr).is_some_and(|until| *until > now)
    }

    /// Decode workers not in quarantine.
    pub fn healthy_decode(&self, now: Instant) -> impl Iterator<Item = &DecodeState> {
        self.decode.iter().filter(move |d| !self.quarantined(&d.addr, now))
    }

    /// Whether decode worker `d` may take new work: not in quarantine, or every worker is
    /// (quarantine steers new work away from a worker that lost a stream while another can
    /// take it; it does not leave a pool of one without a worker). `any_healthy` is
    /// `healthy_decode(now).next().is_some()`, computed once per choice.
    fn usable(&self, d: &DecodeState, any_healthy: bool, now: Instant) -> bool {
        !any_healthy || !self.quarantined(&d.addr, now)
    }

    /// The least loaded usable decode worker with room for `blocks` (ITL SLO `itl`), the one
    /// with the most free blocks among equals.
    pub fn best_decode(&self, blocks: u32, itl: Duration, now: Instant) -> Option<&DecodeState> {
        let any_healthy = self.healthy_decode(now).next().is_some();
        self.decode_order
            .iter()
            .map(|&(_, _, slot)| &self.decode[slot])
            .find(|d| self.usable(d, any_healthy, now) && d.has_room(blocks, itl))
    }

    /// The decode worker for `prompt` (needing `blocks`, ITL SLO `itl`) among those with room:
    /// the lowest cost, counting each prompt block it lacks (to be shipped and stored) as
    /// `weight` blocks of load, so a held prefix attracts its requests until the holder is
    /// that much busier than another worker; among equal costs the most free blocks, then the
    /// first in the fleet. With the cached tokens expected there.
    pub fn choose_decode(
        &self,
        blocks: u32,
        itl: Duration,
        prompt: &Prompt,
        weight: f64,
        now: Instant,
    ) -> Option<(&DecodeState, usize)> {
        let any_healthy = self.healthy_decode(now).next().is_some();
        let open = |d: &DecodeState| self.usable(d, any_healthy, now) && d.has_room(blocks, itl);
        let cost = |d: &DecodeState, cached: usize| {
            let missing = d.blocks_for(prompt.len()).saturating_sub(d.blocks_for(cached));
            weight * f64::from(missing) + f64::from(d.load_blocks())
        };
        // (cost, free blocks, position, cached tokens): lower cost, then more free, then first.
        let better = |c: (f64, u32, usize), best: &Option<(f64, u32, usize, usize)>| match best {
            None => true,
            Some(b) => c.0.total_cmp(&b.0).then(b.1.cmp(&c.1)).then(c.2.cmp(&b.2)).is_lt(),
        };
        let mut best = None;
        for slot in holding(&self.decode_holders, &self.decode_keys, prompt) {
            let d = &self.decode[slot];
            if open(d) {
                let cached = d.prefixes.cached_tokens(prompt, now);
                let c = (cost(d, cached), d.free_blocks(), slot);
                if better(c, &best) {
                    best = Some((c.0, c.1, c.2, cached));
                }
            }
        }
        // The rest cache nothing of it: least loaded first. A later worker is at least as
        // loaded, so once even the fewest blocks the prompt can need cannot make one beat the
        // best, none can.
        let floor = weight * f64::from(prompt.len().div_ceil(self.max_block_size as usize) as u32);
        for &(load, Reverse(free), slot) in &self.decode_order {
            if !better((floor + f64::from(load), free, slot), &best) {
                break;
            }
            let d = &self.decode[slot];
            if open(d) {
                let c = (cost(d, 0), free, slot);
                if better(c, &best) {
                    best = Some((c.0, c.1, c.2, 0));
                }
            }
        }
        best.map(|(.., slot, cached)| (&self.decode[slot], cached))
    }

    /// Prompt tokens the best-placed worker is expected to hold: of the prefill pool, or of
    /// the decode workers when there is none (they prefill).
    pub fn expected_cached(&self, prompt: &Prompt, now: Instant) -> usize {
        if self.prefill.is_empty() {
            let held = holding(&self.decode_holders, &self.decode_keys, prompt).into_iter();
            held.map(|s| self.decode[s].prefixes.cached_tokens(prompt, now)).max().unwrap_or(0)
        } else {
            let held = holding(&self.prefill_holders, &self.prefill_keys, prompt).into_iter();
            held.map(|s| self.prefill[s].prefixes.cached_tokens(prompt, now)).max().unwrap_or(0)
        }
    }

    /// True when a prefill worker has a free slot for a request of the top priority or not.
    pub fn prefill_room(&self, top_priority: bool) -> bool {
        self.prefill_order.iter().any(|&(.., slot)| self.prefill[slot].has_room(top_priority))
    }

    /// The prefill worker with the shortest estimated wait, among those with a free slot.
    pub fn best_prefill(&self, top_priority: bool) -> Option<(&PrefillState, Duration)> {
        let (wait, _, slot) = *self.prefill_order.iter().find(|&&(.., s)| self.prefill[s].has_room(top_priority))?;
        Some((&self.prefill[slot], wait))
    }

    /// The prefill worker, among those with a free slot, that gives `prompt` its first token
    /// soonest: its estimated wait plus computing the part of the prompt it has not cached;
    /// the first in the fleet among equals. With that wait and the cached tokens expected
    /// there.
    pub fn choose_prefill(
        &self,
        top_priority: bool,
        prompt: &Prompt,
        now: Instant,
    ) -> Option<(&PrefillState, Duration, usize)> {
        let score = |p: &PrefillState, cached: usize| {
            let wait = self.wait_of(p);
            (wait, wait + policy::estimated_wait(0, prompt.len() - cached.min(prompt.len()), p.rate(self.prior)))
        };
        // (time to the first token, position, wait, cached tokens): sooner, then first.
        let mut best: Option<(Duration, usize, Duration, usize)> = None;
        fn offer(best: &mut Option<(Duration, usize, Duration, usize)>, c: (Duration, usize, Duration, usize)) {
            if best.is_none_or(|b| (c.0, c.1) < (b.0, b.1)) {
                *best = Some(c);
            }
        }
        for slot in holding(&self.prefill_holders, &self.prefill_keys, prompt) {
            let p = &self.prefill[slot];
            if p.has_room(top_priority) {
                let cached = p.prefixes.cached_tokens(prompt, now);
                let (wait, first) = score(p, cached);
                offer(&mut best, (first, slot, wait, cached));
            }
        }
        // The rest cache nothing of it: shortest wait first, fastest first among equal waits.
        // The first with a free slot of a run of equal waits beats the rest of the run; a
        // later run cannot beat the best once its wait plus the prompt at the pool's fastest
        // rate does not.
        let floor = policy::estimated_wait(0, prompt.len(), self.max_prefill_rate);
        // A worker without room: the next in order. One with room: past the rest of its run.
        let mut rest = self.prefill_order.range::<(Duration, Reverse<u64>, usize), _>(..);
        while let Some(&(wait, _, slot)) = rest.next() {
            if best.is_some_and(|b| wait + floor > b.0) {
                break;
            }
            let p = &self.prefill[slot];
            if p.has_room(top_priority) {
                let (wait, first) = score(p, 0);
                offer(&mut best, (first, slot, wait, 0));
                rest = self.prefill_order.range((Bound::Excluded((wait, Reverse(0), usize::MAX)), Bound::Unbounded));
            }
        }
        best.map(|(_, slot, wait, cached)| (&self.prefill[slot], wait, cached))
    }

    /// A worker's estimated wait for a new short prompt (`PrefillState::wait`, as filed).
    pub fn wait_of(&self, p: &PrefillState) -> Duration {
        p.filed.map_or_else(|| p.wait(self.prior, self.step_budget), |(wait, _)| wait)
    }

    /// The pool's shortest estimated wait (None without a prefill worker) and total rate.
    pub fn prefill_pool(&self) -> (Option<Duration>, f64) {
        let wait = self.prefill_order.first().map(|&(wait, ..)| wait);
        (wait, if self.prefill_rate > 0.0 { self.prefill_rate } else { self.prior })
    }

    /// Tokens still to prefill of every prompt in flight in the pool (`in_flight_tokens`),
    /// each counted at most `cap`: O(log) whatever the pool's size.
    pub fn prefill_in_flight(&self, cap: usize) -> u64 {
        self.in_flight.capped_sum(cap)
    }

    /// The prefill worker with the shortest estimated wait, not in `exclude`.
    pub fn retry_prefill(&self, exclude: &[String]) -> Option<&PrefillState> {
        self.prefill_order.iter().map(|&(.., s)| &self.prefill[s]).find(|p| !exclude.contains(&p.addr))
    }

    /// The least loaded decode worker, not in `exclude`.
    pub fn retry_decode(&self, exclude: &[String]) -> Option<&DecodeState> {
        self.decode_order.iter().map(|&(.., s)| &self.decode[s]).find(|d| !exclude.contains(&d.addr))
    }
}

/// Positions of the workers holding the first block of `prompt`, for each way the pool
/// hashes it (`keys`): the only workers that cache any of it.
fn holding(holders: &Holders, keys: &[(u64, u32)], prompt: &Prompt) -> Vec<usize> {
    let mut slots = Vec::new();
    for &(seed, block_size) in keys {
        if let Some(&first) = prompt.hashes(seed, block_size).first() {
            slots.extend(holders.of(first).iter().map(|&s| s as usize));
        }
    }
    if keys.len() > 1 {
        slots.sort_unstable();
        slots.dedup();
    }
    slots
}

#[cfg(test)]
mod tests;
