//! The scheduler's state and its rules for each event, with no clock, lock, channel or I/O:
//! every event (a request submitted or withdrawn, a refresh, a decode reservation confirmed,
//! a prefill done, a stream released) is a method that takes `now`, so a test replays a
//! sequence of events at chosen instants and checks what was granted. `Scheduler` (mod.rs)
//! owns one behind its lock and delivers the grants; `R` is how a grant reaches its waiter.
//!
//! What each dispatched request holds is a `Booking` keyed by its sequence number: the decode
//! worker's blocks and batch slot, the prefill worker's slot, and a long prompt's turn. The
//! workers' states change only through their booking methods (`fleet`).

use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_proto::v1 as pb;

use super::fleet::Fleet;
use super::policy::{self, Place, Waiting};
use super::prefixes::Prompt;
use super::rates::{Events, Service};
use super::ScheduleConfig;
use crate::classes::{Class, Classes};
use crate::error::RouterError;

/// An admitted request that waits this many times its class's queue age fails with 503.
pub const STALL_FACTOR: u32 = 4;

/// A waiting request's prompt and its waiter.
#[derive(Debug)]
pub struct Entry<R> {
    pub prompt: Arc<Prompt>,
    pub reply: R,
}

/// Where a dispatched request goes (`Scheduler` adds the ticket).
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// The request's sequence number: its booking.
    pub seq: u64,
    pub decode: String,
    /// None: prefilled on the decode worker.
    pub prefill: Option<String>,
    pub place: Place,
    /// Time spent in the router's queue.
    pub waited: Duration,
    /// The chosen prefill worker's estimated wait at dispatch (None without a pool).
    pub prefill_wait: Option<Duration>,
    /// Prompt tokens the chosen workers are expected to hold in their prefix caches.
    pub decode_cached: usize,
    pub prefill_cached: usize,
}

/// An admitted request: its sequence number, and how long it may wait for a grant before it
/// counts as stalled (`STALL_FACTOR` times its class's queue age, and a long prompt's
/// patience).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    pub seq: u64,
    pub stall_after: Duration,
}

/// What one dispatched request holds until it is released.
#[derive(Debug, Clone)]
struct Booking {
    decode: String,
    blocks: u32,
    itl: Duration,
    /// The decode worker confirmed the reservation: its own free-block count includes it.
    opened: bool,
    /// Its prefill worker, until the prompt is prefilled.
    prefill: Option<String>,
    /// Counted in `long_prefills` until its prefill ends.
    long: bool,
}

/// The scheduler's queues, its view of the workers, and what each dispatched request holds.
#[derive(Debug)]
pub struct State<R> {
    config: ScheduleConfig,
    /// Whether a prefill pool is configured (else the decode workers prefill every prompt).
    prefill_pool: bool,
    top_priority: i32,
    /// The tightest TTFT SLO of any class (what makes a prompt long).
    tightest_ttft: Duration,
    waiting: Vec<Waiting<Entry<R>>>,
    /// Queued prompt tokens per class index.
    queued_tokens: Vec<u64>,
    pub(super) fleet: Fleet,
    seq: u64,
    bookings: FxHashMap<u64, Booking>,
    /// When streams last ended (gave their decode capacity back): how fast a queue held by
    /// the decode side drains.
    released: Events,
    /// How fast the queue of top-priority requests is served while it holds any.
    service: Service,
    /// Long prompts (`policy::is_long`) granted a prefill worker and not yet prefilled.
    long_prefills: usize,
}

impl<R> State<R> {
    pub fn new(classes: &Classes, config: ScheduleConfig, prefill_pool: bool) -> Self {
        let all = classes.all();
        let fleet = Fleet::new(config.prior_tokens_per_s, config.step_budget);
        State {
            config,
            prefill_pool,
            top_priority: all.iter().map(|c| c.spec.priority).max().unwrap_or(0),
            tightest_ttft: all.iter().map(|c| c.ttft_slo()).min().unwrap_or(Duration::MAX),
            waiting: Vec::new(),
            queued_tokens: vec![0; all.len()],
            fleet,
            seq: 0,
            bookings: FxHashMap::default(),
            released: Events::default(),
            service: Service::default(),
            long_prefills: 0,
        }
    }

