//! Block bookkeeping for the paged KV cache: ids, a free list and usage, with no tensors.
//!
//! Invariants: every block id is either on the free list or owned by exactly one
//! `BlockAllocation`; an allocation gives its blocks back when dropped, so a sequence that
//! ends by any path (finish, error, cancel, panic unwinding) cannot leak blocks.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{EngineError, Result};

/// Index of a block in the KV cache tensors.
pub type BlockId = u32;

#[derive(Debug)]
struct Pool {
    /// Free block ids; allocation pops from the end (most recently freed first, warm memory).
    free: Vec<BlockId>,
    total: usize,
}

/// Shared handle to the block pool. Cloning is cheap; all clones see one pool.
#[derive(Debug, Clone)]
pub struct BlockManager {
    pool: Arc<Mutex<Pool>>,
    block_size: usize,
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let free = (0..num_blocks as BlockId).rev().collect();
        BlockManager { pool: Arc::new(Mutex::new(Pool { free, total: num_blocks })), block_size }
    }

    fn lock(&self) -> MutexGuard<'_, Pool> {
        // The pool holds plain integers; a panic elsewhere cannot leave it half-updated.
        self.pool.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn total_blocks(&self) -> usize {
        self.lock().total
    }

    pub fn free_blocks(&self) -> usize {
        self.lock().free.len()
    }

    /// Fraction of blocks in use, 0.0 ..= 1.0.
    pub fn usage_ratio(&self) -> f64 {
        let pool = self.lock();
        if pool.total == 0 {
            return 0.0;
        }
        (pool.total - pool.free.len()) as f64 / pool.total as f64
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Takes `count` blocks, or none at all if fewer are free.
    pub fn allocate(&self, count: usize) -> Result<BlockAllocation> {
        let ids = self.take(count)?;
        Ok(BlockAllocation { ids, manager: self.clone() })
    }

    /// An allocation that owns no blocks yet (grows with `ensure_tokens`).
    pub fn empty_allocation(&self) -> BlockAllocation {
        BlockAllocation { ids: Vec::new(), manager: self.clone() }
    }

    fn take(&self, count: usize) -> Result<Vec<BlockId>> {
        let mut pool = self.lock();
        if pool.free.len() < count {
            return Err(EngineError::OutOfBlocks { needed: count, free: pool.free.len(), total: pool.total });
        }
        let at = pool.free.len() - count;
        Ok(pool.free.split_off(at))
    }

    fn give_back(&self, ids: &mut Vec<BlockId>) {
        if ids.is_empty() {
            return;
        }
        self.lock().free.append(ids);
    }
}

/// Blocks owned by one sequence, in logical order (block i holds tokens i*bs .. (i+1)*bs).
#[derive(Debug)]
pub struct BlockAllocation {
    ids: Vec<BlockId>,
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
            let mut more = self.manager.take(needed - self.ids.len())?;
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
        self.ids.append(&mut other.ids);
        Ok(())
    }

    /// Cache slot (block * block_size + offset) of logical token position `pos`.
    pub fn slot(&self, pos: usize) -> Option<usize> {
        let bs = self.manager.block_size;
        self.ids.get(pos / bs).map(|&block| block as usize * bs + pos % bs)
    }
}

impl Drop for BlockAllocation {
    fn drop(&mut self) {
        self.manager.give_back(&mut self.ids);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_returns_blocks_on_drop() {
        let manager = BlockManager::new(8, 16);
        let a = manager.allocate(3).expect("3 of 8");
        let b = manager.allocate(5).expect("5 of 5");
        assert_eq!(manager.free_blocks(), 0);
        assert!((manager.usage_ratio() - 1.0).abs() < 1e-12);
        let mut all: Vec<_> = a.ids().iter().chain(b.ids()).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<_>>(), "ids are distinct and cover the pool");
        drop(a);
        assert_eq!(manager.free_blocks(), 3);
        drop(b);
        assert_eq!(manager.free_blocks(), 8);
        assert_eq!(manager.usage_ratio(), 0.0);
    }

    #[test]
    fn absorb_moves_blocks_and_refuses_other_pools() {
        let manager = BlockManager::new(6, 4);
        let mut a = manager.allocate(2).expect("2");
        let b = manager.allocate(3).expect("3");
        let b_ids = b.ids().to_vec();
        a.absorb(b).expect("same pool");
        assert_eq!(&a.ids()[2..], b_ids.as_slice());
        assert_eq!(manager.free_blocks(), 1);
        let other = BlockManager::new(2, 4);
        assert!(a.absorb(other.allocate(1).expect("1")).is_err());
        assert_eq!(other.free_blocks(), 2, "refused blocks go back to their pool");
        drop(a);
        assert_eq!(manager.free_blocks(), 6);
    }

    #[test]
    fn out_of_blocks_is_an_error_and_takes_nothing() {
        let manager = BlockManager::new(4, 16);
        let _held = manager.allocate(3).expect("3 of 4");
        let err = manager.allocate(2).expect_err("only 1 free");
        assert!(matches!(err, EngineError::OutOfBlocks { needed: 2, free: 1, total: 4 }));
        assert!(err.to_string().contains("out of KV blocks"));
        assert_eq!(manager.free_blocks(), 1);
    }

    #[test]
    fn ensure_tokens_grows_all_or_nothing_and_maps_slots() {
        let manager = BlockManager::new(3, 4);
        let mut alloc = manager.empty_allocation();
        alloc.ensure_tokens(5).expect("2 blocks");
        assert_eq!(alloc.ids().len(), 2);
        assert_eq!(alloc.capacity_tokens(), 8);
        let first = alloc.ids()[0] as usize;
        let second = alloc.ids()[1] as usize;
        assert_eq!(alloc.slot(0), Some(first * 4));
        assert_eq!(alloc.slot(5), Some(second * 4 + 1));
        assert_eq!(alloc.slot(8), None);
        assert!(alloc.ensure_tokens(13).is_err(), "needs 4 blocks, pool has 3");
        assert_eq!(alloc.ids().len(), 2, "failed growth keeps what it had");
        assert_eq!(manager.free_blocks(), 1);
        drop(alloc);
        assert_eq!(manager.free_blocks(), 3);
    }
}
