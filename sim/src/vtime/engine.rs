//! The event loop of a virtual-time run: a queue of timed events, each handled as the router
//! or the worker it concerns would handle it at that instant (`mod.rs` has the request's
//! life). Events at the same instant run in the order they were scheduled.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_router::error::RouterError;
use pd_router::schedule::state::{Placement, State};
use pd_router::schedule::{round_interval, Prompt};
use rustc_hash::FxHashMap;

use super::queue::Queue;
use super::slab::Slab;
use super::workers::{DecodeSeq, StepOutcome, VDecode, VPrefill};
use super::{Config, Outcome, Request, Totals, Traffic};

/// How far ahead the traffic's open-loop arrivals are read at a time.
const PULL: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// Read the traffic's arrivals for the next `PULL`.
    Pull,
    /// Every worker's `Load` reaches the router.
    Refresh,
    /// A request reaches the router.
    Arrive(u64),
    /// A grant reaches its decode worker, which reserves its blocks.
    Reserve(u64),
    /// The reservation's answer reaches the router.
    Opened(u64),
    /// The prompt reaches its prefill worker.
    PrefillArrive(u64),
    PrefillStep(u32, u64),
    /// The KV hand-off commits on the decode worker: first token, then the batch.
    Commit(u64),
    /// The prefill worker's answer reaches the router.
    PrefillDone(u64),
    DecodeStep(u32),
    /// The stream's end reaches the router.
    Release(u64),
}

/// A request from its sending to its end.
#[derive(Debug)]
struct Live {
    request: Request,
    sent: Duration,
    tokens: Vec<Duration>,
    /// The scheduler's sequence number once admitted (0 before).
    seq: u64,
    granted: bool,
    /// When it stalls if still queued (ns; in `Engine::stalls` until granted).
    stall_at: u64,
    decode: usize,
    prefill: Option<usize>,
}

struct Engine<'t, T: Traffic> {
    cfg: Config,
    traffic: &'t mut T,
    origin: Instant,
    now: Duration,
    /// (nanoseconds from the start, order of scheduling, event).
    events: Queue<Ev>,
    /// Queued requests by the time they stall: most are granted first, so they are kept
    /// apart from `events`, where they would pile up.
    stalls: BTreeSet<(u64, u64)>,
    scheduled: u64,
    state: State<u64>,
    decode: Vec<VDecode>,
    prefill: Vec<VPrefill>,
    /// Worker address -> position in its pool (`granted`, for every request).
    index: FxHashMap<String, usize>,
    live: Slab<Live>,
    more_traffic: bool,
    totals: Totals,
    scratch_tokens: Vec<StepOutcome>,
    scratch_done: Vec<(u64, usize)>,
    jitter: Option<SplitMix>,
}

/// A small deterministic generator (splitmix64) for the message-time jitter.
#[derive(Debug)]
struct SplitMix(u64);

