//! The router schedules, workers execute (docs/design.md, Scheduling). Every request passes
//! `submit`: it is refused at once (429 + Retry-After) when its class's queue budget is spent
//! or its estimated wait already exceeds its TTFT SLO, else it waits in the router's queue
//! (priority, then TTFT deadline) until a decode worker has KV room and, for a prompt that
//! goes to the prefill pool, a prefill worker has a free slot. The grant names both workers
//! and where the prompt is prefilled (`policy::place`), and holds a `Ticket` that gives the
//! capacity back as the request moves on (prefill done, stream ended).
//!
//! The rules live in `state` (each event a method on an explicit instant, no I/O) and
//! `policy` (pure functions); this module owns the state behind one lock, reads the clock
//! once per event, and delivers grants to their waiters. Worker state comes from `fleet` (a
//! periodic refresh plus this router's own bookings); which prefixes each worker caches from
//! `prefixes` (the workers' cache events): the decode worker is chosen by load and the
//! prompt blocks it lacks, the prefill worker by the time to the first token (its wait plus
//! the uncached part's compute).

pub mod fleet;
pub mod policy;
pub mod prefixes;
mod rates;
mod refresh;
pub mod state;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pd_telemetry::metrics::RouterMetrics;
use tokio::sync::oneshot;

use crate::classes::{Class, Classes};
use crate::error::RouterError;
use crate::workers::Pools;
use policy::LocalRule;
pub use prefixes::Prompt;
pub use state::Placement;
use state::{State, STALL_FACTOR};

pub use refresh::{round_interval, spawn_refresh};

/// Scheduler settings (router flags).
#[derive(Debug, Clone)]
pub struct ScheduleConfig {
    /// How often every worker's load is read ...
    pub refresh: Duration,
    /// ... with at most this many `Load` calls per second (`refresh::round_interval`).
    pub max_load_calls_per_s: u32,
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
            max_load_calls_per_s: 2000,
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

/// What a dispatched request holds: where it goes (`Placement`), and the capacity it takes
/// until released.
#[derive(Debug)]
pub struct Grant {
    pub placement: Placement,
    pub ticket: Ticket,
}

/// How a grant reaches the request waiting for it.
type Reply = oneshot::Sender<Grant>;

/// The router's queues and view of the workers.
#[derive(Debug)]
pub struct Scheduler {
    state: Mutex<State<Reply>>,
    pub classes: Classes,
    pub config: ScheduleConfig,
    pub pools: Arc<Pools>,
    metrics: RouterMetrics,
}

impl Scheduler {
    pub fn new(classes: Classes, config: ScheduleConfig, pools: Arc<Pools>, metrics: RouterMetrics) -> Arc<Self> {
        let state = State::new(&classes, config.clone(), !pools.prefill.specs_empty());
        Arc::new(Scheduler { state: Mutex::new(state), classes, config, pools, metrics })
    }

    fn lock(&self) -> MutexGuard<'_, State<Reply>> {
        // Each event keeps the queue and the fleet consistent before any call that could panic.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits a request of `class` for `prompt` into the queue, or refuses it.
    pub fn submit(
        self: &Arc<Self>,
        class: &Arc<Class>,
        prompt: Arc<Prompt>,
        max_tokens: usize,
    ) -> Result<Pending, RouterError> {
        let (tx, rx) = oneshot::channel();
        let mut state = self.lock();
        let now = Instant::now();
        let admitted = state.submit(class, prompt, max_tokens, tx, now)?;
        self.dispatch(&mut state, now);
        Ok(self.pending(class, admitted, rx, now))
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
        let (tx, rx) = oneshot::channel();
        let mut state = self.lock();
        let now = Instant::now();
        let admitted = state.submit_migrated(class, prompt, max_tokens, tx, now)?;
        self.dispatch(&mut state, now);
        Ok(self.pending(class, admitted, rx, now))
    }

    fn pending(
        self: &Arc<Self>,
        class: &Arc<Class>,
        admitted: state::Admitted,
        rx: oneshot::Receiver<Grant>,
        now: Instant,
    ) -> Pending {
        Pending {
            scheduler: self.clone(),
            seq: admitted.seq,
            class: class.clone(),
            rx: Some(rx),
            expires: now + admitted.stall_after,
        }
    }

    /// Passes over decode worker `addr` for `how_long` (it lost a stream).
    pub fn quarantine(&self, addr: &str, how_long: Duration) {
        let now = Instant::now();
        self.lock().quarantine(addr, now + how_long, now);
    }

