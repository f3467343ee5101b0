//! The periodic refresh: every interval, one concurrent round of load queries to every
//! resolved worker address (names re-resolved each round, so pods come and go); a worker that
//! does not answer within the timeout leaves the fleet until it answers again. Each query asks
//! for the worker's prefix-cache events after the last one the router applied.
//!
//! Each worker is asked on one long-lived `LoadStream` kept open across rounds: a round costs a
//! message each way on it. A new gRPC call per round (`Load`) cost the router tens of
//! microseconds of CPU whatever it carried (HTTP/2 stream, headers, its own writes): 7-8% of
//! the router's core with 128 workers polled every 100 ms, and 1,000 workers took 39%
//! (bench/results/fleet). A worker that does not serve `LoadStream` (an older binary during a
//! rolling upgrade) is asked with `Load` as before. A stream that fails or misses a round's
//! timeout is dropped (no late answer can be read as the next round's) and reopened next round.
//!
//! Rounds are also spaced to keep within a budget of queries per second (`round_interval`);
//! between rounds the router's own bookings keep its view of its own work exact, and only
//! other routers' work and the workers' own measurements age.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::future::join_all;
use pb::decode_worker_client::DecodeWorkerClient;
use pb::prefill_worker_client::PrefillWorkerClient;
use pd_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Status, Streaming};

use super::Scheduler;
use crate::workers::Pool;

/// How long a load query may take before the worker counts as gone for this round.
const LOAD_TIMEOUT: Duration = Duration::from_millis(500);

/// Per worker address, the `Load` request that continues its cache events.
pub(super) type Cursors = HashMap<String, pb::LoadRequest>;

fn cursor(cursors: &Cursors, addr: &str) -> pb::LoadRequest {
    cursors.get(addr).copied().unwrap_or_default()
}

/// The two ways to ask one kind of worker for its load.
trait LoadClient {
    type Load: Send + 'static;
    fn connect(channel: Channel) -> Self;
    fn once(&mut self, request: pb::LoadRequest) -> impl Future<Output = Result<Self::Load, Status>> + Send;
    fn open(
        &mut self,
        requests: ReceiverStream<pb::LoadRequest>,
    ) -> impl Future<Output = Result<Streaming<Self::Load>, Status>> + Send;
}

impl LoadClient for DecodeWorkerClient<Channel> {
    type Load = pb::DecodeLoad;
    fn connect(channel: Channel) -> Self {
        DecodeWorkerClient::new(channel)
    }
    async fn once(&mut self, request: pb::LoadRequest) -> Result<pb::DecodeLoad, Status> {
        Ok(self.load(request).await?.into_inner())
    }
    async fn open(&mut self, requests: ReceiverStream<pb::LoadRequest>) -> Result<Streaming<pb::DecodeLoad>, Status> {
        Ok(self.load_stream(requests).await?.into_inner())
    }
}

impl LoadClient for PrefillWorkerClient<Channel> {
    type Load = pb::PrefillLoad;
    fn connect(channel: Channel) -> Self {
        PrefillWorkerClient::new(channel)
    }
    async fn once(&mut self, request: pb::LoadRequest) -> Result<pb::PrefillLoad, Status> {
        Ok(self.load(request).await?.into_inner())
    }
    async fn open(&mut self, requests: ReceiverStream<pb::LoadRequest>) -> Result<Streaming<pb::PrefillLoad>, Status> {
        Ok(self.load_stream(requests).await?.into_inner())
    }
}

/// How the router asks one worker.
enum Link<T> {
    /// Its open `LoadStream`: requests go on `requests`, answers come on `answers`.
    Stream { requests: mpsc::Sender<pb::LoadRequest>, answers: Box<Streaming<T>> },
    /// It does not serve `LoadStream`: one `Load` call per round.
    Unary,
}

/// Per worker address, how it is asked (kept from round to round by the refresh task).
pub struct Links<T> {
    links: HashMap<String, Link<T>>,
}

impl<T> Default for Links<T> {
    fn default() -> Self {
        Links { links: HashMap::new() }
    }
}

