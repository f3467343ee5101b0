//! The router schedules, workers execute (docs/design.md, Scheduling). Every request passes
//! `submit`: it is refused at once (429 + Retry-After) when its class's queue budget is spent
//! or its estimated wait already exceeds its TTFT SLO, else it waits in the router's queue
//! (priority, then TTFT deadline) until a decode worker has KV room and, for a prompt that
//! goes to the prefill pool, a prefill worker has a free slot. The grant names both workers
//! and where the prompt is prefilled (`policy::place`), and holds a `Ticket` that gives the
//! capacity back as the request moves on (prefill done, stream ended).
//!
//! The rules live in `state` (each event a method on an explicit instant, no I/O) and
//! `policy` (pure functions); one task owns the state (`owner`): this module's handles send it
//! events, and it reads the clock once per batch of them and delivers grants to their waiters. Worker state comes from `fleet` (a
//! periodic refresh plus this router's own bookings); which prefixes each worker caches from
//! `prefixes` (the workers' cache events): the decode worker is chosen by load and the
//! prompt blocks it lacks, the prefill worker by the time to the first token (its wait plus
//! the uncached part's compute).

pub mod fleet;
mod owner;
pub mod policy;
pub mod prefixes;
mod rates;
mod refresh;
pub mod state;

use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_telemetry::metrics::RouterMetrics;
use tokio::sync::{mpsc, oneshot};

use crate::classes::{Class, Classes};
use crate::error::RouterError;
use crate::workers::Pools;
use owner::{Event, Owner};
use policy::LocalRule;
pub use prefixes::Prompt;
pub use state::Placement;
use state::{Admitted, State, STALL_FACTOR};

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

/// The handle to the router's queues and view of the workers (owned by one task, `owner`).
#[derive(Debug)]
pub struct Scheduler {
    events: mpsc::UnboundedSender<Event>,
    pub classes: Classes,
    pub config: ScheduleConfig,
    pub pools: Arc<Pools>,
    metrics: RouterMetrics,
}

impl Scheduler {
    /// Starts the task that owns the state (on the current tokio runtime); it ends when this
    /// handle and every ticket are gone.
    pub fn new(classes: Classes, config: ScheduleConfig, pools: Arc<Pools>, metrics: RouterMetrics) -> Arc<Self> {
        let state = State::new(&classes, config.clone(), !pools.prefill.specs_empty());
        let (events, inbox) = mpsc::unbounded_channel();
        let owner = Owner::new(state, classes.clone(), metrics.clone(), events.downgrade());
        tokio::spawn(owner.run(inbox));
        Arc::new(Scheduler { events, classes, config, pools, metrics })
    }

    fn send(&self, event: Event) {
        // Fails only once the task is gone, which this handle's own sender prevents.
        let _ = self.events.send(event);
    }

    /// Answers `question` from the state, after every event sent before it.
    async fn ask<T: Default + Send + 'static>(&self, question: impl FnOnce(&State<Reply>) -> T + Send + 'static) -> T {
        let (tx, rx) = oneshot::channel();
        self.send(Event::Ask(Box::new(move |state| {
            let _ = tx.send(question(state));
        })));
        rx.await.unwrap_or_default()
    }

    /// Submits a request of `class` for `prompt`; `Pending::granted` gives its admission
    /// (or refusal) and then its grant.
    pub fn submit(self: &Arc<Self>, class: &Arc<Class>, prompt: Arc<Prompt>, max_tokens: usize) -> Pending {
        self.submit_event(class, prompt, max_tokens, false)
    }

    /// Queues a request whose decode worker was lost mid-stream (`prompt`: its prompt and the
    /// tokens already sent) without admission control: it was admitted once. It goes first
    /// among its priority. No decode worker outside quarantine (the lost one is in it): NoWorker
    /// at once.
    pub fn submit_migrated(self: &Arc<Self>, class: &Arc<Class>, prompt: Arc<Prompt>, max_tokens: usize) -> Pending {
        self.submit_event(class, prompt, max_tokens, true)
    }

    fn submit_event(
        self: &Arc<Self>,
        class: &Arc<Class>,
        prompt: Arc<Prompt>,
        max_tokens: usize,
        migrated: bool,
    ) -> Pending {
        let (admitted_tx, admitted) = oneshot::channel();
        let (reply, rx) = oneshot::channel();
        let class = class.clone();
        let submitted = Instant::now();
        self.send(Event::Submit { class: class.clone(), prompt, max_tokens, migrated, admitted: admitted_tx, reply });
        Pending { scheduler: self.clone(), class, admitted: Some(admitted), seq: None, rx: Some(rx), submitted }
    }

    /// Passes over decode worker `addr` for `how_long` (it lost a stream).
    pub fn quarantine(&self, addr: &str, how_long: Duration) {
        self.send(Event::Quarantine { addr: addr.to_string(), how_long });
    }

    /// The prefill worker with the shortest estimated wait, not in `exclude` (for retries;
    /// no slot is needed: the request already holds one).
    pub async fn retry_prefill_worker(&self, exclude: &[String]) -> Option<String> {
        let exclude = exclude.to_vec();
        self.ask(move |state| state.retry_prefill_worker(&exclude)).await
    }

    /// The decode worker with the least load in blocks, not in `exclude` (a prompt scored
    /// under colocated serving: it needs blocks for the prompt alone, for a moment).
    pub async fn retry_decode_worker(&self, exclude: &[String]) -> Option<String> {
        let exclude = exclude.to_vec();
        self.ask(move |state| state.retry_decode_worker(&exclude)).await
    }

    /// True when a decode worker answers, and a prefill worker too if a pool is configured.
    pub async fn ready(&self) -> bool {
        self.ask(State::ready).await
    }

    /// The `Load` request for each known worker: where its cache events continue.
    async fn cursors(&self) -> (refresh::Cursors, refresh::Cursors) {
        self.ask(|state| {
            let decode = state.fleet.decode().iter().map(|d| (d.addr.clone(), d.prefixes.cursor())).collect();
            let prefill = state.fleet.prefill().iter().map(|p| (p.addr.clone(), p.prefixes.cursor())).collect();
            (decode, prefill)
        })
        .await
    }

    /// Hands a refresh's loads to the state, which dispatches what now fits; with no decode
    /// worker left, every waiting request fails with 503 instead of waiting for its queue age.
    fn refreshed(
        &self,
        decode: Vec<(String, pd_proto::v1::DecodeLoad)>,
        prefill: Vec<(String, pd_proto::v1::PrefillLoad)>,
    ) {
        self.send(Event::Refreshed { decode, prefill });
    }
}

