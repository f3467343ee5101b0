//! The periodic refresh: every interval, one concurrent round of `Load` calls to every
//! resolved worker address (names re-resolved each round, so pods come and go); a worker that
//! does not answer within the timeout leaves the fleet until it answers again. Each call asks
//! for the worker's prefix-cache events after the last one the router applied.
//!
//! A gRPC call costs the router tens of microseconds of CPU whatever it carries, so polling is
//! work per worker per interval: 1,000 workers every 100 ms took 39% of the router's core
//! (bench/results/fleet). Rounds are therefore spaced to keep within a budget of calls per
//! second (`round_interval`); between rounds the router's own bookings keep its view of its
//! own work exact, and only other routers' work and the workers' own measurements age.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::future::join_all;
use pb::decode_worker_client::DecodeWorkerClient;
use pb::prefill_worker_client::PrefillWorkerClient;
use pd_proto::v1 as pb;

use super::Scheduler;
use crate::workers::Pool;

/// How long a load query may take before the worker counts as gone for this round.
const LOAD_TIMEOUT: Duration = Duration::from_millis(500);

/// Per worker address, the `Load` request that continues its cache events.
pub(super) type Cursors = HashMap<String, pb::LoadRequest>;

fn cursor(cursors: &Cursors, addr: &str) -> pb::LoadRequest {
    cursors.get(addr).copied().unwrap_or_default()
}

async fn poll_decode(pool: &Pool, cursors: &Cursors) -> Vec<(String, pb::DecodeLoad)> {
    let calls = pool.endpoints().await.into_iter().map(|addr| async move {
        let mut client = DecodeWorkerClient::new(pool.channel(&addr).ok()?);
        match tokio::time::timeout(LOAD_TIMEOUT, client.load(cursor(cursors, &addr))).await {
            Ok(Ok(load)) => Some((addr, load.into_inner())),
            _ => {
                pool.forget(&addr);
                None
            }
        }
    });
    join_all(calls).await.into_iter().flatten().collect()
}

async fn poll_prefill(pool: &Pool, cursors: &Cursors) -> Vec<(String, pb::PrefillLoad)> {
    let calls = pool.endpoints().await.into_iter().map(|addr| async move {
        let mut client = PrefillWorkerClient::new(pool.channel(&addr).ok()?);
        match tokio::time::timeout(LOAD_TIMEOUT, client.load(cursor(cursors, &addr))).await {
            Ok(Ok(load)) => Some((addr, load.into_inner())),
            _ => {
                pool.forget(&addr);
                None
            }
        }
    });
    join_all(calls).await.into_iter().flatten().collect()
}

/// One round: reads every worker's load and hands it to the scheduler. Returns how many
/// workers were asked.
pub async fn refresh_once(scheduler: &Arc<Scheduler>) -> usize {
    let pools = scheduler.pools.clone();
    let (dc, pc) = scheduler.cursors().await;
    let asked = dc.len() + pc.len();
    let (decode, prefill) = tokio::join!(poll_decode(&pools.decode, &dc), poll_prefill(&pools.prefill, &pc));
    let asked = asked.max(decode.len() + prefill.len());
    scheduler.refreshed(decode, prefill);
    asked
}

/// The time from the start of one round to the next: `every`, or longer when `workers` calls
/// that often would pass `calls_per_s`.
pub fn round_interval(every: Duration, workers: usize, calls_per_s: u32) -> Duration {
    every.max(Duration::from_secs_f64(workers as f64 / f64::from(calls_per_s.max(1))))
}

/// Refreshes now, then each `round_interval` until the scheduler is dropped.
pub async fn spawn_refresh(scheduler: &Arc<Scheduler>) {
    let started = tokio::time::Instant::now();
    let mut asked = refresh_once(scheduler).await;
    let weak: Weak<Scheduler> = Arc::downgrade(scheduler);
    let (every, budget) = (scheduler.config.refresh, scheduler.config.max_load_calls_per_s);
    tokio::spawn(async move {
        let mut started = started;
        let mut spaced = false;
        loop {
            let interval = round_interval(every, asked, budget);
            if (interval > every) != spaced {
                spaced = interval > every;
                tracing::info!(
                    workers = asked,
                    interval_ms = interval.as_millis() as u64,
                    max_load_calls_per_s = budget,
                    "load refresh interval"
                );
            }
            // A round that took longer than the interval is followed at once.
            tokio::time::sleep_until(started + interval).await;
            started = tokio::time::Instant::now();
            let Some(s) = weak.upgrade() else { return };
            asked = refresh_once(&s).await;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_are_spaced_to_keep_within_the_call_budget() {
        let every = Duration::from_millis(100);
        assert_eq!(round_interval(every, 8, 2000), every);
        assert_eq!(round_interval(every, 200, 2000), every, "200 calls in 100 ms: exactly the budget");
        assert_eq!(round_interval(every, 1000, 2000), Duration::from_millis(500));
        assert_eq!(round_interval(every, 1000, 0), Duration::from_secs(1000), "a zero budget counts as one call/s");
    }
}
