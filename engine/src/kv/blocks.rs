//! Block bookkeeping for the paged KV cache: ids, reference counts, the prefix cache of full
//! blocks and usage, with no tensors.
//!
//! Every block is in one of three states: free (no content), held (reference count > 0, by
//! one sequence, or by several when it is a shared cached prefix block) or cached (count 0,
//! content-addressed, reusable until evicted). Allocation takes free blocks first, then
//! evicts cached ones least recently released first; a sequence releases its blocks last
//! block first, so a prefix's tail is evicted before its head. A held block is never
//! evicted, and a shared block is never written: sharing covers only full blocks before a
//! sequence's first computed token. An allocation gives its blocks back when dropped, so a
//! sequence that ends by any path (finish, error, cancel, panic unwinding) cannot leak.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use super::prefix::{self, BlockEventKind, BlockHash, EventLog, EventsSince};
use crate::error::{EngineError, Result};

/// Index of a block in the KV cache tensors.
pub type BlockId = u32;

/// Events kept for followers (the router) between two of their polls.
const EVENT_LOG: usize = 16_384;

#[derive(Debug)]
struct Pool {
    /// Blocks with no content; allocation pops from the end (most recently freed first).
    free: Vec<BlockId>,
    refs: Vec<u32>,
    /// The content address of a block the cache table points at.
    hash: Vec<Option<BlockHash>>,
    table: HashMap<BlockHash, BlockId>,
    /// Cached blocks nobody holds, by release tick (lowest evicted first).
    evictable: BTreeMap<u64, BlockId>,
    released_at: Vec<u64>,
    tick: u64,
    log: EventLog,
    total: usize,
    /// Prompt tokens looked up and found (vLLM's prefix_cache_queries / _hits).
    queried_tokens: u64,
    hit_tokens: u64,
}

impl Pool {
    /// Blocks an allocation can take now (free or evictable).
    fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    fn take(&mut self, count: usize) -> Result<Vec<BlockId>> {
        if self.available() < count {
            return Err(EngineError::OutOfBlocks { needed: count, free: self.available(), total: self.total });
        }
        let from_free = count.min(self.free.len());
        let mut ids = self.free.split_off(self.free.len() - from_free);
        while ids.len() < count {
            let Some((_, id)) = self.evictable.pop_first() else { break };
            if let Some(h) = self.hash[id as usize].take() {
                self.table.remove(&h);
                self.log.push(BlockEventKind::Removed, h);
            }
            ids.push(id);
        }
        for &id in &ids {
            self.refs[id as usize] = 1;
        }
        Ok(ids)
    }

    /// Takes another reference on a cached or held block.
    fn hold(&mut self, id: BlockId) {
        let i = id as usize;
        if self.refs[i] == 0 {
            self.evictable.remove(&self.released_at[i]);
        }
        self.refs[i] += 1;
    }

    /// Drops one reference from each of `ids`, last block first.
    fn release(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let i = id as usize;
            self.refs[i] = self.refs[i].saturating_sub(1);
            if self.refs[i] > 0 {
                continue;
            }
            if self.hash[i].is_some() {
                self.tick += 1;
                self.released_at[i] = self.tick;
                self.evictable.insert(self.tick, id);
            } else {
                self.free.push(id);
            }
        }
    }

    /// Leading blocks of `hashes` that the table holds.
    fn lookup(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        hashes.iter().map_while(|h| self.table.get(h).copied()).collect()
    }
}

/// A random nonzero id (std's randomly keyed hasher over the time: no RNG dependency).
fn random_instance() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish().max(1)
}

/// Shared handle to the block pool. Cloning is cheap; all clones see one pool.
#[derive(Debug, Clone)]
pub struct BlockManager {
    pool: Arc<Mutex<Pool>>,
    block_size: usize,
    /// Hash seed of this pool's prefix cache; None when prefix caching is off.
    seed: Option<u64>,
    /// Random id of this pool, so a follower of its events notices a new one (a restart).
    instance: u64,
}

