//! pd-sim: what it takes to run the real router against a fleet we do not have.
//!
//! - `cost`: a worker's timing as a function of its work (prefill chunks, decode steps, KV
//!   hand-off) and its limits (KV blocks, batch); `fit` fits it to measurements
//!   (`pd-bench profile`), `roofline` derives it from a hardware and a model description.
//! - `prefill`, `decode`: simulated workers serving the real pd.v1 APIs with that timing and
//!   no model compute; `fleet` starts many of them in one process (`pd-sim-worker`); `kv`
//!   moves their KV over UCX for real when asked (`--kv-transport ucx`).
//! - `vtime`: the same workers' rules in virtual time, against the real scheduler, in one
//!   thread with no socket (`pd-bench simulate`): fleets and hours of traffic in seconds.

pub mod cost;
pub mod decode;
pub mod fit;
pub mod fleet;
pub mod kv;
pub mod prefill;
pub mod roofline;
pub mod vtime;

/// The first token every simulated prompt produces (an ordinary token id of any vocabulary
/// the router's tokenizer has, so the router can render it).
pub const FIRST_TOKEN: u32 = 330;

/// Back-to-back simulated steps on the ideal clock: a step that follows another at once
/// starts where the last one ended by the cost model, not when the timer woke its task.
/// Tokio's timer fires on millisecond ticks, so a 12.3 ms step slept from its wake-up lasts
/// about 13 ms, and a worker stepping back to back would run 5-10% slower than its cost model
/// says; from the ideal end the error stays within one tick and does not add up.
#[derive(Debug, Default)]
pub(crate) struct StepClock {
    ideal_end: Option<std::time::Instant>,
}

impl StepClock {
    /// A wake-up later than this after the last step's ideal end starts the next step afresh
    /// (the task was held up, or the worker had been idle).
    const SLACK: std::time::Duration = std::time::Duration::from_millis(2);

    /// When a step beginning now starts.
    pub(crate) fn start(&self) -> std::time::Instant {
        let now = std::time::Instant::now();
        self.ideal_end.filter(|&end| end <= now && now - end < Self::SLACK).unwrap_or(now)
    }

    /// A step from `start` lasting `took` ends at the returned instant.
    pub(crate) fn end(&mut self, start: std::time::Instant, took: std::time::Duration) -> std::time::Instant {
        let end = start + took;
        self.ideal_end = Some(end);
        end
    }

    /// No step follows the last one at once (idle, or a step that was cut).
    pub(crate) fn idle(&mut self) {
        self.ideal_end = None;
    }
}
