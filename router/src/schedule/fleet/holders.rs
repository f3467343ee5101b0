//! The pool's inverted prefix index: for every block hash some worker holds (from its cache
//! events, or the first block of a prefix remembered as routed there), the workers that hold
//! it. A prompt's cached prefix
//! on a worker starts with its first block, so the workers holding that one hash are the only
//! ones worth asking (`PrefixIndex::cached_tokens`): finding where a prompt is cached costs
//! the holders of its first block, not a scan of the pool.

use std::collections::HashMap;

use crate::schedule::prefixes::BlockHashes;

/// The workers holding one hash: nearly always one (a prompt's blocks are routed to one
/// worker of a pool), kept inline; more in a vector.
#[derive(Debug, Clone)]
enum Slots {
    One([u32; 1]),
    Many(Vec<u32>),
}

impl Slots {
    fn as_slice(&self) -> &[u32] {
        match self {
            Slots::One(s) => s,
            Slots::Many(v) => v,
        }
    }
}

/// Block hash -> positions (in the pool's worker list) of the workers holding it.
#[derive(Debug, Default, Clone)]
pub struct Holders {
    by_hash: HashMap<u64, Slots, BlockHashes>,
}

impl Holders {
    /// Worker `slot` starts (`held`) or stops holding `hash`.
    pub fn set(&mut self, hash: u64, slot: usize, held: bool) {
        let slot = slot as u32;
        if held {
            let slots = self.by_hash.entry(hash).or_insert(Slots::One([slot]));
            match slots {
                Slots::One([s]) if *s != slot => *slots = Slots::Many(vec![*s, slot]),
                Slots::Many(v) if !v.contains(&slot) => v.push(slot),
                _ => {}
            }
        } else if let Some(slots) = self.by_hash.get_mut(&hash) {
            let empty = match slots {
                Slots::One([s]) => *s == slot,
                Slots::Many(v) => {
                    v.retain(|s| *s != slot);
                    v.is_empty()
                }
            };
            if empty {
                self.by_hash.remove(&hash);
            }
        }
    }

    /// The workers holding `hash`.
    pub fn of(&self, hash: u64) -> &[u32] {
        self.by_hash.get(&hash).map_or(&[], Slots::as_slice)
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
        h.set(5, 1, true);
        h.set(5, 3, false);
        assert_eq!(h.of(5), &[1], "another worker letting go changes nothing");
        h.set(5, 1, false);
        assert!(h.is_empty());
    }
}