impl BlockManager {
    /// A pool without prefix caching.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        BlockManager::build(num_blocks, block_size, None)
    }

    /// A pool whose full blocks are content-addressed with hashes seeded by `seed`
    /// (`prefix::hash_seed` of the model and block size).
    pub fn with_prefix_cache(num_blocks: usize, block_size: usize, seed: u64) -> Self {
        BlockManager::build(num_blocks, block_size, Some(seed))
    }

    fn build(num_blocks: usize, block_size: usize, seed: Option<u64>) -> Self {
        let pool = Pool {
            free: (0..num_blocks as BlockId).rev().collect(),
            refs: vec![0; num_blocks],
            hash: vec![None; num_blocks],
            table: HashMap::new(),
            evictable: BTreeMap::new(),
            released_at: vec![0; num_blocks],
            tick: 0,
            log: EventLog::new(EVENT_LOG),
            total: num_blocks,
            queried_tokens: 0,
            hit_tokens: 0,
        };
        BlockManager { pool: Arc::new(Mutex::new(pool)), block_size, seed, instance: random_instance() }
    }

    fn lock(&self) -> MutexGuard<'_, Pool> {
        // The pool holds plain integers; a panic elsewhere cannot leave it half-updated.
        self.pool.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Random nonzero id of this pool (its cache events are numbered per instance).
    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// The prefix hash seed, when prefix caching is on.
    pub fn prefix_seed(&self) -> Option<u64> {
        self.seed
    }

    pub fn total_blocks(&self) -> usize {
        self.lock().total
    }

    /// Blocks an allocation can take now: free ones and cached ones nobody holds.
    pub fn free_blocks(&self) -> usize {
        self.lock().available()
    }

    /// Blocks whose content is cached (held or not).
    pub fn cached_blocks(&self) -> usize {
        self.lock().table.len()
    }

    /// Blocks held by sequences (reference count above zero).
    pub fn held_blocks(&self) -> usize {
        let pool = self.lock();
        pool.total - pool.available()
    }

    /// Fraction of blocks held by sequences, 0.0 ..= 1.0 (cached blocks nobody holds count as
    /// free: an allocation may take them).
    pub fn usage_ratio(&self) -> f64 {
        let pool = self.lock();
        if pool.total == 0 {
            return 0.0;
        }
        (pool.total - pool.available()) as f64 / pool.total as f64
    }

    /// Prompt tokens looked up in the prefix cache and tokens found there, since the start.
    pub fn prefix_stats(&self) -> (u64, u64) {
        let pool = self.lock();
        (pool.queried_tokens, pool.hit_tokens)
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Takes `count` blocks, or none at all if fewer are free.
    pub fn allocate(&self, count: usize) -> Result<BlockAllocation> {
        let ids = self.lock().take(count)?;
        Ok(BlockAllocation { ids, hashes: Vec::new(), manager: self.clone() })
    }

    /// An allocation that owns no blocks yet (grows with `ensure_tokens`).
    pub fn empty_allocation(&self) -> BlockAllocation {
        BlockAllocation { ids: Vec::new(), hashes: Vec::new(), manager: self.clone() }
    }

    /// Blocks for a sequence of `capacity` tokens starting with `prompt`, reusing the cached
    /// full blocks of the prompt's longest cached prefix, and the number of tokens they hold.
    /// At least the prompt's last token is left to compute (its logits are needed), so the
    /// cached part is at most the full blocks before it. All or nothing.
    pub fn allocate_prefix(&self, prompt: &[u32], capacity: usize) -> Result<(BlockAllocation, usize)> {
        let needed = self.blocks_for(capacity.max(prompt.len()));
        let Some(seed) = self.seed else { return Ok((self.allocate(needed)?, 0)) };
        let usable = prompt.len().saturating_sub(1) / self.block_size;
        let hashes = prefix::prefix_hashes(seed, self.block_size, &prompt[..usable * self.block_size]);
        let mut pool = self.lock();
        let mut ids = pool.lookup(&hashes);
        for &id in &ids {
            pool.hold(id);
        }
        match pool.take(needed - ids.len()) {
            Ok(mut fresh) => {
                let cached = ids.len() * self.block_size;
                pool.queried_tokens += prompt.len() as u64;
                pool.hit_tokens += cached as u64;
                drop(pool);
                let hashes = hashes[..ids.len()].to_vec();
                ids.append(&mut fresh);
                Ok((BlockAllocation { ids, hashes, manager: self.clone() }, cached))
            }
            Err(e) => {
                pool.release(&ids);
                Err(e)
            }
        }
    }

    /// Cached tokens of `prompt`'s longest cached prefix (full blocks before its last token),
    /// without taking anything.
    pub fn cached_prefix_tokens(&self, prompt: &[u32]) -> usize {
        let Some(seed) = self.seed else { return 0 };
        let usable = prompt.len().saturating_sub(1) / self.block_size;
        let hashes = prefix::prefix_hashes(seed, self.block_size, &prompt[..usable * self.block_size]);
        self.lock().lookup(&hashes).len() * self.block_size
    }

    /// Makes the full blocks of `alloc` whose K/V hold `tokens` (positions 0.. of the
    /// sequence, all computed) reusable by later sequences. Hashes are computed once per block;
    /// a block whose content another block already caches stays private (freed, not cached).
    pub fn register(&self, alloc: &mut BlockAllocation, tokens: &[u32]) {
        let Some(seed) = self.seed else { return };
        let before = alloc.hashes.len();
        let full = (tokens.len() / self.block_size).min(alloc.ids.len());
        prefix::extend_hashes(seed, self.block_size, &tokens[..full * self.block_size], &mut alloc.hashes);
        let mut pool = self.lock();
        for i in before..alloc.hashes.len() {
            let (h, id) = (alloc.hashes[i], alloc.ids[i]);
            if pool.hash[id as usize].is_some() || pool.table.contains_key(&h) {
                continue;
            }
            pool.table.insert(h, id);
            pool.hash[id as usize] = Some(h);
            pool.log.push(BlockEventKind::Stored, h);
        }
    }

    /// Sequence number of the last cache event (0 before any).
    pub fn last_event(&self) -> u64 {
        self.lock().log.last_seq()
    }

    /// Cache events after `after`, at most `limit`.
    pub fn events_since(&self, after: u64, limit: usize) -> EventsSince {
        self.lock().log.since(after, limit)
    }

    /// Every cached hash and the sequence number they are current at (a follower's resync).
    pub fn cached_snapshot(&self) -> (u64, Vec<BlockHash>) {
        let pool = self.lock();
        (pool.log.last_seq(), pool.table.keys().copied().collect())
    }
}

