//! The prefill pool's prompts in flight as one aggregate: admission asks, for every request,
//! how many prompt tokens are ahead of it in the pool, counting each prompt in flight at most
//! up to the request's own tokens (`policy::tokens_ahead`). Summed over the workers that is
//! work per request that grows with the pool; here it is two Fenwick trees over token counts
//! (how many prompts, and their tokens, at each count), so the sum for any cap costs
//! O(log LIMIT), and a worker's change costs O(its prompts x log LIMIT).

use std::collections::HashMap;

/// Token counts at or above this are counted as `LIMIT - 1` (caps too): exact for prompts and
/// caps below 262,144 tokens.
const LIMIT: usize = 1 << 18;

#[derive(Debug, Default)]
pub struct InFlight {
    /// Fenwick trees (1-based) of prompt counts and token sums by token count; empty until
    /// the first prompt.
    count: Vec<u64>,
    sum: Vec<u64>,
    /// What each worker (by slot) contributes now.
    by_slot: HashMap<usize, Vec<usize>>,
}

impl InFlight {
    fn add(&mut self, value: usize, sign: i64) {
        if self.count.is_empty() {
            self.count = vec![0; LIMIT + 1];
            self.sum = vec![0; LIMIT + 1];
        }
        let v = value.min(LIMIT - 1);
        let mut i = v + 1;
        while i <= LIMIT {
            self.count[i] = self.count[i].wrapping_add_signed(sign);
            self.sum[i] = self.sum[i].wrapping_add_signed(sign * v as i64);
            i += i & i.wrapping_neg();
        }
    }

    /// (prompts, tokens) of the values below `v`.
    fn below(&self, v: usize) -> (u64, u64) {
        let (mut n, mut t) = (0u64, 0u64);
        let mut i = v.min(LIMIT);
        while i > 0 && !self.count.is_empty() {
            n = n.wrapping_add(self.count[i]);
            t = t.wrapping_add(self.sum[i]);
            i &= i - 1;
        }
        (n, t)
    }

    /// Worker `slot` now has `values` in flight (replacing what it had).
    pub fn set(&mut self, slot: usize, values: impl Iterator<Item = usize>) {
        let new: Vec<usize> = values.collect();
        let old = if new.is_empty() { self.by_slot.remove(&slot) } else { self.by_slot.insert(slot, new.clone()) };
        for v in old.unwrap_or_default() {
            self.add(v, -1);
        }
        for &v in &new {
            self.add(v, 1);
        }
    }

    pub fn clear(&mut self) {
        self.count.clear();
        self.sum.clear();
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
            let values: Vec<usize> =
                (0..n).map(|i| ((x >> (i * 7)) as usize % 3000) * (1 + (step % 3) * 100)).collect();
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