    /// Admits a request of `class` for `prompt` into the queue, or refuses it (429 with
    /// Retry-After: its class's queue budget is spent, or its estimated wait exceeds what its
    /// TTFT SLO allows; 503: no decode worker). Dispatch follows separately (`dispatch`).
    pub fn submit(
        &mut self,
        class: &Class,
        prompt: Arc<Prompt>,
        max_tokens: usize,
        reply: R,
        now: Instant,
    ) -> Result<Admitted, RouterError> {
        let tokens = prompt.len();
        if self.fleet.decode().is_empty() {
            return Err(RouterError::NoWorker("decode"));
        }
        // What must be computed: a cached prefix costs no prefill time.
        let work = tokens - self.fleet.expected_cached(&prompt, now).min(tokens);
        let (_, rate) = self.fleet.prefill_pool();
        // A long prompt is prefilled a few at a time (`dispatch`); one that waits for its
        // turn holds back only other long ones, not this request if it is short.
        let own = policy::estimated_wait(0, work, rate);
        let long = policy::is_long(own, self.tightest_ttft.min(class.ttft_slo()));
        let priority = class.spec.priority;
        let ahead_of_me = self.waiting.iter().filter(|w| w.priority >= priority && (long || !w.long));
        let (queued_ahead, oldest_ahead) =
            ahead_of_me.fold((0, Duration::ZERO), |(n, o), w| (n + 1, o.max(now.saturating_duration_since(w.arrived))));
        let itl = Duration::from_millis(class.spec.itl_slo_ms);
        let need = self.fleet.decode().first().map_or(0, |d| d.blocks_for(tokens + max_tokens));
        let top = priority >= self.top_priority;
        let view = policy::QueueView {
            tokens_ahead: policy::tokens_ahead(&self.waiting, priority, |cap| self.fleet.prefill_in_flight(cap), work),
            tokens_per_s: rate,
            queued_ahead,
            oldest_ahead,
            decode_room: self.fleet.best_decode(need, itl, now).is_some(),
            prefill_room: !self.prefill_pool || self.fleet.prefill_room(top),
            released_per_s: self.released.per_s(now),
            served_per_s: self.service.per_s(now),
        };
        let estimate = policy::estimate_wait(&view);
        tracing::debug!(
            class = %class.name,
            tokens,
            queued_ahead,
            prefill_wait_ms = estimate.prefill.as_millis() as u64,
            decode_wait_ms = estimate.decode.as_millis() as u64,
            backlog_ms = estimate.backlog.as_millis() as u64,
            oldest_ms = estimate.oldest.as_millis() as u64,
            "admission estimate"
        );
        let oldest_of_class = self
            .waiting
            .iter()
            .filter(|w| w.class == class.index && (long || !w.long))
            .map(|w| now.saturating_duration_since(w.arrived))
            .max()
            .unwrap_or_default();
        let budget = policy::Budget {
            queued_tokens: self.queued_tokens[class.index],
            max_queued_tokens: class.spec.max_queued_tokens,
            ttft_slo: class.ttft_slo(),
            oldest_waiting: oldest_of_class,
            max_queue_age: class.max_queue_age(),
        };
        policy::admit(&class.name, tokens, budget, estimate.total(), own, rate)
            .map_err(|r| RouterError::Overloaded { message: r.message, retry_after_s: r.retry_after_s })?;
        // A long prompt may wait its turn (about its own prefill) on top of the queue age.
        let patience = if long { own * 2 } else { Duration::ZERO };
        let entry = Entry { prompt, reply };
        Ok(self.enqueue(class, entry, work, max_tokens, now + class.ttft_slo(), long, patience, now))
    }

    /// Queues a request whose decode worker was lost mid-stream (`prompt`: its prompt and the
    /// tokens already sent) without admission control: it was admitted once. It goes first
    /// among its priority. No decode worker outside quarantine (the lost one is in it): NoWorker
    /// at once.
    pub fn submit_migrated(
        &mut self,
        class: &Class,
        prompt: Arc<Prompt>,
        max_tokens: usize,
        reply: R,
        now: Instant,
    ) -> Result<Admitted, RouterError> {
        if self.fleet.healthy_decode(now).next().is_none() {
            return Err(RouterError::NoWorker("decode"));
        }
        let work = prompt.len() - self.fleet.expected_cached(&prompt, now).min(prompt.len());
        Ok(self.enqueue(class, Entry { prompt, reply }, work, max_tokens, now, false, Duration::ZERO, now))
    }

