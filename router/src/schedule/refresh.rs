//! The periodic refresh: every interval, one concurrent round of `Load` calls to every
//! resolved worker address (names re-resolved each round, so pods come and go); a worker that
//! does not answer within the timeout leaves the fleet until it answers again. Each call asks
//! for the worker's prefix-cache events after the last one the router applied.

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

/// One round: reads every worker's load and hands it to the scheduler.
pub async fn refresh_once(scheduler: &Arc<Scheduler>) {
    let pools = scheduler.pools.clone();
    let (dc, pc) = scheduler.cursors();
    let (decode, prefill) = tokio::join!(poll_decode(&pools.decode, &dc), poll_prefill(&pools.prefill, &pc));
    scheduler.refreshed(decode, prefill);
}

/// Refreshes now, then every `config.refresh` until the scheduler is dropped.
pub async fn spawn_refresh(scheduler: &Arc<Scheduler>) {
    refresh_once(scheduler).await;
    let weak: Weak<Scheduler> = Arc::downgrade(scheduler);
    let every = scheduler.config.refresh;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(s) = weak.upgrade() else { return };
            refresh_once(&s).await;
        }
    });
}