impl SplitMix {
    fn unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Runs `traffic` against the fleet of `cfg` until every request has ended and the traffic
/// sends no more; outcomes go to `traffic.ended`.
pub fn run<T: Traffic>(cfg: Config, traffic: &mut T) -> Totals {
    let mut index = FxHashMap::default();
    for i in 0..cfg.decode {
        index.insert(decode_addr(i), i);
    }
    for i in 0..cfg.prefill {
        index.insert(prefill_addr(i), i);
    }
    let state = State::new(&cfg.classes, cfg.schedule.clone(), cfg.prefill > 0);
    let cfg_jitter = cfg.jitter;
    let mut e = Engine {
        decode: (0..cfg.decode).map(|_| VDecode::new(&cfg.cost)).collect(),
        prefill: (0..cfg.prefill).map(|_| VPrefill::default()).collect(),
        cfg,
        traffic,
        origin: Instant::now(),
        now: Duration::ZERO,
        events: Queue::new(),
        stalls: BTreeSet::new(),
        scheduled: 0,
        state,
        index,
        live: Slab::default(),
        more_traffic: true,
        totals: Totals::default(),
        scratch_tokens: Vec::new(),
        scratch_done: Vec::new(),
        jitter: cfg_jitter.map(SplitMix),
    };
    e.at(Duration::ZERO, Ev::Refresh);
    e.at(Duration::ZERO, Ev::Pull);
    loop {
        let next = e.events.next_at();
        let stall = e.stalls.first().copied().filter(|&(s, _)| next.is_none_or(|t| s < t));
        if let Some((t, id)) = stall {
            e.stalls.remove(&(t, id));
            e.now = Duration::from_nanos(t);
            e.totals.events += 1;
            e.stall(id);
        } else if let Some((t, ev)) = e.events.pop() {
            e.now = Duration::from_nanos(t);
            e.totals.events += 1;
            e.handle(ev);
        } else {
            break;
        }
    }
    let total = e.cfg.cost.worker.kv_blocks as usize;
    e.totals.held_blocks = e.decode.iter().map(|d| (total - d.free_blocks.min(total)) as u64).sum();
    e.totals
}

fn decode_addr(i: usize) -> String {
    format!("decode-{i}")
}

fn prefill_addr(i: usize) -> String {
    format!("prefill-{i}")
}

impl<T: Traffic> Engine<'_, T> {
    fn at(&mut self, t: Duration, ev: Ev) {
        self.scheduled += 1;
        self.events.push(Queue::<Ev>::key(t.as_nanos() as u64, self.scheduled), ev);
    }

    fn after(&mut self, d: Duration, ev: Ev) {
        self.at(self.now + d, ev);
    }

    /// The time a control message takes (a request, a grant's call, an answer): the hop, or
    /// with `jitter` set a time drawn uniformly between half and one and a half hops.
    /// Token delivery keeps the plain hop (jitter there would only blur the gaps).
    fn message(&mut self) -> Duration {
        match &mut self.jitter {
            None => self.cfg.hop,
            Some(rng) => self.cfg.hop.mul_f64(0.5 + rng.unit()),
        }
    }

