//! The scheduling policies as plain functions over plain data (no clocks read, no I/O), so
//! each is unit-tested: queue order, admission (class budget, estimated wait against the TTFT
//! SLO, Retry-After from the drain rate), and where a prompt is prefilled (queue-aware
//! conditional disaggregation).

use std::time::{Duration, Instant};

/// A request waiting in the router's queues.
#[derive(Debug)]
pub struct Waiting<T> {
    /// Arrival order (ties).
    pub seq: u64,
    /// Index of its class.
    pub class: usize,
    pub priority: i32,
    pub tokens: usize,
    /// Prompt tokens to compute: `tokens` less what the best prefill worker has cached.
    pub work: usize,
    pub max_tokens: usize,
    pub arrived: Instant,
    /// Arrival + the class's TTFT SLO.
    pub deadline: Instant,
    /// The class's ITL SLO: a decode worker whose step time nears it takes no more streams.
    pub itl_slo: Duration,
    /// A long prompt (`is_long`): it waits while the pool prefills its cap of long prompts.
    pub long: bool,
    /// Where the grant goes.
    pub reply: T,
}

/// The index of the request to dispatch next: highest priority, then earliest TTFT deadline,
/// then arrival order; long prompts only while `long_ok` (the pool is under its cap of long
/// prompts prefilling at once), else shorter work passes them.
pub fn next<T>(waiting: &[Waiting<T>], long_ok: bool) -> Option<usize> {
    waiting
        .iter()
        .enumerate()
        .filter(|(_, w)| long_ok || !w.long)
        .min_by_key(|(_, w)| (std::cmp::Reverse(w.priority), w.deadline, w.seq))
        .map(|(i, _)| i)
}

/// A prompt is long when its own prefill (at the pool's measured rate) takes at least half of
/// what admission allows a TTFT SLO of `slo` (`ADMIT_MARGIN`): such a prompt cannot meet that
/// SLO on an idle pool, so the SLO cannot decide its admission (`admit`), and, taken against
/// the tightest class's SLO, it is one the pool prefills only a few of at once. Derived from
/// the measured rate, the same prompt is long on a slow machine and not on a fast one.
pub fn is_long(own: Duration, slo: Duration) -> bool {
    own * 2 >= slo.mul_f64(ADMIT_MARGIN)
}

/// Prompt tokens to compute before a new request of `priority` with `own` such tokens:
/// those waiting at the same or a higher priority, and what the prefill pool holds. Prefill
/// steps take prompts shortest remaining first and several at a time, so another prompt
/// (queued or in flight) delays this one by at most as many tokens as this one has.
/// `in_flight(cap)`: the pool's prompts in flight, each counted at most `cap` tokens.
pub fn tokens_ahead<T>(waiting: &[Waiting<T>], priority: i32, in_flight: impl FnOnce(usize) -> u64, own: usize) -> u64 {
    let cap = own.max(1);
    let queued: u64 = waiting.iter().filter(|w| w.priority >= priority).map(|w| w.work.min(cap) as u64).sum();
    let running = in_flight(cap);
    queued + running
}

/// How long `tokens_ahead` (plus the request's own prompt) take at `tokens_per_s`.
pub fn estimated_wait(tokens_ahead: u64, own_tokens: usize, tokens_per_s: f64) -> Duration {
    let seconds = (tokens_ahead + own_tokens as u64) as f64 / tokens_per_s.max(1.0);
    Duration::from_secs_f64(seconds.min(86_400.0))
}

/// A p95 estimate of the time until `n` more streams end, when they end at `per_s` on
/// average (Poisson): about n + 2 sqrt(n) mean gaps (3 gaps for one, as for an exponential
/// wait). None: the rate is not measured, no wait is assumed.
pub fn queue_wait(n: usize, per_s: Option<f64>) -> Duration {
    match per_s {
        Some(r) if n > 0 => {
            let gaps = n as f64 + 2.0 * (n as f64).sqrt();
            Duration::from_secs_f64((gaps / r.max(1e-3)).min(86_400.0))
        }
        _ => Duration::ZERO,
    }
}

/// The wait for a queue to serve `queued_ahead` requests and this one at the rate it was
/// served lately while it held requests (`per_s`, a p95 as in `queue_wait`): counted when
/// requests are queued ahead, and also when none are but this one cannot be placed now
/// (`placeable`: a decode worker with room and, with a prefill pool, a prefill slot), since it
/// then waits at the head of the queue for both to free at once. Nothing is queued and it can
/// be placed: no wait.
pub fn backlog_wait(queued_ahead: usize, placeable: bool, per_s: Option<f64>) -> Duration {
    if queued_ahead == 0 && placeable {
        Duration::ZERO
    } else {
        queue_wait(queued_ahead + 1, per_s)
    }
}

