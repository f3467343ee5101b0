//! The router's index of what each worker's prefix cache holds, for cache-aware choice.
//!
//! A worker that publishes cache events (`CacheEvents` in its `Load` answer) is followed
//! exactly: the router asks for the events after the last sequence number it applied, under
//! the worker's cache instance id; a restarted worker (new instance), a gap in the numbers or
//! a log that no longer reaches back that far gets a full snapshot instead. A worker that does
//! not publish is credited with the prefixes this router sent it, for `ROUTED_TTL`.
//! Lookups hash the prompt the way the worker does (`pd_engine::kv::prefix`, the worker's
//! seed and block size) and count its leading blocks found.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_engine::kv::prefix;
use pd_proto::v1 as pb;

/// How long a prefix routed to a worker that publishes no events counts as cached there.
pub const ROUTED_TTL: Duration = Duration::from_secs(120);

/// Routed prefixes expire in ticks of this many nanoseconds (1/16 s) from the index's first
/// routing: a u32 of them lasts eight years, and an expiry is at most one tick late.
const TICK_NS: u128 = 62_500_000;

/// Maps and sets keyed by block hashes use them as they are: they are already uniform (cut
/// from SHA-256 digests), and hashing them again with SipHash was a sixth of a long
/// virtual-time run's CPU.
pub type BlockHashes = std::hash::BuildHasherDefault<BlockHashHasher>;

/// The identity on a block hash (`BlockHashes`).
#[derive(Debug, Default, Clone, Copy)]
pub struct BlockHashHasher(u64);

impl std::hash::Hasher for BlockHashHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// Block size assumed for a worker that reports none (the engine's default).
const DEFAULT_BLOCK_SIZE: u32 = 16;

/// One worker's cached block hashes.
#[derive(Debug, Default, Clone)]
pub struct PrefixIndex {
    /// From the worker's events (None: it does not publish).
    followed: Option<Followed>,
    /// Hashes (seed 0) this router routed there, with the tick they stop counting at.
    routed: HashMap<u64, u32, BlockHashes>,
    /// Every routing within `ROUTED_TTL`, oldest first: its expiry tick and its hashes, so
    /// that expired hashes are dropped by looking at those alone, never by a scan of all.
    expiring: VecDeque<(u32, Arc<Vec<u64>>)>,
    /// Where ticks count from (the first routing).
    epoch: Option<Instant>,
    /// The tick of the last routing.
    last_tick: u32,
    routed_block_size: u32,
}

#[derive(Debug, Clone)]
struct Followed {
    instance: u64,
    seed: u64,
    block_size: u32,
    last_seq: u64,
    hashes: HashSet<u64, BlockHashes>,
}

impl PrefixIndex {
    /// What to ask the worker for in the next `Load`: events after this point of this instance.
    pub fn cursor(&self) -> pb::LoadRequest {
        match &self.followed {
            Some(f) => pb::LoadRequest { cache_events_after: f.last_seq, cache_instance: f.instance },
            None => pb::LoadRequest::default(),
        }
    }

    /// Applies one `Load` answer's cache part; `block_size` is the worker's (0: unknown).
    /// `changed` hears every hash the worker starts (true) or stops (false) holding, so the
    /// fleet's inverted index (`fleet/holders.rs`) follows. (Events do not say which hashes
    /// are first blocks, so all of them are told; routed prefixes tell only their first.)
    pub fn apply(&mut self, events: Option<pb::CacheEvents>, block_size: u32, changed: &mut dyn FnMut(u64, bool)) {
        self.routed_block_size = if block_size > 0 { block_size } else { DEFAULT_BLOCK_SIZE };
        let Some(e) = events else {
            if let Some(f) = self.followed.take() {
                f.hashes.iter().for_each(|h| changed(*h, false));
            }
            return;
        };
        let same = self.followed.as_ref().is_some_and(|f| f.instance == e.instance && f.seed == e.hash_seed);
        if e.snapshot || !same {
            self.forget(changed);
            let hashes: HashSet<u64, BlockHashes> = e.snapshot_hashes.iter().copied().collect();
            hashes.iter().for_each(|h| changed(*h, true));
            let base = Followed {
                instance: e.instance,
                seed: e.hash_seed,
                block_size: e.block_size,
                last_seq: if e.snapshot { e.last_seq } else { 0 },
                hashes,
            };
            self.followed = Some(base);
            if !e.snapshot {
                // A new instance answered events meant for the old one: ask for a snapshot.
                return;
            }
        }
        let Some(f) = self.followed.as_mut() else { return };
        for ev in &e.events {
            if ev.seq <= f.last_seq {
                continue;
            }
            if ev.seq != f.last_seq + 1 {
                // A gap: start over from a snapshot at the next refresh.
                f.last_seq = 0;
                f.instance = 0;
                return;
            }
            f.last_seq = ev.seq;
            let now_held = if ev.stored { f.hashes.insert(ev.hash) } else { f.hashes.remove(&ev.hash) };
            if now_held {
                changed(ev.hash, ev.stored);
            }
        }
    }

