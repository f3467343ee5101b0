//! Rates the admission estimate reads: how fast streams end, and how fast the top-priority
//! queue is served while it holds requests. Plain data on instants the caller passes in.
//! Both are read for every request, so neither walks its samples: instants are kept in order
//! (a caller's instant older than the last one recorded counts as the last one), the window
//! is found by binary search, and busy spans carry a running total.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Events remembered for a rate, over how long, and how many make a rate.
const RATE_SAMPLES: usize = 256;
const RATE_WINDOW: Duration = Duration::from_secs(5);
const RATE_MIN_SAMPLES: usize = 3;

/// Shortest time with a non-empty queue in the window that makes a service rate.
const SERVICE_MIN_BUSY: Duration = Duration::from_millis(500);

/// Recent instants of one kind of event, in order, for its rate.
#[derive(Debug, Default)]
pub struct Events(VecDeque<Instant>);

impl Events {
    pub fn record(&mut self, at: Instant) {
        let at = self.0.back().map_or(at, |&last| at.max(last));
        self.0.push_back(at);
        if self.0.len() > RATE_SAMPLES {
            self.0.pop_front();
        }
    }

    /// Events within the last `RATE_WINDOW` (after `now - RATE_WINDOW`).
    fn recent(&self, now: Instant) -> usize {
        match now.checked_sub(RATE_WINDOW) {
            Some(from) => self.0.len() - self.0.partition_point(|t| *t <= from),
            None => self.0.len(),
        }
    }

    /// Events per second over the last `RATE_WINDOW`; None when too few happened in it to
    /// tell (a lightly loaded cluster, or one that just started).
    pub fn per_s(&self, now: Instant) -> Option<f64> {
        let n = self.recent(now);
        (n >= RATE_MIN_SAMPLES).then(|| n as f64 / RATE_WINDOW.as_secs_f64())
    }
}

/// How fast the queue is served while it holds requests: grants of requests that had to wait,
/// over the time the queue was not empty. Grants per second alone would follow arrivals under
/// a light load (a burst after a quiet minute would look like a queue served at 0.2/s and be
/// refused); while requests wait, grants come as fast as capacity frees. Only the top
/// priority counts: batch requests are held back on purpose while interactive ones flow.
#[derive(Debug, Default)]
pub struct Service {
    pub grants: Events,
    /// Closed spans of time with a non-empty queue, oldest first, each with the busy time of
    /// all spans up to its end (since the first ever); and the open one.
    busy: VecDeque<(Instant, Instant, Duration)>,
    since: Option<Instant>,
}

impl Service {
    /// Notes whether the queue holds requests now (called after every change to it).
    pub fn note(&mut self, waiting: bool, now: Instant) {
        match (waiting, self.since) {
            (true, None) => self.since = Some(now),
            (false, Some(start)) => {
                let (start, before) = match self.busy.back() {
                    Some(&(_, end, total)) => (start.max(end), total),
                    None => (start, Duration::ZERO),
                };
                let now = now.max(start);
                self.busy.push_back((start, now, before + (now - start)));
                if self.busy.len() > RATE_SAMPLES {
                    self.busy.pop_front();
                }
                self.since = None;
            }
            _ => {}
        }
    }

    /// Time the queue held requests within the last `RATE_WINDOW`: the spans ending after
    /// its start (the first of them cut at the start), and the open one.
    fn busy_within(&self, now: Instant) -> Duration {
        let from = now.checked_sub(RATE_WINDOW).unwrap_or(now);
        let open = self.since.map_or(Duration::ZERO, |s| now.saturating_duration_since(s.max(from)));
        let first = self.busy.partition_point(|&(_, end, _)| end <= from);
        let Some(&(start, end, total)) = self.busy.get(first) else { return open };
        let last_total = self.busy.back().map_or(total, |&(.., t)| t);
        end.saturating_duration_since(start.max(from)) + (last_total - total) + open
    }

