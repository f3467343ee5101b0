//! The router schedules, workers execute (docs/design.md, Scheduling). Every request passes
//! `submit`: it is refused at once (429 + Retry-After) when its class's queue budget is spent
//! or its estimated wait already exceeds its TTFT SLO, else it waits in the router's queue
//! (priority, then TTFT deadline) until a decode worker has KV room and, for a prompt that
//! goes to the prefill pool, a prefill worker has a free slot. The grant names both workers
//! and where the prompt is prefilled (`policy::place`), and holds a `Ticket` that gives the
//! capacity back as the request moves on (prefill done, stream ended).
//!
//! Worker state comes from `fleet` (a periodic refresh plus this router's own dispatches);
//! which prefixes each worker caches from `prefixes` (the workers' cache events): the
//! decode worker is chosen by load and the prompt blocks it lacks, the prefill worker by the
//! time to the first token (its wait plus the uncached part's compute).

pub mod fleet;
pub mod policy;
pub mod prefixes;
mod refresh;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pd_telemetry::metrics::RouterMetrics;
use tokio::sync::oneshot;

use crate::classes::{Class, Classes};
use crate::error::RouterError;
use crate::workers::Pools;
use fleet::Fleet;
use policy::{LocalRule, Place, Waiting};
pub use prefixes::Prompt;

pub use refresh::spawn_refresh;

/// Scheduler settings (router flags).
#[derive(Debug, Clone)]
pub struct ScheduleConfig {
    /// How often every worker's load is read.
    pub refresh: Duration,
    /// Queue-aware conditional disaggregation.
    pub local: LocalRule,
    /// Prefill tokens/s assumed for a worker that has not measured its own yet.
    pub prior_tokens_per_s: f64,
    /// Tokens of each prompt in flight counted at most when estimating a prefill worker's
    /// wait for a new short prompt (about one step's worth: longer prompts run beside it).
    pub step_budget: usize,
    /// In the choice of a decode worker, each prompt block a worker lacks counts as this many
    /// blocks of load (0: ignore prefix caches).
    pub prefix_weight: f64,
    /// How long a decode worker that lost a stream is passed over (this router only).
    pub quarantine: Duration,
    /// How long the relay waits for a client to take its next event before the request ends
    /// (its decode sequence is cancelled and its KV freed): a reader that stopped reading
    /// holds nothing on a worker past this.
    pub client_send_timeout: Duration,
    /// Long prompts (`policy::is_long`, against the tightest class's TTFT SLO) prefilled at
    /// once per prefill worker; more wait in the queue while shorter work passes them.
    pub long_prefills_per_worker: usize,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        ScheduleConfig {
            refresh: Duration::from_millis(100),
            local: LocalRule {
                max_tokens: 0,
                max_ratio: 4.0,
                min_prefill_wait: Duration::from_millis(500),
                min_free_kv: 0.25,
            },
            prior_tokens_per_s: 300.0,
            step_budget: 256,
            prefix_weight: 2.0,
            quarantine: Duration::from_secs(10),
            client_send_timeout: Duration::from_secs(30),
            long_prefills_per_worker: 1,
        }
    }
}

/// What a dispatched request holds: its workers, and the capacity it takes until released.
#[derive(Debug)]
pub struct Grant {
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
    pub ticket: Ticket,
}

/// What a waiting request carries besides its place in the queue.
#[derive(Debug)]
struct Reply {
    tx: oneshot::Sender<Grant>,
    prompt: Arc<Prompt>,
}

#[derive(Debug, Default)]
struct Inner {
    waiting: Vec<Waiting<Reply>>,
    /// Queued prompt tokens per class index.
    queued_tokens: Vec<u64>,
    fleet: Fleet,
    seq: u64,
    /// When streams last ended (gave their decode capacity back): how fast a queue held by
    /// the decode side drains.
    released: Events,
    /// How fast the queue of top-priority requests is served while it holds any.
    service: Service,
    /// Long prompts (`policy::is_long`) granted a prefill worker and not yet prefilled.
    long_prefills: usize,
}

/// Events remembered for a rate, over how long, and how many make a rate.
const RATE_SAMPLES: usize = 256;
const RATE_WINDOW: Duration = Duration::from_secs(5);
const RATE_MIN_SAMPLES: usize = 3;

/// Shortest time with a non-empty queue in the window that makes a service rate.
const SERVICE_MIN_BUSY: Duration = Duration::from_millis(500);