/// What admission reads of the queue and the fleet when a request arrives, gathered by the
/// scheduler at one instant.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueView {
    /// Prompt tokens the prefill pool computes before this request (`tokens_ahead`).
    pub tokens_ahead: u64,
    /// The prefill pool's rate, tokens per second.
    pub tokens_per_s: f64,
    /// Requests queued ahead of this one (at its priority or higher; for a short prompt, not
    /// the long ones waiting for their turn), and how long the oldest of them has waited.
    pub queued_ahead: usize,
    pub oldest_ahead: Duration,
    /// A decode worker has room for the request now.
    pub decode_room: bool,
    /// A prefill worker has a free slot for its priority now (or there is no prefill pool).
    pub prefill_room: bool,
    /// Streams ended per second lately (None: too few to tell).
    pub released_per_s: Option<f64>,
    /// Grants per second of the top-priority queue while it held requests (None: too few).
    pub served_per_s: Option<f64>,
}

/// The wait the queue causes a new request, by cause; its own prefill is not overload and is
/// not part of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitEstimate {
    /// The prefill work ahead at the pool's rate.
    pub prefill: Duration,
    /// No decode worker has room now: the requests ahead and this one each wait for a stream
    /// to end (a p95 at the rate streams ended lately; too few ended to tell: not counted).
    pub decode: Duration,
    /// Behind a queue, or at its head when it cannot be placed now: the time for the queue to
    /// be served at the rate it was served lately while it held requests, whichever side holds
    /// it back. Without it, requests admitted behind a queue held by the decode side's ITL
    /// headroom waited up to twice their TTFT SLO under overload, and ones admitted onto an
    /// empty queue while every prefill slot was taken waited up to 2.7 s for a slot and decode
    /// room at once.
    pub backlog: Duration,
    /// At least as long again as the oldest request ahead has waited.
    pub oldest: Duration,
}

impl WaitEstimate {
    /// The estimate admission compares with the SLO: the longest of the causes.
    pub fn total(&self) -> Duration {
        self.prefill.max(self.decode).max(self.backlog).max(self.oldest)
    }
}

/// The admission estimate of a new request's wait from what the queue and fleet look like.
pub fn estimate_wait(v: &QueueView) -> WaitEstimate {
    let decode = if v.decode_room { Duration::ZERO } else { queue_wait(v.queued_ahead + 1, v.released_per_s) };
    WaitEstimate {
        prefill: estimated_wait(v.tokens_ahead, 0, v.tokens_per_s),
        decode,
        backlog: backlog_wait(v.queued_ahead, v.decode_room && v.prefill_room, v.served_per_s),
        oldest: v.oldest_ahead,
    }
}

/// Retry-After in whole seconds: the time for the queue to drain by `excess`, at least 1.
pub fn retry_after(excess: Duration) -> u64 {
    excess.as_secs_f64().ceil().max(1.0) as u64
}

/// What a class allows a new request, before it queues.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    pub queued_tokens: u64,
    pub max_queued_tokens: u64,
    pub ttft_slo: Duration,
    /// How long the class's oldest queued request has waited, and how long one may.
    pub oldest_waiting: Duration,
    pub max_queue_age: Duration,
}

/// A refusal: its message and Retry-After seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub message: String,
    pub retry_after_s: u64,
}

/// With work ahead, a request is admitted only if its estimated time to first token is
/// within this fraction of its TTFT SLO: the estimate is an average of rates measured over
/// the last seconds, the SLO a p95. At 3x overload (`bench/slo.sh`) 0.8 gave admitted TTFT
/// p95 of 1.18-1.77 s against a 1.5 s SLO over six runs; 0.6 gave 0.78-0.81 s in three, with
/// as many requests completed (252-263 against 246-275): the queue it keeps is shorter, not
/// the throughput lower.
pub const ADMIT_MARGIN: f64 = 0.6;

