//! Content addresses of full KV blocks and the log of what a block pool caches.
//!
//! A full block's hash is chained: SHA-256 over the parent block's hash (or, for the first
//! block, the pool's seed: model fingerprint and block size) and the block's token ids,
//! truncated to 64 bits. Equal hashes therefore mean equal tokens at equal positions after an
//! equal prefix, so a block found by hash holds exactly the K/V a new sequence would compute.
//! The same function runs in the router (which has the tokenizer but no model), so it lives
//! here with no model dependency. The event log lets another process follow a pool's cache
//! (stored / removed hashes, numbered) and notice when it missed events.

use std::collections::VecDeque;

use sha2::{Digest, Sha256};

/// Content address of one full block.
pub type BlockHash = u64;

/// The seed of a pool's first-block hashes: blocks of another model or another block size
/// never match.
pub fn hash_seed(model_fingerprint: u64, block_size: usize) -> u64 {
    let mut h = Sha256::new();
    h.update(b"pd-prefix-v1");
    h.update(model_fingerprint.to_le_bytes());
    h.update((block_size as u64).to_le_bytes());
    truncate(&h.finalize())
}

/// Hash of the block holding `tokens` after the block hashed `parent` (the seed for the first).
pub fn hash_block(parent: u64, tokens: &[u32]) -> BlockHash {
    let mut h = Sha256::new();
    h.update(parent.to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    truncate(&h.finalize())
}

/// Hashes of the full blocks of `tokens`, from hash `start` on, continuing after `known`
/// (the hashes of blocks before `start`, so each hash is computed once per sequence).
pub fn extend_hashes(seed: u64, block_size: usize, tokens: &[u32], known: &mut Vec<BlockHash>) {
    let full = tokens.len() / block_size.max(1);
    for i in known.len()..full {
        let parent = if i == 0 { seed } else { known[i - 1] };
        known.push(hash_block(parent, &tokens[i * block_size..(i + 1) * block_size]));
    }
}

/// Hashes of every full block of `tokens`.
pub fn prefix_hashes(seed: u64, block_size: usize, tokens: &[u32]) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    extend_hashes(seed, block_size, tokens, &mut out);
    out
}

fn truncate(digest: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(b)
}

/// What changed in a pool's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockEventKind {
    /// A block with this hash became available for reuse.
    Stored,
    /// The block with this hash was evicted (its memory reused).
    Removed,
}

/// One numbered change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockEvent {
    /// 1, 2, 3, ... in the order the pool made the changes.
    pub seq: u64,
    pub kind: BlockEventKind,
    pub hash: BlockHash,
}

/// Events since a point, or the news that some were dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventsSince {
    Events(Vec<BlockEvent>),
    /// Events after the asked point were dropped from the log: resynchronise from a snapshot.
    Gap,
}

/// A bounded log of the last `capacity` events.
#[derive(Debug)]
pub(crate) struct EventLog {
    events: VecDeque<BlockEvent>,
    last_seq: u64,
    capacity: usize,
}

impl EventLog {
    pub(crate) fn new(capacity: usize) -> Self {
        EventLog { events: VecDeque::new(), last_seq: 0, capacity: capacity.max(1) }
    }

    pub(crate) fn push(&mut self, kind: BlockEventKind, hash: BlockHash) {
        self.last_seq += 1;
        if self.events.len() == self.capacity {
            self.events.pop_front();
        }
        self.events.push_back(BlockEvent { seq: self.last_seq, kind, hash });
    }

    pub(crate) fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// Events with `seq > after`, at most `limit` of them (the caller asks again for more).
    pub(crate) fn since(&self, after: u64, limit: usize) -> EventsSince {
        if after >= self.last_seq {
            return EventsSince::Events(Vec::new());
        }
        let first = self.events.front().map_or(self.last_seq + 1, |e| e.seq);
        if after + 1 < first {
            return EventsSince::Gap;
        }
        let skip = (after + 1 - first) as usize;
        EventsSince::Events(self.events.iter().skip(skip).take(limit).copied().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_over_parents_and_only_cover_full_blocks() {
        let seed = hash_seed(7, 4);
        let a = prefix_hashes(seed, 4, &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(a.len(), 2, "the ninth token is in a partial block");
        let b = prefix_hashes(seed, 4, &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(a, b);
        let c = prefix_hashes(seed, 4, &[0, 2, 3, 4, 5, 6, 7, 8]);
        assert_ne!(a[0], c[0]);
        assert_ne!(a[1], c[1], "same tokens after a different parent hash differently");
        assert_ne!(prefix_hashes(hash_seed(8, 4), 4, &[1, 2, 3, 4])[0], a[0], "another model");
        let mut known = vec![a[0]];
        extend_hashes(seed, 4, &[1, 2, 3, 4, 5, 6, 7, 8], &mut known);
        assert_eq!(known, a, "extending continues the chain");
    }

    #[test]
    fn the_log_reports_events_after_a_point_and_gaps() {
        let mut log = EventLog::new(3);
        assert_eq!(log.since(0, 10), EventsSince::Events(vec![]));
        for h in 1..=5 {
            log.push(BlockEventKind::Stored, h);
        }
        assert_eq!(log.last_seq(), 5);
        let EventsSince::Events(e) = log.since(2, 10) else { panic!("3..5 are kept") };
        assert_eq!(e.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![3, 4, 5]);
        let EventsSince::Events(e) = log.since(3, 1) else { panic!("kept") };
        assert_eq!(e.iter().map(|e| e.hash).collect::<Vec<_>>(), vec![4]);
        assert_eq!(log.since(1, 10), EventsSince::Gap, "event 2 was dropped");
        assert_eq!(log.since(5, 10), EventsSince::Events(vec![]));
        assert_eq!(log.since(9, 10), EventsSince::Events(vec![]), "a point from another life is not a gap here");
    }
}
