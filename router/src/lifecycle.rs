//! One request through the cluster (DESIGN.md's lifecycle), as stages: the scheduler's queue
//! (`schedule`: admitted or refused, then granted workers), `route` (the grant as clients),
//! `open_decode` (the decode worker reserves KV and opens the token stream; its
//! first message is the KV target), the prefill on a prefill worker with that target
//! (`prefill`, retried on another worker while the lease holds), and the relay (`relay`):
//! the prefill worker's first token goes to the client as soon as it exists, the decode
//! worker's stream continues from it. Worker calls carry the request's trace context and
//! class in gRPC metadata, so the workers' spans join the request's trace.
//!
//! The `RequestRecord` travels with the request and is finished where the request ends.
//! Dropping the returned stream (client gone) cancels both sides: the decode worker sees its
//! stream closed and frees the blocks; the prefill task is aborted.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pb::decode_event::Event;
use pd_engine::TextSide;
use pd_kv_transfer::convert::sampling_to_pb;
use pd_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;

use crate::classes::Class;
use crate::error::RouterError;
use crate::prefill::{traced, PrefillCall, Prefilled};
use crate::record::{DecodeTimings, PrefillTimings, RequestRecord};
use crate::relay::{decode_error, Relay, Relayed, Update};
use crate::route::{route, Route};
use crate::schedule::{Grant, Scheduler, Ticket};
use crate::validate::ValidRequest;
use crate::workers::Pools;

/// The stream of a request's updates, as the front ends read it.
pub type Updates = ReceiverStream<Result<Update, RouterError>>;

/// Aborts a task when dropped.
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The decode worker's stream, and its KV target when a prefill worker must fill it.
struct Opened {
    events: tonic::Streaming<pb::DecodeEvent>,
    target: Option<pb::KvTarget>,
}

/// Asks the decode worker of `route` to reserve KV (or to prefill here) and opens its stream.
async fn open_decode(
    pools: &Pools,
    route: &mut Route,
    req: &ValidRequest,
    record: &RequestRecord,
) -> Result<Opened, RouterError> {
    let prefill_here = route.prefill.is_none();
    let request = pb::DecodeRequest {
        request_id: record.request_id.clone(),
        prompt_tokens: req.prompt_tokens.clone(),
        sampling: Some(sampling_to_pb(&req.params)),
        lease_ms: 0,
        prefill_here,
    };
    let call = route.decode.client.generate(traced(request, record.span().context(), record.class()));
    let mut events = match call.await {
        Ok(r) => r.into_inner(),
        Err(status) => {
            pools.decode.forget(&route.decode.addr);
            return Err(decode_error(status));
        }
    };
    if prefill_here {
        return Ok(Opened { events, target: None });
    }
    match events.message().await {
        Ok(Some(pb::DecodeEvent { event: Some(Event::Target(t)) })) => Ok(Opened { events, target: Some(t) }),
        Ok(_) => Err(RouterError::Worker { stage: "decode", message: "no KV target".into() }),
        Err(status) => Err(decode_error(status)),
    }
}

/// The prefill call for a KV target; no attempt starts after the target's lease ends.
fn prefill_call(
    scheduler: &Arc<Scheduler>,
    text: &Arc<TextSide>,
    first: Option<crate::workers::Picked<pb::prefill_worker_client::PrefillWorkerClient<tonic::transport::Channel>>>,
    target: pb::KvTarget,
    req: &ValidRequest,
    record: &RequestRecord,
) -> PrefillCall {
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let lease_left = Duration::from_millis(target.lease_deadline_unix_ms.saturating_sub(now_ms));
    PrefillCall {
        scheduler: scheduler.clone(),
        first,
        request: pb::PrefillRequest {
            request_id: record.request_id.clone(),
            prompt_tokens: req.prompt_tokens.clone(),
            target: Some(target),
            sampling: Some(sampling_to_pb(&req.params)),
        },
        deadline: Instant::now() + lease_left,
        cx: record.span().context().clone(),
        class: record.class().clone(),
        metrics: record.metrics().clone(),
        text: text.clone(),
        params: req.params.clone(),
    }
}

/// Waits in the scheduler's queue for a grant (the `router.queue` span), or is refused.
async fn queue(
    scheduler: &Arc<Scheduler>,
    class: &Arc<Class>,
    req: &ValidRequest,
    record: &RequestRecord,
) -> Result<Grant, RouterError> {
    let span = pd_telemetry::StageSpan::start("router.queue", record.span().context());
    span.set("pd.class", class.name.clone());
    let prompt = Arc::new(crate::schedule::Prompt::new(req.prompt_tokens.clone()));
    let granted = match scheduler.submit(class, prompt, req.params.max_tokens) {
        Ok(pending) => pending.granted().await,
        Err(e) => Err(e),
    };
    match &granted {
        Ok(g) => span.set("pd.queue.waited_ms", g.waited.as_secs_f64() * 1e3),
        Err(e) => span.error(e.to_string()),
    }
    span.end();
    granted
}

