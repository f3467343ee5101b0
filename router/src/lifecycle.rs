//! One request through the cluster (docs/design.md's lifecycle), as stages: the scheduler's queue
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
//! start, half a UTF-8 character) is not recovered. A request for `n` answers shares one leg
//! until its worker is lost; then each unfinished answer continues on a leg of its own
//! (its prompt plus its own tokens, its own seed), and the answers already ended stay ended.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::Stream;
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

/// Decode workers a leg may find unavailable as it opens (shutting down in a rolling update,
/// or unreachable) before it fails: each is quarantined and the leg is granted another.
const OPEN_TRIES: u32 = 3;

/// Why a leg did not open; `unavailable` names a decode worker that answered UNAVAILABLE
/// before its stream began (no token sent, no prefill started), so another may take the leg.
struct OpenFailed {
    error: RouterError,
    unavailable: Option<String>,
}

impl From<RouterError> for OpenFailed {
    fn from(error: RouterError) -> Self {
        OpenFailed { error, unavailable: None }
    }
}

impl OpenFailed {
    /// The decode worker to pass over before the next try, while tries are left
    /// (`tried` so far); logged.
    fn retry_elsewhere(&self, tried: u32, request_id: &str) -> Option<&str> {
        let addr = self.unavailable.as_deref().filter(|_| tried < OPEN_TRIES)?;
        tracing::warn!(request_id, decode_worker = addr, error = %self.error, "decode worker unavailable as the stream opened: trying another");
        Some(addr)
    }
}

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
    transfer: &str,
) -> Result<Opened, OpenFailed> {
    let prefill_here = route.prefill.is_none();
    let request = pb::DecodeRequest {
        request_id: transfer.to_owned(),
        prompt_tokens: req.prompt_tokens.clone(),
        sampling: Some(sampling_to_pb(&req.params)),
        lease_ms: 0,
        prefill_here,
        n: req.n as u32,
        output_offset: req.params.output_offset as u32,
    };
    let call = route.decode.client.generate(traced(request, record.span().context(), record.class()));
    let refused = |status: tonic::Status| {
        let unavailable = (status.code() == tonic::Code::Unavailable).then(|| route.decode.addr.clone());
        OpenFailed { error: decode_error(status), unavailable }
    };
    let mut events = match call.await {
        Ok(r) => r.into_inner(),
        Err(status) => {
            pools.decode.forget(&route.decode.addr);
            return Err(refused(status));
        }
    };
    if prefill_here {
        return Ok(Opened { events, target: None });
    }
    match events.message().await {
        Ok(Some(pb::DecodeEvent { event: Some(Event::Target(t)) })) => Ok(Opened { events, target: Some(t) }),
        Ok(_) => Err(RouterError::Worker { stage: "decode", message: "no KV target".into() }.into()),
        Err(status) => Err(refused(status)),
    }
}