    fn instant(&self) -> Instant {
        self.origin + self.now
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Pull => self.pull(),
            Ev::Refresh => self.refresh(),
            Ev::Arrive(id) => self.arrive(id),
            Ev::Reserve(id) => self.reserve(id),
            Ev::Opened(id) => self.opened(id),
            Ev::PrefillArrive(id) => self.prefill_arrive(id),
            Ev::PrefillStep(w, generation) => self.prefill_step(w as usize, generation),
            Ev::Commit(id) => self.commit(id),
            Ev::PrefillDone(id) => {
                if let Some(seq) = self.live.get(id).map(|l| l.seq) {
                    self.state.prefill_done(seq);
                    self.dispatch();
                }
            }
            Ev::DecodeStep(w) => self.decode_step(w as usize),
            Ev::Release(id) => self.release(id),
        }
    }

    fn send(&mut self, sendings: Vec<(Duration, Request)>) {
        for (t, request) in sendings {
            let t = t.max(self.now);
            self.totals.requests += 1;
            let tokens = Vec::with_capacity(request.max_tokens.min(4096));
            let live = Live { request, sent: t, tokens, seq: 0, granted: false, stall_at: 0, decode: 0, prefill: None };
            let id = self.live.insert(live);
            let hop = self.message();
            self.at(t + hop, Ev::Arrive(id));
        }
    }

    fn pull(&mut self) {
        let (sendings, more) = self.traffic.arrivals(self.now, self.now + PULL);
        self.more_traffic = more;
        self.send(sendings);
        if more {
            self.after(PULL, Ev::Pull);
        }
    }

    /// A refresh round: every worker's load as it is now; the next round after the router's
    /// interval for this many workers, while anything may still happen.
    fn refresh(&mut self) {
        self.totals.refreshes += 1;
        let cost = &self.cfg.cost;
        let decode = self.decode.iter().enumerate().map(|(i, d)| (decode_addr(i), d.load(cost))).collect();
        let step = &self.cfg.step;
        let prefill = self.prefill.iter().enumerate().map(|(i, p)| (prefill_addr(i), p.load(step))).collect();
        self.state.refreshed(decode, prefill, self.instant());
        self.dispatch();
        if self.more_traffic || !self.live.is_empty() {
            let s = &self.cfg.schedule;
            self.after(
                round_interval(s.refresh, self.cfg.decode + self.cfg.prefill, s.max_load_calls_per_s),
                Ev::Refresh,
            );
        }
    }

    fn arrive(&mut self, id: u64) {
        let Some(live) = self.live.get(id) else { return };
        let (class, prompt, max_tokens) =
            (live.request.class.clone(), live.request.prompt.clone(), live.request.max_tokens);
        let now = self.instant();
        let state = &mut self.state;
        let admitted = self.cfg.classes.assign(Some(class.as_bytes()), None).and_then(|class| {
            let prompt = Arc::new(Prompt::new(prompt.to_vec()));
            state.submit(&class, prompt, max_tokens, id, now)
        });
        match admitted {
            Ok(a) => {
                if let Some(l) = self.live.get_mut(id) {
                    l.seq = a.seq;
                }
                let at = (self.now + a.stall_after).as_nanos() as u64;
                self.stalls.insert((at, id));
                if let Some(l) = self.live.get_mut(id) {
                    l.stall_at = at;
                }
                self.dispatch();
            }
            Err(e) => self.fail(id, &e),
        }
    }

    /// Hands out what the scheduler grants now.
    fn dispatch(&mut self) {
        for (id, placement) in self.state.dispatch(self.instant()) {
            self.granted(id, &placement);
        }
    }

    fn granted(&mut self, id: u64, p: &Placement) {
        let decode = self.index.get(&p.decode).copied();
        let prefill = p.prefill.as_ref().and_then(|a| self.index.get(a).copied());
        self.totals.local_prefills += u64::from(prefill.is_none());
        let Some(live) = self.live.get_mut(id) else { return };
        self.stalls.remove(&(live.stall_at, id));
        live.granted = true;
        live.decode = decode.unwrap_or_default();
        live.prefill = prefill;
        let hop = self.message();
        self.after(hop, Ev::Reserve(id));
    }

    /// A queued request's stall time passed: it fails (503) if still waiting. One the queue
    /// no longer holds (dropped when the last decode worker left) fails as the router's waiter
    /// would see it, with no worker.
    fn stall(&mut self, id: u64) {
        let Some(live) = self.live.get(id) else { return };
        if live.granted {
            return;
        }
        let e = if self.state.withdraw(live.seq, self.instant()) {
            RouterError::QueueStalled(format!("request {id} waited its stall time in the queue"))
        } else {
            RouterError::NoWorker("decode")
        };
        self.fail(id, &e);
    }

    fn reserve(&mut self, id: u64) {
        let Some(live) = self.live.get(id) else { return };
        let (w, input, max_tokens, seq) = (live.decode, live.request.prompt.len(), live.request.max_tokens, live.seq);
        let local = live.prefill.is_none();
        let d = &mut self.decode[w];
        match d.reserve(&self.cfg.cost, input + max_tokens) {
            Err(message) => {
                self.state.release(seq, false, self.instant());
                self.dispatch();
                let e = RouterError::Worker { stage: "decode", message };
                self.fail(id, &e);
            }
            Ok(blocks) => {
                if local {
                    let q = DecodeSeq { id, blocks, prompt: input, prompt_left: input, generated: 0, max_tokens };
                    d.running.push(q);
                    self.kick_decode(w);
                } else {
                    // The blocks are the sequence's from its commit on (`commit`).
                    d.pending += 1;
                }
                let hop = self.message();
                self.after(hop, Ev::Opened(id));
            }
        }
    }

    fn opened(&mut self, id: u64) {
        let Some(live) = self.live.get(id) else { return };
        let (seq, remote) = (live.seq, live.prefill.is_some());
        self.state.decode_opened(seq);
        if remote {
            let hop = self.message();
            self.after(hop, Ev::PrefillArrive(id));
        }
    }

    fn prefill_arrive(&mut self, id: u64) {
        let Some(live) = self.live.get(id) else { return };
        let Some(w) = live.prefill else { return };
        let len = live.request.prompt.len();
        let busy = self.prefill[w].is_stepping();
        if self.prefill[w].submit(&self.cfg.step, id, len, self.now) {
            self.totals.preempted += u64::from(busy);
            self.start_prefill(w);
        }
    }

    fn start_prefill(&mut self, w: usize) {
        if let Some(took) = self.prefill[w].start_step(&self.cfg.cost, &self.cfg.step, self.now) {
            self.totals.prefill_steps += 1;
            let generation = self.prefill[w].generation;
            self.after(took, Ev::PrefillStep(w as u32, generation));
        }
    }

    fn prefill_step(&mut self, w: usize, generation: u64) {
        let mut done = std::mem::take(&mut self.scratch_done);
        if self.prefill[w].end_step(generation, self.now, &mut done) {
            for (id, len) in done.drain(..) {
                let commit = Duration::from_secs_f64(self.cfg.cost.kv_commit_ms(len) / 1e3);
                let hop = self.message();
                self.after(hop + commit, Ev::Commit(id));
            }
            self.start_prefill(w);
        }
        self.scratch_done = done;
    }

    fn commit(&mut self, id: u64) {
        let hop = self.cfg.hop;
        let Some(live) = self.live.get_mut(id) else { return };
        live.tokens.push(self.now + hop * 2);
        let (w, input, max_tokens) = (live.decode, live.request.prompt.len(), live.request.max_tokens);
        let blocks = self.cfg.cost.blocks_for(input + max_tokens);
        let d = &mut self.decode[w];
        d.pending = d.pending.saturating_sub(1);
        if max_tokens <= 1 {
            d.free_blocks += blocks;
            self.after(hop, Ev::Release(id));
        } else {
            d.running.push(DecodeSeq { id, blocks, prompt: input, prompt_left: 0, generated: 1, max_tokens });
            self.kick_decode(w);
        }
        self.after(hop, Ev::PrefillDone(id));
    }

    fn kick_decode(&mut self, w: usize) {
        if self.decode[w].is_stepping() {
            return;
        }
        if let Some(took) = self.decode[w].start_step(&self.cfg.cost) {
            self.totals.decode_steps += 1;
            self.totals.decode_rows += self.decode[w].running.len().min(self.cfg.cost.worker.max_batch as usize) as u64;
            self.after(took, Ev::DecodeStep(w as u32));
        }
    }

    fn decode_step(&mut self, w: usize) {
        let mut out = std::mem::take(&mut self.scratch_tokens);
        self.decode[w].end_step(&mut out);
        let hop = self.cfg.hop;
        for t in out.drain(..) {
            let StepOutcome::Token { id, finished } = t;
            if let Some(live) = self.live.get_mut(id) {
                live.tokens.push(self.now + hop * 2);
            }
            if finished {
                self.after(hop, Ev::Release(id));
            }
        }
        self.scratch_tokens = out;
        self.kick_decode(w);
    }

    /// The stream's end at the router: the bookings go back, the client sees the end.
    fn release(&mut self, id: u64) {
        let Some(live) = self.live.remove(id) else { return };
        self.state.release(live.seq, true, self.instant());
        self.dispatch();
        let outcome = Outcome {
            request: live.request,
            sent: live.sent,
            tokens: live.tokens,
            status: None,
            retry_after_s: None,
            error: None,
        };
        self.ended(outcome);
    }

    /// The request fails with `e` (its bookings, if any, already given back).
    fn fail(&mut self, id: u64, e: &RouterError) {
        let Some(live) = self.live.remove(id) else { return };
        let retry_after_s = match e {
            RouterError::Overloaded { retry_after_s, .. } => Some(*retry_after_s),
            _ => None,
        };
        let outcome = Outcome {
            request: live.request,
            sent: live.sent,
            tokens: live.tokens,
            status: Some(e.http_status().as_u16()),
            retry_after_s,
            error: Some(e.to_string()),
        };
        self.ended(outcome);
    }

    fn ended(&mut self, outcome: Outcome) {
        let seen = self.now + self.cfg.hop;
        self.totals.virtual_s = self.totals.virtual_s.max(seen.as_secs_f64());
        let next = self.traffic.ended(outcome, seen);
        self.send(next);
    }
}