/// Starts `req` of `class` and returns its updates. Errors before the stream opens (refusal,
/// no worker, the decode worker's reservation) come back directly.
pub async fn start(
    scheduler: Arc<Scheduler>,
    text: Arc<TextSide>,
    req: &ValidRequest,
    class: Arc<Class>,
    mut record: RequestRecord,
) -> Result<Updates, RouterError> {
    let opened = async {
        let grant = queue(&scheduler, &class, req, &record).await?;
        let metrics = record.metrics().clone();
        let mut chosen = route(&scheduler.pools, grant, &metrics, &mut record)?;
        let opened = open_decode(&scheduler.pools, &mut chosen, req, &record).await?;
        chosen.ticket.decode_opened();
        Ok::<_, RouterError>((chosen, opened))
    }
    .await;
    let (chosen, Opened { events, target }) = match opened {
        Ok(o) => o,
        Err(e) => {
            record.fail(&e);
            return Err(e);
        }
    };
    let Route { prefill: first, ticket, .. } = chosen;
    let prefill = target.map(|t| {
        let call = prefill_call(&scheduler, &text, first, t, req, &record);
        AbortOnDrop(tokio::spawn(call.run()))
    });
    let (tx, rx) = mpsc::channel(64);
    let relay = Relay::new(prefill.is_some());
    tokio::spawn(RelayTask { events, prefill, tx, record, relay, ticket, prefilled: false }.run());
    Ok(ReceiverStream::new(rx))
}

/// Feeds both sources of one request through its `Relay` to the client.
struct RelayTask {
    events: tonic::Streaming<pb::DecodeEvent>,
    /// The prefill (None once answered, or when the decode worker prefills); aborted when
    /// the relay ends.
    prefill: Option<AbortOnDrop<Result<Prefilled, RouterError>>>,
    tx: mpsc::Sender<Result<Update, RouterError>>,
    record: RequestRecord,
    relay: Relay,
    /// The capacity this request holds at the scheduler (all of it given back when the relay
    /// ends; the prefill slot as soon as the first token exists).
    ticket: Ticket,
    prefilled: bool,
}

/// What the relay loop waited for.
enum Next {
    Decode(Result<Option<pb::DecodeEvent>, tonic::Status>),
    Prefill(Result<Prefilled, RouterError>),
    ClientGone,
}

impl RelayTask {
    async fn next(&mut self) -> Next {
        let prefill = async {
            match self.prefill.as_mut() {
                Some(task) => (&mut task.0).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            m = self.events.message() => Next::Decode(m),
            p = prefill => {
                self.prefill = None;
                Next::Prefill(p.unwrap_or_else(|join| Err(RouterError::Worker { stage: "prefill", message: format!("prefill task: {join}") })))
            }
            _ = self.tx.closed() => Next::ClientGone,
        }
    }

    /// Runs until the generation ends, fails, or the client leaves (dropping `events` then
    /// cancels the decode stream).
    async fn run(mut self) {
        loop {
            let next = self.next().await;
            if !self.prefilled && matches!(next, Next::Prefill(_) | Next::Decode(Ok(Some(_)))) {
                // The first token exists (or the prefill failed): the prefill slot is free.
                self.prefilled = true;
                self.ticket.prefill_done();
            }
            let relayed = match next {
                Next::ClientGone => return,
                Next::Prefill(Err(e)) => Relayed::Fail(e),
                Next::Prefill(Ok(p)) => {
                    self.record.prefill_worker = p.worker.clone();
                    self.record.prefilled(p.timings);
                    match self.relay.on_prefill_done(p.first_token, p.first_text) {
                        Some(update) => Relayed::Send(update),
                        None => Relayed::Skip,
                    }
                }
                Next::Decode(m) => {
                    if let Ok(Some(pb::DecodeEvent { event: Some(Event::Finished(f)) })) = &m {
                        self.record_decode(f);
                    }
                    self.relay.on_decode_event(m)
                }
            };
            if !self.deliver(relayed).await {
                return;
            }
        }
    }

    /// The decode worker's timings (and its prefill's, for a prompt prefilled there).
    fn record_decode(&mut self, f: &pb::Finished) {
        if f.prefill_ms > 0.0 {
            self.record.prefilled(PrefillTimings {
                queue_ms: f.queue_ms,
                prefill_ms: f.prefill_ms,
                kv_commit_ms: 0.0,
                cached_tokens: f.cached_tokens,
            });
        }
        self.record.decoded(DecodeTimings {
            kv_transfer_ms: f.kv_transfer_ms,
            decode_ms: f.decode_ms,
            kv_bytes: f.kv_bytes,
            cached_tokens: f.cached_tokens,
        });
    }

    /// Hands one outcome to the client; false when the relay is over.
    async fn deliver(&mut self, relayed: Relayed) -> bool {
        match relayed {
            Relayed::Skip => true,
            Relayed::Send(update) => {
                self.record.token();
                self.tx.send(Ok(update)).await.is_ok()
            }
            Relayed::Finish(mut update) => {
                self.await_prefill_record().await;
                if let Update::Done { cached_tokens, .. } = &mut update {
                    *cached_tokens = (*cached_tokens).max(self.record.cached_tokens());
                }
                let reason = match &update {
                    Update::Done { finish_reason, .. } => finish_reason.clone(),
                    Update::Token { .. } => String::new(),
                };
                let _ = self.tx.send(Ok(update)).await;
                self.record.finish(&reason);
                false
            }
            Relayed::Fail(e) => {
                let _ = self.tx.send(Err(e.clone())).await;
                self.record.fail(&e);
                false
            }
        }
    }

    /// The prefill response normally arrives long before the last token; waits briefly for
    /// it so the record carries the prefill worker's timings.
    async fn await_prefill_record(&mut self) {
        if let Some(task) = self.prefill.as_mut() {
            if let Ok(Ok(Ok(p))) = tokio::time::timeout(Duration::from_millis(200), &mut task.0).await {
                self.record.prefill_worker = p.worker;
                self.record.prefilled(p.timings);
            }
        }
    }
}