    /// Drops everything known (the worker left the fleet, or its events start over).
    pub fn forget(&mut self, changed: &mut dyn FnMut(u64, bool)) {
        if let Some(f) = self.followed.take() {
            f.hashes.iter().for_each(|h| changed(*h, false));
        }
        self.routed_firsts(&mut |h| changed(h, false));
        self.routed.clear();
        self.expiring.clear();
    }

    /// The first blocks' hashes of the routed prefixes the map holds (a hash routed twice
    /// within one tick is told twice: the holders index takes that as once).
    fn routed_firsts(&self, f: &mut dyn FnMut(u64)) {
        for (tick, hashes) in &self.expiring {
            // The map keeps a hash's latest routing: only that one tells it.
            if let Some(&h) = hashes.first().filter(|h| self.routed.get(*h) == Some(tick)) {
                f(h);
            }
        }
    }

    /// `t` in ticks from the first routing.
    fn tick(&self, t: Instant) -> u32 {
        let since = self.epoch.map_or(Duration::ZERO, |e| t.saturating_duration_since(e));
        (since.as_nanos() / TICK_NS).min(u128::from(u32::MAX)) as u32
    }

    /// Every hash the inverted index holds for this worker: known from events, or the first
    /// blocks of prefixes routed here (expired or not).
    pub fn for_each_hash(&self, f: &mut dyn FnMut(u64)) {
        match &self.followed {
            Some(fw) => fw.hashes.iter().for_each(|h| f(*h)),
            None => self.routed_firsts(f),
        }
    }

    /// The (seed, block size) its hashes are computed with.
    pub fn hash_key(&self) -> (u64, u32) {
        match &self.followed {
            Some(f) => (f.seed, f.block_size),
            None => (0, self.routed_block_size),
        }
    }

    /// True when the worker publishes its cache.
    pub fn followed(&self) -> bool {
        self.followed.is_some()
    }

    /// Blocks this worker holds of the prompt (leading full blocks, never the one of its last
    /// token, which is always computed), in tokens.
    pub fn cached_tokens(&self, prompt: &Prompt, now: Instant) -> usize {
        let (seed, bs) = self.hash_key();
        let hashes = prompt.hashes(seed, bs);
        let found = match &self.followed {
            Some(f) => hashes.iter().take_while(|h| f.hashes.contains(h)).count(),
            None => {
                let now = self.tick(now);
                hashes.iter().take_while(|h| self.routed.get(h).is_some_and(|&expires| expires > now)).count()
            }
        };
        found * bs as usize
    }

    /// A prompt was routed here: without events, remember its blocks for `ROUTED_TTL`,
    /// dropping the first blocks of the routings that expired by now (the oldest, so only
    /// those are looked at), and the rest of what expired when the map is full.
    /// `changed` hears only first blocks' hashes: the pool's index is asked for the holders
    /// of a prompt's first block only (a cached prefix starts there), and telling it every
    /// block was most of a long run's routing cost (documents of a hundred blocks each).
    pub fn routed(&mut self, prompt: &Prompt, now: Instant, changed: &mut dyn FnMut(u64, bool)) {
        if self.followed.is_some() {
            return;
        }
        self.epoch.get_or_insert(now);
        let current = self.tick(now);
        // An expired routing's first block leaves now, so the holders index hears it; its
        // other blocks stay until the map would grow (lookups check expiry): a removal per block
        // was a cache miss per block of every prompt, paid again at its expiry.
        while let Some((tick, hashes)) = self.expiring.front().filter(|(tick, _)| *tick <= current) {
            if let Some(&first) = hashes.first() {
                // Routed again since: the later routing keeps it.
                if let Entry::Occupied(e) = self.routed.entry(first) {
                    if e.get() == tick {
                        e.remove();
                        changed(first, false);
                    }
                }
            }
            self.expiring.pop_front();
        }
        self.last_tick = current;
        // Rounded up: a routing never counts for less than `ROUTED_TTL`.
        let expires = self.tick(now + ROUTED_TTL).saturating_add(1);
        let hashes = prompt.hashes(0, self.routed_block_size);
        if hashes.is_empty() {
            return;
        }
        if self.routed.len() + hashes.len() > self.routed.capacity() {
            // One pass over the map instead of growing it: only expired blocks go (every
            // expired first block already went above).
            self.routed.retain(|_, expires| *expires > current);
        }
        for (i, h) in hashes.iter().enumerate() {
            let was = self.routed.insert(*h, expires);
            if i == 0 && was.is_none() {
                changed(*h, true);
            }
        }
        self.expiring.push_back((expires, hashes));
    }