    /// Puts an admitted request in the queue with TTFT deadline `deadline` (its place among
    /// its priority); `work`: its prompt tokens less what the best-placed worker caches.
    /// `long`: a long prompt (`policy::is_long`), which may wait `patience` longer than the
    /// class's queue age before it stalls.
    #[allow(clippy::too_many_arguments)]
    fn enqueue(
        &mut self,
        class: &Class,
        entry: Entry<R>,
        work: usize,
        max_tokens: usize,
        deadline: Instant,
        long: bool,
        patience: Duration,
        now: Instant,
    ) -> Admitted {
        let tokens = entry.prompt.len();
        self.seq += 1;
        let seq = self.seq;
        self.waiting.push(Waiting {
            seq,
            class: class.index,
            priority: class.spec.priority,
            tokens,
            work,
            max_tokens,
            arrived: now,
            deadline,
            itl_slo: Duration::from_millis(class.spec.itl_slo_ms),
            long,
            reply: entry,
        });
        self.queued_tokens[class.index] += tokens as u64;
        self.note_queue(now);
        Admitted { seq, stall_after: (class.max_queue_age() + patience) * STALL_FACTOR }
    }

    /// Grants waiting requests, best first, while the head fits somewhere: each with its
    /// booking made. Long prompts go while fewer than the cap of them prefill
    /// (`long_prefills_per_worker` per prefill worker); at the cap, shorter requests pass them.
    /// A waiter that is gone gives its booking back with `release(seq, false, now)`.
    pub fn dispatch(&mut self, now: Instant) -> Vec<(R, Placement)> {
        let cap = self.config.long_prefills_per_worker.max(1) * self.fleet.prefill().len().max(1);
        let mut granted = Vec::new();
        while let Some(i) = policy::next(&self.waiting, self.long_prefills < cap) {
            let Some(placement) = self.place(i, now) else { break };
            let w = self.waiting.swap_remove(i);
            if w.long && placement.prefill.is_some() {
                self.long_prefills += 1;
                if let Some(b) = self.bookings.get_mut(&w.seq) {
                    b.long = true;
                }
            }
            self.queued_tokens[w.class] -= w.tokens as u64;
            // A grant at its own arrival says nothing about how fast a queue is served.
            if w.priority >= self.top_priority && now.saturating_duration_since(w.arrived) >= Duration::from_millis(1) {
                self.service.grants.record(now);
            }
            granted.push((w.reply.reply, placement));
        }
        self.note_queue(now);
        granted
    }

    /// Places waiting request `i` if a decode worker has room and its prompt has a place, and
    /// books the capacity it takes.
    fn place(&mut self, i: usize, now: Instant) -> Option<Placement> {
        let w = &self.waiting[i];
        let cfg = &self.config;
        let prompt = w.reply.prompt.clone();
        let probe = self.fleet.best_decode(0, w.itl_slo, now)?;
        // The decode worker reserves the prompt and the whole output.
        let blocks = probe.blocks_for(w.tokens + w.max_tokens);
        let (decode, decode_cached) = self.fleet.choose_decode(blocks, w.itl_slo, &prompt, cfg.prefix_weight, now)?;
        let (pool_wait, _) = self.fleet.prefill_pool();
        let place = policy::place(&cfg.local, w.tokens, w.max_tokens, pool_wait, decode.free_fraction());
        let prefill = if place.is_local() {
            None
        } else {
            let top = w.priority >= self.top_priority;
            let (p, wait, cached) = self.fleet.choose_prefill(top, &prompt, now)?;
            Some((p.addr.clone(), wait, cached))
        };
        let (decode_addr, seq, tokens, itl) = (decode.addr.clone(), w.seq, w.tokens, w.itl_slo);
        let waited = now.saturating_duration_since(w.arrived);
        if let Some(d) = self.fleet.decode_at(&decode_addr) {
            tracing::debug!(
                waited_ms = waited.as_millis() as u64,
                step_ms = d.load.step_ms,
                predicted_step_ms = d.predicted_step_ms(),
                running = d.load.running_sequences,
                ours = d.ours(),
                "granted"
            );
        }
        self.fleet.book_decode(&decode_addr, blocks, itl, &prompt, now);
        if let Some((addr, _, cached)) = &prefill {
            self.fleet.book_prefill(addr, seq, tokens - (*cached).min(tokens), &prompt, now);
        }
        let booking = Booking {
            decode: decode_addr.clone(),
            blocks,
            itl,
            opened: false,
            prefill: prefill.as_ref().map(|(a, ..)| a.clone()),
            long: false,
        };
        self.bookings.insert(seq, booking);
        Some(Placement {
            seq,
            decode: decode_addr,
            prefill: prefill.as_ref().map(|(a, ..)| a.clone()),
            place,
            waited,
            prefill_wait: prefill.as_ref().map(|(_, w, _)| *w).or(pool_wait),
            decode_cached,
            prefill_cached: prefill.map_or(0, |(.., c)| c),
        })
    }

