//! The event queue of virtual time: a 4-ary min-heap on one `u128` key (instant in ns, then
//! the order of scheduling), so each event's key is one comparison and a pop walks half the
//! levels of a binary heap. An hour of a 1,000-worker fleet pops a hundred million events:
//! `std`'s `BinaryHeap` of `Reverse` tuples was a tenth of the run.

/// Children per node.
const ARITY: usize = 4;

#[derive(Debug)]
pub(super) struct Queue<T> {
    heap: Vec<(u128, T)>,
}

impl<T: Copy> Queue<T> {
    pub fn new() -> Self {
        Queue { heap: Vec::new() }
    }

    /// The key of an event at `t_ns`, scheduled `seq`-th: earlier first, then in the order
    /// of scheduling.
    pub fn key(t_ns: u64, seq: u64) -> u128 {
        (u128::from(t_ns) << 64) | u128::from(seq)
    }

    /// The instant (ns) of the next event.
    pub fn next_at(&self) -> Option<u64> {
        self.heap.first().map(|&(k, _)| (k >> 64) as u64)
    }

    pub fn push(&mut self, key: u128, value: T) {
        let mut i = self.heap.len();
        self.heap.push((key, value));
        while i > 0 {
            let parent = (i - 1) / ARITY;
            if self.heap[parent].0 <= key {
                break;
            }
            self.heap[i] = self.heap[parent];
            i = parent;
        }
        self.heap[i] = (key, value);
    }

    /// The next event: (instant in ns, value).
    pub fn pop(&mut self) -> Option<(u64, T)> {
        let last = self.heap.pop()?;
        let Some(&top) = self.heap.first() else {
            return Some(((last.0 >> 64) as u64, last.1));
        };
        // The last entry sinks from the root into the hole the top leaves.
        let n = self.heap.len();
        let mut i = 0;
        loop {
            let first = ARITY * i + 1;
            if first >= n {
                break;
            }
            let mut child = first;
            for c in first + 1..(first + ARITY).min(n) {
                if self.heap[c].0 < self.heap[child].0 {
                    child = c;
                }
            }
            if self.heap[child].0 >= last.0 {
                break;
            }
            self.heap[i] = self.heap[child];
            i = child;
        }
        self.heap[i] = last;
        Some(((top.0 >> 64) as u64, top.1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;

    #[test]
    fn pops_in_the_order_of_a_binary_heap_of_instant_then_sequence() {
        let (mut queue, mut reference) = (Queue::new(), BinaryHeap::new());
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let (mut now, mut seq) = (0u64, 0u64);
        for _ in 0..50_000 {
            // Pushes ahead of the clock (many at the same instant), pops in bursts.
            for _ in 0..next(4) {
                seq += 1;
                let t = now + next(8) * 1000;
                queue.push(Queue::<u64>::key(t, seq), seq * 3);
                reference.push(Reverse((t, seq, seq * 3)));
            }
            for _ in 0..next(4) {
                let want = reference.pop().map(|Reverse((t, _, v))| (t, v));
                assert_eq!(queue.next_at(), want.map(|(t, _)| t));
                assert_eq!(queue.pop(), want);
                if let Some((t, _)) = want {
                    now = t;
                }
            }
        }
        while let Some(Reverse((t, _, v))) = reference.pop() {
            assert_eq!(queue.pop(), Some((t, v)));
        }
        assert_eq!(queue.pop(), None);
    }
}
