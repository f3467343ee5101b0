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
//!
//! Migration: when the decode worker's stream breaks (the worker died, was partitioned away,
//! or stopped after its grace period) the request continues on another decode worker as a
//! new leg: prompt + the tokens already sent, `max_tokens` reduced, `output_offset` set so
//! seeded sampling draws exactly what the lost worker would have (randomness per output
//! position). The lost worker is quarantined (`--quarantine-ms`); after `MIGRATION_LIMIT`
//! migrations, or with no other decode worker, the request ends with a typed error. Token
//! ids are never repeated or skipped; text the lost worker held back (a possible stop-string
//! start, half a UTF-8 character) is not recovered.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pb::decode_event::Event;
use pd_engine::TextSide;
use pd_kv_transfer::convert::sampling_to_pb;
use pd_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::classes::Class;
use crate::error::RouterError;
use crate::prefill::{traced, PrefillCall, Prefilled};
use crate::record::{DecodeTimings, PrefillTimings, RequestRecord};
use crate::relay::{decode_error, Relay, Relayed, Update};
use crate::route::{route, Route};
use crate::schedule::{Grant, Scheduler, Ticket};
use crate::updates::LastWord;
use crate::validate::ValidRequest;
use crate::workers::Pools;
use pd_telemetry::opentelemetry::KeyValue;

pub use crate::updates::Updates;

/// Decode workers a request may lose before it fails.
pub const MIGRATION_LIMIT: u32 = 3;

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
        n: req.n as u32,
        output_offset: req.params.output_offset as u32,
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
            output_offset: req.params.output_offset as u32,
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
    // Every answer's output is booked; the prompt once.
    let granted = match scheduler.submit(class, prompt, req.params.max_tokens * req.n) {
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

/// What re-issuing a request elsewhere needs.
struct Origin {
    scheduler: Arc<Scheduler>,
    text: Arc<TextSide>,
    req: ValidRequest,
    class: Arc<Class>,
}

/// One decode worker's part of a request: its stream, the prefill feeding it, the merge of
/// the two, the capacity it holds.
struct Leg {
    events: tonic::Streaming<pb::DecodeEvent>,
    /// The prefill (None once answered, or when the decode worker prefills); aborted when
    /// the leg is dropped.
    prefill: Option<AbortOnDrop<Result<Prefilled, RouterError>>>,
    relay: Relay,
    /// The capacity this leg holds at the scheduler (all of it given back when the leg is
    /// dropped; the prefill slot as soon as the first token exists).
    ticket: Ticket,
    prefilled: bool,
    decode: String,
    /// Output tokens sent before this leg (after migrations).
    offset: usize,
}

/// Routes a granted request (`req`: the leg's prompt and sampling) and opens its decode
/// stream and prefill.
async fn open_leg(
    origin: &Origin,
    req: &ValidRequest,
    record: &mut RequestRecord,
    grant: Grant,
    offset: usize,
) -> Result<Leg, RouterError> {
    let metrics = record.metrics().clone();
    record.router_queue_ms.get_or_insert(grant.waited.as_secs_f64() * 1e3);
    let mut chosen = route(&origin.scheduler.pools, grant, &metrics, record)?;
    let opening = Instant::now();
    let opened = open_decode(&origin.scheduler.pools, &mut chosen, req, record).await?;
    record.decode_open_ms.get_or_insert(opening.elapsed().as_secs_f64() * 1e3);
    chosen.ticket.decode_opened();
    let decode = chosen.decode.addr.clone();
    let Route { prefill: first, ticket, .. } = chosen;
    let prefill = opened.target.map(|t| {
        let call = prefill_call(&origin.scheduler, &origin.text, first, t, req, record);
        AbortOnDrop(tokio::spawn(call.run()))
    });
    let relay = Relay::new(prefill.is_some(), req.n);
    Ok(Leg { events: opened.events, prefill, relay, ticket, prefilled: false, decode, offset })
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
    let origin = Origin { scheduler, text, req: req.clone(), class };
    let leg = async {
        let grant = queue(&origin.scheduler, &origin.class, req, &record).await?;
        open_leg(&origin, req, &mut record, grant, 0).await
    }
    .await;
    let leg = match leg {
        Ok(l) => l,
        Err(e) => {
            record.fail(&e);
            return Err(e);
        }
    };
    let (tx, rx) = mpsc::channel(64);
    let last_word = LastWord::default();
    let task = RelayTask {
        leg,
        tx,
        last_word: last_word.clone(),
        record,
        origin,
        sent: Vec::new(),
        migrations: 0,
        first_finish: None,
    };
    tokio::spawn(task.run());
    Ok(Updates::new(rx, last_word))
}

/// Feeds a request's legs through their `Relay` to the client.
struct RelayTask {
    leg: Leg,
    tx: mpsc::Sender<Result<Update, RouterError>>,
    /// The error to end the client's stream with when it cannot be queued on `tx`.
    last_word: LastWord,
    record: RequestRecord,
    origin: Origin,
    /// Answer 0's token ids sent to the client so far (a migrated leg continues after them).
    sent: Vec<u32>,
    migrations: u32,
    /// Answer 0's finish reason, when it ended before the others (the record's outcome).
    first_finish: Option<String>,
}

/// What the relay loop waited for.
enum Next {
    Decode(Result<Option<pb::DecodeEvent>, tonic::Status>),
    Prefill(Result<Prefilled, RouterError>),
    ClientGone,
}

/// Why a decode stream counts as lost (the request migrates) rather than failed: it ended
/// without finishing, or broke with a transport-level or availability status. Refusals of
/// the request itself (invalid, out of capacity) are not.
fn lost(m: &Result<Option<pb::DecodeEvent>, tonic::Status>) -> Option<&'static str> {
    use tonic::Code;
    match m {
        Ok(None) => Some("stream_ended"),
        Err(s) => match s.code() {
            Code::Unavailable => Some("unavailable"),
            Code::Unknown | Code::Internal | Code::Aborted | Code::Cancelled | Code::DataLoss => Some("stream_broken"),
            _ => None,
        },
        Ok(Some(_)) => None,
    }
}