/// The next answer on an open stream, after sending `request`.
async fn ask_stream<T>(
    requests: &mpsc::Sender<pb::LoadRequest>,
    answers: &mut Streaming<T>,
    request: pb::LoadRequest,
) -> Result<T, Status> {
    requests.send(request).await.map_err(|_| Status::unavailable("load stream closed"))?;
    answers.message().await?.ok_or_else(|| Status::unavailable("load stream ended"))
}

/// Opens `LoadStream` with `request` as its first message and reads its answer; a worker that
/// does not serve it is asked with `Load` and remembered as such.
async fn open_stream<C: LoadClient>(
    client: &mut C,
    request: pb::LoadRequest,
) -> Result<(Link<C::Load>, C::Load), Status> {
    let (requests, rx) = mpsc::channel(1);
    let _ = requests.try_send(request);
    let opened = client.open(ReceiverStream::new(rx)).await;
    let mut answers = match opened {
        Ok(a) => a,
        Err(s) if s.code() == tonic::Code::Unimplemented => return Ok((Link::Unary, client.once(request).await?)),
        Err(s) => return Err(s),
    };
    match answers.message().await {
        Ok(Some(load)) => Ok((Link::Stream { requests, answers: Box::new(answers) }, load)),
        Ok(None) => Err(Status::unavailable("load stream ended")),
        Err(s) if s.code() == tonic::Code::Unimplemented => Ok((Link::Unary, client.once(request).await?)),
        Err(s) => Err(s),
    }
}

/// One worker's answer this round, and how to ask it next round (None: drop the link).
async fn ask<C: LoadClient>(
    pool: &Pool,
    addr: &str,
    link: Option<Link<C::Load>>,
    request: pb::LoadRequest,
) -> (Option<Link<C::Load>>, Option<C::Load>) {
    let connect = || pool.channel(addr).map(C::connect).map_err(|e| Status::unavailable(e.to_string()));
    let asked = async {
        match link {
            Some(Link::Stream { requests, mut answers }) => {
                let load = ask_stream(&requests, &mut answers, request).await?;
                Ok((Link::Stream { requests, answers }, load))
            }
            Some(Link::Unary) => connect()?.once(request).await.map(|load| (Link::Unary, load)),
            None => open_stream(&mut connect()?, request).await,
        }
    };
    match tokio::time::timeout(LOAD_TIMEOUT, asked).await {
        Ok(Ok((link, load))) => (Some(link), Some(load)),
        _ => {
            pool.forget(addr);
            (None, None)
        }
    }
}

/// Asks every worker of `pool` this round; links of workers no longer resolved are dropped.
async fn poll<C: LoadClient>(pool: &Pool, cursors: &Cursors, links: &mut Links<C::Load>) -> Vec<(String, C::Load)> {
    let mut previous = std::mem::take(&mut links.links);
    let calls = pool.endpoints().await.into_iter().map(|addr| {
        let link = previous.remove(&addr);
        let request = cursor(cursors, &addr);
        async move {
            let (link, load) = ask::<C>(pool, &addr, link, request).await;
            (addr, link, load)
        }
    });
    let mut out = Vec::new();
    for (addr, link, load) in join_all(calls).await {
        if let Some(l) = link {
            links.links.insert(addr.clone(), l);
        }
        if let Some(load) = load {
            out.push((addr, load));
        }
    }
    out
}

/// The refresh task's links to every worker.
#[derive(Default)]
pub struct Refresher {
    pub decode: Links<pb::DecodeLoad>,
    pub prefill: Links<pb::PrefillLoad>,
}

/// One round: reads every worker's load and hands it to the scheduler. Returns how many
/// workers were asked.
pub async fn refresh_once(scheduler: &Arc<Scheduler>, links: &mut Refresher) -> usize {
    let pools = scheduler.pools.clone();
    let (dc, pc) = scheduler.cursors().await;
    let asked = dc.len() + pc.len();
    let (decode, prefill) = tokio::join!(
        poll::<DecodeWorkerClient<Channel>>(&pools.decode, &dc, &mut links.decode),
        poll::<PrefillWorkerClient<Channel>>(&pools.prefill, &pc, &mut links.prefill)
    );
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
    let mut links = Refresher::default();
    let mut asked = refresh_once(scheduler, &mut links).await;
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
            asked = refresh_once(&s, &mut links).await;
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