/// Admits a request of `tokens` prompt tokens of class `class` with budget `b`, estimated
/// wait `wait` for the work ahead of it and `own` for its own prefill, at drain rate
/// `tokens_per_s`, or says why not. With work ahead, wait + own must fit the TTFT SLO; on an
/// idle pool a request is never refused for its own length (that is no overload). A prompt
/// too long for its class's SLO (`is_long`) is refused only for overload: when the work ahead
/// would make it wait longer than its own prefill takes (and longer than half the SLO's
/// allowance), so its time to first token stays within twice what it needs on an idle pool.
pub fn admit(
    class: &str,
    tokens: usize,
    b: Budget,
    wait: Duration,
    own: Duration,
    tokens_per_s: f64,
) -> Result<(), Refusal> {
    let after = b.queued_tokens + tokens as u64;
    if after > b.max_queued_tokens {
        // Retry when the class's queue has drained by the excess.
        let excess = Duration::from_secs_f64((after - b.max_queued_tokens) as f64 / tokens_per_s.max(1.0));
        return Err(Refusal {
            message: format!(
                "class `{class}` has {} prompt tokens queued; {tokens} more would pass its max_queued_tokens of {}",
                b.queued_tokens, b.max_queued_tokens
            ),
            retry_after_s: retry_after(excess),
        });
    }
    if b.oldest_waiting > b.max_queue_age {
        // The queue is not draining: refuse now rather than let this one wait past the age.
        return Err(Refusal {
            message: format!(
                "class `{class}`'s oldest queued request has waited {} ms, past its max_queue_age_ms of {}",
                b.oldest_waiting.as_millis(),
                b.max_queue_age.as_millis()
            ),
            retry_after_s: retry_after(b.oldest_waiting - b.max_queue_age),
        });
    }
    let allowed = b.ttft_slo.mul_f64(ADMIT_MARGIN);
    if is_long(own, b.ttft_slo) {
        let bound = own.max(allowed / 2);
        if wait <= bound {
            return Ok(());
        }
        return Err(Refusal {
            message: format!(
                "estimated wait {} ms ({:.0} prompt tokens ahead at {tokens_per_s:.0} tokens/s) exceeds what a prompt of {tokens} tokens may wait in class `{class}` ({} ms: as long as its own prefill); the prefill pool is overloaded",
                wait.as_millis(),
                wait.as_secs_f64() * tokens_per_s,
                bound.as_millis(),
            ),
            retry_after_s: retry_after(wait - bound),
        });
    }
    let ttft = if wait.is_zero() { wait } else { wait + own };
    if ttft > allowed {
        return Err(Refusal {
            message: format!(
                "estimated time to first token {} ms ({:.0} prompt tokens ahead, {:.0} own to compute, at {tokens_per_s:.0} tokens/s) exceeds {:.0}% of class `{class}`'s TTFT SLO of {} ms",
                ttft.as_millis(),
                wait.as_secs_f64() * tokens_per_s,
                own.as_secs_f64() * tokens_per_s,
                ADMIT_MARGIN * 100.0,
                b.ttft_slo.as_millis()
            ),
            retry_after_s: retry_after(ttft.saturating_sub(b.ttft_slo.mul_f64(ADMIT_MARGIN))),
        });
    }
    Ok(())
}

/// Thresholds of queue-aware conditional disaggregation.
#[derive(Debug, Clone, Copy)]
pub struct LocalRule {
    /// A prompt longer than this always goes to the prefill pool (0: never local).
    pub max_tokens: usize,
    /// ... and so does one whose prompt is more than `max_ratio` times its output limit (a
    /// short answer to a long prompt gains little from staying on the decode worker).
    pub max_ratio: f64,
    /// Local only while the prefill pool's estimated wait is at least this (0: always).
    pub min_prefill_wait: Duration,
    /// Local only while the decode worker keeps this fraction of its KV blocks free.
    pub min_free_kv: f64,
}

/// Where one prompt is prefilled, and why (the `reason` label and span attribute).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Local(&'static str),
    Remote(&'static str),
}

impl Place {
    pub fn is_local(self) -> bool {
        matches!(self, Place::Local(_))
    }

    pub fn reason(self) -> &'static str {
        match self {
            Place::Local(r) | Place::Remote(r) => r,
        }
    }

    pub fn where_label(self) -> &'static str {
        if self.is_local() {
            "local"
        } else {
            "remote"
        }
    }
}

/// The conditional rule: local only when the prompt is short (absolute and ratio), the
/// prefill pool is busy, and the decode worker has KV headroom.
pub fn place(
    rule: &LocalRule,
    tokens: usize,
    max_tokens: usize,
    prefill_wait: Option<Duration>,
    free_kv: f64,
) -> Place {
    let Some(wait) = prefill_wait else { return Place::Local("no_prefill_worker") };
    if tokens > rule.max_tokens {
        return Place::Remote("long_prompt");
    }
    if tokens as f64 > rule.max_ratio * max_tokens.max(1) as f64 {
        return Place::Remote("prompt_output_ratio");
    }
    if wait < rule.min_prefill_wait {
        return Place::Remote("prefill_pool_free");
    }
    if free_kv < rule.min_free_kv {
        return Place::Remote("decode_kv_low");
    }
    Place::Local("short_prompt_prefill_busy")
}

#[cfg(test)]
mod tests;