/// How fast the queue is served while it holds requests: grants of requests that had to wait,
/// over the time the queue was not empty. Grants per second alone would follow arrivals under
/// a light load (a burst after a quiet minute would look like a queue served at 0.2/s and be
/// refused); while requests wait, grants come as fast as capacity frees. Only the top
/// priority counts: batch requests are held back on purpose while interactive ones flow.
#[derive(Debug, Default)]
struct Service {
    grants: Events,
    /// Closed spans of time with a non-empty queue, oldest first, and the open one.
    busy: std::collections::VecDeque<(Instant, Instant)>,
    since: Option<Instant>,
}

impl Service {
    /// Notes whether the queue holds requests now (called after every change to it).
    fn note(&mut self, waiting: bool, now: Instant) {
        match (waiting, self.since) {
            (true, None) => self.since = Some(now),
            (false, Some(start)) => {
                self.busy.push_back((start, now));
                if self.busy.len() > RATE_SAMPLES {
                    self.busy.pop_front();
                }
                self.since = None;
            }
            _ => {}
        }
    }

    /// Time the queue held requests within the last `RATE_WINDOW`.
    fn busy_within(&self, now: Instant) -> Duration {
        let from = now.checked_sub(RATE_WINDOW).unwrap_or(now);
        let open = self.since.map(|s| (s, now));
        let spans = self.busy.iter().copied().chain(open);
        spans.map(|(a, b)| b.saturating_duration_since(a.max(from))).sum()
    }

    /// Grants per second of busy time; None when too few grants or too little busy time in
    /// the window to tell.
    fn per_s(&self, now: Instant) -> Option<f64> {
        let n = self.grants.recent(now);
        let busy = self.busy_within(now);
        (n >= RATE_MIN_SAMPLES && busy >= SERVICE_MIN_BUSY).then(|| n as f64 / busy.as_secs_f64())
    }
}

/// Recent instants of one kind of event, for its rate.
#[derive(Debug, Default)]
struct Events(std::collections::VecDeque<Instant>);

impl Events {
    fn record(&mut self, at: Instant) {
        self.0.push_back(at);
        if self.0.len() > RATE_SAMPLES {
            self.0.pop_front();
        }
    }

    /// Events within the last `RATE_WINDOW`.
    fn recent(&self, now: Instant) -> usize {
        self.0.iter().filter(|t| now - **t < RATE_WINDOW).count()
    }

    /// Events per second over the last `RATE_WINDOW`; None when too few happened in it to
    /// tell (a lightly loaded cluster, or one that just started).
    fn per_s(&self, now: Instant) -> Option<f64> {
        let n = self.recent(now);
        (n >= RATE_MIN_SAMPLES).then(|| n as f64 / RATE_WINDOW.as_secs_f64())
    }
}

/// The router's queues and view of the workers.
#[derive(Debug)]
pub struct Scheduler {
    inner: Mutex<Inner>,
    pub classes: Classes,
    pub config: ScheduleConfig,
    pub pools: Arc<Pools>,
    metrics: RouterMetrics,
}