impl RelayTask {
    async fn next(&mut self) -> Next {
        let Leg { events, prefill: task, .. } = &mut self.leg;
        let prefill = async {
            match task.as_mut() {
                Some(task) => (&mut task.0).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            m = events.message() => Next::Decode(m),
            p = prefill => {
                self.leg.prefill = None;
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
            if !self.leg.prefilled && matches!(next, Next::Prefill(_) | Next::Decode(Ok(Some(_)))) {
                // The first token exists (or the prefill failed): the prefill slot is free.
                self.leg.prefilled = true;
                self.leg.ticket.prefill_done();
            }
            let relayed = match next {
                Next::ClientGone => return,
                Next::Prefill(Err(e)) => Relayed::Fail(e),
                Next::Prefill(Ok(p)) => {
                    self.record.prefill_worker = p.worker.clone();
                    self.record.prefilled(p.timings);
                    match self.leg.relay.on_prefill_done(p.first_token, p.first_text, p.first_logprobs) {
                        Some(update) => Relayed::Send(update),
                        None => Relayed::Skip,
                    }
                }
                Next::Decode(m) => match lost(&m) {
                    Some(reason) => {
                        let cause = match &m {
                            Err(status) => status.message().to_string(),
                            _ => "the stream ended without finishing".to_string(),
                        };
                        match self.migrate(reason, cause).await {
                            Ok(None) => continue,
                            Ok(Some(relayed)) => relayed,
                            Err(e) => Relayed::Fail(e),
                        }
                    }
                    None => {
                        if let Ok(Some(pb::DecodeEvent { event: Some(Event::Finished(f)) })) = &m {
                            if f.index == 0 {
                                self.record_decode(f);
                            }
                        }
                        let mut relayed = self.leg.relay.on_decode_event(m);
                        if let Relayed::Finish(updates) = &mut relayed {
                            // A migrated leg's prompt includes the tokens sent before it
                            // (only one-answer requests migrate).
                            let offset = self.leg.offset as u32;
                            for u in updates {
                                match u {
                                    Update::Finished { completion_tokens, .. } => *completion_tokens += offset,
                                    Update::Done { prompt_tokens, completion_tokens, .. } => {
                                        *prompt_tokens = prompt_tokens.saturating_sub(offset);
                                        *completion_tokens += offset;
                                    }
                                    Update::Token { .. } => {}
                                }
                            }
                        }
                        relayed
                    }
                },
            };
            if !self.deliver(relayed).await {
                return;
            }
        }
    }

    /// Continues the request on another decode worker after its current one was lost
    /// (`reason` for the metric, `cause` for the error). None: the new leg runs; Some: what
    /// to tell the client instead (the end, when every token had already gone out).
    async fn migrate(&mut self, reason: &'static str, cause: String) -> Result<Option<Relayed>, RouterError> {
        let from = self.leg.decode.clone();
        let lost = format!("decode worker {from} was lost mid-stream ({cause})");
        if self.origin.req.n > 1 {
            // Its answers went different ways: each would need its own leg.
            return Err(RouterError::Migration(format!("{lost}; a request for several answers (n) does not move")));
        }
        if self.migrations >= MIGRATION_LIMIT {
            return Err(RouterError::Migration(format!("{lost}; the request already moved {MIGRATION_LIMIT} times")));
        }
        let scheduler = self.origin.scheduler.clone();
        scheduler.quarantine(&from, scheduler.config.quarantine);
        scheduler.pools.decode.forget(&from);
        let (sent, total) = (self.sent.len(), self.origin.req.params.max_tokens);
        if sent >= total {
            // Every token went out; only the end was lost.
            let end = Update::Finished { index: 0, finish_reason: "length".into(), completion_tokens: sent as u32 };
            let done = Update::Done {
                prompt_tokens: self.origin.req.prompt_tokens.len() as u32,
                completion_tokens: sent as u32,
                cached_tokens: self.record.cached_tokens(),
            };
            return Ok(Some(Relayed::Finish(vec![end, done])));
        }
        self.migrations += 1;
        self.record.metrics().migrations.with_label_values(&[reason]).inc();
        self.record.span().event(
            "request.migrate",
            vec![
                KeyValue::new("pd.migrate.from", from.clone()),
                KeyValue::new("pd.migrate.reason", reason),
                KeyValue::new("pd.migrate.tokens_sent", sent as i64),
            ],
        );
        tracing::warn!(request_id = %self.record.request_id, %from, reason, sent, "migrating to another decode worker");
        let mut req = self.origin.req.clone();
        req.prompt_tokens.extend_from_slice(&self.sent);
        req.params.max_tokens = total - sent;
        req.params.output_offset = sent;
        let failed = |e: RouterError| RouterError::Migration(format!("{lost}; continuing elsewhere failed: {e}"));
        let prompt = Arc::new(crate::schedule::Prompt::new(req.prompt_tokens.clone()));
        let pending = scheduler.submit_migrated(&self.origin.class, prompt, req.params.max_tokens).map_err(failed)?;
        let grant = pending.granted().await.map_err(failed)?;
        let leg = open_leg(&self.origin, &req, &mut self.record, grant, sent).await.map_err(failed)?;
        self.leg = leg; // the lost leg is dropped: its prefill aborted, its capacity released
        Ok(None)
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
                match &update {
                    Update::Token { index, token_id, text, .. } => {
                        if *index == 0 {
                            self.sent.push(*token_id);
                        }
                        self.record.token(text);
                    }
                    Update::Finished { index: 0, finish_reason, .. } => self.first_finish = Some(finish_reason.clone()),
                    _ => {}
                }
                let timeout = self.origin.scheduler.config.client_send_timeout;
                match tokio::time::timeout(timeout, self.tx.send(Ok(update))).await {
                    Ok(sent) => sent.is_ok(),
                    Err(_) => {
                        let e = RouterError::ClientTooSlow(format!(
                            "the client took no event for {} ms; the request was ended",
                            timeout.as_millis()
                        ));
                        tracing::warn!(request_id = %self.record.request_id, "{e}");
                        self.record.fail(&e);
                        self.last_word.set(e);
                        false
                    }
                }
            }
            Relayed::Finish(updates) => {
                self.await_prefill_record().await;
                let mut reason = self.first_finish.take().unwrap_or_default();
                for mut update in updates {
                    match &mut update {
                        Update::Done { cached_tokens, .. } => {
                            *cached_tokens = (*cached_tokens).max(self.record.cached_tokens())
                        }
                        Update::Finished { index: 0, finish_reason, .. } => reason = finish_reason.clone(),
                        _ => {}
                    }
                    let _ = self.tx.send(Ok(update)).await;
                }
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
        if let Some(task) = self.leg.prefill.as_mut() {
            if let Ok(Ok(Ok(p))) = tokio::time::timeout(Duration::from_millis(200), &mut task.0).await {
                self.record.prefill_worker = p.worker;
                self.record.prefilled(p.timings);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_or_unfinished_stream_is_lost_a_refusal_is_not() {
        let event = pb::DecodeEvent { event: Some(Event::Token(pb::TokenEvent::default())) };
        assert_eq!(lost(&Ok(Some(event))), None);
        assert_eq!(lost(&Ok(None)), Some("stream_ended"));
        assert_eq!(lost(&Err(tonic::Status::unavailable("shut down"))), Some("unavailable"));
        assert_eq!(lost(&Err(tonic::Status::unknown("h2 protocol error"))), Some("stream_broken"));
        assert_eq!(lost(&Err(tonic::Status::invalid_argument("max_tokens"))), None);
        assert_eq!(lost(&Err(tonic::Status::resource_exhausted("no blocks"))), None);
    }
}