    /// Request `seq`'s decode worker reserved its KV: the worker's own free-block count now
    /// includes it.
    pub fn decode_opened(&mut self, seq: u64) {
        if let Some(b) = self.bookings.get_mut(&seq) {
            if !std::mem::replace(&mut b.opened, true) {
                self.fleet.opened_decode(&b.decode, b.blocks);
            }
        }
    }

    /// Request `seq`'s prompt is prefilled (or its prefill failed): its prefill slot, and a
    /// long prompt's turn, are free.
    pub fn prefill_done(&mut self, seq: u64) {
        let Some(b) = self.bookings.get_mut(&seq) else { return };
        if std::mem::take(&mut b.long) {
            self.long_prefills = self.long_prefills.saturating_sub(1);
        }
        if let Some(addr) = b.prefill.take() {
            self.fleet.unbook_prefill(&addr, seq);
        }
    }

    /// Request `seq` gives back everything it holds; `ended`: a stream that ran (its end
    /// counts in the rate streams end at).
    pub fn release(&mut self, seq: u64, ended: bool, now: Instant) {
        self.prefill_done(seq);
        let Some(b) = self.bookings.remove(&seq) else { return };
        if ended {
            self.released.record(now);
        }
        self.fleet.unbook_decode(&b.decode, b.blocks, b.itl, b.opened);
    }

    /// Removes a waiting request (its client left, or it stalled); true if it was waiting.
    pub fn withdraw(&mut self, seq: u64, now: Instant) -> bool {
        let Some(i) = self.waiting.iter().position(|w| w.seq == seq) else { return false };
        let w = self.waiting.swap_remove(i);
        self.queued_tokens[w.class] -= w.tokens as u64;
        self.note_queue(now);
        true
    }

    /// Takes a refresh's loads. With no decode worker left, every waiting request is dropped
    /// (its waiter sees its reply gone: 503) instead of waiting for its queue age.
    pub fn refreshed(
        &mut self,
        decode: Vec<(String, pb::DecodeLoad)>,
        prefill: Vec<(String, pb::PrefillLoad)>,
        now: Instant,
    ) {
        self.fleet.apply(decode, prefill);
        if self.fleet.decode().is_empty() {
            self.waiting.clear();
            self.queued_tokens.iter_mut().for_each(|t| *t = 0);
            self.note_queue(now);
        }
    }

    /// Passes over decode worker `addr` until `until` (it lost a stream).
    pub fn quarantine(&mut self, addr: &str, until: Instant, now: Instant) {
        self.fleet.quarantine.retain(|_, u| *u > now);
        self.fleet.quarantine.insert(addr.to_string(), until);
    }

    /// Notes whether top-priority requests wait (`Service`), after any change to the queue.
    fn note_queue(&mut self, now: Instant) {
        let waiting = self.waiting.iter().any(|w| w.priority >= self.top_priority);
        self.service.note(waiting, now);
    }

    /// Requests waiting per class index (the queue-length gauges).
    pub fn queued_per_class(&self) -> Vec<usize> {
        let mut n = vec![0; self.queued_tokens.len()];
        for w in &self.waiting {
            n[w.class] += 1;
        }
        n
    }

    /// The prefill worker with the shortest estimated wait, not in `exclude` (for retries;
    /// no slot is needed: the request already holds one).
    pub fn retry_prefill_worker(&self, exclude: &[String]) -> Option<String> {
        self.fleet.retry_prefill(exclude).map(|p| p.addr.clone())
    }

    /// The decode worker with the least load in blocks, not in `exclude`.
    pub fn retry_decode_worker(&self, exclude: &[String]) -> Option<String> {
        self.fleet.retry_decode(exclude).map(|d| d.addr.clone())
    }

    /// True when a decode worker answers, and a prefill worker too if a pool is configured.
    pub fn ready(&self) -> bool {
        !self.fleet.decode().is_empty() && (!self.prefill_pool || !self.fleet.prefill().is_empty())
    }
}

#[cfg(test)]
pub(super) mod tests;