impl Scheduler {
    pub fn new(classes: Classes, config: ScheduleConfig, pools: Arc<Pools>, metrics: RouterMetrics) -> Arc<Self> {
        let inner = Inner { queued_tokens: vec![0; classes.all().len()], ..Inner::default() };
        Arc::new(Scheduler { inner: Mutex::new(inner), classes, config, pools, metrics })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Each update keeps the queue and the fleet consistent before any call that could panic.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn top_priority(&self) -> i32 {
        self.classes.all().iter().map(|c| c.spec.priority).max().unwrap_or(0)
    }

    /// Admits a request of `class` for `prompt` into the queue, or refuses it.
    pub fn submit(
        self: &Arc<Self>,
        class: &Arc<Class>,
        prompt: Arc<Prompt>,
        max_tokens: usize,
    ) -> Result<Pending, RouterError> {
        let tokens = prompt.len();
        let mut inner = self.lock();
        let now = Instant::now(); // the one instant this event reads
        if inner.fleet.decode.is_empty() {
            return Err(RouterError::NoWorker("decode"));
        }
        // What must be computed: a cached prefix costs no prefill time.
        let work = tokens - inner.fleet.expected_cached(&prompt, now).min(tokens);
        let (_, rate) = inner.fleet.prefill_pool(self.config.prior_tokens_per_s, self.config.step_budget);
        let in_flight: Vec<usize> = inner.fleet.prefill.iter().flat_map(|p| p.in_flight_tokens()).collect();
        // A long prompt is prefilled a few at a time (`dispatch`); one that waits for its
        // turn holds back only other long ones, not this request if it is short.
        let own = policy::estimated_wait(0, work, rate);
        let tightest = self.classes.all().iter().map(|c| c.ttft_slo()).min().unwrap_or(class.ttft_slo());
        let long = policy::is_long(own, tightest);
        let ahead_of_me = inner.waiting.iter().filter(|w| w.priority >= class.spec.priority && (long || !w.long));
        let (queued_ahead, oldest_ahead) =
            ahead_of_me.fold((0, Duration::ZERO), |(n, o), w| (n + 1, o.max(now - w.arrived)));
        let itl = Duration::from_millis(class.spec.itl_slo_ms);
        let need = inner.fleet.decode.first().map_or(0, |d| d.blocks_for(tokens + max_tokens));
        let top = class.spec.priority >= self.top_priority();
        let view = policy::QueueView {
            tokens_ahead: policy::tokens_ahead(&inner.waiting, class.spec.priority, &in_flight, work),
            tokens_per_s: rate,
            queued_ahead,
            oldest_ahead,
            decode_room: inner.fleet.best_decode(need, itl).is_some(),
            prefill_room: self.pools.prefill.specs_empty() || inner.fleet.prefill.iter().any(|p| p.has_room(top)),
            released_per_s: inner.released.per_s(now),
            served_per_s: inner.service.per_s(now),
        };
        let estimate = policy::estimate_wait(&view);
        let wait = estimate.total();
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
        let oldest_of_class = inner
            .waiting
            .iter()
            .filter(|w| w.class == class.index && (long || !w.long))
            .map(|w| now - w.arrived)
            .max()
            .unwrap_or_default();
        let budget = policy::Budget {
            queued_tokens: inner.queued_tokens[class.index],
            max_queued_tokens: class.spec.max_queued_tokens,
            ttft_slo: class.ttft_slo(),
            oldest_waiting: oldest_of_class,
            max_queue_age: class.max_queue_age(),
        };
        policy::admit(&class.name, tokens, budget, wait, own, rate)
            .map_err(|r| RouterError::Overloaded { message: r.message, retry_after_s: r.retry_after_s })?;
        // A long prompt may wait its turn (about its own prefill) on top of the queue age.
        let patience = if long { own * 2 } else { Duration::ZERO };
        let queued = Queued { arrived: now, deadline: now + class.ttft_slo(), long, patience };
        Ok(self.enqueue(&mut inner, class, prompt, max_tokens, queued))
    }

    /// Queues a request whose decode worker was lost mid-stream (`prompt`: its prompt and the
    /// tokens already sent) without admission control: it was admitted once. It goes first
    /// among its priority. No decode worker outside quarantine (the lost one is in it): NoWorker
    /// at once.
    pub fn submit_migrated(
        self: &Arc<Self>,
        class: &Arc<Class>,
        prompt: Arc<Prompt>,
        max_tokens: usize,
    ) -> Result<Pending, RouterError> {
        let mut inner = self.lock();
        if inner.fleet.healthy_decode().next().is_none() {
            return Err(RouterError::NoWorker("decode"));
        }
        let now = Instant::now();
        let queued = Queued { arrived: now, deadline: now, long: false, patience: Duration::ZERO };
        Ok(self.enqueue(&mut inner, class, prompt, max_tokens, queued))
    }

    /// Puts an admitted request in the queue (its place among its priority: the TTFT deadline
    /// of `queued`) and dispatches what fits.
    fn enqueue(
        self: &Arc<Self>,
        inner: &mut Inner,
        class: &Arc<Class>,
        prompt: Arc<Prompt>,
        max_tokens: usize,
        queued: Queued,
    ) -> Pending {
        let Queued { arrived: now, deadline, long, patience } = queued;
        let tokens = prompt.len();
        // What must be computed: the prompt less what the best-placed worker caches.
        let work = tokens - inner.fleet.expected_cached(&prompt, now).min(tokens);
        let (tx, rx) = oneshot::channel();
        inner.seq += 1;
        let seq = inner.seq;
        inner.waiting.push(Waiting {
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
            reply: Reply { tx, prompt },
        });
        inner.queued_tokens[class.index] += tokens as u64;
        self.dispatch(inner, now);
        Pending {
            scheduler: self.clone(),
            seq,
            class: class.clone(),
            rx: Some(rx),
            expires: now + (class.max_queue_age() + patience) * STALL_FACTOR,
        }
    }

    /// Passes over decode worker `addr` for `how_long` (it lost a stream).
    pub fn quarantine(&self, addr: &str, how_long: Duration) {
        let mut inner = self.lock();
        let now = Instant::now();
        inner.fleet.quarantine.retain(|_, until| *until > now);
        inner.fleet.quarantine.insert(addr.to_string(), now + how_long);
    }

    /// Grants waiting requests, best first, while the head fits somewhere. Long prompts go
    /// while fewer than the cap of them prefill (`long_prefills_per_worker` per prefill
    /// worker); at the cap, shorter requests pass them.
    fn dispatch(self: &Arc<Self>, inner: &mut Inner, now: Instant) {
        let top = self.top_priority();
        let cap = self.config.long_prefills_per_worker.max(1) * inner.fleet.prefill.len().max(1);
        while let Some(i) = policy::next(&inner.waiting, inner.long_prefills < cap) {
            let Some(mut grant) = self.place(inner, i, top, now) else { break };
            let w = inner.waiting.swap_remove(i);
            if w.long && grant.prefill.is_some() {
                inner.long_prefills += 1;
                grant.ticket.long = true;
            }
            inner.queued_tokens[w.class] -= w.tokens as u64;
            // A grant at its own arrival says nothing about how fast a queue is served.
            if w.priority >= top && now - w.arrived >= Duration::from_millis(1) {
                inner.service.grants.record(now);
            }
            if let Err(mut grant) = w.reply.tx.send(grant) {
                grant.ticket.release(inner, false, now); // its client left while it waited
            }
        }
        self.count_queued(inner, now);
    }

    /// After any change to the queue: notes whether top-priority requests wait (`Service`)
    /// and sets the queue-length gauges.
    fn count_queued(&self, inner: &mut Inner, now: Instant) {
        let top = self.top_priority();
        let waiting = inner.waiting.iter().any(|w| w.priority >= top);
        inner.service.note(waiting, now);
        for class in self.classes.all() {
            let n = inner.waiting.iter().filter(|w| w.class == class.index).count();
            self.metrics.queued.with_label_values(&[class.name.as_str()]).set(n as f64);
        }
    }

    /// Places waiting request `i` if a decode worker has room and its prompt has a place.
    fn place(self: &Arc<Self>, inner: &mut Inner, i: usize, top: i32, now: Instant) -> Option<Grant> {
        let w = &inner.waiting[i];
        let cfg = &self.config;
        let prompt = w.reply.prompt.clone();
        let probe = inner.fleet.best_decode(0, w.itl_slo)?;
        // The decode worker reserves the prompt and the whole output.
        let blocks = probe.blocks_for(w.tokens + w.max_tokens);
        let (decode, decode_cached) = inner.fleet.choose_decode(blocks, w.itl_slo, &prompt, cfg.prefix_weight, now)?;
        let (pool_wait, _) = inner.fleet.prefill_pool(cfg.prior_tokens_per_s, cfg.step_budget);
        let place = policy::place(&cfg.local, w.tokens, w.max_tokens, pool_wait, decode.free_fraction());
        let prefill = if place.is_local() {
            None
        } else {
            let top = w.priority >= top;
            let (p, wait, cached) =
                inner.fleet.choose_prefill(top, cfg.prior_tokens_per_s, cfg.step_budget, &prompt, now)?;
            Some((p.addr.clone(), wait, cached))
        };
        let (decode_addr, seq, tokens, waited, itl) =
            (decode.addr.clone(), w.seq, w.tokens, now.saturating_duration_since(w.arrived), w.itl_slo);
        if let Some(d) = inner.fleet.decode_mut(&decode_addr) {
            tracing::debug!(
                waited_ms = waited.as_millis() as u64,
                step_ms = d.load.step_ms,
                predicted_step_ms = d.predicted_step_ms(),
                running = d.load.running_sequences,
                ours = d.ours,
                "granted"
            );
            d.pending_blocks += blocks;
            d.ours += 1;
            d.itl_slos.push(itl);
            d.active_blocks += blocks;
            d.prefixes.routed(&prompt, now);
        }
        if let Some((addr, _, cached)) = &prefill {
            if let Some(p) = inner.fleet.prefill_mut(addr) {
                p.in_flight.push((seq, tokens - cached.min(&tokens)));
                p.prefixes.routed(&prompt, now);
            }
        }
        let ticket = Ticket {
            scheduler: Some(self.clone()),
            seq,
            decode: decode_addr.clone(),
            blocks,
            prefill: prefill.as_ref().map(|(a, ..)| a.clone()),
            decode_opened: false,
            itl,
            long: false,
        };
        Some(Grant {
            decode: decode_addr,
            prefill: prefill.as_ref().map(|(a, ..)| a.clone()),
            place,
            waited,
            prefill_wait: prefill.as_ref().map(|(_, w, _)| *w).or(pool_wait),
            decode_cached,
            prefill_cached: prefill.map_or(0, |(.., c)| c),
            ticket,
        })
    }

    /// The prefill worker with the shortest estimated wait, not in `exclude` (for retries;
    /// no slot is needed: the request already holds one).
    pub fn retry_prefill_worker(&self, exclude: &[String]) -> Option<String> {
        let inner = self.lock();
        let cfg = &self.config;
        inner
            .fleet
            .prefill
            .iter()
            .filter(|p| !exclude.contains(&p.addr))
            .min_by_key(|p| inner.fleet.wait_of(p, cfg.prior_tokens_per_s, cfg.step_budget))
            .map(|p| p.addr.clone())
    }

    /// The decode worker with the least load in blocks, not in `exclude` (a prompt scored
    /// under colocated serving: it needs blocks for the prompt alone, for a moment).
    pub fn retry_decode_worker(&self, exclude: &[String]) -> Option<String> {
        let inner = self.lock();
        let open = inner.fleet.decode.iter().filter(|d| !exclude.contains(&d.addr));
        open.min_by_key(|d| d.load_blocks()).map(|d| d.addr.clone())
    }

    /// True when a decode worker answers, and a prefill worker too if a pool is configured.
    pub fn ready(&self) -> bool {
        let inner = self.lock();
        !inner.fleet.decode.is_empty() && (self.pools.prefill.specs_empty() || !inner.fleet.prefill.is_empty())
    }

    /// The `Load` request for each known worker: where its cache events continue.
    fn cursors(&self) -> (refresh::Cursors, refresh::Cursors) {
        let inner = self.lock();
        let decode = inner.fleet.decode.iter().map(|d| (d.addr.clone(), d.prefixes.cursor())).collect();
        let prefill = inner.fleet.prefill.iter().map(|p| (p.addr.clone(), p.prefixes.cursor())).collect();
        (decode, prefill)
    }

    /// Takes a refresh's loads and dispatches what now fits; with no decode worker left,
    /// every waiting request fails with 503 instead of waiting for its queue age.
    fn refreshed(
        self: &Arc<Self>,
        decode: Vec<(String, pd_proto::v1::DecodeLoad)>,
        prefill: Vec<(String, pd_proto::v1::PrefillLoad)>,
    ) {
        let mut inner = self.lock();
        let now = Instant::now();
        inner.fleet.apply(decode, prefill);
        if inner.fleet.decode.is_empty() {
            for w in inner.waiting.drain(..) {
                drop(w.reply); // the waiter sees its channel closed: no decode worker
            }
            inner.queued_tokens.iter_mut().for_each(|t| *t = 0);
        }
        self.dispatch(&mut inner, now);
    }

    /// Removes a waiting request (its client left, or it expired); true if it was waiting.
    fn withdraw(&self, seq: u64) -> bool {
        let mut inner = self.lock();
        match inner.waiting.iter().position(|w| w.seq == seq) {
            Some(i) => {
                let w = inner.waiting.swap_remove(i);
                inner.queued_tokens[w.class] -= w.tokens as u64;
                self.count_queued(&mut inner, Instant::now());
                true
            }
            None => false,
        }
    }
}

/// Where an admitted request queues: when it arrived, its TTFT deadline (its place among its
/// priority), and for a long prompt (`policy::is_long`), `patience` it may wait beyond the
/// class's queue age before it stalls.
#[derive(Debug, Clone, Copy)]
struct Queued {
    arrived: Instant,
    deadline: Instant,
    long: bool,
    patience: Duration,
}

/// An admitted request that waits this many times its class's queue age fails with 503.
const STALL_FACTOR: u32 = 4;

/// A request in the queue; dropping it withdraws the request.
#[derive(Debug)]
pub struct Pending {
    scheduler: Arc<Scheduler>,
    seq: u64,
    class: Arc<Class>,
    rx: Option<oneshot::Receiver<Grant>>,
    expires: Instant,
}

impl Pending {
    /// Waits for the grant. An admitted request is not refused later: the class's queue age
    /// is a budget checked at admission (a queue whose oldest request is past it refuses new
    /// ones at once). Only a request still waiting at `STALL_FACTOR` times the queue age,
    /// which means the workers are not taking requests, fails (503).
    pub async fn granted(mut self) -> Result<Grant, RouterError> {
        let Some(rx) = self.rx.take() else { return Err(RouterError::NoWorker("decode")) };
        let outcome = tokio::time::timeout_at(self.expires.into(), rx).await;
        match outcome {
            Ok(Ok(grant)) => {
                self.scheduler
                    .metrics
                    .queue_time
                    .with_label_values(&[self.class.name.as_str()])
                    .observe(grant.waited.as_secs_f64());
                Ok(grant)
            }
            Ok(Err(_)) => Err(RouterError::NoWorker("decode")),
            Err(_) => {
                self.scheduler.withdraw(self.seq);
                Err(RouterError::QueueStalled(format!(
                    "waited {} ms in the queue of class `{}` ({STALL_FACTOR}x its max_queue_age_ms) without a worker \
                     taking it",
                    (self.class.max_queue_age() * STALL_FACTOR).as_millis(),
                    self.class.name
                )))
            }
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.rx.is_some() {
            self.scheduler.withdraw(self.seq);
        }
    }
}

/// Capacity a dispatched request holds; given back in parts, and all of it when dropped.
#[derive(Debug)]
pub struct Ticket {
    scheduler: Option<Arc<Scheduler>>,
    seq: u64,
    decode: String,
    blocks: u32,
    prefill: Option<String>,
    decode_opened: bool,
    itl: Duration,
    /// Counted in `Inner::long_prefills` until its prefill ends.
    long: bool,
}

impl Ticket {
    /// The decode worker reserved the KV: its own free-block count now includes it.
    pub fn decode_opened(&mut self) {
        if let Some(s) = self.scheduler.clone() {
            let mut inner = s.lock();
            self.open_locked(&mut inner.fleet);
        }
    }

