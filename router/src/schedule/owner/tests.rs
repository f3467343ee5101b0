//! The owner task's event handling replayed without the task: each test applies events at
//! chosen instants and feeds back what tickets and waiters sent, as the task's loop would.
//! No clock is read for the rules and nothing sleeps.

use std::time::Instant;

use pd_telemetry::metrics::Metrics;

use super::*;
use crate::schedule::{ScheduleConfig, Scheduler};
use crate::workers::{Pool, Pools};

use crate::schedule::state::tests::{class, classes};

fn interactive() -> Arc<Class> {
    class("interactive")
}

/// A 32-token prompt (two blocks of 16), distinct per `salt`.
fn prompt(salt: u32) -> Arc<Prompt> {
    crate::schedule::state::tests::prompt(32, salt)
}

/// One decode worker with room for `batch` sequences, one prefill worker.
fn loads(batch: u32) -> Event {
    let decode = pb::DecodeLoad {
        free_blocks: 1000,
        total_blocks: 1000,
        block_size: 16,
        max_batch: batch,
        ..Default::default()
    };
    let prefill = pb::PrefillLoad { max_partial_prefills: 4, prefill_tokens_per_s: 10_000.0, ..Default::default() };
    Event::Refreshed { decode: vec![("d0".into(), decode)], prefill: vec![("p0".into(), prefill)] }
}

/// An owner as `Scheduler::new` makes one, and the channel its tickets send on.
fn owner() -> (Owner, mpsc::UnboundedSender<Event>, mpsc::UnboundedReceiver<Event>) {
    let state = State::new(&classes(), ScheduleConfig::default(), true);
    let (events, inbox) = mpsc::unbounded_channel();
    let metrics = RouterMetrics::register(&Metrics::new());
    (Owner::new(state, classes(), metrics, events.downgrade()), events, inbox)
}

/// What a client holds after submitting: its admission answer and its grant.
struct Waiter {
    admitted: oneshot::Receiver<Result<Admitted, RouterError>>,
    grant: oneshot::Receiver<Grant>,
}

fn submit(salt: u32) -> (Event, Waiter) {
    let (admitted_tx, admitted) = oneshot::channel();
    let (reply, grant) = oneshot::channel();
    let event = Event::Submit {
        class: interactive(),
        prompt: prompt(salt),
        max_tokens: 16,
        migrated: false,
        admitted: admitted_tx,
        reply,
    };
    (event, Waiter { admitted, grant })
}

/// Applies the events tickets and waiters sent since the last call, as one batch at `now`.
fn pump(owner: &mut Owner, inbox: &mut mpsc::UnboundedReceiver<Event>, now: Instant) -> usize {
    let mut n = 0;
    while let Ok(event) = inbox.try_recv() {
        owner.apply(event, now);
        n += 1;
    }
    owner.end_batch(now);
    n
}

fn queued(owner: &Owner) -> usize {
    owner.state.queued_per_class()[interactive().index]
}

#[test]
fn grants_go_to_their_waiters_and_a_dropped_ticket_lets_the_next_one_go() {
    let t0 = Instant::now();
    let (mut o, _handle, mut inbox) = owner();
    o.apply(loads(2), t0);
    let mut waiters: Vec<Waiter> = (0..3)
        .map(|salt| {
            let (event, waiter) = submit(salt);
            o.apply(event, t0);
            waiter
        })
        .collect();
    o.end_batch(t0);
    for w in &mut waiters {
        assert!(matches!(w.admitted.try_recv(), Ok(Ok(_))), "admitted");
    }
    let first = waiters[0].grant.try_recv().expect("granted");
    let _second = waiters[1].grant.try_recv().expect("two batch slots");
    assert!(waiters[2].grant.try_recv().is_err(), "the third waits");
    assert_eq!(queued(&o), 1);
    let mut ticket = first.ticket;
    ticket.decode_opened();
    ticket.prefill_done();
    drop(ticket);
    assert_eq!(pump(&mut o, &mut inbox, t0), 3, "opened, prefilled, released: three events");
    assert!(waiters[2].grant.try_recv().is_ok(), "granted once a stream ended");
    assert_eq!(queued(&o), 0);
}

#[test]
fn a_waiter_gone_before_its_admission_answer_is_not_kept_in_the_queue() {
    let t0 = Instant::now();
    let (mut o, _handle, _inbox) = owner();
    o.apply(loads(1), t0);
    let (event, running) = submit(1);
    o.apply(event, t0);
    let (event, gone) = submit(2);
    drop(gone);
    o.apply(event, t0);
    o.end_batch(t0);
    assert_eq!(queued(&o), 0, "the second request left before it was answered");
    drop(running);
}

#[test]
fn a_grant_whose_waiter_left_gives_its_booking_back_to_the_next_request() {
    let t0 = Instant::now();
    let (mut o, _handle, mut inbox) = owner();
    o.apply(loads(1), t0);
    let (event, mut first) = submit(1);
    o.apply(event, t0);
    o.end_batch(t0);
    let (event, mut left) = submit(2);
    o.apply(event, t0);
    let (event, mut next) = submit(3);
    o.apply(event, t0);
    o.end_batch(t0);
    assert!(left.admitted.try_recv().is_ok() && next.admitted.try_recv().is_ok());
    drop(left.grant);
    // The first stream ends: `left` is granted, finds its waiter gone, and gives the slot back.
    drop(first.grant.try_recv().expect("granted"));
    pump(&mut o, &mut inbox, t0);
    assert!(next.grant.try_recv().is_ok(), "the slot went on to the next request");
    assert_eq!(queued(&o), 0);
}