    /// Cached hashes known (events) or remembered (routed, unexpired at the last routing),
    /// for tests and debugging.
    pub fn len(&self) -> usize {
        match &self.followed {
            Some(f) => f.hashes.len(),
            None => self.routed.values().filter(|&&expires| expires > self.last_tick).count(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `len` without the scan: a routed hash counts until the next routing drops it.
    pub fn indexed_blocks(&self) -> usize {
        self.followed.as_ref().map_or(self.routed.len(), |f| f.hashes.len())
    }
}

/// Block hashes of a prompt for one (seed, block size).
type Hashes = ((u64, u32), std::sync::Arc<Vec<u64>>);

/// A prompt's tokens and its block hashes, computed once per (seed, block size).
#[derive(Debug, Default)]
pub struct Prompt {
    tokens: Vec<u32>,
    memo: std::sync::Mutex<Vec<Hashes>>,
}

impl Prompt {
    pub fn new(tokens: Vec<u32>) -> Self {
        Prompt { tokens, memo: Default::default() }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Hashes of the full blocks before the last token (the part a worker may have cached).
    pub fn hashes(&self, seed: u64, block_size: u32) -> std::sync::Arc<Vec<u64>> {
        let mut memo = self.memo.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, h)) = memo.iter().find(|(k, _)| *k == (seed, block_size)) {
            return h.clone();
        }
        let bs = block_size.max(1) as usize;
        let usable = self.tokens.len().saturating_sub(1) / bs * bs;
        let h = std::sync::Arc::new(prefix::prefix_hashes(seed, bs, &self.tokens[..usable]));
        memo.push(((seed, block_size), h.clone()));
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(seq: u64, hash: u64) -> pb::CacheEvent {
        pb::CacheEvent { seq, stored: true, hash }
    }

    fn events(instance: u64, last_seq: u64, events: Vec<pb::CacheEvent>) -> pb::CacheEvents {
        pb::CacheEvents { instance, hash_seed: 9, block_size: 4, last_seq, events, ..Default::default() }
    }

    #[test]
    fn events_are_followed_and_a_gap_or_restart_asks_for_a_snapshot() {
        let prompt = Prompt::new((0..13).collect());
        let h = prompt.hashes(9, 4).to_vec();
        assert_eq!(h.len(), 3);
        let mut index = PrefixIndex::default();
        // First contact: the worker sends a snapshot (the router asked from instance 0).
        let snap = pb::CacheEvents { snapshot: true, snapshot_hashes: vec![h[0]], ..events(7, 4, vec![]) };
        index.apply(Some(snap), 4, &mut |_, _| {});
        assert_eq!(index.cursor(), pb::LoadRequest { cache_events_after: 4, cache_instance: 7 });
        let now = Instant::now();
        assert_eq!(index.cached_tokens(&prompt, now), 4);
        index.apply(Some(events(7, 6, vec![stored(5, h[1]), stored(6, h[2])])), 4, &mut |_, _| {});
        assert_eq!(index.cached_tokens(&prompt, now), 12);
        index.apply(Some(events(7, 7, vec![pb::CacheEvent { seq: 7, stored: false, hash: h[1] }])), 4, &mut |_, _| {});
        assert_eq!(index.cached_tokens(&prompt, now), 4, "a removed middle block ends the prefix");
        // Event 8 missed: the index asks for a snapshot and keeps what it knew meanwhile.
        index.apply(Some(events(7, 9, vec![stored(9, h[1])])), 4, &mut |_, _| {});
        assert_eq!(index.cursor(), pb::LoadRequest { cache_events_after: 0, cache_instance: 0 });
        // The worker restarted: a new instance's snapshot replaces everything.
        let restarted = pb::CacheEvents { snapshot: true, snapshot_hashes: vec![], ..events(8, 0, vec![]) };
        index.apply(Some(restarted), 4, &mut |_, _| {});
        assert_eq!(index.cached_tokens(&prompt, now), 0);
        assert_eq!(index.cursor().cache_instance, 8);
    }

    #[test]
    fn without_events_the_routed_prefixes_count_until_they_expire() {
        let prompt = Prompt::new((0..40).collect());
        let mut index = PrefixIndex::default();
        index.apply(None, 16, &mut |_, _| {});
        let now = Instant::now();
        assert_eq!(index.cached_tokens(&prompt, now), 0);
        index.routed(&prompt, now, &mut |_, _| {});
        assert_eq!(index.cached_tokens(&prompt, now), 32);
        assert_eq!(index.cached_tokens(&prompt, now + ROUTED_TTL + Duration::from_secs(1)), 0);
    }

    #[test]
    fn expired_blocks_make_room_instead_of_growing_the_map() {
        // A prompt a second for 25 minutes: about 120 routings of 2 blocks live at a time.
        let mut index = PrefixIndex::default();
        index.apply(None, 16, &mut |_, _| {});
        let t0 = Instant::now();
        let mut held = 0i64;
        for i in 0..1500u32 {
            let prompt = Prompt::new((i * 40..i * 40 + 40).collect());
            let now = t0 + Duration::from_secs(u64::from(i));
            index.routed(&prompt, now, &mut |_, told| held += if told { 1 } else { -1 });
            assert_eq!(index.cached_tokens(&prompt, now), 32);
        }
        let live = index.len();
        assert!((240..=250).contains(&live), "{live} blocks unexpired");
        assert!(index.routed.capacity() <= 4 * live, "{} slots for {live} blocks", index.routed.capacity());
        // The holders index heard every first block come and (all but the live ones) go.
        assert_eq!(held, live as i64 / 2);
    }

    #[test]
    fn a_prefix_routed_again_outlives_its_first_routing_and_the_holders_hear_its_end() {
        let a = Prompt::new((0..40).collect());
        let b = Prompt::new((100..140).collect());
        let first_a = a.hashes(0, 16)[0];
        let mut index = PrefixIndex::default();
        index.apply(None, 16, &mut |_, _| {});
        let t0 = Instant::now();
        let mut told = Vec::new();
        index.routed(&a, t0, &mut |h, held| told.push((h, held)));
        assert_eq!(told, vec![(first_a, true)], "only the first block is told");
        index.routed(&a, t0 + Duration::from_secs(100), &mut |h, held| told.push((h, held)));
        assert_eq!(told.len(), 1, "already held");
        // The first routing expired; the second still counts.
        let later = t0 + ROUTED_TTL + Duration::from_secs(10);
        index.routed(&b, later, &mut |h, held| told.push((h, held)));
        assert_eq!(index.cached_tokens(&a, later), 32);
        assert_eq!(told.len(), 2, "b's first block only: {told:?}");
        let mut firsts = Vec::new();
        index.for_each_hash(&mut |h| firsts.push(h));
        firsts.sort_unstable();
        let mut want = vec![first_a, b.hashes(0, 16)[0]];
        want.sort_unstable();
        assert_eq!(firsts, want);
        // Past the second routing's expiry a's blocks are dropped, and the holders hear it.
        let end = t0 + Duration::from_secs(100) + ROUTED_TTL + Duration::from_secs(1);
        index.routed(&b, end, &mut |h, held| told.push((h, held)));
        assert_eq!(told.last(), Some(&(first_a, false)));
        assert_eq!(index.cached_tokens(&a, end), 0);
        assert_eq!(index.len(), 2, "b's two blocks");
        index.forget(&mut |h, held| told.push((h, held)));
        assert_eq!(told.last(), Some(&(b.hashes(0, 16)[0], false)));
        assert!(index.is_empty());
    }
}