    fn open_locked(&mut self, fleet: &mut Fleet) {
        if !self.decode_opened {
            self.decode_opened = true;
            if let Some(d) = fleet.decode_mut(&self.decode) {
                d.pending_blocks = d.pending_blocks.saturating_sub(self.blocks);
            }
        }
    }

    /// The prompt is prefilled (or its prefill failed): its prefill slot is free.
    pub fn prefill_done(&mut self) {
        if let Some(s) = self.scheduler.clone() {
            let mut inner = s.lock();
            self.prefill_locked(&mut inner);
            s.dispatch(&mut inner, Instant::now());
        }
    }

    fn prefill_locked(&mut self, inner: &mut Inner) {
        if std::mem::take(&mut self.long) {
            inner.long_prefills = inner.long_prefills.saturating_sub(1);
        }
        if let Some(addr) = self.prefill.take() {
            if let Some(p) = inner.fleet.prefill_mut(&addr) {
                p.in_flight.retain(|(seq, _)| *seq != self.seq);
            }
        }
    }

    /// Gives everything back (caller holds the lock); `ended` counts a stream that ran.
    fn release(&mut self, inner: &mut Inner, ended: bool, now: Instant) {
        if ended {
            inner.released.record(now);
        }
        self.prefill_locked(inner);
        let fleet = &mut inner.fleet;
        self.open_locked(fleet);
        if let Some(d) = fleet.decode_mut(&self.decode) {
            d.ours = d.ours.saturating_sub(1);
            d.active_blocks = d.active_blocks.saturating_sub(self.blocks);
            if let Some(i) = d.itl_slos.iter().position(|x| *x == self.itl) {
                d.itl_slos.swap_remove(i);
            }
        }
        self.scheduler = None;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(s) = self.scheduler.clone() {
            let mut inner = s.lock();
            let now = Instant::now();
            self.release(&mut inner, true, now);
            s.dispatch(&mut inner, now);
        }
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
    fn the_service_rate_counts_grants_over_the_time_the_queue_held_requests() {
        let at = |ms: u64| Instant::now() + Duration::from_millis(ms);
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
