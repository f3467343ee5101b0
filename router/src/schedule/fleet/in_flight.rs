//! The prefill pool's prompts in flight as one aggregate: admission asks, for every request,
//! how many prompt tokens are ahead of it in the pool, counting each prompt in flight at most
//! up to the request's own tokens (`policy::tokens_ahead`). Summed over the workers that is
//! work per request that grows with the pool; here it is two Fenwick trees over token counts
//! (how many prompts, and their tokens, at each count), so the sum for any cap costs
//! O(log LIMIT), and a worker's change costs O(its prompts x log LIMIT).

/// Token counts at or above this are counted as `LIMIT - 1` (caps too): exact for prompts and
/// caps below 262,144 tokens.
const LIMIT: usize = 1 << 18;

#[derive(Debug, Default)]
pub struct InFlight {
    /// Fenwick tree (1-based) of (prompt count, token sum) by token count, the two side by
    /// side so that an update touches one cache line per node; empty until the first prompt.
    tree: Vec<[u64; 2]>,
    /// What each worker (by slot) contributes now, sorted and clamped below `LIMIT`.
    by_slot: Vec<Vec<usize>>,
}

impl InFlight {
    fn add(&mut self, value: usize, sign: i64) {
        if self.tree.is_empty() {
            self.tree = vec![[0; 2]; LIMIT + 1];
        }
        let v = value.min(LIMIT - 1);
        let mut i = v + 1;
        while i <= LIMIT {
            let node = &mut self.tree[i];
            node[0] = node[0].wrapping_add_signed(sign);
            node[1] = node[1].wrapping_add_signed(sign * v as i64);
            i += i & i.wrapping_neg();
        }
    }

    /// (prompts, tokens) of the values below `v`.
    fn below(&self, v: usize) -> (u64, u64) {
        let (mut n, mut t) = (0u64, 0u64);
        let mut i = v.min(LIMIT);
        while i > 0 && !self.tree.is_empty() {
            let [count, sum] = self.tree[i];
            n = n.wrapping_add(count);
            t = t.wrapping_add(sum);
            i &= i - 1;
        }
        (n, t)
    }

    /// Worker `slot` now has `values` in flight (replacing what it had). Only the difference
    /// reaches the trees: a worker is re-filed at every booking and refresh, mostly with the
    /// prompts it already had.
    pub fn set(&mut self, slot: usize, values: impl Iterator<Item = usize>) {
        let mut new: Vec<usize> = values.map(|v| v.min(LIMIT - 1)).collect();
        new.sort_unstable();
        if self.by_slot.len() <= slot {
            self.by_slot.resize_with(slot + 1, Vec::new);
        }
        let old = std::mem::take(&mut self.by_slot[slot]);
        if old == new {
            self.by_slot[slot] = old;
            return;
        }
        let (mut a, mut b) = (old.iter().peekable(), new.iter().peekable());
        loop {
            match (a.peek(), b.peek()) {
                (Some(x), Some(y)) if x == y => {
                    a.next();
                    b.next();
                }
                (Some(&&x), Some(&&y)) if x < y => {
                    self.add(x, -1);
                    a.next();
                }
                (_, Some(&&y)) => {
                    self.add(y, 1);
                    b.next();
                }
                (Some(&&x), None) => {
                    self.add(x, -1);
                    a.next();
                }
                (None, None) => break,
            }
        }
        self.by_slot[slot] = new;
    }

    pub fn clear(&mut self) {
        self.tree.clear();
        self.by_slot.clear();
    }

    /// Σ min(value, cap) over every prompt in flight.
    pub fn capped_sum(&self, cap: usize) -> u64 {
        let cap = cap.min(LIMIT - 1);
        let (all, _) = self.below(LIMIT);
        let (n, t) = self.below(cap);
        t + (all - n) * cap as u64
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn capped_sums_match_a_plain_sum_through_changes() {
        let mut f = InFlight::default();
        assert_eq!(f.capped_sum(100), 0);
        let mut plain: HashMap<usize, Vec<usize>> = HashMap::new();
        let mut x = 7u64;
        for step in 0..400 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let slot = (x >> 33) as usize % 9;
            let n = (x >> 20) as usize % 4;
            let mut values: Vec<usize> =
                (0..n).map(|i| ((x >> (i * 7)) as usize % 3000) * (1 + (step % 3) * 100)).collect();
            // Repeated values (two prompts of one length) are counted as often as they occur.
            if step % 5 == 0 {
                values.extend(values.clone());
            }
            f.set(slot, values.iter().copied());
            plain.insert(slot, values);
            for cap in [0, 1, 50, 512, 2999, 300_000] {
                let want: u64 = plain.values().flatten().map(|&v| v.min(cap).min(LIMIT - 1) as u64).sum();
                assert_eq!(f.capped_sum(cap), want, "cap {cap} after step {step}");
            }
        }
        f.clear();
        assert_eq!(f.capped_sum(10), 0);
    }
}