    /// Grants per second of busy time; None when too few grants or too little busy time in
    /// the window to tell.
    pub fn per_s(&self, now: Instant) -> Option<f64> {
        let n = self.grants.recent(now);
        let busy = self.busy_within(now);
        (n >= RATE_MIN_SAMPLES && busy >= SERVICE_MIN_BUSY).then(|| n as f64 / busy.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_needs_enough_recent_events_and_forgets_old_ones() {
        let start = Instant::now();
        let mut events = Events::default();
        events.record(start);
        events.record(start + Duration::from_millis(100));
        assert_eq!(events.per_s(start + Duration::from_millis(200)), None, "two events tell no rate");
        events.record(start + Duration::from_millis(200));
        let rate = events.per_s(start + Duration::from_millis(300)).expect("three events in the window");
        assert!((rate - 3.0 / RATE_WINDOW.as_secs_f64()).abs() < 1e-9, "{rate}");
        // Past the window the old events no longer count.
        assert_eq!(events.per_s(start + RATE_WINDOW + Duration::from_millis(150)), None);
        for i in 0..RATE_SAMPLES + 10 {
            events.record(start + Duration::from_micros(i as u64));
        }
        assert_eq!(events.0.len(), RATE_SAMPLES, "bounded memory");
    }

    #[test]
    fn the_binary_searched_window_and_running_totals_agree_with_walking_every_sample() {
        let t0 = Instant::now();
        let (mut service, mut spans, mut events) = (Service::default(), Vec::new(), Vec::new());
        let mut x: u64 = 7;
        let mut draw = |n: u64| {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (x >> 33) % n
        };
        let mut t = Duration::ZERO;
        for _ in 0..2_000 {
            t += Duration::from_millis(draw(200));
            let waiting = draw(2) == 0;
            if waiting != service.since.is_some() {
                if !waiting {
                    spans.push((service.since.expect("open"), t0 + t));
                }
                service.note(waiting, t0 + t);
            }
            if draw(3) == 0 {
                service.grants.record(t0 + t);
                events.push(t0 + t);
            }
            let now = t0 + t + Duration::from_millis(draw(50));
            let from = now.checked_sub(RATE_WINDOW).unwrap_or(now);
            let kept = &spans[spans.len().saturating_sub(RATE_SAMPLES)..];
            let open = service.since.map(|s| (s, now));
            let walked: Duration =
                kept.iter().copied().chain(open).map(|(a, b)| b.saturating_duration_since(a.max(from))).sum();
            assert_eq!(service.busy_within(now), walked);
            let kept = &events[events.len().saturating_sub(RATE_SAMPLES)..];
            let recent = kept.iter().filter(|e| now.saturating_duration_since(**e) < RATE_WINDOW).count();
            assert_eq!(service.grants.recent(now), recent);
        }
    }

    #[test]
    fn the_service_rate_counts_grants_over_the_time_the_queue_held_requests() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut service = Service::default();
        // Three grants, but the queue never held anything long: no rate (a light load).
        for ms in [0, 1000, 2000] {
            service.note(true, at(ms));
            service.grants.record(at(ms + 10));
            service.note(false, at(ms + 10));
        }
        assert_eq!(service.per_s(at(2100)), None, "30 ms of queue tells nothing");
        // A backlog of one second served by 5 grants: 5 per second of busy time (the window
        // holds 8 grants over 1.03 s).
        service.note(true, at(3000));
        for ms in [3200, 3400, 3600, 3800, 4000] {
            service.grants.record(at(ms));
        }
        let rate = service.per_s(at(4000)).expect("a busy second");
        assert!((rate - 8.0 / 1.03).abs() < 0.1, "{rate}");
        service.note(false, at(4000));
        // Long after, the window holds nothing.
        assert_eq!(service.per_s(at(4000) + RATE_WINDOW + Duration::from_secs(1)), None);
    }
}
