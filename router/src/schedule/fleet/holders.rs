//! The pool's inverted prefix index: for every block hash some worker holds (from its cache
//! events, or remembered as routed there), the workers that hold it. A prompt's cached prefix
//! on a worker starts with its first block, so the workers holding that one hash are the only
//! ones worth asking (`PrefixIndex::cached_tokens`): finding where a prompt is cached costs
//! the holders of its first block, not a scan of the pool.

use std::collections::HashMap;

use crate::schedule::prefixes::BlockHashes;

/// Block hash -> positions (in the pool's worker list) of the workers holding it.
#[derive(Debug, Default, Clone)]
pub struct Holders {
    by_hash: HashMap<u64, Vec<u32>, BlockHashes>,
}

impl Holders {
    /// Worker `slot` starts (`held`) or stops holding `hash`.
    pub fn set(&mut self, hash: u64, slot: usize, held: bool) {
        let slot = slot as u32;
        if held {
            let list = self.by_hash.entry(hash).or_default();
            if !list.contains(&slot) {
                list.push(slot);
            }
        } else if let Some(list) = self.by_hash.get_mut(&hash) {
            list.retain(|s| *s != slot);
            if list.is_empty() {
                self.by_hash.remove(&hash);
            }
        }
    }

    /// The workers holding `hash`.
    pub fn of(&self, hash: u64) -> &[u32] {
        self.by_hash.get(&hash).map_or(&[], |v| v.as_slice())
    }

    pub fn clear(&mut self) {
        self.by_hash.clear();
    }

    /// Hashes held by some worker.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_follow_each_worker_and_forget_empty_hashes() {
        let mut h = Holders::default();
        h.set(7, 0, true);
        h.set(7, 2, true);
        h.set(7, 2, true);
        assert_eq!(h.of(7), &[0, 2]);
        h.set(7, 0, false);
        assert_eq!(h.of(7), &[2]);
        h.set(7, 2, false);
        assert!(h.of(7).is_empty() && h.is_empty());
        h.set(9, 1, false);
        assert!(h.is_empty(), "a hash nobody held stays absent");
    }
}