    /// Grants what fits and hands each grant to its waiter; a waiter that is gone (its client
    /// left while it waited) gives its booking back, which may let another request go.
    fn dispatch(self: &Arc<Self>, state: &mut State<Reply>, now: Instant) {
        loop {
            let mut gave_back = false;
            for (tx, placement) in state.dispatch(now) {
                if let Err(mut grant) = tx.send(self.grant(placement)) {
                    // Its ticket gives the booking back here, under the lock this holds.
                    grant.ticket.scheduler = None;
                    state.release(grant.ticket.seq, false, now);
                    gave_back = true;
                }
            }
            if !gave_back {
                break;
            }
        }
        self.count_queued(state);
    }

    fn grant(self: &Arc<Self>, placement: Placement) -> Grant {
        Grant { ticket: Ticket { scheduler: Some(self.clone()), seq: placement.seq }, placement }
    }

    /// The queue-length gauges.
    fn count_queued(&self, state: &State<Reply>) {
        for (class, n) in self.classes.all().iter().zip(state.queued_per_class()) {
            self.metrics.queued.with_label_values(&[class.name.as_str()]).set(n as f64);
        }
    }

    /// The prefill worker with the shortest estimated wait, not in `exclude` (for retries;
    /// no slot is needed: the request already holds one).
    pub fn retry_prefill_worker(&self, exclude: &[String]) -> Option<String> {
        self.lock().retry_prefill_worker(exclude)
    }

    /// The decode worker with the least load in blocks, not in `exclude` (a prompt scored
    /// under colocated serving: it needs blocks for the prompt alone, for a moment).
    pub fn retry_decode_worker(&self, exclude: &[String]) -> Option<String> {
        self.lock().retry_decode_worker(exclude)
    }

    /// True when a decode worker answers, and a prefill worker too if a pool is configured.
    pub fn ready(&self) -> bool {
        self.lock().ready()
    }

    /// The `Load` request for each known worker: where its cache events continue.
    fn cursors(&self) -> (refresh::Cursors, refresh::Cursors) {
        let state = self.lock();
        let decode = state.fleet.decode().iter().map(|d| (d.addr.clone(), d.prefixes.cursor())).collect();
        let prefill = state.fleet.prefill().iter().map(|p| (p.addr.clone(), p.prefixes.cursor())).collect();
        (decode, prefill)
    }

    /// Takes a refresh's loads and dispatches what now fits; with no decode worker left,
    /// every waiting request fails with 503 instead of waiting for its queue age.
    fn refreshed(
        self: &Arc<Self>,
        decode: Vec<(String, pd_proto::v1::DecodeLoad)>,
        prefill: Vec<(String, pd_proto::v1::PrefillLoad)>,
    ) {
        let mut state = self.lock();
        let now = Instant::now();
        state.refreshed(decode, prefill, now);
        self.dispatch(&mut state, now);
    }

    /// Removes a waiting request (its client left, or it expired); true if it was waiting.
    fn withdraw(&self, seq: u64) -> bool {
        let mut state = self.lock();
        let withdrawn = state.withdraw(seq, Instant::now());
        self.count_queued(&state);
        withdrawn
    }
}

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
                    .observe(grant.placement.waited.as_secs_f64());
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

/// Capacity a dispatched request holds (its booking in the scheduler, by sequence number);
/// given back in parts, and all of it when dropped.
#[derive(Debug)]
pub struct Ticket {
    /// None for a grant that never reached its waiter (the dispatch that made it gave the
    /// booking back).
    scheduler: Option<Arc<Scheduler>>,
    seq: u64,
}

impl Ticket {
    /// The decode worker reserved the KV: its own free-block count now includes it.
    pub fn decode_opened(&mut self) {
        if let Some(s) = &self.scheduler {
            s.lock().decode_opened(self.seq);
        }
    }

    /// The prompt is prefilled (or its prefill failed): its prefill slot is free.
    pub fn prefill_done(&mut self) {
        if let Some(s) = &self.scheduler {
            let mut state = s.lock();
            state.prefill_done(self.seq);
            s.dispatch(&mut state, Instant::now());
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(s) = self.scheduler.take() {
            let mut state = s.lock();
            let now = Instant::now();
            state.release(self.seq, true, now);
            s.dispatch(&mut state, now);
        }
    }
}