/// The prefill call for a KV target; no attempt starts after the target's lease ends.
fn prefill_call(
    origin: &Origin,
    first: Option<crate::workers::Picked<pb::prefill_worker_client::PrefillWorkerClient<tonic::transport::Channel>>>,
    target: pb::KvTarget,
    req: &ValidRequest,
    record: &RequestRecord,
    transfer: &str,
) -> PrefillCall {
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let lease_left = Duration::from_millis(target.lease_deadline_unix_ms.saturating_sub(now_ms));
    PrefillCall {
        scheduler: origin.scheduler.clone(),
        first,
        request: pb::PrefillRequest {
            request_id: transfer.to_owned(),
            prompt_tokens: req.prompt_tokens.clone(),
            target: Some(target),
            sampling: Some(sampling_to_pb(&req.params)),
            output_offset: req.params.output_offset as u32,
        },
        deadline: Instant::now() + lease_left,
        cx: record.span().context().clone(),
        class: record.class().clone(),
        metrics: record.metrics().clone(),
        text: origin.text.clone(),
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
    let granted = scheduler.submit(class, prompt, req.params.max_tokens * req.n).granted().await;
    match &granted {
        Ok(g) => span.set("pd.queue.waited_ms", g.placement.waited.as_secs_f64() * 1e3),
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
/// the two, the capacity it holds, and which of the request's answers it carries.
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
    /// The request's answer index of each of this leg's answers (the leg's own index is the
    /// position here): 0 .. n for the first leg, one answer for a migrated leg.
    answers: Vec<u32>,
    /// Output tokens its answer sent before this leg (after migrations).
    offset: usize,
}

/// Which part of a request a leg carries.
struct Part {
    /// Leg-local answer index -> the request's answer index.
    answers: Vec<u32>,
    /// Tokens each of its answers had sent before this leg.
    offset: usize,
    /// The leg's KV transfer id on the workers: the request id for its first leg, a
    /// suffixed one for each migrated leg (the answers of one request may continue on the
    /// same decode worker, each with a reservation of its own).
    transfer: String,
}

/// Routes a granted request (`req`: the leg's prompt and sampling) and opens its decode
/// stream and prefill.
async fn open_leg(
    origin: &Origin,
    req: &ValidRequest,
    record: &mut RequestRecord,
    grant: Grant,
    part: Part,
) -> Result<Leg, OpenFailed> {
    let metrics = record.metrics().clone();
    record.router_queue_ms.get_or_insert(grant.placement.waited.as_secs_f64() * 1e3);
    let mut chosen = route(&origin.scheduler.pools, grant, &metrics, record)?;
    let opening = Instant::now();
    let opened = open_decode(&origin.scheduler.pools, &mut chosen, req, record, &part.transfer).await?;
    record.decode_open_ms.get_or_insert(opening.elapsed().as_secs_f64() * 1e3);
    chosen.ticket.decode_opened();
    let decode = chosen.decode.addr.clone();
    let Route { prefill: first, ticket, .. } = chosen;
    let prefill = opened.target.map(|t| {
        let call = prefill_call(origin, first, t, req, record, &part.transfer);
        AbortOnDrop(tokio::spawn(call.run()))
    });
    let relay = Relay::new(prefill.is_some(), req.n);
    let Part { answers, offset, .. } = part;
    Ok(Leg { events: opened.events, prefill, relay, ticket, prefilled: false, decode, answers, offset })
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
        let mut tried = 0;
        loop {
            let grant = queue(&origin.scheduler, &origin.class, req, &record).await?;
            let part = Part { answers: (0..req.n as u32).collect(), offset: 0, transfer: record.request_id.clone() };
            tried += 1;
            match open_leg(&origin, req, &mut record, grant, part).await {
                Ok(leg) => return Ok(leg),
                Err(e) => match e.retry_elsewhere(tried, &record.request_id) {
                    Some(addr) => origin.scheduler.quarantine(addr, origin.scheduler.config.quarantine),
                    None => return Err(e.error),
                },
            }
        }
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
    let n = req.n.max(1);
    let task = RelayTask {
        legs: vec![leg],
        tx,
        last_word: last_word.clone(),
        record,
        origin,
        sent: vec![Vec::new(); n],
        completed: vec![None; n],
        cached_tokens: 0,
        migrations: 0,
        first_finish: None,
        turn: 0,
    };
    tokio::spawn(task.run());
    Ok(Updates::new(rx, last_word))
}

/// Feeds a request's legs through their `Relay`s to the client.
struct RelayTask {
    /// The legs still streaming: one, until a decode worker carrying several answers is
    /// lost; then each of its unfinished answers continues on a leg of its own.
    legs: Vec<Leg>,
    tx: mpsc::Sender<Result<Update, RouterError>>,
    /// The error to end the client's stream with when it cannot be queued on `tx`.
    last_word: LastWord,
    record: RequestRecord,
    origin: Origin,
    /// Per answer: the token ids sent to the client so far (a migrated leg continues after
    /// them).
    sent: Vec<Vec<u32>>,
    /// Per answer: its completion tokens once it ended.
    completed: Vec<Option<u32>>,
    /// The largest prompt-cache hit a leg reported.
    cached_tokens: u32,
    migrations: u32,
    /// Answer 0's finish reason (the record's outcome).
    first_finish: Option<String>,
    /// The leg polled first next time (so one busy leg cannot starve the others).
    turn: usize,
}

/// What the relay loop waited for, and from which leg.
enum Next {
    Decode(usize, Result<Option<pb::DecodeEvent>, tonic::Status>),
    Prefill(usize, Result<Prefilled, RouterError>),
    ClientGone,
}

/// Why a decode stream counts as lost (the request migrates) rather than failed: it ended
/// without finishing, or broke with a transport-level or availability status. Refusals of
/// the request itself (invalid, out of capacity) are not.
fn lost(m: &Result<Option<pb::DecodeEvent>, tonic::Status>) -> Option<&'static str> {
    use tonic::Code;
    let [ended, unavailable, broken] = MIGRATION_REASONS;
    match m {
        Ok(None) => Some(ended),
        Err(s) => match s.code() {
            Code::Unavailable => Some(unavailable),
            Code::Unknown | Code::Internal | Code::Aborted | Code::Cancelled | Code::DataLoss => Some(broken),
            _ => None,
        },
        Ok(Some(_)) => None,
    }
}

/// The `reason` labels of `pd_migrations_total` (`lost`): the decode stream ended without
/// finishing, the worker became unreachable, or the stream broke.
pub const MIGRATION_REASONS: [&str; 3] = ["stream_ended", "unavailable", "stream_broken"];

/// A leg's update with the leg's answer index replaced by the request's, and a finished
/// answer's tokens counted from the request's start (`offset`: sent before this leg).
fn to_request(update: Update, answers: &[u32], offset: usize) -> Update {
    let global = |i: u32| answers.get(i as usize).copied().unwrap_or(i);
    match update {
        Update::Token { index, token_id, text, logprobs } => {
            Update::Token { index: global(index), token_id, text, logprobs }
        }
        Update::Finished { index, finish_reason, completion_tokens } => Update::Finished {
            index: global(index),
            finish_reason,
            completion_tokens: completion_tokens + offset as u32,
        },
        done @ Update::Done { .. } => done,
    }
}

impl RelayTask {
    /// The next event of any leg (each leg's prefill first, then its stream), or the client
    /// leaving.
    async fn next(&mut self) -> Next {
        let RelayTask { legs, tx, turn, .. } = self;
        let closed = tx.closed();
        tokio::pin!(closed);
        let count = legs.len().max(1);
        *turn = (*turn + 1) % count;
        let first = *turn;
        std::future::poll_fn(|cx| {
            for k in 0..legs.len() {
                let l = (first + k) % legs.len();
                let leg = &mut legs[l];
                if let Some(task) = leg.prefill.as_mut() {
                    if let Poll::Ready(p) = Pin::new(&mut task.0).poll(cx) {
                        leg.prefill = None;
                        let p = p.unwrap_or_else(|join| {
                            Err(RouterError::Worker { stage: "prefill", message: format!("prefill task: {join}") })
                        });
                        return Poll::Ready(Next::Prefill(l, p));
                    }
                }
                if let Poll::Ready(m) = Pin::new(&mut leg.events).poll_next(cx) {
                    return Poll::Ready(Next::Decode(l, m.transpose()));
                }
            }
            match closed.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Next::ClientGone),
                Poll::Pending => Poll::Pending,
            }
        })
        .await
    }

    /// Runs until every answer ended, the generation fails, or the client leaves (dropping
    /// the legs then cancels their decode streams).
    async fn run(mut self) {
        loop {
            if self.legs.is_empty() {
                let e =
                    RouterError::Worker { stage: "decode", message: "no decode stream is left for an answer".into() };
                let _ = self.tx.send(Err(e.clone())).await;
                self.record.fail(&e);
                return;
            }
            let next = self.next().await;
            let l = match &next {
                Next::Decode(l, _) | Next::Prefill(l, _) => *l,
                Next::ClientGone => return,
            };
            let leg = &mut self.legs[l];
            if !leg.prefilled && matches!(next, Next::Prefill(..) | Next::Decode(_, Ok(Some(_)))) {
                // The first token exists (or the prefill failed): the prefill slot is free.
                leg.prefilled = true;
                leg.ticket.prefill_done();
            }
            let relayed = match next {
                Next::ClientGone => return,
                Next::Prefill(_, Err(e)) => Relayed::Fail(e),
                Next::Prefill(_, Ok(p)) => {
                    self.record.prefill_worker = p.worker.clone();
                    self.record.prefilled(p.timings);
                    match self.legs[l].relay.on_prefill_done(p.first_token, p.first_text, p.first_logprobs) {
                        Some(update) => Relayed::Send(update),
                        None => Relayed::Skip,
                    }
                }
                Next::Decode(_, m) => match lost(&m) {
                    Some(reason) => {
                        let cause = match &m {
                            Err(status) => status.message().to_string(),
                            _ => "the stream ended without finishing".to_string(),
                        };
                        match self.migrate(l, reason, cause).await {
                            Ok(ended) => {
                                if !self.deliver_all(ended).await {
                                    return;
                                }
                                continue;
                            }
                            Err(e) => Relayed::Fail(e),
                        }
                    }
                    None => {
                        if let Ok(Some(pb::DecodeEvent { event: Some(Event::Finished(f)) })) = &m {
                            if self.legs[l].answers.get(f.index as usize) == Some(&0) {
                                self.record_decode(f);
                            }
                        }
                        self.legs[l].relay.on_decode_event(m)
                    }
                },
            };
            let updates = match relayed {
                Relayed::Skip => continue,
                Relayed::Send(update) => {
                    let leg = &self.legs[l];
                    vec![to_request(update, &leg.answers, leg.offset)]
                }
                Relayed::Finish(updates) => {
                    // This leg's answers all ended: its capacity goes back now.
                    let mut leg = self.legs.swap_remove(l);
                    self.await_prefill_record(&mut leg).await;
                    updates.into_iter().map(|u| to_request(u, &leg.answers, leg.offset)).collect()
                }
                Relayed::Fail(e) => {
                    let _ = self.tx.send(Err(e.clone())).await;
                    self.record.fail(&e);
                    return;
                }
            };
            if !self.deliver_all(updates).await {
                return;
            }
        }
    }

    /// Continues the answers of leg `l` on other decode workers after its worker was lost
    /// (`reason` for the metric, `cause` for the error): each unfinished answer as a leg of
    /// its own, its prompt followed by the tokens it sent, sampling with its own seed from
    /// the next output position on. Returns the ends of answers that had sent every token
    /// (only their end was lost).
    async fn migrate(&mut self, l: usize, reason: &'static str, cause: String) -> Result<Vec<Update>, RouterError> {
        let from = self.legs[l].decode.clone();
        let lost = format!("decode worker {from} was lost mid-stream ({cause})");
        if self.migrations >= MIGRATION_LIMIT {
            return Err(RouterError::Migration(format!("{lost}; the request already moved {MIGRATION_LIMIT} times")));
        }
        let scheduler = self.origin.scheduler.clone();
        scheduler.quarantine(&from, scheduler.config.quarantine);
        scheduler.pools.decode.forget(&from);
        // The lost leg goes first: its prefill is aborted, its capacity released.
        let leg = self.legs.swap_remove(l);
        let open: Vec<u32> = leg.answers.iter().copied().filter(|&i| self.completed[i as usize].is_none()).collect();
        drop(leg);
        let total = self.origin.req.params.max_tokens;
        let (mut ended, mut moving) = (Vec::new(), Vec::new());
        for i in open {
            let sent = self.sent[i as usize].len();
            if sent >= total {
                ended.push(Update::Finished {
                    index: i,
                    finish_reason: "length".into(),
                    completion_tokens: sent as u32,
                });
            } else {
                moving.push(i);
            }
        }
        if moving.is_empty() {
            return Ok(ended);
        }
        self.migrations += 1;
        self.record.metrics().migrations.with_label_values(&[reason]).inc();
        let sent: usize = moving.iter().map(|&i| self.sent[i as usize].len()).sum();
        self.record.span().event(
            "request.migrate",
            vec![
                KeyValue::new("pd.migrate.from", from.clone()),
                KeyValue::new("pd.migrate.reason", reason),
                KeyValue::new("pd.migrate.tokens_sent", sent as i64),
                KeyValue::new("pd.migrate.answers", moving.len() as i64),
            ],
        );
        tracing::warn!(request_id = %self.record.request_id, %from, reason, sent, answers = moving.len(), "migrating to another decode worker");
        let failed = |e: RouterError| RouterError::Migration(format!("{lost}; continuing elsewhere failed: {e}"));
        for i in moving {
            let sent = &self.sent[i as usize];
            let mut req = self.origin.req.clone();
            req.prompt_tokens.extend_from_slice(sent);
            req.params = self.origin.req.params.for_choice(i as usize);
            req.params.max_tokens = total - sent.len();
            req.params.output_offset = sent.len();
            req.n = 1;
            let offset = sent.len();
            let prompt = Arc::new(crate::schedule::Prompt::new(req.prompt_tokens.clone()));
            let mut tried = 0;
            let leg = loop {
                let pending = scheduler.submit_migrated(&self.origin.class, prompt.clone(), req.params.max_tokens);
                let grant = pending.granted().await.map_err(failed)?;
                let transfer = format!("{}-m{}a{i}", self.record.request_id, self.migrations);
                let part = Part { answers: vec![i], offset, transfer };
                tried += 1;
                match open_leg(&self.origin, &req, &mut self.record, grant, part).await {
                    Ok(leg) => break leg,
                    Err(e) => match e.retry_elsewhere(tried, &self.record.request_id) {
                        Some(addr) => scheduler.quarantine(addr, scheduler.config.quarantine),
                        None => return Err(failed(e.error)),
                    },
                }
            };
            self.legs.push(leg);
        }
        Ok(ended)
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

    /// Hands a leg's updates (in the request's answer indexes) to the client, and the end once
    /// every answer ended; false when the relay is over.
    async fn deliver_all(&mut self, updates: Vec<Update>) -> bool {
        for update in updates {
            match &update {
                Update::Token { index, token_id, text, .. } => {
                    if let Some(sent) = self.sent.get_mut(*index as usize) {
                        sent.push(*token_id);
                    }
                    self.record.token(text);
                }
                Update::Finished { index, finish_reason, completion_tokens } => {
                    if let Some(slot) = self.completed.get_mut(*index as usize) {
                        *slot = Some(*completion_tokens);
                    }
                    if *index == 0 {
                        self.first_finish = Some(finish_reason.clone());
                    }
                }
                Update::Done { cached_tokens, .. } => {
                    // The request's own end follows once every leg ended.
                    self.cached_tokens = self.cached_tokens.max(*cached_tokens);
                    continue;
                }
            }
            if !self.send(update).await {
                return false;
            }
        }
        if self.completed.iter().any(Option::is_none) {
            return true;
        }
        let prompt_tokens = self.origin.req.prompt_tokens.len() as u32;
        let done = Update::Done {
            prompt_tokens,
            completion_tokens: self.completed.iter().flatten().sum(),
            // A migrated leg's prompt holds the answer's earlier tokens: the hit counts the
            // request's prompt only.
            cached_tokens: self.cached_tokens.max(self.record.cached_tokens()).min(prompt_tokens),
        };
        let _ = self.tx.send(Ok(done)).await;
        let reason = self.first_finish.take().unwrap_or_default();
        self.record.finish(&reason);
        false
    }

    /// Queues one update for the client, ending the request when the client stopped reading.
    async fn send(&mut self, update: Update) -> bool {
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

    /// The prefill response normally arrives long before the last token; waits briefly for
    /// it so the record carries the prefill worker's timings.
    async fn await_prefill_record(&mut self, leg: &mut Leg) {
        if let Some(task) = leg.prefill.as_mut() {
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
