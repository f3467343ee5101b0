//! The prefill worker's load as the router and the autoscaler see it: waiting prompt tokens,
//! queued and running prefills, the oldest queued prefill's age. A `Counted` guard holds one
//! request's share from arrival until it is dropped, so every exit path counts down.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Load gauges of one worker.
#[derive(Debug, Default)]
pub struct Gauges {
    /// Prompt tokens of queued and running prefills not computed yet.
    pub waiting_tokens: AtomicU64,
    /// Prefills waiting for their first turn.
    pub queued: AtomicU32,
    /// Prefills that had a turn and are not answered yet.
    pub running: AtomicU32,
    next_ticket: AtomicU64,
    /// Arrival time of every queued prefill, by ticket (oldest first).
    queued_since: Mutex<BTreeMap<u64, Instant>>,
}

impl Gauges {
    pub fn oldest_queued_age(&self) -> Duration {
        self.queued_since.lock().ok().and_then(|q| q.values().next().map(|t| t.elapsed())).unwrap_or_default()
    }

    /// Prefills accepted and not yet answered (queued or running).
    pub fn in_flight(&self) -> u32 {
        self.queued.load(Ordering::Relaxed) + self.running.load(Ordering::Relaxed)
    }
}

/// Counts a request in the gauges from arrival until it is dropped.
#[derive(Debug)]
pub struct Counted {
    gauges: Arc<Gauges>,
    /// Prompt tokens not computed yet.
    tokens: u64,
    ticket: u64,
    running: bool,
}

impl Counted {
    pub fn new(gauges: Arc<Gauges>, tokens: u64, arrived: Instant) -> Self {
        let ticket = gauges.next_ticket.fetch_add(1, Ordering::Relaxed);
        gauges.waiting_tokens.fetch_add(tokens, Ordering::Relaxed);
        gauges.queued.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut q) = gauges.queued_since.lock() {
            q.insert(ticket, arrived);
        }
        Counted { gauges, tokens, ticket, running: false }
    }

    /// Moves the request from queued to running (idempotent).
    pub fn start_running(&mut self) {
        if self.running {
            return;
        }
        self.leave_queue();
        self.gauges.running.fetch_add(1, Ordering::Relaxed);
        self.running = true;
    }

    /// `tokens` more prompt tokens are computed.
    pub fn advance(&mut self, tokens: u64) {
        let n = tokens.min(self.tokens);
        self.tokens -= n;
        self.gauges.waiting_tokens.fetch_sub(n, Ordering::Relaxed);
    }

    fn leave_queue(&self) {
        self.gauges.queued.fetch_sub(1, Ordering::Relaxed);
        if let Ok(mut q) = self.gauges.queued_since.lock() {
            q.remove(&self.ticket);
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.gauges.waiting_tokens.fetch_sub(self.tokens, Ordering::Relaxed);
        if self.running {
            self.gauges.running.fetch_sub(1, Ordering::Relaxed);
        } else {
            self.leave_queue();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_counts_while_queued_then_running_and_leaves_no_trace() {
        let gauges = Arc::new(Gauges::default());
        let mut a = Counted::new(gauges.clone(), 100, Instant::now() - Duration::from_millis(50));
        let b = Counted::new(gauges.clone(), 7, Instant::now());
        assert_eq!((gauges.waiting_tokens.load(Ordering::Relaxed), gauges.queued.load(Ordering::Relaxed)), (107, 2));
        assert!(gauges.oldest_queued_age() >= Duration::from_millis(50));
        a.start_running();
        a.start_running();
        a.advance(60);
        assert_eq!(gauges.waiting_tokens.load(Ordering::Relaxed), 47, "computed tokens leave the gauge");
        assert_eq!((gauges.queued.load(Ordering::Relaxed), gauges.running.load(Ordering::Relaxed)), (1, 1));
        assert!(gauges.oldest_queued_age() < Duration::from_millis(50));
        drop(a);
        drop(b);
        assert_eq!((gauges.waiting_tokens.load(Ordering::Relaxed), gauges.in_flight()), (0, 0));
        assert_eq!(gauges.oldest_queued_age(), Duration::ZERO);
    }
}