/// Blocks owned by one sequence, in logical order (block i holds tokens i*bs .. (i+1)*bs).
#[derive(Debug)]
pub struct BlockAllocation {
    ids: Vec<BlockId>,
    /// Content addresses of the leading full blocks, as far as they were computed.
    hashes: Vec<BlockHash>,
    manager: BlockManager,
}

impl BlockAllocation {
    pub fn ids(&self) -> &[BlockId] {
        &self.ids
    }

    pub fn block_size(&self) -> usize {
        self.manager.block_size
    }

    /// Tokens these blocks can hold.
    pub fn capacity_tokens(&self) -> usize {
        self.ids.len() * self.manager.block_size
    }

    /// Grows the allocation so it holds at least `tokens` tokens. All or nothing.
    pub fn ensure_tokens(&mut self, tokens: usize) -> Result<()> {
        let needed = self.manager.blocks_for(tokens);
        if needed > self.ids.len() {
            let mut more = self.manager.lock().take(needed - self.ids.len())?;
            self.ids.append(&mut more);
        }
        Ok(())
    }

    /// Appends `other`'s blocks (from the same pool) after this allocation's, so a sequence
    /// can own blocks reserved separately for its prompt and for its growth.
    pub fn absorb(&mut self, mut other: BlockAllocation) -> Result<()> {
        if !Arc::ptr_eq(&self.manager.pool, &other.manager.pool) {
            return Err(EngineError::InvalidBatch("blocks from another pool".into()));
        }
        if self.hashes.len() == self.ids.len() && other.hashes.len() == other.ids.len() {
            // Both are whole runs of hashed blocks; otherwise later hashes are recomputed.
            self.hashes.append(&mut other.hashes);
        }
        self.ids.append(&mut other.ids);
        Ok(())
    }

    /// Splits off the blocks from index `at` on into their own allocation (e.g. the part of a
    /// reservation a KV transfer writes, apart from the cached prefix it must not touch).
    pub fn split_off(&mut self, at: usize) -> BlockAllocation {
        let at = at.min(self.ids.len());
        self.hashes.truncate(at);
        BlockAllocation { ids: self.ids.split_off(at), hashes: Vec::new(), manager: self.manager.clone() }
    }

    /// A new allocation holding one more reference on each of the first `blocks` blocks (at
    /// most all of them): the shared, read-only prompt of `n` sequences sampled from one
    /// prefill. Its blocks return to the pool when the last holder lets go.
    pub fn share_prefix(&self, blocks: usize) -> BlockAllocation {
        let ids = self.ids[..blocks.min(self.ids.len())].to_vec();
        let mut pool = self.manager.lock();
        for &id in &ids {
            pool.hold(id);
        }
        drop(pool);
        let hashes = self.hashes[..self.hashes.len().min(ids.len())].to_vec();
        BlockAllocation { ids, hashes, manager: self.manager.clone() }
    }

    /// Offers the full blocks holding `tokens` (positions 0.., all computed) to the prefix
    /// cache of this allocation's pool (`BlockManager::register`).
    pub fn register(&mut self, tokens: &[u32]) {
        let manager = self.manager.clone();
        manager.register(self, tokens);
    }

    /// Cache slot (block * block_size + offset) of logical token position `pos`.
    pub fn slot(&self, pos: usize) -> Option<usize> {
        let bs = self.manager.block_size;
        self.ids.get(pos / bs).map(|&block| block as usize * bs + pos % bs)
    }
}

impl Drop for BlockAllocation {
    fn drop(&mut self) {
        if !self.ids.is_empty() {
            self.manager.lock().release(&self.ids);
        }
    }
}

#[cfg(test)]
mod tests;