/// A submitted request: its admission, then its place in the queue; dropping it withdraws
/// the request.
#[derive(Debug)]
pub struct Pending {
    scheduler: Arc<Scheduler>,
    class: Arc<Class>,
    /// The admission answer, until it is read.
    admitted: Option<oneshot::Receiver<Result<Admitted, RouterError>>>,
    /// Its sequence number, once admitted.
    seq: Option<u64>,
    rx: Option<oneshot::Receiver<Grant>>,
    submitted: Instant,
}

impl Pending {
    /// Waits for the admission, then for the grant. An admitted request is not refused later:
    /// the class's queue age is a budget checked at admission (a queue whose oldest request is
    /// past it refuses new ones at once). Only a request still waiting at `STALL_FACTOR` times
    /// the queue age, which means the workers are not taking requests, fails (503).
    pub async fn granted(mut self) -> Result<Grant, RouterError> {
        let Some(admission) = self.admitted.as_mut() else { return Err(RouterError::NoWorker("decode")) };
        let outcome = admission.await;
        self.admitted = None;
        let admitted = outcome.map_err(|_| RouterError::NoWorker("decode"))??;
        self.seq = Some(admitted.seq);
        let expires = self.submitted + admitted.stall_after;
        let Some(rx) = self.rx.as_mut() else { return Err(RouterError::NoWorker("decode")) };
        let outcome = tokio::time::timeout_at(expires.into(), rx).await;
        match outcome {
            Ok(Ok(grant)) => {
                self.rx = None;
                self.scheduler
                    .metrics
                    .queue_time
                    .with_label_values(&[self.class.name.as_str()])
                    .observe(grant.placement.waited.as_secs_f64());
                Ok(grant)
            }
            Ok(Err(_)) => Err(RouterError::NoWorker("decode")),
            Err(_) => Err(RouterError::QueueStalled(format!(
                "waited {} ms in the queue of class `{}` ({STALL_FACTOR}x its max_queue_age_ms) without a worker \
                 taking it",
                (self.class.max_queue_age() * STALL_FACTOR).as_millis(),
                self.class.name
            ))),
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(mut admission) = self.admitted.take() {
            // Closed first: either the answer is already here, or the task finds the waiter
            // gone when it answers and withdraws the request itself.
            admission.close();
            self.seq = admission.try_recv().ok().and_then(Result::ok).map(|a| a.seq);
        }
        if let (Some(seq), Some(_)) = (self.seq, &self.rx) {
            // Still waiting (or a grant arrived unread: its ticket gives it back).
            self.scheduler.send(Event::Withdraw(seq));
        }
    }
}

/// Capacity a dispatched request holds (its booking in the scheduler, by sequence number);
/// given back in parts, and all of it when dropped. Each is an event to the owner task.
#[derive(Debug)]
pub struct Ticket {
    /// None for a grant that never reached its waiter (the dispatch that made it gave the
    /// booking back), or once the scheduler is gone.
    events: Option<mpsc::UnboundedSender<Event>>,
    seq: u64,
}

impl Ticket {
    fn send(&self, event: Event) {
        if let Some(events) = &self.events {
            let _ = events.send(event);
        }
    }

    /// The decode worker reserved the KV: its own free-block count now includes it.
    pub fn decode_opened(&mut self) {
        self.send(Event::DecodeOpened(self.seq));
    }

    /// The prompt is prefilled (or its prefill failed): its prefill slot is free.
    pub fn prefill_done(&mut self) {
        self.send(Event::PrefillDone(self.seq));
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.send(Event::Release(self.seq));
    }
}
