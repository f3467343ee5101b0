//! Who runs the next prefill chunk on this worker's engine. Prompts are prefilled chunk by
//! chunk, and between chunks the engine goes to the waiting prompt with the fewest tokens
//! left (shortest remaining first): a short prompt that arrives while a long document is
//! being prefilled waits for one chunk, not the whole document. A prompt that has waited
//! longer than `max_wait` for its turn goes first (longest waiting first), so a long prompt
//! still gets a chunk at least every `max_wait` under a stream of short ones.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

#[derive(Debug)]
struct Waiter {
    remaining: usize,
    /// When this turn was asked for.
    since: Instant,
    wake: oneshot::Sender<()>,
}

#[derive(Debug, Default)]
struct State {
    busy: bool,
    waiting: Vec<Waiter>,
}

/// The engine's turns.
#[derive(Debug)]
pub struct ChunkGate {
    state: Mutex<State>,
    max_wait: Duration,
}

/// The engine is this holder's until dropped.
#[derive(Debug)]
pub struct Turn {
    gate: Arc<ChunkGate>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.gate.pass_on();
    }
}

/// A wait in progress; if it is dropped after being woken but before taking the turn (its
/// request was cancelled at that moment), the turn moves on instead of being lost.
struct Waiting {
    gate: Arc<ChunkGate>,
    rx: oneshot::Receiver<()>,
    settled: bool,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if !self.settled {
            self.rx.close(); // later wake-ups fail and skip this waiter
            if self.rx.try_recv().is_ok() {
                self.gate.pass_on();
            }
        }
    }
}

impl ChunkGate {
    pub fn new(max_wait: Duration) -> Arc<Self> {
        Arc::new(ChunkGate { state: Mutex::new(State::default()), max_wait })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update is a single push, remove or flag write: no invariant spans a panic.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for the engine, for a prompt with `remaining` tokens still to prefill that asks
    /// for its turn at `since` (now, except in tests). Cancel-safe: a dropped wait gives its
    /// place up.
    pub async fn turn(self: &Arc<Self>, remaining: usize, since: Instant) -> Turn {
        let rx = {
            let mut state = self.lock();
            if !state.busy {
                state.busy = true;
                return Turn { gate: self.clone() };
            }
            let (wake, rx) = oneshot::channel();
            state.waiting.push(Waiter { remaining, since, wake });
            rx
        };
        let mut waiting = Waiting { gate: self.clone(), rx, settled: false };
        let woken = (&mut waiting.rx).await;
        waiting.settled = true;
        match woken {
            Ok(()) => Turn { gate: self.clone() },
            // A waiter's sender is only dropped unsent once it was removed for being closed,
            // which a live wait is not; queue again rather than run without the turn.
            Err(_) => Box::pin(self.turn(remaining, since)).await,
        }
    }

    /// The next waiter: anyone waiting longer than `max_wait` (longest first), else the
    /// fewest tokens left (earliest asked on ties).
    fn next(&self, waiting: &[Waiter]) -> Option<usize> {
        let now = Instant::now();
        let overdue = waiting
            .iter()
            .enumerate()
            .filter(|(_, w)| now.duration_since(w.since) > self.max_wait)
            .min_by_key(|(_, w)| w.since)
            .map(|(i, _)| i);
        overdue.or_else(|| waiting.iter().enumerate().min_by_key(|(_, w)| (w.remaining, w.since)).map(|(i, _)| i))
    }

    fn pass_on(&self) {
        let mut state = self.lock();
        while let Some(i) = self.next(&state.waiting) {
            let waiter = state.waiting.swap_remove(i);
            if waiter.wake.send(()).is_ok() {
                return; // still busy: the turn moved to that waiter
            }
            // That waiter was cancelled: try the next one.
        }
        state.busy = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Starts a waiter and returns a receiver that fires when it gets its turn (holding it
    /// until `release` fires).
    fn waiter(
        gate: &Arc<ChunkGate>,
        remaining: usize,
        since: Instant,
        order: &Arc<Mutex<Vec<usize>>>,
    ) -> tokio::task::JoinHandle<()> {
        let (gate, order) = (gate.clone(), order.clone());
        tokio::spawn(async move {
            let _turn = gate.turn(remaining, since).await;
            order.lock().expect("order").push(remaining);
        })
    }

    #[tokio::test]
    async fn shortest_remaining_goes_first_and_overdue_prompts_are_not_starved() {
        let gate = ChunkGate::new(Duration::from_secs(5));
        let order = Arc::new(Mutex::new(Vec::new()));
        let now = Instant::now();
        let held = gate.turn(2048, now).await;
        let tasks =
            vec![waiter(&gate, 1536, now, &order), waiter(&gate, 64, now, &order), waiter(&gate, 300, now, &order)];
        tokio::time::sleep(Duration::from_millis(20)).await;
        // A prompt that has waited for its turn longer than max_wait: it goes first.
        let old = waiter(&gate, 4000, now - Duration::from_secs(10), &order);
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(held);
        for t in tasks.into_iter().chain([old]) {
            t.await.expect("task");
        }
        assert_eq!(*order.lock().expect("order"), vec![4000, 64, 300, 1536]);
        // Idle again: the next turn is immediate.
        let t = tokio::time::timeout(Duration::from_millis(100), gate.turn(10, Instant::now())).await;
        assert!(t.is_ok());
    }

    #[tokio::test]
    async fn a_cancelled_wait_gives_its_place_up() {
        let gate = ChunkGate::new(Duration::from_secs(5));
        let held = gate.turn(100, Instant::now()).await;
        let cancelled = tokio::spawn({
            let gate = gate.clone();
            async move {
                let _t = gate.turn(1, Instant::now()).await;
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        cancelled.abort();
        let _ = cancelled.await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let next = waiter(&gate, 500, Instant::now(), &order);
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(held);
        tokio::time::timeout(Duration::from_secs(1), next).await.expect("the live waiter runs").expect("task");
        assert_eq!(*order.lock().expect("order"), vec![500]);
    }
}