#[test]
fn a_submission_sees_the_grants_that_the_events_before_it_allowed() {
    let t0 = Instant::now();
    let (mut o, handle, _inbox) = owner();
    o.apply(loads(1), t0);
    let (event, mut a) = submit(1);
    o.apply(event, t0);
    let (event, mut b) = submit(2);
    o.apply(event, t0);
    o.end_batch(t0);
    let ticket = a.grant.try_recv().expect("granted").ticket;
    // One batch: a's stream ends, then c arrives, then a question about the queue.
    drop(ticket);
    o.apply(Event::Release(1), t0);
    let (event, mut c) = submit(3);
    o.apply(event, t0);
    assert!(b.grant.try_recv().is_ok(), "b was granted before c's admission was decided");
    assert!(c.admitted.try_recv().is_ok());
    let (tx, mut answer) = oneshot::channel();
    o.apply(
        Event::Ask(Box::new(move |s: &State<Reply>| {
            let _ = tx.send(s.queued_per_class()[interactive().index]);
        })),
        t0,
    );
    assert_eq!(answer.try_recv(), Ok(1), "c waits");
    drop(handle);
}

#[tokio::test]
async fn through_the_handle_a_refusal_an_admission_and_a_withdrawal() {
    let pools =
        Arc::new(Pools { decode: Pool::new("decode", vec![], None), prefill: Pool::new("prefill", vec![], None) });
    let metrics = RouterMetrics::register(&Metrics::new());
    let scheduler = Scheduler::new(classes(), ScheduleConfig::default(), pools, metrics);
    let class = interactive();
    let refused = scheduler.submit(&class, prompt(1), 16).granted().await;
    assert!(matches!(refused, Err(RouterError::NoWorker("decode"))), "no decode worker yet: {refused:?}");
    assert!(!scheduler.ready().await);
    let Event::Refreshed { decode, .. } = loads(1) else { unreachable!() };
    scheduler.refreshed(decode, vec![]);
    assert!(scheduler.ready().await, "a decode worker, and no prefill pool configured");
    let grant = scheduler.submit(&class, prompt(2), 16).granted().await.expect("granted");
    assert_eq!(grant.placement.decode, "d0");
    // A second request waits for the only slot; its client leaves.
    let waiting = scheduler.submit(&class, prompt(3), 16);
    let queued = |s: &Arc<Scheduler>| {
        let s = s.clone();
        async move { s.ask(|st| st.queued_per_class()[interactive().index]).await }
    };
    tokio::task::yield_now().await;
    drop(waiting);
    assert_eq!(queued(&scheduler).await, 0, "withdrawn: the waiter left before its answer was read");
    let third = scheduler.submit(&class, prompt(4), 16);
    let third = tokio::spawn(third.granted());
    assert_eq!(queued(&scheduler).await, 1);
    drop(grant);
    let granted = tokio::time::timeout(std::time::Duration::from_secs(5), third).await;
    assert!(matches!(granted, Ok(Ok(Ok(_)))), "granted once the first stream ended");
}

#[test]
fn the_indexed_blocks_gauge_follows_each_workers_cache_and_drops_a_worker_that_left() {
    let t0 = Instant::now();
    let (mut o, _handle, _inbox) = owner();
    let decode = |hashes: Vec<u64>| pb::DecodeLoad {
        free_blocks: 1000,
        total_blocks: 1000,
        block_size: 16,
        max_batch: 4,
        cache: Some(pb::CacheEvents {
            instance: 7,
            hash_seed: 1,
            block_size: 16,
            last_seq: hashes.len() as u64,
            snapshot: true,
            snapshot_hashes: hashes,
            events: vec![],
        }),
        ..Default::default()
    };
    let gauge = |o: &Owner, worker: &str| o.metrics.indexed_blocks.get_metric_with_label_values(&["decode", worker]);
    let both = vec![("d0".to_string(), decode(vec![1, 2, 3])), ("d1".to_string(), decode(vec![4]))];
    o.apply(Event::Refreshed { decode: both, prefill: vec![] }, t0);
    assert_eq!(gauge(&o, "d0").map(|g| g.get()).ok(), Some(3.0));
    assert_eq!(gauge(&o, "d1").map(|g| g.get()).ok(), Some(1.0));
    // d1 stopped answering: its series goes rather than freezing at its last value.
    o.apply(Event::Refreshed { decode: vec![("d0".to_string(), decode(vec![1]))], prefill: vec![] }, t0);
    assert_eq!(gauge(&o, "d0").map(|g| g.get()).ok(), Some(1.0));
    assert!(o.metrics.indexed_blocks.remove_label_values(&["decode", "d1"]).is_err(), "d1's series was removed");
}
