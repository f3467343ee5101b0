//! The one owner of the scheduler's state: a task that takes events from a channel (a request
//! submitted or withdrawn, a refresh, a decode reservation confirmed, a prefill done, a stream
//! released, a question about the fleet) and applies them in arrival order, as TGI's queue
//! task and Dynamo's KV scheduler own theirs. Nothing else touches `State`: tickets and
//! waiters send events and never lock, so a request's handler never waits for another's
//! scheduling work.
//!
//! The task reads the clock once per batch of events (the events that arrived together
//! happen at one instant) and dispatches once per batch, except that a submission or a
//! question first sees every grant the events before it made possible: admission and retry
//! choices read the state as it would be had each event been dispatched at once.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_proto::v1 as pb;
use pd_telemetry::metrics::RouterMetrics;
use tokio::sync::{mpsc, oneshot};

use super::prefixes::Prompt;
use super::state::{Admitted, State};
use super::{Grant, Reply, Ticket};
use crate::classes::{Class, Classes};
use crate::error::RouterError;

/// The most events applied before the next dispatch.
const BATCH: usize = 64;

/// A question answered from the state (`Scheduler::ask`).
pub(super) type Question = Box<dyn FnOnce(&State<Reply>) + Send>;

/// What changes the scheduler's state, or asks about it.
pub(super) enum Event {
    /// A new request (`migrated`: one whose decode worker was lost mid-stream, admitted
    /// once already). The admission answer goes to `admitted`, the grant later to `reply`.
    Submit {
        class: Arc<Class>,
        prompt: Arc<Prompt>,
        max_tokens: usize,
        migrated: bool,
        admitted: oneshot::Sender<Result<Admitted, RouterError>>,
        reply: Reply,
    },
    /// A waiting request's client left, or it stalled.
    Withdraw(u64),
    /// A decode worker lost a stream: passed over for this long.
    Quarantine {
        addr: String,
        how_long: Duration,
    },
    /// A refresh round's loads.
    Refreshed {
        decode: Vec<(String, pb::DecodeLoad)>,
        prefill: Vec<(String, pb::PrefillLoad)>,
    },
    /// The decode worker reserved request `seq`'s KV.
    DecodeOpened(u64),
    /// Request `seq`'s prompt is prefilled (or its prefill failed).
    PrefillDone(u64),
    /// Request `seq` gives back all it holds (its ticket was dropped).
    Release(u64),
    Ask(Question),
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("scheduler event")
    }
}

/// The owner task's state and what it needs to deliver grants.
pub(super) struct Owner {
    pub state: State<Reply>,
    pub classes: Classes,
    pub metrics: RouterMetrics,
    /// How tickets reach this task; weak, so the task ends when the scheduler and every
    /// ticket are gone.
    pub events: mpsc::WeakUnboundedSender<Event>,
    /// Events applied since the last dispatch could grant something.
    dirty: bool,
    /// The (pool, worker) series of `indexed_blocks` set at the last refresh, so that a
    /// worker that left has its series removed rather than frozen at its last value.
    indexed: HashSet<(&'static str, String)>,
}

impl Owner {
    pub fn new(
        state: State<Reply>,
        classes: Classes,
        metrics: RouterMetrics,
        events: mpsc::WeakUnboundedSender<Event>,
    ) -> Self {
        Owner { state, classes, metrics, events, dirty: false, indexed: HashSet::new() }
    }

    /// Applies events until every sender is gone.
    pub async fn run(mut self, mut inbox: mpsc::UnboundedReceiver<Event>) {
        let mut batch = Vec::with_capacity(BATCH);
        while inbox.recv_many(&mut batch, BATCH).await > 0 {
            let now = Instant::now();
            for event in batch.drain(..) {
                self.apply(event, now);
            }
            self.end_batch(now);
        }
    }

    /// After a batch of events: grants what now fits, and sets the queue gauges.
    pub fn end_batch(&mut self, now: Instant) {
        self.dispatch_if_dirty(now);
        self.count_queued();
    }

    /// Applies one event at `now`.
    pub fn apply(&mut self, event: Event, now: Instant) {
        match event {
            Event::Submit { class, prompt, max_tokens, migrated, admitted, reply } => {
                self.dispatch_if_dirty(now);
                let result = match migrated {
                    false => self.state.submit(&class, prompt, max_tokens, reply, now),
                    true => self.state.submit_migrated(&class, prompt, max_tokens, reply, now),
                };
                let seq = result.as_ref().ok().map(|a| a.seq);
                if admitted.send(result).is_err() {
                    // The waiter left before its answer: it is not kept waiting in the queue.
                    if let Some(seq) = seq {
                        self.state.withdraw(seq, now);
                    }
                } else {
                    self.dirty |= seq.is_some();
                }
            }
            // The request ahead that did not fit may have been this one.
            Event::Withdraw(seq) => self.dirty |= self.state.withdraw(seq, now),
            Event::Quarantine { addr, how_long } => self.state.quarantine(&addr, now + how_long, now),
            Event::Refreshed { decode, prefill } => {
                self.state.refreshed(decode, prefill, now);
                self.count_indexed();
                self.dirty = true;
            }
            Event::DecodeOpened(seq) => self.state.decode_opened(seq),
            Event::PrefillDone(seq) => {
                self.state.prefill_done(seq);
                self.dirty = true;
            }
            Event::Release(seq) => {
                self.state.release(seq, true, now);
                self.dirty = true;
            }
            Event::Ask(question) => {
                self.dispatch_if_dirty(now);
                question(&self.state);
            }
        }
    }

    /// Grants what fits and hands each grant to its waiter; a waiter that is gone (its client
    /// left while it waited) gives its booking back, which may let another request go.
    fn dispatch_if_dirty(&mut self, now: Instant) {
        if !std::mem::take(&mut self.dirty) {
            return;
        }
        loop {
            let mut gave_back = false;
            for (reply, placement) in self.state.dispatch(now) {
                let ticket = Ticket { events: self.events.upgrade(), seq: placement.seq };
                if let Err(mut grant) = reply.send(Grant { placement, ticket }) {
                    grant.ticket.events = None;
                    self.state.release(grant.ticket.seq, false, now);
                    gave_back = true;
                }
            }
            if !gave_back {
                break;
            }
        }
    }

    /// The prefix index's size per worker: what the router believes each worker's cache holds,
    /// to read beside the worker's own `pd_kv_cached_blocks`.
    fn count_indexed(&mut self) {
        let fleet = &self.state.fleet;
        let decode = fleet.decode().iter().map(|d| ("decode", &d.addr, d.prefixes.indexed_blocks()));
        let prefill = fleet.prefill().iter().map(|p| ("prefill", &p.addr, p.prefixes.indexed_blocks()));
        let mut now_set = HashSet::with_capacity(self.indexed.len());
        for (pool, addr, blocks) in decode.chain(prefill) {
            self.metrics.indexed_blocks.with_label_values(&[pool, addr.as_str()]).set(blocks as f64);
            now_set.insert((pool, addr.clone()));
        }
        for (pool, addr) in self.indexed.difference(&now_set) {
            let _ = self.metrics.indexed_blocks.remove_label_values(&[pool, addr.as_str()]);
        }
        self.indexed = now_set;
    }

    /// The queue-length gauges.
    fn count_queued(&self) {
        for (class, n) in self.classes.all().iter().zip(self.state.queued_per_class()) {
            self.metrics.queued.with_label_values(&[class.name.as_str()]).set(n as f64);
        }
    }
}

#[cfg(test)]
mod tests;
