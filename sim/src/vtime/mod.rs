//! Virtual time: the real scheduler (`pd_router::schedule::state::State`, the router's own
//! admission, queue, placement and booking rules) and the real planners (the decode batch
//! planner, the prefill step planner and its preemption rule, through `workers`) against
//! simulated workers, in one thread, with time jumping from one event to the next. A fleet
//! of 1,000 workers serves an hour of traffic in seconds to minutes of wall time, where the
//! real-time `pd-sim-worker` needs the hour.
//!
//! What is simulated: the workers' compute (the cost model, as in `pd-sim-worker`), the
//! network (a fixed one-way `hop` per message between processes), and the clients (a
//! `Traffic`, e.g. pd-bench's scenario). What is real: every scheduling decision, and the
//! router's view of the workers, which comes from their `Load` answers at the router's
//! refresh interval (`round_interval`) plus its own bookings, exactly as in the router.
//!
//! A request's life, as `pd-router` drives it (`lifecycle`): submit (429 / 503 refusals
//! answered), queue, grant; the decode worker reserves prompt + output blocks; the router,
//! told the reservation is open, sends the prompt to the grant's prefill worker, whose steps
//! prefill it; the KV hand-off commits it on the decode worker, which sends the first token
//! and decodes the rest in its batch; prefill done and stream end give the bookings back. A
//! prompt placed on its decode worker (`Place::Local`) is prefilled in the decode batch.
//! Not simulated (yet): worker losses and migration, prefix caches (simulated workers report
//! none), the router's CPU time.

mod engine;
mod queue;
mod slab;
pub mod workers;

use std::sync::Arc;
use std::time::Duration;

use pd_prefill::step::StepConfig;

use crate::cost::WorkerCost;

pub use engine::run;
/// The router's traffic classes and scheduler settings (its `--classes` and flags).
pub use pd_router::classes::Classes;
pub use pd_router::schedule::ScheduleConfig;

/// A virtual-time fleet and its router.
#[derive(Debug, Clone)]
pub struct Config {
    pub cost: Arc<WorkerCost>,
    /// The prefill workers' step policy.
    pub step: StepConfig,
    pub prefill: usize,
    pub decode: usize,
    pub schedule: ScheduleConfig,
    pub classes: Classes,
    /// One-way time of a message between processes (client, router, workers).
    pub hop: Duration,
    /// Draw each control message's time around `hop` with this seed (None: exactly `hop`).
    /// Which worker a request lands on can turn on a fraction of a millisecond, and so can
    /// the latencies of a whole run: replicas with different seeds show that spread, which
    /// one run (real-time or virtual) cannot.
    pub jitter: Option<u64>,
}

/// A request a client sends.
#[derive(Debug, Clone)]
pub struct Request {
    /// Whose request it is (for `Traffic::ended`).
    pub client: u64,
    /// The traffic class asked for (`x-pd-class`).
    pub class: String,
    pub prompt: Arc<Vec<u32>>,
    pub max_tokens: usize,
    /// 0 for a first sending, n for the n-th retry after a refusal.
    pub attempt: u32,
}

/// How a request ended, as its client saw it (times from the run's start).
#[derive(Debug, Clone)]
pub struct Outcome {
    pub request: Request,
    pub sent: Duration,
    /// Arrival of each token at the client.
    pub tokens: Vec<Duration>,
    /// HTTP status of a request that was not served (429, 503, ...).
    pub status: Option<u16>,
    pub retry_after_s: Option<u64>,
    pub error: Option<String>,
}

/// The clients of a run.
pub trait Traffic {
    /// Requests sent from now until `until` (each with its sending time, at least now and
    /// before `until`), and whether any may come later.
    fn arrivals(&mut self, now: Duration, until: Duration) -> (Vec<(Duration, Request)>, bool);

    /// A request ended at `now` (its client saw the end): what its client sends next.
    fn ended(&mut self, outcome: Outcome, now: Duration) -> Vec<(Duration, Request)>;
}

/// What a run did, besides the outcomes it handed to its traffic.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Totals {
    /// The virtual time from the start to the last request's end.
    pub virtual_s: f64,
    pub events: u64,
    pub requests: u64,
    /// Load refresh rounds.
    pub refreshes: u64,
    pub decode_steps: u64,
    /// Rows of all decode steps (their mean batch: rows / steps).
    pub decode_rows: u64,
    /// Prompts the scheduler placed on their decode worker (`Place::Local`).
    pub local_prefills: u64,
    pub prefill_steps: u64,
    /// Prefill steps cut by a short prompt's arrival.
    pub preempted: u64,
    /// KV blocks still reserved on the decode workers after the last request ended (a leak
    /// when not 0).
    pub held_blocks: u64,
}

#[cfg(test)]
mod tests;
